"""The training loop behind ``polyshard train``: data slicing, accumulation, progress, metrics."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import os
import resource
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from polyshard.api import parallelize
from polyshard.cluster import Cluster, parse_bytes
from polyshard.plan import recompute_text
from polyshard.planner.config import Fixed
from polyshard.planner.report import render
from polyshard.planner.search import search
from polyshard.planner.stages import predict_timings
from polyshard.schedule import ActionTime
from polyshard.data.ahead import Ahead
from polyshard.data.corpus import TokenBatches, load_corpus
from polyshard.data.images import ImageBatches, open_images
from polyshard.data.synthetic_images import SyntheticImages
from polyshard.data.token_file import open_tokens, out_of_vocabulary
from polyshard.errors import PolyshardError
from polyshard.mesh import init
from polyshard.models.vision import VISION, dataset_strategy, image_meshes
from polyshard.optim import OPTIMIZER_CLASSES, build_optimizer
from polyshard.runtime.offload import OffloadedOptimizer
from polyshard.runtime.parallel import ParallelModule
from polyshard.runtime.pipeline import PipelineModule
from polyshard.runtime.resume import restore_run, resume_path, save_run
from polyshard.runtime.signals import StopRequest, Stopped, stops_noted
from polyshard.runtime.stall import is_timeout, stalled, time_out_collectives
from polyshard.runtime.timeline import draw_timeline
from polyshard.train.config import (
    TrainConfig, apply_strategies, build_model, check_config, token_source,
)
from polyshard.runtime.zero import ZeroOptimizer, setup_zero


def train(cfg: TrainConfig) -> list[dict]:
    """Train on --data, or the corpus shipped with Python; rank 0 prints, shows progress and writes metrics."""
    from tqdm import tqdm

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg, shape, plan = check_config(cfg, world)
    if cfg.auto or cfg.memory_limit:  # --auto: every mesh; --memory-limit alone: the mesh given
        meta = build_model(cfg, cfg.model, device="meta")
        limit = parse_bytes(cfg.memory_limit) if cfg.memory_limit else None
        meshes = [tuple(shape.items())] if not cfg.auto else \
            image_meshes(cfg.model, cfg.image_side, world, cfg.batch_size // cfg.accum) if cfg.vision else None
        plan, _ = search(meta, meta.example_inputs(1), Cluster.from_env(), cfg.batch_size // cfg.accum, limit,
                         meshes=meshes, fixed=Fixed(sp=1) if cfg.sequence_parallel else Fixed(),
                         dataset_strategy=dataset_strategy(cfg.model) if cfg.vision else None)
        made_for = {"image_size": cfg.image_side} if cfg.vision else {"seq_len": meta.cfg.seq_len}
        plan, shape = dataclasses.replace(plan, model=cfg.model, **made_for), dict(plan.mesh)
    if plan is not None and cfg.settings:
        plan = dataclasses.replace(plan, **dict(cfg.settings))
    mesh = init(shape)
    lead = dist.get_rank() == 0
    model = build_model(cfg, cfg.model, seed=cfg.seed)
    pinned = apply_strategies(model, cfg.strategies) if cfg.strategies else []
    # without a pipeline, a plan's micro-batches are gradient accumulation, on top of --accum
    accum = cfg.accum * (plan.micro_batches if plan is not None and mesh.pp == 1 else 1)
    micro = cfg.batch_size // mesh.num_data_shards // accum
    if cfg.batch_size % (mesh.num_data_shards * accum):
        raise PolyshardError(f"the mesh {mesh} does not split --batch-size {cfg.batch_size} into {accum} "
                             f"accumulated micro-batches per data-parallel rank")
    settings = dict(cfg.settings)
    pm = parallelize(model, example_inputs=model.example_inputs(micro), copies=cfg.copies, plan=plan,
                        sequence_parallel=cfg.sequence_parallel, tp_plan=cfg.tp_plan,
                        dataset_strategy=image_strategy(cfg, mesh) if plan is None else None,  # a plan has its own
                        settings=settings)
    pipelined = isinstance(pm, PipelineModule)
    if lead:
        if cfg.auto or cfg.memory_limit:
            print(render(pm.plan, layouts=0))
            planned = Path(cfg.metrics).parent / "plan.json"
            planned.parent.mkdir(parents=True, exist_ok=True)
            planned.write_text(pm.plan.to_json())
            print(f"plan: {planned} (train it again with --plan {planned})")
        nodes = f" on {mesh.cluster.num_nodes} machines" if mesh.cluster and mesh.cluster.num_nodes > 1 else ""
        where = f"on {mesh.device}" if mesh.device_type == "cuda" else f"{torch.get_num_threads()} thread each"
        print(f"mesh: {mesh}  ({world} processes{nodes}, {where})")
        if pm.plan.copies > 1 or cfg.copies == "auto":
            print(f"multi-copy: each micro-batch runs as {pm.plan.copies} interleaved copies")
        if pipelined:
            print(f"pipeline: {mesh.pp} stages from {', '.join(pm.plan.stage_boundaries)}; schedule "
                  f"{pm.plan.schedule}, {pm.plan.micro_batches} micro-batches, {pm.plan.virtual_stages} per rank")
        if pm.plan.recompute != "none" or pm.plan.offload != "none":
            print(f"memory: recompute {recompute_text(pm.plan.recompute, pm.plan.stage_recompute)} "
                  f"(collectives: {pm.plan.recompute_comm}), "
                  f"optimizer state offload: {pm.plan.offload}")
        print(f"optimizer: {pm.plan.optimizer}, optimizer parallel level {pm.plan.zero}, precision {pm.plan.precision}")
        if pm.plan.sequence_parallel:
            print("sequence parallel: row-parallel products reduce-scatter along the sequence")
        if pinned:
            print(f"pinned from {cfg.strategies}: {', '.join(pinned)}")
        print("parameter layouts:\n" + pm.plan.summary())
    scratch = (tempfile.TemporaryDirectory(prefix="polyshard-offload-")
               if pm.plan.offload == "disk" and not cfg.offload_dir else None)  # only disk offload writes files
    opt = make_optimizer(pm, cfg.lr, cfg.offload_dir or (scratch.name if scratch else ""))
    reads = not pipelined or pm.reads_batch  # a middle pipeline stage reads nothing
    batches = Ahead(batch_source(cfg, model, mesh, reads))
    unit, per_step = ("images", cfg.batch_size) if cfg.vision else ("tokens", cfg.batch_size * model.cfg.seq_len)
    done, history = 0, []
    resumed = resume_path(cfg.resume, cfg.save_dir)
    if resumed is not None:
        done, history = restore_run(resumed, pm, opt, batches)
        if lead:
            print(f"resumed from {resumed} (step {done})")
    metrics_file = _open_metrics(cfg.metrics, history) if lead else None
    if cfg.collective_timeout:  # the steps' collectives; a background save's group keeps torch's
        time_out_collectives(cfg.collective_timeout)
    save_group = dist.new_group(backend="gloo") if cfg.async_save else None
    pending = None
    bar = tqdm(total=cfg.steps, initial=done, disable=not lead, unit="step", dynamic_ncols=True)
    start = time.perf_counter() - (history[-1]["elapsed_s"] if history else 0.0)
    stopping = 0
    with stops_noted() if cfg.save_dir else contextlib.nullcontext() as noted:
        for step in range(done + 1, cfg.steps + 1):
            t0 = time.perf_counter()
            x, y = next(batches)
            data_s = time.perf_counter() - t0
            if cfg.data and not cfg.vision and int(y.max()) >= model.cfg.vocab_size:
                raise PolyshardError(out_of_vocabulary(cfg.data, int(y.max()), model.cfg.vocab_size))
            x, y = x.to(mesh.device, non_blocking=True), y.to(mesh.device, non_blocking=True)
            try:
                timed = pipelined and bool(cfg.timeline) and step == cfg.steps
                loss_sum = train_step(pm, opt, x, y, accum, record=timed)
                if mesh.data_group() is not None:
                    dist.all_reduce(loss_sum, group=mesh.data_group())
                    loss_sum /= mesh.num_data_shards
            except RuntimeError as exc:
                if cfg.collective_timeout and is_timeout(exc):
                    raise stalled(exc, step, cfg.collective_timeout) from exc
                raise
            if not math.isfinite(loss_sum.item()):
                raise PolyshardError(f"loss became {loss_sum.item()} at step {step}; lower --lr (now {cfg.lr})")
            step_s = time.perf_counter() - t0
            record = {"step": step, "loss": round(loss_sum.item(), 6), f"{unit}_per_s": round(per_step / step_s, 1),
                      "step_s": round(step_s, 4), "data_s": round(data_s, 4),
                      "elapsed_s": round(time.perf_counter() - start, 3), "peak_rss_bytes": peak_rss_bytes(),
                      **comm_counts(pm)}
            history.append(record)
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.4f}", **{f"{unit[:3]}_s": f"{record[f'{unit}_per_s']:.0f}"})
            if metrics_file:
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()
            if lead and (step % cfg.log_every == 0 or step == cfg.steps):
                bar.write(f"step {step:>5}  loss {record['loss']:.4f}  {record[f'{unit}_per_s']:.0f} {unit}/s")
            # a stop any rank was asked for (SIGTERM, Ctrl-C) ends the run on all after this step, saved first
            stopping = _stop_agreed(noted, mesh.device) if noted else 0
            if cfg.save_dir and ((cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps or stopping):
                if pending is not None:
                    _committed(pending.wait(), lead, bar)
                pending = save_run(cfg.save_dir, pm, opt, batches, step, history, model=cfg.model, keep=cfg.keep,
                                   async_save=cfg.async_save, group=save_group)
                if not cfg.async_save:
                    _committed(pending.wait(), lead, bar)
                    pending = None
            if stopping:
                break
    if pending is not None:
        _committed(pending.wait(), lead, bar)
    batches.close()
    bar.close()
    if stopping:
        if metrics_file:
            metrics_file.close()
        raise Stopped(stopping, "every rank", then=f" after step {step}")
    if pipelined and cfg.timeline:
        draw_measured_timeline(pm, cfg.timeline, partial(predicted_timings, cfg, cfg.model, pm.plan, micro, mesh))
    if lead and isinstance(opt, OffloadedOptimizer):
        print(f"where training state lives (rank 0, {pm.plan.offload} offload):\n{opt.ledger()}")
    if metrics_file:
        metrics_file.close()
        print(f"metrics: {cfg.metrics}")
    del pm, opt, model
    gc.collect()
    if scratch is not None:
        scratch.cleanup()
    dist.barrier()
    return history


def _stop_agreed(noted: StopRequest, device: torch.device) -> int:
    """The signal any rank has noted (0: none), the same on every rank: all stop after the same step."""
    signum = torch.tensor([noted.signum], device=device)
    dist.all_reduce(signum, op=dist.ReduceOp.MAX)
    return int(signum.item())


def batch_source(cfg: TrainConfig, model, mesh, reads: bool = True):
    """This rank's batches, seeded alike on every rank: its rows of each global batch and, of images split by
    height and width, its tile; generated images by default, the pydoc corpus for token models."""
    share = cfg.batch_size // mesh.num_data_shards
    mine = slice(mesh.data_index * share, (mesh.data_index + 1) * share)
    if not cfg.vision:
        source = open_tokens(*token_source(cfg)) if cfg.data else load_corpus()
        return TokenBatches(source, cfg.batch_size, model.cfg.seq_len, cfg.seed, rows=mine, read=reads)
    tile = tuple(_tile(mesh, axis, cfg.image_side) for axis in ("h", "w"))
    if cfg.data:
        return ImageBatches(*open_images(cfg.data), cfg.batch_size, cfg.seed, rows=mine, tile=tile)
    spec = VISION[cfg.model]
    return SyntheticImages(cfg.image_side, spec.classes, cfg.batch_size, cfg.seed, spec.per_pixel, rows=mine, tile=tile)


def image_strategy(cfg: TrainConfig, mesh) -> tuple | None:
    """How an image model's inputs lie over the mesh, if it splits images at all."""
    if not cfg.vision or all(dict(mesh.axes).get(a, 1) == 1 for a in ("h", "w")):
        return None
    axes = dict(mesh.axes)
    return tuple(None if s is None else tuple(d if d is None or axes.get(d, 1) > 1 else None for d in s)
                 for s in dataset_strategy(cfg.model))


def _tile(mesh, axis: str, size: int) -> slice:
    n = dict(mesh.axes).get(axis, 1)
    i = mesh.coords().get(axis, 0)
    return slice(i * size // n, (i + 1) * size // n)


def train_step(pm: ParallelModule | PipelineModule, opt, x: torch.Tensor, y: torch.Tensor, accum: int = 1,
               record: bool = False) -> torch.Tensor:
    """One optimizer step on this rank's rows in ``accum`` accumulated micro-steps (gradients synced in
    the last); returns this rank's mean loss. ``record``: a pipeline keeps the last micro-step's timings."""
    loss_sum = torch.zeros((), device=pm.mesh.device)
    for i, (mx, my) in enumerate(zip(x.chunk(accum), y.chunk(accum))):
        last = i == accum - 1
        with (pm.no_sync() if not last else contextlib.nullcontext()):
            loss = pm.train_step(mx, my, scale=1 / accum, record=record and last) / accum
        loss_sum += loss.detach().float()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss_sum


def make_optimizer(pm: ParallelModule, lr: float, offload_dir: str) -> torch.optim.Optimizer | ZeroOptimizer:
    """The plan's optimizer over this rank's parameters: plain torch when nothing else is asked; with
    optimizer parallel, mixed precision or LAMB, polyshard's ZeroOptimizer (it takes over the data-
    parallel sync); with offload, its state and step on the host or disk."""
    plan = pm.plan
    if plan.offload != "none":
        if plan.zero or plan.precision != "fp32":
            raise PolyshardError(f"offload {plan.offload!r} keeps whole fp32 optimizer state off the device; "
                                 f"it does not combine with zero {plan.zero} or precision {plan.precision!r}: "
                                 "drop one of them")
        path = Path(offload_dir) / f"rank{dist.get_rank()}" if plan.offload == "disk" else None
        return OffloadedOptimizer(pm.parameters(), OPTIMIZER_CLASSES[plan.optimizer], mode=plan.offload, path=path,
                                  lr=lr)
    if plan.zero or plan.precision != "fp32" or plan.optimizer == "lamb":
        return setup_zero(pm, lr=lr)
    return build_optimizer(plan.optimizer, pm.parameters(), lr=lr)


def comm_counts(pm: ParallelModule | PipelineModule) -> dict[str, int]:
    """Collectives the gradient syncs issued since the last call, and their bytes, by kind."""
    return pm.grad_sync.comm.take() if pm.grad_sync is not None else {}


def draw_measured_timeline(pm: PipelineModule, path: str, predicted: Callable[[], list[ActionTime]]) -> None:
    """The last step's schedule as each stage ran it, beside the cost model's (``predicted``), into the PNG
    ``path`` (drawn on rank 0; every rank takes part in gathering the timings)."""
    measured = pm.gather_timings()
    if dist.get_rank() == 0:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        bubbles = draw_timeline(path, predicted=predicted(), measured=measured,
                                title=f"{pm.plan.schedule}, {pm.mesh.pp} stages, {pm.plan.micro_batches} micro-batches")
        print(f"timeline: {path} (bubble: measured {bubbles['measured']:.1%}, predicted {bubbles['predicted']:.1%})")


def predicted_timings(cfg: TrainConfig, name: str, plan, micro: int, mesh) -> list[ActionTime]:
    """The cost model's schedule for ``plan``, on the model built again on the meta device."""
    meta = build_model(cfg, name, device="meta")
    if cfg.strategies:
        apply_strategies(meta, cfg.strategies)
    return predict_timings(meta, meta.example_inputs(micro), plan, mesh.pp, mesh.cluster or Cluster.from_env())


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _committed(path: Path, lead: bool, bar) -> None:
    if lead:
        bar.write(f"checkpoint: {path}")


def _open_metrics(path: str, history: list[dict]):
    """The metrics file, holding ``history`` (a resumed run's records so far) and open to append."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.exists() and not history:
        print(f"metrics: replacing {path}, an earlier run's")
    f = p.open("w")
    f.writelines(json.dumps(r) + "\n" for r in history)
    f.flush()
    return f
