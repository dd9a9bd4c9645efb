"""Models, data and fault injection for the parameter-server tests (module level: every role imports them)."""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from polyshard import models
from polyshard.models.recsys import ClickModel, RecsysConfig, click_batch
from polyshard.runtime.ps.jobs import NamedBatches

CLICKS = RecsysConfig(rows=64, dim=8, fields=4, hidden=16)
GPT = models.CONFIGS["gpt-tiny"]


def click_model() -> ClickModel:
    return ClickModel(CLICKS)


def gpt64() -> torch.nn.Module:
    return models.GPT(GPT).double()


@dataclass(frozen=True)
class Clicks:
    """Worker rows of global click batch ``step``; ``slow`` seconds per batch leaves time to act mid-run."""

    batch_size: int = 8
    slow: float = 0.0

    def __call__(self, step: int, worker: int, workers: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.slow)
        ids, clicks = click_batch(CLICKS, step, self.batch_size, seed=0)
        rows = self.batch_size // workers
        return ids[worker * rows:(worker + 1) * rows], clicks[worker * rows:(worker + 1) * rows]


@dataclass(frozen=True)
class KillOnce:
    """Clicks, except that worker ``by`` at ``step`` sends ``victim`` (a name in roles.json) ``sig``, once per run,
    ``wait`` seconds after it drew that batch (time for the other workers to push theirs)."""

    folder: str
    victim: str
    by: int
    step: int
    slow: float = 0.02
    sig: int = signal.SIGKILL
    wait: float = 0.0

    def __call__(self, step: int, worker: int, workers: int) -> tuple[torch.Tensor, torch.Tensor]:
        marker = Path(self.folder, "killed")
        if worker == self.by and step == self.step and not marker.exists():
            marker.touch()
            time.sleep(self.wait)
            os.kill(pid(self.folder, self.victim), self.sig)
        return Clicks(slow=self.slow)(step, worker, workers)


def pid(folder: str, role: str) -> int:
    """The process that runs ``role`` (e.g. "worker-1") in the run snapshotting into ``folder``."""
    return json.loads(Path(folder, "roles.json").read_text())[role]


def gpt_batches(step: int, worker: int, workers: int) -> tuple[torch.Tensor, torch.Tensor]:
    return NamedBatches("gpt-tiny", 4, seed=0)(step, worker, workers)


def one_device(model_fn, batch_fn, optimizer, steps: int, seed: int = 0):
    """The reference: the same model, seed and global batches trained on one process."""
    torch.manual_seed(seed)
    model = model_fn()
    opt = optimizer(list(model.parameters()))
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = model(*batch_fn(step, 0, 1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return dict(model.named_parameters()), losses
