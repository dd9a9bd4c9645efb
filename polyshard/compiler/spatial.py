"""Convolutional ops on images split by height and width (spatial parallel), which lowering substitutes.

Each rank holds a tile. A window op (convolution, pooling) first takes from its neighbours the border rows
and columns its windows reach past the tile (the halo), height first, then width on the taller tile, so
corners come along; the tile's own op then runs without padding on the split dims (the image's edges are
padded as the op pads them). In backward the halo's gradient goes back to the rank it came from and is
added there. Batch norm sums its statistics over every rank that holds part of a channel (tiles and
data-parallel rows), so it normalizes as one device does; global average pooling adds the tiles' shares.
Weights are whole on every rank, and their gradients, sums over the tiles, are added up across them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from polyshard.halo import pair


@dataclass(frozen=True)
class Split:
    """One split image dim of a window op: ``dim`` of the input is cut in ``group``'s order; the op reaches
    ``lo`` rows before a tile and ``hi`` after it (negative: short of its end); ``out`` rows come out."""

    dim: int
    group: object
    lo: int
    hi: int
    out: int


class _Halo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, lo, hi, group, fill):
        ctx.dim, ctx.lo, ctx.hi, ctx.group = dim, lo, hi, group
        before, after = _swap(x.narrow(dim, x.size(dim) - lo, lo), x.narrow(dim, 0, hi), group)
        edge = lambda n: x.new_full((*x.shape[:dim], n, *x.shape[dim + 1:]), fill)  # noqa: E731
        return torch.cat([before if before is not None else edge(lo), x, after if after is not None else edge(hi)],
                         dim)

    @staticmethod
    def backward(ctx, grad):
        dim, lo, hi = ctx.dim, ctx.lo, ctx.hi
        mine = grad.narrow(dim, lo, grad.size(dim) - lo - hi).clone()
        # the halo's gradient belongs to the neighbour it came from: the 'before' rows to the previous rank
        from_prev, from_next = _swap(grad.narrow(dim, grad.size(dim) - hi, hi), grad.narrow(dim, 0, lo), ctx.group)
        if from_next is not None and lo:
            mine.narrow(dim, mine.size(dim) - lo, lo).add_(from_next)
        if from_prev is not None and hi:
            mine.narrow(dim, 0, hi).add_(from_prev)
        return mine, None, None, None, None, None


def _swap(to_next: torch.Tensor, to_prev: torch.Tensor, group) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Send ``to_next`` to the next rank and ``to_prev`` to the previous one along ``group``; return
    (what the previous rank sent forward, what the next rank sent back), None past either end."""
    ranks = dist.get_process_group_ranks(group)
    i = ranks.index(dist.get_rank())
    ops, from_prev, from_next = [], None, None
    if i + 1 < len(ranks):
        from_next = torch.empty_like(to_prev)
        if to_next.numel():
            ops.append(dist.P2POp(dist.isend, to_next.contiguous(), ranks[i + 1], group))
        if from_next.numel():
            ops.append(dist.P2POp(dist.irecv, from_next, ranks[i + 1], group))
    if i > 0:
        from_prev = torch.empty_like(to_next)
        if to_prev.numel():
            ops.append(dist.P2POp(dist.isend, to_prev.contiguous(), ranks[i - 1], group))
        if from_prev.numel():
            ops.append(dist.P2POp(dist.irecv, from_prev, ranks[i - 1], group))
    for req in dist.batch_isend_irecv(ops) if ops else ():
        req.wait()
    return from_prev, from_next


def with_halo(x: torch.Tensor, split: Split, fill: float = 0.0) -> torch.Tensor:
    """``x`` with the rows ``split``'s windows reach in its neighbours (``fill`` past the image's edges)."""
    lo, hi = max(split.lo, 0), max(split.hi, 0)
    return _Halo.apply(x, split.dim, lo, hi, split.group, fill) if lo or hi else x


class _SumGrad(torch.autograd.Function):
    """Identity forward; backward adds the gradient up over ``group`` (a whole weight used on every tile)."""

    @staticmethod
    def forward(ctx, w, group):
        ctx.group = group
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Sum(torch.autograd.Function):
    """Sum over ``group`` forward; backward sums too (each rank's gradient is its own part's share)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Reduce(torch.autograd.Function):
    """Sum over ``group`` forward; backward hands each rank the whole gradient (its result is replicated)."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class SpatialWindow(nn.Module):
    """A Conv2d, ConvTranspose2d or MaxPool2d on a tile: halos on the split dims, the module's padding on
    the others."""

    def __init__(self, module: nn.Module, splits: tuple[Split, ...], weights_group):
        super().__init__()
        self.module, self.splits, self.weights_group = module, splits, weights_group
        split = {s.dim for s in splits}
        self.padding = tuple(0 if d + 2 in split else p for d, p in enumerate(pair(module.padding)))
        self.fill = float("-inf") if isinstance(module, nn.MaxPool2d) else 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for s in self.splits:
            x = with_halo(x, s, self.fill)
        m = self.module
        if isinstance(m, nn.MaxPool2d):
            y = F.max_pool2d(x, m.kernel_size, m.stride, self.padding, m.dilation, m.ceil_mode)
        else:
            weight = _SumGrad.apply(m.weight, self.weights_group)
            bias = _SumGrad.apply(m.bias, self.weights_group) if m.bias is not None else None
            if isinstance(m, nn.ConvTranspose2d):
                y = F.conv_transpose2d(x, weight, bias, m.stride, m.padding, m.output_padding, m.groups, m.dilation)
            else:
                y = F.conv2d(x, weight, bias, m.stride, self.padding, m.dilation, m.groups)
        for s in self.splits:
            y = y.narrow(s.dim, 0, s.out)
        return y


class SpatialBatchNorm2d(nn.Module):
    """BatchNorm2d whose statistics are summed over ``stats_group`` (every rank holding part of a channel)."""

    def __init__(self, module: nn.BatchNorm2d, stats_group, weights_group):
        super().__init__()
        self.module, self.stats_group, self.weights_group = module, stats_group, weights_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        weight = _SumGrad.apply(m.weight, self.weights_group) if m.affine else None
        bias = _SumGrad.apply(m.bias, self.weights_group) if m.affine else None
        if not (m.training or m.running_mean is None):
            return F.batch_norm(x, m.running_mean, m.running_var, weight, bias, False, 0.0, m.eps)
        count = x.numel() // x.size(1) * dist.get_world_size(self.stats_group)
        sums = _Sum.apply(torch.stack([x.sum((0, 2, 3)), (x * x).sum((0, 2, 3))]), self.stats_group)
        mean = sums[0] / count
        var = sums[1] / count - mean * mean
        if m.training and m.running_mean is not None:
            with torch.no_grad():
                m.num_batches_tracked.add_(1)
                rate = m.momentum if m.momentum is not None else 1.0 / float(m.num_batches_tracked)
                m.running_mean.mul_(1 - rate).add_(mean.detach(), alpha=rate)
                m.running_var.mul_(1 - rate).add_(var.detach() * count / max(count - 1, 1), alpha=rate)
        y = (x - mean[None, :, None, None]) * torch.rsqrt(var + m.eps)[None, :, None, None]
        if weight is not None:
            y = y * weight[None, :, None, None] + bias[None, :, None, None]
        return y


class SpatialCrossEntropy:
    """Mean cross-entropy of per-pixel logits split into tiles: the tiles' summed losses over all counted
    pixels (those not ``ignore_index``); the loss replicated."""

    def __init__(self, group, ignore_index: int = -100):
        self.group, self.ignore_index = group, ignore_index
        self.__name__ = "spatial_cross_entropy"

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        total = F.cross_entropy(logits, target, ignore_index=self.ignore_index, reduction="sum")
        count = (target != self.ignore_index).sum().to(total.dtype)
        dist.all_reduce(count, group=self.group)
        return _Reduce.apply(total, self.group) / count


class SpatialGlobalPool(nn.Module):
    """AdaptiveAvgPool2d to one pixel over tiles: the tiles' means, added up over ``group``, replicated."""

    def __init__(self, tiles: int, group):
        super().__init__()
        self.tiles, self.group = tiles, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Reduce.apply(x.mean((2, 3), keepdim=True) / self.tiles, self.group)
