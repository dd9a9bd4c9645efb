"""A user's pinned strategy for one module or function (MindSpore's ``shard``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from polyshard.errors import PolyshardError

Strategy = Sequence[Sequence[Any]]


@dataclass(frozen=True)
class Pin:
    """in_strategy: per input, slices per dim (``(2, 1)``) or a named spec (``("tp", None)``).
    out_strategy: the output's, or None for the op's natural output (partial sums reduced).
    fn: the pinned function (None for a module); name: how errors and plans call it."""

    in_strategy: tuple
    out_strategy: tuple | None
    fn: Callable | None = None
    name: str = ""


def make_pin(in_strategy: Strategy, out_strategy: Sequence | None, fn: Callable | None, name: str) -> Pin:
    """Validate the strategy's form (not its fit to shapes: that needs the tensors)."""
    if not isinstance(in_strategy, (tuple, list)) or not all(isinstance(s, (tuple, list)) for s in in_strategy):
        raise PolyshardError(
            f"`{name}`: in_strategy must be a tuple with one tuple per input, e.g. ((2, 1), (1, 1)); "
            f"got {in_strategy!r}"
        )
    for s in in_strategy:
        for c in s:
            if not (c is None or isinstance(c, str) or (isinstance(c, int) and c >= 1)):
                raise PolyshardError(f"`{name}`: entry {c!r} of {tuple(s)} is not a positive slice count or axis name")
    out = tuple(out_strategy) if out_strategy is not None else None
    return Pin(tuple(tuple(s) for s in in_strategy), out, fn, name)
