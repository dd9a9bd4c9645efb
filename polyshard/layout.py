"""Layout: how a tensor lies on a device matrix (MindSpore's device matrix + tensor map).

A layout names the device-matrix axes (outer first, with sizes), and for each tensor dim
the axes that split it (outer first), plus the axes on which it is a pending sum
("partial"). It converts from MindSpore strategy tuples, from named specs like
``("dp", None)`` (JAX's PartitionSpec) and to/from DTensor placements, and prints
compactly per axis, e.g. ``S(0)R`` for "dim 0 split on the first axis, replicated on the second".
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

from polyshard.errors import PolyshardError

Axes = tuple[tuple[str, int], ...]
"""A device matrix: (axis name, size) pairs, outermost first (row-major over ranks)."""


@dataclass(frozen=True)
class Layout:
    """One tensor's placement over a device matrix.

    axes: the device matrix, outermost axis first.
    dims: for each tensor dim, the names of the axes that split it, outermost first.
    partial: axes on which each device holds a summand of the tensor, not the tensor itself.
    """

    axes: Axes
    dims: tuple[tuple[str, ...], ...]
    partial: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        position = _positions(self.axes)
        used = [a for d in self.dims for a in d] + list(self.partial)
        if not used:
            return  # replicated: nothing to check (the planner builds many)
        unknown = [a for a in used if a not in position]
        if unknown:
            raise PolyshardError(f"layout uses axes {unknown} not in the device matrix {list(position)}")
        if len(set(used)) != len(used):
            raise PolyshardError(f"layout {self.dims} partial={self.partial} uses an axis twice")
        if len(self.partial) > 1:
            object.__setattr__(self, "partial", tuple(sorted(self.partial, key=position.__getitem__)))
        for d in self.dims:
            if any(position[a] > position[b] for a, b in zip(d, d[1:])):
                raise PolyshardError(
                    f"axes {d} split one dim out of mesh order {list(position)}; list them outermost first"
                )

    # -- construction ---------------------------------------------------------------
    @staticmethod
    def replicated(axes: Axes, ndim: int) -> Layout:
        return Layout(axes, ((),) * ndim)

    @staticmethod
    def from_spec(axes: Axes, spec: Sequence[str | Sequence[str] | None]) -> Layout:
        """From a named spec: one entry per dim, None, an axis name, or a tuple of names."""
        dims = tuple(() if s is None else (s,) if isinstance(s, str) else tuple(s) for s in spec)
        return Layout(axes, dims)

    @staticmethod
    def from_placements(axes: Axes, placements: Sequence, ndim: int) -> Layout:
        """From DTensor placements (one per axis of ``axes``)."""
        from torch.distributed.tensor import Partial, Replicate, Shard

        if len(placements) != len(axes):
            raise PolyshardError(f"{len(placements)} placements for a {len(axes)}-axis mesh")
        dims: list[list[str]] = [[] for _ in range(ndim)]
        partial = []
        for (name, _), p in zip(axes, placements):
            if isinstance(p, Shard):
                if not -ndim <= p.dim < ndim:
                    raise PolyshardError(f"placement {p} on axis {name} is out of range for a {ndim}-dim tensor")
                dims[p.dim % ndim].append(name)
            elif isinstance(p, Partial):
                if p.reduce_op != "sum":
                    raise PolyshardError(f"partial placement {p} on axis {name}: only pending sums are supported")
                partial.append(name)
            elif not isinstance(p, Replicate):
                raise PolyshardError(f"placement {p} is not Shard, Replicate or Partial")
        return Layout(axes, tuple(tuple(d) for d in dims), tuple(partial))

    # -- queries --------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.dims)

    @property
    def axis_sizes(self) -> dict[str, int]:
        return dict(self.axes)

    def num_shards(self, dim: int) -> int:
        """How many pieces dim ``dim`` is cut into."""
        return self.shards[dim]

    @functools.cached_property
    def shards(self) -> tuple[int, ...]:
        """Pieces per dim, computed once: the cost model asks for them millions of times."""
        sizes = self.axis_sizes
        return tuple(math.prod(sizes[a] for a in d) for d in self.dims)

    @functools.cached_property
    def pieces(self) -> int:
        """Pieces the whole tensor is cut into (partial sums aside)."""
        return math.prod(self.shards)

    def dim_of(self, axis: str) -> int | None:
        """The tensor dim split by ``axis``, or None."""
        return next((i for i, d in enumerate(self.dims) if axis in d), None)

    @property
    def is_replicated(self) -> bool:
        return not self.partial and all(not d for d in self.dims)

    def local_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        return tuple(s // self.num_shards(i) for i, s in enumerate(shape))

    def global_shape(self, local_shape: Sequence[int]) -> tuple[int, ...]:
        return tuple(s * self.num_shards(i) for i, s in enumerate(local_shape))

    def check_divides(self, shape: Sequence[int], what: str) -> None:
        """Raise if a split does not divide the dim it splits."""
        if len(shape) != self.ndim:
            raise PolyshardError(f"{what}: layout has {self.ndim} dims, tensor shape {tuple(shape)}")
        for i, s in enumerate(shape):
            n = self.num_shards(i)
            if s % n:
                raise PolyshardError(
                    f"{what}: {n} slices do not divide dim {i} of size {s} (shape {tuple(shape)}); "
                    f"choose a slice count that divides {s}"
                )

    def placements(self) -> tuple:
        """DTensor placements, one per axis."""
        from torch.distributed.tensor import Partial, Replicate, Shard

        out = []
        for name, _ in self.axes:
            dim = self.dim_of(name)
            out.append(Shard(dim) if dim is not None else Partial() if name in self.partial else Replicate())
        return tuple(out)

    def with_dims(self, dims: Sequence[Sequence[str]], partial: Sequence[str] = ()) -> Layout:
        return _interned(self.axes, tuple(map(tuple, dims)), tuple(partial))

    def __str__(self) -> str:
        parts = []
        for name, _ in self.axes:
            dim = self.dim_of(name)
            parts.append(f"S({dim})" if dim is not None else "P" if name in self.partial else "R")
        return "".join(parts) or "R"

    def describe(self) -> str:
        """Per-axis form with names, e.g. ``dp=2:S(0) tp=2:R``."""
        return " ".join(f"{n}={s}:{p}" for (n, s), p in zip(self.axes, _split_str(str(self))))


@functools.lru_cache(maxsize=2**16)
def _interned(axes: Axes, dims: tuple[tuple[str, ...], ...], partial: tuple[str, ...]) -> Layout:
    """One checked Layout per (axes, dims, partial): a search derives the same few layouts from each other a hundred
    thousand times, and checking each again costs ten times the lookup (layouts are immutable, so one serves all)."""
    return Layout(axes, dims, partial)


@functools.lru_cache(maxsize=None)
def _positions(axes: Axes) -> dict[str, int]:
    return {name: i for i, (name, _) in enumerate(axes)}


def _split_str(text: str) -> list[str]:
    out, i = [], 0
    while i < len(text):
        j = text.index(")", i) + 1 if text[i] == "S" else i + 1
        out.append(text[i:j])
        i = j
    return out


def refine(axes_a: Axes, axes_b: Axes) -> tuple[Axes, dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]:
    """The common refinement of two device matrices over the same ranks.

    Returns the refined axes and, for each axis of a and of b, the refined axes it spans.
    Both must cut the ranks at a chain of divisors (counted from the innermost axis);
    otherwise no single mesh holds both layouts and an error says so.
    """
    if axes_a == axes_b:
        same = {name: (name,) for name, _ in axes_a}
        return axes_a, same, same
    if math.prod(s for _, s in axes_a) != math.prod(s for _, s in axes_b):
        raise PolyshardError(f"device matrices {axes_a} and {axes_b} cover different device counts")
    cuts_a, cuts_b = _inner_cuts(axes_a), _inner_cuts(axes_b)
    cuts = sorted(set(cuts_a) | set(cuts_b))
    for small, big in zip(cuts, cuts[1:]):
        if big % small:
            raise PolyshardError(
                f"device matrices {axes_a} and {axes_b} have no common refinement; "
                "use slice counts that nest (e.g. 2 and 4, not 2 and 3 on 6 devices)"
            )
    sizes = [big // small for small, big in zip(cuts, cuts[1:])]  # innermost first
    names = _refined_names(axes_a, cuts_a, cuts)
    refined: Axes = tuple(reversed(list(zip(names, sizes))))
    return refined, _spans(axes_a, cuts_a, cuts, names), _spans(axes_b, cuts_b, cuts, names)


def _inner_cuts(axes: Axes) -> list[int]:
    cuts, total = [1], 1
    for _, size in reversed(axes):
        total *= size
        cuts.append(total)
    return cuts


def _refined_names(axes: Axes, own_cuts: list[int], cuts: list[int]) -> list[str]:
    """Names of refined axes (innermost first): an axis cut into k pieces becomes name:0..k-1."""
    names = []
    for i, (name, _) in enumerate(reversed(axes)):
        lo, hi = own_cuts[i], own_cuts[i + 1]
        inner = [c for c in cuts if lo <= c < hi]
        if len(inner) == 1:
            names.append(name)
        else:
            names.extend(f"{name}:{k}" for k in reversed(range(len(inner))))
    return names


def _spans(axes: Axes, own_cuts: list[int], cuts: list[int], names: list[str]) -> dict[str, tuple[str, ...]]:
    spans = {}
    for i, (name, _) in enumerate(reversed(axes)):
        lo, hi = own_cuts[i], own_cuts[i + 1]
        idx = [k for k, c in enumerate(cuts[:-1]) if lo <= c < hi]
        spans[name] = tuple(names[k] for k in reversed(idx))
    return spans


def expand(layout: Layout, refined: Axes, spans: dict[str, tuple[str, ...]]) -> Layout:
    """The same layout written over a refined device matrix."""
    dims = tuple(tuple(r for a in d for r in spans[a]) for d in layout.dims)
    partial = tuple(r for a in layout.partial for r in spans[a])
    return Layout(refined, dims, partial)


def collapse(layout: Layout, coarse: Axes, spans: dict[str, tuple[str, ...]]) -> Layout:
    """Inverse of :func:`expand`; raises if the layout splits a coarse axis's pieces apart."""
    dims = []
    for d in layout.dims:
        out = []
        for name, _ in coarse:
            span = spans[name]
            hit = [r for r in span if r in d]
            if hit and hit != list(span):
                raise PolyshardError(f"layout {layout.describe()} uses only part of axis {name}")
            if hit:
                out.append(name)
        dims.append(tuple(out))
    partial = []
    for name, _ in coarse:
        hit = [r for r in spans[name] if r in layout.partial]
        if hit and hit != list(spans[name]):
            raise PolyshardError(f"layout {layout.describe()} holds partial sums on only part of axis {name}")
        if hit:
            partial.append(name)
    return Layout(coarse, tuple(dims), tuple(partial))


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))
