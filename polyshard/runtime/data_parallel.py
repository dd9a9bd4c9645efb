"""Data parallel: gradients averaged over the data axes in buckets, overlapped with backward.

Each bucket's all-reduce starts as soon as backward has produced all its gradients (DDP's
method), so no parameter gets a collective of its own and communication hides behind compute.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from polyshard.runtime.fusion import CommStats, plan_buckets

DEFAULT_BUCKET_BYTES = 25 * 2**20


class _Bucket:
    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.pending = len(params)
        self.flat: torch.Tensor | None = None
        self.work = None


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


class GradientSync(Pausable):
    """Averages ``params``' gradients over ``group`` after every backward (unless in :meth:`no_sync`).

    ``fusion``: id(parameter) -> comm_fusion group; a bucket holds one group only. ``comm`` counts the
    collectives issued (see :class:`polyshard.runtime.fusion.CommStats`).
    """

    def __init__(self, params: list[nn.Parameter], group, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 fusion: dict[int, int] | None = None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.comm = CommStats()
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        self._callback_queued = False
        trainable = [p for p in params if p.requires_grad]
        for members in plan_buckets(trainable, bucket_bytes, lambda p: (fusion or {}).get(id(p))):
            self._add(members)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in trainable]

    def remove(self) -> None:
        """Take the gradient hooks off the parameters (another synchronizer takes over)."""
        for h in self._hooks:
            h.remove()

    def _add(self, params: list[nn.Parameter]) -> None:
        bucket = _Bucket(params)
        self.buckets.append(bucket)
        for p in params:
            self._bucket_of[id(p)] = bucket

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self.syncing:
            return
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self._callback_queued = True
        bucket = self._bucket_of[id(param)]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        bucket.flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.world)
        bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)
        self.comm.record("all_reduce", bucket.flat.numel() * bucket.flat.element_size())

    def finish(self) -> None:
        """Wait for every bucket (launching any whose parameters got no gradient) and write back."""
        self._callback_queued = False
        for bucket in self.buckets:
            if bucket.work is None:
                self._launch(bucket)
        for bucket in self.buckets:
            bucket.work.wait()
            pieces = bucket.flat.split([p.numel() for p in bucket.params])
            missing = [p for p in bucket.params if p.grad is None]
            for p in missing:
                p.grad = torch.empty_like(p)
            torch._foreach_copy_([p.grad for p in bucket.params], [x.view_as(p) for x, p in zip(pieces, bucket.params)])
            bucket.work, bucket.flat, bucket.pending = None, None, len(bucket.params)
