"""The gradient-sync engine: each bucket's collective starts from backward's hooks as soon as its
gradients exist (DDP's method), and is waited for at the end of backward.

Data parallel is level 0 (every bucket all-reduced); optimizer parallel builds on the same engine
(polyshard.runtime.zero): from level 2 a sharded bucket is reduce-scattered, so a rank receives only
its shard's gradient, handed to the bucket's master.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from polyshard.runtime.fusion import CommStats, plan_buckets
from polyshard.runtime.sync.bucket import Bucket


class Pausable:
    """Something that syncs gradients after backward unless paused: ``syncing`` is False inside
    :meth:`no_sync` (gradient accumulation's inner steps keep gradients local)."""

    syncing = True

    @contextlib.contextmanager
    def no_sync(self):
        """Keep gradients local until the block ends."""
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True


def _weakly(engine: GradientSync):
    """``engine``'s gradient hook, holding it weakly: a parameter keeps its hooks where Python's collector
    cannot see them, so a hook holding the engine (which holds the parameters) would keep both alive forever."""
    ref = weakref.ref(engine)

    def on_grad(p: nn.Parameter) -> None:
        if (live := ref()) is not None:
            live._on_grad(p)

    return on_grad


class GradientSync(Pausable):
    """Averages the gradients of ``buckets``' parameters over ``group`` in every backward (unless in
    :meth:`no_sync`; at level 2+ with ``shard_accumulated_grads``, sharded buckets reduce-scatter in
    every backward). A backward syncs only the parts (pipeline chunks) it reached. ``comm`` counts the
    collectives issued (see :class:`polyshard.runtime.fusion.CommStats`)."""

    def __init__(self, buckets: list[Bucket], group, level: int = 0, shard_accumulated_grads: bool = False):
        self.buckets, self.group, self.level = buckets, group, level
        self.world = dist.get_world_size(group) if group is not None else 1
        self.shard_accumulated_grads = shard_accumulated_grads
        self.comm = CommStats()
        self.bucket_of = {id(p): b for b in buckets for p in b.params}  # id(parameter) -> its bucket
        self._callback_queued, self._reached = False, set()
        hook = _weakly(self)
        self._hooks = [p.register_post_accumulate_grad_hook(hook) for b in buckets for p in b.params]

    def remove(self) -> None:
        """Take the gradient hooks off the parameters (another engine takes over)."""
        for h in self._hooks:
            h.remove()

    def _scattered(self, b: Bucket) -> bool:
        return b.sharded and self.level >= 2

    def _active(self, b: Bucket) -> bool:
        """Whether ``b`` communicates in this backward."""
        return self.syncing or (self._scattered(b) and self.shard_accumulated_grads)

    def _on_grad(self, p: nn.Parameter) -> None:
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self._callback_queued = True
        b = self.bucket_of[id(p)]
        self._reached.add(b.part)
        b.pending -= 1
        if b.pending == 0:
            if self._active(b):
                self._launch(b)
            if not b.resident:
                b.release()

    def _launch(self, b: Bucket) -> None:
        """Copy the bucket's gradients into one flat buffer and start its all-reduce or reduce-scatter."""
        if self._scattered(b):  # a new buffer each step: level 2 keeps only its shard after backward
            buf = b.flat.new_empty(b.flat.numel())
            views = b.views(buf)
        else:
            buf, views = b.whole_grad()
        for p, view in zip(b.params, views):
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():  # else accumulated in place into the last step's view
                view.copy_(p.grad)
        buf[b.numel:].zero_()
        if self.world > 1:
            buf.div_(self.world)
        nbytes = buf.numel() * buf.element_size()
        if self._scattered(b):
            b.grad, b.sent = buf.new_empty(b.shard_numel), buf
            b.work = dist.reduce_scatter_single(b.grad, buf, group=self.group, async_op=True)
            self.comm.record("reduce_scatter", nbytes)
            for p in b.params:
                p.grad = None
        else:
            b.grad = buf
            if self.world > 1:
                b.work = dist.all_reduce(buf, group=self.group, async_op=True)
                self.comm.record("all_reduce", nbytes)

    def finish(self) -> None:
        """End of backward: wait for the collectives of the parts it reached (launching buckets whose
        parameters got no gradient); the parameters' gradients become views of the averaged buffer, and
        each master gets its shard's."""
        self._callback_queued = False
        active = [b for b in self.buckets if b.part in self._reached and self._active(b)]
        self._reached.clear()
        for b in active:
            if b.grad is None:
                self._launch(b)
        for b in active:
            if b.work is not None:
                b.work.wait()
            grad, b.grad, b.work, b.sent = b.grad, None, None, None
            if self._scattered(b):
                shard = grad.to(b.master.dtype)
                b.master.grad = shard if b.master.grad is None else b.master.grad.add_(shard)
            else:
                for p, view in zip(b.params, b.whole_grad()[1]):
                    p.grad = view
                b.master.grad = grad[b.lo:b.lo + b.shard_numel].to(b.master.dtype)
        for b in self.buckets:
            b.pending = len(b.params)
            if not b.resident and b.gathered:
                b.release()


def data_parallel(params: Sequence[nn.Parameter], group, bucket_bytes: int, first_bucket_bytes: int,
                  fusion: Mapping[int, int] | None = None, parts: Sequence[nn.Module] = ()) -> GradientSync:
    """Level 0 over ``group``: ``params`` in buckets of ``bucket_bytes``, the first closed at ``first_bucket_bytes``
    (one comm_fusion group, one part and one dtype each; ``fusion``: id(parameter) -> its group), all-reduced
    as backward makes them."""
    trainable = [p for p in dict.fromkeys(params) if p.requires_grad]
    part_of = {id(p): i for i, part in enumerate(parts) for p in part.parameters()}
    buckets = [Bucket(members, False, 1, 0, members[0].dtype, True, part_of.get(id(members[0]), 0))
               for members in plan_buckets(trainable, bucket_bytes, first_bucket_bytes,
                                           lambda p: (part_of.get(id(p), 0), (fusion or {}).get(id(p)), p.dtype))]
    return GradientSync(buckets, group)
