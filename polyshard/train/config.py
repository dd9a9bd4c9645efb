"""What `polyshard train` is asked to do, checked whole before any process starts.

Flags are checked against each other and the world (``check_config``, also in every rank); then,
in the launching process only, against the model itself on the meta device (``check_against_model``):
strategies pinned and propagated, a plan file met with the graph it is to run, pipeline cuts counted.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import yaml

from polyshard import models
from polyshard.cluster import parse_bytes
from polyshard.data.images import open_images
from polyshard.data.token_file import check_tokens, open_tokens, tokenized
from polyshard.errors import PolyshardError, file_in_the_way
from polyshard.mesh import PIPELINE_AXIS, check_mesh, check_roles, parse_mesh
from polyshard.models.vision import VISION, build_vision, check_image_size
from polyshard.pin import pin_module
from polyshard.plan import Plan
from polyshard.train.options import TrainConfig

DEFAULT_MODEL = "gpt-small"
DEFAULT_BATCH_SIZE = 8


def token_source(cfg: TrainConfig) -> tuple[str, str]:
    """The token file the run reads and its dtype: --data itself, or --data tokenized by --tokenizer."""
    if cfg.tokenizer:
        return tokenized(cfg.data, cfg.tokenizer, str(Path(cfg.metrics).parent / "data"))
    return cfg.data, cfg.data_dtype or "uint16"


def build_model(cfg: TrainConfig, name: str, device: str | torch.device = "cpu", seed: int = 0) -> torch.nn.Module:
    """The model ``name`` as this run trains it (an image model at the run's image size)."""
    if name in VISION:
        return build_vision(name, cfg.image_side, device, seed)
    return models.build(name, device=device, seed=seed, seq_len=cfg.seq_len)


def check_images(path: str, name: str, size: int) -> None:
    """An image set an image model can train on: RGB images of ``size`` pixels a side, labelled as it predicts."""
    images, labels = open_images(path)
    spec = VISION[name]
    if images.shape[1:] != (3, size, size):
        raise PolyshardError(f"--data {path!r} holds images of shape {images.shape[1:]}; {name} at --image-size "
                             f"{size} takes (3, {size}, {size}): pass --image-size {images.shape[-1]} for square RGB "
                             "images")
    if (labels.ndim == 3) != spec.per_pixel:
        raise PolyshardError(f"--data {path!r} has {'masks' if labels.ndim == 3 else 'a class per image'}; {name} "
                             f"predicts {'a class per pixel' if spec.per_pixel else 'one class per image'}")
    sample = np.asarray(labels[0] if labels.ndim == 3 else labels[:1024])  # one mask, or the first classes
    top = int(sample.max())
    if top >= spec.classes or int(sample.min()) < 0:
        raise PolyshardError(f"--data {path!r}: label {top} is outside {name}'s {spec.classes} classes (0 .. "
                             f"{spec.classes - 1})")


def load_plan(path: str, what: str = "--plan") -> Plan:
    """A plan file, read and parsed (errors name the file)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise PolyshardError(f"{what} {path!r} cannot be read: {exc.strerror}") from exc
    try:
        return Plan.from_json(text)
    except PolyshardError as exc:
        raise PolyshardError(f"{what} {path!r}: {exc}") from exc


def check_config(cfg: TrainConfig, world_size: int) -> tuple[TrainConfig, dict[str, int], Plan | None]:
    """Every flag checked against the others and the world; returns the config with its model named (the
    flag's, else the --plan file's, else the default), the mesh shape and the --plan file's plan."""
    plan = load_plan(cfg.plan) if cfg.plan else None
    cfg = _planned_for(_with_model_named(cfg, plan), plan)
    shape = _check_mesh(cfg, plan, world_size)
    _check_image_flags(cfg, shape)
    _check_numbers(cfg)
    settings = {**_plan_settings(plan), **dict(cfg.settings)}
    Plan(op_axes=(), **settings)  # each setting checked by the plan's own rules
    data = 1 if cfg.auto else math.prod(s for n, s in shape.items() if n in (plan.data_axes if plan else ("dp",)))
    if cfg.batch_size % (data * cfg.accum):
        raise PolyshardError(
            f"--batch-size {cfg.batch_size} must split into dp={data} shards x --accum {cfg.accum} micro-batches; "
            f"use a multiple of {data * cfg.accum}"
        )
    rows = cfg.batch_size // data // cfg.accum
    if cfg.copies != "auto" and cfg.copies > rows:
        raise PolyshardError(f"--copies {cfg.copies} needs at least as many rows per micro-batch, which has {rows} "
                             f"(--batch-size {cfg.batch_size} / dp={data} / --accum {cfg.accum})")
    _check_pipeline_flags(cfg, shape, settings, rows)
    _check_memory_flags(cfg, data, settings)
    _check_paths(cfg)
    _check_checkpoint_flags(cfg)
    return cfg, shape, plan


def _with_model_named(cfg: TrainConfig, plan: Plan | None) -> TrainConfig:
    """``cfg`` with its model named and checked: the flag's, else the plan's, else the default."""
    if plan is not None and cfg.model and plan.model and cfg.model != plan.model:
        raise PolyshardError(f"--plan {cfg.plan!r} was made for {plan.model}, not --model {cfg.model}; leave out "
                             f"--model or plan {cfg.model} with `polyshard plan`")
    name = cfg.model or (plan.model if plan is not None else "") or DEFAULT_MODEL
    if name.startswith("hf:"):
        from polyshard.models.hf import config_dict

        config_dict(name[3:])  # names a family, a shipped config or a config.json, or says what does
    elif name.startswith("gpt:"):
        models.config(name)  # a shape: its own errors say which entry is wrong
    elif name not in models.CONFIGS and name not in VISION:
        raise PolyshardError(f"--model {name!r} is unknown; use a name `polyshard models` lists "
                             f"({', '.join([*models.CONFIGS, *VISION])}), a shape such as "
                             "gpt:layers=2,hidden=64,heads=4,seq=32,vocab=256, or hf:<family or config.json>")
    return replace(cfg, model=name)


def _planned_for(cfg: TrainConfig, plan: Plan | None) -> TrainConfig:
    """``cfg`` at the batch, tokens a row and image size the --plan file was made for, where the flags leave them out
    (its layouts, micro-batches and memory were chosen for those); a flag that asks for other ones is refused."""
    if plan is not None:
        accum = max(cfg.accum, 1)  # a bad --accum is refused with the other numbers
        made = {"batch_size": (plan.global_batch * accum, f"{plan.global_batch} rows a step" + (
                    f" (--batch-size {plan.global_batch * accum} at --accum {accum})" if accum > 1 else "")),
                "seq_len": (0 if cfg.vision else plan.seq_len, f"{plan.seq_len} tokens a row"),
                "image_size": (plan.image_size if cfg.vision else 0, f"{plan.image_size} x {plan.image_size} images")}
        for name, (value, words) in made.items():
            given = getattr(cfg, name)
            if value and given is not None and given != value:
                flag = "--" + name.replace("_", "-")
                again = f"--global-batch {given // accum}" if name == "batch_size" else f"{flag} {given}"
                raise PolyshardError(f"--plan {cfg.plan!r} was made for {words}, not {flag} {given}: leave out "
                                     f"{flag}, or plan again with {again}")
            if value:
                cfg = replace(cfg, **{name: value})
    return replace(cfg, batch_size=DEFAULT_BATCH_SIZE) if cfg.batch_size is None else cfg


def _check_image_flags(cfg: TrainConfig, shape: dict[str, int]) -> None:
    """An image model on what it supports: a mesh of dp, h and w (tp too), images it can halve on every tile; the
    size flag of the other kind refused."""
    if cfg.vision and cfg.seq_len is not None:
        raise PolyshardError(f"--seq-len is for token models; {cfg.model} reads images: leave it out (--image-size "
                             "sizes them)")
    if not cfg.vision:
        if cfg.image_size is not None:
            raise PolyshardError(f"--image-size sizes an image model's images; {cfg.model or 'the model'} reads "
                                 f"tokens: use --model {' or '.join(VISION)}, or leave out --image-size")
        if set(shape) & {"h", "w"}:
            raise PolyshardError(f"the mesh's h and w axes split images by height and width; {cfg.model or 'the model'} "
                                 f"reads tokens: use --model {' or '.join(VISION)}")
        return
    unsupported = [flag for flag, on in (("--tokenizer", cfg.tokenizer), ("--sequence-parallel", cfg.sequence_parallel),
                                         ("a pp axis", shape.get(PIPELINE_AXIS, 1) > 1)) if on]
    if unsupported:
        raise PolyshardError(f"{cfg.model} trains on images split by height and width over h and w axes; "
                             f"{unsupported[0]} is for token models: leave it out")
    if cfg.image_side < 1:
        raise PolyshardError(f"--image-size must be a positive number of pixels, got {cfg.image_side}")
    check_image_size(cfg.model, cfg.image_side, {a: n for a, n in shape.items() if a in ("h", "w") and n > 1})


def _check_mesh(cfg: TrainConfig, plan: Plan | None, world_size: int) -> dict[str, int]:
    if cfg.plan and (cfg.mesh or cfg.auto):
        raise PolyshardError("--plan fixes the mesh: leave out --mesh and --auto")
    if cfg.auto and cfg.mesh:
        raise PolyshardError("--auto chooses the mesh: leave out --mesh")
    if plan is not None:
        shape = dict(plan.mesh) or {"dp": world_size}
        check_roles(shape, plan.data_axes or ("dp",), where=f"--plan {cfg.plan!r}: mesh")
        missing = [a for a in plan.data_axes if a not in shape]
        if missing:
            raise PolyshardError(f"--plan {cfg.plan!r}: data axes {missing} are not in its mesh {shape}")
    else:
        shape = parse_mesh(cfg.mesh) if cfg.mesh else {"dp": world_size}
        check_roles(shape, ("dp",), where="--mesh")
    check_mesh(shape, world_size)
    if cfg.sequence_parallel and cfg.plan:
        raise PolyshardError("--plan fixes every layout: leave out --sequence-parallel (or plan with --config sp=1)")
    if cfg.sequence_parallel and not cfg.auto and shape.get("tp", 1) < 2:
        raise PolyshardError("--sequence-parallel splits the sequence over tp: the mesh needs a tp axis of 2 or more")
    if cfg.tp_plan and (cfg.plan or cfg.auto or cfg.memory_limit):
        raise PolyshardError("--tp-plan pins products for the --mesh given; a --plan file, --auto and --memory-limit "
                             "lay them out themselves: leave out --tp-plan or those")
    if cfg.tp_plan and not any(n not in ("dp", PIPELINE_AXIS) and s > 1 for n, s in shape.items()):
        raise PolyshardError(f"--tp-plan splits products over an operator axis, and the mesh {shape} has none; "
                             "add one, e.g. --mesh dp=2,tp=2")
    return shape


def _check_numbers(cfg: TrainConfig) -> None:
    for flag, value in (("--steps", cfg.steps), ("--batch-size", cfg.batch_size), ("--accum", cfg.accum),
                        ("--log-every", cfg.log_every), ("--seq-len", 1 if cfg.seq_len is None else cfg.seq_len)):
        if value < 1:
            raise PolyshardError(f"{flag} must be at least 1, got {value}")
    if cfg.seed < 0:
        raise PolyshardError(f"--seed must be 0 or more, got {cfg.seed}")
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise PolyshardError(f"--lr must be positive and finite, got {cfg.lr}")
    if cfg.copies != "auto" and not (isinstance(cfg.copies, int) and cfg.copies >= 1):
        raise PolyshardError(f"--copies must be a positive integer or 'auto', got '{cfg.copies}'")
    if cfg.memory_limit:
        if not parse_bytes(cfg.memory_limit) > 0:
            raise PolyshardError(f"--memory-limit {cfg.memory_limit!r} must be positive, e.g. 2GiB")
        if cfg.plan:
            raise PolyshardError("--plan is already planned for a memory limit: leave out --memory-limit")


def _check_pipeline_flags(cfg: TrainConfig, shape: dict[str, int], settings: dict, rows: int) -> None:
    """Pipeline flags need a pipeline: without one they would be ignored (or, from a plan, accumulate)."""
    given = dict(cfg.settings)
    pp = shape.get(PIPELINE_AXIS, 1)
    if pp < 2 and not cfg.auto:
        flags = [f for f, on in (("--micro-batches", "micro_batches" in given and not cfg.plan),
                                 ("--schedule", "schedule" in given), ("--virtual-stages", "virtual_stages" in given),
                                 ("--timeline", bool(cfg.timeline))) if on]
        if flags:
            raise PolyshardError(f"{flags[0]} applies to a pipeline, and the mesh has no pp axis of 2 or more; add "
                                 "one (e.g. --mesh dp=1,pp=2)" + ", or use --accum" * (flags[0] == "--micro-batches"))
    if pp > 1 and cfg.copies != 1:
        raise PolyshardError(f"--copies {cfg.copies} interleaves a batch's slices to hide collectives, which a "
                             "pipeline's micro-batches already do; leave out --copies with a pp axis")
    if pp > 1 and rows % settings.get("micro_batches", 1):
        raise PolyshardError(f"--micro-batches {settings['micro_batches']} does not divide the {rows} rows each "
                             "pipeline gets per step; use a divisor of it")
    schedule, virtual = settings.get("schedule", "1f1b"), settings.get("virtual_stages", 1)
    if pp > 1 and schedule == "interleaved" and virtual < 2:
        raise PolyshardError("--schedule interleaved runs 2 or more stages per rank: set --virtual-stages 2 or more")
    if pp > 1 and schedule != "interleaved" and virtual > 1:
        raise PolyshardError(f"--virtual-stages {virtual} applies to --schedule interleaved, not {schedule}")
    modes = settings.get("stage_recompute", ())
    if modes and (cfg.auto or len(modes) != pp * virtual):
        raise PolyshardError(f"--recompute {'/'.join(modes)} gives a mode to each of {len(modes)} pipeline chunks, "
                             + ("and --auto chooses the mesh; give one mode" if cfg.auto else
                                f"and pp={pp} x {virtual} virtual stages make {pp * virtual}; give one mode each"))


def _check_memory_flags(cfg: TrainConfig, data: int, settings: dict) -> None:
    modes = settings.get("stage_recompute") or (settings.get("recompute", "none"),)
    if "recompute_comm" in dict(cfg.settings) and not (cfg.auto or cfg.memory_limit) and \
            all(mode == "none" for mode in modes):
        raise PolyshardError(f"--recompute-comm {settings['recompute_comm']} applies to recomputed regions, and "
                             "nothing is recomputed; add --recompute selective, pointwise, alternate, half or full, or "
                             "leave out --recompute-comm")
    zero, offload, precision = settings.get("zero", 0), settings.get("offload", "none"), settings.get("precision")
    if zero and data < 2 and not cfg.auto:
        raise PolyshardError(f"--zero {zero} shards over the data-parallel ranks, and the mesh has no dp axis of 2 "
                             "or more; add one or leave out --zero")
    if offload != "none" and (zero or precision not in (None, "fp32")):
        other = f"--zero {zero}" if zero else f"--precision {precision}"
        raise PolyshardError(f"--offload {offload} keeps the whole fp32 optimizer state off the device, and {other} "
                             f"changes that state; leave out one of --offload {offload} and {other}")
    if cfg.offload_dir:
        folder = Path(cfg.offload_dir)
        if offload != "disk":
            raise PolyshardError("--offload-dir is where --offload disk keeps its files; add --offload disk or leave "
                                 "out --offload-dir")
        if folder.exists() and not folder.is_dir():
            raise PolyshardError(f"--offload-dir {cfg.offload_dir!r} is a file; name an empty folder")
        if folder.is_dir() and any(folder.iterdir()):
            raise PolyshardError(f"--offload-dir {cfg.offload_dir!r} is not empty; name an empty (or new) folder")


def _check_paths(cfg: TrainConfig) -> None:
    if not cfg.metrics:
        raise PolyshardError("--metrics '' names no file; leave it out to write runs/metrics.jsonl")
    for flag, path in (("--metrics", cfg.metrics), ("--timeline", cfg.timeline)):
        if not path:
            continue
        p = Path(path)
        if p.is_dir():
            raise PolyshardError(f"{flag} {path!r} is a folder; name a file in it")
        blocking = file_in_the_way(str(p.parent))
        if blocking is not None:
            raise PolyshardError(f"{flag} {path!r}: {str(blocking)!r} is a file, not a folder")
    if cfg.strategies and not Path(cfg.strategies).is_file():
        raise PolyshardError(f"--strategies file {cfg.strategies!r} does not exist")
    if cfg.tokenizer and not cfg.data:
        raise PolyshardError("--tokenizer tokenizes the text file --data names: give --data")
    if cfg.data_dtype and (not cfg.data or cfg.tokenizer or cfg.vision):
        raise PolyshardError("--data-dtype is the id type of a token file --data names"
                             + (", and --tokenizer writes its own" if cfg.tokenizer else
                                f", and {cfg.model} reads images" if cfg.vision and cfg.data else "; give --data")
                             + " (or leave out --data-dtype)")
    if cfg.data and cfg.vision:
        check_images(cfg.data, cfg.model, cfg.image_side)
    elif cfg.data:
        open_tokens(*token_source(cfg))


def _check_checkpoint_flags(cfg: TrainConfig) -> None:
    if (cfg.save_every or cfg.keep or cfg.async_save) and not cfg.save_dir:
        raise PolyshardError("--save-every, --keep and --async-save need --save-dir, where checkpoints go")
    if cfg.save_every < 0:
        raise PolyshardError(f"--save-every must be 0 (only at the end) or more steps, got {cfg.save_every}")
    if cfg.keep < 0:
        raise PolyshardError(f"--keep must be 0 (keep all) or more, got {cfg.keep}")
    if cfg.resume and not cfg.save_dir:
        from polyshard.runtime.checkpoint import NEWEST

        if cfg.resume in NEWEST:
            raise PolyshardError(f"--resume {cfg.resume} continues from the newest checkpoint in --save-dir: give "
                                 "--save-dir")
    if not (cfg.collective_timeout >= 0 and math.isfinite(cfg.collective_timeout)):
        raise PolyshardError(f"--collective-timeout must be a number of seconds, 0 or more; "
                             f"got {cfg.collective_timeout}")
    if cfg.save_dir and Path(cfg.save_dir).exists() and not Path(cfg.save_dir).is_dir():
        raise PolyshardError(f"--save-dir {cfg.save_dir!r} is a file; name a folder")


def check_resume(cfg: TrainConfig, name: str, params: dict[str, tuple[int, ...]], optimizer: str) -> None:
    """Before launch: the checkpoint to continue from is whole and of this model and optimizer, and a
    fresh run does not write over another run's checkpoints."""
    from polyshard.runtime import checkpoint
    from polyshard.runtime.training_state import MODEL

    if not cfg.resume:
        if cfg.save_dir and checkpoint.committed(cfg.save_dir):
            raise PolyshardError(f"--save-dir {cfg.save_dir!r} holds another run's checkpoints: continue it with "
                                 "--resume auto, or save into an empty folder")
        return
    path = checkpoint.resolve(cfg.resume, cfg.save_dir)
    if path is None and cfg.resume == "if-any":
        return  # a fresh start
    if path is None:
        raise PolyshardError(f"--resume auto: --save-dir {cfg.save_dir!r} holds no complete checkpoint yet")
    manifest = checkpoint.read_manifest(path)
    saved = checkpoint.tensor_entries(checkpoint.read_metadata(path))
    if manifest.get("model") != name:
        raise PolyshardError(f"checkpoint {path} is of model {manifest.get('model')!r}; this run trains {name!r}")
    for param, shape in params.items():
        if MODEL + param not in saved:
            raise PolyshardError(f"checkpoint {path} has no {param}: it is of another model")
        if saved[MODEL + param][0] != tuple(shape):
            raise PolyshardError(f"checkpoint {path}: {param} is {list(saved[MODEL + param][0])} there and "
                                 f"{list(shape)} in this model (another size or vocabulary)")
    if manifest.get("optimizer") != optimizer:
        raise PolyshardError(f"checkpoint {path} holds {manifest.get('optimizer')} state; this run's optimizer is "
                             f"{optimizer}: resume with --optimizer {manifest.get('optimizer')}")
    if manifest["step"] >= cfg.steps:
        raise PolyshardError(f"checkpoint {path} is at step {manifest['step']}, and --steps {cfg.steps} ends there; "
                             f"raise --steps to train on")


def _plan_settings(plan: Plan | None) -> dict:
    if plan is None:
        return {}
    return {k: getattr(plan, k) for k in ("zero", "offload", "precision", "schedule", "micro_batches",
                                          "virtual_stages", "recompute", "stage_recompute")}


def check_against_model(cfg: TrainConfig, shape: dict[str, int], plan: Plan | None, nodes: int = 1) -> None:
    """On the meta device, before launch: pins fit the model, ``plan`` (the --plan file's) fits its graph,
    stages fit its blocks, and where the ranks will search (--auto, --memory-limit), some split can hold its
    parameters on ``nodes`` machines like this one."""
    from polyshard.cluster import Cluster
    from polyshard.planner.check import check_plan
    from polyshard.graph.capture import capture
    from polyshard.planner.plan_model import pin_tp_plan
    from polyshard.planner.propagate import propagate
    from polyshard.planner.search import refuse_where_nothing_fits
    from polyshard.graph.stage_cuts import block_paths

    model = build_model(cfg, cfg.model, device="meta")
    if cfg.auto or cfg.memory_limit:
        limit = parse_bytes(cfg.memory_limit) if cfg.memory_limit else None
        refuse_where_nothing_fits(model, Cluster.of_machines(nodes, math.prod(shape.values()) // nodes), limit)
    if cfg.data and not cfg.vision:
        check_tokens(open_tokens(*token_source(cfg)), cfg.data, model.cfg.vocab_size, model.cfg.seq_len)
    if cfg.strategies:
        apply_strategies(model, cfg.strategies)
    data_axes = plan.data_axes if plan is not None else ("dp",)
    rows = cfg.batch_size // math.prod(s for n, s in shape.items() if n in data_axes) // cfg.accum
    gm = capture(model, model.example_inputs(max(rows, 1)))
    if plan is not None:
        try:
            check_plan(plan, gm, tuple(shape.items()))
        except PolyshardError as exc:
            raise PolyshardError(f"--plan {cfg.plan!r}: {exc}") from exc
    elif not cfg.auto:
        op_axes = tuple((n, s) for n, s in shape.items() if n not in data_axes and n != PIPELINE_AXIS and s > 1)
        if cfg.tp_plan:  # a model without a plan, or a plan that splits a module no pin can, is refused here
            pin_tp_plan(model, gm, tuple(n for n, _ in op_axes), "--tp-plan", cfg.model)
        propagate(gm, op_axes, lambda msg: None, cfg.sequence_parallel)
    optimizer = dict(cfg.settings).get("optimizer", plan.optimizer if plan is not None else "adamw")
    check_resume(cfg, cfg.model, {n: tuple(p.shape) for n, p in gm.named_parameters()}, optimizer)
    pp, virtual = shape.get(PIPELINE_AXIS, 1), dict(cfg.settings).get("virtual_stages", 1)
    blocks = len(block_paths(gm))
    if pp > 1 and not cfg.plan and pp * virtual > blocks:
        raise PolyshardError(f"pp={pp} x {virtual} virtual stages make {pp * virtual} stages, and "
                             f"{cfg.model} has {blocks} blocks to cut; use fewer stages")


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML that refuses a key given twice (plain YAML keeps the last one in silence)."""

    def construct_mapping(self, node, deep=False):
        keys = [self.construct_object(k, deep=deep) for k, _ in node.value]
        twice = next((k for k in keys if keys.count(k) > 1), None)
        if twice is not None:
            raise PolyshardError(f"{self.name}: {twice!r} is given twice (line {node.start_mark.line + 1}); "
                                 "keep one")
        return super().construct_mapping(node, deep)


_STRATEGY_KEYS = ("in_strategy", "out_strategy", "manual_split")


def read_strategies(path: str) -> dict:
    """A strategies file: module names or globs -> {in_strategy: ..., out_strategy: ..., manual_split: ...}."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise PolyshardError(f"--strategies {path!r} cannot be read: {exc.strerror}") from exc
    loader = _UniqueKeyLoader(text)
    loader.name = path
    try:
        raw = loader.get_single_data()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise PolyshardError(f"{path} is not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    finally:
        loader.dispose()
    if raw is None:
        raise PolyshardError(f"{path} holds no strategies; write NAME_OR_GLOB: {{in_strategy: [[1, 1], [2, 1]]}}")
    if not isinstance(raw, dict):
        raise PolyshardError(f"{path}: expected a mapping of module names to strategies, got a {type(raw).__name__}")
    for pattern, spec in raw.items():
        if not isinstance(spec, dict) or "in_strategy" not in spec or set(spec) - set(_STRATEGY_KEYS):
            raise PolyshardError(f"{path}: entry {pattern!r} needs in_strategy (and optionally out_strategy, or an "
                                 f"embedding's manual_split), got {spec!r}")
    return raw


def apply_strategies(model: torch.nn.Module, path: str) -> list[str]:
    """Pin strategies from YAML: ``module-name-or-glob: {in_strategy: [[1, 1], [2, 1]], out_strategy: ...}``
    (an embedding's rows split unevenly: ``manual_split: [10, 20, 30, 4]``); each module is pinned by one entry."""
    names = dict(model.named_modules())
    by: dict[str, str] = {}
    for pattern, spec in read_strategies(path).items():
        hits = [n for n in names if n and fnmatch.fnmatchcase(n, str(pattern))]
        if not hits:
            leaves = [n for n, m in names.items() if n and not any(m.children())]
            raise PolyshardError(f"{path}: {pattern!r} matches no module; names look like "
                                 f"{', '.join(leaves[:3])}")
        for name in hits:
            if name in by:
                raise PolyshardError(f"{path}: module {name} is pinned by both {by[name]!r} and {pattern!r}; "
                                     "make the patterns disjoint")
            by[name] = str(pattern)
            try:
                pin_module(names[name], _tuples(spec["in_strategy"]), _tuples(spec.get("out_strategy")),
                           _tuples(spec.get("manual_split")))
            except PolyshardError as exc:
                raise PolyshardError(f"{path}: module {name}: {exc}") from exc
    return list(by)


def _tuples(value):
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value
