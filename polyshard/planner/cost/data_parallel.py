"""Data-parallel gradient traffic per step at each optimizer-parallel level, and what backward hides of it."""

from __future__ import annotations

from polyshard.buckets import BUCKET_BYTES, bucket_count
from polyshard.cluster import Cluster
from polyshard.planner.cost.comm import DataSync, axis_link, collective_latency
from polyshard.planner.cost.overlap import first_bucket_bytes
from polyshard.planner.split import data_size
from polyshard.transitions import wire_bytes


def dp_seconds(grad_bytes: float, mesh, data_axes, cluster: Cluster, zero: int = 0, modules: float = 0,
               overlap_s: float = 0.0, micro_batches: int = 1, whole_bytes: float = 0.0,
               bucket_bytes: int = BUCKET_BYTES) -> float:
    """Data-parallel communication per step left exposed beside ``overlap_s`` of backward (:func:`dp_sync`)."""
    return dp_sync(grad_bytes, mesh, data_axes, cluster, zero, modules, micro_batches, whole_bytes,
                   bucket_bytes).exposed(overlap_s)


def dp_sync(grad_bytes: float, mesh, data_axes, cluster: Cluster, zero: int = 0, modules: float = 0,
            micro_batches: int = 1, whole_bytes: float = 0.0, bucket_bytes: int = BUCKET_BYTES) -> DataSync:
    """Data-parallel communication per step (alpha-beta on the outermost data axis's link), by when it runs.

    With B gradient bytes over n ranks, each level moves what the runtime (polyshard.runtime.zero)
    issues, one collective per gradient bucket of ``bucket_bytes``: level 0 all-reduces the gradients,
    2(n-1)/n B; level 1 all-reduces them and all-gathers the stepped shards, 3(n-1)/n B; level 2 reduce-scatters and
    all-gathers, 2(n-1)/n B; level 3 all-gathers each module's parameters in forward and again in
    backward and reduce-scatters the gradients, 3(n-1)/n B in 3 collectives per module; over m
    accumulated micro-batches level 3 gathers in each one's forward and backward, (2m+1)(n-1)/n B;
    ``modules``: those level 3 gathers; ``whole_bytes``: of B, parameters small enough to stay whole at
    levels 1-3, all-reduced in buckets of their own and never gathered. Each collective pays its own fixed
    cost (an all-gather half an all-reduce's, see collective_latency). On GPUs the
    collectives issued during backward (level 3: during every forward and backward) run beside the last
    backward and only the rest, and at least the last bucket, is exposed; the all-gather after the optimizer
    step (levels 1, 2) is not hidden, and backward beside the traffic runs Cluster.overlap_slowdown longer.
    On CPU gloo runs on the cores that compute, so nothing hides (see cost/overlap.py)."""
    dp = data_size(mesh, data_axes)
    if dp == 1:
        return DataSync(0.0)
    link = axis_link(mesh, next(n for n, s in mesh if n in data_axes), cluster)
    latency = collective_latency(link, dp)
    gather, scatter = (collective_latency(link, dp, kind, cluster.backend) for kind in ("all_gather", "reduce_scatter"))
    pass_s = wire_bytes("reduce_scatter", grad_bytes, dp) / link.bandwidth_bytes_per_s  # (n-1)/n B once
    first = first_bucket_bytes(cluster, bucket_bytes)
    buckets = bucket_count(grad_bytes, bucket_bytes, first)
    sharded = grad_bytes - whole_bytes if zero else 0.0
    sharded_s = pass_s * sharded / grad_bytes if grad_bytes else 0.0
    sharded_buckets = bucket_count(sharded, bucket_bytes, first) if sharded > 0 else 0
    whole_buckets = bucket_count(whole_bytes, bucket_bytes, first) if whole_bytes else 0
    whole_s = 2 * (pass_s - sharded_s) + whole_buckets * latency if whole_bytes else 0.0
    if zero == 3:
        during = ((2 * micro_batches + 1) * sharded_s + modules * (2 * micro_batches * gather + scatter)
                  + whole_s)
    elif zero == 2:
        during = sharded_s + sharded_buckets * scatter + whole_s
    else:
        during = 2 * pass_s + buckets * latency
    after = sharded_s + sharded_buckets * gather if zero in (1, 2) else 0.0
    if cluster.device_type != "cuda":
        return DataSync(during, after)
    last_bucket = min(during, wire_bytes("all_reduce", bucket_bytes, dp) / link.bandwidth_bytes_per_s + latency)
    # level 3: beside every forward too (half a backward each)
    return DataSync(during, after, last_bucket, 1.5 * micro_batches if zero == 3 else 1, cluster.overlap_slowdown)
