"""Which compute precisions a search costs, and the cluster its bounds and shared strategies are priced on.

A precision is left out only where another is no slower in every term the cost model prices by dtype
(matmul rate, fused attention's rate, the fixed cost per op): on GPUs bf16 wins all three; on a CPU whose
bf16 products are fast but whose small bf16 kernels cost more per op, neither dominates and both are
costed. Bounds must then hold for both, so they are computed on an envelope of the two.
"""

from __future__ import annotations

import dataclasses

from polyshard.cluster import Cluster
from polyshard.plan import DTYPES

_DOMINANCE_ORDER = ("fp32", "bf16")  # where each is priced as fast as the other, fp32 keeps its precision


def precisions_to_cost(cluster: Cluster, offload: str, fixed: str | None) -> tuple[str, ...]:
    """The precisions to cost: ``fixed`` where given; fp32 with offloaded state (stepped whole, in fp32);
    else the one that dominates, or both fp32 and bf16 where neither does."""
    if offload != "none":
        return ("fp32",)
    if fixed is not None:
        return (fixed,)
    winner = next((p for p in _DOMINANCE_ORDER if all(_no_slower(cluster, p, q) for q in _DOMINANCE_ORDER)), None)
    return (winner,) if winner else ("fp32", "bf16")


def narrowest(precisions: tuple[str, ...]) -> str:
    """The precision of fewest bytes per element: the one bounds are computed in."""
    return min(precisions, key=lambda p: DTYPES[p][1])


def bounding_cluster(cluster: Cluster, precisions: tuple[str, ...]) -> Cluster:
    """``cluster`` with the narrowest of ``precisions`` as fast as the fastest of them in every dtype term: the
    best matmul rate, the least fixed cost per op, and at every measured attention size the best attention
    rate. Any plan costs no more there in that precision than on ``cluster`` in any of ``precisions``, so
    bounds computed on it hold for all of them (attention shares interpolate linearly between sizes, and the
    maximum of lines lies under the line through their maxima)."""
    dtypes = [DTYPES[p][0] for p in precisions]
    low = DTYPES[narrowest(precisions)][0]
    if len(set(dtypes)) == 1:
        return cluster
    top = max(cluster.flops_per_s[d] for d in dtypes)
    sizes = sorted({f for d in dtypes for f, _ in cluster.attention_shares.get(d, ())})
    shares = dict(cluster.attention_shares)
    if sizes:  # else every dtype runs attention at attention_efficiency of its rate
        shares[low] = tuple((f, min(1.0, max(cluster.flops_per_s[d] * cluster.attention_share(d, f)
                                             for d in dtypes) / top)) for f in sizes)
    return dataclasses.replace(cluster, flops_per_s={**cluster.flops_per_s, low: top}, attention_shares=shares,
                               op_overheads_s={**cluster.op_overheads_s,
                                               low: min(cluster.op_overhead_for(d) for d in dtypes)})


def _no_slower(cluster: Cluster, p: str, q: str) -> bool:
    """Whether precision ``p`` is priced no slower than ``q`` in every dtype term."""
    a, b = DTYPES[p][0], DTYPES[q][0]
    ra, rb = cluster.flops_per_s.get(a, 0.0), cluster.flops_per_s.get(b, 0.0)
    sizes = {f for d in (a, b) for f, _ in cluster.attention_shares.get(d, ())} or {1.0}
    return ra >= rb and cluster.op_overhead_for(a) <= cluster.op_overhead_for(b) and \
        all(ra * cluster.attention_share(a, f) >= rb * cluster.attention_share(b, f) for f in sizes)
