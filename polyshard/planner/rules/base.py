"""What a rule may look at; its answer is a NodePlan (the Plan's per-node entry)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from torch import fx, nn

from polyshard.layout import Axes, Layout


INPUT_LAYOUTS = "polyshard_input_layouts"  # a captured graph's meta: its inputs' layouts, by placeholder name


@dataclass
class RuleContext:
    """What rules read: the op axes, the graph's modules, layouts already fixed, pins; and for the
    search, whether row-parallel products reduce-scatter along the sequence (sequence parallel: True
    wherever it applies, False never, None both offered); the graph inputs' layouts (replicated if absent);
    rows: where the op axes split the batch rows instead of operators (a pipeline stage whose operator ranks
    act as data parallel: weights whole, their gradients summed over the axes), the values whose dim 0 holds
    those rows."""

    op_axes: Axes
    modules: dict[str, nn.Module]
    layouts: dict[str, Any]
    param_layouts: dict[int, Layout]
    warn: Callable[[str], None]
    sequence: bool | None = None
    inputs: dict[str, Layout] = field(default_factory=dict)  # graph inputs laid out by a dataset strategy
    rows: frozenset[str] = frozenset()

    @property
    def all_axes(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.op_axes)

    @property
    def num_devices(self) -> int:
        return math.prod(s for _, s in self.op_axes)

    def layout(self, node: Any) -> Any:
        return self.layouts.get(node.name) if isinstance(node, fx.Node) else None

    def replicated(self, ndim: int) -> Layout:
        return Layout.replicated(self.op_axes, ndim)
