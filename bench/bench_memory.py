"""Memory: the planner's per-device estimate against the peak measured in a real training step.

    python bench/bench_memory.py                          # gpt-tiny and gpt-small, batch 8
    python bench/bench_memory.py --model gpt-small --batch 16
    python bench/bench_memory.py --model hf:llama,hf:gpt2   # transformers' own models, tiny configs

One process. For each model and each setting (recompute none/selective/pointwise/full, optimizer-state
offload none/host/disk) it builds the model with polyshard.parallelize, takes one untracked step,
then measures one step with torch's MemTracker (polyshard.runtime.memory_probe): parameters,
gradients, optimizer state, activations and temporaries at the peak. With offload, the optimizer
step runs on the host, so the measured device share is forward and backward. The estimate is
polyshard.planner.cost.memory.estimate_memory for the same plan; ratio = estimate / measured.

Then the limit case: the memory limit is set to 75% of the plain run's measured peak, the planner
(search over this one device) chooses recompute and/or offload to fit, and the chosen plan is
measured the same way: it must come in under the limit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile

import torch

import polyshard as ps
from polyshard import models
from polyshard.cluster import Cluster, format_bytes
from polyshard.errors import PolyshardError
from polyshard.graph.capture import capture
from polyshard.planner.cost.memory import estimate_memory
from polyshard.planner.search import search
from polyshard.runtime.memory_probe import step_peak_bytes
from polyshard.train.trainer import make_optimizer

SETTINGS = [("none", "none"), ("selective", "none"), ("pointwise", "none"), ("alternate", "none"), ("half", "none"),
            ("full", "none"), ("none", "host"), ("none", "disk"), ("full", "disk")]
LIMIT_SHARE = 0.75


def measure(model: str, batch, recompute="none", offload="none", plan=None):
    """Measured peak by category and the plan the step ran, for ``model`` under these settings."""
    torch.manual_seed(0)
    pm = ps.parallelize(models.build(model), batch, plan=plan, recompute=None if plan else recompute)
    pm.plan = dataclasses.replace(pm.plan, offload=plan.offload if plan else offload)
    with tempfile.TemporaryDirectory() as folder:
        opt = make_optimizer(pm, 1e-3, folder)
        return step_peak_bytes(pm, opt, batch, state_on_device=pm.plan.offload == "none",
                               micro_batches=pm.plan.micro_batches), pm.plan


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-tiny,gpt-small",
                   help="comma-separated model names (`polyshard models`; hf:FAMILY for transformers' own)")
    p.add_argument("--batch", type=int, default=8, help="rows per step")
    args = p.parse_args(argv)
    try:
        configs = {name: models.config(name) for name in args.model.split(",")}
    except PolyshardError as e:
        raise SystemExit(str(e)) from None
    ps.init()
    print("| model | recompute | offload | estimate | measured | estimate / measured | measured activations |")
    print("|---|---|---|---:|---:|---:|---:|")
    for name, cfg in configs.items():
        g = torch.Generator().manual_seed(0)
        batch = tuple(torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), generator=g) for _ in range(2))
        graph = capture(models.build(name, "meta"), batch)
        plain = None
        for recompute, offload in SETTINGS:
            measured, plan = measure(name, batch, recompute, offload)
            estimate = estimate_memory(graph, plan).total_bytes
            plain = plain or measured
            print(f"| {name} | {recompute} | {offload} | {format_bytes(estimate)} | {format_bytes(measured['total'])} "
                  f"| {estimate / measured['total']:.3f} | {format_bytes(measured['activation'])} "
                  f"({measured['activation'] / plain['activation']:.0%}) |", flush=True)
            print(json.dumps({"bench": "memory", "model": name, "batch": args.batch, "recompute": recompute,
                              "offload": offload, "estimate_bytes": estimate, "measured": measured}),
                  file=__import__("sys").stderr)
        limit = LIMIT_SHARE * plain["total"]
        meta = models.build(name, "meta")
        chosen, _ = search(meta, meta.example_inputs(1), Cluster.preset("cpu-gloo:1"), args.batch, limit,
                           meshes=[(("dp", 1),)])
        measured, _ = measure(name, batch, plan=chosen)
        print(f"\n{name}: limit {format_bytes(limit)} ({LIMIT_SHARE:.0%} of the plain peak); the planner chose "
              f"recompute {chosen.recompute}, offload {chosen.offload}, {chosen.micro_batches} micro-batches; "
              f"measured peak {format_bytes(measured['total'])}: "
              f"{'within' if measured['total'] <= limit else 'OVER'} the limit\n")


if __name__ == "__main__":
    main()
