"""``polyshard train`` flags as a TrainConfig: what the command runs, and what ``k8s`` checks before writing pods."""

from __future__ import annotations

import argparse
import dataclasses

from polyshard.errors import PolyshardError
from polyshard.plan import (OFFLOADS, OPTIMIZERS, PRECISIONS, RECOMPUTE_COMMS, RECOMPUTE_MODES, SCHEDULES,
                            ZERO_LEVELS, chunk_values, most_recompute)
from polyshard.train.options import TrainConfig


def _recompute_modes(text: str) -> tuple[str, ...]:
    """--recompute's modes: one, or one per pipeline chunk."""
    try:
        modes = chunk_values(text, "--recompute")
    except PolyshardError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    bad = [m for m in modes if m not in RECOMPUTE_MODES]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad[0]!r} is not a recompute mode; give one of "
                                         f"{', '.join(RECOMPUTE_MODES)}, or one per pipeline chunk joined by '/'")
    return modes


def _count(text: str) -> int:
    """A count of at least 1 (micro-batches, virtual stages)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


# `train` flags that set a plan field of the same name (and win over a plan file's), as argparse takes them
PLAN_FLAGS = {
    "recompute": dict(type=_recompute_modes, metavar="{none,selective,pointwise,alternate,half,full}[*N][/...]",
                      help="recompute activations in backward instead of storing them: the attention cores "
                      "(selective), every block's ops but its products and attention (pointwise), those and every "
                      "second product by a weight (alternate), every second block (half) or every block (full); in a "
                      "pipeline also one mode per chunk joined by '/', a run of chunks as MODE*N (full/none: the "
                      "first stage recomputes, the second does not; full*3/none)"),
    "recompute_comm": dict(choices=RECOMPUTE_COMMS, help="in recomputed regions, keep the results of collectives "
                           "(default) or issue them again (less memory, more communication)"),
    "offload": dict(choices=OFFLOADS, help="keep the optimizer state and its step on the host, or on disk (streamed "
                    "back each step; crash-safe files under --offload-dir)"),
    "zero": dict(type=int, choices=ZERO_LEVELS, help="optimizer parallel over the data axes: 1 shards optimizer "
                 "state, 2 also gradients (reduce-scatter), 3 also parameters (gathered before use)"),
    "optimizer": dict(choices=OPTIMIZERS, help="optimizer (default adamw); lamb's layer norms are of whole tensors "
                      "however they are split"),
    "precision": dict(choices=PRECISIONS, help="compute and communicate in bf16 or fp16 (with dynamic loss scaling) "
                      "over fp32 master weights and optimizer state (default fp32)"),
    "schedule": dict(choices=SCHEDULES, help="pipeline schedule, with a pp axis in --mesh (e.g. dp=2,pp=2): all "
                     "forwards then all backwards (gpipe), one forward one backward (1f1b, the default), or 1f1b "
                     "over several stages per rank (interleaved)"),
    "micro_batches": dict(type=_count, help="micro-batches each step's batch is cut into for the pipeline"),
    "virtual_stages": dict(type=_count, help="stages per rank under the interleaved schedule (at least 2)"),
}
_FLAG_TYPES = {"str": str, "int": int, "float": float}


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field, with the help, default and type the field declares, and one per plan
    setting it carries."""
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
    for name, options in PLAN_FLAGS.items():
        parser.add_argument("--" + name.replace("_", "-"), **options)


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig that parsed ``train`` flags describe (a mode per chunk sets the plan's stage_recompute,
    one mode clears it)."""
    settings = tuple((name, getattr(args, name)) for name in PLAN_FLAGS if getattr(args, name) is not None)
    modes = dict(settings).pop("recompute", None)
    if modes is not None:
        settings = tuple((n, v) for n, v in settings if n != "recompute") + \
            (("recompute", most_recompute(modes)), ("stage_recompute", modes if len(modes) > 1 else ()))
    return TrainConfig(settings=settings, **{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
                                            if f.name != "settings"})
