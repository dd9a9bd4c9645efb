"""Operators as einsum-like specs (nnscaler-style annotations), and strategies turned into layouts.

A spec names each dim of each input and of the output with a letter; a letter split by a
strategy must be split the same way wherever it appears, and a letter missing from the output
is a contraction whose split leaves the output as a partial sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from polyshard.errors import PolyshardError
from polyshard.layout import Axes, Layout, expand, refine

BATCH_LETTERS = "abcdefgh"


@dataclass(frozen=True)
class EinsumSpec:
    """inputs: one letter string per tensor input; output: the output's letters."""

    inputs: tuple[str, ...]
    output: str


def linear_spec(x_ndim: int, has_bias: bool) -> EinsumSpec:
    """y[..., j] = x[..., k] W[j, k] (+ b[j]); weight as stored by nn.Linear."""
    batch = BATCH_LETTERS[: x_ndim - 1]
    return EinsumSpec((batch + "k", "jk") + (("j",) if has_bias else ()), batch + "j")


def matmul_spec(a_ndim: int, b_ndim: int) -> EinsumSpec:
    """torch.matmul for a of rank >= 2 and b of rank 2 (or equal-rank batched)."""
    if a_ndim < 2 or b_ndim < 2:
        raise PolyshardError(f"matmul rule needs inputs of rank >= 2, got {a_ndim} and {b_ndim}")
    batch_a = BATCH_LETTERS[: a_ndim - 2]
    batch_b = batch_a[len(batch_a) - (b_ndim - 2):] if b_ndim > 2 else ""
    return EinsumSpec((batch_a + "ik", batch_b + "kj"), batch_a + "ij")


def embedding_spec(idx_ndim: int) -> EinsumSpec:
    """y[..., h] = W[v, h] looked up at idx[...]: splitting the vocabulary v leaves partial sums."""
    batch = BATCH_LETTERS[:idx_ndim]
    return EinsumSpec((batch, "vh"), batch + "h")


def independent_spec(ndims: Sequence[int]) -> EinsumSpec:
    """Inputs that share no dims (an op without a known spec): each strategy stands alone."""
    letters = iter("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    return EinsumSpec(tuple("".join(next(letters) for _ in range(n)) for n in ndims), "")


def _check_strategy(spec: EinsumSpec, strategy: Sequence, shapes: Sequence[Sequence[int]], op: str) -> None:
    if len(strategy) != len(spec.inputs):
        raise PolyshardError(
            f"`{op}`: in_strategy has {len(strategy)} entries but the op takes {len(spec.inputs)} "
            f"tensor inputs of shapes {[tuple(s) for s in shapes]}; give one tuple per input"
        )
    for i, (s, letters, shape) in enumerate(zip(strategy, spec.inputs, shapes)):
        if len(s) != len(letters):
            raise PolyshardError(
                f"`{op}`: strategy {tuple(s)} for input {i} has {len(s)} entries but the tensor has "
                f"{len(letters)} dims (shape {tuple(shape)}); give one slice count per dim"
            )


def layouts_from_counts(spec: EinsumSpec, strategy: Sequence[Sequence[int]], shapes: Sequence[Sequence[int]],
                        op_axes: Axes, op: str) -> list[Layout]:
    """MindSpore strategy tuples -> one layout per input over (a refinement of) ``op_axes``.

    The op's device matrix is [repeat] + [count per split letter, in order of first use], innermost
    last; devices the strategy leaves over repeat the computation.
    """
    _check_strategy(spec, strategy, shapes, op)
    counts: dict[str, tuple[int, int]] = {}
    for i, (s, letters, shape) in enumerate(zip(strategy, spec.inputs, shapes)):
        for d, (c, letter) in enumerate(zip(s, letters)):
            if not isinstance(c, int) or c < 1:
                raise PolyshardError(f"`{op}`: slice count {c!r} in {tuple(s)} must be a positive integer")
            if shape[d] % c:
                raise PolyshardError(
                    f"`{op}`: strategy {tuple(s)} does not divide dim {d} of size {shape[d]} of input {i} "
                    f"(shape {tuple(shape)}); use a count that divides {shape[d]}"
                )
            if letter in counts and counts[letter][0] != c:
                j = counts[letter][1]
                raise PolyshardError(
                    f"`{op}`: input {j} and input {i} split the same dim ({letter!r}) into "
                    f"{counts[letter][0]} and {c} slices; they must match"
                )
            counts.setdefault(letter, (c, i))
    world = math.prod(size for _, size in op_axes)
    used = math.prod(c for c, _ in counts.values())
    if world % used:
        raise PolyshardError(
            f"`{op}`: strategy {tuple(map(tuple, strategy))} uses {used} devices, which does not divide "
            f"the {world} devices of the op axes {dict(op_axes)}"
        )
    matrix: Axes = (("repeat", world // used),) + tuple((f"{op}.{l}", c) for l, (c, _) in counts.items() if c > 1)
    matrix = tuple(a for a in matrix if a[1] > 1) or (("repeat", 1),)
    axes, spans_mesh, spans_op = refine(op_axes, matrix)
    out = []
    for letters in spec.inputs:
        dims = tuple(spans_op.get(f"{op}.{l}", ()) for l in letters)
        out.append(Layout(axes, dims))
    return out


def output_layout(spec: EinsumSpec, in_layouts: Sequence[Layout], op: str) -> Layout:
    """The layout the op produces when its inputs have ``in_layouts``; contractions become partial."""
    axes_of: dict[str, tuple[str, ...]] = {}
    first: dict[str, int] = {}
    for i, (letters, layout) in enumerate(zip(spec.inputs, in_layouts)):
        for letter, axes in zip(letters, layout.dims):
            if letter in axes_of and axes_of[letter] != axes:
                raise PolyshardError(
                    f"`{op}`: input {first[letter]} splits its dim {letter!r} on {axes_of[letter] or 'no axis'} "
                    f"but input {i} on {axes or 'no axis'}; the same dim must be split alike"
                )
            axes_of.setdefault(letter, axes)
            first.setdefault(letter, i)
    dims = tuple(axes_of.get(l, ()) for l in spec.output)
    partial = tuple(a for l, axes in axes_of.items() if l not in spec.output for a in axes)
    mesh_order = [n for n, _ in in_layouts[0].axes]
    return Layout(in_layouts[0].axes, dims, tuple(sorted(partial, key=mesh_order.index)))


def counts_layout(counts: Sequence[int], shape: Sequence[int], op_axes: Axes, op: str) -> Layout:
    """One tensor's strategy tuple (e.g. an out_strategy) -> its layout, splits innermost first."""
    spec = EinsumSpec(("".join(BATCH_LETTERS[: len(counts)]),), "")
    return layouts_from_counts(spec, [counts], [shape], op_axes, op)[0]


def spec_layout(spec: Sequence, op_axes: Axes, shape: Sequence[int], op: str) -> Layout:
    """A named spec like ``("dp", None)`` over the op axes, checked against ``shape``."""
    if len(spec) != len(shape):
        raise PolyshardError(f"`{op}`: spec {tuple(spec)} has {len(spec)} entries for a tensor of shape {tuple(shape)}")
    names = {n for n, _ in op_axes}
    unknown = [a for entry in spec for a in ((entry,) if isinstance(entry, str) else entry or ()) if a not in names]
    if unknown:
        raise PolyshardError(f"`{op}`: spec {tuple(spec)} names axis {unknown[0]!r}, which is not an operator axis of "
                             f"the mesh ({', '.join(sorted(names)) or 'none'})")
    layout = Layout.from_spec(op_axes, spec)
    layout.check_divides(shape, f"`{op}`")
    return layout


def to_common(layouts: Sequence[Layout]) -> list[Layout]:
    """The layouts written over one device matrix (the common refinement of theirs)."""
    axes = layouts[0].axes
    for l in layouts[1:]:
        axes = refine(axes, l.axes)[0]
    out = []
    for l in layouts:
        if l.axes == axes:
            out.append(l)
        else:
            _, spans, _ = refine(l.axes, axes)
            out.append(expand(l, axes, spans))
    return out


def _is_named(strategy) -> bool:
    return any(isinstance(c, str) or c is None for s in strategy for c in s)


def pin_layouts(spec: EinsumSpec, strategy, shapes, op_axes: Axes, op: str) -> list[Layout]:
    """A pinned in_strategy (slice counts or named specs) -> one layout per input."""
    if _is_named(strategy):
        _check_strategy(spec, strategy, shapes, op)
        layouts = [spec_layout(s, op_axes, shape, op) for s, shape in zip(strategy, shapes)]
        output_layout(spec, layouts, op)  # checks that shared dims are split alike
        return layouts
    return layouts_from_counts(spec, strategy, shapes, op_axes, op)


def pin_output_layout(out_strategy, shape, natural: Layout | None, op_axes: Axes, op: str) -> Layout:
    """The output layout a pin asks for: its out_strategy, else the natural one with sums reduced."""
    if out_strategy is not None:
        if _is_named([out_strategy]):
            return spec_layout(out_strategy, op_axes, shape, op)
        return counts_layout(out_strategy, shape, op_axes, op)
    if natural is None:
        return Layout.replicated(op_axes, len(shape))
    return natural.with_dims(natural.dims)  # partial sums reduced
