"""A pool of gloo ranks started once and reused by many test cases (start-up is the slow part)."""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, tasks, results, one_device: bool) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK="0" if one_device else str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    while (task := tasks.get()) is not None:
        fn, args = task
        try:
            results.put((rank, True, fn(*args)))
        except BaseException:  # report every failure to the test, keep the rank alive
            results.put((rank, False, traceback.format_exc()))
        gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # skip the interpreter's teardown of everything the cases imported: seconds per rank


class RankPool:
    """``world`` processes in one gloo group; :meth:`run` calls a function on all and returns by rank.
    ``one_device``: every rank uses GPU 0 (gloo carries CUDA tensors, so one GPU holds a whole mesh)."""

    def __init__(self, world: int, one_device: bool = False):
        ctx = mp.get_context("spawn")
        self.world = world
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        port = _free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, world, port, self.tasks[r], self.results, one_device),
                                  daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, timeout: float = 600):
        for q in self.tasks:
            q.put((fn, args))
        out, errors = [None] * self.world, []
        for _ in range(self.world):
            rank, ok, value = self.results.get(timeout=timeout)
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            raise AssertionError("\n".join(errors))
        return out

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


@contextlib.contextmanager
def pools_by_world(one_device: bool = False):
    """``get(world)``: a pool of that many ranks, started on first use and shared until the block ends."""
    made: dict[int, RankPool] = {}

    def get(world: int) -> RankPool:
        if world not in made:
            made[world] = RankPool(world, one_device)
        return made[world]

    try:
        yield get
    finally:
        for pool in made.values():
            pool.close()
