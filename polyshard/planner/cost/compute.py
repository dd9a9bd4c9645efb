"""Forward FLOPs each op does on one rank, from its global shapes and the plan's layouts.

Matrix products count 2 FLOPs per multiply-add (nanoGPT's estimate_mfu convention); attention
counts its two products, 4*B*H*T*S*D; elementwise ops count one FLOP per output element.
Training costs 3x forward (backward does two products per forward one); an op that recompute
runs again in backward costs one forward more.
"""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import fx, nn

from polyshard.graph.capture import shape_of
from polyshard.layout import Layout
from polyshard.cluster import Cluster
from polyshard.graph.regions import Recomputed
from polyshard.planner.plan import NodePlan, Plan

TRAIN_FLOPS_PER_FORWARD = 3


def forward_flops(node: fx.Node, plan: Plan, modules: dict[str, nn.Module]) -> float:
    """FLOPs of ``node``'s forward on this rank."""
    shape = shape_of(node)
    out = plan.nodes[node.name].output
    if shape is None or not isinstance(out, Layout):
        return 0.0
    local = math.prod(shape) / math.prod(out.num_shards(d) for d in range(out.ndim))
    if node.op == "call_module":
        module = modules[node.target]
        if isinstance(module, nn.Linear):
            weight = plan.nodes[node.name].params["weight"]
            return 2 * local * module.in_features / weight.num_shards(1)
        if isinstance(module, nn.Embedding):
            return 0.0
    if node.target is F.scaled_dot_product_attention:
        q, k = (shape_of(n) for n in node.args[:2])
        return 4 * local / q[-1] * k[-2] * q[-1]
    return local


def passes(name: str, recomputed: Recomputed) -> tuple[int, int]:
    """(forward-equivalents of compute, passes of communication) per training step for node ``name``:
    3 and 2 (forward, backward), one more of each when recompute runs it again (communication
    only if its collectives are recomputed rather than kept)."""
    again = name in recomputed.rerun
    return TRAIN_FLOPS_PER_FORWARD + again, 2 + (again and recomputed.comm == "recompute")


def op_overhead(entry: NodePlan, cluster: Cluster, compute_passes: int = TRAIN_FLOPS_PER_FORWARD) -> float:
    """Fixed cost of one op per training step, however small: more when it runs on split tensors (DTensor)."""
    per_step = cluster.op_overhead_s + (cluster.split_op_overhead_s if entry.impl != "local" else 0.0)
    return per_step * compute_passes / TRAIN_FLOPS_PER_FORWARD
