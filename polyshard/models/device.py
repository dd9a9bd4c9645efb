"""Models built on a device; on "meta" (shapes only, for planning) without filling their weights."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

_FILLS = frozenset(getattr(torch.Tensor, name) for name in (
    "normal_", "uniform_", "zero_", "fill_", "exponential_", "log_normal_", "cauchy_", "geometric_", "random_",
    "bernoulli_"))


class _SkippedFills(TorchFunctionMode):
    """A meta tensor's in-place fills (nn.init's functions, a tensor's normal_, uniform_, ...) return it as it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")  # nn.init passes its tensor by keyword
        if isinstance(target, torch.Tensor) and target.is_meta and \
                (func in _FILLS or getattr(func, "__module__", None) == "torch.nn.init"):
            return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def building_on(device: str | torch.device) -> Iterator[None]:
    """``torch.device(device)``; on meta, modules' init fills nothing: there is nothing to fill, and torch runs a
    meta tensor's random fill through its Python references (a third of a build of the largest GPTs)."""
    device = torch.device(device)
    with device, (_SkippedFills() if device.type == "meta" else contextlib.nullcontext()):
        yield
