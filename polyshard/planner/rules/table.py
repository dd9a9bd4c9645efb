"""Rules for the ops a GPT and an MLP classifier use; any other op runs replicated (one warning).

Each rule sees the layouts its inputs arrive in and answers with a Decision. Partial sums never
leave a rule: the "dtensor" ops reduce them before handing their output on.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F
from torch import fx, nn

from polyshard.graph.capture import PIN_ATTR, shape_of
from polyshard.layout import Layout
from polyshard.planner.rules.base import Decision, RuleContext
from polyshard.planner.rules.einsum import (
    EinsumSpec, embedding_spec, independent_spec, linear_spec, matmul_spec, output_layout, pin_layouts,
    pin_output_layout, to_common,
)

ELEMENTWISE = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, torch.add, torch.sub, torch.mul,
    torch.tanh, torch.sigmoid, torch.relu, torch.exp, F.gelu, F.relu, F.silu, F.dropout, F.tanh,
    "add", "sub", "mul", "div", "relu", "gelu", "tanh", "sigmoid", "exp", "float", "to", "type_as",
    "contiguous", "clone", "detach", "pow", "sqrt", "rsqrt",
}
NON_TENSOR = {"size", "dim", "ndimension"}
CREATION = {torch.arange, torch.zeros, torch.ones, torch.full, torch.empty, torch.tensor, torch.ones_like,
            torch.zeros_like}
VIEWS = {"view", "reshape", torch.reshape, "flatten", torch.flatten}
POSITIONAL = {"triu", "tril", torch.triu, torch.tril}


def decide_all(node: fx.Node, ctx: RuleContext) -> list[Decision]:
    """Every Decision the search may choose for ``node`` given its inputs' layouts (default first)."""
    options = [decide(node, ctx)]
    pinned = node.op == "call_module" and hasattr(ctx.modules[node.target], PIN_ATTR)
    if node.op == "call_module" and not pinned:
        module = ctx.modules[node.target]
        if isinstance(module, nn.Linear):
            modes = ("column", "row", "replicated") + ("row_scatter",) * (ctx.sequence is None)
            options += [_linear(node, module, ctx, mode) for mode in modes]
        elif isinstance(module, nn.Embedding):
            options += [_embedding(node, module, ctx, split) for split in (True, False)]
    elif node.target is F.cross_entropy:
        options += [_cross_entropy(node, ctx, vocab) for vocab in (True, False)]
    unique: list[Decision] = []
    for d in options:
        if d is not None and d not in unique:
            unique.append(d)
    return unique


def decide(node: fx.Node, ctx: RuleContext) -> Decision:
    """The Decision for one node, given the layouts of the nodes before it."""
    if node.op == "placeholder":
        shape = shape_of(node)
        return Decision("local", {}, ctx.replicated(len(shape)) if shape is not None else None)
    if node.op == "output":
        return Decision("local", {n.name: ctx.replicated(len(shape_of(n))) for n in _tensor_inputs(node, ctx)}, None)
    if node.op == "get_attr":
        shape = shape_of(node)
        return Decision("local", {}, ctx.replicated(len(shape)) if shape is not None else None)
    if node.op == "call_module":
        module = ctx.modules[node.target]
        pin = getattr(module, PIN_ATTR, None)
        if pin is not None:
            return _pinned_module(node, module, pin, ctx)
        for kind, rule in ((nn.Linear, _linear), (nn.Embedding, _embedding), (nn.LayerNorm, _layer_norm)):
            if isinstance(module, kind):
                return rule(node, module, ctx)
        return _replicated(node, ctx, warn=True)
    target = node.target
    pin = getattr(target, PIN_ATTR, None)
    if pin is not None:
        return _pinned_function(node, target, pin, ctx)
    if target in NON_TENSOR or (target is getattr and node.args[1] in ("shape", "device", "dtype", "ndim")):
        return Decision("local", {}, None)
    if shape_of(node) is None and not _tensor_inputs(node, ctx):  # arithmetic on sizes: plain Python values
        return Decision("local", {}, None)
    if target is operator.getitem:
        return _getitem(node, ctx)
    if target in CREATION and not _tensor_inputs(node, ctx):
        return Decision("local", {}, ctx.replicated(len(shape_of(node) or ())))
    if target in ELEMENTWISE:
        return _elementwise(node, ctx)
    if target in VIEWS:
        return _view(node, ctx)
    if target in POSITIONAL:  # the value depends on where an element sits: whole tensors only
        return _replicated(node, ctx)
    if target in ("transpose", torch.transpose, "permute", torch.permute):
        return _permute(node, ctx)
    if target is F.scaled_dot_product_attention:
        return _attention(node, ctx)
    if target in (F.softmax, F.log_softmax, "softmax", "log_softmax", torch.softmax):
        return _softmax(node, ctx)
    if target is F.cross_entropy:
        return _cross_entropy(node, ctx)
    if target in ("sum", "mean", torch.sum, torch.mean):
        return _reduction(node, ctx)
    if target in (torch.matmul, operator.matmul, "matmul"):
        return _matmul(node, ctx)
    return _replicated(node, ctx, warn=True)


# -- helpers -------------------------------------------------------------------------------
def _tensor_inputs(node: fx.Node, ctx: RuleContext) -> list[fx.Node]:
    return [n for n in node.all_input_nodes if isinstance(ctx.layout(n), Layout)]


def _replicated(node: fx.Node, ctx: RuleContext, warn: bool = False) -> Decision:
    """Gather every input and run the op whole on each rank: always correct."""
    if warn:
        what = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
        kind = type(ctx.modules[node.target]).__name__ if node.op == "call_module" else node.op
        ctx.warn(f"no sharding rule for `{what}` ({kind}); it runs replicated")
    inputs = {n.name: ctx.replicated(ctx.layout(n).ndim) for n in _tensor_inputs(node, ctx)}
    shape = shape_of(node)
    return Decision("local", inputs, ctx.replicated(len(shape)) if shape is not None else None)


def _reduced(layout: Layout) -> Layout:
    """``layout`` with its partial sums reduced (what a "dtensor" op hands on)."""
    return layout.with_dims(layout.dims)


def _without(layout: Layout, dims: list[int]) -> Layout:
    """``layout`` with the given dims gathered (and no partial sums)."""
    return layout.with_dims([() if i in dims else d for i, d in enumerate(layout.dims)])


def _norm_dim(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


# -- rules ---------------------------------------------------------------------------------
def _elementwise(node: fx.Node, ctx: RuleContext) -> Decision:
    """Broadcasting elementwise op: every input follows the most-split input, aligned from the right."""
    inputs = _tensor_inputs(node, ctx)
    out_shape = shape_of(node)
    if out_shape is None or not inputs:
        return _replicated(node, ctx)
    layouts = to_common([ctx.layout(n) for n in inputs])
    out_nd = len(out_shape)
    lead = max(layouts, key=lambda l: sum(map(len, l.dims)))
    shift = out_nd - lead.ndim
    out_dims = [()] * shift + [tuple(d) for d in lead.dims]
    out = lead.with_dims(out_dims)
    required = {}
    for n, l in zip(inputs, layouts):
        shape = shape_of(n)
        off = out_nd - len(shape)
        dims = [out_dims[off + i] if shape[i] == out_shape[off + i] else () for i in range(len(shape))]
        required[n.name] = l.with_dims(dims) if l.axes == out.axes else out.with_dims(dims)
    return Decision("local", required, out)


def _view(node: fx.Node, ctx: RuleContext) -> Decision:
    """view/reshape/flatten: a split moves to the first (outermost) piece of the dim it splits."""
    x = node.args[0]
    src = ctx.layout(x)
    in_shape, out_shape = shape_of(x), shape_of(node)
    out_dims: list[tuple[str, ...]] = [()] * len(out_shape)
    gather = []
    for in_group, out_group in _view_groups(in_shape, out_shape):
        sharded = [d for d in in_group if src.dims[d]]
        if not sharded:
            continue
        d = sharded[0]
        n = src.num_shards(d)
        real_in = [i for i in in_group if in_shape[i] != 1]
        real_out = [o for o in out_group if out_shape[o] != 1]
        if len(sharded) == 1 and real_in and d == real_in[0] and real_out and out_shape[real_out[0]] % n == 0:
            out_dims[real_out[0]] = src.dims[d]
        else:
            gather.extend(sharded)
    need = _without(src, gather)
    out = need.with_dims(out_dims)
    divisors = {o: out.num_shards(o) for o in range(len(out_shape)) if out_dims[o]}
    if node.target in ("flatten", torch.flatten):
        divisors = {}
    return Decision("local", {x.name: need}, out, shape_divisors=divisors)


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


def _permute(node: fx.Node, ctx: RuleContext) -> Decision:
    x = node.args[0]
    src = _without(ctx.layout(x), [])
    nd = src.ndim
    if node.target in ("transpose", torch.transpose):
        a, b = (_norm_dim(d, nd) for d in node.args[1:3])
        order = list(range(nd))
        order[a], order[b] = order[b], order[a]
    else:
        dims = node.args[1:] if not isinstance(node.args[1], (tuple, list)) else node.args[1]
        order = [_norm_dim(d, nd) for d in dims]
    return Decision("local", {x.name: src}, src.with_dims([src.dims[o] for o in order]))


def _getitem(node: fx.Node, ctx: RuleContext) -> Decision:
    src = ctx.layout(node.args[0])
    if isinstance(src, tuple):
        return Decision("local", {}, src[node.args[1]])
    if isinstance(src, Layout):
        return _replicated(node, ctx)
    return Decision("local", {}, None)


def _attention(node: fx.Node, ctx: RuleContext) -> Decision:
    """Attention is independent per (batch, head): q, k, v split alike on those dims run locally."""
    q, k, v = node.args[:3]
    lead = _without(ctx.layout(q), [2, 3])
    if len(node.args) > 3 or node.kwargs.get("attn_mask") is not None:
        lead = _without(lead, [0, 1])
    return Decision("local", {n.name: lead for n in (q, k, v)}, lead)


def _softmax(node: fx.Node, ctx: RuleContext) -> Decision:
    x = node.args[0]
    src = ctx.layout(x)
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else -1)
    need = _without(src, [_norm_dim(dim, src.ndim)])
    return Decision("local", {x.name: need}, need)


def _reduction(node: fx.Node, ctx: RuleContext) -> Decision:
    """sum/mean: split dims that are reduced are gathered first; the others stay split."""
    x = node.args[0]
    src = ctx.layout(x)
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    reduced = list(range(src.ndim)) if dim is None else [_norm_dim(d, src.ndim) for d in
                                                         (dim if isinstance(dim, (tuple, list)) else [dim])]
    need = _without(src, reduced)
    keep = node.kwargs.get("keepdim", node.args[2] if len(node.args) > 2 else False)
    dims = [() if i in reduced else d for i, d in enumerate(need.dims) if keep or i not in reduced]
    return Decision("local", {x.name: need}, need.with_dims(dims))


def _layer_norm(node: fx.Node, module: nn.LayerNorm, ctx: RuleContext) -> Decision:
    """Normalized dims whole, the others (batch, sequence) may stay split. On a split input the
    whole weights get partial gradients: DTensor runs it, and sums them over the split axes."""
    x = node.args[0]
    src = ctx.layout(x)
    need = _without(src, list(range(src.ndim - len(module.normalized_shape), src.ndim)))
    params = {name: ctx.replicated(p.ndim) for name, p in module.named_parameters(recurse=False)}
    impl = "dtensor" if params and not need.is_replicated else "local"
    return Decision(impl, {x.name: need}, need, params=params)


def _cross_entropy(node: fx.Node, ctx: RuleContext, vocab: bool | None = None) -> Decision | None:
    """Logits split over the classes stay split: vocabulary-parallel cross-entropy, no full logits.

    ``vocab`` forces the choice, for the search (True slices replicated logits); None if it cannot apply."""
    logits, target = node.args[:2]
    src = ctx.layout(logits)
    defaults = {"weight": None, "size_average": None, "reduce": None, "reduction": "mean", "label_smoothing": 0.0}
    plain = len(node.args) == 2 and all(node.kwargs.get(k, v) == v for k, v in defaults.items()) and src.ndim == 2
    if vocab is None:
        vocab = plain and bool(src.dims[1]) and not src.dims[0] and not src.partial
    if not vocab:
        return _replicated(node, ctx)
    if not plain or not ctx.all_axes or shape_of(logits)[1] % ctx.num_devices:
        return None
    need = src if src.dims[1] and not src.dims[0] and not src.partial else ctx.replicated(2).with_dims([(), ctx.all_axes])
    return Decision("vocab_ce", {logits.name: need, target.name: ctx.replicated(1)}, ctx.replicated(0))


def _linear(node: fx.Node, module: nn.Linear, ctx: RuleContext, mode: str | None = None) -> Decision | None:
    """Megatron's pairing: column-parallel after replicated input, row-parallel after a split last dim.

    ``mode`` ("column", "row", "row_scatter", "replicated") forces a choice, for the search; None if
    it cannot apply. "row_scatter" is row-parallel whose partial sums are reduce-scattered along the
    sequence (the dim before the features) instead of all-reduced: Megatron's sequence parallel, where
    the norms, dropout and residual adds that follow run on a slice of the sequence each. Under
    ``ctx.sequence`` every row-parallel product scatters where it can."""
    x = node.args[0]
    src = ctx.layout(x)
    fixed = ctx.param_layouts.get(id(module.weight))
    last = src.dims[-1]
    if mode is not None:
        rows, cols = {"column": (ctx.all_axes, ()), "row": ((), last or ctx.all_axes),
                      "row_scatter": ((), last or ctx.all_axes)}.get(mode, ((), ()))
        n = ctx.num_devices
        if mode != "replicated" and (not ctx.all_axes or module.in_features % n or module.out_features % n):
            return None
    elif fixed is not None:
        rows, cols = fixed.dims
        mode = "replicated" if fixed.is_replicated or (rows and cols) else "column" if rows else "row"
    elif last and not src.partial and module.in_features % src.num_shards(src.ndim - 1) == 0:
        mode, rows, cols = "row", (), last
    elif ctx.all_axes and module.out_features % ctx.num_devices == 0:
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
    params = {"weight": w} | ({"bias": Layout(ctx.op_axes, (w.dims[0],))} if module.bias is not None else {})
    impl = "local" if mode == "replicated" else "dtensor"
    return Decision(impl, {x.name: x_need}, out, params=params)


def _embedding(node: fx.Node, module: nn.Embedding, ctx: RuleContext, split: bool | None = None) -> Decision | None:
    """Vocabulary-parallel lookup (rows split, partial sums reduced) for tables taller than wide.

    ``split`` forces the choice, for the search; None if it cannot apply."""
    idx = node.args[0]
    src = ctx.layout(idx)
    fixed = ctx.param_layouts.get(id(module.weight))
    divides = bool(ctx.all_axes) and module.num_embeddings % ctx.num_devices == 0
    if split is None:
        split = divides and module.num_embeddings >= module.embedding_dim
    elif split and not divides:
        return None
    w = fixed if fixed is not None else Layout(ctx.op_axes, (ctx.all_axes, ())) if split else ctx.replicated(2)
    impl = "local" if w.is_replicated else "dtensor"
    return Decision(impl, {idx.name: ctx.replicated(src.ndim)}, ctx.replicated(src.ndim + 1), params={"weight": w})


def _matmul(node: fx.Node, ctx: RuleContext) -> Decision:
    a, b = node.args[:2]
    la, lb = ctx.layout(a), ctx.layout(b)
    spec = matmul_spec(la.ndim, lb.ndim)
    a_need = _without(la, [la.ndim - 1])
    if la.ndim == lb.ndim > 2:  # batched (attention scores, attention @ values): b's batch dims follow a's
        b_need = a_need.with_dims([*a_need.dims[:-2], (), ()])
    else:
        b_need = _without(lb, list(range(lb.ndim)))
    out = output_layout(spec, [a_need, b_need], node.name)
    return Decision("local", {a.name: a_need, b.name: b_need}, out)


# -- pins ----------------------------------------------------------------------------------
def _pinned_module(node: fx.Node, module: nn.Module, pin, ctx: RuleContext) -> Decision:
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
    layouts = pin_layouts(spec, pin.in_strategy, shapes, ctx.op_axes, node.target)
    params = {"weight": layouts[-1]} if len(layouts) > len(inputs) else {}
    if isinstance(module, nn.Linear) and module.bias is not None:
        params["bias"] = layouts[-1].with_dims([layouts[-1].dims[0]])
    for name, p in module.named_parameters(recurse=False):
        params.setdefault(name, Layout.replicated(layouts[0].axes, p.ndim))
    natural = output_layout(spec, layouts, node.target) if params.get("weight") is not None and spec.output else None
    out = pin_output_layout(pin.out_strategy, shape_of(node), natural, ctx.op_axes, node.target)
    return Decision("dtensor", {n.name: l for n, l in zip(inputs, layouts)}, out, params=params)


def _pinned_function(node: fx.Node, fn, pin, ctx: RuleContext) -> Decision:
    inputs = [n for n in node.args if isinstance(n, fx.Node)]
    shapes = [shape_of(n) for n in inputs]
    spec = spec_for_function(pin.fn, [len(s) for s in shapes])
    layouts = pin_layouts(spec, pin.in_strategy, shapes, ctx.op_axes, pin.name)
    natural = output_layout(spec, layouts, pin.name) if spec.output else None
    out = pin_output_layout(pin.out_strategy, shape_of(node), natural, ctx.op_axes, pin.name)
    return Decision("dtensor", {n.name: l for n, l in zip(inputs, layouts)}, out)


def spec_for_function(fn, ndims: list[int]) -> EinsumSpec:
    """The einsum spec of a known function; unknown ones get independent letters (no output)."""
    if fn in (torch.matmul, operator.matmul, torch.mm) and len(ndims) == 2:
        return matmul_spec(*ndims)
    if fn is F.linear and len(ndims) in (2, 3):
        return linear_spec(ndims[0], len(ndims) == 3)
    if fn is F.embedding and len(ndims) == 2:
        return embedding_spec(ndims[0])
    return independent_spec(ndims)
