"""Optimizers by name (the Plan's ``optimizer`` field), and LAMB."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from polyshard.errors import PolyshardError
from polyshard.optim.lamb import Lamb, NormSpec

OPTIMIZER_CLASSES = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD, "lamb": Lamb}


def build_optimizer(name: str, params: Iterable, **kwargs) -> torch.optim.Optimizer:
    """``OPTIMIZER_CLASSES[name](params, **kwargs)``, with an error naming the choices."""
    if name not in OPTIMIZER_CLASSES:
        raise PolyshardError(f"optimizer {name!r} is unknown; choose one of {', '.join(OPTIMIZER_CLASSES)}")
    return OPTIMIZER_CLASSES[name](params, **kwargs)


__all__ = ["Lamb", "NormSpec", "OPTIMIZER_CLASSES", "build_optimizer"]
