"""Trace a module with torch.fx and record each value's shape and dtype with fake tensors.

Modules with parameters that have a sharding rule (Linear, Embedding, LayerNorm) and modules
carrying a user's pin stay whole (one node each); everything else is traced through.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.shape_prop import ShapeProp

from polyshard.errors import PolyshardError

LEAF_MODULES = (nn.Linear, nn.Embedding, nn.LayerNorm)
PIN_ATTR = "_polyshard_pin"


class _Tracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, LEAF_MODULES) or hasattr(m, PIN_ATTR) or super().is_leaf_module(m, qualname)


def capture(model: nn.Module, example_inputs: Sequence[torch.Tensor]) -> fx.GraphModule:
    """An fx graph of ``model`` whose nodes carry ``meta["tensor_meta"]`` (shape, dtype)."""
    try:
        graph = _Tracer().trace(model)
    except Exception as exc:  # fx raises many kinds; all mean "not traceable as written"
        raise PolyshardError(
            f"could not trace {type(model).__name__} with torch.fx ({type(exc).__name__}: {exc}); "
            "avoid Python control flow on tensor values in forward, or pin its parts with polyshard.shard"
        ) from exc
    gm = fx.GraphModule(model, graph, class_name=type(model).__name__)
    if all(p.device.type == "meta" for p in model.parameters()):
        # meta tensors carry shapes already: the fastest way through a 175B model (seconds)
        ShapeProp(gm).propagate(*[t.to("meta") if isinstance(t, torch.Tensor) else t for t in example_inputs])
    else:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        ShapeProp(gm, fake_mode=mode).propagate(
            *[mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs])
    return gm


def shape_of(node: fx.Node) -> tuple[int, ...] | None:
    """The recorded shape of a node's tensor value, or None if it is not a single tensor."""
    meta = node.meta.get("tensor_meta")
    return tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else None
