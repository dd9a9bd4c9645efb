"""Optimizer parallel benchmark: polyshard ZeRO levels 1, 2, 3 against torch FSDP2, in one run.

    torchrun --nproc-per-node 4 bench/bench_zero.py

Every system trains the same GPT (same seed, same weights) on the same global batches with AdamW over a
data-parallel group of all ranks. FSDP2 is ``fully_shard`` on each block and on the root; polyshard's
level 3 gets the same gather units by marking the root and each block as comm_fusion groups. Timing
follows bench_core.py: warm-up steps (first losses must agree), then interleaved rounds (each system takes
turns every --block steps), median tokens/s per system, ratio = polyshard / FSDP2.

Memory per rank, after a step: bytes of parameters + gradients + optimizer state held (distinct storages;
FSDP2's DTensors counted by their local shards), and the growth of the process's resident set while the
system was built and warmed up (systems share one process, so this is approximate: the allocator keeps
freed memory). Rank 0 prints a markdown table and one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import polyshard as ps  # noqa: E402
from bench_core import NUM_BATCHES, System, build_model, make_batches, mean_loss, rank_rows, tokens_per_s  # noqa: E402
from training import train_step  # noqa: E402
from polyshard import models  # noqa: E402
from polyshard.runtime.zero import setup_zero  # noqa: E402

LR = 1e-3


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-small", choices=sorted(models.CONFIGS))
    p.add_argument("--levels", default="1,2,3", help="polyshard ZeRO levels to run, comma-separated")
    p.add_argument("--steps", type=int, default=10, help="timed steps per round and system")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per system before the rounds")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per system (interleaved)")
    p.add_argument("--block", type=int, default=5, help="within a round the systems take turns every BLOCK steps")
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threshold", type=int, default=64 * 1024,
                   help="bytes below which a parameter stays whole (default 64 KiB; 0 shards all, as FSDP2 does)")
    return p.parse_args(argv)


def optimizer_state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every state tensor of a torch optimizer (moments, step counters)."""
    return [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]


def held_bytes(params, grads, state) -> int:
    """Bytes of the distinct storages behind these tensors (DTensors by their local shard)."""
    seen, total = set(), 0
    for t in (*params, *grads, *state):
        t = t.to_local() if hasattr(t, "to_local") else t
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PolyshardZero(System):
    def __init__(self, cfg, seed: int, batches, level: int, threshold: int):
        self.name = f"polyshard zero-{level}"
        model = build_model(cfg, seed)
        if level == 3:  # FSDP2's units: the root's own parameters, and each block
            ps.comm_fusion(model, 0)
            for i, block in enumerate(model.blocks):
                ps.comm_fusion(block, i + 1)
        mesh = ps.current_mesh()
        example = tuple(t.chunk(mesh.num_data_shards)[mesh.data_index] for t in batches[0])
        self.pm = ps.parallelize(model, example_inputs=example)
        self.local = [self.pm.local_batch(x, y) for x, y in batches]
        self.opt = setup_zero(self.pm, level, "adamw", threshold_bytes=threshold, lr=LR)

    def step(self, i: int) -> torch.Tensor:
        return train_step(self.pm, self.opt, *self.local[i % len(self.local)])

    def held(self) -> int:
        params = list(self.pm.parameters()) + [b.master for b in self.opt.buckets]
        state = optimizer_state(self.opt.optimizer)
        return held_bytes(params, [p.grad for p in params if p.grad is not None], state)

    def close(self) -> None:
        self.opt.remove()
        del self.pm, self.opt


class TorchFSDP2(System):
    def __init__(self, cfg, seed: int, batches):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.name = "torch FSDP2"
        self.local = rank_rows(batches)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
        self.model = build_model(cfg, seed)
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)

    def step(self, i: int) -> torch.Tensor:
        return train_step(self.model, self.opt, *self.local[i % len(self.local)])

    def held(self) -> int:
        params = list(self.model.parameters())
        state = optimizer_state(self.opt)
        return held_bytes(params, [p.grad for p in params if p.grad is not None], state)

    def close(self) -> None:
        del self.model, self.opt


class DeepSpeedZero3(TorchFSDP2):
    """DeepSpeed's ZeRO stage 3 (when it is installed): its engine over torch's AdamW, on gloo."""

    def __init__(self, cfg, seed: int, batches):
        import deepspeed

        self.name = "DeepSpeed ZeRO-3"
        self.local = rank_rows(batches)
        model = build_model(cfg, seed)
        config = {"train_micro_batch_size_per_gpu": self.local[0][0].size(0), "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True}
        self.model, self.opt, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(),
                                                        lr=LR), config=config)

    def step(self, i: int) -> torch.Tensor:
        loss = self.model(*self.local[i % len(self.local)])
        self.model.backward(loss)
        self.model.step()
        return loss.detach()

    def held(self) -> int:
        params = list(self.model.module.parameters())
        state = optimizer_state(self.opt.optimizer)
        return held_bytes([p.ds_tensor for p in params], [], state + list(self.opt.fp32_partitioned_groups_flat))


def main(argv=None) -> None:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ps.init(f"dp={world}")  # gloo, 1 thread per rank
    rank = dist.get_rank()
    cfg = models.CONFIGS[args.model]
    if args.batch % world or min(args.warmup, args.steps, args.rounds) < 1:
        raise SystemExit(f"--batch must be a multiple of {world}; --warmup, --steps, --rounds at least 1")
    batches = make_batches(cfg, args.batch, NUM_BATCHES)

    systems, losses, rss = [], {}, {}
    makers = [lambda lv=int(lv): PolyshardZero(cfg, args.seed, batches, lv, args.threshold)
              for lv in args.levels.split(",")]
    deepspeed = [lambda: DeepSpeedZero3(cfg, args.seed, batches)] if _has_deepspeed() else []
    if rank == 0 and not deepspeed:
        print("DeepSpeed is not installed: compared with FSDP2 only", flush=True)
    for make in [lambda: TorchFSDP2(cfg, args.seed, batches), *deepspeed, *makers]:
        before = rss_bytes()
        s = make()
        losses[s.name] = [mean_loss(s.step(i), "dp") for i in range(args.warmup)]
        rss[s.name] = rss_bytes() - before
        systems.append(s)
    base = systems[0]
    held = {s.name: s.held() for s in systems}
    if rank == 0:
        for s in systems[1:]:
            a, b = losses[s.name][0], losses[base.name][0]
            print(f"first loss: {s.name} {a:.6f}  {base.name} {b:.6f}  rel diff {abs(a - b) / abs(b):.1e}", flush=True)

    tps = tokens_per_s(systems, args, args.steps * args.batch * cfg.seq_len)
    med = {name: statistics.median(v) for name, v in tps.items()}
    if rank == 0:
        print(f"\n{args.model}, dp={world}, global batch {args.batch} x {cfg.seq_len} tokens, AdamW\n")
        print("| system | tokens/s | ratio to FSDP2 | paired | params+grads+optimizer per rank | RSS growth |")
        print("|--------|---------:|---------------:|-------:|------------------:|-----------:|")
        for s in systems:
            paired = statistics.median(a / b for a, b in zip(tps[s.name], tps[base.name]))
            print(f"| {s.name} | {med[s.name]:,.0f} | {med[s.name] / med[base.name]:.3f} | {paired:.3f} "
                  f"| {held[s.name] / 2**20:.2f} MiB | {rss[s.name] / 2**20:.1f} MiB |")
        print(json.dumps({
            "bench": "zero", "model": args.model, "ranks": world, "batch": args.batch, "steps": args.steps,
            "rounds": args.rounds, "baseline": base.name,
            "tok_s": {k: round(v, 1) for k, v in med.items()},
            "ratio": {k: round(v / med[base.name], 4) for k, v in med.items()},
            "held_bytes": held, "rss_growth_bytes": rss,
            "first_loss": {k: v[0] for k, v in losses.items()}, "torch": torch.__version__,
        }), flush=True)

    for s in systems:
        s.close()
    del systems, base
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def _has_deepspeed() -> bool:
    """Whether DeepSpeed imports (it is optional: the comparison runs when it is installed)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    main()
