"""Bytes one rank holds at each optimizer-parallel (ZeRO) level, and how gradients are cut into buckets.

The runtime (polyshard.runtime.zero) cuts its buckets with :func:`polyshard.buckets.cut_buckets`, as this
prediction does, so the two follow one definition. Per rank, with P the bytes of the parameters that are
sharded (each at least ``threshold_bytes``), W those that stay whole, N ranks, k optimizer states:

    level  params        grads         optimizer
    0      W + P         W + P         k (W + P)
    1      W + P~        W + P~        k (W + P~/N)
    2      W + P~        W + P~/N      k (W + P~/N)
    3      W + P~/N      W + P~/N      k (W + P~/N)

where P~ is P padded per bucket (level 3: per module) to a multiple of N elements. Gradients accumulated over
several micro-batches are held whole (W + P~) until the last one reduces them, at every level. No communication buffer
outlives a step: the all-reduced gradient buffer becomes the gradient, level 3's gathered parameters are freed.
"""

from __future__ import annotations

from collections.abc import Sequence

from polyshard.buckets import BUCKET_BYTES, FIRST_BUCKET_BYTES, cut_buckets, padded
from polyshard.errors import PolyshardError

def state_bytes_per_rank(param_numels: Sequence[int | Sequence[int]], level: int, world: int,
                         threshold_bytes: int, itemsize: int = 4, optimizer_states: int = 2,
                         bucket_bytes: int = BUCKET_BYTES, accumulating: bool = False,
                         first_bucket_bytes: int = FIRST_BUCKET_BYTES) -> dict[str, int]:
    """Predicted bytes of parameters, gradients, optimizer state and buffers one rank holds after a step.

    ``param_numels``: this rank's parameter sizes in forward order, grouped by the module that uses them
    (level 3 gathers one module's parameters at a time); a plain int is a module of one parameter.
    ``optimizer_states``: per-element state tensors (AdamW: 2, SGD with momentum: 1, LAMB: 2);
    ``accumulating``: gradients are accumulated over micro-batches, whole until the last one.
    """
    if level not in (0, 1, 2, 3):
        raise PolyshardError(f"ZeRO level must be 0, 1, 2 or 3, got {level!r}")
    if world < 1:
        raise PolyshardError(f"world must be at least 1, got {world}")
    units = [[n] if isinstance(n, int) else list(n) for n in param_numels]
    flat = [n for unit in units for n in unit]
    sharded = [level > 0 and world > 1 and n * itemsize >= threshold_bytes for n in flat]
    whole = sum(n for n, s in zip(flat, sharded) if not s)
    if level == 3:
        marks = iter(sharded)
        full = [padded(sum(n for n in unit if next(marks)), world) for unit in units]
    else:
        order = list(reversed(range(len(flat))))
        buckets = cut_buckets([flat[i] * itemsize for i in order], [sharded[i] for i in order], bucket_bytes,
                              first_bucket_bytes)
        full = [padded(sum(flat[order[j]] for j in b), world) for b in buckets if sharded[order[b[0]]]]
    total_full = sum(full)
    shard = total_full // world
    params = whole + (shard if level == 3 else total_full)
    grads = whole + (total_full if level <= 1 or accumulating else shard)
    return {"params": params * itemsize, "grads": grads * itemsize,
            "optimizer": optimizer_states * (whole + shard) * itemsize, "buffers": 0}
