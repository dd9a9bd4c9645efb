"""A dataset strategy (MindSpore's): how each input's dims split over the operator axes, as the layouts of the
captured graph's inputs."""

from __future__ import annotations

from typing import Sequence

from torch import fx

from polyshard.errors import PolyshardError
from polyshard.graph.capture import shape_of
from polyshard.layout import Axes, Layout
from polyshard.planner.rules.einsum import pin_output_layout


def input_layouts(gm: fx.GraphModule, strategy: Sequence | None, op_axes: Axes,
                  absent_whole: bool = False) -> dict[str, Layout]:
    """The layouts ``strategy`` gives the graph's positional inputs over ``op_axes``, by placeholder name:
    per input, slice counts or axis names per dim, or None for whole. ``absent_whole``: a name ``op_axes``
    lacks leaves its dim whole (a search tries meshes with and without it); else it is an error."""
    if strategy is None:
        return {}
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if not isinstance(strategy, (tuple, list)) or len(strategy) > len(inputs):
        raise PolyshardError(f"dataset_strategy must be a tuple with one entry per input (at most {len(inputs)}), "
                             f"e.g. ((1, 1, 2, 2), None); got {strategy!r}")
    axes = dict(op_axes)
    out = {}
    for i, (node, s) in enumerate(zip(inputs, strategy)):
        if s is None:
            continue
        shape = shape_of(node)
        if shape is None or len(s) != len(shape):
            raise PolyshardError(f"dataset_strategy[{i}] {tuple(s)} has {len(s)} entries, but input `{node.name}` "
                                 f"has shape {tuple(shape or ())}; give one per dim")
        spec = tuple(None if absent_whole and isinstance(d, str) and d not in axes else d for d in s)
        layout = pin_output_layout(spec, shape, None, op_axes, f"dataset_strategy[{i}]")
        layout.check_divides(shape, f"input `{node.name}` (dataset_strategy[{i}] {tuple(s)})")
        out[node.name] = layout
    return out
