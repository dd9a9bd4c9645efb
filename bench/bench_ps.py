"""Parameter-server throughput (sync and async) against data-parallel all-reduce on a wide-embedding click model.

Every system trains the same model (`recsys-small`, or --rows/--dim) with SGD, on the same global batches,
with --workers processes computing gradients: torch's DistributedDataParallel (gloo) all-reduces the whole
table's gradient each step; polyshard's parameter server moves only the rows a batch touches. Startup is
left out: DDP is timed from its --steps/10-th step to its last, the servers from their first update to their last.

    python bench/bench_ps.py [--steps 400] [--workers 2] [--servers 2] [--batch-size 256]
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from polyshard.models.recsys import ClickModel, RecsysConfig, click_batch
from polyshard.runtime.ps import train_ps
from polyshard.runtime.ps.launch import free_ports


def _ddp_rank(rank: int, world: int, port: int, cfg: RecsysConfig, steps: int, batch: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(ClickModel(cfg))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rows = batch // world
    times = []
    for step in range(steps):
        ids, clicks = click_batch(cfg, step, batch, seed=0)
        opt.zero_grad()
        model(ids[rank * rows:(rank + 1) * rows], clicks[rank * rows:(rank + 1) * rows]).backward()
        opt.step()
        times.append(time.perf_counter())
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def ddp_seconds_per_step(cfg: RecsysConfig, steps: int, batch: int, world: int) -> float:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_ports(1)[0]
    procs = [ctx.Process(target=_ddp_rank, args=(r, world, port, cfg, steps, batch, out)) for r in range(world)]
    for p in procs:
        p.start()
    times = out.get()
    for p in procs:
        p.join()
    skip = steps // 10
    return (times[-1] - times[skip]) / (steps - 1 - skip)


class _Model:
    def __init__(self, cfg: RecsysConfig) -> None:
        self.cfg = cfg

    def __call__(self) -> ClickModel:
        return ClickModel(self.cfg)


class _Batches:
    """Worker rows of global batch ``step``, the rows DDP's rank of the same index trains on."""

    def __init__(self, cfg: RecsysConfig, batch_size: int) -> None:
        self.cfg, self.batch_size = cfg, batch_size

    def __call__(self, step: int, worker: int, workers: int):
        ids, clicks = click_batch(self.cfg, step, self.batch_size, seed=0)
        rows = self.batch_size // workers
        return ids[worker * rows:(worker + 1) * rows], clicks[worker * rows:(worker + 1) * rows]


def ps_seconds_per_step(cfg: RecsysConfig, args, mode: str) -> float:
    """Server 0's time from its first update to its last, per update."""
    result = train_ps(_Model(cfg), _Batches(cfg, args.batch_size), servers=args.servers, workers=args.workers,
                      steps=args.steps, optimizer=functools.partial(torch.optim.SGD, lr=0.1), mode=mode,
                      log_every=10**9)
    return result.seconds / (args.steps - 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--rows", type=int, default=RecsysConfig().rows)
    p.add_argument("--dim", type=int, default=RecsysConfig().dim)
    args = p.parse_args()
    cfg = RecsysConfig(rows=args.rows, dim=args.dim)
    print(f"click model: table {cfg.rows} x {cfg.dim} ({cfg.rows * cfg.dim * 4 / 2**20:.1f} MiB), batch "
          f"{args.batch_size} x {cfg.fields} ids, {args.workers} workers, {args.servers} servers, {args.steps} steps")
    ddp = ddp_seconds_per_step(cfg, args.steps, args.batch_size, args.workers)
    print(f"DDP all-reduce   {ddp * 1e3:8.2f} ms/step  {args.batch_size / ddp:9.0f} examples/s")
    for mode in ("sync", "async"):
        ps = ps_seconds_per_step(cfg, args, mode)
        # async applies one worker's half batch per update: examples per update = batch / workers
        examples = args.batch_size if mode == "sync" else args.batch_size // args.workers
        print(f"PS {mode:5s}         {ps * 1e3:8.2f} ms/update {examples / ps:9.0f} examples/s  "
              f"ratio vs DDP {examples / ps / (args.batch_size / ddp):.2f}")


if __name__ == "__main__":
    main()
