"""When a collective times out, say which rank went silent and where: each rank that timed out leaves a
mark in the job's key-value store, waits for the other live ranks to do the same, and blames the rest."""

from __future__ import annotations

import datetime
import time
import traceback
from pathlib import Path

import torch.distributed as dist

from polyshard.errors import PolyshardError

_MARK = "polyshard/timed-out/"


def time_out_collectives(seconds: float) -> None:
    """From here on every collective of this rank's process groups gives up after ``seconds``. What ran before
    (building, capture, planning, resuming) kept torch's default: ranks may reach its collectives far apart."""
    c10d, timeout = dist.distributed_c10d, datetime.timedelta(seconds=seconds)
    for group in list(c10d._world.pg_map):
        if not c10d._rank_not_in_group(group):
            c10d._set_pg_timeout(timeout, group)


def is_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective giving up on its peers (not a peer's crash, which restarts the job)."""
    return isinstance(exc, RuntimeError) and "timed out" in str(exc).lower()


def stalled(exc: RuntimeError, step: int, timeout_s: float) -> PolyshardError:
    """The error this rank reports for a timed-out collective in ``step``."""
    store = dist.distributed_c10d._get_default_store()  # torch's rendezvous store: reachable while a rank hangs
    rank, world = dist.get_rank(), dist.get_world_size()
    store.set(f"{_MARK}{rank}", str(step))
    deadline = time.monotonic() + min(timeout_s, 10.0)  # the others time out within about one timeout
    silent = _unmarked(store, rank, world)
    while silent and time.monotonic() < deadline:
        time.sleep(0.2)
        silent = _unmarked(store, rank, world)
    who = (f"rank {silent[0]}" if len(silent) == 1 else f"ranks {', '.join(map(str, silent))}") if silent else \
        "no rank (every one timed out)"
    return PolyshardError(f"{who} stopped responding: rank {rank} waited {timeout_s:g} s in {_collective(exc)} "
                          f"at step {step} (--collective-timeout)")


def _unmarked(store, rank: int, world: int) -> list[int]:
    return [r for r in range(world) if r != rank and not store.check([f"{_MARK}{r}"])]


def _collective(exc: BaseException) -> str:
    """The torch.distributed call that gave up, else the innermost polyshard function waiting on one."""
    frames = traceback.extract_tb(exc.__traceback__)
    for f in reversed(frames):
        if f.filename.endswith("distributed_c10d.py"):
            return f.name
    mine = [f for f in frames if "/polyshard/" in f.filename]
    return f"{Path(mine[-1].filename).stem}.{mine[-1].name} (waiting on a collective)" if mine else "a collective"
