"""Capture with torch.export: the model's own Python runs on fake tensors, so control flow on shapes,
keyword arguments and structured outputs (``ModelOutput``) simply work.

The exported aten graph is then put in the form the rules read, the form :mod:`capture` gives: each
parameter and buffer is an attribute of the user's own module, and each leaf module (Linear, Embedding,
LayerNorm, GPT-2's Conv1D, a pinned module) is one call, whatever ops it ran inside.
"""

from __future__ import annotations

import inspect
import operator
import traceback
from dataclasses import dataclass
from collections import OrderedDict
from typing import Any, Callable, NamedTuple

import torch
from torch import fx, nn
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.passes.shape_prop import TensorMetadata, _extract_tensor_metadata
from torch.export import Dim
from torch.utils._pytree import TreeSpec, tree_flatten, tree_leaves, tree_map, tree_unflatten

from polyshard.errors import PolyshardError
from polyshard.graph.batched_heads import unmerge_batched_heads
from polyshard.graph.causal import run_causal_attention_unmasked
from polyshard.graph.fused_norm import FUSED_NORM, FusedRMSNorm, fused_eps, install_fused_norms
from polyshard.graph.saved import KEPT_INSIDE, kept_inside
from polyshard.graph.stamp import find_stack, first_layers, stamp
from polyshard.graph.structure import structure_key
from polyshard.graph.upcast import PROBED, may_upcast, probe
from polyshard.layout import contiguous_strides

SIGNATURE_KEY = "polyshard_call_signature"
# on the call of an Embedding subclass whose own forward capture saw only scale its lookup (Gemma's)
SCALED_LOOKUP = "polyshard_scaled_lookup"
# Ops that only assert what export saw; they would pin the capture's device into the program.
_ASSERTS = {torch.ops.aten._assert_tensor_metadata.default, torch.ops.aten._assert_scalar.default}
_VIEWS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default}


@dataclass(frozen=True)
class CallSignature:
    """How a call with the user's (args, kwargs) maps to the graph's tensor inputs, and its outputs back
    to the user's structure. Non-tensor arguments were fixed at capture (``constants``)."""

    in_spec: TreeSpec
    tensor_positions: tuple[int, ...]
    constants: tuple
    out_spec: TreeSpec

    def flatten(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        leaves, spec = tree_flatten((tuple(args), dict(kwargs)))
        if spec != self.in_spec:
            raise PolyshardError(f"called with arguments shaped {spec}, but the model was captured with "
                                 f"{self.in_spec}; "
                                 "call it as in example_inputs")
        for i, (value, fixed) in enumerate(zip(leaves, self.constants)):
            if i not in self.tensor_positions and value != fixed:
                raise PolyshardError(f"non-tensor argument {i} is {value!r} but the model was captured with {fixed!r}")
        return [leaves[i] for i in self.tensor_positions]

    def unflatten(self, outputs) -> Any:
        return tree_unflatten(list(outputs) if isinstance(outputs, (tuple, list)) else [outputs], self.out_spec)


def export_graph(model: nn.Module, args: tuple, kwargs: dict, is_leaf: Callable[[nn.Module], bool],
                 stamped: bool = True) -> fx.GraphModule:
    """``model`` exported in the form of :func:`polyshard.graph.capture.capture`, its call signature in
    ``gm.meta[SIGNATURE_KEY]``. The batch dim stays symbolic where the code allows, so one graph runs any
    batch (each rank's, each micro-batch, a one-row capture for the search); shapes are recorded at the
    example's batch. A stack of identical layers is exported with two of them and the rest stamped
    (``stamped=False``: every layer exported). A model of a structure this process exported before
    (:mod:`polyshard.graph.structure`) gets that graph again, over its own modules."""
    rows = _rows(args, kwargs)
    key = structure_key(model, args, kwargs, is_leaf, batched=rows > 0) if stamped else None
    if key is not None and (kept := _KEPT.get(key)) is not None:
        graph = _copy(kept.graph) if rows == kept.rows else _graph_at_rows(kept.graph, rows)
        if graph is not None:  # (None: the code fixed the batch at other rows)
            _KEPT.move_to_end(key)
            return _over(model, graph, kept.extras, kept.signature)
    graph, extras, signature = _export(model, args, kwargs, is_leaf, stamped)
    if key is not None:
        _KEPT[key] = _Kept(_copy(graph), extras, signature, rows)
        while len(_KEPT) > _KEEP:
            _KEPT.popitem(last=False)
    return _over(model, graph, extras, signature)


class _Kept(NamedTuple):
    """An export, apart from the model it was exported from: its graph at ``rows`` rows, export's own attributes
    (constants, bodies of higher-order ops) and the call signature."""

    graph: fx.Graph
    extras: dict[str, Any]
    signature: CallSignature
    rows: int


_KEPT: OrderedDict[tuple, _Kept] = OrderedDict()  # by structure key, the most recently used last
_KEEP = 4


def _over(model: nn.Module, graph: fx.Graph, extras: dict[str, Any], signature: CallSignature) -> fx.GraphModule:
    """``graph`` over the model's own children plus export's extras, without touching the model."""
    root = _root(model)
    for name, value in extras.items():
        setattr(root, name, value)
    gm = graph_module(root, graph, type(model).__name__)
    gm.meta[SIGNATURE_KEY] = signature
    return install_fused_norms(gm)


def _root(model: nn.Module) -> nn.Module:
    """A module holding ``model``'s own children, parameters and buffers, and nothing else of it."""
    root = nn.Module()
    root._modules, root._parameters, root._buffers = dict(model._modules), dict(model._parameters), dict(model._buffers)
    return root


def _export(model: nn.Module, args: tuple, kwargs: dict, is_leaf: Callable[[nn.Module], bool],
            stamped: bool = True) -> tuple[fx.Graph, dict[str, Any], CallSignature]:
    """:func:`export_graph`'s graph, extras and signature, from export itself."""
    stack = find_stack(model) if stamped else None
    traced = first_layers(model, stack) if stack else model
    rows, dynamic = _batch_dims(traced, args, kwargs)
    # export fixes a size-1 dim, so one row is traced as two; a tensor passed twice (ids as labels) would
    # be traced as one input, so each is traced as its own copy, as a one-row slice of it will be
    tiled = tree_map(lambda t: (t.repeat(2 if rows == 1 else 1, *[1] * (t.dim() - 1)) if t.dim() else t.clone())
                     if isinstance(t, torch.Tensor) else t, (tuple(args), dict(kwargs)))
    try:
        ep = torch.export.export(traced, *tiled, dynamic_shapes=dynamic, strict=False)
        if rows == 1 and not _symbolic_batch(ep.graph):  # the code fixed the batch: capture the one row as is
            tiled = (tuple(args), dict(kwargs))
            ep = torch.export.export(traced, *tiled, strict=False)
    except Exception as exc:  # export raises many kinds; each means "this code cannot be captured"
        raise PolyshardError(_capture_error(model, exc)) from exc
    graph = ep.graph_module.graph
    graph.owning_module = None  # rebuilt below, over the user's modules
    sig = ep.graph_signature
    attrs: dict[str, Any] = {}
    _inline_state(graph, sig, traced, ep.constants, attrs)
    signature = _bind_user_inputs(graph, sig, ep.call_spec.in_spec, *tiled, ep.call_spec.out_spec)
    _drop_asserts(graph)
    for node in graph.nodes:
        if node.op == "get_attr" and node.target.startswith("submod_"):  # higher-order ops' bodies
            attrs[node.target] = body = getattr(ep.graph_module, node.target)
            _drop_asserts(body.graph)
            body.recompile()
    for node in graph.nodes:
        _clean_stack(node)
    _split_to_slices(graph)
    _drop_same_dtype_casts(graph)
    _drop_contiguous(graph)
    _out_of_place(graph)
    unmerge_batched_heads(graph)
    _collapse_leaves(graph, traced, is_leaf, attrs)
    # shapes and the causal rewrite before stamping: each stamped layer copies its model layer's as they are
    batch = dict.fromkeys(_symbolic_batch(graph), rows)
    grads = _needs_grad(graph, attrs)
    for node in graph.nodes:
        _set_tensor_meta(node, batch, node in grads)
    run_causal_attention_unmasked(graph)
    if stack is not None and not stamp(graph, stack, model, attrs):  # the layers' graphs differ after all
        return _export(model, args, kwargs, is_leaf, stamped=False)
    for node in [n for n in graph.nodes if n.op == "get_attr" and not n.users]:  # a collapsed leaf's own state
        graph.erase_node(node)
        attrs.pop(node.target, None)
    own = _root(model)  # the names the model's own children and state take
    extras = {n: attrs[n] for n in attrs if "." not in n and not hasattr(own, n)}
    return _named_in_order(graph), extras, signature


def graph_module(root: nn.Module, graph: fx.Graph, class_name: str) -> fx.GraphModule:
    """``graph`` over ``root``'s modules, its Python generated at its first call: the search reads a capture and
    never runs it, and generating a 100-layer model's code costs a fraction of a second each time."""
    return _LazyGraphModule(root, graph, class_name=class_name)


def at_rows(gm: fx.GraphModule, rows: int) -> fx.GraphModule | None:
    """An exported ``gm`` whose shapes are recorded at ``rows`` rows: the same graph, which export kept symbolic in
    the batch; None where the code fixed the batch."""
    graph = _graph_at_rows(gm.graph, rows)
    if graph is None:
        return None
    wider = graph_module(gm, graph, type(gm).__name__)
    wider.meta.update(gm.meta)
    return wider


def _graph_at_rows(graph: fx.Graph, rows: int) -> fx.Graph | None:
    """A copy of an exported graph with its shapes recorded at ``rows`` rows; None where the code fixed the batch."""
    batch = dict.fromkeys(_symbolic_batch(graph), rows)
    if not batch:
        return None
    out = _copy(graph)
    for old, new in zip(graph.nodes, out.nodes):
        meta, val = old.meta.get("tensor_meta"), old.meta.get("val")
        if isinstance(meta, TensorMetadata):
            new.meta["tensor_meta"] = _meta_at(meta, val, batch)
        elif isinstance(meta, tuple):
            new.meta["tensor_meta"] = tuple(_meta_at(m, v, batch) for m, v in zip(meta, val))
    return out


def _copy(graph: fx.Graph) -> fx.Graph:
    """Another graph of the same nodes (names, targets, meta), which passes may change without touching this one."""
    out = fx.Graph()
    out.output(out.graph_copy(graph, {})).meta = dict(graph.output_node().meta)
    return out


def _drop_asserts(graph: fx.Graph) -> None:
    """Export's checks of the dtypes and sizes it traced: a program that computes in another precision, or
    at another batch, would fail them."""
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in _ASSERTS]:
        graph.erase_node(node)


def _inline_state(graph: fx.Graph, sig, model: nn.Module, constants: dict, attrs: dict) -> None:
    """Lifted parameters, buffers and constants become attributes again, the model's own objects."""
    state = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    lifted = {**sig.inputs_to_parameters, **sig.inputs_to_buffers, **sig.inputs_to_lifted_tensor_constants}
    if sig.buffers_to_mutate:
        mutated = ", ".join(sig.buffers_to_mutate.values())
        raise PolyshardError(f"{type(model).__name__} updates buffers in forward ({mutated}, "
                             "e.g. BatchNorm running statistics); polyshard cannot split such a model yet")
    first = next(n for n in graph.nodes if n.op != "placeholder") if len(graph.nodes) else None
    canonical: dict[int, str] = {}  # a tied parameter by the model's first name for it, not the one export chose
    for name, p in model.named_parameters(remove_duplicate=False):
        canonical.setdefault(id(p), name)
    for node in [n for n in graph.nodes if n.op == "placeholder" and n.name in lifted]:
        fqn = lifted[node.name]
        target = canonical.get(id(state[fqn]), fqn) if fqn in state else f"_constant_{len(attrs)}"
        attrs[target] = state[fqn] if fqn in state else constants[fqn]
        with graph.inserting_before(first):
            new = graph.get_attr(target)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)


def _bind_user_inputs(graph: fx.Graph, sig, in_spec: TreeSpec, args, kwargs, out_spec: TreeSpec) -> CallSignature:
    """Tensor inputs stay placeholders; non-tensor ones become the constants export specialized on."""
    leaves, _ = tree_flatten((tuple(args), dict(kwargs)))
    positions = []
    for i, (node, value) in enumerate(zip([n for n in graph.nodes if n.op == "placeholder"], leaves)):
        if isinstance(value, torch.Tensor):
            positions.append(i)
            continue
        for user in list(node.users):
            user.replace_input_with(node, value)
        graph.erase_node(node)
    output = next(n for n in graph.nodes if n.op == "output")
    output.args = (tuple(output.args[0][: len(sig.user_outputs)]),)
    return CallSignature(in_spec, tuple(positions), tuple(leaves), out_spec)


def _clean_stack(node: fx.Node) -> None:
    """Module paths as fx writes them: no root entry, no "@n" suffix for a module's later calls."""
    stack = node.meta.get("nn_module_stack")
    if stack:
        node.meta["nn_module_stack"] = {k: (path.split("@")[0], kind) for k, (path, kind) in stack.items()
                                        if path and not path.startswith("_empty")}  # export's placeholder entry


_SPLITS = {torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default, torch.ops.aten.chunk.default,
           torch.ops.aten.unbind.int}


def _split_to_slices(graph: fx.Graph) -> None:
    """A split's pieces become one slice (or select) each: rules and search see single tensors, not tuples."""
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in _SPLITS]:
        if not all(u.target is operator.getitem for u in node.users):
            continue
        x, pieces = node.args[0], node.meta["val"]
        unbind = node.target is torch.ops.aten.unbind.int
        dim = node.kwargs.get("dim", node.args[-1] if unbind or len(node.args) > 2 else 0)
        dim = dim if isinstance(dim, int) else 0
        starts = [0]
        for p in pieces:
            starts.append(starts[-1] + (1 if node.target is torch.ops.aten.unbind.int else p.shape[dim]))
        for user in list(node.users):
            i = user.args[1]
            with graph.inserting_before(user):
                piece = (graph.call_function(torch.ops.aten.select.int, (x, dim, i))
                         if node.target is torch.ops.aten.unbind.int else
                         graph.call_function(torch.ops.aten.slice.Tensor, (x, dim, starts[i], starts[i + 1])))
            piece.meta = dict(user.meta)
            user.replace_all_uses_with(piece)
            graph.erase_node(user)
        graph.erase_node(node)


# Casts export records, and where each takes its dtype among its positional arguments (None: by keyword only):
# ``x.float()`` is to.dtype, ``x.to(dtype=..., device=...)`` to.device (transformers' rotary tables).
CASTS = {torch.ops.aten.to.dtype: 1, torch.ops.aten.to.device: 2, torch.ops.aten.to.dtype_layout: None,
         torch.ops.aten._to_copy.default: None}


def _cast_device(node: fx.Node):
    """The device a cast node moves its value to (None: where it is)."""
    return node.args[1] if node.target is torch.ops.aten.to.device else node.kwargs.get("device")


def _drop_same_dtype_casts(graph: fx.Graph) -> None:
    """A cast to the dtype a value has already returns the value itself (eager's ``.to``); export records it
    as a node, which would tie a norm's float32 upcast to the residual stream that reuses it."""
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in CASTS]:
        src, val = node.args[0], node.meta.get("val")
        same_device = _cast_device(node) in (None, getattr(src.meta.get("val"), "device", None))
        if (isinstance(src, fx.Node) and isinstance(val, torch.Tensor) and same_device
                and getattr(src.meta.get("val"), "dtype", None) == val.dtype):
            node.replace_all_uses_with(src)
            graph.erase_node(node)


def _drop_contiguous(graph: fx.Graph) -> None:
    """``.contiguous()`` is recorded only where the traced tensor was not contiguous already, which depends on the
    device traced on (attention returns another memory layout on meta than on CPU), so a plan made on
    meta would name nodes a run does not have. Each is dropped, and a view of it becomes a reshape, which
    copies where the strides need it, as the pair did."""
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target == torch.ops.aten.contiguous.default]:
        for user in node.users:
            if user.op == "call_function" and user.target in _VIEWS:
                user.target = torch.ops.aten.reshape.default
        node.replace_all_uses_with(node.args[0])
        graph.erase_node(node)


def _named_in_order(graph: fx.Graph) -> fx.Graph:
    """``graph`` again, each op's nodes numbered in graph order (``mul``, ``mul_1``, ...): export numbers them as
    it makes them, which also differs with the device traced on, and a plan names them."""
    counts: dict[str, int] = {}
    for node in graph.nodes:
        if node.op in ("call_function", "call_method"):
            op = node.target if node.op == "call_method" else \
                getattr(node.target, "_opname", None) or getattr(node.target, "__name__", "op")
            counts[op] = counts.get(op, 0) + 1
            node.name = op if counts[op] == 1 else f"{op}_{counts[op] - 1}"
    named = fx.Graph()
    named.output(named.graph_copy(graph, {}))
    return named


_OUT_OF_PLACE = {getattr(torch.ops.aten, f"{name}_").Tensor: getattr(torch.ops.aten, name).Tensor
                 for name in ("add", "sub", "mul", "div")}


def _out_of_place(graph: fx.Graph) -> None:
    """A model's ``x += y`` where ``x`` is an op's own result that nothing else reads, as ``x + y``: the same value
    (export keeps the write; a split op hands its result on as a view of its piece, which autograd will not let it
    write into). A write into an input, a parameter or a view of another value stays as it is."""
    for node in graph.nodes:
        functional, x = _OUT_OF_PLACE.get(node.target), node.args[0] if node.args else None
        if functional is not None and isinstance(x, fx.Node) and x.op == "call_function" and len(x.users) == 1 and \
                isinstance(x.target, torch._ops.OpOverload) and x.target._schema.returns[0].alias_info is None:
            node.target = functional


def _collapse_leaves(graph: fx.Graph, model: nn.Module, is_leaf: Callable[[nn.Module], bool], attrs: dict) -> None:
    """Each run of ops inside one call of a leaf module becomes one ``call_module`` node."""
    runs: list[tuple[tuple, list[fx.Node]]] = []
    for node in graph.nodes:
        leaf = _leaf_of(node, model, is_leaf)
        if leaf is None:
            continue
        if runs and runs[-1][0] == leaf and runs[-1][1][-1].next is node:
            runs[-1][1].append(node)
        else:
            runs.append((leaf, [node]))
    for (key, path), nodes in runs:
        inside, module = set(nodes), model.get_submodule(path)
        state = {id(t) for t in [*module.parameters(), *module.buffers()]}
        own = {i for n in nodes for i in n.all_input_nodes if i.op == "get_attr" and id(attrs.get(i.target)) in state}
        inputs = list(dict.fromkeys(i for n in nodes for i in n.all_input_nodes if i not in inside and i not in own
                                    and isinstance(i.meta.get("val"), torch.Tensor)))  # sizes: the module reads its own
        outputs = [n for n in nodes if any(u not in inside for u in n.users)]
        if len(inputs) != 1 or len(outputs) != 1 or not _called_on_one_tensor(module, nodes, inputs[0], attrs):
            continue  # runs traced through, op by op
        attrs[path] = module
        with graph.inserting_before(nodes[0]):
            call = graph.call_module(path, (inputs[0],))
        call.meta = dict(outputs[0].meta) | {KEPT_INSIDE: kept_inside(nodes, outputs[0])}
        if isinstance(module, nn.Embedding) and own_forward(module, nn.Embedding):
            call.meta[SCALED_LOOKUP] = True
        if may_upcast(module):
            features = tuple(inputs[0].meta["val"].shape[-1:])
            if (eps := fused_eps(module, features[0])) is not None:  # runs as FusedRMSNorm: see _over
                call.meta[FUSED_NORM], module = eps, FusedRMSNorm(module.weight, eps)
            if probed := probe(module, features):
                call.meta[PROBED] = probed
                if eps is not None:  # what the fused norm keeps, measured, not what the Python's ops would
                    call.meta[KEPT_INSIDE] = probed.kept_inside_full
        outputs[0].replace_all_uses_with(call)
        for n in reversed(nodes):
            graph.erase_node(n)


def _called_on_one_tensor(module: nn.Module, nodes: list[fx.Node], input: fx.Node, attrs: dict) -> bool:
    """Whether calling a leaf on the run's one tensor input reproduces the run, and its sharding rule holds for
    what it returns: a subclass of torch's Linear, Embedding or LayerNorm with a forward of its own may take other
    arguments (OPT's positional embedding reads the attention mask), or do more than its base; an embedding that
    only scales the rows it looks up (Gemma's) does not, nor a Linear that only writes its product out (Falcon's)."""
    base = next((b for b in (nn.Linear, nn.Embedding, nn.LayerNorm) if isinstance(module, b)), None)
    return base is None or not own_forward(module, base) or (base is nn.Embedding and _scaled_lookup(nodes, input)) \
        or (base is nn.Linear and _plain_product(nodes, input, module, attrs))


def _plain_product(nodes: list[fx.Node], input: fx.Node, module: nn.Linear, attrs: dict) -> bool:
    """Whether a run multiplies ``input`` by the module's weight transposed, then adds its bias where it has one
    (``input @ self.weight.T + self.bias``): a Linear's product, written out."""
    aten = torch.ops.aten
    reads = lambda node, t: node.op == "get_attr" and attrs.get(node.target) is t  # noqa: E731
    if len(nodes) != 2 + (module.bias is not None):
        return False
    transposed, product, *biased = nodes
    return transposed.target in (aten.numpy_T.default, aten.t.default) and reads(transposed.args[0], module.weight) \
        and product.target is aten.matmul.default and product.args == (input, transposed) \
        and all(b.target is aten.add.Tensor and b.args[0] is product and reads(b.args[1], module.bias) for b in biased)


def own_forward(module: nn.Module, base: type[nn.Module]) -> bool:
    """Whether ``module``'s class replaces ``base``'s forward with one of its own."""
    return type(module).forward is not base.forward


def _scaled_lookup(nodes: list[fx.Node], input: fx.Node) -> bool:
    """Whether a run looks up ``input``'s ids, then multiplies or divides the rows found by scalars alone (which
    the run may cast on the way): a lookup split by rows or by features scales as it is."""
    if nodes[0].target is not torch.ops.aten.embedding.default or nodes[0].args[1] is not input:
        return False
    found = nodes[0]
    for node in nodes[1:]:
        if found not in node.all_input_nodes:  # the scale itself: a value of no dims
            if not _is_scalar(node):
                return False
        elif getattr(node.target, "overloadpacket", None) in (torch.ops.aten.mul, torch.ops.aten.div) and \
                node.args[0] is found and all(_is_scalar(a) for a in node.args[1:] if isinstance(a, fx.Node)):
            found = node
        else:
            return False
    return found is nodes[-1]


def _is_scalar(node: fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.dim() == 0


def _leaf_of(node: fx.Node, model: nn.Module, is_leaf) -> tuple | None:
    """(stack key, path) of the outermost leaf module ``node`` runs inside, if any."""
    if node.op != "call_function":
        return None
    for key, (path, _) in (node.meta.get("nn_module_stack") or {}).items():
        if is_leaf(model.get_submodule(path)):
            return key, path
    return None


def _rows(args, kwargs) -> int:
    """The example's rows: its tensor inputs' common leading size (0 where they have none)."""
    rows = {t.size(0) for t in tree_leaves((tuple(args), dict(kwargs))) if isinstance(t, torch.Tensor) and t.dim()}
    return rows.pop() if len(rows) == 1 else 0


def _batch_dims(model: nn.Module, args, kwargs) -> tuple[int, Any]:
    """The example's rows, and export's dynamic_shapes marking every tensor input's dim 0 as the batch."""
    rows = _rows(args, kwargs)
    if not rows:  # no common leading dim: shapes stay as given
        return 0, None
    mark = lambda t: {0: Dim.AUTO} if isinstance(t, torch.Tensor) and t.dim() else None  # noqa: E731
    bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    return rows, {name: tree_map(mark, value) for name, value in bound.items()}


def _symbolic_batch(graph: fx.Graph) -> set:
    """The symbols export kept for the inputs' leading dims (none if the code fixed the batch)."""
    return {d.node.expr for n in graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
            for d in n.meta["val"].shape[:1] if isinstance(d, torch.SymInt)}


def _needs_grad(graph: fx.Graph, attrs: dict) -> set[fx.Node]:
    """The values that depend on a trainable parameter, as autograd will see them in training (export
    records its values without grad)."""
    out: set[fx.Node] = set()
    for node in graph.nodes:
        val = node.meta.get("val")
        if node.op == "get_attr":
            grad = getattr(attrs.get(node.target), "requires_grad", False)
        elif node.op == "call_module":
            grad = any(p.requires_grad for p in attrs[node.target].parameters()) or any(
                i in out for i in node.all_input_nodes)
        elif node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
            grad = node.args[0] is not False and any(i in out for i in node.all_input_nodes)
        else:
            grad = any(i in out for i in node.all_input_nodes)
        floating = isinstance(val, torch.Tensor) and val.dtype.is_floating_point
        if grad and (floating or node.target is operator.getitem or isinstance(val, (tuple, list))):
            out.add(node)
    return out


_ANY_ROWS = 7  # a row count no other dim is likely to equal


def _concrete(val: torch.Tensor, batch: dict, grad: bool) -> torch.Tensor:
    """A meta tensor of ``val``'s shape with the batch symbol at the example's rows."""
    return torch.empty(_shape_at(val, batch), dtype=val.dtype, device="meta",
                       requires_grad=grad and val.dtype.is_floating_point)


def _shape_at(val: torch.Tensor, batch: dict) -> torch.Size:
    """``val``'s shape with the batch symbol at the given rows."""
    return torch.Size(int(d) if not isinstance(d, torch.SymInt) else int(d.node.expr.xreplace(batch))
                      for d in val.shape)


def shape_at_any_rows(node: fx.Node) -> tuple[int, ...] | None:
    """An exported value's shape with the batch at several rows (None where export kept no symbol in it): recorded
    at one row, a view that merges the batch with another dim reads as one that leaves the batch alone."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not any(isinstance(d, torch.SymInt) for d in val.shape):
        return None
    return tuple(_shape_at(val, {s: _ANY_ROWS for d in val.shape if isinstance(d, torch.SymInt)
                                 for s in d.node.expr.free_symbols}))


def _meta_at(meta: TensorMetadata, val: torch.Tensor, batch: dict) -> TensorMetadata:
    """``meta`` (recorded at other rows) with the shape, and contiguous strides, at the given rows."""
    shape = _shape_at(val, batch)
    return meta._replace(shape=shape, stride=contiguous_strides(shape))


def _set_tensor_meta(node: fx.Node, batch: dict, grad: bool) -> None:
    """``meta["tensor_meta"]`` from export's fake values, as shape propagation records it."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        node.meta["tensor_meta"] = _extract_tensor_metadata(_concrete(val, batch, grad))
    elif isinstance(val, (tuple, list)) and val and all(isinstance(v, torch.Tensor) for v in val):
        node.meta["tensor_meta"] = tuple(_extract_tensor_metadata(_concrete(v, batch, grad)) for v in val)


def _capture_error(model: nn.Module, exc: Exception) -> str:
    """One message naming where in the model's own source capture stopped, and what to do."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/torch/" not in f.filename]
    where = f" at {frames[-1].filename}:{frames[-1].lineno} (`{(frames[-1].line or '').strip()}`)" if frames else ""
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (f"could not capture {type(model).__name__}{where}: {type(exc).__name__}: {first_line}. Control flow on "
            "tensor values cannot be captured: compute it from shapes, move it out of forward, or pin the module "
            "that holds it with polyshard.shard")
