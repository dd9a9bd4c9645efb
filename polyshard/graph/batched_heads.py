"""Attention written over batch x heads merged into one dim (BLOOM's ALiBi ``baddbmm`` and ``bmm``), kept 4-D.

A merged dim cut by heads is no even split of the merged dim once a rank holds more than one row, so no layout
can name it and the attention would run whole on every rank. Where every use of the merged values is a batched
product, a transpose of the last dims or the view that splits batch and heads apart again, the same products run
on the 4-D values (``matmul`` broadcasts over batch and heads), and heads split as they do in any other attention.
"""

from __future__ import annotations

import contextlib
import math
import operator

import torch
from torch import fx
from torch._guards import detect_fake_mode

aten = torch.ops.aten
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_PRODUCTS = {aten.bmm.default, aten.baddbmm.default}
_CASTS = {aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout}


def unmerge_batched_heads(graph: fx.Graph) -> None:
    """Rewrite the merged values' products on their 4-D values, or leave the graph as it is where any use of
    them is something else."""
    twins = _merged(graph)
    if not twins:
        return
    made: dict[fx.Node, fx.Node] = {}
    rewritten = [n for n in graph.nodes if n in twins or _unmerges(n, twins)]
    for node in rewritten:
        with graph.inserting_before(node):
            if node in twins:
                made[node] = _four_d(graph, node, twins[node][0], made)
            else:
                node.replace_all_uses_with(made[node.args[0]])
    for node in reversed(rewritten):
        if not node.users:
            graph.erase_node(node)
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target is operator.mul and not n.users]:
        graph.erase_node(node)  # the batch x heads sizes the merging views were given


def _merged(graph: fx.Graph) -> dict[fx.Node, tuple[str, int]]:
    """Each merged value, how it comes to be ("view" of a 4-D value, "repeat" of a 3-D one over the batch, "cast",
    "transpose", or a product) and its heads (the size merged second), of those whose every use this rewrite
    knows; none where no product is left."""
    kinds: dict[fx.Node, str] = {}
    heads: dict[fx.Node, int] = {}  # the size of the dim merged in second place
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        inputs = [a for a in node.args if isinstance(a, fx.Node)]
        if node.target in _VIEWS and _merges(node):
            kinds[node], heads[node] = "view", _val(node.args[0]).shape[1]
        elif node.target is aten.repeat.default and _repeats_over_batch(node):
            kinds[node], heads[node] = "repeat", _val(node.args[0]).shape[0]
        elif node.target is aten.transpose.int and inputs[0] in kinds and 0 not in {d % 3 for d in _dims(node)}:
            kinds[node], heads[node] = "transpose", heads[inputs[0]]
        elif node.target in _CASTS and inputs[0] in kinds:  # ALiBi's table cast to the compute dtype
            kinds[node], heads[node] = "cast", heads[inputs[0]]
        elif node.target in _PRODUCTS and inputs and all(a in kinds for a in inputs) and \
                len({heads[a] for a in inputs}) == 1:
            kinds[node], heads[node] = "product", heads[inputs[0]]
    tables: set[fx.Node] = set()  # a repeated table and its casts, in graph order
    for n, kind in kinds.items():
        if kind == "repeat" or kind == "cast" and n.args[0] in tables:
            tables.add(n)
    while True:  # drop what has a use not known, and what reads a value dropped, until nothing changes
        merged = {n: (kind, heads[n]) for n, kind in kinds.items()}
        dropped = {n for n in kinds if any(u not in kinds and not _unmerges(u, merged) for u in n.users)
                   or any(isinstance(a, fx.Node) and a not in kinds for a in n.args[:3] if kinds[n] == "product")
                   or kinds[n] in ("transpose", "cast") and n.args[0] not in kinds
                   # a table repeated over the batch broadcasts only as a product's added term, or cast
                   or n in tables and any(kinds.get(u) != "cast" and (kinds.get(u) != "product" or u.args[0] is not n)
                                          for u in n.users)}
        if not dropped:
            break
        kinds = {n: kind for n, kind in kinds.items() if n not in dropped}
    return {n: (kind, heads[n]) for n, kind in kinds.items()} if "product" in kinds.values() else {}


def _merges(node: fx.Node) -> bool:
    """A view of (B, H, *rest) as 3-D (B * H, *rest'), rest' holding what rest holds (BLOOM's ALiBi table from a
    padding mask: (B, H, S) as (B * H, 1, S))."""
    src, out = _val(node.args[0]), _val(node)
    return src is not None and out is not None and src.dim() >= 2 and out.dim() == 3 and \
        isinstance(src.shape[1], int) and all(isinstance(d, int) for d in (*src.shape[2:], *out.shape[1:])) and \
        math.prod(src.shape[2:]) == math.prod(out.shape[1:])


def _repeats_over_batch(node: fx.Node) -> bool:
    """``x.repeat(B, 1, 1)`` of a 3-D (H, *rest): batch copies of a table per head, merged as the views merge."""
    src, tiles = _val(node.args[0]), node.args[1]
    return src is not None and src.dim() == 3 and len(tiles) == 3 and list(tiles[1:]) == [1, 1]


def _unmerges(node: fx.Node, merged: dict[fx.Node, tuple[str, int]]) -> bool:
    """A view of a merged value back into (B, H, *rest)."""
    if node.op != "call_function" or node.target not in _VIEWS or node.args[0] not in merged:
        return False
    src, out = _val(node.args[0]), _val(node)
    return out.dim() == src.dim() + 1 and out.shape[1] == merged[node.args[0]][1] and \
        tuple(out.shape[2:]) == tuple(src.shape[1:])


def _four_d(graph: fx.Graph, node: fx.Node, kind: str, made: dict[fx.Node, fx.Node]) -> fx.Node:
    """The (B, H, ...) value of merged ``node``, built before it."""
    def call(target, *args, **kwargs) -> fx.Node:
        out = graph.call_function(target, args, kwargs)
        out.meta = {k: v for k, v in node.meta.items() if k != "val"}
        values = [made_val(a) for a in args]
        with detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)]) or contextlib.nullcontext():
            out.meta["val"] = target(*values, **kwargs)
        return out

    def made_val(a):
        return a.meta["val"] if isinstance(a, fx.Node) else a

    if kind == "view":
        src, out = _val(node.args[0]), _val(node)
        if tuple(src.shape[2:]) == tuple(out.shape[1:]):
            return node.args[0]
        return call(aten.reshape.default, node.args[0], [-1, src.shape[1], *out.shape[1:]])
    if kind == "repeat":  # broadcast over the batch instead of copied
        return call(aten.unsqueeze.default, node.args[0], 0)
    if kind == "cast":
        return call(node.target, made[node.args[0]], *node.args[1:], **node.kwargs)
    if kind == "transpose":
        return call(aten.transpose.int, made[node.args[0]], *(d + 1 if d >= 0 else d for d in _dims(node)))
    if node.target is aten.bmm.default:
        return call(aten.matmul.default, made[node.args[0]], made[node.args[1]])
    added, a, b = (made[x] for x in node.args[:3])
    alpha, beta = node.kwargs.get("alpha", 1), node.kwargs.get("beta", 1)
    product = call(aten.matmul.default, a, b)
    product = product if alpha == 1 else call(aten.mul.Tensor, product, alpha)
    added = added if beta == 1 else call(aten.mul.Tensor, added, beta)
    return call(aten.add.Tensor, added, product)


def _dims(node: fx.Node) -> tuple[int, int]:
    """A transpose's two dims, of the merged value (3-D: dim 0 is batch x heads)."""
    return tuple(node.args[1:3])


def _val(node) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None
