"""How far apart ranks reach a collective after the same work: the wait a step's gradient all-reduce pays
beyond its calibrated time, which `polyshard calibrate` measures the same way as the cluster's arrival skew.

    torchrun --nproc-per-node 4 bench/bench_arrival_spread.py              # 128 KiB all-reduce, 0 .. 20 ms of work
    torchrun --nproc-per-node 2 bench/bench_arrival_spread.py --work-ms 0,5,20

Every rank runs the same number of 128 x 128 products (as many as it ran in WORK ms while every rank ran
them), then one all-reduce; a barrier starts each repeat. Rank 0 prints, per amount of work, each rank's
median wait in the all-reduce and its ratio to the wait after no work (the calibration's case: ranks
arriving together).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def _products_per_ms(a: torch.Tensor, seconds: float = 0.05) -> float:
    """Products per ms on this rank while every rank runs them (the cores shared as in training)."""
    dist.barrier()
    count, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ a
        count += 1
    return count / (seconds * 1e3)


def _median_wait_ms(a: torch.Tensor, payload: torch.Tensor, products: int, repeats: int) -> float:
    waits = []
    for _ in range(repeats):
        dist.barrier()
        for _ in range(products):
            a @ a
        start = time.perf_counter()
        dist.all_reduce(payload)
        waits.append(time.perf_counter() - start)
    return statistics.median(waits) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-ms", default="0,1,2,5,10,20", help="comma-separated work before the all-reduce (ms)")
    p.add_argument("--kib", type=int, default=128, help="all-reduce payload per rank in KiB")
    p.add_argument("--repeats", type=int, default=30, help="all-reduces per amount of work (the median is kept)")
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    a, payload = torch.randn(128, 128), torch.ones(args.kib * 256)
    rate = _products_per_ms(a)
    waits = {}
    for work in (float(w) for w in args.work_ms.split(",")):
        mine = torch.tensor([_median_wait_ms(a, payload, int(rate * work), args.repeats)])
        every = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(every, mine)
        waits[work] = [float(t) for t in every]
    if rank == 0:
        base = statistics.median(waits[min(waits)])
        print(f"{world} ranks, {args.kib} KiB all-reduce; wait per rank in ms (x the median wait after "
              f"{min(waits):g} ms of work, {base:.2f} ms)")
        for work, per_rank in waits.items():
            print(f"work {work:>5g} ms: " + "  ".join(f"{w:6.2f} ({w / base:4.1f}x)" for w in per_rank))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
