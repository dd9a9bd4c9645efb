"""Capture a module as an fx graph whose values carry their shapes and dtypes.

Code that torch.fx can trace symbolically is traced so, its shapes recorded with fake tensors; any
other (Python control flow on shapes, keyword arguments, structured outputs: transformers models) is
captured by torch.export (:mod:`polyshard.graph.export`). Either way modules with parameters that
have a sharding rule (Linear, Embedding, LayerNorm, Conv1D) and modules carrying a user's pin stay
whole (one node each); everything else is traced through.
"""

from __future__ import annotations

import contextlib
import io
import logging
import operator
import sys
from dataclasses import dataclass
from functools import partial
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.node import map_aggregate
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata, _extract_tensor_metadata
from torch.utils._pytree import tree_leaves, tree_map

from polyshard.errors import PolyshardError
from polyshard.graph.export import SIGNATURE_KEY, export_graph, graph_module
from polyshard.graph.export import at_rows as exported_at_rows
from polyshard.graph.fused_norm import FUSED_NORM, fused_eps_alike, install_fused_norms
from polyshard.graph.ops import op_key
from polyshard.graph.upcast import may_upcast
from polyshard.pin import PIN_ATTR

LEAF_MODULES = (nn.Linear, nn.Embedding, nn.LayerNorm)
_MATMULS = (torch.matmul, operator.matmul, "matmul")
# rows by the matrix of the expert each row's group is assigned (transformers' grouped experts on CPU, on GPUs)
GROUPED_PRODUCTS = ("grouped_mm_fallback", "_grouped_mm")
_PRODUCTS = (*_MATMULS, torch.bmm, torch.mm, torch.baddbmm, torch.addmm, F.linear, "bmm", *GROUPED_PRODUCTS)


def is_conv1d(m: nn.Module) -> bool:
    """GPT-2's Conv1D (transformers): a Linear whose weight is stored (in, out), run as addmm."""
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf") and getattr(m, "weight", None) is not None


def is_rms_norm(m: nn.Module) -> bool:
    """An RMSNorm (torch's, or a transformers family's own class): one per-feature weight, no children.
    Kept whole so a sequence-split input runs it on DTensors, its weight's gradient summed over the split."""
    params = dict(m.named_parameters(recurse=False))
    return (type(m).__name__.endswith("RMSNorm") and not any(True for _ in m.children())
            and list(params) == ["weight"] and params["weight"].ndim == 1)


def linear_dims(m: nn.Module) -> tuple[int, int] | None:
    """Which weight dims hold (outputs, inputs) for a Linear-like module (Linear: (0, 1), Conv1D: (1, 0))."""
    return (0, 1) if isinstance(m, nn.Linear) else (1, 0) if is_conv1d(m) else None


def is_product(node: fx.Node, modules: Mapping[str, nn.Module]) -> bool:
    """Whether ``node`` multiplies matrices: a Linear-like module's call, or a matmul / bmm / mm / addmm."""
    if node.op == "call_module":
        return linear_dims(modules[node.target]) is not None
    return op_key(node) in _PRODUCTS


def is_weight_product(node: fx.Node, modules: Mapping[str, nn.Module]) -> bool:
    """Whether ``node`` multiplies by one matrix (a weight): a product that runs as one mm or addmm, not as a
    batch of products (attention's scores and weighted sum run bmm)."""
    if not is_product(node, modules):
        return False
    if node.op == "call_module" or op_key(node) in (F.linear, torch.mm, torch.addmm):
        return True
    right = node.args[1] if len(node.args) > 1 and op_key(node) in _MATMULS else None
    return isinstance(right, fx.Node) and len(shape_of(right) or ()) == 2


def is_leaf(m: nn.Module) -> bool:
    """Whether capture keeps ``m`` as one call: a module with a sharding rule, or a pinned one."""
    return isinstance(m, LEAF_MODULES) or is_conv1d(m) or is_rms_norm(m) or hasattr(m, PIN_ATTR)


class _Tracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return is_leaf(m) or super().is_leaf_module(m, qualname)


class _RepeatShapeProp(ShapeProp):
    """ShapeProp that runs each distinct (op, input shapes) once: a model's repeated blocks repeat
    the same ops on the same shapes, so the 2nd..Nth block's shapes are looked up, not recomputed."""

    def __init__(self, gm: fx.GraphModule, fake_mode: FakeTensorMode | None = None):
        super().__init__(gm, fake_mode)
        self._seen: dict = {}
        self._metadata: dict[_TensorKey, TensorMetadata] = {}

    def run_node(self, n: fx.Node):
        """ShapeProp's record of ``n``, each distinct meta tensor's metadata read once (reading it checks every
        memory format: a third of the propagation)."""
        if self.fake_mode is not None:
            return super().run_node(n)
        try:
            result = fx.Interpreter.run_node(self, n)
        except Exception as exc:
            raise RuntimeError(f"shape propagation failed at {n.format_node()}") from exc
        found = False

        def metadata(value):
            nonlocal found
            if not isinstance(value, torch.Tensor):
                return value
            found = True
            return self._metadata_of(value)

        meta = map_aggregate(result, metadata)
        if found:
            n.meta["tensor_meta"] = meta
        n.meta["type"] = type(result)
        return result

    def _metadata_of(self, t: torch.Tensor) -> TensorMetadata:
        key = _tensor_key(t)
        if key not in self._metadata:
            self._metadata[key] = _extract_tensor_metadata(t)
        return self._metadata[key]

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


def split_example(example: Sequence | Mapping) -> tuple[tuple, dict]:
    """Example inputs as (args, kwargs): a sequence is positional, a mapping is keywords."""
    return ((), dict(example)) if isinstance(example, Mapping) else (tuple(example), {})


def batch_rows(example: Sequence | Mapping) -> int:
    """Rows of an example batch: the leading size of its first tensor."""
    tensors = [t for t in tree_leaves(split_example(example)) if isinstance(t, torch.Tensor)]
    if not tensors:
        raise PolyshardError("example inputs hold no tensor; pass the batch tensors the model is called with")
    return tensors[0].size(0)


def example_inputs_of(model: nn.Module, example_inputs: Sequence | Mapping | None) -> Sequence | Mapping:
    """``example_inputs`` if given (a lone tensor: the one positional argument), else the model's own
    ``example_inputs()``."""
    if not isinstance(model, nn.Module):
        raise PolyshardError(f"polyshard captures an nn.Module, not {type(model).__name__}; wrap the code in a "
                             "module (ps.shard takes a function)")
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if example_inputs is not None:
        return example_inputs
    if not hasattr(model, "example_inputs"):
        raise PolyshardError(f"{type(model).__name__} has no example_inputs(); pass example_inputs=(batch tensors...) "
                             "so polyshard can read the shapes")
    return model.example_inputs()


def capture(model: nn.Module, example_inputs: Sequence | Mapping) -> fx.GraphModule:
    """An fx graph of ``model`` whose nodes carry ``meta["tensor_meta"]`` (shape, dtype).

    ``example_inputs``: positional arguments (a sequence) or keyword arguments (a mapping)."""
    args, kwargs = split_example(example_inputs)
    try:
        if kwargs:
            raise TypeError("keyword arguments")
        graph = _Tracer().trace(model)
    except Exception:  # fx raises many kinds; all mean "not traceable symbolically": run the code instead
        return export_graph(model, args, kwargs, is_leaf)
    return _with_shapes(graph_module(model, graph, type(model).__name__), model, args)


def _with_shapes(gm: fx.GraphModule, model: nn.Module, example_inputs: Sequence) -> fx.GraphModule:
    """``gm``, a trace of ``model``, with each node's shape and dtype at ``example_inputs``."""
    try:
        with _quiet_unless_it_runs():
            if _on_meta(model):
                # meta tensors carry shapes already: the fastest way through a 175B model (seconds)
                _RepeatShapeProp(gm).propagate(*[t.to("meta") if isinstance(t, torch.Tensor) else t
                                                 for t in example_inputs])
            else:
                mode = FakeTensorMode(allow_non_fake_inputs=True)
                _RepeatShapeProp(gm, fake_mode=mode).propagate(
                    *[mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs])
    except (RuntimeError, TypeError, ValueError, IndexError) as exc:  # the model's own code, on these inputs
        root = exc
        while root.__cause__ is not None:
            root = root.__cause__
        shapes = ", ".join(str(list(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__
                           for t in example_inputs)
        raise PolyshardError(f"{type(model).__name__} does not run on its example inputs ({shapes}): {root}") from exc
    _mark_fused_norms(gm)
    return install_fused_norms(gm)


@contextlib.contextmanager
def _quiet_unless_it_runs():
    """What the block writes to stderr, passed on once it has run; where it fails, dropped with the traceback fx's
    ShapeProp prints and fake tensors log for the failed op, as the refusal then says why."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level, held = logger.level, io.StringIO()
    logger.setLevel(logging.CRITICAL + 1)
    try:
        with contextlib.redirect_stderr(held):
            yield
    finally:
        logger.setLevel(level)
    sys.stderr.write(held.getvalue())


def _on_meta(model: nn.Module) -> bool:
    return all(p.device.type == "meta" for p in model.parameters())


def _mark_fused_norms(gm: fx.GraphModule) -> None:
    """A traced RMSNorm of Python code that :class:`FusedRMSNorm` reproduces is marked to run as it (the estimate
    of a leaf's memory counts what a fused norm keeps: its input)."""
    seen: dict = {}
    for node in gm.graph.nodes:
        if node.op != "call_module" or FUSED_NORM in node.meta or (shape := shape_of(node)) is None:
            continue
        module = gm.get_submodule(node.target)
        if is_rms_norm(module) and may_upcast(module) and \
                (eps := fused_eps_alike(module, shape[-1], seen)) is not None:
            node.meta[FUSED_NORM] = eps


def at_rows(model: nn.Module, gm: fx.GraphModule, example_row: Sequence | Mapping, rows: int) -> fx.GraphModule:
    """``gm`` (``model`` captured on the one-row ``example_row``) with its shapes at ``rows`` rows: an exported
    graph recorded again (export kept the batch symbolic: no second export), a traced one propagated again (a
    symbolic trace never sees the inputs, so tracing again would give the same graph)."""
    if SIGNATURE_KEY in gm.meta and (again := exported_at_rows(gm, rows)) is not None:
        return again
    meta = SIGNATURE_KEY not in gm.meta and _on_meta(model)  # a search may ask for a whole batch of rows: no memory
    wider = tree_map(lambda t: (t.to("meta") if meta else t).repeat(rows, *[1] * (t.dim() - 1))
                     if isinstance(t, torch.Tensor) else t, example_row)
    if SIGNATURE_KEY in gm.meta:  # the code fixed the batch: export it again at these rows
        return capture(model, wider)
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return _with_shapes(graph_module(model, graph, type(model).__name__), model, split_example(wider)[0])


def shapes_of(node: fx.Node) -> tuple[tuple[int, ...], ...] | None:
    """The recorded shapes of a node whose value is several tensors (a split), or None."""
    meta = node.meta.get("tensor_meta")
    if isinstance(meta, (tuple, list)) and not hasattr(meta, "shape"):
        return tuple(tuple(m.shape) for m in meta)
    return None


def shape_of(node: fx.Node) -> tuple[int, ...] | None:
    """The recorded shape of a node's tensor value, or None if it is not a single tensor."""
    meta = node.meta.get("tensor_meta")
    return tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else None


