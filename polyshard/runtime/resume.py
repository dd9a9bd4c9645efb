"""What ``polyshard train`` checkpoints beside the model and optimizer (where the data stands, each rank's
random state, the metrics so far), and which checkpoint a run continues from."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from polyshard.data.corpus import TokenBatches
from polyshard.errors import PolyshardError
from polyshard.runtime import checkpoint, training_state

RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"  # torchrun's count of restarts after a failure
METRICS = "metrics.jsonl"
DATA, RNG = "data/position", "rng/rank"


def resume_path(resume: str, save_dir: str) -> Path | None:
    """The checkpoint to continue from: after torchrun restarted the job, the newest in ``save_dir``;
    else (or before the first save) ``resume``'s. Every rank must see the same one."""
    if save_dir and int(os.environ.get(RESTART_ENV, "0")) > 0 and checkpoint.committed(save_dir):
        path = checkpoint.committed(save_dir)[-1]
    else:
        path = checkpoint.resolve(resume, save_dir) if resume else None
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, None if path is None else path.name)
    if len(set(seen)) > 1:
        raise PolyshardError(f"the ranks would resume from different checkpoints ({sorted(set(map(str, seen)))}); "
                             "every machine must see the same --save-dir (a shared filesystem)")
    return path


def save_run(save_dir: str, pm, opt, batches: TokenBatches, step: int, history: list[dict], *, model: str,
             keep: int, async_save: bool, group=None) -> checkpoint.Pending:
    """Checkpoint the run after ``step``: model, optimizer, data position, random states and metrics."""
    metrics = "".join(json.dumps(r) + "\n" for r in history)
    return training_state.save(save_dir, pm, opt, step, keep=keep, async_save=async_save, extra=_extras(batches),
                               files={METRICS: metrics}, info={"model": model}, group=group)


def restore_run(path: Path, pm, opt, batches: TokenBatches) -> tuple[int, list[dict]]:
    """Load a checkpoint into the run; returns its step and the metrics up to it. A rank's random state is
    restored when the checkpoint has that rank (the same world size); the data position always."""
    extra = _extras(batches)
    manifest = training_state.load(path, pm, opt, extra)
    batches.seek(extra[DATA])
    torch.set_rng_state(extra[f"{RNG}{dist.get_rank()}"])
    lines = (path / METRICS).read_text().splitlines() if (path / METRICS).is_file() else []
    return manifest["step"], [json.loads(line) for line in lines]


def _extras(batches: TokenBatches) -> dict[str, torch.Tensor]:
    return {DATA: batches.position(), f"{RNG}{dist.get_rank()}": torch.get_rng_state()}
