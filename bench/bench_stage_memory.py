"""Pipeline memory per stage: the planner's estimate of each rank's stage against the peak measured there,
with one recompute mode for every stage and with a mode per stage; and the step time each costs.

    torchrun --nproc-per-node 2 bench/bench_stage_memory.py                 # gpt-small, batch 32, m=8
    torchrun --nproc-per-node 2 bench/bench_stage_memory.py --batch 64 --micro-batches 16

Each setting (pp=2, 1F1B, the given micro-batches, recompute none / full on the first stage only / full)
is searched alone on the cpu-gloo:2 preset, which gives its plan and each stage's memory. The plan is
built with ps.parallelize, and one training step (after one untracked step) is measured on each rank
with torch's MemTracker (polyshard.runtime.memory_probe): parameters, gradients, optimizer state,
activations and temporaries at the peak. Then --steps timed steps of each setting, taking turns
over --rounds rounds; the median step of each is printed against the uniform full recompute's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import polyshard as ps  # noqa: E402
from polyshard import models  # noqa: E402
from polyshard.cluster import Cluster, format_bytes  # noqa: E402
from polyshard.planner.config import Fixed  # noqa: E402
from polyshard.planner.report import chosen_row  # noqa: E402
from polyshard.planner.search import search  # noqa: E402
from polyshard.runtime.memory_probe import peak_bytes  # noqa: E402

MODES = ("none", "full/none", "full")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-small", help="model name; known: " + ", ".join(models.CONFIGS))
    p.add_argument("--batch", type=int, default=32, help="rows per step")
    p.add_argument("--micro-batches", type=int, default=8, help="pipeline micro-batches per step")
    p.add_argument("--steps", type=int, default=5, help="timed steps per setting and round")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (settings take turns within each)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    ps.init("pp=2")
    mesh, rank = ps.current_mesh(), dist.get_rank()
    cfg = models.CONFIGS[args.model]
    g = torch.Generator().manual_seed(0)
    batch = tuple(torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), generator=g) for _ in range(2))
    meta = models.build(args.model, "meta")
    built, rows = {}, []
    for modes in MODES:
        fixed = Fixed.parse(f"pp=2,m={args.micro_batches},schedule=1f1b,recompute={modes},offload=none,"
                            "precision=fp32")
        plan, _ = search(meta, meta.example_inputs(1), Cluster.preset("cpu-gloo:2"), args.batch,
                         meshes=[mesh.axes], data_axes=mesh.data_axes, fixed=fixed)
        chosen = chosen_row(plan.report)
        stage = chosen["pipeline"]["stages"][rank]
        torch.manual_seed(0)
        pm = ps.parallelize(models.build(args.model), plan=plan, example_inputs=batch)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
        local = pm.local_batch(*batch)
        measured = peak_bytes(pm, opt, lambda: pm.train_step(*local))
        built[modes] = (pm, opt, local)
        rows.append({"recompute": modes, "rank": rank, "stage_recompute": stage["recompute"],
                     "boundaries": list(plan.stage_boundaries), "estimate": stage["memory"]["total"],
                     "measured": measured["total"], "activations": measured.get("activation", 0.0),
                     "predicted_step_s": chosen["step_s"], "estimate_parts": stage["memory"],
                     "measured_parts": measured})
    times = {modes: [] for modes in MODES}
    for r in range(args.rounds):
        for modes in MODES[r % len(MODES):] + MODES[:r % len(MODES)]:
            pm, opt, local = built[modes]
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                pm.train_step(*local)
                opt.step()
                opt.zero_grad(set_to_none=True)
            dist.barrier()
            times[modes].append((time.perf_counter() - start) / args.steps)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        _report(args, [row for part in gathered for row in part], {m: statistics.median(t) for m, t in times.items()})
    dist.destroy_process_group()


def _report(args, rows: list[dict], step_s: dict[str, float]) -> None:
    print(f"{args.model}, batch {args.batch}, pp=2, 1F1B, {args.micro_batches} micro-batches, fp32, AdamW")
    print("| recompute | rank | its mode | cut at | estimate | measured | estimate / measured | measured activations |")
    print("|---|---:|---|---|---:|---:|---:|---:|")
    for row in sorted(rows, key=lambda r: (MODES.index(r["recompute"]), r["rank"])):
        print(f"| {row['recompute']} | {row['rank']} | {row['stage_recompute']} | {', '.join(row['boundaries'])} "
              f"| {format_bytes(row['estimate'])} | {format_bytes(row['measured'])} "
              f"| {row['estimate'] / row['measured']:.3f} | {format_bytes(row['activations'])} |")
    base = step_s["full"]
    predicted = {r["recompute"]: r["predicted_step_s"] for r in rows}
    print("\n| recompute | predicted step | measured step | measured / full everywhere |")
    print("|---|---:|---:|---:|")
    for modes in MODES:
        print(f"| {modes} | {predicted[modes] * 1e3:.1f} ms | {step_s[modes] * 1e3:.1f} ms | {step_s[modes] / base:.3f} |")
    print(json.dumps({"bench": "stage_memory", "model": args.model, "batch": args.batch, "rows": rows,
                      "step_s": step_s}))


if __name__ == "__main__":
    main()
