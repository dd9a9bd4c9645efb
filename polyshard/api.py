"""The semi-auto entry point: ``shard`` pins a strategy on a module or a function."""

from __future__ import annotations

from typing import Sequence, TypeVar

from torch import nn

from polyshard.errors import PolyshardError
from polyshard.graph.capture import PIN_ATTR
from polyshard.pin import Strategy, make_pin
from polyshard.runtime.eager import ShardedCallable

T = TypeVar("T")


def shard(target: T, in_strategy: Strategy, out_strategy: Sequence | None = None,
          manual_split: Sequence[int] | None = None) -> T:
    """Pin a strategy, MindSpore-style: per input, slices per dim (``((2, 1), (1, 1))``) or axis names.

    A module is returned as is, marked: :func:`polyshard.parallelize` honours the pin (for Linear
    the strategy covers ``(input, weight)``, weight as stored). A function is returned wrapped: it
    runs sharded when called, eagerly, and as a pinned op inside a parallelized model.
    ``manual_split`` (an ``nn.Embedding``'s, MindSpore's Gather option): the table's rows per piece where
    its strategy splits them unevenly, ``(10, 20, 30, 4)`` for 64 rows in 4 pieces; each rank keeps its
    rows, looks up the ids they hold, and the pieces' lookups are summed.
    """
    if isinstance(target, nn.Module):
        if manual_split is not None and not isinstance(target, nn.Embedding):
            raise PolyshardError(f"manual_split splits an embedding table's rows; {type(target).__name__} is "
                                 "not an nn.Embedding")
        setattr(target, PIN_ATTR, make_pin(in_strategy, out_strategy, None, type(target).__name__, manual_split))
        return target
    if manual_split is not None:
        raise PolyshardError("manual_split splits an nn.Embedding's table; pin the module, not a function")
    if callable(target):
        name = getattr(target, "__name__", type(target).__name__)
        return ShardedCallable(target, make_pin(in_strategy, out_strategy, target, name))
    raise PolyshardError(f"shard() takes an nn.Module or a function, not {type(target).__name__}")


__all__ = ["shard"]
