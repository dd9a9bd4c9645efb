"""Blocks whose parameters stay on the host and reach the device only while the block runs (forward,
and again for backward), the next block's fetched ahead."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from polyshard.errors import PolyshardError
from polyshard.runtime.offload.ledger import HOST


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
