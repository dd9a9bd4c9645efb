"""Optimizer parallel's level 3: parameters kept as shards, a module's gathered before its forward and
released after, gathered again before its backward; the next module's gather starts one module ahead."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from polyshard.runtime.fusion import CommStats
from polyshard.runtime.sync.bucket import Bucket


class ModuleGathers:
    """Hooks on ``parts`` and on each module of ``uses`` (a module -> the buckets it needs), gathering over
    ``group`` and counting in ``comm``. Prefetch follows the order of the part's previous forward."""

    def __init__(self, uses: dict[nn.Module, list[Bucket]], parts: list[nn.Module], group, comm: CommStats):
        self._uses, self.group, self.comm = uses, group, comm
        self._order: list[nn.Module] = []
        self._last_order: list[nn.Module] = []
        # each part's modules in call order, until its forward records its own: prefetch stays within a part
        self._orders = {part: [m for m in self._uses if m in set(part.modules())] for part in parts}
        self._hooks = [part.register_forward_pre_hook(self._begin_forward) for part in parts]
        for m in self._uses:
            self._hooks.append(m.register_forward_pre_hook(self._before_forward))
            self._hooks.append(m.register_forward_hook(self._after_forward))

    def _begin_forward(self, part: nn.Module, _args) -> None:
        self._last_order, self._order = self._orders[part], []
        self._orders[part] = self._order

    def gather(self, buckets: Iterable[Bucket]) -> None:
        """Start gathering ``buckets`` not already there (or on the way)."""
        for b in buckets:
            if b.gathered:
                continue
            b.flat.untyped_storage().resize_(b.flat.numel() * b.flat.element_size())
            b.gather_src = b.master.detach().to(b.flat.dtype)
            b.gather_work = dist.all_gather_single(b.flat, b.gather_src, group=self.group, async_op=True)
            self.comm.record("all_gather", b.flat.numel() * b.flat.element_size())
            for p, view in zip(b.params, b.views(b.flat)):
                p.data = view
            b.gathered = True

    def _ready(self, m: nn.Module, prefetch: nn.Module | None) -> None:
        """Gather ``m``'s parameters (waiting for them) and start gathering ``prefetch``'s."""
        self.gather(self._uses[m])
        if prefetch is not None:
            self.gather(self._uses[prefetch])
        for b in self._uses[m]:
            b.wait_gather()

    def _next(self) -> nn.Module | None:
        """The module expected after the one running now (from the previous forward's order)."""
        i = len(self._order)
        return self._last_order[i] if i < len(self._last_order) else None

    def _before_forward(self, m: nn.Module, _args) -> None:
        self._order.append(m)
        self._ready(m, self._next())

    def _after_forward(self, m: nn.Module, _args, out) -> None:
        nxt = self._next()
        keep = self._uses[nxt] if nxt is not None else []
        for b in self._uses[m]:
            if b not in keep:  # the next module needs it too (one fusion group): keep it
                b.release()
        tensors = [t for t in (out if isinstance(out, (tuple, list)) else (out,))
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            i = len(self._order) - 1
            prev = self._order[i - 1] if i > 0 else None
            tensors[0].register_hook(lambda grad: self._ready(m, prev))

    @contextlib.contextmanager
    def gathered(self):
        """Every bucket gathered while inside (e.g. to read or save the parameters)."""
        units = list(dict.fromkeys(b for bs in self._uses.values() for b in bs))
        self.gather(units)
        for b in units:
            b.wait_gather()
        try:
            yield
        finally:
            for b in units:
                b.release()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
