"""The closure protocol every torch optimizer's step follows."""

from __future__ import annotations

import torch


def closure_loss(closure) -> torch.Tensor | None:
    """What an optimizer's ``step(closure)`` returns: the loss the closure computes, with gradients on."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
