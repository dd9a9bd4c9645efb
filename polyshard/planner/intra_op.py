"""Intra-op search: one strategy per op, chosen by an integer program (Alpa's formulation).

Each op gets candidate strategies (:mod:`polyshard.planner.candidates`: column/row/replicated Linear,
split/whole Embedding, vocabulary-parallel/plain loss, ...). A binary variable picks one per op; a pair
variable per two picks of neighbouring ops, tied to both, carries the redistribution's cost; a value several
ops take in one layout is moved once (as lowering does), by a variable per producer pick and layout that every
such pair variable bounds from below. Minimised: compute plus communication (seconds); subject to: per-device
memory under the limit, and shared parameters laid out alike at every use. Repeated blocks (a ModuleList of
identical layers) share one set of variables, so a 96-layer model is solved as one layer. The LP relaxation's
optimum bounds the true optimum from below: the gap reported is how far the plan can be from it (where that
optimum picks whole strategies, it is the plan, and no branching is needed).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
from torch import fx

from polyshard.cluster import Cluster
from polyshard.errors import PolyshardError
from polyshard.graph.capture import shape_of
from polyshard.graph.params import parameters_of
from polyshard.graph.twins import twins
from polyshard.layout import Axes, Layout
from polyshard.planner.candidates import (Enumeration, Repeat, enumerated, gathering_pairs, layouts_taken,
                                          shares_params)
from polyshard.planner.cost.comm import (collectives_seconds, comm_seconds, gradient_bytes, gradient_layout,
                                         gradient_path, own_collectives, weight_sum_seconds)
from polyshard.graph.regions import Recomputed, recomputed
from polyshard.planner.cost.compute import RETURNED_PASSES, forward_seconds, op_overhead, passes, recompute_overhead
from polyshard.planner.cost.memory import kept_copies, local_numel
from polyshard.planner.cost.offload import device_bytes_per_param
from polyshard.plan import DTYPES, NodePlan, Plan, splits_operators
from polyshard.planner.rules import row_splits
from polyshard.transitions import transition_bytes

INTEGRAL_TOLERANCE = 1e-6  # a relaxed pick this close to 0 or 1 is one
# The relaxation's objective is exact to the solver's feasibility tolerances (1e-7 on costs scaled to order one):
# a bound is taken this much lower, so that where the relaxation is whole it stays under the plan's own costing.
BOUND_MARGIN = 1e-6


@dataclass(frozen=True)
class IntraOpResult:
    """plan: the chosen strategies (None when pruned: the LP bound already loses to a known split);
    cost_s: their predicted seconds per step (rows included); lower_bound_s: the LP relaxation's
    optimum; memory_bytes: per device; variables: in the program."""

    plan: Plan | None
    cost_s: float
    lower_bound_s: float
    memory_bytes: float
    variables: int

    @property
    def gap(self) -> float:
        return max(0.0, (self.cost_s - self.lower_bound_s) / self.cost_s) if self.cost_s else 0.0


@dataclass
class Program:
    """The integer program's data. options: candidates per node; rep: each node's stand-in (tied
    blocks share variables); var_of: (stand-in, candidate) -> column; node_cost / node_mem: per
    column; edges: (producer stand-in, consumer stand-in) -> cost matrix [producer pick, consumer pick];
    shared: each shared move with its cost matrix [producer pick, layout]."""

    options: dict[str, Sequence[NodePlan]]
    rep: dict[str, str]
    var_of: dict[tuple[str, int], int]
    node_cost: np.ndarray
    node_mem: np.ndarray
    edges: dict[tuple[str, str], np.ndarray]
    conflicts: list[tuple[tuple[str, int], tuple[str, int]]]
    shared: list[tuple[SharedMove, np.ndarray]]


@dataclass(frozen=True)
class SharedMove:
    """A value several consumers take, which lowering moves once per layout however many take it so.
    producer: its stand-in; consumers: each consumer stand-in with the layout (an index) each of its picks takes
    the value in, -1 for none; cost: (per row, fixed) seconds [producer pick, layout], over every value moved alike."""

    producer: str
    consumers: tuple[tuple[str, np.ndarray], ...]
    cost: tuple[np.ndarray, np.ndarray]


@dataclass(frozen=True)
class Terms:
    """A :class:`Program` for any row count: every cost and byte count is a per-row part plus a
    fixed part (collective latencies, per-op overheads, parameters), so one enumeration serves
    every split that shares the operator axes."""

    options: dict[str, Sequence[NodePlan]]
    rep: dict[str, str]
    var_of: dict[tuple[str, int], int]
    cost: tuple[np.ndarray, np.ndarray]  # (per row, fixed) per column
    mem: tuple[np.ndarray, np.ndarray]
    edges: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]]
    conflicts: list[tuple[tuple[str, int], tuple[str, int]]]
    shared: tuple[SharedMove, ...]

    def at(self, rows: float) -> Program:
        return Program(self.options, self.rep, self.var_of, rows * self.cost[0] + self.cost[1],
                       rows * self.mem[0] + self.mem[1], {k: rows * a + b for k, (a, b) in self.edges.items()},
                       self.conflicts, [(m, rows * m.cost[0] + m.cost[1]) for m in self.shared])

    @cached_property
    def chosen(self) -> dict[tuple[int, ...], Plan]:
        """The strategies of each set of picks solved so far (one per stand-in, in order)."""
        return {}

    @cached_property
    def columns(self) -> tuple[list[np.ndarray], tuple[np.ndarray, np.ndarray], tuple[np.ndarray, ...],
                               tuple[np.ndarray, ...]]:
        """What the program has at every row count: each stand-in's columns; a pair variable for every two picks
        of neighbours whose redistribution costs something (or that a shared move reads), then a column per
        shared move's producer pick and layout that costs something, with their costs (per row, fixed); the rows
        that tie each pair's variables to the picks (see :func:`solve`), and the rows that hold each shared move's
        column at or above the pair variables that take the value to its layout, as (starts, columns, values)."""
        picks = {name: np.array([self.var_of[(name, i)] for i in range(len(self.options[name]))], dtype=np.int32)
                 for name in dict.fromkeys(self.rep.values())}
        read = {(m.producer, c) for m in self.shared for c, _ in m.consumers}
        paired = len(self.var_of)  # the next pair variable's column
        first_pair: dict[tuple[str, str], int] = {}
        per_row, fixed, ties, bounds = [np.zeros(0)], [np.zeros(0)], _Rows(), _Rows()
        for (u, v), (a, b) in self.edges.items():
            if not (a + b).any() and (u, v) not in read:  # free at every row count
                continue
            # pair (i, j), column paired + i * nv + j: u picks i and v picks j; a row per pick of u over its
            # pairs, and one per pick of v
            (nu, nv), own_u, own_v = a.shape, picks[u].tolist(), picks[v].tolist()
            for i in range(nu):
                ties.add([*range(paired + i * nv, paired + (i + 1) * nv), own_u[i]], [1.0] * nv + [-1.0])
            for j in range(nv):
                ties.add([*range(paired + j, paired + nu * nv, nv), own_v[j]], [1.0] * nu + [-1.0])
            per_row.append(a.ravel())
            fixed.append(b.ravel())
            first_pair[(u, v)] = paired
            paired += a.size
        for move in self.shared:
            a, b = move.cost
            for i, layout in zip(*np.nonzero(a + b)):
                for c, takes in move.consumers:
                    nv = len(takes)
                    pairs = first_pair[(move.producer, c)] + i * nv + np.flatnonzero(takes == layout)
                    bounds.add([paired, *pairs.tolist()], [1.0] + [-1.0] * len(pairs))
                per_row.append(a[i, layout:layout + 1])
                fixed.append(b[i, layout:layout + 1])
                paired += 1
        return list(picks.values()), (np.concatenate(per_row), np.concatenate(fixed)), ties.arrays(), bounds.arrays()


class _Rows:
    """Sparse rows of an integer program, gathered one by one and handed to HiGHS as (starts, columns, values)."""

    def __init__(self):
        self.index, self.values, self.lengths = [], [], []

    def add(self, index: list[int], values: list[float]) -> None:
        self.index += index
        self.values += values
        self.lengths.append(len(index))

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        starts = np.cumsum([0] + self.lengths[:-1]).astype(np.int32) if self.lengths else np.zeros(0, np.int32)
        return starts, np.array(self.index, dtype=np.int32), np.array(self.values, dtype=float)


def build_program(gm: fx.GraphModule, op_axes: Axes, cluster: Cluster, rows: int,
                  rc: Recomputed = Recomputed(), offload: str = "none", precision: str = "fp32") -> Program:
    """Candidates, costs (seconds per step at ``rows`` rows, computing and communicating in
    ``precision``) and memory of every choice, under recompute ``rc`` and optimizer-state ``offload``."""
    return program_terms(gm, op_axes, cluster, rc, offload, precision).at(rows)


def program_terms(gm: fx.GraphModule, op_axes: Axes, cluster: Cluster, rc: Recomputed = Recomputed(),
                  offload: str = "none", precision: str = "fp32", sequence: bool | None = None,
                  all_reduce_only: bool = False) -> Terms:
    """:func:`build_program`'s data with rows left open; ``sequence``: see :class:`RuleContext`;
    ``all_reduce_only``: values move between ops by all-reduces alone (:func:`gathering_pairs`)."""
    found = enumerated(gm, op_axes, sequence)
    conflicts = found.conflicts + (gathering_pairs(gm, found, cluster.all_to_all) if all_reduce_only else [])
    var_of: dict[tuple[str, int], int] = {}
    for name, stand_in in found.rep.items():
        if stand_in == name:
            for i in range(len(found.options[name])):
                var_of[(name, i)] = len(var_of)
    # a repeat that recompute treats as its twin block is counted as that block, in bulk
    repeated = [r for r in found.repeats if not (rc.rerun or rc.freed) or
                all(rc.alike(m, t) for m, t in zip(r.members, r.twins))]
    totals = _node_terms(gm, found, var_of, repeated, op_axes, cluster, rc, offload, precision)
    edges, shared = _edge_terms(gm, found, repeated, op_axes, cluster, rc, precision)
    return Terms(found.options, found.rep, var_of, (totals[:, 0, 0], totals[:, 0, 1]),
                 (totals[:, 1, 0], totals[:, 1, 1]), edges, conflicts, shared)


def _node_terms(gm: fx.GraphModule, found: Enumeration, var_of: dict[tuple[str, int], int],
                repeated: list[Repeat], op_axes: Axes, cluster: Cluster, rc: Recomputed, offload: str,
                precision: str) -> np.ndarray:
    """Each column's [(seconds, bytes), (per row, fixed)], summed over the nodes its stand-in stands for."""
    options, copied, rep, modules = found.options, found.copied, found.rep, found.modules
    dtype, itemsize = DTYPES[precision]
    seconds = found.seconds.setdefault((cluster, precision), {})  # (node, passes) -> its options' seconds
    per_node: dict[str, np.ndarray] = {}  # [candidate, (seconds, bytes), (per row, fixed)]; a twin's is its twin's
    node_uses: Counter[tuple[str, str]] = Counter()  # (stand-in, node costed) -> how many nodes it stands for
    owned, seen_params = parameters_of(gm).owned, set()
    skipped = {m for r in repeated for m in r.members}
    for n in gm.graph.nodes:
        if n.name in skipped:
            pass
        elif n.name in copied and rc.alike(n.name, copied[n.name]) and \
                not shares_params(n, owned, seen_params):
            per_node[n.name] = per_node[copied[n.name]]
            node_uses[(rep[n.name], _source(n.name, copied, per_node))] += 1
        else:
            key = (n.name, passes(n.name, rc))
            if key not in seconds:
                forward = _forwards(found, n, cluster, precision)
                seconds[key] = np.array([_op_seconds(n, d, f, modules, op_axes, cluster, dtype, itemsize, rc)
                                         for d, f in zip(options[n.name], forward)]).reshape(len(options[n.name]), 2)
            memory = np.array([_op_memory(n, d, modules, seen_params, rc, offload) for d in options[n.name]])
            per_node[n.name] = np.stack([seconds[key], memory.reshape(len(options[n.name]), 2)], axis=1)
            node_uses[(rep[n.name], n.name)] += 1
        if n.op == "call_module":
            seen_params.update(id(p) for _, _, p in owned[n.target])
    for twin_block, count in Counter(r.twins for r in repeated).items():
        for t in twin_block:
            node_uses[(rep[t], t)] += count
    totals = np.zeros((len(var_of), 2, 2))
    for (stand_in, source), uses in node_uses.items():
        totals[[var_of[(stand_in, i)] for i in range(len(options[stand_in]))]] += uses * per_node[source]
    return totals


def _edge_terms(gm: fx.GraphModule, found: Enumeration, repeated: list[Repeat], op_axes: Axes, cluster: Cluster,
                rc: Recomputed, precision: str) -> tuple[dict[tuple[str, str], tuple[np.ndarray, ...]],
                                                         tuple[SharedMove, ...]]:
    """Each pair of stand-ins' redistribution seconds [producer pick, consumer pick], (per row, fixed),
    summed over the edges it stands for; and the moves of values several consumers take, which those
    edges leave out."""
    options, copied, rep = found.options, found.copied, found.rep
    itemsize = DTYPES[precision][1]
    moves = found.moves.setdefault((cluster, precision), {})  # (producer, consumer, passes) -> edge seconds
    edge_uses: Counter[tuple[tuple[str, str], int]] = Counter()  # (stand-in pair, id of costs) -> uses
    per_edge: dict[tuple[str, str], np.ndarray] = {}
    by_id: dict[int, np.ndarray] = {}
    nodes = list(gm.graph.nodes)
    returned = _returned_layouts(nodes, options)
    twin_of = twins(gm)
    skipped = {m for r in repeated for m in r.members}
    boundary = {name: ks for r in repeated for name, ks in r.boundary.items()}  # what of a repeat is walked
    for n in nodes:
        if n.name in skipped and n.name not in boundary:
            continue
        twin = twin_of.get(n.name) if n.name in copied else None
        twin_inputs = twin.all_input_nodes if twin is not None and rc.alike(n.name, twin.name) else ()
        for k, u in enumerate(n.all_input_nodes):
            if n.name in skipped and k not in boundary[n.name]:
                continue
            costs = None
            if twin_inputs:  # the twin edge, inside a block; or a value from outside it (a rotary table) as it comes in
                costs = per_edge.get((copied.get(u.name), twin.name))  # to the twin, costed alike
                if costs is None and twin_inputs[k] is u:
                    costs = per_edge[(u.name, twin.name)]
            if costs is None or u.name in returned:
                comm_passes = RETURNED_PASSES if n.op == "output" else passes(n.name, rc)[1]
                key = (u.name, n.name, comm_passes)
                costs = moves.get(key)
                if costs is None:
                    # a value the model returns is moved to the output's layout once, and its other consumers
                    # that take it so share that move (lowering inserts one redistribution per value and layout)
                    shared = returned.get(u.name) if n.op != "output" else None
                    costs = moves[key] = np.array(
                        [[_edge_seconds(u, o.output, d, op_axes, cluster, comm_passes, itemsize, n.op != "output",
                                        moved=shared is None or d.inputs.get(u.name) != shared)
                          for d in options[n.name]] for o in options[u.name]]).reshape(
                        len(options[u.name]), len(options[n.name]), 2)
            per_edge[(u.name, n.name)] = costs
            by_id[id(costs)] = costs
            edge_uses[((rep[u.name], rep[n.name]), id(costs))] += 1
    for twin_edges, count in Counter(r.twin_edges for r in repeated).items():  # a repeat's edges are its twins'
        for u, t in twin_edges:  # but for those from the block before it
            edge_uses[((rep[u], rep[t]), id(per_edge[(u, t)]))] += count
    shared = _shared_moves(nodes, options, rep, repeated, per_edge, returned, lambda u, c, j: _gradient_reduction(
        u, options[c.name][j], [o.output for o in options[u.name]], op_axes, cluster, itemsize))
    for _, uses, count in shared:  # their edges are paid as the shared moves instead
        for pair, costs in uses:
            edge_uses[(pair, id(costs))] -= count
    summed: dict[tuple[str, str], np.ndarray] = {}
    for (key, costs_id), uses in edge_uses.items():
        summed[key] = summed.get(key, 0) + uses * by_id[costs_id]
    return {key: (costs[..., 0], costs[..., 1]) for key, costs in summed.items()}, tuple(m for m, _, _ in shared)


def _shared_moves(nodes: list[fx.Node], options, rep: dict[str, str], repeated: list[Repeat], per_edge: dict,
                  returned: dict[str, Layout], reduction: Callable) -> list[tuple[SharedMove, tuple, int]]:
    """Each value that two or more consumers may have to move (a norm's output read by q, k and v): its
    SharedMoves (over the values alike), the edges they pay for ((stand-in pair, costs) per consumer of
    one value) and how many values they stand for. Two moves: the value's to each layout taken and its gradient's
    way back, at a producer pick the most any consumer pays (they differ only where recompute runs one consumer's
    collectives again); and the gradient's reduction where products taking it whole split their outputs
    (``reduction(value, consumer, pick)``: its gradient layout and [producer pick, (per row, fixed)] seconds, or
    None), once per layout taken and layout reduced from, whoever takes it so."""
    by_name = {n.name: n for n in nodes}
    twin_of = {m: by_name[t] for r in repeated for m, t in zip(r.members, r.twins)}

    def counted_as(u: fx.Node, c: fx.Node) -> tuple[tuple[str, str], np.ndarray, fx.Node, fx.Node]:
        walked = per_edge.get((u.name, c.name))
        if walked is not None:
            return (rep[u.name], rep[c.name]), walked, u, c
        twin = twin_of[c.name]  # an edge inside a repeated block: counted as its twin's
        v = twin.all_input_nodes[c.all_input_nodes.index(u)]
        return (rep[v.name], rep[twin.name]), per_edge[(v.name, twin.name)], v, twin

    found: dict[tuple, list] = {}
    moving: dict[int, bool] = {}  # per costs array (twin edges share theirs): whether any pick pays to move
    for u in nodes:
        if u.name in returned:
            continue
        uses = []
        for c in u.users:
            pair, costs, value, consumer = counted_as(u, c)
            moves = moving.get(id(costs))
            if moves is None:
                moves = moving[id(costs)] = bool(costs.any())
            if moves:
                uses.append((pair, costs, layouts_taken(options[c.name], u.name), value, consumer))
        if len(uses) > 1:
            edges = sorted(((pair, id(costs), takes) for pair, costs, takes, _, _ in uses), key=lambda e: e[:2])
            key = (rep[u.name], tuple(edges))
            found.setdefault(key, [uses, 0])[1] += 1
    out = []
    for (producer, _), (uses, count) in found.items():
        layouts = list(dict.fromkeys(l for _, _, takes, _, _ in uses for l in takes if l is not None))
        reduced: dict[tuple, np.ndarray] = {}  # (layout taken, gradient layout) -> [per row, fixed] seconds
        cost = np.zeros((uses[0][1].shape[0], len(layouts), 2))
        consumers: dict[str, np.ndarray] = {}
        reducers: dict[str, np.ndarray] = {}
        for (_, c), costs, takes, value, consumer in uses:
            index, reducing = np.array([-1 if l is None else layouts.index(l) for l in takes]), []
            for j, layout in enumerate(index):
                found_reduction = reduction(value, consumer, j) if layout >= 0 else None
                paid = costs[:, j]
                if found_reduction is not None:
                    grad, seconds = found_reduction
                    reduced.setdefault((takes[j], grad), seconds)
                    reducing.append(list(reduced).index((takes[j], grad)))
                    paid = paid - seconds
                else:
                    reducing.append(-1)
                if layout >= 0:
                    cost[:, layout] = np.maximum(cost[:, layout], paid)
            consumers[c], reducers[c] = index, np.array(reducing)
        cost *= count
        edges = tuple((pair, costs) for pair, costs, _, _, _ in uses)
        out.append((SharedMove(producer, tuple(consumers.items()), (cost[..., 0], cost[..., 1])), edges, count))
        if reduced:
            once = count * np.stack(list(reduced.values()), axis=1)
            out.append((SharedMove(producer, tuple(reducers.items()), (once[..., 0], once[..., 1])), (), count))
    return out


def _gradient_reduction(value: fx.Node, d: NodePlan, made: Sequence, axes, cluster, itemsize: int):
    """Where the op run as ``d`` takes ``value`` whole and splits its output or weights: the layout the value's
    gradient comes back in, and per layout its producer may make it in (``made``) the (per row, fixed) seconds of
    the first step of its way back (cost.comm.gradient_path), which reduces it; else None."""
    taken = d.inputs.get(value.name)
    if taken is None:
        return None
    grad = gradient_layout(taken, [d])
    if grad == taken.with_dims(taken.dims):
        return None
    seconds = []
    for src in made:  # a producer pick that makes no single tensor moves nothing (see _edge_seconds)
        path = gradient_path(value, src, taken, [d]) if isinstance(src, Layout) else ()
        if isinstance(src, Layout) and not path:
            return None
        sent = transition_bytes(*path[:2], shape_of(value), itemsize, cluster.backend, cluster.all_to_all) \
            if path else {}
        seconds.append(comm_seconds(sent, axes, cluster))
    return grad, np.array(seconds)


def forward_floor(gm: fx.GraphModule, op_axes: Axes, cluster: Cluster, precision: str, times: Callable[[str], int],
                  sequence: bool | None = None) -> float:
    """Seconds per row of ``times(name)`` forwards of each node under its cheapest candidate on ``op_axes`` (a
    twin's is its twin's): what any strategy computes at the least, communication and fixed costs left out."""
    found = enumerated(gm, op_axes, sequence)
    nodes = {n.name: n for n in gm.graph.nodes}
    sources: Counter[str] = Counter()
    for name, n in nodes.items():
        if n.op.startswith("call_") and found.options[name]:
            sources[found.copied.get(name, name)] += times(name)
    return sum(uses * float(_forwards(found, nodes[source], cluster, precision).min())
               for source, uses in sources.items() if uses)


def _forwards(found: Enumeration, node: fx.Node, cluster: Cluster, precision: str) -> np.ndarray:
    """Seconds per row of ``node``'s forward under each of its candidates, once per cluster and precision
    (every recompute mode's costs are passes of it)."""
    table = found.forward.setdefault((cluster, precision), {})
    if node.name not in table:
        dtype, itemsize = DTYPES[precision]
        table[node.name] = np.array([forward_seconds(node, d, found.modules, cluster, dtype, itemsize)
                                     for d in found.options[node.name]])
    return table[node.name]


def _source(name: str, copied: dict[str, str], per_node: dict[str, np.ndarray]) -> str:
    """The node whose costs ``name``'s are (the first of a chain of twins that share them)."""
    while name in copied and per_node[copied[name]] is per_node[name]:
        name = copied[name]
    return name


def _returned_layouts(nodes: list[fx.Node], options: dict[str, Sequence[NodePlan]]) -> dict[str, Layout]:
    """The layout the graph's output takes each returned value in (it has one choice)."""
    out = next((n for n in reversed(nodes) if n.op == "output"), None)
    if out is None or len(options[out.name]) != 1:
        return {}
    return dict(options[out.name][0].inputs)


def evaluate(program: Program, picks: dict[str, int]) -> tuple[float, float]:
    """(seconds, bytes) of one choice per stand-in: the objective the integer program minimises."""
    x = np.zeros(len(program.var_of))
    for name, i in picks.items():
        x[program.var_of[(name, i)]] = 1.0
    cost = float(program.node_cost @ x)
    for (u, v), costs in program.edges.items():
        cost += float(costs[picks[u], picks[v]])
    for move, costs in program.shared:
        taken = {int(takes[picks[c]]) for c, takes in move.consumers} - {-1}
        cost += float(sum(costs[picks[move.producer], layout] for layout in taken))
    return cost, float(program.node_mem @ x)


def solve(gm: fx.GraphModule, op_axes: Axes, cluster: Cluster, rows: int, memory_limit_bytes: float,
          cutoff_s: float | None = None, time_limit_s: float = 30.0, recompute: str = "none",
          recompute_comm: str = "keep", offload: str = "none", precision: str = "fp32",
          sequence: bool | None = None, terms: Terms | None = None,
          extra_per_row_s: np.ndarray | None = None) -> IntraOpResult:
    """The cheapest strategy per op for ``rows`` batch rows per device (``gm`` captured at one row),
    with activations under ``recompute`` and optimizer state under ``offload`` (see :class:`Plan`),
    computing and communicating in ``precision``.

    Pruned (no plan) when the LP bound shows nothing here costs less than ``cutoff_s``; ``sequence``:
    sequence parallel everywhere it applies (True), nowhere (False), or where it pays (None); ``terms``:
    :func:`program_terms` of the same arguments, where the caller keeps them for other row counts;
    ``extra_per_row_s``: seconds per row more for each column (its pick), which the costs reported include."""
    import highspy

    terms = terms or program_terms(gm, op_axes, cluster, recomputed(gm, recompute, recompute_comm), offload, precision,
                                   sequence)
    options, rep, var_of = terms.options, terms.rep, terms.var_of
    picks, (paid_per_row, paid_fixed), (starts, index, values), moved = terms.columns
    per_row = terms.cost[0] if extra_per_row_s is None else terms.cost[0] + extra_per_row_s
    node_cost, node_mem = rows * per_row + terms.cost[1], rows * terms.mem[0] + terms.mem[1]
    paid = rows * paid_per_row + paid_fixed
    # Seconds can be 1e-9 and bytes 1e11: scale both to order one so the solver's tolerances bite.
    scale = 1.0 / max(node_cost.max(initial=0.0), paid.max(initial=0.0), 1e-30)
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)  # no solver threads: a search's forked workers would inherit them dead
    h.setOptionValue("time_limit", time_limit_s)
    h.setOptionValue("mip_rel_gap", 1e-9)
    h.setOptionValue("mip_abs_gap", 0.0)
    num_x = len(var_of)
    h.addVars(num_x, np.zeros(num_x), np.ones(num_x))
    h.changeColsCost(num_x, np.arange(num_x, dtype=np.int32), node_cost * scale)
    _add_rows(h, picks, [np.ones(len(idx)) for idx in picks], 1.0, 1.0)
    # a pair variable z[i, j] per two picks of neighbours u and v, summing to u's pick i over j and to v's pick
    # j over i (the local polytope): at whole picks it is 1 for the pair picked, and relaxed it stays tight, so
    # the relaxation's optimum is most often whole (a weaker z >= x_i + x_j - 1 lets halves of picks pay nothing)
    h.addCols(len(paid), paid * scale, np.zeros(len(paid)), np.ones(len(paid)), 0, np.zeros(len(paid), np.int32),
              np.array([], np.int32), np.array([]))
    if len(starts):
        h.addRows(len(starts), np.zeros(len(starts)), np.zeros(len(starts)), len(index), starts, index, values)
    if len(moved[0]):  # a shared move is paid where any consumer takes the value to its layout
        h.addRows(len(moved[0]), np.zeros(len(moved[0])), np.full(len(moved[0]), highspy.kHighsInf), len(moved[1]),
                  *moved)
    for a, b in terms.conflicts:
        h.addRow(-highspy.kHighsInf, 1.0, 2, np.array([var_of[a], var_of[b]], dtype=np.int32), np.array([1.0, 1.0]))
    h.addRow(-highspy.kHighsInf, 1.0, num_x, np.arange(num_x, dtype=np.int32), node_mem / memory_limit_bytes)
    h.run()
    lower = h.getInfo().objective_function_value / scale * (1 - BOUND_MARGIN)
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        raise PolyshardError(f"no strategy fits {memory_limit_bytes / 2**30:.1f} GiB per device on op axes {dict(op_axes)}")
    if cutoff_s is not None and lower >= cutoff_s:
        return IntraOpResult(None, lower, lower, 0.0, h.getNumCol())
    x = np.array(h.getSolution().col_value[:num_x])
    if np.abs(x - np.round(x)).max(initial=0.0) > INTEGRAL_TOLERANCE:  # else the relaxation's optimum is a plan
        h.changeColsIntegrality(num_x, np.arange(num_x, dtype=np.int32), np.ones(num_x, dtype=np.uint8))
        h.run()
        x = np.array(h.getSolution().col_value[:num_x])
    chosen = {name: int(np.argmax(x[idx])) for name, idx in zip(dict.fromkeys(rep.values()), picks)}
    key = tuple(chosen.values())
    if key not in terms.chosen:  # another row count often picks the same
        made = Plan(op_axes=op_axes)
        made.nodes.update({name: options[name][chosen[rep[name]]] for name in rep})
        _fill_params(gm, made, op_axes)
        terms.chosen[key] = made
    made = terms.chosen[key]
    plan = Plan(op_axes=op_axes, recompute=recompute, recompute_comm=recompute_comm, offload=offload,
                nodes=dict(made.nodes), params=dict(made.params), row_splits=dict(made.row_splits))
    cost = h.getInfo().objective_function_value / scale
    return IntraOpResult(plan, cost, min(lower, cost), float(node_mem @ np.round(x)), h.getNumCol())


def _add_rows(h, indices, values, lower: float, upper: float) -> None:
    """Rows ``lower <= values . x[indices] <= upper``, one per entry, added at once."""
    if not len(indices):
        return
    starts = np.cumsum([0] + [len(idx) for idx in indices[:-1]]).astype(np.int32)
    h.addRows(len(indices), np.full(len(indices), lower), np.full(len(indices), upper), int(sum(map(len, indices))),
              starts, np.concatenate(indices).astype(np.int32), np.concatenate(values).astype(float))


def _op_seconds(node, d: NodePlan, forward: float, modules, axes, cluster, dtype: str, itemsize: int,
                rc: Recomputed) -> tuple[float, float]:
    """(seconds per row, fixed seconds) of one op, whose forward takes ``forward`` seconds per row."""
    compute_passes, comm_passes = passes(node.name, rc)
    sent, back = (collectives_seconds(c, axes, cluster) for c in own_collectives(node, d, modules, itemsize,
                                                                                   cluster.backend))
    transfer, latency = ((comm_passes - 1) * f + b for f, b in zip(sent, back))
    overhead = op_overhead(node, d, cluster, compute_passes, dtype) + \
        recompute_overhead(node.name, rc, cluster, splits_operators(axes)) if node.op.startswith("call_") else 0.0
    summed = weight_sum_seconds(node, d, modules, itemsize, axes, cluster)
    return compute_passes * forward + transfer, latency + overhead + summed


def _op_memory(node, d: NodePlan, modules, seen_params: set[int], rc: Recomputed, offload: str) -> tuple[float, float]:
    """(bytes per row, fixed bytes) of one op: its kept activation, its parameters' state."""
    fixed = 0.0
    for name, p in (modules[node.target].named_parameters(recurse=False) if node.op == "call_module" else []):
        if id(p) not in seen_params and name in d.params:
            fixed += local_numel(p.shape, d.params[name]) * device_bytes_per_param(offload)
    shape = shape_of(node)
    kept = kept_copies(node, rc) if isinstance(d.output, Layout) and shape is not None else 0.0
    return (local_numel(shape, d.output) * 4 * kept if kept else 0.0), fixed


def _edge_seconds(u: fx.Node, src, d: NodePlan, axes, cluster, comm_passes: int, itemsize: int, backward: bool,
                  moved: bool = True) -> tuple[float, float]:
    """(seconds per row, fixed seconds) of moving ``u``'s value from ``src`` to the layout the op run as ``d``
    takes it in: in forward (``moved``: not a move shared with the returned value), again in recompute when the
    consumer's collectives run again, and its gradient's way back (``backward``; comm_passes counts it)."""
    dst = d.inputs.get(u.name)
    if not isinstance(src, Layout) or dst is None:
        return 0.0, 0.0
    forward = [transition_bytes(src, dst, shape_of(u), itemsize, cluster.backend, cluster.all_to_all)] \
        if moved and src != dst else []
    back = gradient_bytes(u, src, dst, [d], itemsize, cluster.backend, cluster.all_to_all) if backward else []
    times = comm_passes - 1 if backward else comm_passes
    (f_transfer, f_latency), (b_transfer, b_latency) = (collectives_seconds(c, axes, cluster) for c in (forward, back))
    return times * f_transfer + b_transfer, times * f_latency + b_latency


def _fill_params(gm: fx.GraphModule, plan: Plan, op_axes: Axes) -> None:
    listed = parameters_of(gm)
    for node in gm.graph.nodes:
        chosen = plan.nodes[node.name].params
        for pname, _, p in listed.owned.get(node.target, ()) if chosen else ():
            if pname in chosen:
                plan.params.setdefault(listed.name_of[id(p)], chosen[pname])
    for name, p in listed.named:
        if name not in plan.params:
            plan.params[name] = Layout.replicated(op_axes, p.ndim)
    plan.row_splits.update(row_splits(gm, plan.nodes))

