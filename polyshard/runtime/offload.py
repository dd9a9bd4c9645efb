"""Host and disk offload (heterogeneous training): what does not fit on the device lives on the host or on disk.

- ``OffloadedOptimizer``: any torch optimizer whose state, master copies and step live on the host
  (``mode="host"``) or in files streamed through the step (``mode="disk"``, see ``disk_store``).
- ``offload_parameters``: blocks whose parameters stay on the host and reach the device only while
  the block runs (forward, and again for backward), the next block's fetched ahead.
- ``HostEmbedding`` / ``offload_embedding``: tables looked up on the host; only the rows move.
- ``DeviceLedger``: the bytes each place holds, so a CPU-only run shows what a GPU would hold.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from polyshard.errors import PolyshardError
from polyshard.optim.closure import closure_loss
from polyshard.runtime.disk_store import DiskStore, entry_bytes

HOST = torch.device("cpu")


@dataclass
class DeviceLedger:
    """Bytes resident per (place, category). Places: "device", "host", "disk". Categories: "params" and
    "grads" (the model's), "master" (the copies the optimizer updates), "state" (the optimizer's state)."""

    bytes: dict[tuple[str, str], int] = field(default_factory=dict)

    def add(self, place: str, category: str, nbytes: int) -> None:
        self.bytes[place, category] = self.bytes.get((place, category), 0) + nbytes

    def get(self, place: str, category: str | None = None) -> int:
        """Bytes of one category at ``place``, or of all of them when ``category`` is None."""
        return sum(n for (p, c), n in self.bytes.items() if p == place and (category is None or c == category))

    def __str__(self) -> str:
        return "\n".join(f"{place:<6} {category:<6} {n / 2**20:10.2f} MiB" for (place, category), n in sorted(self.bytes.items()))


class HostStore:
    """Entries kept in host memory: the host mode of OffloadedOptimizer."""

    place = "host"

    def __init__(self):
        self.entries: dict[int, dict] = {}

    def stream(self, indices: Iterable[int]) -> Iterator[tuple[int, dict | None]]:
        return ((i, self.entries.get(i)) for i in indices)

    def commit(self, step: int, entries: Iterable[tuple[int, dict]]) -> None:
        self.entries.update(entries)

    def tensor_bytes(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for entry in self.entries.values():
            for key, n in entry_bytes(entry).items():
                total[key] = total.get(key, 0) + n
        return total


class OffloadedOptimizer(torch.optim.Optimizer):
    """``optimizer_class(params, **optimizer_kwargs)`` with its state and step off the device.

    Each parameter has an entry on the host: a master copy (fp32, or the parameter's dtype when wider)
    and the optimizer's state for it. A step copies the gradient into the master, updates it with the
    wrapped optimizer, and copies it back to the parameter. ``mode="disk"`` keeps the entries in files
    under ``path`` and streams them through the step (``prefetch`` entries read ahead, a writer behind),
    so none stays in memory; ``resume=True`` continues from the last step committed there, setting the
    parameters from their masters. Parameters are updated one at a time, so the optimizer must update
    each from its own state only (all of torch.optim but LBFGS).
    """

    def __init__(self, params, optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW, *,
                 mode: str = "host", path: str | os.PathLike | None = None, prefetch: int = 2,
                 resume: bool = False, **optimizer_kwargs):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise PolyshardError(f"optimizer_class must be a torch.optim.Optimizer class, got {optimizer_class!r}")
        if issubclass(optimizer_class, torch.optim.LBFGS):
            raise PolyshardError("LBFGS updates all parameters from one shared history and cannot be offloaded; "
                                 "use AdamW, SGD or another per-parameter optimizer")
        if mode not in ("host", "disk"):
            raise PolyshardError(f"mode must be 'host' or 'disk', got {mode!r}")
        if mode == "host" and (path is not None or resume):
            raise PolyshardError("path and resume are for mode='disk'; host mode keeps the state in memory")
        if mode == "disk" and path is None:
            raise PolyshardError("mode='disk' needs path=, a directory for the optimizer's files")
        # Updates one master at a time: its param_groups[0] gets the group's settings and that parameter.
        self._inner = optimizer_class([torch.zeros(1, requires_grad=True)], **optimizer_kwargs)
        super().__init__(params, self._inner.defaults)
        self._store = HostStore() if mode == "host" else DiskStore(path, prefetch, resume)
        self.num_steps = 0
        if resume:
            self._resume()

    def _params(self) -> list[tuple[dict, torch.Tensor]]:
        return [(group, p) for group in self.param_groups for p in group["params"]]

    def _resume(self) -> None:
        """Sets the parameters from the masters of the committed step."""
        params = self._params()
        if any(i >= len(params) for i in self._store.files):
            raise PolyshardError(f"{self._store.path} holds state for {max(self._store.files) + 1} parameters; "
                                 f"this optimizer has {len(params)}")
        with torch.no_grad():
            for i, entry in self._store.stream(range(len(params))):
                p = params[i][1]
                if entry is not None:
                    if entry["master"].shape != p.shape:
                        raise PolyshardError(f"parameter {i} has shape {tuple(p.shape)}, its saved master "
                                             f"{tuple(entry['master'].shape)}: not the model this state was saved from")
                    p.copy_(entry["master"])
        self.num_steps = self._store.step

    @staticmethod
    def _master(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """A host copy of ``value`` for parameter ``p``: fp32, or ``p``'s dtype when wider."""
        return value.detach().to(HOST, torch.promote_types(p.dtype, torch.float32), copy=True)

    def _update(self, group: dict, p: torch.Tensor, entry: dict | None) -> dict:
        """One parameter's step, on its host master; the result is copied back to the parameter."""
        entry = entry or {"master": self._master(p, p), "state": {}}
        master, slot = entry["master"], self._inner.param_groups[0]
        master.grad = p.grad.to(HOST, master.dtype, copy=True)
        slot.update({k: v for k, v in group.items() if k != "params"}, params=[master])
        self._inner.state[master] = entry["state"]
        self._inner.step()
        entry["state"] = self._inner.state.pop(master)
        master.grad, slot["params"] = None, []
        p.copy_(master)
        return entry

    @torch.no_grad()
    def step(self, closure=None):
        """Updates every parameter that has a gradient, as the wrapped optimizer would."""
        loss = closure_loss(closure)
        params = self._params()
        todo = [i for i, (_, p) in enumerate(params) if p.grad is not None]
        self._store.commit(self.num_steps + 1,
                           ((i, self._update(*params[i], entry)) for i, entry in self._store.stream(todo)))
        self.num_steps += 1
        return loss

    def state_dict(self) -> dict:
        """torch's layout; each parameter's state also holds its ``master`` copy (reads every entry)."""
        packed = super().state_dict()
        entries = self._store.stream(range(len(self._params())))
        packed["state"] = {i: {**entry["state"], "master": entry["master"]} for i, entry in entries if entry}
        return packed

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a state dict of this class or of the wrapped torch optimizer (masters then come from the parameters)."""
        super().load_state_dict({**state_dict, "state": {}})
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = self._params()

        def entry(i: int) -> dict:
            saved, p = dict(state_dict["state"].get(saved_ids[i], {})), params[i][1]
            master = self._master(saved.pop("master", p), p)
            state = {k: v.detach().to(HOST, copy=True) if isinstance(v, torch.Tensor) else v for k, v in saved.items()}
            return {"master": master, "state": state}

        self._store.commit(self.num_steps, ((i, entry(i)) for i in range(len(params))))

    def ledger(self, on_host: Iterable[torch.Tensor] = ()) -> DeviceLedger:
        """Bytes per place: parameters and gradients on the device (on the host for those in ``on_host``,
        e.g. kept there by offload_parameters or a HostEmbedding); masters and state where the mode keeps them."""
        host_ids = {id(p) for p in on_host}
        ledger = DeviceLedger()
        for _, p in self._params():
            place = "host" if id(p) in host_ids else "device"
            ledger.add(place, "params", p.nbytes)
            if p.requires_grad:
                ledger.add(place, "grads", p.nbytes)
        for key, n in self._store.tensor_bytes().items():
            ledger.add(self._store.place, key, n)
        return ledger


def _device_of(args: tuple, kwargs: dict) -> torch.device:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    raise PolyshardError("an offloaded block needs a tensor input: its parameters go to that tensor's device")


@dataclass(frozen=True)
class _SavedParam:
    """A block parameter saved for backward, kept as a reference and fetched again when backward needs it."""

    block: int
    index: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class ParameterOffload:
    """Keeps ``blocks``' parameters on the host and gives each block device copies only while it runs.

    A block's forward pre-hook fetches its parameters (and the next ``prefetch`` blocks') to the device
    of its input and swaps the copies in; the copies are linked to the host parameters by autograd, so
    gradients land on them. Tensors that autograd saves from these copies are stored as references and
    fetched again for backward (a backward pre-hook fetches the block and the ``prefetch`` before it),
    so no copy outlives its block's forward or backward. Copies are made on the current stream: on
    CUDA the fetch is queued ahead of the compute but does not overlap it.
    """

    def __init__(self, module: nn.Module, blocks: Iterable[nn.Module], prefetch: int = 1):
        self.blocks, self.prefetch = list(blocks), prefetch
        if prefetch < 0:
            raise PolyshardError(f"prefetch must be 0 or more blocks, got {prefetch}")
        if not self.blocks:
            raise PolyshardError("offload_parameters needs at least one block")
        self.params = [list(block.parameters()) for block in self.blocks]
        self._check(module)
        positions = [{id(p): k for k, p in enumerate(params)} for params in self.params]
        self._slots = [[(owner, name, position[id(p)]) for owner in block.modules()
                        for name, p in owner._parameters.items() if p is not None]
                       for block, position in zip(self.blocks, positions)]
        self._forward: dict[int, list[torch.Tensor]] = {}
        self._backward: dict[int, list[torch.Tensor]] = {}
        self._device: dict[int, torch.device] = {}
        self._saving: dict[int, int] = {}
        self._saved_hooks = None
        pin = torch.cuda.is_available()
        for p in (p for params in self.params for p in params):
            p.data = p.data.to(HOST).pin_memory() if pin else p.data.to(HOST)
        self._handles = [handle for b, block in enumerate(self.blocks) for handle in (
            block.register_forward_pre_hook(partial(self._before_forward, b), with_kwargs=True),
            block.register_forward_hook(partial(self._after_forward, b), always_call=True),
            block.register_full_backward_pre_hook(partial(self._before_backward, b)),
            block.register_full_backward_hook(partial(self._after_backward, b)),
        )]

    def _check(self, module: nn.Module) -> None:
        """Every block inside ``module``, and each block's parameters used by that block alone."""
        modules = list(module.modules())
        block_of: dict[int, int] = {}
        for b, (block, params) in enumerate(zip(self.blocks, self.params)):
            if not any(m is block for m in modules):
                raise PolyshardError(f"block {b} ({type(block).__name__}) is not a submodule of the model")
            for p in params:
                if block_of.setdefault(id(p), b) != b:
                    raise PolyshardError(f"blocks {block_of[id(p)]} and {b} share a parameter; pass disjoint blocks")
            inside, ids = {id(m) for m in block.modules()}, {id(p) for p in params}
            for m in modules:
                if id(m) not in inside and any(id(q) in ids for q in m._parameters.values()):
                    raise PolyshardError(f"a parameter of block {b} is also used by {type(m).__name__} outside it "
                                         "(tied weights); untie it or leave that block on the device")

    @property
    def resident(self) -> set[int]:
        """Blocks whose parameters have device copies now."""
        return set(self._forward) | set(self._backward)

    def parameters(self) -> Iterator[torch.Tensor]:
        """The parameters kept on the host."""
        return (p for params in self.params for p in params)

    def _before_forward(self, b: int, block: nn.Module, args: tuple, kwargs: dict) -> None:
        device = self._device[b] = _device_of(args, kwargs)
        self._backward.pop(b, None)
        for n in range(b, min(b + 1 + self.prefetch, len(self.blocks))):
            if n not in self._forward:  # a differentiable copy: its gradient flows back to the host parameter
                self._forward[n] = [p.to(device, copy=True) for p in self.params[n]]
        copies = self._forward[b]
        for owner, name, k in self._slots[b]:
            owner._parameters[name] = copies[k]
        if torch.is_grad_enabled():
            self._saving = {c.untyped_storage().data_ptr(): k for k, c in enumerate(copies) if c.numel()}
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(partial(self._pack, b), self._unpack)
            self._saved_hooks.__enter__()

    def _after_forward(self, b: int, block: nn.Module, args: tuple, output) -> None:
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks, self._saving = None, {}
        for owner, name, k in self._slots[b]:
            owner._parameters[name] = self.params[b][k]
        self._forward.pop(b, None)

    def _pack(self, b: int, tensor: torch.Tensor):
        if tensor.layout != torch.strided or tensor.is_nested:
            return tensor
        k = self._saving.get(tensor.untyped_storage().data_ptr())
        if k is None or tensor.dtype != self.params[b][k].dtype:
            return tensor
        return _SavedParam(b, k, tensor.size(), tensor.stride(), tensor.storage_offset())

    def _unpack(self, saved):
        if not isinstance(saved, _SavedParam):
            return saved
        return self._fetch_backward(saved.block)[saved.index].as_strided(saved.size, saved.stride, saved.offset)

    def _fetch_backward(self, b: int) -> list[torch.Tensor]:
        if b not in self._backward:
            self._backward[b] = [p.detach().to(self._device[b], copy=True) for p in self.params[b]]
        return self._backward[b]

    def _before_backward(self, b: int, block: nn.Module, grad_output) -> None:
        for n in range(b, max(b - 1 - self.prefetch, -1), -1):
            if n in self._device:
                self._fetch_backward(n)

    def _after_backward(self, b: int, block: nn.Module, grad_input, grad_output) -> None:
        self._backward.pop(b, None)

    def remove(self) -> None:
        """Removes the hooks; the parameters stay on the host."""
        for handle in self._handles:
            handle.remove()


def offload_parameters(module: nn.Module, blocks: Iterable[nn.Module], prefetch: int = 1) -> ParameterOffload:
    """Keeps each block's parameters on the host, fetched to the device of its input ahead of its forward
    and backward (``prefetch`` blocks ahead). Call it after moving ``module`` to its device."""
    return ParameterOffload(module, blocks, prefetch)


class HostEmbedding(nn.Embedding):
    """An nn.Embedding whose table stays on the host: lookups run there and only the rows move to the
    device of the indices. Shares the Parameter of the embedding it comes from (optimizers keep working)."""

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding) -> HostEmbedding:
        e = embedding
        host = cls(e.num_embeddings, e.embedding_dim, e.padding_idx, e.max_norm, e.norm_type,
                   e.scale_grad_by_freq, e.sparse, _weight=e.weight.detach())
        host.weight = e.weight
        host.weight.data = host.weight.data.to(HOST)
        return host

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx.to(self.weight.device)).to(idx.device, copy=True)


def offload_embedding(module: nn.Module) -> list[str]:
    """Replaces each nn.Embedding inside ``module`` by a HostEmbedding; returns their names. Embeddings
    whose table another module shares (a tied LM head needs all of it on the device) stay, with a warning."""
    users: dict[int, int] = {}
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None:
                users[id(p)] = users.get(id(p), 0) + 1
    replaced, tied = [], []
    for parent_name, parent in list(module.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if type(child) is not nn.Embedding:
                continue
            if users[id(child.weight)] > 1:
                tied.append(full)
                continue
            setattr(parent, name, HostEmbedding.from_embedding(child))
            replaced.append(full)
    if not replaced:
        raise PolyshardError(f"no untied nn.Embedding in {type(module).__name__} to keep on the host"
                             + (f" ({', '.join(tied)} share their table)" if tied else ""))
    for name in tied:
        warnings.warn(f"{name}'s table is shared with another module (tied weights), which needs all of it on "
                      f"the device; {name} stays as it is", stacklevel=2)
    return replaced
