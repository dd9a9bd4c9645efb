"""Layout-to-layout transitions as a list of one-axis collectives, and the bytes each moves.

Pure planning (no process group), shared by the cost model and the compiler. The table:

    P -> R      all-reduce        2 (n-1)/n x local bytes sent per rank (ring)
    P -> S(d)   reduce-scatter      (n-1)/n x local bytes
    S(d) -> R   all-gather          (n-1)   x local bytes
    S(d) -> S(e) all-to-all         (n-1)/n x local bytes (gloo has none: gathered, (n-1) x)
    R -> S(d)   slice              0 (each rank keeps its piece)

Where all-to-all is not allowed (a network without it), S(d) -> S(e) is an all-gather and a slice.

Partial sums are reduced first (they shrink what follows), then splits that are in the wrong
place are gathered innermost first, then the target's new splits are sliced outermost first.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

from polyshard.errors import PolyshardError
from polyshard.layout import Layout, expand, refine

COLLECTIVE_OF = {
    ("P", "R"): "all_reduce",
    ("P", "S"): "reduce_scatter",
    ("S", "R"): "all_gather",
    ("S", "S"): "all_to_all",
    ("R", "S"): "slice",
}


def wire_bytes(collective: str, local_bytes: float, group_size: int, backend: str = "gloo") -> float:
    """Bytes one rank sends for ``collective`` over ``group_size`` ranks, given its input's bytes."""
    n = group_size
    if collective == "all_to_all" and backend == "gloo":
        collective = "all_gather"  # gloo has no all-to-all: DTensor gathers and keeps its chunk
    return {
        "all_reduce": 2 * (n - 1) / n * local_bytes,
        "reduce_scatter": (n - 1) / n * local_bytes,
        "all_gather": (n - 1) * local_bytes,
        "all_to_all": (n - 1) / n * local_bytes,
        "slice": 0.0,
    }[collective]


@dataclass(frozen=True)
class Step:
    """One collective (or local slice) on one axis, from ``before`` to ``after``."""

    collective: str
    axis: str
    before: Layout
    after: Layout

    def bytes_sent(self, global_shape: Sequence[int], itemsize: int, backend: str = "gloo") -> float:
        local = math.prod(self.before.local_shape(global_shape)) * itemsize
        return wire_bytes(self.collective, local, self.before.axis_sizes[self.axis], backend)


def plan_transition(src: Layout, dst: Layout, all_to_all: bool = True) -> list[Step]:
    """Steps from ``src`` to ``dst``; both over the same device matrix (see :func:`common_axes`).
    ``all_to_all=False``: a split that moves between dims is gathered and sliced instead."""
    if src.axes != dst.axes or src.ndim != dst.ndim:
        raise PolyshardError(f"cannot plan {src.describe()} -> {dst.describe()}: different axes or ranks")
    missing = [a for a in dst.partial if a not in src.partial]
    if missing:
        raise PolyshardError(f"target layout {dst.describe()} asks for partial sums on {missing}; nothing makes them")
    steps: list[Step] = []
    cur = src

    def move(collective: str, axis: str, dims, partial) -> None:
        nonlocal cur
        nxt = cur.with_dims(dims, partial)
        steps.append(Step(collective, axis, cur, nxt))
        cur = nxt

    for axis in [a for a in src.partial if a not in dst.partial]:
        dims = [list(d) for d in cur.dims]
        partial = [p for p in cur.partial if p != axis]
        d = dst.dim_of(axis)
        if d is not None and not cur.dims[d] and dst.dims[d] == (axis,):
            dims[d] = [axis]
            move("reduce_scatter", axis, dims, partial)
        else:
            move("all_reduce", axis, dims, partial)

    for d in range(src.ndim):
        keep = _common_prefix(cur.dims[d], dst.dims[d])
        for axis in reversed(cur.dims[d][len(keep):]):
            dims = [list(x) for x in cur.dims]
            dims[d].remove(axis)
            e = dst.dim_of(axis)
            if (all_to_all and e is not None and e != d and dst.dims[e] == cur.dims[e] + (axis,)
                    and cur.dims[d][-1] == axis):
                dims[e].append(axis)
                move("all_to_all", axis, dims, cur.partial)
            else:
                move("all_gather", axis, dims, cur.partial)

    for d in range(src.ndim):
        for axis in dst.dims[d][len(cur.dims[d]):]:
            dims = [list(x) for x in cur.dims]
            dims[d].append(axis)
            move("slice", axis, dims, cur.partial)
    assert cur == dst, (cur, dst)
    return steps


def _common_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def common_axes(src: Layout, dst: Layout) -> tuple[Layout, Layout]:
    """Both layouts written over the common refinement of their device matrices."""
    if src.axes == dst.axes:
        return src, dst
    axes, spans_src, spans_dst = refine(src.axes, dst.axes)
    return expand(src, axes, spans_src), expand(dst, axes, spans_dst)


# the suffix of an axis's name under which transition_bytes counts an all-to-all's bytes
PAIRWISE = "@pairwise"


@functools.lru_cache(maxsize=65536)
def _transition_bytes(src: Layout, dst: Layout, global_shape: tuple[int, ...], itemsize: int,
                      backend: str, all_to_all: bool) -> tuple[tuple[str, float], ...]:
    a, b = common_axes(src, dst)
    out: dict[str, float] = {}
    for step in plan_transition(a, b, all_to_all):
        pairwise = step.collective == "all_to_all" and backend != "gloo"  # gloo gathers instead (wire_bytes)
        key = step.axis + PAIRWISE * pairwise
        out[key] = out.get(key, 0.0) + step.bytes_sent(global_shape, itemsize, backend)
    return tuple(out.items())


def transition_bytes(src: Layout, dst: Layout, global_shape: Sequence[int], itemsize: int,
                     backend: str = "gloo", all_to_all: bool = True) -> dict[str, float]:
    """Bytes each rank sends per axis to go from ``src`` to ``dst`` (memoised: the search asks often); an
    all-to-all's under its axis's name and PAIRWISE, as it sends to each rank apart rather than round a ring."""
    return dict(_transition_bytes(src, dst, tuple(global_shape), itemsize, backend, all_to_all))
