"""Mesh search: every dp x tp split of the devices, costed, under a per-device memory limit.

Operator strategies within a split come from sharding propagation (the op rules); the split
with the lowest predicted step time that fits wins. Costs use one capture of the model at one
row per data shard, scaled by the rows each split gives a device (compute, activations and
their communication grow with rows; parameters do not).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from polyshard.cluster import Cluster, format_bytes
from polyshard.errors import PolyshardError
from polyshard.graph.capture import capture
from polyshard.planner.cost.comm import axis_link
from polyshard.planner.cost.memory import MemoryEstimate, estimate_memory
from polyshard.planner.cost.overlap import OP_OVERHEAD_S, op_costs
from polyshard.planner.plan import Plan
from polyshard.planner.propagate import propagate
from polyshard.transitions import wire_bytes


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

    @property
    def step_s(self) -> float:
        return self.compute_s + self.op_comm_s + self.dp_comm_s

    def describe(self) -> str:
        return " x ".join(f"{n}={s}" for n, s in self.mesh)


def mesh_candidates(num_devices: int) -> list[tuple[tuple[str, int], ...]]:
    """Every (dp, tp) factorisation, tp innermost so it lands on the fastest links."""
    return [(("dp", num_devices // tp), ("tp", tp)) for tp in range(1, num_devices + 1) if num_devices % tp == 0]


def search(model: nn.Module, example_row: Sequence[torch.Tensor], cluster: Cluster, global_batch: int,
           memory_limit_bytes: float | None = None, meshes=None) -> tuple[Plan, list[Candidate]]:
    """The best plan over ``meshes`` (default: every dp x tp split) and every candidate's costs.

    ``example_row``: inputs for one row (batch dim 1); ``global_batch``: rows per step in all.
    """
    limit = memory_limit_bytes or cluster.memory_bytes
    gm = capture(model, example_row)
    candidates, plans = [], {}
    for mesh in meshes or mesh_candidates(cluster.num_devices):
        sizes = dict(mesh)
        dp, tp = sizes.get("dp", 1), sizes.get("tp", 1)
        if global_batch % dp:
            continue
        rows = global_batch // dp
        op_axes = (("tp", tp),) if tp > 1 else ()
        plan = propagate(gm, op_axes, lambda msg: None)
        plan.mesh, plan.data_axes = mesh, ("dp",)
        costs = op_costs(gm, plan, cluster)
        overhead = OP_OVERHEAD_S[cluster.device_type] * len(costs)
        compute = rows * sum(c.compute_s for c in costs) + overhead
        op_comm = sum(rows * c.comm_s + c.latency_s for c in costs)
        one_row = estimate_memory(gm, plan, data_parallel=dp > 1)
        memory = MemoryEstimate(one_row.params_bytes, one_row.grads_bytes, one_row.optimizer_bytes,
                                one_row.activations_bytes * rows, one_row.buffers_bytes)
        link = axis_link(mesh, "dp", cluster)
        dp_comm = 0.0
        if dp > 1:
            sent = wire_bytes("all_reduce", memory.grads_bytes, dp)
            dp_comm = sent / link.bandwidth_bytes_per_s + link.latency_s
        candidates.append(Candidate(mesh, rows, compute, op_comm, dp_comm, memory))
        plans[mesh] = plan
    if not candidates:
        raise PolyshardError(f"no dp x tp split of {cluster.num_devices} devices divides the batch of {global_batch}")
    fitting = [c for c in candidates if c.memory.total_bytes <= limit]
    if not fitting:
        least = min(candidates, key=lambda c: c.memory.total_bytes)
        raise PolyshardError(
            f"the model does not fit: the leanest split ({least.describe()}) needs "
            f"{format_bytes(least.memory.total_bytes)} per device, {format_bytes(least.memory.total_bytes - limit)} "
            f"over the {format_bytes(limit)} limit; add devices, shrink the batch, or raise --memory-limit"
        )
    best = min(fitting, key=lambda c: c.step_s)
    ranked = sorted(candidates, key=lambda c: c.step_s)
    plan = plans[best.mesh]
    plan.global_batch, plan.report = global_batch, search_report(ranked, best, limit)
    return plan, ranked


def search_report(candidates: list[Candidate], chosen: Candidate, limit_bytes: float) -> dict:
    """JSON-able figures of every candidate split and the choice."""
    def row(c: Candidate) -> dict:
        m = c.memory
        return {"mesh": c.describe(), "rows": c.rows, "step_s": c.step_s, "compute_s": c.compute_s,
                "op_comm_s": c.op_comm_s, "dp_comm_s": c.dp_comm_s,
                "memory": {"params": m.params_bytes, "grads": m.grads_bytes, "optimizer": m.optimizer_bytes,
                           "activations": m.activations_bytes, "buffers": m.buffers_bytes, "total": m.total_bytes},
                "fits": m.total_bytes <= limit_bytes}
    return {"chosen": chosen.describe(), "limit_bytes": limit_bytes, "candidates": [row(c) for c in candidates]}

