"""Sharding propagation: walk the graph in order, each op choosing its layouts from its inputs'.

Pinned ops keep their strategies; the rest follow the op rules. Parameters shared by two ops
(tied embeddings) keep the layout the first op chose, and the second adapts to it; those the graph reads as
values stay whole.
"""

from __future__ import annotations

from typing import Callable

from torch import fx

from polyshard.errors import PolyshardError
from polyshard.graph.params import modules_of, parameters_of, read_whole
from polyshard.layout import Axes, Layout
from polyshard.plan import Plan
from polyshard.planner.rules import RuleContext, decide, row_splits


def propagate(gm: fx.GraphModule, op_axes: Axes, warn: Callable[[str], None], sequence: bool = False,
              inputs: dict[str, Layout] | None = None, rows: frozenset[str] = frozenset(),
              params: dict[str, Layout] | None = None) -> Plan:
    """A Plan for every node and parameter of ``gm`` on the given op axes (``sequence``: row-parallel
    products reduce-scatter along the sequence, Megatron's sequence parallel; ``inputs``: layouts of graph
    inputs, by placeholder name, that a dataset strategy splits; ``rows``: the axes split the batch rows
    instead of operators, held at dim 0 by these values, every weight whole but those ``params`` lays out, by
    name)."""
    modules = modules_of(gm)
    listed = parameters_of(gm)
    named = dict(listed.named)
    fixed = {id(named[name]): layout for name, layout in (params or {}).items()}
    whole = read_whole(gm)
    by_id = {id(p): p for p in named.values()}
    fixed |= {i: Layout.replicated(op_axes, by_id[i].ndim) for i in whole if i not in fixed}
    ctx = RuleContext(op_axes, modules, {}, fixed, warn, sequence, inputs or {}, rows)
    plan = Plan(op_axes=op_axes)
    param_names = listed.name_of
    owner: dict[int, str] = {i: f"{name} (read whole by the graph)" for i, name in whole.items()}
    for node in gm.graph.nodes:
        decision = decide(node, ctx)
        ctx.layouts[node.name] = decision.output
        for pname, layout in decision.params.items():
            param = getattr(modules[node.target], pname)
            fixed = ctx.param_layouts.setdefault(id(param), layout)
            owner.setdefault(id(param), node.target)
            if fixed != layout:
                raise PolyshardError(
                    f"conflicting pins: `{owner[id(param)]}` lays out the shared parameter "
                    f"`{param_names[id(param)]}` as {fixed.describe() or 'R'} but `{node.target}` needs "
                    f"{layout.describe() or 'R'}; pin both alike or unpin one"
                )
            plan.params.setdefault(param_names[id(param)], ctx.param_layouts[id(param)])
        plan.nodes[node.name] = decision
    for name, p in listed.named:
        plan.params.setdefault(name, Layout.replicated(op_axes, p.ndim))
    plan.row_splits.update(row_splits(gm, plan.nodes))
    return plan
