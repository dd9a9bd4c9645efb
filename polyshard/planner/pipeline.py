"""Pipeline parallel in the search: a plan's costs gathered per repeated block (a unit), then per
micro-batch count and schedule the stage cuts that minimise the slowest stage's time with every
stage's memory under the limit, timed by simulating the schedule.

Costs come from one plan of the whole model on the stage's operator axes (a stage runs its ops
as that plan lays them out), so one integer program serves every pipeline depth.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import weakref
from dataclasses import dataclass
from typing import Callable

import numpy as np
from torch import fx

from polyshard.buckets import BUCKET_BYTES
from polyshard.graph.capture import shape_of
from polyshard.graph.params import parameters_of
from polyshard.graph.regions import Recomputed
from polyshard.layout import Layout
from polyshard.planner.cost.comm import DataSync
from polyshard.planner.cost.compute import TRAIN_FLOPS_PER_FORWARD
from polyshard.planner.cost.memory import (STATES, MemoryEstimate, gradient_transients, kept_copies, local_numel,
                                           param_numel, with_cached)
from polyshard.planner.cost.overlap import OpCost
from polyshard.planner.config import Fixed
from polyshard.planner.cost.zero_memory import state_bytes_per_rank
from polyshard.plan import DTYPES, ZERO_THRESHOLD_BYTES, Plan
from polyshard.schedule import simulated_span
from polyshard.planner.stages import even_partition, min_max_partition, range_sums

# Schedules of more micro-batches than this many per stage are simulated at this many, and the rest
# added at the steady state's pace (each further micro-batch, or group of pp interleaved, adds what the
# last did): 1F1B is steady from pp on, interleaving once v x pp forwards have filled the pipe.
SIMULATED_PER_STAGE = {"gpipe": 2, "1f1b": 2, "interleaved": 3}
# The outer knobs tried unless fixed: micro-batches of up to this many rows (published runs use 1-4),
# or up to this many micro-batches per stage; chunks per rank under interleaving.
MAX_MICRO_ROWS, MAX_MICRO_PER_STAGE, VIRTUAL_STAGES = 8, 2, (2, 3, 4, 6, 8)


@dataclass(frozen=True)
class Units:
    """One plan's figures per unit (unit 0: the first block and what runs before it; the last: the
    last block and what runs after). Seconds and bytes per row of a micro-batch unless fixed.

    span: (first, last) module path of each unit; starts: the block each unit begins with;
    compute_s / comm_s: per row, forward, backward and recompute; overhead_s / latency_s: fixed,
    per micro-batch; forward_share: of each unit's seconds spent in forward; activation_bytes: kept
    for backward; rerun_bytes: what recompute frees (alive again while its backward runs);
    transient_bytes: the most gradients alive while one of its ops' backward runs;
    send_bytes[u]: values crossing the cut before unit u (0 for u = 0); groups: each unit's
    parameters' local sizes, by module (a parameter two units use is in both); model_groups: the
    model's, each parameter once; recompute: the mode these figures are for; split_rows: the operator ranks
    that split each micro-batch's rows instead of its operators in this plan (0: they split operators)."""

    span: tuple[tuple[str, str], ...]
    starts: tuple[str, ...]
    compute_s: np.ndarray
    comm_s: np.ndarray
    overhead_s: np.ndarray
    latency_s: np.ndarray
    forward_share: float
    activation_bytes: np.ndarray
    rerun_bytes: np.ndarray
    transient_bytes: np.ndarray
    send_bytes: np.ndarray
    groups: tuple[tuple[tuple[int, ...], ...], ...]
    model_groups: tuple[tuple[int, ...], ...]
    recompute: str = "none"
    split_rows: int = 0

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def tp_split(self) -> str:
        """What the operator ranks split: "rows" of the batch, or "ops" (operators)."""
        return "rows" if self.split_rows else "ops"

    def seconds(self, rows: float) -> np.ndarray:
        return rows * (self.compute_s + self.comm_s) + self.overhead_s + self.latency_s

    @functools.cached_property
    def unit_numels(self) -> tuple[int, ...]:
        """Parameters each unit holds (a parameter two units use counted in both): read at every setup."""
        return tuple(sum(map(sum, unit)) for unit in self.groups)


# One model's units under each recompute mode a chunk may run, the fastest first; then, where a stage's operator
# ranks may split its rows instead, the units of that plan under each mode.
Modes = tuple[Units, ...]


def unit_costs(gm: fx.GraphModule, plan: Plan, costs: list[OpCost], rc: Recomputed, unit_of: dict[str, int],
               starts: tuple[str, ...], itemsize: int) -> Units:
    """``plan``'s per-op ``costs`` (:func:`polyshard.planner.cost.overlap.op_costs`, in its order)
    and memory summed per unit (``unit_of``: each computing node's unit)."""
    n = len(starts)
    facts = _unit_facts(gm, unit_of, starts)
    costed = [unit_of[node.name] for node in gm.graph.nodes
              if node.op not in ("placeholder", "output", "get_attr") and node.name in plan.nodes]
    fields = {key: np.bincount(costed, [getattr(cost, key) for cost in costs], minlength=n)
              for key in ("compute_s", "comm_s", "overhead_s", "latency_s")}
    transient = np.zeros(n)
    for name, size in gradient_transients(gm, plan, itemsize).items():
        if name in unit_of:
            transient[unit_of[name]] = max(transient[unit_of[name]], size)
    groups: list[list[tuple[int, ...]]] = [[] for _ in range(n)]
    model_groups = []
    v = facts.values
    laid = [plan.nodes[name].output for name in v.names]
    pieces = np.array([out.pieces if isinstance(out, Layout) else 0 for out in laid], dtype=float)
    size = np.where(pieces > 0, v.numels / np.maximum(pieces, 1), 0.0) * itemsize
    kept = size * np.array([with_cached(c, name, rc) for c, name in zip(v.copies[itemsize < 4].tolist(), v.names)])
    freed = np.array([name in rc.freed for name in v.names], dtype=bool)
    # what recompute frees is alive again while its region's backward runs
    rerun = np.bincount(v.units, np.where(freed, kept, 0.0), minlength=n)
    activation = np.bincount(v.units, np.where(freed, 0.0, kept), minlength=n)
    # a value crosses every cut after its unit up to its last consumer's: +size at the first, -size after the last
    crosses = v.reaches > v.units
    edges = np.stack([v.units[crosses] + 1, v.reaches[crosses] + 1], axis=1).ravel()
    crossing = np.bincount(edges, np.stack([size[crosses], -size[crosses]], axis=1).ravel(), minlength=n + 1)
    for u, params, first in facts.params:
        sizes = tuple(int(param_numel(plan, name, shape)) for name, shape in params)
        groups[u].append(sizes)
        if first:
            model_groups.append(tuple(sizes[i] for i in first))
    return Units(facts.span, starts, forward_share=forward_share(plan.recompute), groups=tuple(map(tuple, groups)),
                 model_groups=tuple(g for g in model_groups if g), activation_bytes=activation,
                 rerun_bytes=rerun, transient_bytes=transient, send_bytes=np.cumsum(crossing)[:n],
                 recompute=str(plan.recompute), **fields)


def forward_share(recompute: str) -> float:
    """Of a training pass's seconds, forward's: one of three passes, one of four where backward runs it again."""
    return 1 / (TRAIN_FLOPS_PER_FORWARD + (recompute == "full"))


def crossing_bytes(gm: fx.GraphModule, terms, unit_of: dict[str, int], itemsize: int) -> np.ndarray:
    """Bytes per row each column of an intra-op program (:class:`polyshard.planner.intra_op.Terms`) would send
    between pipeline stages, over every cut of units its value crosses (a value a later unit reads crosses each
    cut up to that unit's)."""
    out = np.zeros(len(terms.var_of))
    for node in gm.graph.nodes:
        unit, shape = unit_of.get(node.name), shape_of(node)
        reach = max((unit_of.get(user.name, -1) for user in node.users), default=-1)
        if unit is None or shape is None or reach <= unit:
            continue
        for i, d in enumerate(terms.options[node.name]):
            if isinstance(d.output, Layout):
                out[terms.var_of[(terms.rep[node.name], i)]] += (reach - unit) * local_numel(shape, d.output) * itemsize
    return out


@dataclass(frozen=True)
class _Values:
    """A graph's valued nodes in order, as arrays: name, unit, elements, the last unit that reads it, and the
    copies of it autograd keeps (in full precision, and in half)."""

    names: tuple[str, ...]
    units: np.ndarray
    numels: np.ndarray
    reaches: np.ndarray
    copies: tuple[np.ndarray, np.ndarray]


@dataclass(frozen=True)
class _UnitFacts:
    """What :func:`unit_costs` reads of a graph whatever the plan: its valued nodes (:class:`_Values`); each
    module's parameters new to its unit (name, shape) with the indices of those new to the model; each unit's
    span of module paths."""

    values: _Values
    params: list[tuple[int, list[tuple[str, tuple]], list[int]]]
    span: tuple[tuple[str, str], ...]


_UNIT_FACTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _unit_facts(gm: fx.GraphModule, unit_of: dict[str, int], starts: tuple[str, ...]) -> _UnitFacts:
    per_graph = _UNIT_FACTS.setdefault(gm, {})
    if starts in per_graph:
        return per_graph[starts]
    n, last = len(starts), len(starts) - 1
    listed = parameters_of(gm)
    values, params, paths = [], [], [[] for _ in range(n)]
    seen: list[set[int]] = [set() for _ in range(n)]
    model_seen: set[int] = set()
    # a unit's span names the outermost modules that hold no unit (a model's base holds them all)
    holders = {".".join(t.split(".")[:i]) for t in starts for i in range(1, t.count(".") + 1)}
    for node in gm.graph.nodes:
        if node.name not in unit_of:
            continue
        u, shape = unit_of[node.name], shape_of(node)
        stack = node.meta.get("nn_module_stack") or {}
        paths[u] += [path for path, _ in stack.values() if path not in holders][:1]
        if shape is not None:
            reach = max((unit_of.get(user.name, last) for user in node.users), default=u)
            copies = (kept_copies(node, Recomputed(), b) for b in (4, 2))
            values.append((node.name, u, math.prod(shape), reach, *copies))
        if node.op == "call_module":
            own = [p for _, _, p in listed.owned[node.target] if id(p) not in seen[u]]
            seen[u].update(id(p) for p in own)
            if own:
                first = [i for i, p in enumerate(own) if id(p) not in model_seen]
                model_seen.update(id(p) for p in own)
                params.append((u, [(listed.name_of[id(p)], p.shape) for p in own], first))
    span = tuple((p[0], p[-1]) if p else (s, s) for p, s in zip(paths, starts))
    names, units, numels, reaches, full, half = zip(*values) if values else ((),) * 6
    arrays = _Values(names, np.array(units, dtype=np.intp), np.array(numels, dtype=float),
                     np.array(reaches, dtype=np.intp), (np.array(full, dtype=float), np.array(half, dtype=float)))
    per_graph[starts] = _UnitFacts(arrays, params, span)
    return per_graph[starts]


def state_memory(groups, zero: int, dp: int, precision: str, offload: str, accumulating: bool = False,
                 optimizer: str = "adamw", threshold_bytes: int = ZERO_THRESHOLD_BYTES,
                 bucket_bytes: int = BUCKET_BYTES) -> MemoryEstimate:
    """Parameters, gradients and optimizer state of these parameter groups (local sizes, by module),
    as :func:`polyshard.planner.cost.memory.estimate_memory` counts them; no activations."""
    itemsize = 4 if precision == "fp32" else 2
    held = _state_bytes(tuple(groups) or (0,), zero, dp, threshold_bytes, itemsize, accumulating)
    state = held["optimizer"] / itemsize * 4 * (STATES[optimizer] + (precision != "fp32"))
    buffers = min(bucket_bytes, held["params"]) if dp > 1 and zero == 0 else 0.0
    on_device = state if offload == "none" else 0.0
    return MemoryEstimate(held["params"], held["grads"], on_device, 0.0, buffers, state - on_device)


@functools.lru_cache(maxsize=256)  # a search asks again at every micro-batch count and bucket size
def _state_bytes(groups: tuple, zero: int, dp: int, threshold_bytes: int, itemsize: int,
                 accumulating: bool) -> dict[str, int]:
    """:func:`state_bytes_per_rank` with one optimizer state (read only: shared by every caller)."""
    return state_bytes_per_rank(groups, zero, dp, threshold_bytes, itemsize, optimizer_states=1,
                                accumulating=accumulating)


@functools.lru_cache(maxsize=256)  # a search asks again for the same groups at every micro-batch count
def level3_traffic(groups, itemsize: int, threshold_bytes: int = ZERO_THRESHOLD_BYTES) -> tuple[float, int]:
    """(bytes left whole, modules gathered) of these parameter groups (local sizes, by module) at
    optimizer level 3, as polyshard.runtime.zero runs it: parameters under the threshold stay whole
    and are all-reduced; a module holding a larger one is gathered, in forward and in backward."""
    whole = sum(n for g in groups for n in g if n * itemsize < threshold_bytes) * itemsize
    return float(whole), sum(any(n * itemsize >= threshold_bytes for n in g) for g in groups)


def stepped_tensors(groups, zero: int, precision: str, offload: str, bucket_bytes: int = BUCKET_BYTES) -> int:
    """Tensors one optimizer step walks over these parameter groups (sizes, by module), as polyshard train
    builds the optimizer: plain torch steps every parameter (fp32 at level 0, or offloaded state);
    polyshard.runtime.zero steps flat buckets of masters, one per module gathered at level 3."""
    if offload != "none" or (zero == 0 and precision == "fp32"):
        return sum(map(len, groups))
    if zero == 3:
        return len(groups)
    numel = sum(map(sum, groups))
    return max(1, -(-numel * _itemsize(precision) // bucket_bytes))


def in_flight(schedule: str, pp: int, micro_batches: int, virtual_stages: int, chunk: int) -> float:
    """Micro-batches whose activations chunk ``chunk`` holds at once, at the most: all of them under
    GPipe, pp - stage under 1F1B; under interleaving a rank's warm-up forwards, shared by its chunks."""
    stage = chunk % pp
    if schedule == "gpipe":
        return micro_batches
    if schedule == "1f1b":
        return min(micro_batches, pp - stage)
    warm = 2 * (pp - stage - 1) + (virtual_stages - 1) * pp + 1
    return min(micro_batches * virtual_stages, warm) / virtual_stages


def ideal_bubble(pp: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """The idle share of equal stages: (p-1)/(m+p-1), and (p-1)/(vm+p-1) interleaved."""
    return (pp - 1) / (virtual_stages * micro_batches + pp - 1)


@dataclass(frozen=True)
class Stage:
    """One chunk of the pipeline (a stage, or a virtual stage under interleaving) on rank ``rank``:
    its units' first and last module, seconds per micro-batch (p2p sends included), memory,
    recompute mode, and what its operator ranks split (:attr:`Units.tp_split`)."""

    rank: int
    first: str
    last: str
    forward_s: float
    backward_s: float
    memory: MemoryEstimate
    recompute: str = "none"
    tp_split: str = "ops"


@dataclass(frozen=True)
class PipelineCost:
    """A pipeline's predicted step on one mesh: boundaries (the blocks stages 2.. begin with), the
    busiest rank's compute, op comm and p2p seconds, the rest of the simulated span as its bubble,
    bubble: the idle share of all ranks over the span, dp_comm_s: the data-parallel communication
    of the gradients of the rank holding the most parameters (all its chunks'), memory: the fullest rank's."""

    schedule: str
    micro_batches: int
    virtual_stages: int
    boundaries: tuple[str, ...]
    compute_s: float
    op_comm_s: float
    p2p_s: float
    bubble_s: float
    dp_comm_s: float
    bubble: float
    stages: tuple[Stage, ...]
    memory: MemoryEstimate
    span_s: float = 0.0  # the simulated schedule, first start to last end (the step less data-parallel sync and update)
    refused_s: float = float("inf")  # what freeing memory may reach (the least span of an option memory refused)
    bucket_bytes: int = BUCKET_BYTES  # gradients per data-parallel collective
    squeezed: bool = False  # memory refused it faster cuts, chunk modes or bucket size: freeing it may gain

    @property
    def step_s(self) -> float:
        return self.compute_s + self.op_comm_s + self.p2p_s + self.bubble_s + self.dp_comm_s

    @property
    def recompute(self) -> tuple[str, ...]:
        """Each chunk's recompute mode, in chunk order."""
        return tuple(s.recompute for s in self.stages)

    @property
    def tp_split(self) -> tuple[str, ...]:
        """What each chunk's operator ranks split, in chunk order."""
        return tuple(s.tp_split for s in self.stages)


@dataclass(frozen=True)
class Setup:
    """What one pipelined mesh runs under: pp stages, dp data-parallel ranks, rows per data-parallel
    replica per step, the optimizer-parallel level, precision and offload, the memory limit;
    send: seconds to send bytes between neighbouring stages; dp_sync(bytes, groups, m, bucket):
    the data-parallel communication of that many gradient bytes of these parameter groups over m
    micro-batches, in buckets of that many bytes (:class:`DataSync`: read at a backward's length);
    update_seconds(numel, tensors): the optimizer step's (or offload's copies') seconds over that many
    parameters in that many tensors (none given: a lower bound); fixed: settings the user fixed; memo:
    results one search reuses (unit memory, simulated schedules, time-balanced cuts); bucket_sizes: the
    gradient bucket sizes to choose from, the default first."""

    pp: int
    dp: int
    rows: int
    zero: int
    precision: str
    offload: str
    limit: float
    send: Callable[[np.ndarray], np.ndarray]
    dp_sync: Callable[[float, tuple, int, int], DataSync]
    update_seconds: Callable[..., float]
    fixed: Fixed = Fixed()
    memo: dict = dataclasses.field(default_factory=dict)
    bucket_sizes: tuple[int, ...] = (BUCKET_BYTES,)


def best_pipeline(modes: Modes, setup: Setup,
                  best_s: float = float("inf")) -> tuple[PipelineCost | None, float, float]:
    """The fastest (micro-batch count, schedule, virtual stages) whose cuts let every stage fit,
    tried in the order of their lower bounds until the bound loses to the best found or
    ``best_s``; the lowest bound of those not tried or not simulated (their cuts fit, but the busiest
    rank's work alone lost; inf when all were costed); and what saving memory may reach (:func:`_freed`)."""
    units = modes[0]
    numel = sum(units.unit_numels)
    allowed = list(schedule_options(len(units), setup.rows, setup.pp, setup.fixed))
    options = sorted((bound, *option) for bound, option in zip(_bounds(modes, setup, allowed, numel), allowed))
    best, tried, overflow_at, ranges = None, set(), {}, {}
    refused = []  # (bound, option) of the options memory refused, or squeezed into slower cuts
    lost_bound = float("inf")  # the lowest bound of the options that fit but were not simulated (they lose)
    for bound, m, schedule, v in options:
        beat = min(best_s, best.step_s if best else float("inf"))
        if bound >= beat:
            break
        if schedule == "gpipe" and m in tried:  # 1F1B ran the same work in no more memory: GPipe cannot gain
            continue
        if m <= overflow_at.get((schedule, v), 0):  # fewer, larger micro-batches hold no less per stage
            refused.append((bound, m, schedule, v))
            continue
        found = cost_pipeline(modes, setup, m, schedule, v, beat_s=beat, ranges=ranges)
        if schedule == "1f1b":
            tried.add(m)
        if isinstance(found, Loses):
            lost_bound = min(lost_bound, found.bound_s)
            continue
        if found is None:
            overflow_at[(schedule, v)] = max(m, overflow_at.get((schedule, v), 0))
        if found is None or found.squeezed:
            refused.append((bound, m, schedule, v))
        found = found and _uniform_if_faster(modes, setup, found, beat)
        if found is not None and (best is None or found.step_s < best.step_s):
            best = found
    else:
        bound = float("inf")  # every option was tried
    freed = _freed(modes, setup, refused, ranges)
    return best and dataclasses.replace(best, refused_s=freed), min(bound, lost_bound), freed


def _uniform_if_faster(modes: Modes, s: Setup, found: PipelineCost, beat_s: float) -> PipelineCost:
    """``found``, or where some of its chunks split rows and every chunk splitting operators on its schedule is
    faster than it and than ``beat_s`` (the best found so far), that: each chunk takes the split it runs faster in,
    blind to the optimizer step whole weights lengthen and to how evenly the cuts then share the work."""
    ops = tuple(u for u in modes if u.tp_split == "ops")
    if "rows" not in found.tp_split or not ops:
        return found
    alone = cost_pipeline(ops, s, found.micro_batches, found.schedule, found.virtual_stages,
                          beat_s=min(found.step_s, beat_s))
    return alone if isinstance(alone, PipelineCost) and alone.step_s < found.step_s else found


def _freed(modes: Modes, s: Setup, refused: list[tuple], ranges: dict | None = None) -> float:
    """What saving memory may reach: of the ``refused`` options ((bound, m, schedule, v)), the least span any
    takes on its cuts with memory to spare (the busiest rank's work, fill and drain, which recompute only
    lengthens; not simulated). inf when none."""
    spare = dataclasses.replace(s, limit=float("inf"))
    least = float("inf")
    for bound, m, schedule, v in sorted(refused):
        if bound >= least:
            break
        found = cost_pipeline(modes, spare, m, schedule, v, beat_s=0.0, ranges=ranges)  # least span, not simulated
        if found is not None:  # None: the modes allowed leave some chunk nothing to run, at any memory
            least = min(least, found.bound_s)
    return least


def leanest_pipeline(modes: Modes, setup: Setup) -> PipelineCost | None:
    """The time-balanced cuts under the allowed schedule with the most micro-batches and the leanest
    recompute mode, whatever their memory (to tell by how much a mesh on which nothing fits misses);
    None when nothing is allowed."""
    options = list(schedule_options(len(modes[0]), setup.rows, setup.pp, setup.fixed))
    if not options:
        return None
    m, schedule, v = max(options, key=lambda o: (o[0], o[1] == "1f1b"))
    leanest = [u for u in modes if not u.split_rows][-1:]
    return cost_pipeline(leanest, dataclasses.replace(setup, limit=float("inf")), m, schedule, v, simulated=False)


def _unit_state(units: Units, s: Setup) -> tuple[list[MemoryEstimate], np.ndarray]:
    """Each unit's parameter memory, and its running total from the first unit (0 before it); the gradient
    bucket is counted once per stage instead. A stage accumulates its gradients over the micro-batches, whole
    until the last (counted so for every m)."""
    whole = ("state", id(units), s.zero, s.dp, s.precision, s.offload)
    if whole not in s.memo:
        out = []
        for groups in units.groups:
            key = (groups, *whole[2:])  # repeated blocks hold alike
            if key not in s.memo:
                s.memo[key] = dataclasses.replace(state_memory(groups, *key[1:], accumulating=True), buffers_bytes=0.0)
            out.append(s.memo[key])
        s.memo[whole] = out, np.concatenate([[0.0], np.cumsum([st.total_bytes for st in out])])
    return s.memo[whole]


def schedule_options(n: int, rows: int, pp: int, f: Fixed):
    """(micro-batches, schedule, virtual stages) to try for ``n`` units on ``pp`` stages, bounded: m divides the
    ``rows``, with micro-batches of at most MAX_MICRO_ROWS rows or at most MAX_MICRO_PER_STAGE per stage;
    interleaving with 2, 3, 4, 6 or 8 chunks per rank (at most n/pp), m a multiple of pp; pp x v chunks where the
    user gives a recompute mode or a tp split per chunk. What the user fixes is tried whatever these bounds say."""
    for m in (m for m in range(1, rows + 1) if rows % m == 0):
        if f.m is None and f.mbs is None and rows // m > MAX_MICRO_ROWS and m > MAX_MICRO_PER_STAGE * pp:
            continue
        candidates = [(m, "1f1b", 1), (m, "gpipe", 1)]
        if pp > 1 and m % pp == 0:
            chunks = [f.v] if f.v is not None else [v for v in VIRTUAL_STAGES if v <= n // pp]
            candidates += [(m, "interleaved", v) for v in chunks if 1 < v <= n // pp]
        for m_, schedule, v in candidates:
            if f.allows(m=m_, mbs=rows // m_, schedule=schedule, v=v) and \
                    len(f.stage_recompute) in (0, pp * v) and len(f.stage_tp_split) in (0, 1, pp * v):
                yield m_, schedule, v


def _bounds(modes: Modes, s: Setup, options: list[tuple[int, str, int]], numel: float) -> list[float]:
    """Per (m, schedule, v): equal stages' step, (m + (p-1)/v) x the mean stage's micro-batch, or if more,
    m x the slowest unit's (whichever rank holds it runs it m times), each unit and cut in its fastest mode (the
    first mode's parameters, which the others hold no fewer of); plus the optimizer step and the least
    exposed gradient communication (at any bucket size) of the rank holding the most parameters (at least the
    mean share of the ``numel``): hidden beside no more than the mean chunk's backward (:func:`cost_pipeline`
    hides it beside the least one's), at level 3 with every small parameter of the model left whole and one
    module gathered."""
    units = modes[0]
    grads = numel / s.pp * _itemsize(s.precision)
    every = (tuple(n for group in units.model_groups for n in group),)  # one module holding every parameter
    update = s.update_seconds(numel / s.pp)
    per_m = {}  # m -> (the stages' summed seconds per micro-batch, the slowest unit's, the most one cut sends)
    out = []
    for m, _, v in options:
        if m not in per_m:
            seconds = np.min([u.seconds(s.rows / m) for u in modes], axis=0)
            sends = np.min([s.send(u.send_bytes * s.rows / m) for u in modes], axis=0)
            per_m[m] = (seconds.sum(), seconds.max(), float(np.max(sends)),
                        [s.dp_sync(grads, every, m, b) for b in s.bucket_sizes])
        total, slowest, sent, syncs = per_m[m]
        backward = (1 - units.forward_share) * total / (s.pp * v) + sent
        out.append(max((m + (s.pp - 1) / v) * total / s.pp, m * slowest)
                   + min(sync.exposed(backward) for sync in syncs)
                   + update)
    return out


@dataclass(frozen=True)
class Loses:
    """cost_pipeline's answer where cuts fit, memory kept none from faster ones, and they cannot beat the time
    asked: the busiest rank's own work, with gradient sync and update, already takes ``bound_s`` (no schedule was
    simulated)."""

    bound_s: float


class _Ranges:
    """Per mode, what every unit range [i, j) (indexed [i, j]) holds and takes at one micro-batch's ``rows``:
    what :func:`cost_pipeline` reads at every schedule and micro-batch count of those rows."""

    def __init__(self, modes: Modes, s: Setup, rows: float):
        self.modes, self.setup, self.rows = modes, s, rows
        self.state, self.fixed_of = zip(*(_unit_state(u, s) for u in modes))  # each unit's state; running totals
        # in one micro-batch's backward: its recomputed block alive again, and the gradients of the op running
        self.working = [(u.rerun_bytes.max() + u.transient_bytes.max()) * rows for u in modes]
        self.least_acts = np.min([u.activation_bytes for u in modes], axis=0).sum() * rows

    @functools.cached_property
    def seconds(self) -> list[np.ndarray]:
        return [u.seconds(self.rows) for u in self.modes]

    @functools.cached_property
    def send(self) -> list[np.ndarray]:
        """Per cut 0..n, what a chunk sends across it (the ends send nothing)."""
        return [np.concatenate([[0.0], self.setup.send(u.send_bytes[1:] * self.rows), [0.0]]) for u in self.modes]

    @functools.cached_property
    def numel_of(self) -> list[list[int]]:
        """Per mode, the parameters of the units before each cut 0..n (exact: integers)."""
        return [[0, *itertools.accumulate(u.unit_numels)] for u in self.modes]

    @functools.cached_property
    def time(self) -> list[np.ndarray]:
        """Seconds, with sends of activations out and gradients back in."""
        return [range_sums(sec) + sent[None, :] + sent[:, None] for sec, sent in zip(self.seconds, self.send)]

    @functools.cached_property
    def base(self) -> list[np.ndarray]:
        """Parameter state, working memory and a level-0 bucket."""
        return [f[None, :] - f[:, None] + w + _bucket(self.setup) for f, w in zip(self.fixed_of, self.working)]

    @functools.cached_property
    def acts(self) -> list[np.ndarray]:
        """Activations of one micro-batch."""
        return [range_sums(u.activation_bytes * self.rows) for u in self.modes]


def _bucket(s: Setup) -> float:
    """At level 0 with data parallel, the gradient buffer each chunk holds: cuts fit the least one."""
    return min(s.bucket_sizes) if s.dp > 1 and s.zero == 0 else 0.0


def cost_pipeline(modes: Modes, s: Setup, m: int, schedule: str, v: int, simulated: bool = True,
                  beat_s: float = float("inf"), ranges: dict | None = None
                  ) -> PipelineCost | Loses | None:
    """This (m, schedule)'s fastest cuts whose every stage fits, each chunk in the fastest of ``modes`` that fits
    it (sending across its cuts what that mode's plan lays out there), simulated; None when no cuts fit,
    :class:`Loses` when they cannot take less than ``beat_s``. ``simulated=False`` times the schedule by the
    equal-stage formula instead, (m + (p-1)/v) x the busiest rank's micro-batch (for a split that does not fit,
    whose memory is what matters). ``ranges``: :class:`_Ranges` by micro-batch rows, kept across calls on the same
    modes and setup (its memory limit aside)."""
    units = modes[0]
    n, chunks, rows = len(units), s.pp * v, s.rows / m
    ranges = {} if ranges is None else ranges
    if rows not in ranges:
        ranges[rows] = _Ranges(modes, s, rows)
    r = ranges[rows]
    state, fixed_of, working = r.state, r.fixed_of, r.working
    held = [in_flight(schedule, s.pp, m, v, c) for c in range(chunks)]
    in_flight_of = np.array(held)
    bucket = _bucket(s)
    allowed = _allowed(modes, s, chunks, s.rows // m)
    if min(f[-1] for f in fixed_of) + r.least_acts * min(held) + chunks * (min(working) + bucket) > s.pp * s.limit:
        return None  # more than all chunks hold together (limit / v each): no cuts fit, and no program is needed
    seconds, send, time, base, acts = r.seconds, r.send, r.time, r.base, r.acts

    def load(banded, cap: float = s.limit / v):  # time where a range fits with its chunk's activations in flight,
        return functools.reduce(np.minimum, (  # in its fastest mode that does
            np.where(allowed[:, k, None, None] & (banded(b) + banded(a) * in_flight_of[:, None, None] <= cap),
                     banded(t), np.inf)
            for k, (b, a, t) in enumerate(zip(base, acts, time))))

    def modes_of(cuts: list[int], cap: float = s.limit / v) -> list[int] | None:
        """Each chunk's fastest mode that fits under ``cap`` (the first of equals); None if one has none."""
        edges = np.array([0, *cuts, n])
        if len(edges) != chunks + 1:
            return None
        i, j = edges[:-1], edges[1:]
        fits = np.stack([allowed[:, k] & (b[i, j] + a[i, j] * in_flight_of <= cap)
                         for k, (b, a) in enumerate(zip(base, acts))])
        if not fits.any(axis=0).all():
            return None
        return np.where(fits, np.stack([t[i, j] for t in time]), np.inf).argmin(axis=0).tolist()

    if s.fixed.cuts == "even":
        cuts = even_partition(n, chunks)
    else:
        # The time-balanced cuts ignore memory and the optimizer level: where they fit in the fastest mode they
        # are the answer, and the levels and schedules that share them need no program of their own.
        free = ("cuts", id(units), chunks, rows, send[0].tobytes())
        if free not in s.memo:
            s.memo[free] = min_max_partition(lambda banded: banded(time[0]), n, chunks)[1]
        cuts = list(s.memo[free])
    mode = modes_of(cuts)
    squeezed = mode != modes_of(cuts, float("inf"))  # memory kept a chunk from its fastest mode
    if s.fixed.cuts == "even":
        if mode is None:
            return None
    elif mode is None or any(mode):
        if not _coverable(base, acts, held, s.limit / v):
            return None
        slowest, cuts = min_max_partition(load, n, chunks)
        if not np.isfinite(slowest):
            return None
        mode = modes_of(cuts)
        if not squeezed:  # the balanced cuts fit, in a slower mode: did memory keep other cuts from less?
            unlimited = ("cuts in any mode", tuple(map(id, modes)), chunks, rows)
            if unlimited not in s.memo:
                s.memo[unlimited] = min_max_partition(functools.partial(load, cap=float("inf")), n, chunks)[0]
            squeezed = slowest > s.memo[unlimited] * (1 + 1e-12)
    edges = [0, *cuts, n]
    parts = list(zip(edges, edges[1:]))
    run = [modes[k] for k in mode]  # each chunk's units, in its mode
    own = [seconds[k][i:j].sum() for k, (i, j) in zip(mode, parts)]  # each chunk's seconds, sends aside
    forward = [u.forward_share * t + send[k][j] for k, u, t, (i, j) in zip(mode, run, own, parts)]  # activations out
    backward = [(1 - u.forward_share) * t + send[k][i] for k, u, t, (i, j) in zip(mode, run, own, parts)]  # grads in
    # the parameters each rank holds (its one stage's, or under interleaving its v chunks'), the groups of the fullest
    rank_numel = [sum(r.numel_of[mode[c]][edges[c + 1]] - r.numel_of[mode[c]][edges[c]]
                      for c in range(k, chunks, s.pp)) for k in range(s.pp)]
    most = max(range(s.pp), key=rank_numel.__getitem__)
    groups = tuple(g for c in range(most, chunks, s.pp) for unit in run[c].groups[edges[c]:edges[c + 1]] for g in unit)
    numel = rank_numel[most]
    # a rank's gradients sync in its last micro-batch's backward, beside the backwards still to run there, in
    # buckets of each size: (exposed sync, optimizer step)
    synced = {b: (s.dp_sync(numel * _itemsize(s.precision), groups, m, b).exposed(min(backward)),
                  s.update_seconds(numel, stepped_tensors(groups, s.zero, s.precision, s.offload, b)))
              for b in s.bucket_sizes}
    work = [m * sum(forward[c] + backward[c] for c in range(r, chunks, s.pp)) for r in range(s.pp)]  # per rank
    # no span is shorter than a rank's own work, after the first micro-batch's forward reaches its first chunk r
    # and before the last one's backward leaves it for chunks r-1 .. 0 (the fill and drain of every schedule)
    least = max(sum(forward[:r]) + work[r] + sum(backward[:r]) for r in range(s.pp)) + min(map(sum, synced.values()))
    # cuts memory squeezed are costed whatever they lose by: the search reads that freeing memory may gain, and
    # goes on to recompute (a loss on them is no loss at any memory)
    if simulated and beat_s < float("inf") and not squeezed and least * (1 - 1e-12) >= beat_s:
        return Loses(least)
    # each chunk holds its units' state and its micro-batches in flight, and at level 0 a bucket-sized buffer:
    # the fastest size whose buffer fits beside every chunk (the cuts fit the least)
    held_bytes = [_sum_memory(state[mode[c]][i:j] + [MemoryEstimate(0.0, 0.0, 0.0, run[c].activation_bytes[i:j].sum()
                                                                     * rows * held[c] + working[mode[c]], 0.0)])
                  for c, (i, j) in enumerate(parts)]

    def buffer(size: int, chunk: MemoryEstimate) -> float:  # as estimate_memory counts one: no more than the gradients
        return min(size, chunk.params_bytes) if bucket else 0.0

    size = min((b for b in s.bucket_sizes if not bucket or b == bucket or
                all(h.total_bytes + buffer(b, h) <= s.limit / v for h in held_bytes)), key=lambda b: sum(synced[b]))
    squeezed |= sum(synced[size]) > min(map(sum, synced.values()))
    dp_comm, update = synced[size]
    stages = [Stage(c % s.pp, units.span[i][0], units.span[j - 1][1], forward[c], backward[c],
                    dataclasses.replace(h, buffers_bytes=buffer(size, h)), run[c].recompute, run[c].tp_split)
              for c, ((i, j), h) in enumerate(zip(parts, held_bytes))]
    if simulated:
        key = (schedule, s.pp, m, v, tuple(forward), tuple(backward))  # cuts that differ only in memory time alike
        if key not in s.memo:
            s.memo[key] = _simulated(*key)
        span, busy = s.memo[key]
    else:
        busy = work
        span = max(busy) * (1 + (s.pp - 1) / (v * m))
    rank = max(range(s.pp), key=busy.__getitem__)
    mine = [(run[c], *parts[c]) for c in range(rank, chunks, s.pp)]
    compute = m * sum(rows * u.compute_s[i:j].sum() + u.overhead_s[i:j].sum() for u, i, j in mine)
    op_comm = m * sum(rows * u.comm_s[i:j].sum() + u.latency_s[i:j].sum() for u, i, j in mine)
    p2p = m * sum(forward[c] + backward[c] - own[c] for c in range(rank, chunks, s.pp))
    compute += update
    fullest = max(range(s.pp), key=lambda r: sum(stages[c].memory.total_bytes for c in range(r, chunks, s.pp)))
    memory = _sum_memory([stages[c].memory for c in range(fullest, chunks, s.pp)])
    return PipelineCost(schedule, m, v, tuple(units.starts[i] for i in cuts), compute, op_comm, p2p,
                        span - busy[rank], dp_comm, 1 - sum(busy) / (s.pp * span), tuple(stages), memory, span,
                        bucket_bytes=size, squeezed=squeezed)


def _allowed(modes: Modes, s: Setup, chunks: int, micro_rows: int) -> np.ndarray:
    """[chunk, mode]: :func:`_allows`, once per modes, chunk count and micro-batch rows."""
    key = ("allowed", tuple(map(id, modes)), chunks, micro_rows)
    if key not in s.memo:
        s.memo[key] = np.array([[_allows(s.fixed, u, c, micro_rows) for u in modes] for c in range(chunks)])
    return s.memo[key]


def _allows(fixed: Fixed, units: Units, chunk: int, micro_rows: int) -> bool:
    """Whether chunk ``chunk`` may run ``units``' plan: the recompute mode and operator split the user gave it, if
    any, and rows of a micro-batch that divide over the ranks splitting them."""
    recompute, split = fixed.stage_recompute, fixed.stage_tp_split
    return (not recompute or units.recompute == recompute[chunk]) and \
        (not split or units.tp_split == split[chunk if len(split) > 1 else 0]) and \
        (not units.split_rows or micro_rows % units.split_rows == 0)


def _coverable(base: list[np.ndarray], acts: list[np.ndarray], held: list[float], cap: float) -> bool:
    """Whether the chunks in order, each taking as many units as fit beside its micro-batches in flight in one
    of the modes (``base`` and ``acts`` per mode), reach the last unit. Where they do not, no cuts fit: a chunk
    of any cuts ends no later than this one does (a range holds no less than the ranges inside it), so those
    cuts leave units over too."""
    i, n = 0, base[0].shape[0] - 1
    for h in held:
        i += max(int(np.searchsorted(b[i, i + 1:] + a[i, i + 1:] * h, cap, side="right"))  # grows with the range
                 for b, a in zip(base, acts))
        if i >= n:
            return True
    return False


def _simulated(schedule: str, pp: int, m: int, v: int, forward: tuple, backward: tuple) -> tuple[float, list[float]]:
    """The simulated span and each rank's busy seconds (its chunks' times, m times over)."""
    busy = [m * sum(forward[c] + backward[c] for c in range(r, len(forward), pp)) for r in range(pp)]
    return _span(schedule, pp, m, v, forward, backward), busy


def _span(schedule: str, pp: int, m: int, v: int, forward: tuple, backward: tuple) -> float:
    """The simulated span; beyond SIMULATED_PER_STAGE micro-batches per stage, it grows at the steady state's pace
    (what the last micro-batch, or under interleaving the last group of pp, added)."""
    cap, group = SIMULATED_PER_STAGE[schedule] * pp, pp if schedule == "interleaved" else 1
    if m > cap:
        span, before = (_span(schedule, pp, k, v, forward, backward) for k in (cap, cap - group))
        return span + (m - cap) / group * (span - before)
    return simulated_span(schedule, pp, m, v, forward, backward)


def _sum_memory(parts: list[MemoryEstimate]) -> MemoryEstimate:
    return MemoryEstimate(*(sum(getattr(p, f) for p in parts) for f in
                            ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes",
                             "buffers_bytes", "offloaded_bytes", "apart_bytes")))


def _itemsize(precision: str) -> int:
    return DTYPES[precision][1]
