"""Semi-auto tier, eager: a function called with a pinned strategy, outside any traced graph."""

from __future__ import annotations

from typing import Callable

import torch
from torch import fx
from torch.distributed.tensor import DTensor

from polyshard.compiler.redistribute import redistribute, to_dtensor
from polyshard.layout import Layout
from polyshard.mesh import current_mesh
from polyshard.pin import PIN_ATTR, Pin
from polyshard.planner.rules.einsum import pin_layouts, pin_output_layout
from polyshard.planner.rules.table import spec_for_function


class ShardedCallable:
    """``fn`` run with its inputs in the pinned layouts; returns a DTensor (the logical full result).

    Plain tensors are taken as the same full tensor on every rank; DTensors are redistributed.
    Inside a traced model it becomes one graph node that the planner treats as pinned.
    """

    def __init__(self, fn: Callable, pin: Pin):
        self.fn = fn
        setattr(self, PIN_ATTR, pin)
        self.__name__ = pin.name

    def __call__(self, *args, **kwargs):
        if any(isinstance(a, fx.Proxy) for a in args):
            proxy = next(a for a in args if isinstance(a, fx.Proxy))
            return proxy.tracer.create_proxy("call_function", self, args, kwargs)
        pin: Pin = getattr(self, PIN_ATTR)
        mesh = current_mesh()
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        shapes = [tuple(a.shape) for a in tensors]
        spec = spec_for_function(self.fn, [len(s) for s in shapes])
        layouts = iter(pin_layouts(spec, pin.in_strategy, shapes, mesh.op_axes, pin.name))
        dargs = [self._place(a, next(layouts), mesh) if isinstance(a, torch.Tensor) else a for a in args]
        out = self.fn(*dargs, **kwargs)
        if pin.out_strategy is not None:
            out = redistribute(out, pin_output_layout(pin.out_strategy, tuple(out.shape), None, mesh.op_axes, pin.name), mesh)
        return out

    @staticmethod
    def _place(x: torch.Tensor, layout: Layout, mesh) -> DTensor:
        if not isinstance(x, DTensor):
            x = to_dtensor(x, Layout.replicated(layout.axes, x.ndim), x.shape, mesh)
        return redistribute(x, layout, mesh)

