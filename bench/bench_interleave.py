"""Multi-copy benchmark: step time with the batch run as 1 vs 2 interleaved copies, on tp=N.

    torchrun --nproc-per-node 4 bench/bench_interleave.py            # tp=4, a GPT sized so communication matters

Both settings train the same GPT from the same weights on the same batches (AdamW). They are
timed in alternating blocks so machine noise hits both alike. A torch profiler pass per setting
writes a Chrome trace (open it in chrome://tracing or Perfetto) from which rank 0 measures
  hidden: the share of the collectives' time (gloo's worker threads) during which the main thread
          was computing (matrix products, attention), i.e. communication overlapped by compute;
  exposed: the time per step the main thread spent blocked waiting for collectives.
Rank 0 prints the planner's predicted step times, a table row and a JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import polyshard as ps  # noqa: E402
from training import train_step  # noqa: E402
from polyshard import models  # noqa: E402
from polyshard.graph.capture import capture  # noqa: E402
from polyshard.planner.cost.overlap import choose_copies  # noqa: E402
from polyshard.planner.propagate import propagate  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5, help="timed blocks per setting")
    p.add_argument("--block", type=int, default=4, help="steps per timed block")
    p.add_argument("--trace-dir", default="runs", help="where the Chrome traces go (interleave-N.json)")
    return p.parse_args()


class Trainer:
    def __init__(self, cfg, copies: int, batches):
        torch.manual_seed(0)
        model = models.GPT(cfg)
        self.pm = ps.parallelize(model, example_inputs=batches[0], copies=copies)
        self.opt = torch.optim.AdamW(self.pm.parameters(), lr=1e-3)
        self.batches = batches

    def step(self, i: int) -> torch.Tensor:
        return train_step(self.pm, self.opt, *self.batches[i % len(self.batches)])


COMPUTE_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product_flash_attention_for_cpu")


def profile_trace(trainer: Trainer, steps: int, path: str | None) -> dict | None:
    """Profile ``steps`` steps (every rank, in lock step); with a ``path``, write the Chrome trace
    there and return the hidden share and exposed wait measured from it."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            trainer.step(i)
    if path is None:
        return None
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and isinstance(e.get("tid"), int)]
    main_tid = max(set(e["tid"] for e in events), key=lambda t: sum(e["tid"] == t for e in events))
    compute = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["tid"] == main_tid and e["name"] in COMPUTE_OPS]
    comm = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith("gloo:")]
    overlapped = sum(max(0, min(b, d) - max(a, c)) for a, b in comm for c, d in compute)
    waits = sum(e["dur"] for e in events if e["tid"] == main_tid and e["name"].endswith("wait_tensor"))
    return {"hidden": overlapped / max(sum(b - a for a, b in comm), 1), "exposed_ms": waits / 1e3 / steps}


def main() -> None:
    args = parse_args()
    mesh = ps.init({"tp": int(os.environ["WORLD_SIZE"])})
    lead = dist.get_rank() == 0
    cfg = dataclasses.replace(models.CONFIGS["gpt-tiny"], num_layers=args.layers, hidden=args.hidden,
                              num_heads=8, seq_len=args.seq)
    g = torch.Generator().manual_seed(0)
    batches = [tuple(torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), generator=g) for _ in range(2))
               for _ in range(4)]
    systems = {k: Trainer(cfg, k, batches) for k in (1, 2)}
    first = {k: s.step(0).item() for k, s in systems.items()}
    if lead:
        meta = models.GPT(cfg).to("meta")
        gm = capture(meta, batches[0])
        plan = propagate(gm, mesh.op_axes, lambda m: None)
        plan = dataclasses.replace(plan, mesh=mesh.axes)
        chosen, predicted = choose_copies(gm, plan, mesh.cluster, args.batch)
        print(f"first loss: 1 copy {first[1]:.6f}  2 copies {first[2]:.6f}")
        print("planner: predicted step " + ", ".join(f"{k} copies {v * 1e3:.1f} ms" for k, v in predicted.items())
              + f"; chooses {chosen}")
    times = {1: [], 2: []}
    for r in range(args.rounds):
        for k in ((1, 2) if r % 2 == 0 else (2, 1)):
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(args.block):
                systems[k].step(i)
            dist.barrier()
            times[k].append((time.perf_counter() - t0) / args.block)
    step = {k: statistics.median(v) for k, v in times.items()}
    measured = {}
    for k in (1, 2):
        os.makedirs(args.trace_dir, exist_ok=True)
        measured[k] = profile_trace(systems[k], args.block, os.path.join(args.trace_dir, f"interleave-{k}.json") if lead else None)
    if lead:
        row = {"bench": "interleave", "tp": mesh.world_size, "hidden": cfg.hidden, "layers": cfg.num_layers,
               "seq": cfg.seq_len, "batch": args.batch, "step_ms_1": round(step[1] * 1e3, 1),
               "step_ms_2": round(step[2] * 1e3, 1), "speedup": round(step[1] / step[2], 3),
               "hidden_share_1": round(measured[1]["hidden"], 3), "hidden_share_2": round(measured[2]["hidden"], 3),
               "exposed_wait_ms_1": round(measured[1]["exposed_ms"], 1),
               "exposed_wait_ms_2": round(measured[2]["exposed_ms"], 1), "torch": torch.__version__}
        print(f"| tp={mesh.world_size} h={cfg.hidden} L={cfg.num_layers} T={cfg.seq_len} B={args.batch} "
              f"| {row['step_ms_1']} | {row['step_ms_2']} | {row['speedup']} | "
              f"{row['hidden_share_1']:.0%} -> {row['hidden_share_2']:.0%} | "
              f"{row['exposed_wait_ms_1']} -> {row['exposed_wait_ms_2']} |")
        print(json.dumps(row))
    systems.clear()
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
