"""Checkpoint benchmark: polyshard's save and load against torch DCP called directly on the same state.

    torchrun --nproc-per-node 4 bench/bench_checkpoint.py --mesh dp=2,tp=2 --zero 1

One run builds a GPT under the mesh, takes one AdamW step (so the optimizer has state) and then, alternating
``--rounds`` times, saves and loads that state with ``ps.save``/``ps.load`` (manifest, hashes, commit by
rename, ZeRO shards gathered into each parameter's piece) and with ``dcp.save``/``dcp.load`` on the same
tensors: seconds per GiB of state and the ratio polyshard / DCP (medians). Then it trains ``--steps``
steps three ways, interleaved: no checkpoints, a blocking save every ``--every`` steps, and an async save
every ``--every`` steps; the step-time overhead is each one's median step time over the no-save run's.
Bytes on disk (data files) are compared with the state's bytes counted once per tensor, as one device holds it.
Rank 0 prints a markdown table and one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import polyshard as ps
from polyshard import models
from polyshard.data.corpus import TokenBatches, load_corpus
from polyshard.runtime import training_state
from polyshard.train.trainer import make_optimizer, train_step

GIB = 1 << 30


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt:layers=4,hidden=512,heads=8,seq=64,vocab=8192")
    p.add_argument("--mesh", default="dp=2,tp=2")
    p.add_argument("--zero", type=int, default=1, help="optimizer parallel level (default 1)")
    p.add_argument("--rounds", type=int, default=3, help="save/load rounds per system (default 3)")
    p.add_argument("--steps", type=int, default=12, help="training steps per way of saving (default 12)")
    p.add_argument("--every", type=int, default=4, help="steps between checkpoints (default 4)")
    p.add_argument("--dir", default="", help="where to write (default: a temporary folder)")
    return p.parse_args(argv)


def timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    """Bytes of every tensor as one device holds it (global shape), each counted once."""
    return sum(t.numel() * t.element_size() for t in state.values())


def data_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.suffix == ".distcp")


def main() -> None:
    args = parse_args()
    mesh = ps.init(args.mesh)
    model = models.build(args.model, seed=0)
    rows = 8 // mesh.num_data_shards
    pm = ps.parallelize(model, example_inputs=model.example_inputs(rows))
    pm.plan = dataclasses.replace(pm.plan, zero=args.zero if mesh.num_data_shards > 1 else 0)
    where = [args.dir or (tempfile.mkdtemp(prefix="polyshard-bench-ckpt-") if dist.get_rank() == 0 else "")]
    dist.broadcast_object_list(where)
    root = Path(where[0])
    opt = make_optimizer(pm, 1e-3, str(root / "offload"))
    batches = TokenBatches(load_corpus(), 8, model.cfg.seq_len, 0)
    train_step(pm, opt, *pm.local_batch(*next(batches)))
    lead = dist.get_rank() == 0
    state = training_state.state_dict(pm, opt)
    nbytes = state_bytes(state)

    times: dict[str, list[float]] = {k: [] for k in ("ps_save", "dcp_save", "ps_load", "dcp_load")}
    for r in range(args.rounds):
        times["ps_save"].append(timed(lambda: training_state.save(root / "ps", pm, opt, r + 1).wait()))
        times["dcp_save"].append(timed(lambda: dcp.save(state, checkpoint_id=str(root / "dcp" / str(r)))))
        times["ps_load"].append(timed(lambda: training_state.load(root / "ps" / f"step-{r + 1:08d}", pm, opt)))
        times["dcp_load"].append(timed(lambda: dcp.load(state, checkpoint_id=str(root / "dcp" / str(r)))))
    on_disk = data_bytes(root / "ps" / f"step-{args.rounds:08d}")

    step_s: dict[str, list[float]] = {"none": [], "blocking": [], "async": []}
    group = dist.new_group(backend="gloo")
    pending = None
    for i in range(args.steps):
        for way in step_s:  # interleaved, so load on the machine hits all three alike
            x, y = pm.local_batch(*next(batches))
            dist.barrier()
            t0 = time.perf_counter()
            train_step(pm, opt, x, y)
            if way != "none" and (i + 1) % args.every == 0:
                if pending is not None:
                    pending.wait()
                pending = training_state.save(root / way, pm, opt, i + 1, keep=1, async_save=way == "async",
                                              group=group)
                if way == "blocking":
                    pending.wait()
                    pending = None
            step_s[way].append(time.perf_counter() - t0)
    if pending is not None:
        pending.wait()
    dist.barrier()

    if lead:
        med = {k: statistics.median(v) for k, v in times.items()}
        step = {k: statistics.median(v) for k, v in step_s.items()}
        mean = {k: statistics.fmean(v) for k, v in step_s.items()}
        gib = nbytes / GIB
        out = {"model": args.model, "mesh": args.mesh, "zero": pm.plan.zero, "state_bytes": nbytes,
               "disk_bytes": on_disk,
               "save_s_per_gib": {"polyshard": med["ps_save"] / gib, "dcp": med["dcp_save"] / gib},
               "load_s_per_gib": {"polyshard": med["ps_load"] / gib, "dcp": med["dcp_load"] / gib},
               "save_ratio": med["ps_save"] / med["dcp_save"], "load_ratio": med["ps_load"] / med["dcp_load"],
               "step_mean_s": mean, "step_median_s": step,
               "overhead_blocking": mean["blocking"] / mean["none"], "overhead_async": mean["async"] / mean["none"],
               "torch": torch.__version__}
        print(f"state {nbytes / 2**20:.1f} MiB, on disk {on_disk / 2**20:.1f} MiB "
              f"(ratio {on_disk / nbytes:.3f}), {args.mesh}, ZeRO {pm.plan.zero}")
        print("| | polyshard | torch DCP | ratio |\n|---|---:|---:|---:|")
        print(f"| save, s/GiB | {out['save_s_per_gib']['polyshard']:.2f} | {out['save_s_per_gib']['dcp']:.2f} | "
              f"{out['save_ratio']:.3f} |")
        print(f"| load, s/GiB | {out['load_s_per_gib']['polyshard']:.2f} | {out['load_s_per_gib']['dcp']:.2f} | "
              f"{out['load_ratio']:.3f} |")
        print(f"step time (mean, every {args.every} steps): none {mean['none'] * 1e3:.1f} ms, blocking save "
              f"{mean['blocking'] * 1e3:.1f} ms (x{out['overhead_blocking']:.3f}), async save "
              f"{mean['async'] * 1e3:.1f} ms (x{out['overhead_async']:.3f})")
        print(json.dumps(out))
        if not args.dir:
            shutil.rmtree(root)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
