"""Bytes one device holds for training: parameters, gradients, optimizer state, activations.

Activations are the outputs autograd keeps for backward: every op's output except pure views
and shape queries, at this rank's share of the shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import fx

from polyshard.graph.capture import shape_of
from polyshard.layout import Layout
from polyshard.planner.plan import Plan

VIEW_OPS = {"view", "reshape", "transpose", "permute", "contiguous", "size", "expand", "unsqueeze", "flatten"}


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-device bytes: params_bytes, grads_bytes, optimizer_bytes (AdamW: two fp32 moments),
    activations_bytes (kept for backward), buffers_bytes (gradient buckets)."""

    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    buffers_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes + self.buffers_bytes


def local_numel(shape, layout: Layout) -> float:
    return math.prod(shape) / math.prod(layout.num_shards(d) for d in range(layout.ndim))


def estimate_memory(gm: fx.GraphModule, plan: Plan, itemsize: int = 4, optimizer_states: int = 2,
                    bucket_bytes: float = 25 * 2**20, data_parallel: bool = False) -> MemoryEstimate:
    """The per-device memory of training ``gm`` under ``plan`` (activations at the captured batch)."""
    params = dict(gm.named_parameters())
    param_numel = sum(local_numel(params[name].shape, layout) for name, layout in plan.params.items() if name in params)
    activations = 0.0
    for node in gm.graph.nodes:
        out = plan.nodes.get(node.name)
        shape = shape_of(node)
        if out is None or shape is None or not isinstance(out.output, Layout) or node.op in ("placeholder", "output"):
            continue
        if node.target in VIEW_OPS or getattr(node.target, "__name__", "") == "getitem":
            continue
        activations += local_numel(shape, out.output) * itemsize
    param_bytes = param_numel * itemsize
    buffers = min(bucket_bytes, param_bytes) if data_parallel else 0.0
    return MemoryEstimate(param_bytes, param_bytes, optimizer_states * param_numel * 4, activations, buffers)
