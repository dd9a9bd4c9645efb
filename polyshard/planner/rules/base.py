"""The shape of a rule's answer, and what a rule may look at."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from torch import fx, nn

from polyshard.layout import Axes, Layout


@dataclass
class Decision:
    """How one graph node runs.

    impl: "local" (the op runs on each rank's pieces as written), "dtensor" (the op runs on
      DTensors built from the pieces: sharded weights, contractions), or "vocab_ce"
      (vocabulary-parallel cross-entropy).
    inputs: the layout each tensor input must be in (by input node name).
    output: the layout of the node's value (None for non-tensors, a tuple for tuples).
    params: for a module node, each parameter's layout (by the parameter's own name).
    shape_divisors: for view-like ops, output dim -> pieces, to turn global shape args local.
    """

    impl: str
    inputs: dict[str, Layout]
    output: Any
    params: dict[str, Layout] = field(default_factory=dict)
    shape_divisors: dict[int, int] = field(default_factory=dict)


@dataclass
class RuleContext:
    """What rules read: the op axes, the graph's modules, layouts already fixed, pins."""

    op_axes: Axes
    modules: dict[str, nn.Module]
    layouts: dict[str, Any]
    param_layouts: dict[int, Layout]
    warn: Callable[[str], None]

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
