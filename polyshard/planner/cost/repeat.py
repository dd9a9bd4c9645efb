"""Which nodes cost what their twin does under a plan, so a stack of layers is costed as two."""

from __future__ import annotations

from torch import fx

from polyshard.graph.capture import shape_of
from polyshard.graph.twins import twins
from polyshard.layout import Layout
from polyshard.planner.cost.comm import first_to_take
from polyshard.plan import Plan


def costed_as(gm: fx.GraphModule, plan: Plan) -> dict[str, str]:
    """Node name -> its twin's (:func:`polyshard.graph.twins.twins`), where the node's compute and
    communication under ``plan`` are its twin's (recompute aside, which the caller compares)."""
    table = twins(gm)
    return {node.name: twin.name for node in gm.graph.nodes
            if (twin := table.get(node.name)) is not None and _costs_alike(node, twin, plan)}


def _costs_alike(node: fx.Node, twin: fx.Node, plan: Plan) -> bool:
    """``node`` makes its twin's choice (implementation, parameter, input and output layouts) on inputs
    that arrive as the twin's do: in the same layout and shape, and moved by it exactly when the twin
    moves its own (the first consumer to take a value in a layout moves it; a rotary table read by every
    layer is moved once)."""
    mine, theirs = plan.nodes.get(node.name), plan.nodes.get(twin.name)
    if mine is None or theirs is None:
        return mine is theirs
    if not (mine.impl == theirs.impl and _same(mine.output, theirs.output) and _same(mine.params, theirs.params)
            and mine.shape_divisors == theirs.shape_divisors):
        return False
    for a, b in zip(node.all_input_nodes, twin.all_input_nodes):
        dst = mine.inputs.get(a.name)
        if not _same(dst, theirs.inputs.get(b.name)):
            return False
        src = plan.nodes[a.name].output if a.name in plan.nodes else None
        if a is not b and (shape_of(a) != shape_of(b) or
                           not _same(src, plan.nodes[b.name].output if b.name in plan.nodes else None)):
            return False
        if isinstance(src, Layout) and dst is not None and not _same(src, dst) and \
                first_to_take(node, a, dst, plan) != first_to_take(twin, b, dst, plan):
            return False
    return True


def _same(x, y) -> bool:
    """Equal, most often by being one object (a twin's choice shares its layouts)."""
    return x is y or x == y
