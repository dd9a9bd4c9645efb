"""Which compute precisions a search costs, and the cluster its bounds and shared strategies are priced on.

A precision is left out only where another is no slower in every term the cost model prices by dtype
(matmul rate at every measured depth, fused attention's rate, the fixed cost per op): on GPUs bf16 wins all
three; on a CPU whose large bf16 products are fast but whose small ones and small kernels are slow, neither
dominates and both are costed. Bounds must then hold for both, so they are computed on an envelope of the two.
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
    best matmul rate, the least fixed cost per op, and at every measured product depth and attention size the
    best product and attention rate. Any plan costs no more there in that precision than on ``cluster`` in any
    of ``precisions``, so bounds computed on it hold for all of them (shares interpolate linearly between the
    measured points, and the maximum of lines lies under the line through their maxima)."""
    dtypes = [DTYPES[p][0] for p in precisions]
    low = DTYPES[narrowest(precisions)][0]
    if len(set(dtypes)) == 1:
        return cluster
    top = max(cluster.flops_per_s[d] for d in dtypes)

    def best(points: list, rate) -> tuple[tuple, ...]:
        return tuple((x, min(1.0, max(cluster.flops_per_s[d] * rate(d, x) for d in dtypes) / top)) for x in points)

    products, attention = dict(cluster.matmul_shares), dict(cluster.attention_shares)
    if any(d in products for d in dtypes):  # else every dtype's products take the same share of its rate
        products[low] = best(_depths(cluster, dtypes), _product_share(cluster))
    shapes = {(seq, dim) for d in dtypes for seq, dim, _ in attention.get(d, ())}
    if shapes:  # else every dtype's attention takes the same share of its rate
        rates = best(sorted(shapes, key=lambda shape: shape[::-1]), lambda d, shape: cluster.attention_share(d, *shape))
        attention[low] = tuple((*shape, share) for shape, share in rates)
    return dataclasses.replace(cluster, flops_per_s={**cluster.flops_per_s, low: top}, matmul_shares=products,
                               attention_shares=attention, pointwise_rates={**cluster.pointwise_rates,
                                                                            low: _fastest_pointwise(cluster, dtypes)},
                               op_overheads_s={**cluster.op_overheads_s,
                                               low: min(cluster.op_overhead_for(d) for d in dtypes)})


def _no_slower(cluster: Cluster, p: str, q: str) -> bool:
    """Whether precision ``p`` is priced no slower than ``q`` in every dtype term."""
    a, b = DTYPES[p][0], DTYPES[q][0]
    ra, rb = cluster.flops_per_s.get(a, 0.0), cluster.flops_per_s.get(b, 0.0)
    shapes = {(seq, dim) for d in (a, b) for seq, dim, _ in cluster.attention_shares.get(d, ())} or {(1.0, 1.0)}
    product = _product_share(cluster)
    ops = {op for d in (a, b) for op in cluster.pointwise_rates.get(d, {})}
    unmeasured = float("inf")  # an op without a rate is bound by its bytes alone
    return ra >= rb and cluster.op_overhead_for(a) <= cluster.op_overhead_for(b) and \
        all((cluster.pointwise_rate(op, a) or unmeasured) >= (cluster.pointwise_rate(op, b) or unmeasured)
            for op in ops) and \
        all(ra * cluster.attention_share(a, *s) >= rb * cluster.attention_share(b, *s) for s in shapes) and \
        all(ra * product(a, depth) >= rb * product(b, depth) for depth in _depths(cluster, (a, b)) or [1.0])


def _fastest_pointwise(cluster: Cluster, dtypes) -> dict[str, float]:
    """Per pointwise op, the best rate of ``dtypes``; an op some dtype has no rate for is left out (unbound)."""
    ops = set.intersection(*(set(cluster.pointwise_rates.get(d, {})) for d in dtypes))
    return {op: max(cluster.pointwise_rates[d][op] for d in dtypes) for op in ops}


def _depths(cluster: Cluster, dtypes) -> list[float]:
    """Every contraction depth where a product share of ``dtypes`` is measured or tabled."""
    return sorted({d for t in dtypes for d, _ in cluster.matmul_shares.get(t, ())} |
                  {d for d, _ in cluster.matmul_depth_shares})


def _product_share(cluster: Cluster):
    """(dtype, depth) -> the share of its rate a product ``depth`` deep in every pass reaches."""
    return lambda dtype, depth: cluster.matmul_share(depth, depth, depth, dtype)
