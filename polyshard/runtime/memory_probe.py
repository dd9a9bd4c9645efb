"""Measured device memory of a training step, to hold the planner's estimate against.

torch's MemTracker follows every tensor's storage through a step and splits the peak into
parameters, gradients, optimizer state, activations and temporaries. On a CPU-only machine it
counts what a device would hold: forward and backward, plus the optimizer step only when the
optimizer state lives on the device (with offload, the step runs on the host).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker


class _Tracker(MemTracker):
    """MemTracker that lets a root module run forward more than once a step (micro-batches, a pipeline's
    chunks): its per-module figures start over then, the peak per device is kept."""

    def _pre_fw_hook(self, module: nn.Module, inputs) -> None:
        name = self._mod_tracker.get_known_fqn(module)
        if module in self.memory_tracking and not self._mod_tracker.is_bw and \
                set(self._mod_tracker.parents) - {name} == {"Global"}:
            self.reset_mod_stats()
        super()._pre_fw_hook(module, inputs)


def step_peak_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, batch, state_on_device: bool = True,
                    micro_batches: int = 1) -> dict:
    """Peak bytes by category (and "total") over one training step of ``model`` on ``batch`` (run as
    ``micro_batches`` accumulated micro-batches), after one untracked step so the optimizer state
    exists as it does in training."""
    def forward_backward():
        for micro in zip(*(t.chunk(micro_batches) for t in batch)):
            (model(*micro) / micro_batches).backward()

    return peak_bytes(model, optimizer, forward_backward, state_on_device)


def peak_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, forward_backward: Callable[[], None],
               state_on_device: bool = True) -> dict:
    """Peak bytes by category (and "total") over one step of ``forward_backward`` (which leaves gradients in
    ``model``, e.g. a pipeline's ``train_step``) and the optimizer step, after one untracked step."""
    def step(tracked: bool):
        forward_backward()
        if not tracked or state_on_device:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    tracker = _Tracker()
    step(tracked=False)
    tracker.track_external(model, *([optimizer] if state_on_device else []))
    with tracker:
        step(tracked=True)
    if not state_on_device:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()), {})
    return {str(getattr(k, "value", k)).lower(): v for k, v in peak.items()}
