"""Flat buckets: parameters stored as views of one tensor, communicated and stepped as one."""

from __future__ import annotations

import torch
from torch import nn

from polyshard.buckets import padded


class Bucket:
    """Parameters communicated as one flat tensor, which is also their storage (they are views of it).

    ``sharded``: each rank steps ``master``, its 1/world slice; otherwise ``master`` is the whole bucket.
    ``resident``: the flat tensor always exists (False at level 3: only while its module runs).
    ``part``: the index of the part (pipeline chunk) whose backward produces its gradients.
    """

    def __init__(self, params: list[nn.Parameter], sharded: bool, world: int, rank: int, dtype: torch.dtype,
                 resident: bool, part: int):
        self.params, self.sharded, self.resident, self.part = params, sharded, resident, part
        self.shapes = [p.shape for p in params]  # level 3 empties the parameters between uses
        self.numel = sum(p.numel() for p in params)
        self.shard_numel = padded(self.numel, world) // world if sharded else self.numel
        self.lo = rank * self.shard_numel if sharded else 0
        self.flat = torch.zeros(self.shard_numel * (world if sharded else 1), dtype=dtype, device=params[0].device)
        master_dtype = params[0].dtype
        with torch.no_grad():
            torch._foreach_copy_(self.views(self.flat), [p.detach() for p in params])
        for p, view in zip(params, self.views(self.flat)):
            p.data = view
        shard = self.flat[self.lo:self.lo + self.shard_numel]
        alias = resident and master_dtype == dtype  # step in place on the parameters' own storage
        self.master = nn.Parameter(shard if alias else shard.detach().to(master_dtype, copy=True))
        self.pending = len(params)
        self.grad: torch.Tensor | None = None  # gradient collective's result while in flight
        self._whole_grad: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        self.work = self.sent = None
        self.gather_work = self.gather_src = None
        self.gathered = resident
        if not resident:
            self.release()

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's slice of a flat tensor, shaped like the parameter."""
        out, offset = [], 0
        for shape in self.shapes:
            out.append(flat[offset:offset + shape.numel()].view(shape))
            offset += shape.numel()
        return out

    def whole_grad(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A flat gradient buffer for the whole bucket and each parameter's view of it, made once and kept
        across steps, as DDP keeps its buckets."""
        if self._whole_grad is None:
            buf = self.flat.new_empty(self.flat.numel())
            self._whole_grad = buf, self.views(buf)
        return self._whole_grad

    def release(self) -> None:
        """Free the gathered parameters (level 3); the parameters point at an empty tensor meanwhile, so a
        stray use fails on its shape instead of reading freed memory."""
        self.wait_gather()
        self.flat.untyped_storage().resize_(0)
        empty = self.flat.new_empty(0)
        for p in self.params:
            p.data = empty
        self.gathered = False

    def wait_gather(self) -> None:
        if self.gather_work is not None:
            self.gather_work.wait()
            self.gather_work = self.gather_src = None
