"""Trace a module with torch.fx and record each value's shape and dtype with fake tensors.

Modules with parameters that have a sharding rule (Linear, Embedding, LayerNorm) and modules
carrying a user's pin stay whole (one node each); everything else is traced through.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Sequence

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.node import map_aggregate
from torch.fx.passes.shape_prop import ShapeProp

from polyshard.errors import PolyshardError

LEAF_MODULES = (nn.Linear, nn.Embedding, nn.LayerNorm)
PIN_ATTR = "_polyshard_pin"


class _Tracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, LEAF_MODULES) or hasattr(m, PIN_ATTR) or super().is_leaf_module(m, qualname)


class _RepeatShapeProp(ShapeProp):
    """ShapeProp that runs each distinct (op, input shapes) once: a model's repeated blocks repeat
    the same ops on the same shapes, so the 2nd..Nth block's shapes are looked up, not recomputed."""

    def __init__(self, gm: fx.GraphModule, fake_mode: FakeTensorMode | None = None):
        super().__init__(gm, fake_mode)
        self._seen: dict = {}

    def call_function(self, target, args, kwargs):
        return self._cached(("f", target), args, kwargs, partial(super().call_function, target, args, kwargs))

    def call_method(self, target, args, kwargs):
        return self._cached(("m", target), args, kwargs, partial(super().call_method, target, args, kwargs))

    def call_module(self, target, args, kwargs):
        module = self.fetch_attr(target)
        compute = partial(super().call_module, target, args, kwargs)
        if not isinstance(module, LEAF_MODULES) or hasattr(module, PIN_ATTR):
            return compute()  # arbitrary modules may hold state that shapes depend on
        signature = (type(module), module.extra_repr(),
                     tuple((n, _tensor_key(p)) for n, p in module.named_parameters()))
        return self._cached(("c", signature), args, kwargs, compute)

    def _cached(self, op, args, kwargs, compute):
        try:
            key = (op, map_aggregate((args, kwargs), _value_key))
            hash(key)
        except TypeError:  # an argument with no stable value (e.g. an object): compute it
            return compute()
        if key not in self._seen:
            result = compute()
            self._seen[key] = _map_tensors(result, _tensor_key)
        return _map_tensors(self._seen[key], _rebuild)


@dataclass(frozen=True)
class _TensorKey:
    """What a tensor's shape propagation depends on, and all it takes to make one like it."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool


def _tensor_key(t: torch.Tensor) -> _TensorKey:
    return _TensorKey(tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)


def _value_key(v):
    if isinstance(v, torch.Tensor):
        return _tensor_key(v)
    if isinstance(v, slice):
        return ("slice", v.start, v.stop, v.step)
    return v


def _rebuild(k: _TensorKey) -> torch.Tensor:
    """A fresh tensor like a recorded one (meta or fake: only shapes flow through here)."""
    return torch.empty_strided(k.shape, k.stride, dtype=k.dtype, device=k.device, requires_grad=k.requires_grad)


def _map_tensors(value, fn):
    """``fn`` on each tensor (or recorded tensor) in nested lists/tuples/dicts; torch.Size stays as it is."""
    if isinstance(value, (torch.Tensor, _TensorKey)):
        return fn(value)
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        mapped = [_map_tensors(v, fn) for v in value]
        return type(value)(*mapped) if hasattr(value, "_fields") else type(value)(mapped)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


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
        _RepeatShapeProp(gm).propagate(*[t.to("meta") if isinstance(t, torch.Tensor) else t for t in example_inputs])
    else:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        _RepeatShapeProp(gm, fake_mode=mode).propagate(
            *[mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs])
    return gm


def shape_of(node: fx.Node) -> tuple[int, ...] | None:
    """The recorded shape of a node's tensor value, or None if it is not a single tensor."""
    meta = node.meta.get("tensor_meta")
    return tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else None
