"""Convolutional ops on images split by height and width (spatial parallel), which lowering substitutes.

Each rank holds a tile. A window op (convolution, pooling) first takes from its neighbours the border rows
and columns its windows reach past the tile (the halo), height first, then width on the taller tile, so
corners come along; the tile's own op then runs without padding on the split dims (the image's edges are
padded as the op pads them). It keeps the tile and those thin strips for backward, which grows the tile
again, not a padded copy; the halo's gradient goes back to the rank it came from and is added there.
Batch norm sums its statistics over every rank that holds part of a channel (tiles and data-parallel
rows), so it normalizes as one device does; global average pooling adds the tiles' shares.
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


class _Strips(torch.autograd.Function):
    """The rows a tile's windows reach in its neighbours along ``dim``: (``lo`` rows before it, ``hi`` after
    it), ``fill`` past the image's edges; backward sends their gradients back to the ranks they came from."""

    @staticmethod
    def forward(ctx, x, dim, lo, hi, group, fill):
        ctx.dim, ctx.lo, ctx.hi, ctx.group, ctx.shape = dim, lo, hi, group, x.shape
        before, after = _swap(x.narrow(dim, x.size(dim) - lo, lo), x.narrow(dim, 0, hi), group)
        edge = lambda n: x.new_full((*x.shape[:dim], n, *x.shape[dim + 1:]), fill)  # noqa: E731
        return before if before is not None else edge(lo), after if after is not None else edge(hi)

    @staticmethod
    def backward(ctx, grad_before, grad_after):
        dim, lo, hi = ctx.dim, ctx.lo, ctx.hi
        from_prev, from_next = _swap(grad_after.contiguous(), grad_before.contiguous(), ctx.group)
        grad = grad_before.new_zeros(ctx.shape)
        if from_next is not None and lo:  # the next rank's rows before it are this tile's last
            grad.narrow(dim, ctx.shape[dim] - lo, lo).add_(from_next)
        if from_prev is not None and hi:
            grad.narrow(dim, 0, hi).add_(from_prev)
        return grad, None, None, None, None, None


def _swap(to_next: torch.Tensor, to_prev: torch.Tensor, group) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Send ``to_next`` to the next rank and ``to_prev`` to the previous one along ``group``; return
    (what the previous rank sent forward, what the next rank sent back), None past either end."""
    ranks = dist.get_process_group_ranks(group)
    i = ranks.index(dist.get_rank())
    ops, from_prev, from_next = [], None, None
    if i + 1 < len(ranks):
        from_next = to_prev.new_empty(to_prev.shape)  # contiguous, whatever the strips' strides
        if to_next.numel():
            ops.append(dist.P2POp(dist.isend, to_next.contiguous(), ranks[i + 1], group))
        if from_next.numel():
            ops.append(dist.P2POp(dist.irecv, from_next, ranks[i + 1], group))
    if i > 0:
        from_prev = to_next.new_empty(to_next.shape)
        if to_prev.numel():
            ops.append(dist.P2POp(dist.isend, to_prev.contiguous(), ranks[i - 1], group))
        if from_prev.numel():
            ops.append(dist.P2POp(dist.irecv, from_prev, ranks[i - 1], group))
    for req in dist.batch_isend_irecv(ops) if ops else ():
        req.wait()
    return from_prev, from_next


def strips(x: torch.Tensor, splits: tuple[Split, ...], fill: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each split dim's (before, after) rows, height first, width then from the tile grown by the height's
    (so corners come along). The grown tile is a temporary: nothing keeps it."""
    out = []
    for s in splits:
        lo, hi = max(s.lo, 0), max(s.hi, 0)
        before, after = _Strips.apply(x, s.dim, lo, hi, s.group, fill)
        out.append((before, after))
        x = torch.cat([before, x, after], s.dim)
    return out


def _grown(x: torch.Tensor, splits: tuple[Split, ...], rows: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The tile with its strips around it (``rows``: before, after of each split dim in turn)."""
    for k, s in enumerate(splits):
        x = torch.cat([rows[2 * k], x, rows[2 * k + 1]], s.dim)
    return x


def _ungrown(grad: torch.Tensor, splits: tuple[Split, ...], rows: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """The grown tile's gradient cut back into (tile, before, after of each split dim)."""
    parts: list[torch.Tensor] = [None] * (2 * len(splits))
    for k in reversed(range(len(splits))):
        d, lo, hi = splits[k].dim, rows[2 * k].size(splits[k].dim), rows[2 * k + 1].size(splits[k].dim)
        parts[2 * k], parts[2 * k + 1] = grad.narrow(d, 0, lo), grad.narrow(d, grad.size(d) - hi, hi)
        grad = grad.narrow(d, lo, grad.size(d) - lo - hi)
    return [grad, *parts]


class _TileConv(torch.autograd.Function):
    """conv2d over a tile with its strips, keeping the tile (which the op before keeps anyway) and the
    strips, not the grown copy: backward grows it again."""

    @staticmethod
    def forward(ctx, x, weight, bias, conv, splits, *rows):
        ctx.conv, ctx.splits, ctx.has_bias = conv, splits, bias is not None
        ctx.save_for_backward(x, weight, *rows)
        return F.conv2d(_grown(x, splits, rows), weight, bias, *conv)

    @staticmethod
    def backward(ctx, grad):
        x, weight, *rows = ctx.saved_tensors
        grown = _grown(x, ctx.splits, rows)
        stride, padding, dilation, groups = ctx.conv
        grad_in = torch.nn.grad.conv2d_input(grown.shape, weight, grad, stride, padding, dilation, groups)
        grad_w = torch.nn.grad.conv2d_weight(grown, weight.shape, grad, stride, padding, dilation, groups)
        grad_b = grad.sum((0, 2, 3)) if ctx.has_bias else None
        tile, *strip_grads = _ungrown(grad_in, ctx.splits, rows)
        return (tile, grad_w, grad_b, None, None, *strip_grads)


class _TileMaxPool(torch.autograd.Function):
    """max_pool2d over a tile with its strips, keeping only the argmax of each window for backward."""

    @staticmethod
    def forward(ctx, x, pool, splits, *rows):
        grown = _grown(x, splits, rows)
        y, index = F.max_pool2d(grown, *pool, return_indices=True)
        ctx.splits, ctx.shape = splits, grown.shape
        ctx.save_for_backward(index, *rows)
        return y

    @staticmethod
    def backward(ctx, grad):
        index, *rows = ctx.saved_tensors
        n, c = ctx.shape[:2]
        grown = grad.new_zeros(ctx.shape)
        grown.view(n, c, -1).scatter_add_(2, index.reshape(n, c, -1), grad.reshape(n, c, -1))
        tile, *strip_grads = _ungrown(grown, ctx.splits, rows)
        return (tile, None, None, *strip_grads)


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
        m, splits = self.module, tuple(s for s in self.splits if max(s.lo, 0) or max(s.hi, 0))
        rows = [t for around in strips(x, splits, self.fill) for t in around]
        if isinstance(m, nn.MaxPool2d):
            y = _TileMaxPool.apply(x, (m.kernel_size, m.stride, self.padding, m.dilation, m.ceil_mode), splits, *rows)
        else:
            weight = _SumGrad.apply(m.weight, self.weights_group)
            bias = _SumGrad.apply(m.bias, self.weights_group) if m.bias is not None else None
            if isinstance(m, nn.ConvTranspose2d):
                y = F.conv_transpose2d(x, weight, bias, m.stride, m.padding, m.output_padding, m.groups, m.dilation)
            else:
                y = _TileConv.apply(x, weight, bias, (m.stride, self.padding, m.dilation, m.groups), splits, *rows)
        for s in self.splits:
            y = y.narrow(s.dim, 0, s.out)
        return y


class _BatchNorm(torch.autograd.Function):
    """Training batch norm over every element of a channel on ``group``'s ranks, keeping only the normalized
    input for backward (torch's own keeps its input). Also returns the batch mean and variance."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, group):
        count = x.numel() // x.size(1) * dist.get_world_size(group)
        mean = x.sum((0, 2, 3))
        dist.all_reduce(mean, group=group)
        mean /= count
        centred = x - mean[None, :, None, None]
        var = (centred * centred).sum((0, 2, 3))
        dist.all_reduce(var, group=group)
        var /= count
        invstd = torch.rsqrt(var + eps)
        normed = centred.mul_(invstd[None, :, None, None])
        ctx.save_for_backward(normed, weight, invstd)
        ctx.count, ctx.group = count, group
        ctx.mark_non_differentiable(mean, var)
        y = normed * weight[None, :, None, None] + bias[None, :, None, None] if weight is not None else normed.clone()
        return y, mean, var

    @staticmethod
    def backward(ctx, grad, _mean, _var):
        normed, weight, invstd = ctx.saved_tensors
        sums = torch.stack([grad.sum((0, 2, 3)), (grad * normed).sum((0, 2, 3))])
        grad_b, grad_w = sums[0].clone(), sums[1].clone()  # this rank's parts (added up over tiles outside)
        dist.all_reduce(sums, group=ctx.group)
        scale = invstd * weight if weight is not None else invstd
        grad_x = (grad - sums[0][None, :, None, None] / ctx.count
                  - normed * (sums[1] / ctx.count)[None, :, None, None]) * scale[None, :, None, None]
        return grad_x, grad_w if weight is not None else None, grad_b if weight is not None else None, None, None


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
        y, mean, var = _BatchNorm.apply(x, weight, bias, m.eps, self.stats_group)
        if m.training and m.running_mean is not None:
            with torch.no_grad():
                count = x.numel() // x.size(1) * dist.get_world_size(self.stats_group)
                m.num_batches_tracked.add_(1)
                rate = m.momentum if m.momentum is not None else 1.0 / float(m.num_batches_tracked)
                m.running_mean.mul_(1 - rate).add_(mean, alpha=rate)
                m.running_var.mul_(1 - rate).add_(var * count / max(count - 1, 1), alpha=rate)
        return y


class SpatialUpsample(nn.Module):
    """Bilinear upsampling by a whole ``factor`` on a tile: one row (and column) from each neighbour, or at the
    image's edges the tile's own edge again (the whole image's interpolation clamps there), height first so
    corners come along; then the grown tile upsampled and cut back to the tile's own output rows. Bilinear
    backward needs no input values, so nothing but shapes is kept."""

    def __init__(self, factor: tuple[int, int], splits: tuple[Split, ...]):
        super().__init__()
        self.factor, self.splits = factor, splits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for s in self.splits:
            before, after = _Strips.apply(x, s.dim, s.lo, s.hi, s.group, 0.0)
            ranks = dist.get_process_group_ranks(s.group)
            if ranks[0] == dist.get_rank():
                before = x.narrow(s.dim, 0, s.lo)
            if ranks[-1] == dist.get_rank():
                after = x.narrow(s.dim, x.size(s.dim) - s.hi, s.hi)
            x = torch.cat([before, x, after], s.dim)
        y = F.interpolate(x, scale_factor=self.factor, mode="bilinear", align_corners=False)
        for s in self.splits:
            f = self.factor[s.dim - 2]
            y = y.narrow(s.dim, f * s.lo, s.out)
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
