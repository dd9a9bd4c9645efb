"""Rules for the ops transformers use, at torch's level (fx's graphs) and at aten's (export's, read by
their names through ``op_key``); any other op runs replicated (one warning).

Each rule sees the layouts its inputs arrive in and answers with a NodePlan. Partial sums never
leave a rule: the "dtensor" ops (and "rows", a table's lookup split unevenly) reduce them before handing their
output on.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F
from torch import fx, nn

from polyshard.graph.capture import is_conv1d, is_rms_norm, linear_dims, shape_of, shapes_of
from polyshard.graph.export import SCALED_LOOKUP, own_forward, shape_at_any_rows
from polyshard.graph.ops import op_key
from polyshard.graph.params import parameters_of
from polyshard.errors import PolyshardError
from polyshard.layout import Layout
from polyshard.pin import PIN_ATTR
from polyshard.plan import NodePlan
from polyshard.planner.rules.base import RuleContext
from polyshard.planner.rules.spatial import SPATIAL_MODULES, upsample, cross_entropy as spatial_cross_entropy
from polyshard.planner.rules.einsum import (
    EinsumSpec, embedding_spec, independent_spec, linear_spec, matmul_spec, output_layout, pin_layouts,
    pin_output_layout, to_common,
)

ELEMENTWISE = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, torch.add, torch.sub, torch.mul,
    torch.tanh, torch.sigmoid, torch.relu, torch.exp, F.gelu, F.relu, F.silu, F.dropout, F.tanh,
    "add", "sub", "mul", "div", "relu", "gelu", "tanh", "sigmoid", "exp", "float", "to", "type_as",
    "contiguous", "clone", "detach", "pow", "square", "sqrt", "rsqrt", "neg", "silu", "dropout", "alias", "erf", "log",
    "abs", "sin", "cos", "reciprocal", "minimum", "maximum", "clamp", "eq", "ne", "le", "lt", "ge", "gt",
    "__and__", "__or__", "bitwise_and", "bitwise_or", "bitwise_not", "logical_and", "logical_or", "logical_not",
    "floor_divide", "where", "masked_fill", "zeros_like", "ones_like", "full_like", "empty_like", "lift_fresh_copy",
}
IN_PLACE = {"add_", "sub_", "mul_", "div_"}
NON_TENSOR = {"size", "dim", "ndimension", "sym_size"}
CREATION = {torch.arange, torch.zeros, torch.ones, torch.full, torch.empty, torch.tensor, torch.ones_like,
            torch.zeros_like, "arange", "full", "zeros", "ones", "empty", "scalar_tensor"}
# New tensors of a given size: the tensor they are called on only lends its dtype and device.
CREATION_FROM = {"new_ones", "new_zeros", "new_full", "new_empty"}
VIEWS = {"view", "reshape", torch.reshape, "flatten", torch.flatten}
# Modules that act on each element alone (no weights): their input's layout carries through.
ELEMENTWISE_MODULES = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Identity)
# The value depends on where an element sits: whole tensors.
POSITIONAL = {"triu", "tril", torch.triu, torch.tril}
# Ops over all elements at once, whole tensors too: a histogram, a write at indices, and grouped products (a mixture
# of experts' `grouped_mm`: offsets assign runs of rows to each expert's matrix).
WHOLE = {"histc", "index_put_", "grouped_mm_fallback", "_grouped_mm"}
# Ops along one dim (positional arg 1, or ``dim``): that dim whole, the others may stay split.
ALONG_DIM = {F.softmax, F.log_softmax, "softmax", "log_softmax", torch.softmax, "cumsum", "slice", "select",
             "split", "split_with_sizes", "chunk", "cat", "stack", torch.cat, torch.stack, "repeat_interleave",
             "topk", torch.topk, "sort", torch.sort}


def decide_all(node: fx.Node, ctx: RuleContext) -> list[NodePlan]:
    """Every NodePlan the search may choose for ``node`` given its inputs' layouts (default first)."""
    options = [decide(node, ctx)]
    pinned = node.op == "call_module" and hasattr(ctx.modules[node.target], PIN_ATTR)
    if node.op == "call_module" and not pinned:
        module = ctx.modules[node.target]
        if isinstance(module, nn.Linear) or is_conv1d(module):
            modes = ("column", "row", "replicated", "batch") + ("row_scatter",) * (ctx.sequence is None)
            options += [_linear(node, module, ctx, mode) for mode in modes]
        elif isinstance(module, nn.Embedding):
            options += [_embedding(node, module, ctx, split) for split in ("rows", "columns", "whole", "batch")]
    elif op_key(node) in (F.cross_entropy, "cross_entropy_loss"):
        options += [_cross_entropy(node, ctx, vocab) for vocab in (True, False)]
    unique: list[NodePlan] = []
    for d in options:
        if d is not None and d not in unique:
            unique.append(d)
    return unique


def decide(node: fx.Node, ctx: RuleContext) -> NodePlan:
    """The NodePlan for one node, given the layouts of the nodes before it."""
    if node.op == "placeholder":
        shape = shape_of(node)
        fixed = ctx.inputs.get(node.name)
        return NodePlan("local", {}, fixed or (ctx.replicated(len(shape)) if shape is not None else None))
    if node.op == "output":
        return NodePlan("local", {n.name: ctx.replicated(len(shape_of(n))) for n in _tensor_inputs(node, ctx)}, None)
    if node.op == "get_attr":
        shape = shape_of(node)
        return NodePlan("local", {}, ctx.replicated(len(shape)) if shape is not None else None)
    if node.op == "call_module":
        module = ctx.modules[node.target]
        pin = getattr(module, PIN_ATTR, None)
        if pin is not None:
            return _pinned_module(node, module, pin, ctx)
        rule = next((MODULE_RULES[k] for k in type(module).__mro__ if k in MODULE_RULES), None)
        if rule is None and (is_conv1d(module) or is_rms_norm(module)):  # known by their shape, not their type
            rule = _linear if is_conv1d(module) else _layer_norm
        if ctx.rows and rule in (_linear, _embedding):  # the op ranks split rows here: weights whole
            tied = any(id(p) in ctx.param_layouts for p in module.parameters(recurse=False))
            whole = None if tied else "whole" if rule is _embedding else "replicated"
            return rule(node, module, ctx, "batch") or rule(node, module, ctx, whole) or _replicated(node, ctx)
        if rule is None:
            return _replicated(node, ctx, warn=True)
        return rule(node, module, ctx) or _replicated(node, ctx)
    target = op_key(node)
    pin = getattr(node.target, PIN_ATTR, None)
    if pin is not None:
        return _pinned_function(node, node.target, pin, ctx)
    if target in NON_TENSOR or (target is getattr and node.args[1] in ("shape", "device", "dtype", "ndim")):
        return NodePlan("local", {}, None)
    if shape_of(node) is None and not _tensor_inputs(node, ctx):  # arithmetic on sizes: plain Python values
        return NodePlan("local", {}, None)
    if (target in CREATION and not _tensor_inputs(node, ctx)) or target in CREATION_FROM:
        return NodePlan("local", {n.name: ctx.layout(n) for n in _tensor_inputs(node, ctx)},
                        ctx.replicated(len(shape_of(node) or ())))
    if isinstance(node.target, torch._ops.HigherOrderOperator):
        return _replicated(node, ctx)  # a body export outlined (e.g. rotary tables under no_grad): run whole
    rule = RULES.get(target)
    return rule(node, ctx) if rule is not None else _replicated(node, ctx, warn=True)


# -- helpers -------------------------------------------------------------------------------
def _tensor_inputs(node: fx.Node, ctx: RuleContext) -> list[fx.Node]:
    return [n for n in node.all_input_nodes if isinstance(ctx.layout(n), Layout)]


def _replicated(node: fx.Node, ctx: RuleContext, warn: bool = False) -> NodePlan:
    """Gather every input and run the op whole on each rank: always correct."""
    if warn:
        what = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
        kind = type(ctx.modules[node.target]).__name__ if node.op == "call_module" else node.op
        ctx.warn(f"no sharding rule for `{what}` ({kind}); it runs replicated")
    inputs = {n.name: ctx.replicated(ctx.layout(n).ndim) for n in _tensor_inputs(node, ctx)}
    if shapes_of(node) is not None:  # several tensors (a split, an outlined body): each whole
        return NodePlan("local", inputs, tuple(ctx.replicated(len(s)) for s in shapes_of(node)))
    shape = shape_of(node)
    return NodePlan("local", inputs, ctx.replicated(len(shape)) if shape is not None else None)


def _reduced(layout: Layout) -> Layout:
    """``layout`` with its partial sums reduced (what a "dtensor" op hands on)."""
    return layout.with_dims(layout.dims)


def _without(layout: Layout, dims: list[int]) -> Layout:
    """``layout`` with the given dims gathered (and no partial sums)."""
    return layout.with_dims([() if i in dims else d for i, d in enumerate(layout.dims)])


def _norm_dim(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


# -- rules ---------------------------------------------------------------------------------
def _elementwise(node: fx.Node, ctx: RuleContext, in_place: bool = False) -> NodePlan:
    """Broadcasting elementwise op: every input follows the most-split input (``in_place``: the one it writes),
    aligned from the right."""
    inputs = _tensor_inputs(node, ctx)
    out_shape = shape_of(node)
    if out_shape is None or not inputs:
        return _replicated(node, ctx)
    layouts = to_common([ctx.layout(n) for n in inputs])
    out_nd = len(out_shape)
    written = in_place and node.args[0] in inputs
    lead = layouts[inputs.index(node.args[0])] if written else max(layouts, key=lambda l: sum(map(len, l.dims)))
    shift = out_nd - lead.ndim
    out_dims = [()] * shift + [tuple(d) for d in lead.dims]
    trainable = [n for n in inputs if getattr(n.meta.get("tensor_meta"), "requires_grad", False)]
    if any(_broadcast_over(shape_of(n), out_shape, out_dims) for n in trainable):
        out_dims = [()] * out_nd  # a trainable value (RMSNorm's weight) broadcast over a split dim: partial grads
    out = lead.with_dims(out_dims)
    required = {}
    for n, l in zip(inputs, layouts):
        shape = shape_of(n)
        off = out_nd - len(shape)
        dims = [out_dims[off + i] if shape[i] == out_shape[off + i] else () for i in range(len(shape))]
        required[n.name] = l.with_dims(dims) if l.axes == out.axes else out.with_dims(dims)
    return NodePlan("local", required, out)


def _in_place(node: fx.Node, ctx: RuleContext) -> NodePlan:
    """``x /= y`` and the like: the tensor written keeps its layout, the others follow it."""
    return _elementwise(node, ctx, in_place=True)


def _broadcast_over(shape, out_shape, out_dims) -> bool:
    """Whether a value of ``shape`` is broadcast (absent, or of size 1) along a split dim of the output."""
    off = len(out_shape) - len(shape)
    return any(dims and (d < off or shape[d - off] != out_shape[d]) for d, dims in enumerate(out_dims))


def _view(node: fx.Node, ctx: RuleContext) -> NodePlan:
    """view/reshape/flatten: a split moves to the first (outermost) piece of the dim it splits."""
    x = node.args[0]
    src = ctx.layout(x)
    in_shape, out_shape = shape_of(x), shape_of(node)
    # which dims hold the same elements, told at more rows where the batch is symbolic: at one row a view merging
    # heads split over the ranks with the batch would read as leaving the batch alone, though at two rows a rank's
    # piece of the merged dim is no even split of it
    in_any, out_any = shape_at_any_rows(x), shape_at_any_rows(node)
    if in_any is None or out_any is None:
        in_any, out_any = in_shape, out_shape
    out_dims: list[tuple[str, ...]] = [()] * len(out_shape)
    gather = []
    for in_group, out_group in _view_groups(in_any, out_any):
        sharded = [d for d in in_group if src.dims[d]]
        if not sharded:
            continue
        d = sharded[0]
        n = src.num_shards(d)
        real_in = [i for i in in_group if in_any[i] != 1]
        real_out = [o for o in out_group if out_any[o] != 1]
        if len(sharded) == 1 and real_in and d == real_in[0] and real_out and out_shape[real_out[0]] % n == 0:
            out_dims[real_out[0]] = src.dims[d]
        else:
            gather.extend(sharded)
    need = _without(src, gather)
    out = need.with_dims(out_dims)
    divisors = {o: out.num_shards(o) for o in range(len(out_shape)) if out_dims[o]}
    if op_key(node) in ("flatten", torch.flatten):  # its arguments name dims, not sizes: nothing to localize
        divisors = {}
    return NodePlan("local", {x.name: need}, out, shape_divisors=divisors)


def _view_groups(in_shape, out_shape) -> list[tuple[list[int], list[int]]]:
    """Pair runs of input dims with runs of output dims that hold the same elements."""
    groups, i, j = [], 0, 0
    while i < len(in_shape) or j < len(out_shape):
        gi, gj = [], []
        pi = pj = 1
        while True:
            if pi <= pj and i < len(in_shape):
                gi.append(i); pi *= in_shape[i]; i += 1
            elif j < len(out_shape):
                gj.append(j); pj *= out_shape[j]; j += 1
            else:
                break
            if pi == pj and (i == len(in_shape) or in_shape[i] != 1) and (j == len(out_shape) or out_shape[j] != 1):
                break
        groups.append((gi, gj))
    return groups


def _permute(node: fx.Node, ctx: RuleContext, order: list[int] | None = None) -> NodePlan:
    x = node.args[0]
    src = _without(ctx.layout(x), [])
    nd = src.ndim
    if order is None and op_key(node) in ("transpose", torch.transpose):
        a, b = (_norm_dim(d, nd) for d in node.args[1:3])
        order = list(range(nd))
        order[a], order[b] = order[b], order[a]
    elif order is None:
        dims = node.args[1:] if not isinstance(node.args[1], (tuple, list)) else node.args[1]
        order = [_norm_dim(d, nd) for d in dims]
    return NodePlan("local", {x.name: src}, src.with_dims([src.dims[o] for o in order]))


def _index(node: fx.Node, ctx: RuleContext) -> NodePlan:
    """aten.index (``x[:, :, [i, j]]``): the dims its integer index tensors pick from whole, the dims around them keep
    their split, where the index tensors are of one shape and side by side (their result takes their place, as in
    numpy); anything else runs whole."""
    x, indices = node.args[0], node.args[1]
    picked = [i for i, t in enumerate(indices) if t is not None]
    metas = [indices[i].meta.get("tensor_meta") if isinstance(indices[i], fx.Node) else None for i in picked]
    if not picked or picked != list(range(picked[0], picked[-1] + 1)) or any(
            m is None or m.dtype == torch.bool for m in metas) or len({tuple(m.shape) for m in metas}) > 1:
        return _replicated(node, ctx)
    need = _without(ctx.layout(x), picked)
    dims = need.dims[:picked[0]] + ((),) * len(metas[0].shape) + need.dims[picked[-1] + 1:]
    inputs = {x.name: need} | {indices[i].name: ctx.replicated(len(m.shape)) for i, m in zip(picked, metas)}
    return NodePlan("local", inputs, need.with_dims(list(dims)))


def _gather(node: fx.Node, ctx: RuleContext) -> NodePlan:
    """gather (``out[i][j] = x[i][index[i][j]]`` along ``dim``): that dim whole in both, each other dim split alike in
    both where they are of one size (each rank picks from its own rows); where the index is shorter, whole."""
    x = node.kwargs.get("input", node.args[0] if node.args else None)
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    index = node.kwargs.get("index", node.args[2] if len(node.args) > 2 else None)
    x_shape, index_shape = shape_of(x), shape_of(index)
    layouts = to_common([ctx.layout(x), ctx.layout(index)])
    lead = max(layouts, key=lambda l: sum(map(len, l.dims)))
    whole = [d for d in range(lead.ndim) if d == _norm_dim(dim, lead.ndim) or x_shape[d] != index_shape[d]]
    need = _without(lead, whole)
    return NodePlan("local", {x.name: need, index.name: need}, need)


def _lookup(node: fx.Node, ctx: RuleContext) -> NodePlan:
    """A table's lookup called as a function (a module's forward traced through, as OPT's positions are): the table
    whole; the ids keep their split where the table takes no gradient, else whole, as each rank's gradient of a
    whole table from its own ids would be only its part."""
    if op_key(node) == "embedding":  # aten's: (weight, ids)
        table, ids = node.args[:2]
    else:
        ids, table = node.kwargs.get("input", node.args[0]), node.kwargs.get("weight", (*node.args, None)[1])
    trainable = getattr(table.meta.get("tensor_meta"), "requires_grad", False)
    need = ctx.replicated(ctx.layout(ids).ndim) if trainable else _without(ctx.layout(ids), [])
    return NodePlan("local", {table.name: ctx.replicated(ctx.layout(table).ndim), ids.name: need},
                    need.with_dims([*need.dims, ()]))


def _getitem(node: fx.Node, ctx: RuleContext) -> NodePlan:
    src = ctx.layout(node.args[0])
    if isinstance(src, tuple):
        return NodePlan("local", {}, src[node.args[1]])
    if isinstance(src, Layout):
        return _replicated(node, ctx)
    return NodePlan("local", {}, None)


def _attention(node: fx.Node, ctx: RuleContext) -> NodePlan:
    """Attention is independent per (batch, head): q, k, v split alike on those dims run locally."""
    q, k, v = node.args[:3]
    lead = _without(ctx.layout(q), [2, 3])
    if any(shape_of(n)[1] % lead.num_shards(1) for n in (k, v)):  # fewer kv heads (GQA) than pieces
        lead = _without(lead, [1])
    inputs = {n.name: lead for n in (q, k, v)}
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if isinstance(mask, fx.Node):  # split alike on the batch and head dims it does not broadcast over
        q_shape, m_shape = shape_of(q), shape_of(mask)
        off = len(q_shape) - len(m_shape)
        inputs[mask.name] = lead.with_dims([lead.dims[off + i] if off + i < 2 and size == q_shape[off + i] else ()
                                            for i, size in enumerate(m_shape)])
    return NodePlan("local", inputs, lead)


def _along_dim(node: fx.Node, ctx: RuleContext) -> NodePlan:
    """Softmax, cumsum, slice, select, split, cat, stack, repeat_interleave, topk, sort: the dim they work along
    whole, others as they come."""
    target = getattr(op_key(node), "__name__", op_key(node))  # torch.cat as "cat"
    if target == "repeat_interleave":  # repeats per element, or the input flattened first: whole
        repeats = node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
        if not isinstance(repeats, int) or node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else None) is None:
            return _replicated(node, ctx)
    parts = node.args[0] if target in ("cat", "stack") else [node.args[0]]
    pos = 2 if target in ("split", "split_with_sizes", "chunk", "repeat_interleave", "topk") else 1
    default = -1 if target in ("softmax", "log_softmax", "topk", "sort") else 0
    dim = node.kwargs.get("dim", node.args[pos] if len(node.args) > pos else default)
    layouts = to_common([ctx.layout(n) for n in parts])
    lead = max(layouts, key=lambda l: sum(map(len, l.dims)))
    need = _without(lead, [_norm_dim(dim, lead.ndim)])
    inputs = {n.name: need for n in parts}
    dims = list(need.dims)
    if target == "stack":
        dims.insert(_norm_dim(dim, need.ndim + 1), ())
    elif target == "select":
        del dims[_norm_dim(dim, need.ndim)]
    out = need.with_dims(dims)
    several = shapes_of(node)
    return NodePlan("local", inputs, tuple(out for _ in several) if several is not None else out)


def _repeat(node: fx.Node, ctx: RuleContext) -> NodePlan:
    """repeat (tiles): a dim tiled more than once whole, one tiled once keeps its split, new leading dims whole."""
    x, tiles = node.args[0], node.args[1] if isinstance(node.args[1], (list, tuple)) else node.args[1:]
    src = ctx.layout(x)
    lead = len(tiles) - src.ndim
    need = _without(src, [d for d in range(src.ndim) if tiles[lead + d] != 1])  # a symbolic count may be more
    return NodePlan("local", {x.name: need}, need.with_dims([()] * lead + list(need.dims)))


def _broadcast_view(node: fx.Node, ctx: RuleContext) -> NodePlan:
    """unsqueeze, squeeze, expand: split dims keep their split; an expand's sizes are made local."""
    x = node.args[0]
    src = _without(ctx.layout(x), [])
    in_shape, out_shape = shape_of(x), shape_of(node)
    target = op_key(node)
    if target == "unsqueeze":
        dims = list(src.dims)
        dims.insert(_norm_dim(node.args[1], len(out_shape)), ())
    elif target == "squeeze":  # drops the named size-1 dims, or all of them
        named = node.args[1] if len(node.args) > 1 else range(len(in_shape))
        named = {_norm_dim(d, len(in_shape)) for d in (named if isinstance(named, (list, tuple, range)) else [named])}
        dims = [d for i, d in enumerate(src.dims) if not (i in named and in_shape[i] == 1)]
    else:
        dims = [()] * (len(out_shape) - src.ndim) + list(src.dims)
    out = src.with_dims(dims)
    divisors = {o: out.num_shards(o) for o in range(len(out_shape)) if dims[o]} if target == "expand" else {}
    return NodePlan("local", {x.name: src}, out, shape_divisors=divisors)


def _reduction(node: fx.Node, ctx: RuleContext) -> NodePlan:
    """sum/mean: split dims that are reduced are gathered first; the others stay split."""
    x = node.args[0]
    src = ctx.layout(x)
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    reduced = list(range(src.ndim)) if dim is None else [_norm_dim(d, src.ndim) for d in
                                                         (dim if isinstance(dim, (tuple, list)) else [dim])]
    need = _without(src, reduced)
    keep = node.kwargs.get("keepdim", node.args[2] if len(node.args) > 2 else False)
    dims = [() if i in reduced else d for i, d in enumerate(need.dims) if keep or i not in reduced]
    return NodePlan("local", {x.name: need}, need.with_dims(dims))


def _layer_norm(node: fx.Node, module: nn.Module, ctx: RuleContext) -> NodePlan:
    """LayerNorm or RMSNorm: normalized dims whole, the others (batch, sequence) may stay split. On a
    split input the whole weights get partial gradients: DTensor runs it, and sums them over the split axes."""
    x = node.args[0]
    src = ctx.layout(x)
    normalized = len(getattr(module, "normalized_shape", None) or module.weight.shape)
    need = _without(src, list(range(src.ndim - normalized, src.ndim)))
    params = {name: ctx.replicated(p.ndim) for name, p in module.named_parameters(recurse=False)}
    impl = "dtensor" if params and not need.is_replicated else "local"
    return NodePlan(impl, {x.name: need}, need, params=params)


def _on_last_dims(node: fx.Node, ctx: RuleContext, whole: int) -> NodePlan:
    """An op on its first input's last ``whole`` dims, given whole tensors besides (a weight, a bias), whose output has
    that input's dims with the last whole: the other dims may stay split. A trainable tensor beside a split input
    gets partial gradients: DTensor runs the op and sums them over the split axes (given by keyword, it stays
    whole)."""
    x = node.args[0]
    src = ctx.layout(x)
    others = [n for n in _tensor_inputs(node, ctx) if n is not x]
    need = _without(src, list(range(src.ndim - whole, src.ndim)))
    trainable = any(getattr(n.meta.get("tensor_meta"), "requires_grad", False) for n in others)
    if trainable and any(n not in node.args for n in others):
        need = _without(src, list(range(src.ndim)))
    inputs = {n.name: ctx.replicated(ctx.layout(n).ndim) for n in others} | {x.name: need}
    return NodePlan("dtensor" if trainable and not need.is_replicated else "local", inputs, need)


def _layer_norm_function(node: fx.Node, ctx: RuleContext) -> NodePlan:
    """A norm written as a call (no weights, or weights it computes, as OLMo's and Nemotron's): as the module's."""
    shape = node.args[1] if len(node.args) > 1 else node.kwargs["normalized_shape"]
    return _on_last_dims(node, ctx, len(shape))


def _linear_function(node: fx.Node, ctx: RuleContext) -> NodePlan:
    """A product by a weight written as a call (a mixture of experts' router): the weight whole."""
    return _on_last_dims(node, ctx, 1)


def _cross_entropy(node: fx.Node, ctx: RuleContext, vocab: bool | None = None) -> NodePlan | None:
    """Logits split over the classes stay split: vocabulary-parallel cross-entropy, no full logits.

    ``vocab`` forces the choice, for the search (True slices replicated logits); None if it cannot apply."""
    logits, target = node.args[:2]
    src = ctx.layout(logits)
    if op_key(node) == "cross_entropy_loss":  # aten's: (input, target, weight, reduction, ignore_index, smoothing)
        given = dict(zip(("weight", "reduction", "ignore_index", "label_smoothing"), node.args[2:])) | node.kwargs
        defaults, rest = {"weight": None, "reduction": 1, "label_smoothing": 0.0}, ()
    else:
        given = node.kwargs
        defaults = {"weight": None, "size_average": None, "reduce": None, "reduction": "mean", "label_smoothing": 0.0}
        rest = node.args[2:]
    plain = not rest and all(given.get(k, v) == v for k, v in defaults.items()) and src.ndim == 2
    if vocab is None:
        vocab = plain and bool(src.dims[1]) and not src.dims[0] and not src.partial
    if not vocab:
        return _replicated(node, ctx)
    if not plain or not ctx.all_axes or shape_of(logits)[1] % ctx.num_devices:
        return None
    need = src if src.dims[1] and not src.dims[0] and not src.partial else ctx.replicated(2).with_dims([(), ctx.all_axes])
    return NodePlan("vocab_ce", {logits.name: need, target.name: ctx.replicated(1)}, ctx.replicated(0))


def _linear(node: fx.Node, module: nn.Linear, ctx: RuleContext, mode: str | None = None) -> NodePlan | None:
    """Megatron's pairing: column-parallel after replicated input, row-parallel after a split last dim.

    ``mode`` ("column", "row", "row_scatter", "replicated", "batch") forces a choice, for the search; None if
    it cannot apply. "batch": the weight whole on rows split over op axes (see :func:`_whole_on_rows`).
    "row_scatter" is row-parallel whose partial sums are reduce-scattered along the sequence (the dim before the
    features) instead of all-reduced: Megatron's sequence parallel, where the norms, dropout and residual adds
    that follow run on a slice of the sequence each. Under ``ctx.sequence`` every row-parallel product scatters
    where it can."""
    x = node.args[0]
    src = ctx.layout(x)
    order = linear_dims(module)  # GPT-2's Conv1D stores its weight transposed: layouts are flipped to match
    out_features, in_features = (module.weight.shape[d] for d in order)
    fixed = ctx.param_layouts.get(id(module.weight))
    fixed = fixed.with_dims([fixed.dims[d] for d in order]) if fixed is not None else None
    last = src.dims[-1]
    if mode == "batch":
        return _whole_on_rows(node, x, module, ctx, 1)
    if mode is not None:
        rows, cols = {"column": (ctx.all_axes, ()), "row": ((), last or ctx.all_axes),
                      "row_scatter": ((), last or ctx.all_axes)}.get(mode, ((), ()))
        split = out_features if mode == "column" else in_features  # the weight's dim the mode cuts
        if mode != "replicated" and (not ctx.all_axes or split % ctx.num_devices):
            return None
    elif fixed is not None:
        rows, cols = fixed.dims
        mode = "replicated" if fixed.is_replicated or (rows and cols) else "column" if rows else "row"
    elif last and not src.partial and in_features % src.num_shards(src.ndim - 1) == 0:
        mode, rows, cols = "row", (), last
    elif ctx.all_axes and out_features % ctx.num_devices == 0:
        mode, rows, cols = "column", ctx.all_axes, ()
    else:
        mode = "replicated"
    x_need = ctx.replicated(src.ndim)
    if mode == "replicated":
        w = fixed or ctx.replicated(2)
    else:
        w = Layout(ctx.op_axes, (rows, cols))
        x_need = x_need.with_dims([()] * (src.ndim - 1) + [cols])
    out = _reduced(output_layout(linear_spec(src.ndim, False), [x_need, w], node.name))
    if mode == "row_scatter" or (mode == "row" and ctx.sequence):  # sequence parallel: where it can, else None
        seq, sizes = src.ndim - 2, dict(ctx.op_axes)
        if seq >= 1 and not out.dims[seq] and shape_of(node)[seq] % math.prod(sizes[a] for a in cols) == 0:
            out = out.with_dims([cols if d == seq else dims for d, dims in enumerate(out.dims)])
        elif mode == "row_scatter":
            return None
    bias = {"bias": Layout(ctx.op_axes, (w.dims[0],))} if getattr(module, "bias", None) is not None else {}
    params = {"weight": w.with_dims([w.dims[d] for d in order])} | bias
    impl = "local" if mode == "replicated" else "dtensor"
    return NodePlan(impl, {x.name: x_need}, out, params=params)


def _embedding(node: fx.Node, module: nn.Embedding, ctx: RuleContext, split: str | None = None) -> NodePlan | None:
    """Vocabulary-parallel lookup (rows split, partial sums reduced) for tables taller than wide; split by
    features where their rows do not divide.

    ``split`` forces the choice, for the search: "rows", "columns" (each rank looks up its features of every
    row, and hands them on split: a vocabulary that does not divide, tied to a row-parallel head, still
    splits), "whole" or "batch" (whole, on lookups whose rows are split over op axes: :func:`_whole_on_rows`);
    None if it cannot apply."""
    idx = node.args[0]
    if split == "batch":
        return _whole_on_rows(node, idx, module, ctx, 0)
    src = ctx.layout(idx)
    fixed = ctx.param_layouts.get(id(module.weight))
    sizes = {"rows": module.num_embeddings, "columns": module.embedding_dim}
    if split is None:
        tall = bool(ctx.all_axes) and sizes["rows"] >= sizes["columns"]
        split = next((s for s in ("rows", "columns") if tall and sizes[s] % ctx.num_devices == 0), "whole")
    elif split != "whole" and (not ctx.all_axes or sizes[split] % ctx.num_devices):
        return None
    out = ctx.replicated(src.ndim + 1)
    if fixed is not None:
        w = fixed
    elif split == "whole":
        w = ctx.replicated(2)
    else:
        w = Layout(ctx.op_axes, (ctx.all_axes, ()) if split == "rows" else ((), ctx.all_axes))
    if w.dims[1]:  # features split: handed on so, no partial sums
        out = out.with_dims([()] * src.ndim + [w.dims[1]])
    impl = "local" if w.is_replicated else "dtensor"
    return NodePlan(impl, {idx.name: ctx.replicated(src.ndim)}, out, params={"weight": w})


def _whole_on_rows(node: fx.Node, x: fx.Node, module: nn.Module, ctx: RuleContext,
                   features: int) -> NodePlan | None:
    """A module's weights whole, run on its input's rows (dim 0) split over op axes as they arrive, or split here
    over every op axis where ``ctx.rows`` says dim 0 holds them (a stage whose operator ranks split the batch);
    DTensor sums the weights' gradients over the axes. None where the rows are not split or a weight is laid out
    otherwise already (a table tied to a split head)."""
    own = dict(module.named_parameters(recurse=False))
    params = {name: ctx.replicated(p.ndim) for name, p in own.items()}
    if any(ctx.param_layouts.get(id(p), params[name]) != params[name] for name, p in own.items()):
        return None
    src = ctx.layout(x)
    need = _without(src, list(range(src.ndim - features, src.ndim)))
    if x.name in ctx.rows and ctx.all_axes and need.is_replicated and shape_of(x)[0] % ctx.num_devices == 0:
        need = need.with_dims([ctx.all_axes] + [()] * (src.ndim - 1))
    if src.ndim == features or not need.dims[0]:
        return None
    out = need.with_dims(list(need.dims[:src.ndim - features]) + [()] * (len(shape_of(node)) - src.ndim + features))
    return NodePlan("local" if need.is_replicated else "dtensor", {x.name: need}, out, params=params)


def _matmul(node: fx.Node, ctx: RuleContext) -> NodePlan:
    a, b = node.args[:2]
    la, lb = ctx.layout(a), ctx.layout(b)
    spec = matmul_spec(la.ndim, lb.ndim)
    a_need = _without(la, [la.ndim - 1])
    if la.ndim == lb.ndim > 2:  # batched (attention scores, attention @ values): b's batch dims follow a's
        b_need = a_need.with_dims([*a_need.dims[:-2], (), ()])
    else:
        b_need = _without(lb, list(range(lb.ndim)))
    out = output_layout(spec, [a_need, b_need], node.name)
    return NodePlan("local", {a.name: a_need, b.name: b_need}, out)


# -- pins ----------------------------------------------------------------------------------
def _pinned_module(node: fx.Node, module: nn.Module, pin, ctx: RuleContext) -> NodePlan:
    """A user's strategy for a module: Linear and Embedding split their weights by it too."""
    inputs = [n for n in node.args if isinstance(n, fx.Node)]
    shapes = [shape_of(n) for n in inputs]
    if isinstance(module, nn.Linear):
        spec = linear_spec(len(shapes[0]), False)
    elif isinstance(module, nn.Embedding):
        spec = embedding_spec(len(shapes[0]))
    else:
        spec = independent_spec([len(s) for s in shapes])
    if isinstance(module, (nn.Linear, nn.Embedding)):
        shapes.append(tuple(module.weight.shape))  # the strategy's last entry is the weight
    if pin.manual_split is not None:  # the rows' pieces are given, not cut evenly: any count of pieces divides
        shapes[-1] = (len(pin.manual_split) * ctx.num_devices, *shapes[-1][1:])
    layouts = pin_layouts(spec, pin.in_strategy, shapes, ctx.op_axes, node.target)
    params = {"weight": layouts[-1]} if len(layouts) > len(inputs) else {}
    if isinstance(module, nn.Linear) and module.bias is not None:
        params["bias"] = layouts[-1].with_dims([layouts[-1].dims[0]])
    for name, p in module.named_parameters(recurse=False):
        params.setdefault(name, Layout.replicated(layouts[0].axes, p.ndim))
    natural = output_layout(spec, layouts, node.target) if params.get("weight") is not None and spec.output else None
    out = pin_output_layout(pin.out_strategy, shape_of(node), natural, ctx.op_axes, node.target)
    if pin.manual_split is not None:
        _check_manual_split(node, module, pin.manual_split, layouts)
    impl = "rows" if pin.manual_split is not None else "dtensor"
    return NodePlan(impl, {n.name: l for n, l in zip(inputs, layouts)}, out, params=params)


def _check_manual_split(node: fx.Node, table: nn.Embedding, rows: tuple[int, ...], layouts: list[Layout]) -> None:
    """An uneven split of a table's rows: one count per piece its strategy makes, adding up to the table,
    nothing else split the lookup would need to gather, and a forward each piece may run on its own rows."""
    target, (ids, weight) = node.target, layouts
    pieces = weight.num_shards(0)
    if pieces != len(rows):
        raise PolyshardError(f"`{target}`: manual_split {rows} gives {len(rows)} pieces, but the strategy splits the "
                             f"table's rows into {pieces}; give one row count per piece")
    if sum(rows) != table.num_embeddings:
        raise PolyshardError(f"`{target}`: manual_split {rows} adds up to {sum(rows)} rows; the table has "
                             f"{table.num_embeddings}")
    if weight.dims[1] or set(weight.dims[0]) & {a for d in ids.dims for a in d}:
        raise PolyshardError(f"`{target}`: manual_split splits the table's rows only; keep its columns whole and "
                             "the ids unsplit over the axes that split the rows")
    if table.max_norm is not None or table.scale_grad_by_freq or table.sparse:
        raise PolyshardError(f"`{target}`: manual_split takes a plain lookup; max_norm, scale_grad_by_freq and "
                             "sparse gradients need the whole table")
    if own_forward(table, nn.Embedding) and not node.meta.get(SCALED_LOOKUP):
        raise PolyshardError(f"`{target}`: manual_split runs each piece through {type(table).__name__}'s own "
                             "forward, which capture did not see only scale its lookup (a transformers model's "
                             "is checked; a model fx traces is not); split the table evenly instead")


def row_splits(gm: fx.GraphModule, nodes: dict) -> dict[str, tuple[int, ...]]:
    """The rows per piece of each table a pin splits unevenly (its node runs "rows"), by parameter name."""
    listed = parameters_of(gm)
    out = {}
    split = {name for name, d in nodes.items() if d.impl == "rows"}
    for node in gm.graph.nodes if split else ():
        if node.name not in split:
            continue
        weight = gm.get_submodule(node.target).weight
        sharers = sorted({n.target for n in gm.graph.nodes if n.op == "call_module" and n.target != node.target
                          and any(p is weight for _, _, p in listed.owned[n.target])})
        if sharers:
            raise PolyshardError(f"`{node.target}`: manual_split splits a table that `{sharers[0]}` shares (tied "
                                 "weights); untie them or split the table evenly")
        out[listed.name_of[id(weight)]] = getattr(gm.get_submodule(node.target), PIN_ATTR).manual_split
    return out


def left_whole(gm: fx.GraphModule, plan) -> list[tuple[str, tuple[int, ...]]]:
    """(module path, weight shape) of each Linear and Embedding that ``plan`` runs whole on every rank of its
    operator axes while neither dim of its weight divides by their ranks (a split cuts one): the rules could not
    split it, whatever the search preferred."""
    ranks = math.prod(size for _, size in plan.op_axes)
    out: dict[str, tuple[int, ...]] = {}
    for node in gm.graph.nodes if ranks > 1 else ():
        entry = plan.nodes.get(node.name)
        if node.op != "call_module" or entry is None or node.target in out:
            continue
        module = gm.get_submodule(node.target)
        weight = entry.params.get("weight")
        if weight is None or not weight.is_replicated:
            continue
        if (isinstance(module, nn.Embedding) or linear_dims(module)) and all(s % ranks for s in module.weight.shape):
            out[node.target] = tuple(module.weight.shape)
    return list(out.items())


def _pinned_function(node: fx.Node, fn, pin, ctx: RuleContext) -> NodePlan:
    inputs = [n for n in node.args if isinstance(n, fx.Node)]
    shapes = [shape_of(n) for n in inputs]
    spec = spec_for_function(pin.fn, [len(s) for s in shapes])
    layouts = pin_layouts(spec, pin.in_strategy, shapes, ctx.op_axes, pin.name)
    natural = output_layout(spec, layouts, pin.name) if spec.output else None
    out = pin_output_layout(pin.out_strategy, shape_of(node), natural, ctx.op_axes, pin.name)
    return NodePlan("dtensor", {n.name: l for n, l in zip(inputs, layouts)}, out)


def spec_for_function(fn, ndims: list[int]) -> EinsumSpec:
    """The einsum spec of a known function; unknown ones get independent letters (no output)."""
    if fn in (torch.matmul, operator.matmul, torch.mm) and len(ndims) == 2:
        return matmul_spec(*ndims)
    if fn is F.linear and len(ndims) in (2, 3):
        return linear_spec(ndims[0], len(ndims) == 3)
    if fn is F.embedding and len(ndims) == 2:
        return embedding_spec(ndims[0])
    return independent_spec(ndims)


def _transposed(node: fx.Node, ctx: RuleContext) -> NodePlan:
    """t, numpy's T: the dims reversed."""
    return _permute(node, ctx, order=list(reversed(range(ctx.layout(node.args[0]).ndim))))


def _edge_op(node: fx.Node, ctx: RuleContext) -> NodePlan:
    """diff and pad read past each element along the dims they act on: those dims whole."""
    x = node.args[0]
    whole = ([node.args[2] if len(node.args) > 2 else -1] if op_key(node) == "diff"
             else range(-len(node.args[1]) // 2, 0))
    need = _without(ctx.layout(x), [_norm_dim(d, ctx.layout(x).ndim) for d in whole])
    return NodePlan("local", {n.name: ctx.replicated(ctx.layout(n).ndim) for n in _tensor_inputs(node, ctx)}
                    | {x.name: need}, need)


def _any_cross_entropy(node: fx.Node, ctx: RuleContext) -> NodePlan:
    return spatial_cross_entropy(node, ctx) or _cross_entropy(node, ctx)


def _interpolate(node: fx.Node, ctx: RuleContext) -> NodePlan:
    """Images (4-D) upsample tile by tile; anything else runs whole."""
    if shape_of(node.args[0]) is not None and len(shape_of(node.args[0])) == 4:
        return upsample(node, None, ctx)
    return _replicated(node, ctx, warn=True)


def _elementwise_module(node: fx.Node, module: nn.Module, ctx: RuleContext) -> NodePlan:
    return _elementwise(node, ctx)


def _registry(*families: tuple) -> dict:
    """op -> its rule, family by family; an op two families name keeps the first one's."""
    out: dict = {}
    for targets, rule in families:
        for target in targets:
            out.setdefault(target, rule)
    return out


# The rule for each op, by family (ops named by their torch function, aten name or method name); an op
# without one runs replicated, with a warning naming it.
RULES = _registry(
    ((operator.getitem,), _getitem),
    (ELEMENTWISE, _elementwise),
    (IN_PLACE, _in_place),
    (VIEWS, _view),
    (POSITIONAL, _replicated),
    (WHOLE, _replicated),
    (("transpose", torch.transpose, "permute", torch.permute), _permute),
    (("t",), _transposed),
    (("index",), _index),
    (("gather", torch.gather), _gather),
    (("embedding", F.embedding), _lookup),
    (("repeat",), _repeat),
    (("unsqueeze", "squeeze", "expand"), _broadcast_view),
    (ALONG_DIM, _along_dim),
    (("diff", "pad"), _edge_op),
    ((F.scaled_dot_product_attention,), _attention),
    ((F.cross_entropy, "cross_entropy_loss"), _any_cross_entropy),
    ((F.interpolate,), _interpolate),
    (("sum", "mean", torch.sum, torch.mean), _reduction),
    ((torch.matmul, operator.matmul, "matmul"), _matmul),
    ((F.layer_norm, "layer_norm"), _layer_norm_function),
    ((F.linear, "linear"), _linear_function),
)
# The rule for each module type (its subclasses too), given the module.
MODULE_RULES = {nn.Linear: _linear, nn.Embedding: _embedding, nn.LayerNorm: _layer_norm, **SPATIAL_MODULES,
                **dict.fromkeys(ELEMENTWISE_MODULES, _elementwise_module)}
