"""A pool of gloo ranks started once and reused by many test cases (start-up is the slow part)."""

from __future__ import annotations

import contextlib
import gc
import os
import queue
import socket
import time
import traceback

import torch.multiprocessing as mp

CASE_TIMEOUT_S = 240  # the slowest case takes about 25 s on 2 cores
STRAGGLER_GRACE_S = 10  # after one rank fails, how long the others get to report before the pool is replaced
# torch's fake tensors load torch._dynamo (seconds), and most cases build a transformers model
PRELOAD = ["torch", "torch._dynamo", "torch.distributed.tensor", "polyshard.api", "polyshard.train.trainer",
           "transformers.modeling_utils", "transformers.models.llama.modeling_llama",
           "transformers.models.gpt2.modeling_gpt2"]


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
    ``one_device``: every rank uses GPU 0 (gloo carries CUDA tensors, so one GPU holds a whole mesh).
    A case that fails leaves the pool ``broken``: its ranks may sit in a collective the others left."""

    def __init__(self, world: int, one_device: bool = False):
        # ranks forked from a server that imported once what the cases load: a fresh interpreter per rank (spawn)
        # spends seconds of a shared core importing it again; the server runs nothing, so no thread or CUDA state
        # forks (a module not installed is left out)
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        self.world = world
        self.broken = False
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        port = _free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, world, port, self.tasks[r], self.results, one_device),
                                  daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, timeout: float = CASE_TIMEOUT_S):
        for q in self.tasks:
            q.put((fn, args))
        out, errors, waiting = [None] * self.world, [], set(range(self.world))
        deadline = time.monotonic() + timeout
        while waiting:
            try:
                rank, ok, value = self.results.get(timeout=1)
            except queue.Empty:
                dead = [r for r in waiting if not self.procs[r].is_alive()]
                if dead or time.monotonic() > deadline:
                    self.broken = True
                    why = (f"ranks {dead} exited (codes {[self.procs[r].exitcode for r in dead]})" if dead
                           else f"ranks {sorted(waiting)} did not finish")
                    raise AssertionError("\n".join([f"{getattr(fn, 'func', fn).__name__}: {why}"] + errors)) from None
                continue
            waiting.discard(rank)
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
                deadline = min(deadline, time.monotonic() + STRAGGLER_GRACE_S)
        if errors:
            self.broken = True
            raise AssertionError("\n".join(errors))
        return out

    def close(self) -> None:
        if not self.broken:
            for q in self.tasks:
                q.put(None)
        for p in self.procs:
            p.join(timeout=0 if self.broken else 60)
            if p.is_alive():
                p.kill()
                p.join()


@contextlib.contextmanager
def pools_by_world(one_device: bool = False):
    """``get(world)``: a pool of that many ranks, started on first use and shared until the block ends;
    a pool broken by a failed case is replaced, so one failure does not spread to the cases after it."""
    made: dict[int, RankPool] = {}

    def get(world: int) -> RankPool:
        if world in made and made[world].broken:
            made.pop(world).close()
        if world not in made:
            made[world] = RankPool(world, one_device)
        return made[world]

    try:
        yield get
    finally:
        for pool in made.values():
            pool.close()
