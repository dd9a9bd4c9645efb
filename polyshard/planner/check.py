"""A plan meets the program it is to run, checked whole before lowering: a hand-edited plan fails
naming its own entries, not deep inside DTensor."""

from __future__ import annotations

import math
from typing import Any, Iterator

from torch import fx

from polyshard.errors import PolyshardError
from polyshard.layout import Axes, Layout, refine
from polyshard.plan import NodePlan, Plan
from polyshard.planner.rules import RuleContext, decide_all

IMPLS = ("local", "dtensor", "vocab_ce", "spatial", "rows")


def check_plan(plan: Plan, gm: fx.GraphModule, mesh: Axes) -> None:
    """Raise unless ``plan`` covers exactly ``gm``'s parameters and nodes, in layouts over its mesh's
    operator axes that divide the shapes they split, each node as one of the op rules' strategies."""
    made_for = f" (the plan was made for {plan.model})" if plan.model else ""
    sizes = dict(mesh)
    for name, size in plan.op_axes:
        if sizes.get(name) != size:
            raise PolyshardError(f"the plan splits operators over {name}={size}, but the mesh is "
                                 f"{', '.join(f'{n}={s}' for n, s in mesh)}")
    params = dict(gm.named_parameters())
    for name, p in params.items():
        if name not in plan.params:
            raise PolyshardError(f"the plan has no layout for parameter `{name}`{made_for}; plan this model again")
        shape = tuple(p.shape)
        rows = plan.row_splits.get(name)
        if rows is not None:
            if sum(rows) != shape[0] or len(rows) != plan.params[name].num_shards(0):
                raise PolyshardError(f"the plan splits parameter `{name}`'s {shape[0]} rows as {rows}, which is not "
                                     f"one count per piece of its layout adding up to the table{made_for}")
            shape = (len(rows), *shape[1:])  # its pieces are given, not cut evenly
        _check_layout(plan.params[name], plan.op_axes, f"parameter `{name}`", shape)
    extra = sorted(set(plan.params) - set(params))
    if extra:
        raise PolyshardError(f"the plan lays out parameters this model does not have: {', '.join(extra[:3])}"
                             f"{made_for}; plan this model again")
    names = {n.name for n in gm.graph.nodes}
    extra = sorted(set(plan.nodes) - names)
    if extra:
        raise PolyshardError(f"the plan names graph nodes this model does not have: {', '.join(extra[:3])}"
                             f"{made_for}; graph nodes are named as `polyshard explain` lists them")
    modules = dict(gm.named_modules())
    canonical = {id(p): name for name, p in params.items()}  # a tied weight goes by its first name
    for node in gm.graph.nodes:
        entry = plan.nodes.get(node.name)
        if entry is None:
            raise PolyshardError(f"the plan has no entry for graph node `{node.name}` ({_what(node)}){made_for}")
        _check_node(node, entry, plan, modules, canonical)
    _check_rules(plan, gm, modules)


def _check_layout(layout: Layout, op_axes: Axes, what: str, shape: tuple[int, ...] | None = None) -> None:
    ops = dict(op_axes)
    foreign = [n for n, _ in layout.axes if n.split(":")[0] not in ops]
    if foreign and layout.axes:
        raise PolyshardError(f"{what} is laid out over axis {foreign[0]!r}, which is not one of the plan's operator "
                             f"axes {list(ops)}")
    if layout.axes and layout.axes != op_axes:
        if math.prod(s for _, s in layout.axes) != math.prod(ops.values()):
            raise PolyshardError(f"{what} is laid out over {dict(layout.axes)}, not the {math.prod(ops.values())} "
                                 f"devices of the plan's operator axes {ops}")
        refine(layout.axes, op_axes)
    if shape is not None:
        layout.check_divides(shape, what)


def _check_node(node: fx.Node, entry: NodePlan, plan: Plan, modules: dict, canonical: dict[int, str]) -> None:
    where = f"plan node `{node.name}` ({_what(node)})"
    if entry.impl not in IMPLS:
        raise PolyshardError(f"{where}: impl {entry.impl!r} is not one of {', '.join(IMPLS)}")
    inputs = {n.name for n in node.all_input_nodes}
    for name, layout in entry.inputs.items():
        if name not in inputs:
            raise PolyshardError(f"{where} takes no input `{name}`; its inputs are {sorted(inputs) or 'none'}")
        _check_layout(layout, plan.op_axes, f"{where}, input `{name}`")
    for layout in _layouts(entry.output):
        _check_layout(layout, plan.op_axes, f"{where}, output")
    owned = dict(modules[node.target].named_parameters(recurse=False)) if node.op == "call_module" else {}
    for pname, layout in entry.params.items():
        if pname not in owned:
            raise PolyshardError(f"{where} lays out a parameter `{pname}` its module does not hold")
        full = canonical[id(owned[pname])]
        if plan.params.get(full) != layout:
            raise PolyshardError(f"{where} lays out `{pname}` as {layout.describe() or 'R'}, but the plan's "
                                 f"parameter `{full}` is {plan.params[full].describe() or 'R'}; make them agree")
    if entry.impl == "local" and any(not layout.is_replicated for layout in entry.params.values()):
        raise PolyshardError(f"{where} runs as written ('local') but its weight is split; a split weight needs "
                             "impl 'dtensor'")
    out = next(_layouts(entry.output), None)
    for dim in entry.shape_divisors:
        if out is None or not 0 <= dim < out.ndim:
            raise PolyshardError(f"{where}: shape_divisors names dim {dim}, and its output has "
                                 f"{out.ndim if out else 0} dims")


def _check_rules(plan: Plan, gm: fx.GraphModule, modules: dict) -> None:
    """Each node's entry is a strategy the op rules offer for the layouts it takes its inputs in."""
    inputs = {n.name: plan.nodes[n.name].output for n in gm.graph.nodes  # the inputs lie as the plan says
              if n.op == "placeholder" and isinstance(plan.nodes[n.name].output, Layout)}
    ctx = RuleContext(plan.op_axes, modules, {}, {}, lambda msg: None, None, inputs)
    for node in gm.graph.nodes:
        entry = plan.nodes[node.name]
        for inp in node.all_input_nodes:
            ctx.layouts[inp.name] = entry.inputs.get(inp.name, plan.nodes[inp.name].output)
        options = decide_all(node, ctx)
        if entry not in options:
            shown = "; ".join(_describe(d) for d in options[:4])
            raise PolyshardError(f"plan node `{node.name}` ({_what(node)}) is {_describe(entry)}, which its op "
                                 f"rules do not offer for those inputs; they offer: {shown}")


def _layouts(value: Any) -> Iterator[Layout]:
    if isinstance(value, Layout):
        yield value
    elif isinstance(value, tuple):
        for v in value:
            yield from _layouts(v)


def _describe(d: NodePlan) -> str:
    ins = ", ".join(f"{k} {v.describe() or 'R'}" for k, v in d.inputs.items())
    ps = ", ".join(f"{k} {v.describe() or 'R'}" for k, v in d.params.items())
    out = ", ".join(l.describe() or "R" for l in _layouts(d.output))
    return f"{d.impl} [inputs {ins or '-'}; params {ps or '-'}; output {out or '-'}]"


def _what(node: fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
