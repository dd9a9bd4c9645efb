"""Full search: every dp x tp split of the devices, each whole-model choice (recompute mode), and
within each the cheapest strategy per op.

Within a split an integer program picks every op's strategy (polyshard.planner.intra_op) under
the memory limit, with the memory and time model of the whole-model choices; the combination
with the lowest predicted step time wins. Recompute is tried only where memory is tight. Costs use one capture of
the model at one row, scaled by the rows each split gives a device (compute, activations and
their communication grow with rows; parameters do not).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from polyshard.cluster import Cluster, format_bytes
from polyshard.errors import PolyshardError
from polyshard.graph.capture import capture
from polyshard.graph.regions import recomputed
from polyshard.planner.cost.comm import axis_link
from polyshard.planner.cost.memory import MemoryEstimate, estimate_memory
from polyshard.planner.cost.memory import local_numel as local_numel_of
from polyshard.planner.cost.offload import offload_seconds
from polyshard.planner.cost.overlap import op_costs
from polyshard.planner.intra_op import solve
from polyshard.planner.plan import OFFLOADS, RECOMPUTE_MODES, ZERO_LEVELS, Plan
from polyshard.planner.propagate import propagate
from polyshard.transitions import wire_bytes

# A split whose plan fills at most this share of the memory limit is not tried with recompute or offload.
_ROOMY = 0.9
# Whole-model (recompute, offload) settings, in the order tried: the first costs no time.
SETTINGS = tuple(itertools.product(RECOMPUTE_MODES, OFFLOADS))


@dataclass(frozen=True)
class Candidate:
    """One mesh split: predicted step time (compute, op-parallel communication, data-parallel
    gradient all-reduce) and per-device memory, at ``rows`` rows per device."""

    mesh: tuple[tuple[str, int], ...]
    rows: int
    compute_s: float
    op_comm_s: float
    dp_comm_s: float
    memory: MemoryEstimate
    gap: float = 0.0  # the intra-op program's distance from its LP lower bound
    recompute: str = "none"  # activations recomputed in backward (see Plan)
    offload: str = "none"  # where the optimizer state lives, if not on the device (see Plan)
    zero: int = 0  # optimizer parallel level over the data axes (see Plan)
    precision: str = "fp32"
    pruned: bool = False  # not solved: its LP bound already lost (figures are lower bounds)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.op_comm_s + self.dp_comm_s

    @property
    def key(self) -> tuple:
        return self.mesh, self.recompute, self.offload, self.zero, self.precision

    def describe(self) -> str:
        extras = [f"recompute {self.recompute}"] * (self.recompute != "none") + \
            [f"offload {self.offload}"] * (self.offload != "none") + [f"zero {self.zero}"] * (self.zero > 0) + \
            [self.precision] * (self.precision != "fp32")
        return ", ".join([_mesh_text(self.mesh), *extras])


def mesh_candidates(num_devices: int) -> list[tuple[tuple[str, int], ...]]:
    """Every (dp, tp) factorisation, tp innermost so it lands on the fastest links."""
    return [(("dp", num_devices // tp), ("tp", tp)) for tp in range(1, num_devices + 1) if num_devices % tp == 0]


def search(model: nn.Module, example_row: Sequence[torch.Tensor], cluster: Cluster, global_batch: int,
           memory_limit_bytes: float | None = None, meshes=None,
           data_axes: tuple[str, ...] = ("dp",)) -> tuple[Plan, list[Candidate]]:
    """The best plan over ``meshes`` (default: every dp x tp split) and every candidate's costs.

    ``example_row``: inputs for one row (batch dim 1); ``global_batch``: rows per step in all;
    ``data_axes``: the mesh axes that split the batch (the others split operators).
    """
    limit = memory_limit_bytes or cluster.memory_bytes
    gm = capture(model, example_row)
    candidates, plans, skipped = [], {}, []
    best_s = float("inf")
    # splits whose operator axes fill one node first: they are likely best, and bound the rest
    order = sorted(meshes or mesh_candidates(cluster.num_devices),
                   key=lambda m: abs(math.log(_op_size(m, data_axes) / cluster.devices_per_node)))
    for mesh in order:
        dp = math.prod(s for n, s in mesh if n in data_axes)
        if global_batch % dp:
            continue
        for setting in SETTINGS:
            try:
                found = _cost_split(gm, mesh, data_axes, setting, cluster, global_batch // dp, limit, best_s)
            except PolyshardError as exc:  # a pin that this split cannot hold
                skipped.append(f"{_mesh_text(mesh)}: {exc}")
                break
            for candidate, plan in found:
                candidates.append(candidate)
                if plan is not None:
                    plans[candidate.key] = plan
                    if candidate.memory.total_bytes <= limit:
                        best_s = min(best_s, candidate.step_s)
            # recompute and offload only buy memory, at the price of time: tried only where memory is tight
            if found and min(c.memory.total_bytes if not c.pruned else 0 for c, _ in found) <= _ROOMY * limit:
                break
    if not candidates:
        why = "; ".join(skipped) or f"none divides the batch of {global_batch}"
        raise PolyshardError(f"no split of {cluster.num_devices} devices works: {why}")
    fitting = [c for c in candidates if c.memory.total_bytes <= limit and not c.pruned]
    if not fitting:
        least = min((c for c in candidates if not c.pruned), key=lambda c: c.memory.total_bytes)
        raise PolyshardError(
            f"the model does not fit: the leanest split ({least.describe()}) needs "
            f"{format_bytes(least.memory.total_bytes)} per device, {format_bytes(least.memory.total_bytes - limit)} "
            f"over the {format_bytes(limit)} limit; add devices, shrink the batch, or raise --memory-limit"
        )
    best = min(fitting, key=lambda c: c.step_s)
    ranked = sorted(candidates, key=lambda c: c.step_s)
    plan = plans[best.key]
    plan.global_batch, plan.report = global_batch, search_report(ranked, best, limit)
    return plan, ranked


def _cost_split(gm, mesh, data_axes, setting: tuple[str, str], cluster: Cluster, rows: int, limit: float,
                best_s: float) -> list[tuple[Candidate, Plan | None]]:
    """One mesh split under one (recompute, offload) setting: the integer program's plan, costed at
    every optimizer-parallel level and precision that applies (no plan when the LP bound shows it
    cannot beat ``best_s``; nothing when the recompute mode frees nothing here)."""
    recompute, offload = setting
    if recompute != "none" and not recomputed(gm, recompute).rerun:
        return []
    op_axes = tuple((n, s) for n, s in mesh if n not in data_axes and s > 1)
    op_size = _op_size(mesh, data_axes)
    param_numel = sum(p.numel() for p in gm.parameters())
    # floors, as if every weight were split over the operator axes
    floor = _dp_seconds(4 * param_numel / op_size, mesh, data_axes, cluster) + \
        offload_seconds(param_numel / op_size, offload, cluster)
    try:
        solved = solve(gm, op_axes, cluster, rows, limit, cutoff_s=best_s - floor, recompute=recompute,
                       offload=offload)
    except PolyshardError:
        solved = None  # nothing fits on this split; costed below with propagation's plan
    if solved is not None and solved.plan is None:
        return [(Candidate(mesh, rows, solved.lower_bound_s, 0.0, floor, MemoryEstimate(0, 0, 0, 0, 0),
                           recompute=recompute, offload=offload, pruned=True), None)]
    if solved is not None:
        base = solved.plan
    else:
        base = propagate(gm, op_axes, lambda msg: None)
        base.recompute, base.offload = recompute, offload
    base.mesh, base.data_axes = mesh, data_axes
    dp = math.prod(s for n, s in mesh if n in data_axes)
    out = []
    for zero, precision in _variants(dp, offload, cluster):
        plan = dataclasses.replace(base, zero=zero, precision=precision)
        dtype, itemsize = ("float32", 4) if precision == "fp32" else ("bfloat16", 2)
        costs = op_costs(gm, plan, cluster, dtype, itemsize)
        numel = sum(local_numel_of(p.shape, plan.params[n]) for n, p in gm.named_parameters() if n in plan.params)
        compute = sum(rows * c.compute_s + c.overhead_s for c in costs) + offload_seconds(numel, offload, cluster)
        op_comm = sum(rows * c.comm_s + c.latency_s for c in costs)
        memory = estimate_memory(gm, plan, data_world=dp, rows=rows)
        modules = sum(1 for n in gm.graph.nodes if n.op == "call_module")
        dp_comm = _dp_seconds(numel * itemsize, mesh, data_axes, cluster, zero, modules)
        out.append((Candidate(mesh, rows, compute, op_comm, dp_comm, memory, solved.gap if solved else 0.0,
                              recompute=recompute, offload=offload, zero=zero, precision=precision), plan))
    return out


def _variants(dp: int, offload: str, cluster: Cluster) -> list[tuple[int, str]]:
    """(optimizer-parallel level, precision) pairs to cost: levels only with data parallel, half
    precision only where the device runs it faster; offloaded state stays whole and fp32."""
    levels = ZERO_LEVELS if dp > 1 and offload == "none" else (0,)
    fast_half = cluster.flops_per_s.get("bfloat16", 0.0) > cluster.flops_per_s["float32"] and offload == "none"
    return [(z, p) for z in levels for p in ("fp32", "bf16")[:1 + fast_half]]


def _op_size(mesh, data_axes) -> int:
    return math.prod(s for n, s in mesh if n not in data_axes)


def _mesh_text(mesh) -> str:
    return " x ".join(f"{n}={s}" for n, s in mesh)


def _dp_seconds(grad_bytes: float, mesh, data_axes, cluster: Cluster, zero: int = 0, modules: int = 0) -> float:
    """Data-parallel communication per step (alpha-beta on the outermost data axis's link): the
    gradient all-reduce (level 0), plus the parameters' all-gather after the step (level 1);
    reduce-scatter and all-gather, the same bytes (level 2); and at level 3 the parameters gathered
    in forward and again in backward, one collective per module each time."""
    dp = math.prod(s for n, s in mesh if n in data_axes)
    if dp == 1:
        return 0.0
    link = axis_link(mesh, next(n for n, s in mesh if n in data_axes), cluster)
    gather = wire_bytes("all_gather", grad_bytes, dp) / link.bandwidth_bytes_per_s
    reduce = wire_bytes("all_reduce", grad_bytes, dp) / link.bandwidth_bytes_per_s + link.latency_s
    return reduce + (gather + link.latency_s if zero == 1 else 2 * gather + 2 * modules * link.latency_s if zero == 3
                     else 0.0)


def search_report(candidates: list[Candidate], chosen: Candidate, limit_bytes: float) -> dict:
    """JSON-able figures of every candidate split and the choice."""
    def row(c: Candidate) -> dict:
        m = c.memory
        return {"mesh": c.describe(), "split": _mesh_text(c.mesh), "recompute": c.recompute, "offload": c.offload,
                "zero": c.zero, "precision": c.precision,
                "rows": c.rows, "step_s": c.step_s, "compute_s": c.compute_s,
                "op_comm_s": c.op_comm_s, "dp_comm_s": c.dp_comm_s, "gap": c.gap,
                "memory": {"params": m.params_bytes, "grads": m.grads_bytes, "optimizer": m.optimizer_bytes,
                           "activations": m.activations_bytes, "buffers": m.buffers_bytes, "apart": m.apart_bytes,
                           "total": m.total_bytes},
                "fits": m.total_bytes <= limit_bytes and not c.pruned, "pruned": c.pruned}
    return {"chosen": chosen.describe(), "limit_bytes": limit_bytes, "candidates": [row(c) for c in candidates]}

