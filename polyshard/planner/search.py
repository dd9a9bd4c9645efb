"""Full search: every dp x pp x tp split of the devices, each whole-model choice (recompute,
offload), and within each the cheapest strategy per op.

An integer program (polyshard.planner.intra_op) picks every op's strategy once per operator axes and
recompute mode, shared by every split on those axes: a pipeline stage runs its ops as that plan lays
them out (polyshard.planner.pipeline chooses the cuts, micro-batches and schedule), and a split that
holds the whole model is solved again under the memory limit where the shared plan does not fit. Where
neither precision is priced faster in every term (CPUs), each is costed with the program solved in it.
Each split is costed at every optimizer-parallel level, precision and micro-batch count (gradient accumulation
when there is no pipeline); the fastest that fits wins. Splits are tried from the most promising, and what a
lower bound shows cannot win is not costed: every bound is computed in the narrowest precision tried, priced
as fast as the fastest tried in every term (polyshard.planner.precision), and with all data-parallel traffic
hidden (without a pipeline: all that backward can hide at each optimizer level), so it is never above what it
prunes. Recompute and offload are tried where memory is tight, also where
a split fits only because nothing was costed yet; a pipeline's chunks each take the fastest recompute mode
that fits them (early stages hold more micro-batches in flight), all laid out by the plain program, whose
bounds bound them. An operator split of k ways is first bounded by the unsplit program's bound / k (no op gets
faster than its work split evenly), a pipelined one so at every micro-batch's rows and then by the pipeline's
wait at the schedule where it is least, and one over k ranks of an axis by k0 / k of a built program's on k0 of
them (no strategy gets more than k / k0 times cheaper on k / k0 times the ranks), so hopeless splits need no
program.
Costs use one capture of the model at one row, scaled by the rows each split gives a device
(compute, activations and their communication grow with rows; parameters do not). Each costed option takes
the gradient bucket size (of BUCKET_CHOICES) that syncs and steps its gradients fastest.
On a cluster of several nodes, processes forked before the first split cost the splits side by side
(:mod:`polyshard.planner.workers`), sharing the best step time found so far; the splits on one set of operator
axes go to the process that built their program.
A ``Fixed`` restricts the search to the settings a user gives (``polyshard cost --config``). A model whose
parameters alone, spread over every device, exceed the limit is refused before it is captured.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import math
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from torch import fx, nn

from polyshard.buckets import BUCKET_BYTES
from polyshard.cluster import Cluster, format_bytes
from polyshard.errors import PolyshardError
from polyshard.graph.capture import at_rows, capture
from polyshard.graph.regions import recomputed
from polyshard.mesh import PIPELINE_AXIS
from polyshard.pin import PIN_ATTR
from polyshard.planner.cost.comm import DataSync, axis_link
from polyshard.planner.cost.data_parallel import dp_seconds, dp_sync
from polyshard.planner.cost.memory import MemoryEstimate, estimate_memory, frees_activations
from polyshard.planner.cost.offload import device_bytes_per_param, offload_seconds
from polyshard.planner.cost.compute import optimizer_seconds, passes
from polyshard.planner.cost.overlap import first_bucket_bytes, op_costs
from polyshard.planner.candidates import covers, enumerated
from polyshard.planner.intra_op import IntraOpResult, Terms, forward_floor, program_terms, solve
from polyshard.planner.precision import bounding_cluster, narrowest, precisions_to_cost
from polyshard.planner.pipeline import (Setup, Units, best_pipeline, crossing_bytes, forward_share, leanest_pipeline,
                                        level3_traffic, schedule_options, state_memory, stepped_tensors, unit_costs)
from polyshard.planner.config import Fixed
from polyshard.planner.split import (Candidate, data_size, mesh_candidates, mesh_text, operator_axes, operator_size,
                                     search_report, spatial_sizes, stage_count)
from polyshard.planner.workers import SharedBest, SharedTally, available_cores, run_items
from polyshard.planner.dataset import input_layouts
from polyshard.pin import tp_plan_agreement
from polyshard.plan import (DTYPES, OFFLOADS, RECOMPUTE_MODES, ZERO_LEVELS, ZERO_THRESHOLD_BYTES, Plan,
                            most_recompute)
from polyshard.planner.rules import left_whole
from polyshard.planner.rules.base import INPUT_LAYOUTS
from polyshard.planner.stage_rows import batch_values, rows_layouts, shared_parameters, with_rows_chunks
from polyshard.graph.stage_cuts import assign_chunks, block_paths
from polyshard.planner.stages import pp_plan_agreement, pp_plan_units

# Whole-model (recompute, offload) settings, in the order tried: the first costs no time.
SETTINGS = tuple(itertools.product(RECOMPUTE_MODES, OFFLOADS))
# Memory kept free on a GPU for what the model does not count: the CUDA context, NCCL's buffers and
# the caching allocator's fragmentation (PyTorch's CUDA semantics notes; about 1-3 GiB in practice).
GPU_RESERVE_SHARE, GPU_RESERVE_MIN_BYTES = 0.05, 2 * 2**30
# Gradient accumulation counts tried per split without a pipeline: the fewest micro-batches that fit.
ACCUMULATION_TRIES = 12
# Gradient bucket sizes a plan may take: fewer, larger collectives pay fewer fixed costs, a smaller last
# bucket leaves less unhidden after backward. 25 MiB is torch DDP's default (bucket_cap_mb); DeepSpeed's
# ZeRO config defaults reduce_bucket_size to 5e8 elements (about 1 GB in bf16), so larger sizes are in use.
BUCKET_CHOICES = tuple(mib * 2**20 for mib in (1, 5, 25, 100, 400))


def default_reserve_bytes(cluster: Cluster) -> int:
    """Bytes of each device the plan leaves free: on GPUs the larger of 5% and 2 GiB; none on CPU."""
    if cluster.device_type != "cuda":
        return 0
    return int(max(GPU_RESERVE_SHARE * cluster.memory_bytes, GPU_RESERVE_MIN_BYTES))


def _paused_cycle_collection(fn):
    """Run ``fn`` with Python's cyclic garbage collector off: a search makes millions of short-lived
    objects and no garbage cycles, and the collector's passes over the captured graph cost about a
    fifth of its time at cluster scale."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()
    return run


@_paused_cycle_collection
def search(model: nn.Module, example_row: Sequence[torch.Tensor], cluster: Cluster, global_batch: int,
           memory_limit_bytes: float | None = None, meshes=None, data_axes: tuple[str, ...] = ("dp",),
           fixed: Fixed = Fixed(), reserve_bytes: float | None = None,
           pp_plan: bool = False, dataset_strategy: Sequence | None = None,
           graph: fx.GraphModule | None = None, workers: int | None = None,
           progress: Callable[[int, int], None] | None = None) -> tuple[Plan, list[Candidate]]:
    """The best plan over ``meshes`` (default: every dp x pp x tp split) and every candidate's costs.

    ``example_row``: inputs for one row (batch dim 1); ``global_batch``: rows per step in all;
    ``data_axes``: the mesh axes that split the batch (``pp`` holds pipeline stages; the others split operators);
    ``fixed``: settings the plan must keep; ``reserve_bytes``: of the limit, what plans leave free
    (default :func:`default_reserve_bytes`); ``pp_plan``: stages may begin at every module a transformers
    model's own pipeline plan names (:func:`pp_plan_units`), not only at its repeated blocks;
    ``dataset_strategy``: per positional input, how its dims split (slice counts, or axis names: a mesh
    without the axis keeps the dim whole), so the search weighs splitting images by height and width;
    ``graph``: the model already captured at ``example_row`` (:func:`capture`), so a second search skips it;
    ``workers``: processes that cost splits side by side (default: see :func:`_default_workers`);
    ``progress(done, total)``: told, in this process, of the splits costed as the search goes.
    """
    limit, reserve = refuse_where_nothing_fits(model, cluster, memory_limit_bytes, reserve_bytes, fixed)
    gm = capture(model, example_row) if graph is None else graph
    blocks = (pp_plan_units(model, gm) if pp_plan else ()) or block_paths(gm)  # where pipeline stages may begin
    allowed = [m for m in meshes or mesh_candidates(cluster.num_devices, len(blocks),
                                                    None if fixed.tp else cluster.devices_per_node)
               if _keeps(fixed, m, data_axes) and global_batch % data_size(m, data_axes) == 0]
    costs = _Costs(gm, cluster, data_axes, global_batch, limit, fixed, blocks, dataset_strategy,
                   lambda rows: at_rows(model, gm, example_row, rows), _rows_splits(allowed, data_axes, global_batch))
    ordered = costs.order(allowed)
    workers = _default_workers(cluster) if workers is None else workers
    best = SharedBest(shared=workers > 1)
    tally = SharedTally(workers > 1, lambda done: progress(done, len(ordered))) if progress else None
    if progress:
        progress(0, len(ordered))  # the first split may take seconds (it solves the program most share)

    def cost(mesh) -> _Tried:
        found = costs.tried(mesh, best)
        if tally is not None:
            tally.add(1)
        return found

    # this process costs the first split, which sets the incumbent; splits on the same operator axes share their
    # program, so the process that costs the first of them costs the rest while others are left
    tried = run_items(ordered, cost, workers, keys=[operator_axes(m, data_axes) for m in ordered])
    candidates = [c for t in tried for c in t.candidates]
    plans = {key: plan for t in tried for key, plan in t.plans.items()}
    skipped = [s for t in tried for s in t.skipped]
    if not candidates:
        rows = f" ({global_batch // fixed.dp} at dp={fixed.dp})" if fixed.dp and global_batch % fixed.dp == 0 else ""
        why = "; ".join(skipped) or fixed.conflict(global_batch, len(costs.blocks)) or (
            f"none allowed by {fixed.text()} holds a plan (the data-parallel size must divide the batch of "
            f"{global_batch}, mbs and m each replica's rows{rows} and, interleaved, m be a multiple of pp; pp x v "
            f"cannot exceed the model's {len(costs.blocks)} blocks; optimizer levels above 0 need dp > 1, offload "
            "needs zero=0 and fp32)" if fixed.text() else f"none divides the batch of {global_batch}")
        raise PolyshardError(f"no split of {cluster.num_devices} devices works: {why}")
    fitting = [c for c in candidates if c.memory.total_bytes <= limit and not c.pruned]
    if not fitting:
        least = min((c for c in candidates if not c.pruned), key=lambda c: c.memory.total_bytes)
        kept = fixed.text()
        raise PolyshardError(
            f"{f'no plan that keeps {kept} fits' if kept else 'the model does not fit'}: the leanest split "
            f"({least.describe()}) needs {'at least ' * least.memory_floor}{format_bytes(least.memory.total_bytes)} "
            f"per device, {format_bytes(least.memory.total_bytes - limit)} over the {_limit_text(limit, reserve)}; "
            + ("leave more settings to the search (recompute, zero, offload, mbs), or raise --memory-limit to price "
               "it all the same" if kept else "add devices, shrink the batch, or raise --memory-limit"))
    best = min(fitting, key=lambda c: c.step_s)
    ranked = sorted(candidates, key=lambda c: c.step_s)
    report = search_report(ranked, best, limit, reserve, data_axes, cluster)
    hints = {"tp_plan": tp_plan_agreement(model, plans[best.key].params),
             "pp_plan": pp_plan_agreement(model, costs.gm, plans[best.key].stage_boundaries, costs.blocks),
             "left_whole": [[path, list(shape)] for path, shape in left_whole(costs.gm, plans[best.key])]}
    plan = dataclasses.replace(plans[best.key], global_batch=global_batch,
                               first_bucket_bytes=first_bucket_bytes(cluster, plans[best.key].bucket_bytes),
                               report=report | {k: v for k, v in hints.items() if v})
    return plan, ranked


@dataclass
class _Tried:
    """What costing some splits found: every candidate, the plan of the fastest that fits (the search needs no
    other), and the splits a pin ruled out."""

    candidates: list[Candidate]
    plans: dict[tuple, Plan]
    skipped: list[str]
    fastest_s: float = float("inf")

    def keep(self, candidate: Candidate, plan: Plan) -> None:
        if candidate.step_s < self.fastest_s:
            self.plans, self.fastest_s = {candidate.key: plan}, candidate.step_s


def refuse_where_nothing_fits(model: nn.Module, cluster: Cluster, memory_limit_bytes: float | None = None,
                              reserve_bytes: float | None = None, fixed: Fixed = Fixed()) -> tuple[float, float]:
    """The bytes per device plans may fill and the reserve they leave (as :func:`search` takes them); raises,
    without capturing ``model``, where no split can fit: every plan holds each parameter, its gradient and (unless
    offloaded) its optimizer state somewhere, in the narrowest precision its offload setting allows, and at best
    spread evenly over every device with nothing else beside them."""
    reserve = default_reserve_bytes(cluster) if reserve_bytes is None else reserve_bytes
    limit = (memory_limit_bytes or cluster.memory_bytes) - reserve
    if limit <= 0:
        raise PolyshardError(f"the memory reserve of {format_bytes(reserve)} leaves nothing of the "
                             f"{format_bytes(memory_limit_bytes or cluster.memory_bytes)} per device; lower the "
                             "reserve")
    numel = sum(p.numel() for p in model.parameters())
    per_param, offload = min((device_bytes_per_param(offload, DTYPES[precision][1]), offload)
                             for offload in ((fixed.offload,) if fixed.offload else OFFLOADS)
                             for precision in precisions_to_cost(cluster, offload, fixed.precision))
    floor = numel * per_param / cluster.num_devices
    if floor > limit:
        kept = "weight, gradient and optimizer state" if offload == "none" else "weight and gradient, the optimizer " \
            "state offloaded"
        raise PolyshardError(
            f"the model does not fit: its {numel:,} parameters need {per_param} bytes each at the least ({kept}), "
            f"{format_bytes(floor)} per device spread over all {cluster.num_devices}, {format_bytes(floor - limit)} "
            f"over the {_limit_text(limit, reserve)}; add devices or raise --memory-limit")
    return limit, reserve


def _limit_text(limit: float, reserve: float) -> str:
    """The memory limit plans must keep, and the reserve it leaves, for an error message."""
    return f"{format_bytes(limit)} limit" + (f" ({format_bytes(limit + reserve)} less a {format_bytes(reserve)} "
                                             "reserve)" if reserve else "")


def _rows_splits(meshes, data_axes: tuple[str, ...], global_batch: int) -> int:
    """The least common multiple of the rank counts of ``meshes`` whose operator ranks may split a replica's
    rows: a capture at as many rows serves them all."""
    return math.lcm(*(ways for m in meshes if (ways := operator_size(m, data_axes)) > 1 and
                      global_batch // data_size(m, data_axes) % ways == 0), 1)


def _default_workers(cluster: Cluster) -> int:
    """Processes a search runs in: for a cluster of several nodes, this process's share of the cores it may use
    (each rank of a job on this machine plans); one for a single node, whose search takes less than forking saves."""
    if cluster.num_devices <= cluster.devices_per_node:
        return 1
    return max(1, available_cores() // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


class _Costs:
    """One search's model, cluster and limits, with what splits share: the integer program's plan
    per (operator axes, recompute), and that plan's costs per unit per precision; ``capture_rows(rows)``: the model
    captured at that many rows (for stages whose operator ranks split rows), where it may be."""

    def __init__(self, gm, cluster: Cluster, data_axes: tuple[str, ...], global_batch: int, limit: float,
                 fixed: Fixed = Fixed(), stage_units: Sequence[str] = (), dataset_strategy: Sequence | None = None,
                 capture_rows: Callable[[int], fx.GraphModule] | None = None, rows_splits: int = 1):
        self.gm, self.cluster, self.data_axes, self.batch, self.limit = gm, cluster, data_axes, global_batch, limit
        self.fixed = fixed
        self.precisions = tried = precisions_to_cost(cluster, "none", fixed.precision)
        self.narrowest = narrowest(tried)
        self.bounds = bounding_cluster(cluster, tried)  # priced no slower than any precision tried
        # where neither precision is priced faster in every term, each is costed with the strategies solved in it
        # (None: one solve, on the bounding cluster, for every precision)
        self.own_plans: tuple[str | None, ...] = tuple(tried) if len(tried) > 1 else (None,)
        self.blocks = list(stage_units) or block_paths(gm)
        self.unit_of = assign_chunks(gm, self.blocks[1:])
        self.param_numels = tuple(p.numel() for p in gm.parameters())
        self.numel = sum(self.param_numels)
        self.recompute_comm = fixed.recompute_comm or "keep"
        self.all_reduce_only = fixed.tp_comm == "all_reduce"  # then no product reduce-scatters its sums either
        self.sequence = False if self.all_reduce_only else None if fixed.sp is None else bool(fixed.sp)
        self.hides = float(fixed.overlap != 0)  # of backward, the share gradient communication may run beside
        self._solved: dict[tuple, IntraOpResult] = {}
        self._sending: dict[tuple, IntraOpResult] = {}
        self._crossing: dict[tuple, np.ndarray] = {}  # per program, the bytes each column sends across the cuts
        self._terms: dict[tuple, Terms] = {}
        self.recomputed = functools.cache(functools.partial(recomputed, gm))
        self._worth: dict[str, bool] = {}
        self._floors: dict[tuple, float] = {}  # forward_floor per (operator axes or "fp32", recompute)
        self._covers: dict[tuple, bool] = {}  # (built operator axes, operator axes) -> covers()
        self._units: dict[tuple, tuple[Plan, Units]] = {}
        self._memo: dict = {}  # what pipelined splits share (see Setup)
        self._level3: dict[tuple, tuple] = {}  # per parameter groups (kept, so their id stays theirs): _level3
        self.dataset_strategy = dataset_strategy
        self.capture_rows, self.rows_splits = capture_rows, rows_splits
        self.pinned = any(hasattr(m, PIN_ATTR) for m in gm.modules())  # pinned products split the operators
        # rows -> the model captured at those rows, its batch values (None: another graph), its shared parameters
        self._wider: dict[int, tuple[fx.GraphModule, frozenset[str] | None, tuple[str, ...]]] = {}
        self._rows: dict[tuple, Plan] = {}  # (operator axes, shared layouts) -> the rows layout

    def order(self, meshes) -> list:
        """Splits whose operator axes fill one node first (they are likely best, and bound the rest), of those
        first the ones whose ranks hold their parameters' weights, gradients and optimizer state unsharded (the
        first split sets the incumbent the rest are pruned against: one that fits only with its state sharded
        or activations recomputed is seldom fast), then the shallowest pipelines (the least bubble), then by
        their least data-parallel communication."""
        node = self.cluster.devices_per_node
        state = self.numel * device_bytes_per_param("none", DTYPES[self.narrowest][1])
        return sorted(meshes, key=lambda m: (abs(math.log(operator_size(m, self.data_axes) / node)),
                                             state / operator_size(m, self.data_axes) / stage_count(m) > self.limit,
                                             stage_count(m), self.floor(m, "none")))

    def tried(self, mesh, best: SharedBest) -> _Tried:
        """Every setting of ``mesh`` that may beat ``best`` (lowered by what fits), with the plan of the fastest that
        fits."""
        out = _Tried([], {}, [])
        # settings that cannot win on this split: (what their recompute reruns, their offload, "" for any);
        # a setting that reruns as much and offloads as much costs no less
        lost: list[tuple[frozenset[str], str]] = []
        floors: dict[str, dict[tuple, float]] = {}  # offload -> (level, precision) -> what recompute cannot beat
        for setting in SETTINGS:
            rerun = self.recomputed(setting[0], self.recompute_comm).rerun
            if not self.fixed.allows(recompute=setting[0], offload=setting[1]) or any(
                    gone <= rerun and offload in ("", setting[1]) for gone, offload in lost):
                continue
            try:
                found = self.split(mesh, setting, best.value, floors)
            except PolyshardError as exc:  # a pin that this split cannot hold
                out.skipped.append(f"{mesh_text(mesh)}: {exc}")
                break
            for candidate, plan in found:
                out.candidates.append(candidate)
                if plan is not None and candidate.memory.total_bytes <= self.limit:
                    out.keep(candidate, plan)
                    best.offer(candidate.step_s)
                if setting[0] == "none":
                    floors.setdefault(setting[1], {})[(candidate.zero, candidate.precision)] = \
                        _floor(candidate, self.limit)
            if found and all(c.pruned for c, _ in found):
                # recompute only adds time, and so does offload: what lost without them loses with them
                lost.append((rerun, "" if setting[1] == "none" else setting[1]))
                continue
            # recompute and offload only buy memory, at the price of time: once memory refused no option
            # of this setting that could beat the best, the settings rerunning more cannot win here
            variants = len(self.variants(data_size(mesh, self.data_axes), "none"))
            if setting[1] == "none" and _nothing_to_free(found, variants, best.value, self.limit):
                lost.append((rerun, ""))
        return out

    def variants(self, dp: int, offload: str, only: str | None = None) -> list[tuple[int, str]]:
        """(optimizer-parallel level, precision) pairs to cost, less the dominated ones unless fixed:
        levels only with data parallel, and not level 1 (level 2 sends less and holds no more); the
        precisions ``precisions_to_cost`` keeps (mixed precision holds no more bytes per parameter; without offload
        those this search tries), or of them ``only``, where given."""
        levels = ZERO_LEVELS if dp > 1 and offload == "none" else (0,)
        if self.fixed.zero is None:
            levels = tuple(z for z in levels if z != 1)
        precisions = self.precisions if offload == "none" else \
            precisions_to_cost(self.cluster, offload, self.fixed.precision)
        return [(z, p) for z in levels for p in precisions
                if self.fixed.allows(zero=z, precision=p) and only in (None, p)]

    def worth(self, recompute: str) -> bool:
        """Whether a recompute mode may buy memory: it runs something again, and unless the user asked for it,
        frees a kept activation (recompute around attention's views alone only adds time) and is not half (whose
        alternating blocks are no longer costed as one: it doubled the planning time of the largest models, and a
        pipeline's chunks mix whole-block recompute with none already)."""
        if recompute not in self._worth:
            rc = self.recomputed(recompute, self.recompute_comm)
            asked = self.fixed.recompute is not None
            self._worth[recompute] = bool(rc.rerun) and (asked or recompute != "half" and
                                                         frees_activations(self.gm, rc))
        return self._worth[recompute]

    def floor(self, mesh, offload: str) -> float:
        """Seconds no plan on ``mesh`` saves: gradient communication left exposed however much
        backward hides, and offload copies, as if every weight were split over the operator and
        pipeline axes, in the narrowest precision tried."""
        numel = self.numel / operator_size(mesh, self.data_axes) / stage_count(mesh)
        itemsize = DTYPES[self.narrowest][1] if offload == "none" else 4
        dp = data_size(mesh, self.data_axes)
        return min(dp_seconds(itemsize * numel, mesh, self.data_axes, self.bounds, zero, overlap_s=float("inf"),
                              bucket_bytes=size)
                   + _update_seconds(numel, offload, zero, dp, self.narrowest, self.bounds)
                   for zero in ZERO_LEVELS for size in self.bucket_sizes)

    def whole_bound(self, mesh, offload: str, recompute: str, program_s: float) -> float:
        """A lower bound of a step on ``mesh`` without a pipeline whose program (compute and operator
        communication) takes at least ``program_s``: at each optimizer level costed, data-parallel traffic
        hides only beside the backward share of the step, and at level 3 beside forward too
        (:class:`DataSync`'s ``hides`` per second of backward, at one micro-batch, where it sends least);
        its bytes as if every weight were split over the operator axes, and those small enough to stay
        whole at levels 1-3 (:meth:`whole_most`) left out; its fixed costs only per bucket."""
        op_size = operator_size(mesh, self.data_axes)
        numel = self.numel / op_size
        itemsize = DTYPES[self.narrowest][1] if offload == "none" else 4
        dp = data_size(mesh, self.data_axes)
        sharded = max(0.0, numel * itemsize - self.whole_most(op_size, itemsize))
        backward = (1 - forward_share(recompute)) * self.hides
        least = float("inf")
        for zero in {z for z, _ in self.variants(dp, offload)}:
            work = program_s + _update_seconds(numel, offload, zero, dp, self.narrowest, self.bounds)
            for size in self.bucket_sizes:
                sync = dp_sync(numel * itemsize if zero == 0 else sharded, mesh, self.data_axes, self.bounds, zero,
                               bucket_bytes=size)
                rate = sync.hides * backward  # seconds hidden per second of the step's work
                # the step is work + max(during - rate x work, floor) + after: least at the work where it
                # stops falling, if it falls
                at = max(work, (sync.during - sync.floor) / rate) if rate > 1 else work
                least = min(least, at + max(sync.during - rate * at, sync.floor) + sync.after)
        return least

    def whole_most(self, op_size: int, itemsize: int) -> float:
        """The most bytes per rank of parameters small enough to stay whole at optimizer levels 1-3 with the
        operators split ``op_size`` ways: those whose even split is under the threshold, each at most
        their whole size and under the threshold."""
        threshold = ZERO_THRESHOLD_BYTES / itemsize
        return itemsize * sum(min(n, threshold) for n in self.param_numels if n / op_size < threshold)

    def skew(self, compute_s: float, communicates: bool, dp: int) -> float:
        """Seconds a step waits for ranks that reach its collectives apart: the arrival skew's share of its
        compute, and the call skew of its gradient sync's group; none where it has no collective."""
        if not communicates:
            return 0.0
        return self.cluster.arrival_skew * compute_s + (self.cluster.call_skew_for(dp) if dp > 1 else 0.0)

    @property
    def bucket_sizes(self) -> tuple[int, ...]:
        """Gradient bucket sizes to cost, the default first (ties keep it): the fixed one, else every choice."""
        if self.fixed.bucket is not None:
            return (self.fixed.bucket_bytes,)
        return (BUCKET_BYTES, *(b for b in BUCKET_CHOICES if b != BUCKET_BYTES))

    def split(self, mesh, setting: tuple[str, str], best_s: float,
              floors: dict[str, dict[tuple, float]] | None = None) -> list[tuple[Candidate, Plan | None]]:
        """One split under one (recompute, offload) setting, costed at every optimizer-parallel level
        and precision that applies (no plan when a bound shows it cannot beat ``best_s``; nothing
        when the recompute mode can buy nothing here); ``floors``: per offload, per (level, precision), what the
        split did without recompute (:func:`_floor`), which a pipeline that recomputes cannot beat."""
        recompute, offload = setting
        if recompute != "none" and not self.worth(recompute):
            return []
        # a pipeline's chunks each run their fastest mode up to this one that fits: the plain program lays
        # them all out, so its bounds bound them
        modes = self.stage_modes(recompute) if stage_count(mesh) > 1 else (recompute,)
        program = modes[0]
        if stage_count(mesh) > max(len(self.blocks), 1):
            raise PolyshardError(f"{stage_count(mesh)} pipeline stages need as many stage units (by default the "
                                 f"repeated blocks, children of a ModuleList); the model has {len(self.blocks)}")
        op_axes = operator_axes(mesh, self.data_axes)
        rows = self.batch // data_size(mesh, self.data_axes)
        floor = self.floor(mesh, offload)
        split_ways = math.prod(n for _, n in op_axes)

        def pruned(bound: float, dp_s: float = floor) -> list[tuple[Candidate, None]]:
            return [(Candidate(mesh, rows, bound, 0.0, dp_s, MemoryEstimate(0, 0, 0, 0, 0), recompute=recompute,
                               offload=offload, pruned=True), None)]

        least = 0.0  # the most any bound below says the split's program costs
        # (the unsplit program bounds are not built for a model with pins, which only a split can hold)
        unsplit = best_s < float("inf") and not self.pinned
        if offload != "none" and unsplit:
            # offloaded state is stepped in fp32 (variants), so the model computes in fp32: its compute alone
            least = rows / stage_count(mesh) * self.fp32_floor(program) / split_ways
            if least + floor >= best_s:
                return pruned(least)
        if split_ways > 1 and unsplit:  # before a program of its own: the unsplit one's bound / ways
            bound = self.unsplit_bound(program, rows / stage_count(mesh), (best_s - floor) * split_ways) / split_ways
            if stage_count(mesh) > 1 and bound + floor < best_s:  # and at the schedule where a pipeline waits least
                bound = max(bound, self.pipelined_bound(program, mesh, rows, split_ways, best_s - floor))
            least = max(least, bound)
            if least + floor >= best_s:
                return pruned(least)
        if split_ways > 1 and best_s < float("inf"):  # nor before the bound a program on fewer of its ranks gives
            least = max(least, self.divisor_bound(op_axes, program, rows / stage_count(mesh), best_s - floor))
            if least + floor >= best_s:
                return pruned(least)
        if program != "none" and best_s < float("inf"):  # nor before the plain program's bound and the reruns
            least = max(least, self.recompute_bound(op_axes, program, rows / stage_count(mesh)))
            if least + floor >= best_s:
                return pruned(least)
        if stage_count(mesh) == 1 and least > 0:  # nor, without a pipeline, before what backward can hide at each level
            bound = self.whole_bound(mesh, offload, program, least)
            if bound >= best_s:
                return pruned(least, bound - least)
        solved = self.solved(op_axes, program, rows / stage_count(mesh), best_s - floor)
        if solved.plan is None:
            return pruned(solved.lower_bound_s)
        out = []
        dp = data_size(mesh, self.data_axes)
        for precision in self.own_plans:
            if precision is not None and not self.variants(dp, offload, precision):
                continue  # e.g. bf16 under offload, which steps fp32 state
            mine = solved if precision is None else \
                self.solved(op_axes, program, rows / stage_count(mesh), best_s - floor, precision)
            if mine.plan is None:
                out += [(dataclasses.replace(c, precision=precision), None) for c, _ in pruned(mine.lower_bound_s)]
            elif stage_count(mesh) > 1:
                plain = (floors or {}).get(offload) if program != modes[-1] else None  # recomputing: what it beats
                found = self._pipelined(mine, mesh, offload, rows, best_s, modes, precision, plain)
                sending = self.solved_sending(op_axes, program, rows / stage_count(mesh), mesh, precision)
                if sending.plan.nodes != mine.plan.nodes:
                    found = _faster_per_variant(found + self._pipelined(sending, mesh, offload, rows, best_s, modes,
                                                                        precision, plain))
                out += found
            else:
                out += self._whole_fitting(mine, mesh, setting, rows, best_s, floor, precision)
        return out

    def _whole_fitting(self, solved: IntraOpResult, mesh, setting: tuple[str, str], rows: int, best_s: float,
                       floor: float, precision: str | None) -> list[tuple[Candidate, Plan]]:
        """:meth:`_whole` of the solved strategies under (recompute, offload) ``setting``, and where the fastest
        variant does not fit, of the leanest strategies that do, if any (``floor``: the seconds no plan on
        ``mesh`` saves)."""
        recompute, offload = setting
        op_axes = solved.plan.op_axes
        out = self._whole(solved.plan, solved.gap, mesh, offload, rows, precision)
        if not out:  # the fixed settings allow no level or precision here (level 1 and more need dp > 1)
            return out
        fastest = min((c for c, _ in out), key=lambda c: c.step_s)
        if fastest.memory.total_bytes > self.limit and fastest.step_s < best_s and \
                self.numel / operator_size(mesh, self.data_axes) * device_bytes_per_param(offload) <= self.limit:
            cluster, dtype = self.priced(precision)
            try:
                lean = solve(self.gm, op_axes, cluster, rows, self.limit, cutoff_s=best_s - floor, recompute=recompute,
                             offload=offload, precision=dtype, recompute_comm=self.recompute_comm,
                             terms=self.terms(op_axes, recompute, offload, precision))
            except PolyshardError:
                return out
            if lean.plan is not None and lean.plan.nodes != solved.plan.nodes:
                leaner = self._whole(lean.plan, lean.gap, mesh, offload, rows, precision)
                out = [mine if mine[0].memory.total_bytes <= self.limit else other for mine, other in zip(out, leaner)]
        return out

    def priced(self, precision: str | None) -> tuple[Cluster, str]:
        """The cluster and precision the programs of ``precision`` are solved in (None: the bounding ones)."""
        return (self.bounds, self.narrowest) if precision is None else (self.cluster, precision)

    def stage_modes(self, recompute: str) -> tuple[str, ...]:
        """The modes a pipeline's chunks choose from under setting ``recompute``: those up to it that may buy
        memory, fastest first; the one given where the user fixed it (per chunk: each chunk keeps its own)."""
        if self.fixed.recompute is not None:
            return tuple(m for m in RECOMPUTE_MODES if m in self.fixed.recompute_modes)
        upto = RECOMPUTE_MODES[:RECOMPUTE_MODES.index(recompute) + 1]
        return tuple(m for m in upto if m == "none" or self.worth(m))

    def solved(self, op_axes, recompute: str, rows: float, cutoff_s: float,
               precision: str | None = None) -> IntraOpResult:
        """The fastest strategies on ``op_axes`` at ``rows`` rows in ``precision`` (None: priced as fast as every
        precision tried), memory aside (splits differ in what else they hold); pruned where the LP bound
        reaches ``cutoff_s``."""
        key = (op_axes, recompute, rows, precision)
        found = self._solved.get(key)
        if found is None or (found.plan is None and found.lower_bound_s < cutoff_s):
            cluster, dtype = self.priced(precision)
            found = self._solved[key] = solve(self.gm, op_axes, cluster, rows, float("inf"),
                                              cutoff_s=cutoff_s, recompute=recompute, precision=dtype,
                                              recompute_comm=self.recompute_comm,
                                              terms=self.terms(op_axes, recompute, "none", precision))
        return found

    def solved_sending(self, op_axes, recompute: str, rows: float, mesh,
                       precision: str | None = None) -> IntraOpResult:
        """The fastest strategies on ``op_axes`` with what crosses ``mesh``'s pipeline cuts priced as sent: the plain
        program leaves sends out, so it may keep whole a value every stage sends. A stage sends what crosses its
        two cuts, out in forward and back in backward, for each of its rows (rows x pp of the program's): over
        the model's cuts, 2 pp / (cuts) of what crosses each."""
        pp, link = stage_count(mesh), axis_link(mesh, PIPELINE_AXIS, self.cluster, ring=False)
        key = (op_axes, recompute, rows, pp, link.bandwidth_bytes_per_s, precision)
        if key not in self._sending:
            cluster, dtype = self.priced(precision)
            terms = self.terms(op_axes, recompute, "none", precision)
            program = (op_axes, recompute, precision)  # what crosses the cuts: the same at every depth and link
            if program not in self._crossing:
                self._crossing[program] = crossing_bytes(self.gm, terms, self.unit_of, DTYPES[dtype][1])
            per_row_s = self._crossing[program] * 2 * pp / (len(self.blocks) - 1) / link.bandwidth_bytes_per_s
            self._sending[key] = solve(self.gm, op_axes, cluster, rows, float("inf"), recompute=recompute,
                                       precision=dtype, recompute_comm=self.recompute_comm, terms=terms,
                                       extra_per_row_s=per_row_s)
        return self._sending[key]

    def unsplit_bound(self, recompute: str, rows: float, enough_s: float) -> float:
        """A lower bound of the unsplit program's cost at ``rows`` rows, solved only when the bounds at
        other row counts fall short of ``enough_s``: costs grow with rows, and no faster than in
        proportion (every term is a per-row part plus a fixed part, both non-negative), so the
        bound at r0 rows bounds ``rows`` by min(1, rows / r0) of it."""
        known = max((found.lower_bound_s * min(1.0, rows / r0)
                     for (axes, mode, r0, precision), found in self._solved.items()
                     if axes == () and mode == recompute and precision is None), default=0.0)
        return known if known >= enough_s else self.solved((), recompute, rows, float("inf")).lower_bound_s

    def pipelined_bound(self, recompute: str, mesh, rows: int, ways: int, enough_s: float = float("inf")) -> float:
        """A lower bound of a pipeline on ``mesh`` over ``rows`` rows per replica, its operators split ``ways`` ways,
        without a program of its own: the pipeline's equal-stage bound (:func:`best_pipeline`), (m + (p-1)/v) / p x
        the model's seconds per micro-batch, at the schedule allowed where it is least, those seconds bounded by the
        unsplit program's bound at a micro-batch's rows / ``ways``. 0 once it falls short of a finite ``enough_s``
        (the unsplit program is solved at another row count only where that may reach it)."""
        pp, least = stage_count(mesh), float("inf")
        options = schedule_options(max(len(self.blocks), 1), rows, pp, self.fixed)
        for m, _, v in sorted(options, key=lambda o: (-o[0], -o[2])):  # the likeliest least first
            scale = (m + (pp - 1) / v) / pp / ways
            least = min(least, scale * self.unsplit_bound(recompute, rows / m, enough_s / scale))
            if least < enough_s < float("inf"):
                return 0.0
        return 0.0 if least == float("inf") else least

    def divisor_bound(self, op_axes, recompute: str, rows: float, enough_s: float) -> float:
        """A lower bound of the program on one operator axis of k ranks at ``rows`` rows, without building it, from a
        built one on k0 of them (k0 dividing k, over the same link) that offers every strategy it does
        (:func:`covers`): each strategy costs at least k0 / k as much on k ranks, its work split at most k / k0 ways
        further and its collectives sending no less than k0 / k of the bytes in no fewer steps, so k0 / k of that
        program's LP bound bounds this one's. 0 where no such program is built, or this one is, or a smaller product
        may reach a larger share of peak on this cluster."""
        if len(op_axes) != 1 or not self.bounds.shares_grow_with_size or \
                any(key[:2] == (op_axes, recompute) for key in self._terms):
            return 0.0
        (axis, k), = op_axes
        nodes = self.cluster.devices_per_node
        bound = 0.0
        for axes, mode, offload, precision in list(self._terms):
            if mode != recompute or offload != "none" or precision is not None or len(axes) != 1:
                continue
            (name, k0), = axes
            if name != axis or k0 >= k or k % k0 or (nodes % k0 == 0) != (nodes % k == 0):
                continue
            if (axes, op_axes) not in self._covers:  # each split on op_axes asks again
                self._covers[(axes, op_axes)] = covers(enumerated(self.gm, axes, self.sequence),
                                                       enumerated(self.gm, op_axes, self.sequence))
            if self._covers[(axes, op_axes)]:
                bound = max(bound, self.solved(axes, recompute, rows, enough_s * k / k0).lower_bound_s * k0 / k)
        return bound

    def recompute_bound(self, op_axes, recompute: str, rows: float) -> float:
        """A lower bound of ``recompute``'s program on ``op_axes`` at ``rows`` rows without solving it: the plain
        program's bound, where solved already (else 0), plus the forwards the mode runs again at the least."""
        plain = self._solved.get((op_axes, "none", rows, None))
        if plain is None:
            return 0.0
        key = (op_axes, recompute)
        if key not in self._floors:
            rerun = self.recomputed(recompute, self.recompute_comm).rerun
            self._floors[key] = forward_floor(self.gm, op_axes, self.bounds, self.narrowest,
                                              rerun.__contains__, self.sequence)
        return plain.lower_bound_s + rows * self._floors[key]

    def fp32_floor(self, recompute: str) -> float:
        """Seconds per row the unsplit model computes in fp32 under ``recompute`` at the least."""
        key = ("fp32", recompute)
        if key not in self._floors:
            rc = self.recomputed(recompute, self.recompute_comm)
            self._floors[key] = forward_floor(self.gm, (), self.cluster, "fp32", lambda name: passes(name, rc)[0],
                                              self.sequence)
        return self._floors[key]

    def terms(self, op_axes, recompute: str, offload: str, precision: str | None = None) -> Terms:
        """The integer program on ``op_axes`` in ``precision`` (None: the bounding one) with rows left open:
        enumerated once, solved per row count."""
        key = (op_axes, recompute, offload, precision)
        if key not in self._terms:
            if self.dataset_strategy is not None:  # the inputs as they lie on these axes
                self.gm.meta[INPUT_LAYOUTS] = input_layouts(self.gm, self.dataset_strategy, op_axes, absent_whole=True)
            cluster, dtype = self.priced(precision)
            self._terms[key] = program_terms(self.gm, op_axes, cluster,
                                             self.recomputed(recompute, self.recompute_comm), offload,
                                             dtype, self.sequence, self.all_reduce_only)
        return self._terms[key]

    def units(self, plan: Plan, mesh, precision: str, recompute: str | None = None, split_rows: int = 0) -> Units:
        """``plan``'s costs and memory per unit in ``precision``, its collectives on ``mesh``'s links, under
        ``recompute`` (default: the plan's mode); ``split_rows``: the op ranks ``plan`` splits rows over."""
        links = tuple(axis_link(mesh, n, self.cluster) for n, _ in plan.op_axes)
        recompute = recompute or plan.recompute
        key = (id(plan), links, precision, recompute, split_rows)
        if key not in self._units:
            dtype, itemsize = DTYPES[precision]
            laid = dataclasses.replace(plan, mesh=mesh, precision=precision, recompute=recompute)
            rc = self.recomputed(recompute, plan.recompute_comm)
            units = unit_costs(self.gm, laid, op_costs(self.gm, laid, self.cluster, dtype, itemsize, rc), rc,
                               self.unit_of, tuple(self.blocks) or ("",), itemsize)
            # the plan kept alive, so its id stays its own
            self._units[key] = plan, dataclasses.replace(units, split_rows=split_rows)
        return self._units[key][1]

    def rows_plan(self, base: Plan) -> Plan | None:
        """``base``'s model laid out with its operator ranks splitting the batch rows (shared weights as ``base``
        has them), captured at rows that divide over the ranks; None where that capture is another graph."""
        ways = math.prod(n for _, n in base.op_axes)
        rows = next((r for r in self._wider if r % ways == 0), None)  # one capture serves every divisor of its rows
        if rows is None:
            rows = math.lcm(ways, self.rows_splits)
            wider = self.capture_rows(rows)
            self._wider[rows] = wider, batch_values(self.gm, wider), shared_parameters(wider)
        wider, batch, names = self._wider[rows]
        if batch is None:
            return None
        shared = {name: base.params[name] for name in names}
        key = (base.op_axes, tuple(shared.items()))
        if key not in self._rows:
            self._rows[key] = rows_layouts(wider, batch, base.op_axes, shared)
        return self._rows[key]

    def rows_units(self, base: Plan, mesh, rows: int, precision: str, modes: tuple[str, ...]) -> tuple[Units, ...]:
        """The units of chunks whose operator ranks split the rows instead of ``base``'s operators, under each of
        ``modes``: none where no micro-batch of the ``rows`` per replica divides over the ranks, the user fixed
        every chunk to split operators or pinned products to split, or the ranks split images."""
        ways = math.prod(n for _, n in base.op_axes)
        fixed = self.fixed.stage_tp_split
        if ways == 1 or self.capture_rows is None or rows % ways or (fixed and "rows" not in fixed) or \
                self.pinned or spatial_sizes(mesh):
            return ()
        plan = self.rows_plan(base)
        if plan is None:
            return ()
        return tuple(self.units(plan, mesh, precision, mode, split_rows=ways) for mode in modes)

    def _whole(self, base: Plan, gap: float, mesh, offload: str, rows: int,
               only: str | None = None) -> list[tuple[Candidate, Plan]]:
        """A split that holds the whole model: its plan at every (optimizer-parallel level, precision) (of
        precision ``only``, where given), each with the fewest gradient-accumulation micro-batches that fit."""
        dp = data_size(mesh, self.data_axes)
        out = []
        for zero, precision in self.variants(dp, offload, only):
            units = self.units(base, mesh, precision)
            plan = dataclasses.replace(base, zero=zero, precision=precision, offload=offload, mesh=mesh,
                                       data_axes=self.data_axes)
            numel = sum(map(sum, units.model_groups))
            tries = [m for m in range(1, rows + 1) if rows % m == 0 and self.fixed.allows(m=m, mbs=rows // m)]
            found, refused = None, float("inf")
            for m in tries[:ACCUMULATION_TRIES]:
                found = self._accumulated(plan, units, mesh, rows, m, numel, gap)
                if found[0].memory.total_bytes <= self.limit:
                    break
                refused = min(refused, found[0].step_s)
            if found is not None:
                out.append((dataclasses.replace(found[0], refused_s=refused), found[1]))
        return out

    def _accumulated(self, plan: Plan, units: Units, mesh, rows: int, m: int, numel: float,
                     gap: float) -> tuple[Candidate, Plan]:
        """``plan`` on ``rows`` rows run as ``m`` micro-batches, gradients synced in the last one's backward
        in buckets of the size that syncs and steps them fastest and fits (at level 0 a bucket is also a buffer)."""
        dp = data_size(mesh, self.data_axes)
        work = float(rows * units.compute_s.sum() + m * units.overhead_s.sum())
        op_comm = float(rows * units.comm_s.sum() + m * units.latency_s.sum())

        def synced(size: int) -> tuple[float, float]:  # compute with the optimizer step, exposed gradient sync
            tensors = stepped_tensors(units.model_groups, plan.zero, plan.precision, plan.offload, size)
            compute = work + _update_seconds(numel, plan.offload, plan.zero, dp, plan.precision, self.cluster, tensors)
            backward = (1 - units.forward_share) * (compute + op_comm) / m
            return compute, self.dp_sync(numel * DTYPES[plan.precision][1], mesh, plan.zero, m, size,
                                         self.level3(units.model_groups, plan.precision, plan)).exposed(backward)

        timed = {b: synced(b) for b in self.bucket_sizes}
        tried = []  # fastest first (a sort keeps the default first among ties), until one fits
        for size in sorted(timed, key=lambda b: sum(timed[b])):
            sized = dataclasses.replace(plan, micro_batches=m, bucket_bytes=size,
                                        first_bucket_bytes=first_bucket_bytes(self.cluster, size))
            memory = _memory_floor(units, plan.zero, dp, plan.precision, plan.offload, rows // m, m > 1, size)
            exact = memory.total_bytes <= self.limit  # estimated in full only where it may fit
            if exact:
                memory = estimate_memory(self.gm, sized, data_world=dp, rows=rows // m,
                                         rc=self.recomputed(plan.recompute, plan.recompute_comm))
            tried.append((sized, memory, exact))
            if memory.total_bytes <= self.limit or plan.zero:  # above level 0 the size holds no memory
                break
        plan, memory, exact = tried[-1] if tried[-1][1].total_bytes <= self.limit else tried[0]
        compute, dp_comm = timed[plan.bucket_bytes]
        return Candidate(mesh, rows, compute, op_comm, dp_comm, memory, gap, recompute=plan.recompute,
                         offload=plan.offload, zero=plan.zero, precision=plan.precision, memory_floor=not exact,
                         accumulation=m, sequence=plan.sequence_parallel, bucket_bytes=plan.bucket_bytes,
                         skew_s=self.skew(compute, op_comm > 0 or dp > 1, dp)), plan

    def dp_sync(self, grad_bytes: float, mesh, zero: int, micro_batches: int, bucket_bytes: int,
                level3: dict) -> DataSync:
        """:func:`dp_sync` on ``mesh``, hiding nothing where the user turned overlap off."""
        sync = dp_sync(grad_bytes, mesh, self.data_axes, self.cluster, zero, micro_batches=micro_batches,
                       bucket_bytes=bucket_bytes, **level3)
        return sync if self.hides else dataclasses.replace(sync, hides=0.0)

    def level3(self, groups, precision: str, plan: Plan) -> dict:
        """:func:`_level3` once per parameter groups: a pipeline's costing asks again at every bucket size and
        micro-batch count."""
        key = (id(groups), precision, plan.zero_threshold_bytes)
        found = self._level3.get(key)
        if found is None or found[0] is not groups:
            found = self._level3[key] = groups, _level3(groups, precision, plan)
        return found[1]

    def _pipelined(self, solved: IntraOpResult, mesh, offload: str, rows: int, best_s: float,
                   modes: tuple[str, ...], only: str | None = None,
                   floors: dict[tuple, float] | None = None) -> list[tuple[Candidate, Plan | None]]:
        """A pipelined split: at every (optimizer-parallel level, precision) (of precision ``only``, where given),
        its best cuts, micro-batch count, schedule and recompute mode per chunk (of ``modes``), or a bound where
        none can beat ``best_s`` (``floors``, per (level, precision): one known before any is costed). A pipeline
        no chunk of which runs the last mode is left to the setting before."""
        dp, pp, base = data_size(mesh, self.data_axes), stage_count(mesh), solved.plan
        link = axis_link(mesh, PIPELINE_AXIS, self.cluster, ring=False)
        out = []

        def pruned(bound: float, zero: int, precision: str) -> None:
            out.append((Candidate(mesh, rows, bound, 0.0, 0.0, MemoryEstimate(0, 0, 0, 0, 0), recompute=modes[-1],
                                  offload=offload, zero=zero, precision=precision, pruned=True), None))

        for zero, precision in self.variants(dp, offload, only):
            floor_s = (floors or {}).get((zero, precision), 0.0)
            if floor_s >= best_s:
                pruned(floor_s, zero, precision)
                continue
            units = tuple(self.units(base, mesh, precision, mode) for mode in modes) + \
                self.rows_units(base, mesh, rows, precision, modes)
            setup = Setup(pp, dp, rows, zero, precision, offload, self.limit,
                          send=lambda b: b / link.bandwidth_bytes_per_s + link.latency_s,
                          dp_sync=lambda b, groups, m, size, zero=zero, precision=precision: self.dp_sync(
                              b, mesh, zero, m, size, self.level3(groups, precision, base)),
                          update_seconds=lambda numel, tensors=0, zero=zero, precision=precision: _update_seconds(
                              numel, offload, zero, dp, precision, self.cluster, tensors),
                          fixed=self.fixed, memo=self._memo, bucket_sizes=self.bucket_sizes)
            found, bound, refused = best_pipeline(units, setup, best_s)
            if found is None and refused == float("inf"):
                if bound < float("inf"):
                    pruned(bound, zero, precision)
                continue
            # nothing fits: by how much the leanest misses, and what memory refused (so what saves it is tried)
            p = found or leanest_pipeline(units, setup)
            if p is None:  # the fixed settings allow no schedule on this split
                continue
            p = dataclasses.replace(p, refused_s=min(p.refused_s, refused))
            if modes[-1] not in p.recompute:  # the setting before ran these modes, no slower
                continue
            most = most_recompute(p.recompute)
            per_chunk = p.recompute if len(set(p.recompute)) > 1 else ()
            plan = dataclasses.replace(base, zero=zero, precision=precision, offload=offload, mesh=mesh,
                                       data_axes=self.data_axes, recompute=most, stage_recompute=per_chunk,
                                       stage_boundaries=p.boundaries, schedule=p.schedule,
                                       micro_batches=p.micro_batches, virtual_stages=p.virtual_stages,
                                       bucket_bytes=p.bucket_bytes)
            split = p.tp_split if "rows" in p.tp_split else ()
            if split:
                plan = with_rows_chunks(plan, self.rows_plan(base), self.gm, split)
            out.append((Candidate(mesh, rows, p.compute_s, p.op_comm_s, p.dp_comm_s, p.memory, solved.gap,
                                  recompute=most, stage_recompute=per_chunk, stage_tp_split=split, offload=offload,
                                  zero=zero,
                                  precision=precision, pipeline=p, sequence=plan.sequence_parallel,
                                  refused_s=p.refused_s, bucket_bytes=p.bucket_bytes,
                                  skew_s=self.skew(p.compute_s, True, dp)), plan))
            if found is not None:
                best_s = min(best_s, out[-1][0].step_s)
        return out


def _faster_per_variant(found: list[tuple[Candidate, Plan | None]]) -> list[tuple[Candidate, Plan | None]]:
    """Of candidates for one split, the fastest per (optimizer-parallel level, precision): one costed before one
    only bounded, and of two bounds the lesser; with the least step either was refused by memory."""
    best: dict[tuple, tuple[Candidate, Plan | None]] = {}
    for c, plan in found:
        key = (c.zero, c.precision)
        if key in best:
            known, known_plan = best[key]
            refused = min(c.refused_s, known.refused_s)  # what memory refused either may still be reached
            if (known.pruned, known.step_s) <= (c.pruned, c.step_s):
                c, plan = known, known_plan
            c = dataclasses.replace(c, refused_s=refused)
        best[key] = c, plan
    return list(best.values())


def _floor(c: Candidate, limit: float) -> float:
    """What a split's setting without recompute tells of the same split recomputing, at ``c``'s level and
    precision: no faster than its bound where pruned, else than its step where it fits or what memory refused
    (recompute only adds time to the same cuts and micro-batches)."""
    if c.pruned:
        return c.step_s
    return min(c.refused_s, c.step_s if c.memory.total_bytes <= limit else float("inf"))


def _nothing_to_free(found: list[tuple[Candidate, Plan | None]], variants: int, best_s: float, limit: float) -> bool:
    """Whether freeing memory cannot make one split beat ``best_s``: each of its ``variants`` was costed,
    and was pruned by its bound, or memory refused it nothing (itself included) faster than the best."""
    return len(found) == variants and all(
        c.pruned or min(c.refused_s, c.step_s if c.memory.total_bytes > limit else float("inf")) >= best_s
        for c, _ in found)


def _memory_floor(units: Units, zero: int, dp: int, precision: str, offload: str, rows: int,
                  accumulating: bool = False, bucket_bytes: int = BUCKET_BYTES) -> MemoryEstimate:
    """Less than or equal to what estimate_memory finds: its parameter state, and of activations
    and gradients at least the larger (all kept activations are alive as backward starts)."""
    state = state_memory(units.model_groups, zero, dp, precision, offload, accumulating, bucket_bytes=bucket_bytes)
    activations = units.activation_bytes.sum() * rows
    return dataclasses.replace(state, activations_bytes=activations,
                               apart_bytes=min(activations, state.grads_bytes))


def _level3(groups, precision: str, plan: Plan) -> dict:
    """:func:`dp_seconds`'s modules gathered and bytes left whole at optimizer level 3."""
    whole, gathered = level3_traffic(groups, DTYPES[precision][1], plan.zero_threshold_bytes)
    return {"modules": gathered, "whole_bytes": whole}


def _update_seconds(numel: float, offload: str, zero: int, dp: int, precision: str, cluster: Cluster,
                    tensors: int = 0) -> float:
    """Seconds of the optimizer step on ``numel`` local parameters in ``tensors`` tensors (this rank's shard
    from level 1 on), or under offload the copies to and from where it keeps the state and the host's step."""
    if offload != "none":
        return offload_seconds(numel, offload, cluster, tensors=tensors)
    return optimizer_seconds(numel / (dp if zero else 1), precision, cluster, tensors)


def _keeps(fixed: Fixed, mesh, data_axes) -> bool:
    """Whether the mesh's sizes agree with the dp / tp / pp / h / w that ``fixed`` keeps, has a pipeline where
    ``fixed`` sets how one runs, and tp ranks where a chunk's must split rows."""
    spatial = spatial_sizes(mesh)
    if fixed.pipeline_keys and stage_count(mesh) == 1 or \
            "rows" in fixed.stage_tp_split and operator_size(mesh, data_axes) == 1:
        return False
    return fixed.allows(dp=data_size(mesh, data_axes), tp=operator_size(mesh, data_axes) // math.prod(spatial.values()),
                        pp=stage_count(mesh), h=spatial.get("h", 1), w=spatial.get("w", 1))
