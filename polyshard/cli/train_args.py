"""``polyshard train`` flags as a TrainConfig: what the command runs, and what ``k8s`` checks before writing pods."""

from __future__ import annotations

import argparse
import dataclasses

from polyshard.train.config import TrainConfig

# `train` flags that set a plan field of the same name (and win over a plan file's)
PLAN_FLAGS = ("recompute", "recompute_comm", "offload", "zero", "optimizer", "precision", "schedule", "micro_batches",
              "virtual_stages")
_FLAG_TYPES = {"str": str, "int": int, "float": float}


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field, with the help, default and type the field declares."""
    for f in dataclasses.fields(TrainConfig):
        if "help" not in f.metadata:
            continue
        options = dict(f.metadata)
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            parser.add_argument(flag, action="store_true", **options)
        else:
            if "type" not in options:
                options["type"] = _FLAG_TYPES[f.type]
            parser.add_argument(flag, default=f.default, **options)


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig that parsed ``train`` flags describe."""
    settings = tuple((name, getattr(args, name)) for name in PLAN_FLAGS if getattr(args, name) is not None)
    return TrainConfig(settings=settings, **{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
                                            if f.name != "settings"})
