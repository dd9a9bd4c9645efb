"""Pipeline chunks whose operator ranks split the batch rows instead of operators (a sub-mesh per stage).

A stage's tp ranks may act as data parallel: every weight of the stage whole, each rank a share of each
micro-batch's rows, the weights' gradients summed over the ranks in each backward. That pays where a stage's
weights are small beside its activations, or its ops do not split. The layouts come from the op rules under
that reading (``RuleContext.rows``), on the model captured at rows that divide over the ranks; a parameter
several chunks share keeps the layout the operator-split plan gives it, so chunks of either kind agree on it.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from torch import fx

from polyshard.graph.capture import shape_of
from polyshard.graph.params import parameters_of
from polyshard.graph.stage_cuts import assign_chunks
from polyshard.layout import Axes, Layout
from polyshard.plan import Plan
from polyshard.planner.propagate import propagate


def batch_values(gm: fx.GraphModule, wider: fx.GraphModule) -> frozenset[str] | None:
    """The values whose dim 0 holds the batch rows: those whose dim 0 differs between two captures of one model
    on different row counts; None where the captures are not the same graph."""
    nodes, others = list(gm.graph.nodes), list(wider.graph.nodes)
    if [(n.name, n.target) for n in nodes] != [(n.name, n.target) for n in others]:
        return None
    return frozenset(n.name for n, o in zip(nodes, others)
                     if shape_of(n) and shape_of(o) and shape_of(n)[0] != shape_of(o)[0])


def shared_parameters(gm: fx.GraphModule) -> tuple[str, ...]:
    """The parameters several ops of ``gm`` use (a tied table and head), by name."""
    name_of = parameters_of(gm).name_of
    return tuple(name_of[i] for i, users in _users(gm).items() if len(users) > 1)


def rows_layouts(wider: fx.GraphModule, batch: frozenset[str], op_axes: Axes, shared: dict[str, Layout]) -> Plan:
    """The model captured as ``wider`` laid out on ``op_axes`` splitting the rows of the values in ``batch``,
    every weight whole but the ``shared`` ones, laid out as given."""
    return propagate(wider, op_axes, lambda msg: None, rows=batch, params=shared)


def with_rows_chunks(plan: Plan, rows: Plan, gm: fx.GraphModule, tp_split: Sequence[str]) -> Plan:
    """``plan`` (cut into pipeline chunks) with the chunks whose ``tp_split`` is "rows" laid out as ``rows``
    (:func:`rows_layouts`); graph inputs, and parameters chunks of both kinds use, stay as ``plan`` lays them out."""
    chunk_of = assign_chunks(gm, plan.stage_boundaries)
    split_rows = {c for c, split in enumerate(tp_split) if split == "rows"}
    nodes = {name: rows.nodes[name] if chunk_of.get(name) in split_rows else entry for name, entry in plan.nodes.items()}
    name_of = parameters_of(gm).name_of
    params = dict(plan.params)
    for i, users in _users(gm).items():
        if {chunk_of.get(n.name) for n in users} <= split_rows:
            params[name_of[i]] = rows.params[name_of[i]]
    return dataclasses.replace(plan, nodes=nodes, params=params, stage_tp_split=tuple(tp_split))


def _users(gm: fx.GraphModule) -> dict[int, list[fx.Node]]:
    """Each parameter's users (by id): the module calls that own it, and the nodes that read it."""
    owned = parameters_of(gm).owned
    params = dict(gm.named_parameters(remove_duplicate=False))
    out: dict[int, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module":
            for _, _, p in owned.get(n.target, ()):
                out.setdefault(id(p), []).append(n)
        elif n.op == "get_attr" and n.target in params:
            out.setdefault(id(params[n.target]), []).append(n)
    return out
