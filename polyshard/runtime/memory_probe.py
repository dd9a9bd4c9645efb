"""Measured device memory of a training step, to hold the planner's estimate against.

torch's MemTracker follows every tensor's storage through a step and splits the peak into
parameters, gradients, optimizer state, activations and temporaries. On a CPU-only machine it
counts what a device would hold: forward and backward, plus the optimizer step only when the
optimizer state lives on the device (with offload, the step runs on the host).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker


def step_peak_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, batch, state_on_device: bool = True,
                    micro_batches: int = 1) -> dict:
    """Peak bytes by category (and "total") over one training step of ``model`` on ``batch`` (run as
    ``micro_batches`` accumulated micro-batches), after one untracked step so the optimizer state
    exists as it does in training."""
    def step(tracked: bool):
        for micro in zip(*(t.chunk(micro_batches) for t in batch)):
            (model(*micro) / micro_batches).backward()
            if tracked:
                tracker.reset_mod_stats()  # per-module figures only: the peak per device is kept
        if not tracked or state_on_device:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    tracker = MemTracker()
    step(tracked=False)
    tracker.track_external(model, *([optimizer] if state_on_device else []))
    with tracker:
        step(tracked=True)
    if not state_on_device:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()), {})
    return {str(getattr(k, "value", k)).lower(): v for k, v in peak.items()}
