"""Core throughput benchmark: polyshard against torch's own parallel wrappers, in one run.

    torchrun --nproc-per-node 4 bench/bench_core.py --case dp   # polyshard dp=N vs torch DDP
    torchrun --nproc-per-node 2 bench/bench_core.py --case tp   # polyshard tp=N vs torch parallelize_module

Both systems train the same GPT (same seed, same initial weights) on the same global batches
with AdamW. After a few warm-up steps each, the systems are timed in interleaved rounds: within
a round they take turns every --block steps (ABBA order), so machine noise hits both alike.
The figure for each system is the median over rounds. Rank 0 prints the warm-up losses of
each system (the first must agree), one table row, and one JSON line; nothing is written to disk.

tokens/s counts the global batch: steps * batch * seq_len / seconds.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import polyshard as ps  # noqa: E402
from training import train_step  # noqa: E402
from polyshard import models  # noqa: E402

LR = 1e-3
NUM_BATCHES = 4  # distinct global batches, cycled through by every system in the same order


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", choices=["dp", "tp"], required=True)
    p.add_argument("--model", default="gpt-small", choices=sorted(models.CONFIGS))
    p.add_argument("--steps", type=int, default=20, help="timed steps per round and system")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per system before the rounds")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per system (interleaved)")
    p.add_argument("--block", type=int, default=5,
                   help="within a round the systems take turns every BLOCK steps (noise hits both alike)")
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    p.add_argument("--untied", action="store_true", help="untie the LM head from the token embedding (both sides)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def make_batches(cfg, batch: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for s in range(n):
        g = torch.Generator().manual_seed(1000 + s)
        out.append((torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g),
                    torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g)))
    return out


def build_model(cfg, seed: int) -> models.GPT:
    torch.manual_seed(seed)
    return models.GPT(cfg)


class System:
    """One trainable system: ``step(i)`` trains one step on global batch ``i`` and returns the loss."""

    name: str

    def step(self, i: int) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        pass


class Polyshard(System):
    def __init__(self, cfg, seed: int, batches):
        self.name = "polyshard"
        model = build_model(cfg, seed)
        mesh = ps.current_mesh()
        n, i = mesh.num_data_shards, mesh.data_index
        example = tuple(t.chunk(n)[i] for t in batches[0])  # one rank's batch: shapes for capture
        self.pm = ps.parallelize(model, example_inputs=example)
        # this rank's rows of every global batch, cut once before timing (as for the baseline)
        self.local = [self.pm.local_batch(x, y) for x, y in batches]
        self.opt = torch.optim.AdamW(self.pm.parameters(), lr=LR)

    def step(self, i: int) -> torch.Tensor:
        return train_step(self.pm, self.opt, *self.local[i % len(self.local)])

    def close(self) -> None:
        del self.pm, self.opt


def rank_rows(batches) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's rows of each global batch, over a data-parallel group of every rank."""
    world, rank = dist.get_world_size(), dist.get_rank()
    return [(x.chunk(world)[rank], y.chunk(world)[rank]) for x, y in batches]


class TorchDDP(System):
    def __init__(self, cfg, seed: int, batches):
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.name = "torch DDP"
        self.local = rank_rows(batches)
        self.model = DDP(build_model(cfg, seed))  # gloo, default buckets (25 MiB, first 1 MiB)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)

    def step(self, i: int) -> torch.Tensor:
        return train_step(self.model, self.opt, *self.local[i % len(self.local)])

    def close(self) -> None:
        del self.model, self.opt


class TorchTP(System):
    """torch.distributed.tensor.parallel with polyshard's split: q/k/v/fc column, proj row,
    token embedding and LM head split over the vocabulary, loss_parallel cross-entropy."""

    def __init__(self, cfg, seed: int, batches):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                                       parallelize_module)

        self.name = "torch TP"
        self.batches = batches
        self.loss_parallel = loss_parallel
        model = build_model(cfg, seed)
        tp_mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
        plan = {
            "wte": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        }
        for i in range(cfg.num_layers):
            b = f"blocks.{i}"
            plan.update({f"{b}.attn.q": ColwiseParallel(), f"{b}.attn.k": ColwiseParallel(),
                         f"{b}.attn.v": ColwiseParallel(), f"{b}.attn.proj": RowwiseParallel(),
                         f"{b}.mlp.fc": ColwiseParallel(), f"{b}.mlp.proj": RowwiseParallel()})
        self.model = parallelize_module(model, tp_mesh, plan)
        if cfg.tied:
            # parallelize_module distributes wte.weight and lm_head.weight separately; both are
            # Shard(0) over the vocabulary, so sharing one DTensor restores the tie.
            self.model.lm_head.weight = self.model.wte.weight
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)

    def step(self, i: int) -> torch.Tensor:
        return train_step(self.model, self.opt, *self.batches[i % len(self.batches)], self.loss_parallel).full_tensor()

    def close(self) -> None:
        del self.model, self.opt


def mean_loss(loss: torch.Tensor, case: str) -> float:
    """The global-batch loss: dp ranks hold their rows' mean, tp ranks hold the whole mean."""
    if case == "dp":
        loss = loss.clone()
        dist.all_reduce(loss)
        loss /= dist.get_world_size()
    return loss.item()


def timed(system: System, steps: int, start: int) -> float:
    """Seconds for ``steps`` steps on every rank (barriers on both sides)."""
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(start, start + steps):
        system.step(i)
    dist.barrier()
    return time.perf_counter() - t0


def timed_round(systems, steps: int, block: int, start: int, flip: bool) -> dict[str, float]:
    """One round: each system runs ``steps`` steps, taking turns every ``block`` steps."""
    order = systems[::-1] if flip else systems
    out = {s.name: 0.0 for s in systems}
    done = 0
    while done < steps:
        n = min(block, steps - done)
        for s in order:
            out[s.name] += timed(s, n, start + done)
        done += n
        order = order[::-1]  # ABBA...: neither system always goes first
    return out


def tokens_per_s(systems, args, tokens: int) -> dict[str, list[float]]:
    """Each system's tokens per second in every round after the warm-up, ``tokens`` per round's ``args.steps``."""
    times: dict[str, list[float]] = {s.name: [] for s in systems}
    start = args.warmup
    for r in range(args.rounds):
        for name, t in timed_round(systems, args.steps, max(1, args.block), start, flip=r % 2 == 1).items():
            times[name].append(t)
        start += args.steps
    return {name: [tokens / t for t in ts] for name, ts in times.items()}


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    mesh_text = f"{args.case}={world}"
    ps.init(mesh_text)  # gloo process group, 1 thread per rank
    rank = dist.get_rank()
    torch.set_num_threads(1)

    cfg = models.CONFIGS[args.model]
    if args.untied:
        cfg = dataclasses.replace(cfg, tied=False)
    if args.case == "dp" and args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be a multiple of {world} for dp")
    if min(args.warmup, args.steps, args.rounds) < 1:
        raise SystemExit("--warmup, --steps and --rounds must be at least 1")
    batches = make_batches(cfg, args.batch, NUM_BATCHES)

    ours = Polyshard(cfg, args.seed, batches)
    base = TorchDDP(cfg, args.seed, batches) if args.case == "dp" else TorchTP(cfg, args.seed, batches)
    systems = (ours, base)

    # Warm-up: the first step of each starts from the same weights on the same batch, so the
    # losses must agree; the last warm-up loss checks that training stays together.
    losses = {s.name: [mean_loss(s.step(i), args.case) for i in range(args.warmup)] for s in systems}
    if rank == 0:
        for k in sorted({0, args.warmup - 1}):
            a, b = losses[ours.name][k], losses[base.name][k]
            print(f"warm-up step {k + 1} loss: polyshard {a:.6f}  {base.name} {b:.6f}  "
                  f"rel diff {abs(a - b) / abs(b):.1e}", flush=True)

    tps = tokens_per_s(systems, args, args.steps * args.batch * cfg.seq_len)
    med = {name: statistics.median(v) for name, v in tps.items()}
    ratio = med[ours.name] / med[base.name]
    # per-round ratio (both systems timed in the same round): less sensitive to load drift
    paired = statistics.median(a / b for a, b in zip(tps[ours.name], tps[base.name]))
    if rank == 0:
        print(f"| {args.model} | {args.case}={world} | {med[ours.name]:,.0f} | {base.name} {med[base.name]:,.0f} "
              f"| {ratio:.3f} | paired {paired:.3f} |", flush=True)
        print(json.dumps({
            "bench": "core", "case": args.case, "model": args.model, "ranks": world, "tied": cfg.tied,
            "batch": args.batch, "seq_len": cfg.seq_len, "steps": args.steps, "rounds": args.rounds, "block": args.block,
            "baseline": base.name, "polyshard_tok_s": round(med[ours.name], 1),
            "baseline_tok_s": round(med[base.name], 1), "ratio": round(ratio, 4),
            "paired_ratio": round(paired, 4),
            "polyshard_rounds": [round(v, 1) for v in tps[ours.name]],
            "baseline_rounds": [round(v, 1) for v in tps[base.name]],
            "first_loss": {"polyshard": losses[ours.name][0], "baseline": losses[base.name][0]},
            "torch": torch.__version__,
        }), flush=True)

    for s in systems:
        s.close()
    del ours, base, systems
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
