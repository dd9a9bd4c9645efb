"""One optimizer step, shared by every benchmark so each system is timed doing the same work."""

import contextlib

import torch


def train_step(model, opt, x: torch.Tensor, y: torch.Tensor, context=contextlib.nullcontext) -> torch.Tensor:
    """Zero the gradients, forward and backward (inside ``context``), step; returns the loss."""
    opt.zero_grad(set_to_none=True)
    with context():
        loss = model(x, y)
        loss.backward()
    opt.step()
    return loss.detach()
