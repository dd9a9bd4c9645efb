"""Runs on a pool of ranks: train under one plan, save, continue under another, against the run that never stopped."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from polyshard.runtime.checkpoint import read_full, step_dir
from polyshard.train.config import TrainConfig
from polyshard.train.trainer import train
from polyshard.runtime.training_state import MODEL


def _run(root: Path, name: str, steps: int, save_every: int, resume: str = "", **flags) -> list[float]:
    mesh, settings = flags.pop("mesh"), tuple(flags.pop("settings", {}).items())
    cfg = TrainConfig(model="gpt-tiny", mesh=mesh, steps=steps, batch_size=8, lr=1e-2, log_every=100,
                      metrics=str(root / f"{name}.jsonl"), save_dir=str(root / name), save_every=save_every,
                      resume=resume, settings=settings, **flags)
    return [r["loss"] for r in train(cfg)]


def resume_elsewhere(root: str, first: dict, second: dict, steps: int = 6, saved_at: int = 3) -> dict:
    """Plan ``first`` trains ``steps`` steps, saving at ``saved_at``; plan ``second`` continues from that
    checkpoint. Returns both runs' losses after it and the largest relative gap of the final weights.
    In float64: AdamW turns reassociation noise in a zero gradient (the key bias's) into full-size updates."""
    root = Path(root)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        whole = _run(root, "a", steps, saved_at, **first)
        resumed = _run(root, "b", steps, steps, resume=str(step_dir(root / "a", saved_at)), **second)
    finally:
        torch.set_default_dtype(default)
    gap = None
    if dist.get_rank() == 0:
        a, b = read_full(step_dir(root / "a", steps), MODEL), read_full(step_dir(root / "b", steps), MODEL)
        assert a.keys() == b.keys()
        gap = max(((a[k] - b[k]).abs().max() / a[k].abs().max().clamp_min(1e-30)).item() for k in a)
        shutil.rmtree(root)
    dist.barrier()
    return {"whole": whole[saved_at:], "resumed": resumed[saved_at:], "param_gap": gap}
