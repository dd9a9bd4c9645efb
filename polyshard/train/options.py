"""What one ``polyshard train`` run is asked to do (:class:`TrainConfig`), with each flag's help: importable without
torch, as the command line's parser reads it before anything runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


def _flag(default, help: str, **argparse_options):
    """A TrainConfig field with its ``polyshard train`` flag's help: each option is described once, here."""
    return field(default=default, metadata={"help": help, **argparse_options})


def _copies(text: str) -> int | str:
    """``--copies`` as TrainConfig takes it: a count, or "auto" (any other word is left for its check to name)."""
    return int(text) if text.isdigit() else text


@dataclass(frozen=True)
class TrainConfig:
    """What one ``polyshard train`` run is asked to do; every field but ``settings`` is the flag of its name."""

    model: str = _flag("", "model name (see `polyshard models`; default: the --plan's, else gpt-small), or "
                       "hf:FAMILY (e.g. hf:llama, a tiny transformers model), hf:CONFIG.json or hf:DIR with "
                       "config.json and safetensors weights, or an image model (unet-small segments, resnet-small "
                       "classifies; images generated on the fly, split by height and width over h and w axes of "
                       "--mesh)")
    mesh: str = _flag("", "named mesh, e.g. dp=2,tp=2 (default: dp=NPROC); 'dp' splits batches, other axes split "
                      "operators")
    sequence_parallel: bool = _flag(False, "with a tp axis: row-parallel products reduce-scatter along the sequence "
                                    "instead of all-reducing, so norms, dropout and residual adds run on a slice of "
                                    "it and hold a slice of their activations (Megatron's sequence parallel)")
    steps: int = _flag(50, "optimizer steps (default %(default)s)")
    batch_size: int | None = _flag(None, "global batch rows per step (default: the --plan file's, else 8)", type=int)
    seq_len: int | None = _flag(None, "tokens per row of a token model (default: the --plan file's, else the model's "
                                "own; a transformers config's longest, at most 2048)", type=int)
    accum: int = _flag(1, "gradient accumulation micro-steps per step (default %(default)s)")
    lr: float = _flag(3e-3, "AdamW learning rate (default %(default)s)")
    seed: int = _flag(0, "seed for weights and data (default %(default)s)")
    strategies: str = _flag("", "YAML of per-module pins: NAME_OR_GLOB: {in_strategy: [[1,1],[2,1]]}")
    tp_plan: bool = _flag(False, "pin the products a transformers model's own tensor-parallel plan names (its "
                          "_tp_plan: colwise, rowwise, ...) over the mesh's operator axes; the rest follows the rules")
    metrics: str = _flag("runs/metrics.jsonl", "JSON-lines metrics path (default %(default)s)")
    log_every: int = _flag(10, "print a line every N steps (default %(default)s)")
    copies: int | Literal["auto"] = _flag(1, "run each micro-batch as N interleaved copies so collectives overlap "
                                          "compute; 'auto' lets the cost model choose (default 1)", type=_copies)
    plan: str = _flag("", "run this plan file (from `polyshard plan`, or edited by hand)")
    auto: bool = _flag(False, "search the best plan for the processes at hand, then train")
    memory_limit: str = _flag("", "bytes per device, e.g. 2GiB: the planner keeps the run under it, choosing "
                              "layouts, recompute and offload (for the --mesh given, or every mesh with --auto)")
    settings: tuple[tuple[str, object], ...] = ()  # plan fields set from flags (--recompute, ...), over the plan's
    offload_dir: str = _flag("", "empty folder for disk offload's files (default: a temporary one, removed after "
                             "the run)")
    timeline: str = _flag("", "with a pipeline: draw the last step's schedule, measured beside predicted, into this "
                          "PNG")
    save_dir: str = _flag("", "save checkpoints here (torch.distributed.checkpoint; any later plan or device count "
                          "can load them), every --save-every steps and at the end")
    save_every: int = _flag(0, "steps between checkpoints (with --save-dir; default 0: only at the end)")
    keep: int = _flag(0, "leave only the newest K checkpoints (default 0: all)")
    async_save: bool = _flag(False, "write checkpoints in the background while training goes on (the state is "
                             "copied first)")
    resume: str = _flag("", "continue from a checkpoint: 'auto' (the newest in --save-dir), 'if-any' (that, or a "
                        "fresh start where there is none: what a restarted pod runs) or its directory; the plan and "
                        "device count may differ from the run that saved it")
    collective_timeout: float = _flag(0.0, "seconds a training step's collective waits for a silent process before "
                                      "the run fails, naming it (default 0: torch's, 30 minutes, which "
                                      "start-up always keeps)")
    data: str = _flag("", "a token file to train on: uint16 (or --data-dtype uint32) ids, as nanoGPT's prepare.py "
                      "writes, or a folder `datasets` saved (its input_ids rows end to end); each data-parallel rank "
                      "reads only its rows' windows (default: the pydoc corpus, byte tokens); with an image model, "
                      "an (N, C, H, W) .npy of images beside NAME.labels.npy, or a folder of image files "
                      "(ROOT/CLASS/FILE, or ROOT/images/ beside ROOT/masks/), of which a rank reads only its rows "
                      "and tile")
    data_dtype: str = _flag("", "the --data token file's id type (default uint16)", choices=("uint16", "uint32"))
    tokenizer: str = _flag("", "a tokenizer.json (or a folder with one, e.g. a transformers model's): --data is then "
                           "a text file (or a saved dataset's text rows), tokenized once into runs/data/ beside the "
                           "metrics")
    image_size: int | None = _flag(None, "with an image model: square images of N pixels (default: the --plan "
                                   "file's, else 64)", type=int)

    @property
    def vision(self) -> bool:
        from polyshard.models.vision import VISION  # the image models (torch): read once a run is checked
        return self.model in VISION

    @property
    def image_side(self) -> int:
        from polyshard.models.vision import DEFAULT_IMAGE_SIZE
        return DEFAULT_IMAGE_SIZE if self.image_size is None else self.image_size
