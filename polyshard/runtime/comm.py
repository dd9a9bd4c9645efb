"""Manual tier: collectives over named mesh axes, on this rank's pieces, with autograd.

Each collective is a layout change along one axis, and its gradient is the reverse change,
taking the loss as the same on every rank (as in the rest of polyshard):

    all_gather      S(dim) -> R        backward: keep own chunk
    reduce_scatter  P -> S(dim)        backward: all-gather
    all_reduce      P -> R             backward: identity
    all_to_all      S(cat) -> S(split) backward: all-to-all back

DTensor carries each change (and its gradient) on the axis's one-dimensional mesh.
``send``/``recv`` move a tensor between two ranks; the gradient travels back the same way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from polyshard.errors import PolyshardError
from polyshard.layout import contiguous_strides
from polyshard.mesh import current_mesh


def all_gather(x: torch.Tensor, axis: str, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (ranks of ``axis`` in order)."""
    return _change(x, axis, Shard(dim), Replicate())


def reduce_scatter(x: torch.Tensor, axis: str, dim: int = 0) -> torch.Tensor:
    """Sum ``x`` over ``axis`` and keep this rank's chunk of the sum along ``dim``."""
    return _change(x, axis, Partial(), Shard(dim))


def all_reduce(x: torch.Tensor, axis: str) -> torch.Tensor:
    """Sum ``x`` over ``axis``."""
    return _change(x, axis, Partial(), Replicate())


def all_to_all(x: torch.Tensor, axis: str, split_dim: int, concat_dim: int) -> torch.Tensor:
    """Split ``x`` along ``split_dim``, send chunk j to rank j, concatenate what arrives along ``concat_dim``."""
    return _change(x, axis, Shard(concat_dim), Shard(split_dim))


def send(x: torch.Tensor, dst: int) -> torch.Tensor:
    """Send ``x`` to global rank ``dst``. Returns a zero scalar: backward through it receives
    ``x``'s gradient from ``dst`` (add it to this rank's loss, or call ``.backward()`` on it)."""
    return _Send.apply(x, dst)


def recv(shape: tuple[int, ...], src: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Receive a tensor of ``shape`` from global rank ``src``; its gradient is sent back to ``src``."""
    anchor = torch.zeros((), requires_grad=True, device=current_mesh().device)
    return _Recv.apply(anchor, tuple(shape), dtype, src)


def _change(x: torch.Tensor, axis: str, src, dst) -> torch.Tensor:
    for placement in (src, dst):
        if isinstance(placement, Shard) and not -x.dim() <= placement.dim < x.dim():
            raise PolyshardError(f"dim {placement.dim} is out of range for a tensor of {x.dim()} dims (shape "
                                 f"{tuple(x.shape)})")
    sub = current_mesh().axis_mesh(axis)
    size = sub.size()
    shape = list(x.shape)
    if isinstance(src, Shard):
        shape[src.dim] *= size
    if isinstance(dst, Shard) and shape[dst.dim] % size:
        raise PolyshardError(f"dim {dst.dim} of size {shape[dst.dim]} does not split over axis {axis} of {size}")
    d = DTensor.from_local(x, sub, [src], shape=torch.Size(shape), stride=contiguous_strides(shape))
    return d.redistribute(sub, [dst]).to_local()


class _Send(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dst):
        dist.send(x.detach().contiguous(), dst)
        ctx.dst, ctx.shape, ctx.dtype, ctx.device = dst, x.shape, x.dtype, x.device
        return x.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        grad = torch.empty(ctx.shape, dtype=ctx.dtype, device=ctx.device)
        dist.recv(grad, ctx.dst)
        return grad, None


class _Recv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, shape, dtype, src):
        out = torch.empty(shape, dtype=dtype, device=anchor.device)
        dist.recv(out, src)
        ctx.src = src
        return out

    @staticmethod
    def backward(ctx, grad):
        dist.send(grad.contiguous(), ctx.src)
        return None, None, None, None
