"""``polyshard``: train, launch scripts, list models. Multi-process work goes through torchrun."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import math
import os
import sys
import traceback
from pathlib import Path
from typing import Callable

from polyshard.cli.calibrate import add_parser as add_calibrate
from polyshard.cli.k8s import add_parser as add_k8s
from polyshard.cli.launch import (ERRORS_ENV, LAUNCH_FLAGS, SAVE_STOP_GRACE_S, STOP_GRACE_S, STOPS_ENV, check_nodes,
                                  launch, reach_rendezvous, say_stopped, under_torchrun, without_flag)
from polyshard.cli.ps import add_parser as add_ps
from polyshard.cli.train_args import add_config_flags, train_config
from polyshard.errors import PolyshardError, check_output_file, file_in_the_way
from polyshard.runtime.signals import Stopped


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what the launched ranks are given
    args.parser = parser  # for commands that check the flags of another (k8s)
    try:
        return args.handler(args)
    except Stopped as exc:
        if os.environ.get(STOPS_ENV):  # a rank `launch` started: the launcher says it, and restarts nothing
            say_stopped(os.environ[STOPS_ENV], exc)
        elif os.environ.get("RANK", "0") == "0":  # of a job's ranks, the first says it
            print(f"\npolyshard: {exc}{exc.then}", file=sys.stderr)
        return 128 + exc.signum  # as a shell reports a command a signal ended
    except PolyshardError as exc:
        if args.debug:
            traceback.print_exc()
        errors = os.environ.get(ERRORS_ENV)
        if errors and not args.debug:  # a rank `launch` started: it says it once for all ranks
            Path(errors, f"rank{os.environ.get('RANK', '0')}").write_text(str(exc))
        else:
            print(f"polyshard: error: {exc}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="polyshard", description="Train one PyTorch model across many devices.")
    p.add_argument("--debug", action="store_true", help="with an error, also print where in polyshard it was raised")
    sub = p.add_subparsers(required=True, metavar="COMMAND")

    t = sub.add_parser("train", help="train a model across N processes (by default a GPT on text shipped with Python)",
                       description="Train a model from polyshard.models or transformers on --data, by default on the "
                                   "pydoc corpus every Python install has.")
    add_config_flags(t)
    for flag, options in LAUNCH_FLAGS.items():
        t.add_argument(flag, **options)
    t.set_defaults(handler=_train)

    pl = sub.add_parser("plan", help="choose how to split a model over a cluster (prints it, can write it)",
                        description="Search every dp x pp x tp split of the cluster's devices and, within each, every "
                                    "operator's strategy (an integer program), micro-batches, schedule, optimizer "
                                    "parallel level, precision, recompute and offload, under a per-device memory "
                                    "limit.")
    _planning_flags(pl)
    pl.add_argument("--config", default="", help="settings the plan must keep, the rest searched: e.g. "
                    "'tp=8,pp=16' (keys: dp tp pp h w sp mbs m schedule v zero recompute recompute_comm "
                    "precision offload cuts overlap bucket tp_split tp_comm)")
    pl.add_argument("--out", default="", help="write the plan here as JSON")
    pl.set_defaults(handler=_plan)

    co = sub.add_parser("cost", help="price a given configuration with the planner's cost model",
                        description="Predict the step time and memory of one configuration (the keys left out are "
                                    "chosen by the search, and the output says what it chose), with the same "
                                    "breakdown as `polyshard plan`; --json for scripts.")
    _planning_flags(co)
    co.add_argument("--config", required=True, help="e.g. 'dp=8,tp=8,pp=16,mbs=1,schedule=interleaved,v=2,zero=1,"
                    "recompute=full,precision=bf16'; recompute=full/none gives each pipeline chunk its own mode "
                    "(full*3/none: a run of 3 chunks); "
                    "cuts=even places equal block counts on the stages, as Megatron-LM does; tp_split=rows/ops "
                    "says what each pipeline chunk's tp ranks split (rows: the chunk's weights whole, each rank a "
                    "share of every micro-batch); tp_comm=all_reduce keeps every value between the split products "
                    "whole on each rank, all-reduced (Megatron-LM's tensor parallel before sequence parallel)")
    co.add_argument("--out", default="", help="write the priced plan here as JSON")
    co.add_argument("--compare", action="store_true", help="also search with nothing fixed and show the pick beside "
                    "this configuration, term by term")
    co.set_defaults(handler=_plan)

    ex = sub.add_parser("explain", help="show a plan file again, with why its choice won",
                        description="Print a plan file: candidates, the choice and its runner-up, memory, layouts.")
    ex.add_argument("plan", help="plan JSON file")
    _listing_flags(ex)
    ex.add_argument("--timeline", default="", help="for a pipelined plan: draw its predicted schedule (which stage "
                    "runs which micro-batch's forward and backward, when) into this PNG")
    ex.add_argument("--cluster", default="", help="time the timeline with the cost model's compute on this cluster "
                    "(NODESxDEVICESxTYPE, cpu-gloo:N or a YAML file) instead of the plan's predicted stage times")
    ex.add_argument("--beside", default="", help="another plan file of the same model, batch and devices (e.g. your "
                    "configuration from `polyshard cost --config ... --out`): show the two side by side, term by term")
    ex.set_defaults(handler=_explain)

    r = sub.add_parser("run", help="run your own script on N processes (torchrun)",
                       description="Launch SCRIPT on N local processes; inside it, call polyshard.init().")
    r.add_argument("-n", "--nproc", type=int, required=True, help="number of processes")
    r.add_argument("script", help="Python script to run")
    r.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    r.set_defaults(handler=_run)

    e = sub.add_parser("export", help="write a checkpoint's weights as a transformers model directory",
                       description="Write model.safetensors and config.json that transformers loads (polyshard's GPT "
                                   "in GPT-2's layout) and `polyshard train --model hf:DIR` starts from.")
    e.add_argument("checkpoint", help="a checkpoint directory, or a --save-dir (its newest checkpoint)")
    e.add_argument("--to", choices=("hf",), default="hf", help="the format (hf: transformers)")
    e.add_argument("--out", required=True, help="directory to write into")
    e.set_defaults(handler=_export)

    m = sub.add_parser("models", help="list the models polyshard ships", description="List the named model configs.")
    m.set_defaults(handler=_models)
    add_calibrate(sub)
    add_ps(sub)
    add_k8s(sub)
    return p


def _train(args) -> int:
    from polyshard.train.config import check_against_model, check_config, token_source

    cfg = train_config(args)
    in_torchrun = under_torchrun()
    if args.nproc is not None and args.nproc < 1:
        raise PolyshardError(f"--nproc must be at least 1, got {args.nproc}")
    if args.max_restarts < 0:
        raise PolyshardError(f"--max-restarts must be 0 or more, got {args.max_restarts}")
    rendezvous = check_nodes(args.nnodes, args.node_rank, args.rdzv, args.rdzv_timeout)
    world = int(os.environ["WORLD_SIZE"]) if in_torchrun else (args.nproc or 1) * args.nnodes
    cfg, shape, plan = check_config(cfg, world)
    if not in_torchrun:
        check_against_model(cfg, shape, plan, args.nnodes)
        if rendezvous is not None:
            reach_rendezvous(rendezvous, args.node_rank, args.rdzv_timeout)
        rest = args.argv
        for flag in LAUNCH_FLAGS:
            rest = without_flag(rest, flag)
        if cfg.tokenizer:  # the ranks read the token file tokenized here, not the text again
            for flag in ("--data", "--data-dtype", "--tokenizer"):
                rest = without_flag(rest, flag)
            data, dtype = token_source(cfg)
            rest += ["--data", data, "--data-dtype", dtype]
        try:
            return launch(world // args.nnodes, ["-m", "polyshard.cli.main"] + rest,
                          nodes=(args.nnodes, args.node_rank), rendezvous=rendezvous, max_restarts=args.max_restarts,
                          stop_grace_s=SAVE_STOP_GRACE_S if cfg.save_dir else STOP_GRACE_S)
        except Stopped as exc:
            exc.then = exc.then or _saved_so_far(cfg.save_dir)  # the ranks' word where they stopped themselves
            raise
    from polyshard.train.trainer import train

    try:
        train(cfg)
    except Stopped as exc:  # every rank, after the step they were in, saved
        exc.then += _saved_so_far(cfg.save_dir)
        raise
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


def _saved_so_far(save_dir: str) -> str:
    """What a stopped run leaves to continue from, in words: its newest checkpoint, if it saved one."""
    if not save_dir:
        return ""
    from polyshard.runtime.checkpoint import committed

    saved = committed(save_dir)
    return (f"; its newest checkpoint is {saved[-1]} (train again with --resume auto to continue)" if saved else
            f"; it had saved no checkpoint in {save_dir}")


def _planning_flags(p: argparse.ArgumentParser) -> None:
    """What `plan` and `cost` share: the model, the cluster, the batch and the memory budget."""
    p.add_argument("--model", required=True, help="a name from `polyshard models` (image models too), a shape "
                   "such as 'gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200' (ffn defaults to 4 x "
                   "hidden; also dropout=P, attention=fused|math, tied=0|1), or a transformers model: "
                   "hf:llama-3-70b (shipped configs in `polyshard models`) or hf:CONFIG.json")
    p.add_argument("--cluster", required=True, help="NODESxDEVICESxTYPE (e.g. 128x8xA100-80G), cpu-gloo:N, or a YAML "
                   "file from `polyshard calibrate`")
    p.add_argument("--global-batch", "--batch-size", dest="batch_size", type=int, default=None,
                   help="sequences per optimizer step, over all devices (default: 1 per device)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's)")
    p.add_argument("--image-size", type=int, default=None, help="for an image model (unet-small, resnet-small): square "
                   "images of N pixels a side (default 64); the search weighs splitting them by height and width")
    p.add_argument("--memory-limit", default="", help="bytes per device, e.g. 70GiB (default: the device's memory; "
                   "on CPU, the machine's divided among the ranks on it)")
    p.add_argument("--memory-reserve", default="", help="of the limit, bytes plans leave free for the CUDA context, "
                   "communication buffers and allocator fragmentation (default: on GPUs the larger of 5%% and 2GiB)")
    p.add_argument("--pin", default="", help="YAML of strategies to keep: NAME_OR_GLOB: {in_strategy: [[1,1],[2,1]]}")
    p.add_argument("--pp-plan", action="store_true", help="pipeline stages may begin at every module a transformers "
                   "model's own pipeline plan names (embedding, each layer, final norm, head), not only at its layers")
    p.add_argument("--tp-plan", action="store_true", help="pin the products a transformers model's own "
                   "tensor-parallel plan names (colwise, rowwise, ...) over tp: only splits with tp > 1 are searched")
    p.add_argument("--json", action="store_true", help="print one JSON object (step_s, memory_bytes_per_device, "
                   "config, breakdown, planning_s) instead of the table")
    _listing_flags(p)
    p.add_argument("--workers", type=int, default=None, help="processes that cost splits side by side (default: "
                   "one per core this process may use on a cluster of several nodes, else 1)")


def _listing_flags(p: argparse.ArgumentParser) -> None:
    """How much of a plan's report to print."""
    p.add_argument("--candidates", type=int, default=20, help="candidates to list, fastest first (default 20; "
                   "the choice is listed wherever it ranks)")
    p.add_argument("--layouts", type=int, default=40, help="parameter layouts to list (default 40; 0 lists none)")


def _check_listing(args) -> None:
    """Refuse a negative row count for the report's listings before any planning starts."""
    for flag in ("layouts", "candidates"):
        if getattr(args, flag) < 0:
            raise PolyshardError(f"--{flag} must be 0 or more, got {getattr(args, flag)}")


def _status_line() -> Callable[[str], None] | None:
    """On a terminal, what planning is doing, on one line of stderr ("" clears it); elsewhere (logs, pipes)
    nothing."""
    if not sys.stderr.isatty():
        return None

    def say(text: str) -> None:
        print("\r\033[K" + (f"planning: {text}" if text else ""), end="", file=sys.stderr, flush=True)
    return say


def _plan(args) -> int:
    import json
    import time

    from polyshard.cluster import Cluster, parse_bytes
    from polyshard.planner.config import Fixed
    from polyshard.planner.report import compare, render, summary
    from polyshard.graph.capture import capture
    from polyshard.planner.search import default_reserve_bytes, refuse_where_nothing_fits, search

    cluster = Cluster.load(args.cluster)
    if hasattr(args, "compare") and not args.config.strip():  # `cost`: a configuration to price
        raise PolyshardError("--config is empty; give the settings to price (e.g. 'dp=8,tp=8'), or use "
                             "`polyshard plan` to search them all")
    fixed = Fixed.parse(args.config)
    fixed.check_devices(cluster.num_devices)
    batch = cluster.num_devices if args.batch_size is None else args.batch_size
    if batch < 1:
        raise PolyshardError(f"--global-batch must be at least 1, got {batch}")
    if args.workers is not None and args.workers < 1:
        raise PolyshardError(f"--workers must be at least 1, got {args.workers}")
    _check_listing(args)
    limit = parse_bytes(args.memory_limit) if args.memory_limit else None
    reserve = parse_bytes(args.memory_reserve) if args.memory_reserve else None
    _check_reserve(limit or cluster.memory_bytes, reserve, default_reserve_bytes(cluster))
    if args.pin and not Path(args.pin).is_file():
        raise PolyshardError(f"--pin file {args.pin!r} does not exist")
    if args.out:
        check_output_file("--out", args.out)
    planned = _planned_model(args, cluster.num_devices, batch, fixed)
    say = _status_line()
    start = time.perf_counter()
    try:
        if say:
            say(f"building and capturing {args.model}")
        model = planned.build()
        if args.pin:
            from polyshard.train.config import apply_strategies

            apply_strategies(model, args.pin)
        refuse_where_nothing_fits(model, cluster, limit, reserve, fixed)
        graph = capture(model, model.example_inputs(1))
        if args.tp_plan:
            from polyshard.planner.plan_model import pin_tp_plan

            pin_tp_plan(model, graph, ("tp",), "--tp-plan", args.model)
        counted = None if say is None else lambda done, total: say(f"{done} of {total} splits costed")
        options = dict(meshes=planned.meshes, dataset_strategy=planned.dataset_strategy, reserve_bytes=reserve,
                       pp_plan=args.pp_plan, graph=graph, workers=args.workers, progress=counted)
        plan, _ = search(model, model.example_inputs(1), cluster, batch, limit, fixed=fixed, **options)
        plan = dataclasses.replace(plan, model=planned.name, **planned.shape)
        seconds = time.perf_counter() - start
        pick = None
        if getattr(args, "compare", False):
            pick, _ = search(model, model.example_inputs(1), cluster, batch, limit, **options)
    finally:
        if say:
            say("")  # the answer, or the error, on a clean line
    if args.json:
        print(json.dumps({**summary(plan, planned.cfg, cluster.num_devices), "planning_s": round(seconds, 3),
                          "fixed": fixed.text(),
                          **({"pick": summary(pick, planned.cfg, cluster.num_devices)} if pick else {})}))
    else:
        print(f"planned {args.model} on {cluster.num_devices} devices ({args.cluster}), global batch {batch} "
              f"x {planned.row}, in {seconds:.1f} s")
        if fixed.text():
            kept = {kv.split("=")[0] for kv in fixed.text().split(",")}
            chosen = [kv for kv in plan.report["config"].split(",") if kv.split("=")[0] not in kept]
            print(f"kept {fixed.text()}; the search chose {','.join(chosen) or 'nothing else'}")
        print(render(plan, layouts=args.layouts, candidates=args.candidates))
        if pick is not None:
            print(compare(summary(plan, planned.cfg, cluster.num_devices),
                          summary(pick, planned.cfg, cluster.num_devices)))
    if args.out:
        Path(args.out).write_text(plan.to_json())
        if not args.json:
            print(f"plan: {args.out} (train it with `polyshard train --plan {args.out}`)")
    return 0


@dataclasses.dataclass(frozen=True)
class _Planned:
    """What `plan` and `cost` plan: the model's name for the plan file, its token shape (None for an image
    model), one row in words, the model built on the meta device (planned at full size without its memory),
    the meshes to weigh (None: every dp x pp x tp split), how its inputs split, the row's size as the plan file
    records it (seq_len or image_size, which a run of the file then trains at)."""

    name: str
    cfg: object
    row: str
    build: Callable
    meshes: list | None = None
    dataset_strategy: tuple | None = None
    shape: dict = dataclasses.field(default_factory=dict)


def _planned_model(args, devices: int, batch: int, fixed) -> _Planned:
    """The flags' model checked before any planning: a token model at --seq-len, or an image model at
    --image-size over every dp x h x w split of the devices it can train on."""
    from polyshard import models
    from polyshard.models.vision import (DEFAULT_IMAGE_SIZE, VISION, build_vision, check_image_size,
                                         dataset_strategy, image_meshes)

    foreign = {"h", "w"} if args.model not in VISION else {"tp", "pp", "sp", "schedule", "v", "cuts"}
    misplaced = sorted(k for k in foreign if getattr(fixed, k) is not None)
    if misplaced:
        raise PolyshardError(f"--config {misplaced[0]}: {args.model} " + (
            "reads tokens, and h and w split images by height and width" if args.model not in VISION else
            "splits its images over dp, h and w only (tp, pipelines and sequence parallel are for token models)"))
    if args.model not in VISION:
        if args.image_size is not None:
            raise PolyshardError(f"--image-size sizes an image model's images; {args.model} reads tokens: use "
                                 f"--model {' or '.join(VISION)}, or leave out --image-size")
        cfg = models.config(args.model, args.seq_len)
        named_whole = args.seq_len is None or args.model.startswith("hf:")  # a gpt: shape spells its length
        return _Planned(args.model if named_whole else models.shape_spec(cfg), cfg, f"{cfg.seq_len} tokens",
                        functools.partial(models.build, args.model, device="meta", seq_len=args.seq_len),
                        shape={"seq_len": cfg.seq_len})
    for flag, given in (("--seq-len", args.seq_len is not None), ("--pp-plan", args.pp_plan),
                        ("--tp-plan", args.tp_plan)):
        if given:
            raise PolyshardError(f"{flag} is for token models; {args.model} reads images: leave it out")
    size = DEFAULT_IMAGE_SIZE if args.image_size is None else args.image_size
    if size < 1:
        raise PolyshardError(f"--image-size must be a positive number of pixels, got {size}")
    check_image_size(args.model, size, {})
    meshes = image_meshes(args.model, size, devices, batch)
    if not meshes:
        raise PolyshardError(f"no dp x h x w split of {devices} devices takes --global-batch {batch} of {size} x "
                             f"{size} images: use a batch that {devices} divides, or an image size of a multiple "
                             f"of {devices * 2 ** VISION[args.model].halvings}")
    return _Planned(args.model, None, f"{size} x {size} images",
                    functools.partial(build_vision, args.model, size, device="meta"), meshes,
                    dataset_strategy(args.model), {"image_size": size})


def _check_reserve(limit: int, reserve: int | None, default: int) -> None:
    """A reserve leaves some of the limit to plan with."""
    from polyshard.cluster import format_bytes

    if reserve is not None and reserve >= limit:
        raise PolyshardError(f"--memory-reserve {format_bytes(reserve)} leaves nothing of the {format_bytes(limit)} "
                             "per device (--memory-limit, or the device's memory); lower the reserve")
    if reserve is None and limit and default >= limit:
        raise PolyshardError(f"the {format_bytes(limit)} per device (--memory-limit, or the device's memory) is not "
                             f"more than the default reserve of {format_bytes(default)}; raise the limit or set "
                             "--memory-reserve")


def _explain(args) -> int:
    from polyshard.planner.report import compare, render, summary
    from polyshard.train.config import load_plan

    _check_listing(args)
    plan = load_plan(args.plan, "plan file")
    other = load_plan(args.beside, "--beside plan file") if args.beside else None
    if other is not None:
        _check_comparable(plan, other, args.beside)
    cluster = _timeline_cluster(plan, args.timeline, args.cluster)
    print(render(plan, layouts=args.layouts, candidates=args.candidates))
    if other is not None:
        devices = math.prod(s for _, s in plan.mesh)
        names = (Path(args.beside).stem, Path(args.plan).stem)
        print(compare(summary(other, None, devices), summary(plan, None, devices),
                      names=names if names[0] != names[1] else (args.beside, args.plan)))
    if args.timeline:
        _draw_plan_timeline(plan, args.timeline, cluster)
    return 0


def _timeline_cluster(plan, path: str, cluster_spec: str):
    """The cluster --timeline times the plan's compute on (None: the plan's own predicted stage times), after
    every check that would refuse the drawing, so a refusal comes before anything is printed."""
    from polyshard.cluster import Cluster

    if cluster_spec and not path:
        raise PolyshardError("--cluster times the --timeline drawing; add --timeline or leave out --cluster")
    if not path:
        return None
    if dict(plan.mesh).get("pp", 1) < 2:
        raise PolyshardError("--timeline draws a pipeline, and this plan's mesh has no pp axis of 2 or more stages")
    check_output_file("--timeline", path)
    if _chosen_pipeline(plan) is not None and not cluster_spec:
        return None
    if plan.global_batch < 1:
        raise PolyshardError("--timeline needs the plan's model and global batch (plans from `polyshard plan` "
                             "have them)")
    return Cluster.load(cluster_spec or _plan_cluster(plan) or f"cpu-gloo:{math.prod(s for _, s in plan.mesh)}")


def _check_comparable(plan, other, path: str) -> None:
    """Two plans priced by a search for the same model, global batch and devices, or a clear error."""
    from polyshard.planner.report import chosen_row

    for p, name in ((plan, "the plan"), (other, f"--beside {path!r}")):
        if chosen_row(p.report) is None:
            raise PolyshardError(f"{name} holds no search report to compare; write plans with `polyshard plan` or "
                                 "`polyshard cost --out`")
    mine, theirs = ((p.model, p.global_batch, p.seq_len, p.image_size, math.prod(s for _, s in p.mesh))
                    for p in (plan, other))
    differ = [f"{what} {t} against {m}" for what, t, m in zip(("model", "global batch", "tokens a row", "image size",
                                                                "devices"), theirs, mine)
              if t != m and (t and m or what not in ("tokens a row", "image size"))]  # older files lack the sizes
    if differ:
        raise PolyshardError(f"--beside {path!r} differs from the plan in {', '.join(differ)}; compare plans of one "
                             "model, batch and cluster")


def _draw_plan_timeline(plan, path: str, cluster) -> None:
    """The plan's schedule, simulated with the stage times its search predicted (the same step and
    bubble as its table), or with the cost model's compute on ``cluster`` when one is given (or the plan
    has no stage times), drawn into ``path``."""
    from polyshard.schedule import schedule_actions, simulate
    from polyshard.runtime.timeline import draw_timeline

    pp = dict(plan.mesh)["pp"]
    if cluster is None:
        chosen = _chosen_pipeline(plan)
        stages = chosen["pipeline"]["stages"]
        times = simulate(schedule_actions(plan.schedule, pp, plan.micro_batches, plan.virtual_stages),
                         [s["forward_s"] for s in stages], [s["backward_s"] for s in stages])
        rest = ", the optimizer step and ranks arriving apart" if chosen.get("skew_s") else " and optimizer step"
        source = f"the plan's predicted stage times (step {chosen['step_s'] * 1e3:.4g} ms with the data-parallel " \
                 f"sync{rest})"
    else:
        from polyshard import models
        from polyshard.planner.stages import predict_timings

        rows = plan.global_batch // math.prod(s for n, s in plan.mesh if n in plan.data_axes)
        model = models.build(plan.model or "gpt-small", device="meta", seq_len=plan.seq_len or None)
        times = predict_timings(model, model.example_inputs(rows), plan, pp, cluster)  # cut into micro-batches there
        source = f"compute on {cluster.num_devices}x {cluster.device_name}"
    bubble = draw_timeline(path, predicted=times, title=f"{plan.model}: {plan.schedule}, {pp} stages, "
                                                          f"{plan.micro_batches} micro-batches")["predicted"]
    span = max(t.end_s for t in times) - min(t.start_s for t in times)
    print(f"timeline: {path}: schedule {span * 1e3:.6g} ms from {source}; predicted bubble {bubble:.1%}, "
          f"(p-1)/(vm+p-1) = "
          f"{(pp - 1) / (plan.micro_batches * plan.virtual_stages + pp - 1):.1%}")


def _chosen_pipeline(plan) -> dict | None:
    """The report's chosen candidate, when it has per-chunk stage times for the plan's schedule."""
    from polyshard.planner.report import chosen_row

    chosen = chosen_row(plan.report or {})
    p = (chosen or {}).get("pipeline")
    if p is None or (p["schedule"], p["micro_batches"], p["virtual_stages"]) != \
            (plan.schedule, plan.micro_batches, plan.virtual_stages):
        return None
    return chosen


def _plan_cluster(plan) -> str:
    """The preset the plan was made for, from its report ('' when unknown)."""
    c = (plan.report or {}).get("cluster")
    return f"{c['num_nodes']}x{c['devices_per_node']}x{c['device_name']}" if c and c["device_name"] != "cpu" else ""


def _export(args) -> int:
    from polyshard.runtime.export import export_hf

    if not args.out:
        raise PolyshardError("--out '' names no folder; name the folder to write the model into")
    blocking = file_in_the_way(args.out)
    if blocking is not None:
        raise PolyshardError(f"--out {args.out!r}: {str(blocking)!r} is a file; name a folder")
    out = export_hf(args.checkpoint, args.out)
    print(f"wrote {out / 'model.safetensors'} and {out / 'config.json'} (load with transformers, or train on with "
          f"--model hf:{out})")
    return 0


def _run(args) -> int:
    if args.nproc < 1:
        raise PolyshardError(f"-n must be at least 1, got {args.nproc}")
    if not os.path.isfile(args.script):
        raise PolyshardError(f"script {args.script!r} does not exist" + " (it is a folder)" * os.path.isdir(args.script))
    return launch(args.nproc, [args.script] + args.script_args)


def _models(args) -> int:
    from polyshard.models import CONFIGS

    print(f"{'name':<18} {'layers':>6} {'hidden':>6} {'heads':>5} {'vocab':>6} {'seq':>5} {'params':>10}")
    for name, c in CONFIGS.items():
        n = c.num_params()
        size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"
        print(f"{name:<18} {c.num_layers:>6} {c.hidden:>6} {c.num_heads:>5} {c.vocab_size:>6} {c.seq_len:>5} {size:>10}")
    from polyshard.models import hf

    print(f"transformers models (the [hf] extra): hf:FAMILY, tiny ({', '.join(hf.TINY)}); real sizes, for planning: "
          f"{', '.join('hf:' + n for n in hf.shipped())}; or hf:CONFIG.json, hf:DIR (config.json + safetensors)")
    from polyshard.models.vision import VISION

    print("image models (train --image-size N): " + ", ".join(
        f"{n} ({'a class per pixel' if v.per_pixel else 'a class per image'}, {v.classes} classes)"
        for n, v in VISION.items()))
    return 0


def run() -> None:
    """The ``polyshard`` command: :func:`main` in a process of its own, whose objects are left to the process's end
    uncollected (once torch is loaded, collecting them at exit takes about a second, in every rank). Output piped
    into a reader that stops early (``| head``) ends it quietly, as other command-line tools end."""
    try:
        code = main()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit would raise again
        sys.exit(1)
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    run()
