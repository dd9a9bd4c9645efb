"""Run a layout transition on real tensors: DTensor executes each one-axis step of our plan.

We plan the steps ourselves (polyshard.transitions) rather than hand DTensor the whole change,
so the bytes the cost model counts are exactly the collectives that run; DTensor carries the
autograd of every step.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from polyshard.layout import Axes, Layout, contiguous_strides
from polyshard.mesh import Mesh
from polyshard.transitions import common_axes, plan_transition


def layout_of(x: DTensor) -> Layout:
    """The Layout of a DTensor, over its mesh's named axes."""
    mesh = x.device_mesh
    axes: Axes = tuple(zip(mesh.mesh_dim_names, mesh.shape))
    return Layout.from_placements(axes, x.placements, x.ndim)


def to_dtensor(local: torch.Tensor, layout: Layout, global_shape, mesh: Mesh) -> DTensor:
    """Wrap this rank's piece as a DTensor of ``layout`` (no communication)."""
    shape = torch.Size(global_shape)
    return DTensor.from_local(local, mesh.device_mesh(layout.axes), layout.placements(),
                              shape=shape, stride=contiguous_strides(shape))


def redistribute(x: DTensor, dst: Layout, mesh: Mesh, async_op: bool = False) -> DTensor:
    """``x`` moved to layout ``dst`` (over ``dst.axes``), one planned collective per step.

    With ``async_op`` the last collective is waited for only where its result is first used,
    so work issued in between (another micro-batch copy's compute) overlaps it."""
    src = layout_of(x)
    if src == dst:
        return x
    a, b = common_axes(src, dst)
    y = x if a.axes == src.axes else _rewrap(x, a, mesh)
    for step in plan_transition(a, b, mesh.cluster is None or mesh.cluster.all_to_all):
        y = y.redistribute(y.device_mesh, step.after.placements(), async_op=async_op)
    return y if b.axes == dst.axes else _rewrap(y, dst, mesh)


def redistribute_local(local: torch.Tensor, src: Layout, dst: Layout, global_shape, mesh: Mesh,
                       async_op: bool = False) -> torch.Tensor:
    """This rank's piece of a tensor moved from ``src`` to ``dst`` (autograd flows through)."""
    if src == dst:
        return local
    return redistribute(to_dtensor(local, src, global_shape, mesh), dst, mesh, async_op).to_local()


def _rewrap(x: DTensor, layout: Layout, mesh: Mesh) -> DTensor:
    """The same pieces viewed over another device matrix of the same ranks (no communication)."""
    return to_dtensor(x.to_local(), layout, x.shape, mesh)
