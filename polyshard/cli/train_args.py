"""``polyshard train`` flags as a TrainConfig: what the command runs, and what ``k8s`` checks before writing pods."""

from __future__ import annotations

import argparse

# `train` flags that set a plan field of the same name (and win over a plan file's)
PLAN_FLAGS = ("recompute", "recompute_comm", "offload", "zero", "optimizer", "precision", "schedule", "micro_batches",
              "virtual_stages")


def train_config(args: argparse.Namespace):
    """The TrainConfig that parsed ``train`` flags describe."""
    from polyshard.train.config import TrainConfig

    settings = tuple((name, getattr(args, name)) for name in PLAN_FLAGS if getattr(args, name) is not None)
    return TrainConfig(model=args.model, mesh=args.mesh, steps=args.steps, batch_size=args.batch_size, accum=args.accum,
                       lr=args.lr, seed=args.seed, strategies=args.strategies, metrics=args.metrics,
                       log_every=args.log_every, copies=_copies(args.copies), plan=args.plan, auto=args.auto,
                       memory_limit=args.memory_limit, settings=settings, offload_dir=args.offload_dir,
                       timeline=args.timeline, sequence_parallel=args.sequence_parallel, save_dir=args.save_dir,
                       save_every=args.save_every, keep=args.keep, async_save=args.async_save, resume=args.resume,
                       collective_timeout=args.collective_timeout, data=args.data, data_dtype=args.data_dtype,
                       tokenizer=args.tokenizer, image_size=args.image_size)


def _copies(text: str) -> int | str:
    """``--copies`` as TrainConfig takes it: a count, or "auto" (any other word is left for its check to name)."""
    return int(text) if text.isdigit() else text
