"""Pipeline benchmark: polyshard's pipeline against torch.distributed.pipelining on the same GPT split.

    PYTHONPATH=. torchrun --nproc-per-node 2 bench/bench_pipeline.py --schedule 1f1b --micro-batches 4

Both systems train the same GPT (untied head, same seed, same batches, AdamW) cut into pp=WORLD
stages of equal numbers of blocks. polyshard: ``ps.parallelize`` on a ``pp=WORLD`` mesh (its split of
the captured graph, its schedule, ``train_step``). torch: ``PipelineStage`` over whole-block
nn.Module stages written here, run by ``ScheduleGPipe`` or ``Schedule1F1B``. They are timed in
alternating blocks (ABBA), so machine noise hits both alike. Then polyshard records a few steps'
action times: the measured bubble fraction against the theory, (p-1)/(m+p-1), and against the cost
model's simulated schedule; the last recorded step is drawn to ``--timeline``.
Rank 0 prints a markdown table row and a JSON line.
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
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import polyshard as ps  # noqa: E402
from polyshard import models  # noqa: E402
from polyshard.cluster import Cluster  # noqa: E402
from polyshard.planner.stages import predict_timings  # noqa: E402
from polyshard.runtime.timeline import bubble_fraction, draw_timeline  # noqa: E402

TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedule", choices=sorted(TORCH_SCHEDULES), default="1f1b")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--rounds", type=int, default=4, help="timed blocks per system")
    p.add_argument("--block", type=int, default=4, help="steps per timed block")
    p.add_argument("--record", type=int, default=5, help="polyshard steps whose action times are recorded")
    p.add_argument("--timeline", default="runs/pipeline-timeline.png")
    return p.parse_args()


class TorchStage(nn.Module):
    """Blocks ``lo..hi`` of ``gpt`` as a plain module, with the embeddings on the first stage and
    the final norm and head on the last (what a torch.distributed.pipelining user writes)."""

    def __init__(self, gpt: models.GPT, lo: int, hi: int):
        super().__init__()
        self.first, self.last = lo == 0, hi == len(gpt.blocks)
        self.embed = nn.ModuleList([gpt.wte, gpt.wpe]) if self.first else None
        self.blocks = nn.ModuleList(gpt.blocks[lo:hi])
        self.head = nn.Sequential(gpt.ln_f, gpt.lm_head) if self.last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.embed[0](x) + self.embed[1](torch.arange(x.size(1)))
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.last else x


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class Polyshard:
    def __init__(self, cfg, args, example):
        torch.manual_seed(0)
        self.pm = ps.parallelize(models.GPT(cfg), example_inputs=example, schedule=args.schedule,
                                 micro_batches=args.micro_batches)
        self.opt = torch.optim.AdamW(self.pm.parameters(), lr=1e-3)

    def step(self, x, y, record: bool = False) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        loss = self.pm.train_step(x, y, record=record)
        self.opt.step()
        return loss


class TorchPipelining:
    def __init__(self, cfg, args, pp: int, stage: int):
        torch.manual_seed(0)
        gpt = models.GPT(cfg)
        per = cfg.num_layers // pp
        self.module = TorchStage(gpt, stage * per, (stage + 1) * per)
        self.first, self.last = stage == 0, stage == pp - 1
        pipe = PipelineStage(self.module, stage, pp, torch.device("cpu"))
        self.schedule = TORCH_SCHEDULES[args.schedule](pipe, args.micro_batches, loss_fn=loss_fn)
        self.opt = torch.optim.AdamW(self.module.parameters(), lr=1e-3)

    def step(self, x, y) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        args = (x,) if self.first else ()
        self.schedule.step(*args, **({"target": y, "losses": losses} if self.last else {}))
        self.opt.step()
        return torch.stack(losses).mean().detach() if losses else torch.zeros(())


def timed(system, batches, steps: int) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(steps):
        system.step(*batches[i % len(batches)])
    dist.barrier()
    return time.perf_counter() - t0


def main() -> None:
    args = parse_args()
    pp = int(os.environ["WORLD_SIZE"])
    mesh = ps.init(f"pp={pp}")
    lead = mesh.rank == 0
    cfg = dataclasses.replace(models.CONFIGS["gpt-tiny"], num_layers=args.layers, hidden=args.hidden,
                              num_heads=8, seq_len=args.seq, tied=False)
    g = torch.Generator().manual_seed(0)
    batches = [tuple(torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), generator=g) for _ in range(2))
               for _ in range(4)]
    systems = {"polyshard": Polyshard(cfg, args, batches[0]), "torch": TorchPipelining(cfg, args, pp, mesh.stage)}
    first = {name: s.step(*batches[0]) for name, s in systems.items()}
    dist.broadcast(first["torch"], src=pp - 1)
    times: dict[str, list[float]] = {name: [] for name in systems}
    for r in range(args.rounds):
        for name in (("polyshard", "torch") if r % 2 == 0 else ("torch", "polyshard")):
            times[name].append(timed(systems[name], batches, args.block))
    recorded = []
    for i in range(args.record):
        systems["polyshard"].step(*batches[i % len(batches)], record=True)
        recorded.append(systems["polyshard"].pm.gather_timings())
    pm = systems["polyshard"].pm
    with torch.device("meta"):
        predicted = predict_timings(models.GPT(cfg), batches[0], pm.plan, pp, mesh.cluster or Cluster.from_env())
    if not lead:
        return
    os.makedirs(os.path.dirname(args.timeline) or ".", exist_ok=True)
    draw_timeline(args.timeline, predicted, recorded[-1],
                  title=f"GPT {cfg.num_layers}x{cfg.hidden}, pp={pp}, {args.schedule}, m={args.micro_batches}")
    tokens = args.block * args.batch * cfg.seq_len
    tok_s = {name: statistics.median(tokens / t for t in v) for name, v in times.items()}
    paired = statistics.median(b / a for a, b in zip(times["polyshard"], times["torch"]))
    m = args.micro_batches
    row = {"bench": "pipeline", "schedule": args.schedule, "pp": pp, "micro_batches": m, "hidden": cfg.hidden,
           "layers": cfg.num_layers, "batch": args.batch, "seq": cfg.seq_len,
           "polyshard_tok_s": round(tok_s["polyshard"], 1), "torch_tok_s": round(tok_s["torch"], 1),
           "ratio": round(tok_s["polyshard"] / tok_s["torch"], 3), "paired_ratio": round(paired, 3),
           "bubble_measured": round(statistics.median(bubble_fraction(t) for t in recorded), 3),
           "bubble_predicted": round(bubble_fraction(predicted), 3), "bubble_theory": round((pp - 1) / (m + pp - 1), 3),
           "first_loss": {name: round(v.item(), 6) for name, v in first.items()},
           "timeline": args.timeline, "torch": torch.__version__}
    print(f"first loss: polyshard {first['polyshard'].item():.6f}  torch {first['torch'].item():.6f}")
    print("| schedule | pp | m | polyshard tok/s | torch.distributed.pipelining tok/s | ratio | paired "
          "| bubble measured | predicted | theory (p-1)/(m+p-1) |")
    print(f"| {args.schedule} | {pp} | {m} | {row['polyshard_tok_s']:,.0f} | {row['torch_tok_s']:,.0f} | "
          f"{row['ratio']:.3f} | {row['paired_ratio']:.3f} | {row['bubble_measured']:.3f} | "
          f"{row['bubble_predicted']:.3f} | {row['bubble_theory']:.3f} |")
    print(json.dumps(row))


if __name__ == "__main__":
    main()
    gc.collect()  # drop the models before the process group goes (gloo aborts otherwise, now and then)
    dist.barrier()
    dist.destroy_process_group()
