"""An optimizer whose state, master copies and step live on the host (``mode="host"``) or in files
streamed through the step (``mode="disk"``, see ``disk``)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

import torch

from polyshard.errors import PolyshardError
from polyshard.optim.closure import closure_loss
from polyshard.runtime.offload.disk import DiskStore, entry_bytes

from polyshard.runtime.offload.ledger import HOST, DeviceLedger


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
