"""Multi-copy overlap: predicted step time for k interleaved copies, and the best k.

Each op of each copy is a compute task (its share of the FLOPs, plus its fixed cost of dispatch
and launch, which every copy pays again) followed, if it communicates, by a communication task (its share of the bytes,
plus the link latency per collective). Tasks run in the interleaved order (op-major, copy-minor)
on one compute stream and one communication stream, and a copy's next op waits for its own
previous communication: list scheduling of that order gives the step time, so the other
copies' compute hides each collective as far as there is compute to hide it behind, compute running
Cluster.overlap_slowdown longer while a collective runs beside it.

On CPU, gloo's collectives run on the same cores as the compute (there is no separate copy
engine), so there the two streams are one and nothing hides: more copies only add per-op cost.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import fx

from polyshard.buckets import FIRST_BUCKET_BYTES
from polyshard.cluster import Cluster
from polyshard.planner.cost.comm import (collectives_seconds, lost_beside, node_backward_bytes, node_comm_bytes,
                                         weight_sum_seconds)
from polyshard.graph.params import modules_of
from polyshard.graph.regions import Recomputed, recomputed
from polyshard.planner.cost.compute import RETURNED_PASSES, forward_seconds, op_overhead, passes, recompute_overhead
from polyshard.planner.cost.repeat import costed_as
from polyshard.plan import Plan

@dataclass(frozen=True)
class OpCost:
    """One op for the whole batch: compute_s (at the rates of polyshard.planner.cost.compute), comm_s (bytes over
    bandwidth); latency_s (the links' latency for its collectives, and the sum of whole weights' gradients over
    the axes splitting their input) and overhead_s (dispatch and launch) are fixed costs that every copy pays
    again."""

    compute_s: float
    comm_s: float
    latency_s: float
    overhead_s: float = 0.0


def op_costs(gm: fx.GraphModule, plan: Plan, cluster: Cluster, dtype: str = "float32", itemsize: int = 4,
             rc: Recomputed | None = None) -> list[OpCost]:
    """Training cost of every op in program order (forward, backward and recompute folded together); a
    layer's node that runs as its twin in an earlier layer does costs what the twin did; the last op also pays
    for moving what the model returns to the layout it is returned in. ``rc``: the plan's recompute, where the
    caller has it."""
    modules = modules_of(gm)
    rc = rc or recomputed(gm, plan.recompute, plan.recompute_comm)
    same = costed_as(gm, plan)
    by_name: dict[str, OpCost] = {}
    out = []
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr") or node.name not in plan.nodes:
            continue
        twin = same.get(node.name)
        if twin is not None and rc.alike(node.name, twin):
            out.append(by_name.setdefault(node.name, by_name[twin]))
            continue
        compute_passes, comm_passes = passes(node.name, rc)
        seconds = compute_passes * forward_seconds(node, plan.nodes[node.name], modules, cluster, dtype, itemsize)
        (transfer, latency), (back, back_latency) = (
            _collectives_seconds(node, plan, modules, itemsize, cluster, sent) for sent in (node_comm_bytes,
                                                                                       node_backward_bytes))
        summed = weight_sum_seconds(node, plan.nodes[node.name], modules, itemsize, plan.mesh or plan.op_axes, cluster)
        fixed = op_overhead(node, plan.nodes[node.name], cluster, compute_passes, dtype) + \
            recompute_overhead(node.name, rc, cluster, plan.splits_operators)
        forwards = comm_passes - 1  # forward's collectives, and again where recompute runs them
        by_name[node.name] = OpCost(seconds, forwards * transfer + back,
                                    forwards * latency + back_latency + summed, fixed)
        out.append(by_name[node.name])
    output = next((n for n in reversed(gm.graph.nodes) if n.op == "output"), None)
    if out and output is not None and output.name in plan.nodes:  # e.g. split logits gathered whole
        transfer, latency = _collectives_seconds(output, plan, modules, itemsize, cluster)
        out[-1] = replace(out[-1], comm_s=out[-1].comm_s + RETURNED_PASSES * transfer,
                          latency_s=out[-1].latency_s + RETURNED_PASSES * latency)
    return out


def _collectives_seconds(node: fx.Node, plan: Plan, modules, itemsize: int, cluster: Cluster,
                         sent=node_comm_bytes) -> tuple[float, float]:
    """(transfer, latency) of ``node``'s collectives that ``sent`` lists (forward's, or backward's with
    node_backward_bytes), one after another."""
    return collectives_seconds(sent(node, plan, modules, itemsize, cluster.backend, cluster.all_to_all),
                               plan.mesh or plan.op_axes, cluster)


def step_seconds(costs: list[OpCost], copies: int, overlap: bool = True, slowdown: float = 0.0) -> float:
    """List-scheduled time of the interleaved order on one compute and one communication stream
    (``overlap=False``: communication occupies the compute stream too), compute taking ``slowdown`` longer
    while communication runs beside it."""
    compute_free = comm_free = 0.0
    ready = [0.0] * copies  # when each copy's previous communication is done
    for cost in costs:
        for c in range(copies):
            start = max(compute_free, ready[c])
            work = cost.compute_s / copies + cost.overhead_s
            beside = min(max(comm_free - start, 0.0), work * (1 + slowdown))
            compute_free = start + work + lost_beside(beside, slowdown)
            if cost.comm_s or cost.latency_s:
                comm_start = max(comm_free, compute_free)
                comm_free = comm_start + cost.comm_s / copies + cost.latency_s
                ready[c] = comm_free
                if not overlap:
                    compute_free = comm_free
            else:
                ready[c] = compute_free
    return max([compute_free, comm_free, *ready])


def first_bucket_bytes(cluster: Cluster, bucket_bytes: int) -> int:
    """The first gradient bucket backward closes: small where collectives run beside compute (GPUs), so
    communication starts early in backward; where they take the cores that compute (gloo on CPU) nothing
    hides and every bucket more pays one latency more, so it is as large as the others."""
    return min(FIRST_BUCKET_BYTES, bucket_bytes) if cluster.device_type == "cuda" else bucket_bytes


def choose_copies(gm: fx.GraphModule, plan: Plan, cluster: Cluster, batch_rows: int,
                  candidates: tuple[int, ...] = (1, 2, 4)) -> tuple[int, dict[int, float]]:
    """The copy count with the lowest predicted step time, and the prediction for each candidate."""
    costs = op_costs(gm, plan, cluster)
    overlap = cluster.device_type == "cuda"
    predicted = {k: step_seconds(costs, k, overlap, cluster.overlap_slowdown) for k in candidates if k <= batch_rows}
    return min(predicted, key=predicted.get), predicted
