"""Cost-model check: the planner's predicted step time of each setting against the measured one.

    torchrun --nproc-per-node 4 bench/bench_cost_model.py                       # gpt-tiny and gpt-small, batch 8
    torchrun --nproc-per-node 4 bench/bench_cost_model.py --model gpt-small --batch 8,16
    torchrun --nproc-per-node 4 bench/bench_cost_model.py --model hf:gpt2,hf:llama --batch 16  # transformers' own
    torchrun --nproc-per-node 4 bench/bench_cost_model.py --settings "dp=4;dp=2,pp=2,m=4;dp=4,zero=3"
    torchrun --nproc-per-node 1 bench/bench_cost_model.py --model gpt-125m --batch 16 \
        --settings "precision=bf16,m=2;precision=bf16,recompute=full;precision=fp32"   # one GPU

For each configuration (model x global batch) each setting (``--config`` spelling; by default every
dp x tp split of the ranks) is searched alone, which gives its plan and predicted step time, and one
free search gives the planner's pick, which is run too unless its plan is a setting's (then the pick
is that setting, timed once). Every rank searches (the search is deterministic). Then every setting
of every configuration is built for real (``ps.init`` + ``ps.parallelize``, same seed, same global
batches, AdamW at the plan's optimizer level, ``polyshard train``'s step) and trained: after
--warmup untimed steps, --rounds timed rounds, each running --steps steps of every setting, taking
turns in an order that rotates from round to round, so machine noise hits all of them alike (one
configuration's settings at a time: they are freed before the next configuration's are built). A
setting's measured step time is the median over rounds of (seconds between barriers) / steps.

Where the run calibrates, each round begins by timing the calibration's fp32 products again, and on CPU its fixed
cost per op: rank 0 prints their medians over the rounds as shares of the calibration's (above 1: faster, and for
the fixed cost slower), and searches each setting again on the calibration at that speed (every rate scaled by the
one, every fixed cost per op or tensor by the other; links and shares as calibrated): a second prediction, which
separates the cost model's error from the machine's drift since the calibration. Then per configuration, the
predicted and measured step times and ranks;
the Spearman rank correlation of predicted vs measured (per configuration, per model, and pooled over every
point); each prediction's error; whether the planner's pick is the measured fastest or within 5% of it; on GPUs,
each setting's predicted memory against its allocator peak (the other settings' resident bytes left out); a breakdown
of one profiled block per mesh (time the main thread waits for operator collectives and for the
gradient all-reduce, against the planner's op_comm_s and dp_comm_s); and one JSON line.
Nothing is written to disk.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import polyshard as ps  # noqa: E402
from bench_core import NUM_BATCHES, make_batches  # noqa: E402
from polyshard import models  # noqa: E402
from polyshard.calibrate import (MATMUL_SIZE, calibrate, message_sizes, slowest_matmul_rate,  # noqa: E402
                                 slowest_step_overhead)
from polyshard.cluster import Cluster, format_bytes  # noqa: E402
from polyshard.errors import PolyshardError  # noqa: E402
from polyshard.graph.capture import capture  # noqa: E402
from polyshard.planner.config import Fixed  # noqa: E402
from polyshard.planner.plan_model import pin_tp_plan  # noqa: E402
from polyshard.plan import Plan  # noqa: E402
from polyshard.graph.stage_cuts import block_paths  # noqa: E402
from polyshard.planner.search import search  # noqa: E402
from polyshard.planner.split import mesh_candidates  # noqa: E402
from polyshard.runtime.sync import GradientSync  # noqa: E402
from polyshard.train.trainer import make_optimizer, train_step  # noqa: E402

LR = 1e-3
PICK_TOLERANCE = 0.05  # the pick passes if its measured time is within 5% of the fastest
ERROR_GOAL = 0.25  # each prediction within 25% of the measured step


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-tiny,gpt-small",
                   help="comma-separated model names (each gets its own meshes): " + ", ".join(models.CONFIGS) +
                        ", or a transformers model as hf:FAMILY (hf:gpt2, hf:llama, ...) or hf:CONFIG.json "
                        "(bench/configs/ holds two at gpt-small's size)")
    p.add_argument("--batch", default="8", help="comma-separated global batches (sequences per step)")
    p.add_argument("--extra", action="append", default=[], metavar="MODEL:BATCH",
                   help="one more configuration, e.g. gpt-small:16 (repeatable)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per mesh and round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per mesh before the rounds")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (meshes interleaved within each)")
    p.add_argument("--profile-steps", type=int, default=2,
                   help="steps per mesh in the profiled breakdown block (0: no breakdown)")
    p.add_argument("--settings", default="",
                   help="semicolon-separated settings in the --config spelling, each searched alone and run "
                        "(default: every dp x tp split of the ranks); '+tp_plan' after one pins the model's own "
                        "tensor-parallel plan (transformers' _tp_plan), e.g. 'tp=4+tp_plan'")
    p.add_argument("--plan", choices=["search", "propagate"], default="search",
                   help="run each split with the plan the search costs for it (default), or with the plan "
                        "ps.parallelize propagates itself")
    p.add_argument("--cluster", default="calibrate",
                   help="cluster the planner costs: 'calibrate' (default: measure this machine first, as "
                        "`polyshard calibrate` does), a preset such as cpu-gloo:4, or a YAML file")
    return p.parse_args(argv)


def load_cluster(spec: str) -> Cluster:
    if spec == "calibrate":  # every rank measures; messages of 4 KiB to 16 MiB, as `polyshard calibrate` times
        return calibrate(None, message_sizes(16 * 2**20), repeats=3)  # (to 4 MiB noise can hide the size's share)
    if spec.endswith((".yaml", ".yml")) or os.path.isfile(spec):
        return Cluster.from_yaml(spec)
    return Cluster.preset(spec)


def configurations(args) -> list[tuple[str, int]]:
    out = [(m.strip(), int(b)) for m in args.model.split(",") if m.strip() for b in args.batch.split(",") if b.strip()]
    for e in args.extra:
        name, _, batch = e.partition(":")
        out.append((name.strip(), int(batch)))
    for name, _ in out:
        try:
            models.config(name)
        except PolyshardError as e:
            raise SystemExit(str(e)) from None
    return list(dict.fromkeys(out))


def mesh_text(mesh) -> str:
    return " x ".join(f"{n}={s}" for n, s in mesh)


# ---------------------------------------------------------------- statistics


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing their average rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rho: Pearson's correlation of the ranks (nan when either side has no spread)."""
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return cov / var if var else float("nan")


# ---------------------------------------------------------------- predictions


def figures_of(c) -> dict:
    return {"rows": c.rows, "step_s": c.step_s, "compute_s": c.compute_s, "op_comm_s": c.op_comm_s,
            "dp_comm_s": c.dp_comm_s, "skew_s": c.skew_s, "memory_bytes": float(c.memory.total_bytes)}


def same_plan(a: str, b: str) -> bool:
    """Whether two plans' JSON make the same decisions (their search reports aside)."""
    return {k: v for k, v in json.loads(a).items() if k != "report"} == \
        {k: v for k, v in json.loads(b).items() if k != "report"}


def predict(configs, cluster: Cluster, settings: list[str]) -> dict:
    """Per configuration: the free search's pick, and per setting (the pick's own included) its
    predicted figures and the plan of the search over that setting alone (as JSON). A pick whose plan is
    a setting's is that setting: one configuration, trained and timed once."""
    out = {}
    for model, batch in configs:
        searchable = _searchable(model, cluster)
        _, meta, row, splits = searchable
        plan, ranked = search(meta, row, cluster, batch, meshes=splits)
        pick = plan.report["config"]
        found = searched_alone(searchable, batch, cluster, list(dict.fromkeys(settings + [pick])))
        alike = next((t for t in settings if t != pick and same_plan(found[t]["plan"], found[pick]["plan"])), None)
        if alike is not None:
            del found[pick]
            pick = alike
        out[(model, batch)] = {"pick": pick, "settings": found}
    return out


def searched_alone(searchable, batch: int, cluster: Cluster, settings: list[str]) -> dict:
    """Per setting, the predicted figures and the plan (as JSON) of the search over that setting alone
    (``searchable``: what :func:`_searchable` gives)."""
    name, meta, row, splits = searchable
    found = {}
    for text in settings:
        fixed, tp_plan = parse_setting(text)
        model = meta
        if tp_plan:  # a model of its own, whose pins no other setting's search sees
            model = models.build(name, device="meta")
            pin_tp_plan(model, capture(model, row), ("tp",))
        alone_plan, alone = search(model, row, cluster, batch, meshes=splits, fixed=fixed)
        best = next(c for c in alone if c.describe() == alone_plan.report["chosen"])
        found[text] = {**figures_of(best), "mesh": tuple(alone_plan.mesh), "plan": alone_plan.to_json()}
    return found


def parse_setting(text: str) -> tuple[Fixed, bool]:
    """A setting in the --config spelling, and whether it ends in ``+tp_plan``: the model's own tensor-parallel
    plan pinned (transformers' ``_tp_plan``: Megatron-style column- and row-parallel products), so that its tp
    ranks split operators where the search alone would rather keep them whole."""
    config, plus, pins = text.partition("+")
    if plus and pins != "tp_plan":
        raise PolyshardError(f"setting {text!r}: after '+' only 'tp_plan' (the model's own tensor-parallel plan)")
    return Fixed.parse(config), bool(plus)


def _searchable(model: str, cluster: Cluster):
    """``model``'s name, the model on the meta device, its one-row example, and every split of the cluster it can
    take."""
    meta = models.build(model, device="meta")
    row = meta.example_inputs(1)
    return model, meta, row, mesh_candidates(cluster.num_devices, len(block_paths(capture(meta, row))))


# ---------------------------------------------------------------- one mesh, trained for real


ON_GPU = torch.cuda.is_available()  # each rank trains on its GPU (NCCL), else on the CPU (gloo)


def allocated() -> int:
    """Bytes of tensors on this rank's GPU (0 on CPU, where no allocator keeps count)."""
    return torch.cuda.memory_allocated() if ON_GPU else 0


def settle() -> None:
    """Wait for every rank, and on a GPU for its queued kernels, so a timer reads finished work."""
    if ON_GPU:
        torch.cuda.synchronize()
    dist.barrier()
    if ON_GPU:
        torch.cuda.synchronize()


def machine_speed() -> tuple[float, float]:
    """The calibration's fp32 product rate and (on CPU) its fixed cost per op, timed again on every rank at once."""
    rate = slowest_matmul_rate(torch.float32, MATMUL_SIZE["cuda" if ON_GPU else "cpu"], repeats=3)
    return rate, (0.0 if ON_GPU else slowest_step_overhead(repeats=3))


def at_speed(cluster: Cluster, speed: float, overhead: float) -> Cluster:
    """``cluster`` on a machine running ``speed`` times as fast and paying ``overhead`` times the fixed costs: every
    rate (products, pointwise ops, memory) scaled by the one, every fixed cost per op or tensor by the other; links,
    shares and the ranks' arrival skew as calibrated."""
    per_op = {f: getattr(cluster, f) * overhead for f in ("op_overhead_s", "split_op_overhead_s",
                                                         "recompute_op_overhead_s", "watched_op_overhead_s",
                                                         "optimizer_overhead_s", "host_optimizer_overhead_s")}
    return dataclasses.replace(
        cluster, **per_op,
        op_overheads_s={d: s * overhead for d, s in cluster.op_overheads_s.items()},
        flops_per_s={d: r * speed for d, r in cluster.flops_per_s.items()},
        pointwise_rates={d: {op: r * speed for op, r in ops.items()} for d, ops in cluster.pointwise_rates.items()},
        memory_bandwidth_bytes_per_s=cluster.memory_bandwidth_bytes_per_s * speed,
        host_memory_bandwidth_bytes_per_s=cluster.host_memory_bandwidth_bytes_per_s * speed)


def repriced(configs, cluster: Cluster, predicted: dict, speed: dict, overhead: dict) -> dict:
    """Per configuration and setting, its search again on ``cluster`` at the speed its rounds ran
    (:func:`at_speed`): the predicted step time, and whether that search chose the plan that was run."""
    out = {}
    for model, batch in configs:
        settings = predicted[(model, batch)]["settings"]
        fast = at_speed(cluster, speed[(model, batch)], overhead.get((model, batch), 1.0))
        again = searched_alone(_searchable(model, cluster), batch, fast, list(settings))
        out[(model, batch)] = {label: {"step_s": again[label]["step_s"],
                                       "same_plan": same_plan(f["plan"], again[label]["plan"])}
                               for label, f in settings.items()}
    return out


class Run:
    """One configuration under one setting: ``step(i)`` trains on global batch ``i`` (this rank's rows)."""

    def __init__(self, model: str, batch: int, label: str, mesh, batches, plan: Plan | None):
        self.model, self.batch, self.label, self.mesh = model, batch, label, mesh
        self.before = allocated()  # device bytes before this setting's model, to count what it keeps
        self.ps_mesh = ps.init(dict(mesh))
        n, i = self.ps_mesh.num_data_shards, self.ps_mesh.data_index
        example = tuple(t.chunk(n)[i] for t in batches[0])  # one rank's rows: the shapes for capture
        self.pm = ps.parallelize(models.build(model, seed=0), example_inputs=example, plan=plan,
                                 tp_plan=parse_setting(label)[1])  # the pins its plan was searched under
        self.local = [self.pm.local_batch(x, y) for x, y in batches]  # cut once, before timing
        self.opt = make_optimizer(self.pm, LR, "")  # AdamW, at the plan's optimizer-parallel level
        self.times: list[float] = []  # seconds per step, one per round
        self.resident = 0  # device bytes this setting keeps between steps (weights, optimizer state)
        self.peak = 0  # device bytes at this setting's fullest moment, other settings' resident bytes left out
        self.dp_wait = 0.0  # seconds spent in the gradient sync's finish() (while enabled)
        self._timing_sync = False
        sync = self.pm.grad_sync  # data parallel's engine, or an optimizer-parallel level's
        if isinstance(sync, GradientSync):
            finish = sync.finish

            def timed_finish():
                t0 = time.perf_counter()
                finish()
                if self._timing_sync:
                    self.dp_wait += time.perf_counter() - t0

            sync.finish = timed_finish  # the backward callback looks it up on the instance

    def activate(self) -> None:
        ps.init(dict(self.mesh))  # the process group is reused; only the current mesh changes

    def step(self, i: int) -> torch.Tensor:
        accum = self.pm.plan.micro_batches if self.ps_mesh.pp == 1 else 1  # gradient accumulation without a pipeline
        return train_step(self.pm, self.opt, *self.local[i % len(self.local)], accum)

    def warm(self, steps: int) -> list[float]:
        """The first ``steps`` steps' global losses, untimed; then what the setting keeps on the device."""
        losses = [self.global_loss(self.step(i)) for i in range(steps)]
        self.resident = allocated() - self.before
        return losses

    def global_loss(self, loss: torch.Tensor) -> float:
        """The global-batch loss: data shards hold their rows' mean."""
        group = self.ps_mesh.data_group()
        if group is not None:
            loss = loss.clone()
            dist.all_reduce(loss, group=group)
            loss /= self.ps_mesh.num_data_shards
        return loss.item()

    def timed(self, steps: int, start: int) -> float:
        self.activate()
        settle()
        base = allocated()
        if ON_GPU:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for i in range(start, start + steps):
            self.step(i)
        settle()
        seconds = (time.perf_counter() - t0) / steps
        if ON_GPU:
            self.peak = max(self.peak, torch.cuda.max_memory_allocated() - base + self.resident)
        return seconds

    def breakdown(self, steps: int, start: int) -> dict:
        """One profiled block: wall time per step, main-thread waits for operator collectives
        (DTensor's wait_tensor) and for the gradient all-reduce (the sync's finish), per step."""
        from torch.profiler import ProfilerActivity, profile

        self.activate()
        self.dp_wait, self._timing_sync = 0.0, True
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for i in range(start, start + steps):
                self.step(i)
            wall = time.perf_counter() - t0
        self._timing_sync = False
        dist.barrier()
        waits = [e for e in prof.key_averages() if e.key.endswith("wait_tensor")]
        # the functional-collective wait and the aten op it dispatches to nest: take the outermost
        outer = max(waits, key=lambda e: e.cpu_time_total, default=None)
        op_wait = outer.cpu_time_total / 1e6 if outer is not None else 0.0
        waited = outer.count if outer is not None else 0
        return {"wall_s": wall / steps, "op_wait_s": op_wait / steps, "dp_wait_s": self.dp_wait / steps,
                "op_collectives": waited / steps}

    def close(self) -> None:
        del self.pm, self.opt, self.local


# ---------------------------------------------------------------- main


def main(argv=None) -> None:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ps.init({"dp": world})  # starts the process group: gloo on CPU (1 thread per rank), NCCL on GPUs
    lead = dist.get_rank() == 0
    if min(args.warmup, args.steps, args.rounds) < 1:
        raise SystemExit("--warmup, --steps and --rounds must be at least 1")
    configs = configurations(args)  # a bad model name fails before the calibration
    settings = [t.strip() for t in args.settings.split(";") if t.strip()] or \
        [",".join(f"{n}={v}" for n, v in m) for m in mesh_candidates(world)]
    for text in settings:  # and so does a bad setting
        try:
            parse_setting(text)
        except PolyshardError as exc:
            raise SystemExit(f"--settings: {exc}") from exc
    cluster = load_cluster(args.cluster)
    if cluster.num_devices != world:
        raise SystemExit(f"cluster {args.cluster!r} has {cluster.num_devices} devices; the world has {world}")

    # ---- predictions, on rank 0 and sent to the others (every rank then builds the same meshes in
    # the same order): one search over every split per configuration (the pick and its figures),
    # then one search per split alone, for the plan the planner costs on that split (run below)
    payload = [None]
    if lead:
        t_search = time.perf_counter()
        payload[0] = {"predicted": predict(configs, cluster, settings), "search_s": time.perf_counter() - t_search}
    dist.broadcast_object_list(payload, src=0)
    predicted, t_search = payload[0]["predicted"], payload[0]["search_s"]
    picks = {key: p["pick"] for key, p in predicted.items()}

    # ---- per configuration, its settings built once and timed in rounds, then freed before the next
    # configuration's (a GPU holds one configuration's models at a time)
    runs: list[Run] = []
    first_loss: dict[tuple[str, int], dict[str, float]] = {}
    detail, speed, overhead = {}, {}, {}
    for model, batch in configs:
        batches = make_batches(models.config(model), batch, NUM_BATCHES)
        group = []
        for label, figures in predicted[(model, batch)]["settings"].items():
            plan = Plan.from_json(figures["plan"]) if args.plan == "search" else None
            run = Run(model, batch, label, figures["mesh"], batches, plan)
            group.append(run)
            first_loss.setdefault((model, batch), {})[label] = run.warm(args.warmup)[0]
        # timed rounds: the settings take turns; the order rotates per round, so noise hits all alike. Where the
        # run calibrates, each round first times the calibration's fp32 products (and on CPU its fixed cost per op)
        # again: the machine's speed while the settings ran
        start, probes = args.warmup, []
        for r in range(args.rounds):
            if args.cluster == "calibrate":
                probes.append(machine_speed())
            order = group[r % len(group):] + group[:r % len(group)]
            if r % 2:
                order = order[::-1]
            for run in order:
                run.times.append(run.timed(args.steps, start))
            start += args.steps
        # one profiled block per setting: where the measured time goes
        if args.profile_steps > 0:
            for run in group:
                detail[(run.model, run.batch, run.label)] = run.breakdown(args.profile_steps, start)
        for run in group:
            run.close()
        if probes:
            if lead:
                shares = [f"{p[0] / cluster.flops_per_s['float32']:.2f}x" for p in probes]
                costs = [f"{p[1] / cluster.op_overhead_s:.2f}x" for p in probes] if not ON_GPU else []
                print(f"{model}:{batch} per round against the calibration: fp32 products {', '.join(shares)}"
                      + f"; fixed cost per op {', '.join(costs)}" * bool(costs), flush=True)
            speed[(model, batch)] = statistics.median(p[0] for p in probes) / cluster.flops_per_s["float32"]
            if not ON_GPU:
                overhead[(model, batch)] = statistics.median(p[1] for p in probes) / cluster.op_overhead_s
        runs.extend(group)
        gc.collect()
        if ON_GPU:
            torch.cuda.empty_cache()

    if lead:
        print(f"cluster: {cluster.device_name} x {cluster.num_devices} ({cluster.backend}); "
              f"search: {t_search:.1f} s for {len(configs)} configurations; torch {torch.__version__}", flush=True)
        for key, by_mesh in first_loss.items():
            vals = list(by_mesh.values())
            spread = (max(vals) - min(vals)) / abs(vals[0])
            print(f"{key[0]} batch {key[1]}: first loss under every setting " + ", ".join(
                f"{m} {v:.6f}" for m, v in by_mesh.items()) + f" (rel spread {spread:.1e})", flush=True)
        for what, ratios in (("fp32 products", speed), ("fixed cost per op", overhead)):
            if ratios:
                print(f"{what} timed again at the start of each round, median against the calibration"
                      f"{' (above 1: slower)' if ratios is overhead else ''}: " +
                      ", ".join(f"{m}:{b} {ratio:.2f}x" for (m, b), ratio in ratios.items()), flush=True)

    if lead:
        again = repriced(configs, cluster, predicted, speed, overhead) if speed else {}
        report(args, cluster, configs, runs, predicted, picks, detail, first_loss, speed, overhead, again)

    del runs
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def report(args, cluster, configs, runs, predicted, picks, detail, first_loss, speed, overhead, again) -> None:
    """The tables and one JSON line; ``again``: per configuration and setting, its prediction at the speed the
    rounds ran (:func:`repriced`; empty where the run did not calibrate)."""
    rows, per_config, per_model_pts, pooled = [], {}, {}, []
    print()
    print("| model | batch | setting | rows/dev | predicted ms | measured ms | error | predicted rank | measured rank "
          "| at the rounds' speed ms | error |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for model, batch in configs:
        these = [r for r in runs if (r.model, r.batch) == (model, batch)]
        settings = predicted[(model, batch)]["settings"]
        pred = [settings[r.label]["step_s"] for r in these]
        meas = [statistics.median(r.times) for r in these]
        pr, mr = ranks(pred), ranks(meas)
        for r, p, m, a, b in zip(these, pred, meas, pr, mr):
            c = settings[r.label]
            fast = again.get((model, batch), {}).get(r.label)
            at = (f"{fast['step_s'] * 1e3:.3f}{'' if fast['same_plan'] else ' (another plan)'} | "
                  f"{fast['step_s'] / m - 1:+.0%}") if fast else "- | -"
            print(f"| {model} | {batch} | {r.label} | {c['rows']} | {p * 1e3:.3f} | {m * 1e3:.1f} | {p / m - 1:+.0%} "
                  f"| {a:g} | {b:g} | {at} |")
            rows.append({"model": model, "batch": batch, "setting": r.label, "mesh": mesh_text(r.mesh),
                         "rows": int(c["rows"]), "predicted_ms": round(p * 1e3, 3), "measured_ms": round(m * 1e3, 2),
                         "error": round(p / m - 1, 4), "predicted_rank": a, "measured_rank": b,
                         "compute_ms": round(c["compute_s"] * 1e3, 3), "op_comm_ms": round(c["op_comm_s"] * 1e3, 3),
                         "dp_comm_ms": round(c["dp_comm_s"] * 1e3, 3), "skew_ms": round(c["skew_s"] * 1e3, 3),
                         "memory_bytes": int(c["memory_bytes"]), "peak_bytes": r.peak,
                         "rounds_ms": [round(t * 1e3, 2) for t in r.times]}
                        | ({"at_speed_ms": round(fast["step_s"] * 1e3, 3),
                            "at_speed_error": round(fast["step_s"] / m - 1, 4),
                            "at_speed_same_plan": fast["same_plan"]} if fast else {}))
        pick = picks[(model, batch)]
        fastest = min(zip(meas, these), key=lambda x: x[0])
        pick_meas = next(m for m, r in zip(meas, these) if r.label == pick)
        per_config[(model, batch)] = {
            "spearman": spearman(pred, meas), "pick": pick, "fastest": fastest[1].label,
            "pick_over_fastest": pick_meas / fastest[0] - 1,
        }
        per_model_pts.setdefault(model, []).extend(zip(pred, meas))
        pooled.extend(zip(pred, meas))

    print()
    print("| model | batch | Spearman | planner's pick | measured fastest | pick vs fastest | pick within 5% |")
    print("|---|---:|---:|---|---|---:|---|")
    for (model, batch), s in per_config.items():
        ok = s["pick_over_fastest"] <= PICK_TOLERANCE
        print(f"| {model} | {batch} | {s['spearman']:+.2f} | {s['pick']} | {s['fastest']} "
              f"| {s['pick_over_fastest'] * 100:+.1f}% | {'yes' if ok else 'NO'} |")

    def rho(points):
        return spearman([p for p, _ in points], [m for _, m in points])

    by_model = {m: rho(pts) for m, pts in per_model_pts.items()}
    pooled_rho = rho(pooled)
    # within-configuration pooling: each configuration's times divided by its own mean, so the
    # pooled figure ranks meshes, not model sizes
    normed = []
    for model, batch in configs:
        pts = [(r["predicted_ms"], r["measured_ms"]) for r in rows if (r["model"], r["batch"]) == (model, batch)]
        mp, mm = statistics.fmean(p for p, _ in pts), statistics.fmean(m for _, m in pts)
        normed.extend((p / mp, m / mm) for p, m in pts)
    normed_rho = rho(normed)
    print()
    print("Spearman per model: " + ", ".join(f"{m} {v:+.2f} ({len(per_model_pts[m])} points)" for m, v in by_model.items()))
    print(f"Spearman pooled over all {len(pooled)} points: {pooled_rho:+.2f} (raw ms; "
          f"{normed_rho:+.2f} with each configuration's times divided by its mean)")
    picks_ok = all(s["pick_over_fastest"] <= PICK_TOLERANCE for s in per_config.values())
    picks_best = sum(s["pick"] == s["fastest"] for s in per_config.values())
    print(f"planner's pick measured fastest in {picks_best}/{len(per_config)} configurations; "
          f"within 5% in all: {'yes' if picks_ok else 'no'}")
    within = sum(abs(r["error"]) <= ERROR_GOAL for r in rows)
    print(f"predictions within 25% of the measured step: {within}/{len(rows)} "
          f"(median |error| {statistics.median(abs(r['error']) for r in rows):.0%})")
    if again:
        fast = [r for r in rows if "at_speed_error" in r]
        print(f"at the speed the rounds ran: {sum(abs(r['at_speed_error']) <= ERROR_GOAL for r in fast)}/{len(fast)} "
              f"within 25% (median |error| {statistics.median(abs(r['at_speed_error']) for r in fast):.0%}; "
              f"Spearman pooled {rho([(r['at_speed_ms'], r['measured_ms']) for r in fast]):+.2f}; "
              f"searched to another plan than the one run: {sum(not r['at_speed_same_plan'] for r in fast)})")

    if any(r["peak_bytes"] for r in rows):  # on a GPU: the planner's memory against the allocator's peak
        print()
        print("| model | batch | setting | predicted memory | measured peak | predicted / measured |")
        print("|---|---:|---|---:|---:|---:|")
        for r in rows:
            print(f"| {r['model']} | {r['batch']} | {r['setting']} | {format_bytes(r['memory_bytes'])} "
                  f"| {format_bytes(r['peak_bytes'])} | {r['memory_bytes'] / r['peak_bytes']:.3f} |")

    if detail:
        print()
        print("Breakdown (one profiled block of %d steps per mesh, rank 0; ms per step):" % args.profile_steps)
        print("| model | batch | setting | pred compute | pred op comm | pred dp comm | measured wall (profiled) "
              "| op collective waits | op-collective wait | grad all-reduce wait | rest (compute, optimizer, overhead) |")
        print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            d = detail[(r["model"], r["batch"], r["setting"])]
            rest = d["wall_s"] - d["op_wait_s"] - d["dp_wait_s"]
            r.update({"profiled_wall_ms": round(d["wall_s"] * 1e3, 2), "op_wait_ms": round(d["op_wait_s"] * 1e3, 2),
                      "dp_wait_ms": round(d["dp_wait_s"] * 1e3, 2), "rest_ms": round(rest * 1e3, 2),
                      "op_collectives_per_step": d["op_collectives"]})
            print(f"| {r['model']} | {r['batch']} | {r['setting']} | {r['compute_ms']:.2f} | {r['op_comm_ms']:.2f} "
                  f"| {r['dp_comm_ms']:.2f} | {r['profiled_wall_ms']:.1f} | {r['op_collectives_per_step']:g} | {r['op_wait_ms']:.1f} "
                  f"| {r['dp_wait_ms']:.1f} | {r['rest_ms']:.1f} |")

    print(json.dumps({
        "bench": "cost_model", "ranks": cluster.num_devices, "cluster": cluster.device_name, "plan": args.plan,
        "backend": cluster.backend, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
        "rows": rows,
        "per_config": [{"model": m, "batch": b, **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items()}}
                       for (m, b), s in per_config.items()],
        "spearman_per_model": {m: round(v, 4) for m, v in by_model.items()},
        "spearman_pooled": round(pooled_rho, 4), "spearman_pooled_normalised": round(normed_rho, 4),
        "picks_within_5pct": picks_ok, "within_25pct": within, "picks_fastest": picks_best,
        "first_loss": {f"{m}:{b}": v for (m, b), v in first_loss.items()},
        "product_rate_vs_calibration": {f"{m}:{b}": round(v, 3) for (m, b), v in speed.items()},
        "op_overhead_vs_calibration": {f"{m}:{b}": round(v, 3) for (m, b), v in overhead.items()},
        "torch": torch.__version__,
    }, default=lambda v: v.item()), flush=True)  # numpy scalars


if __name__ == "__main__":
    main()
