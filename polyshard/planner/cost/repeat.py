"""Which nodes cost what their twin does under a plan, so a stack of layers is costed as two."""

from __future__ import annotations

import weakref

from torch import fx

from polyshard.graph.capture import shape_of
from polyshard.graph.twins import twins
from polyshard.layout import Layout
from polyshard.planner.cost.comm import first_to_take
from polyshard.plan import Plan


def costed_as(gm: fx.GraphModule, plan: Plan) -> dict[str, str]:
    """Node name -> its twin's (:func:`polyshard.graph.twins.twins`), where the node's compute and
    communication under ``plan`` are its twin's (recompute aside, which the caller compares)."""
    known = _ALIKE.setdefault(gm, {})
    found = known.get(id(plan.nodes))
    if found is None or found[0] is not plan.nodes:  # a plan's precision, mesh or recompute leave this as it is
        same = {node.name: twin.name for node, twin, inputs in _pairs(gm) if _costs_alike(node, twin, inputs, plan)}
        found = known[id(plan.nodes)] = plan.nodes, same
    return found[1]


_PAIRS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per graph: every plan asks again
_ALIKE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per graph, per layouts: their nodes and twins


def _pairs(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node, tuple[tuple[fx.Node, fx.Node, bool], ...]]]:
    """Each node with a twin, the twin, and their inputs pairwise with whether those are one value or two of one
    shape (what no plan changes)."""
    found = _PAIRS.get(gm)
    if found is None:
        table = twins(gm)
        found = _PAIRS[gm] = [
            (node, twin, tuple((a, b, a is b or shape_of(a) == shape_of(b))
                               for a, b in zip(node.all_input_nodes, twin.all_input_nodes)))
            for node in gm.graph.nodes if (twin := table.get(node.name)) is not None]
    return found


def _costs_alike(node: fx.Node, twin: fx.Node, inputs, plan: Plan) -> bool:
    """``node`` makes its twin's choice (implementation, parameter, input and output layouts) on inputs
    that arrive as the twin's do: in the same layout and shape, and moved by it exactly when the twin
    moves its own (the first consumer to take a value in a layout moves it; a rotary table read by every
    layer is moved once)."""
    nodes = plan.nodes
    mine, theirs = nodes.get(node.name), nodes.get(twin.name)
    if mine is None or theirs is None:
        return mine is theirs
    if not (mine.impl == theirs.impl and _same(mine.output, theirs.output) and _same(mine.params, theirs.params)
            and mine.shape_divisors == theirs.shape_divisors):
        return False
    for a, b, alike in inputs:
        dst = mine.inputs.get(a.name)
        if not (alike and _same(dst, theirs.inputs.get(b.name))):
            return False
        src = nodes[a.name].output if a.name in nodes else None
        if a is not b and not _same(src, nodes[b.name].output if b.name in nodes else None):
            return False
        if isinstance(src, Layout) and dst is not None and not _same(src, dst) and \
                first_to_take(node, a, dst, plan) != first_to_take(twin, b, dst, plan):
            return False
    return True


def _same(x, y) -> bool:
    """Equal, most often by being one object (a twin's choice shares its layouts)."""
    return x is y or x == y
