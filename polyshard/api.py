"""The semi-auto entry point: ``shard`` pins a strategy on a module or a function."""

from __future__ import annotations

from typing import Sequence, TypeVar

from torch import nn

from polyshard.errors import PolyshardError
from polyshard.graph.capture import PIN_ATTR
from polyshard.pin import Strategy, make_pin
from polyshard.runtime.eager import ShardedCallable

T = TypeVar("T")


def shard(target: T, in_strategy: Strategy, out_strategy: Sequence | None = None) -> T:
    """Pin a strategy, MindSpore-style: per input, slices per dim (``((2, 1), (1, 1))``) or axis names.

    A module is returned as is, marked: :func:`polyshard.parallelize` honours the pin (for Linear
    the strategy covers ``(input, weight)``, weight as stored). A function is returned wrapped: it
    runs sharded when called, eagerly, and as a pinned op inside a parallelized model.
    """
    if isinstance(target, nn.Module):
        setattr(target, PIN_ATTR, make_pin(in_strategy, out_strategy, None, type(target).__name__))
        return target
    if callable(target):
        name = getattr(target, "__name__", type(target).__name__)
        return ShardedCallable(target, make_pin(in_strategy, out_strategy, target, name))
    raise PolyshardError(f"shard() takes an nn.Module or a function, not {type(target).__name__}")


__all__ = ["shard"]
