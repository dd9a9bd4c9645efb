"""Splits costed side by side in forked processes: results in order, the incumbent shared, errors raised here,
and the same plan as one process finds."""

import os
import subprocess
import sys
import time

import pytest

from polyshard import models
from polyshard.cluster import Cluster
from polyshard.errors import PolyshardError
from polyshard.planner.report import chosen_row
from polyshard.planner.search import search
from polyshard.planner.workers import SharedBest, run_items

PARENT = os.getpid()


def _slow(i: int) -> tuple[int, int]:
    time.sleep(0.05)
    return i * i, os.getpid()


def test_results_come_back_in_item_order_from_every_process():
    out = run_items(list(range(8)), _slow, workers=2)
    assert [v for v, _ in out] == [i * i for i in range(8)]
    assert len({pid for _, pid in out}) == 2, "one process computed every item: nothing ran side by side"


def _slower(i: int) -> tuple[int, int]:
    time.sleep(0.5)  # longer than a fork takes: each process has taken a key before the first item is done
    return i, os.getpid()


def test_items_sharing_a_key_run_in_the_process_that_took_the_first_of_them():
    keys = ["a", "b", "a", "b"]
    out = run_items(list(range(4)), _slower, workers=2, keys=keys)
    assert [v for v, _ in out] == [0, 1, 2, 3]
    assert out[0][1] == PARENT and out[2][1] == PARENT, "this process takes the first item, and its key"
    assert out[1][1] == out[3][1] != PARENT


def test_a_process_with_no_key_left_takes_another_s_rather_than_wait():
    out = run_items(list(range(4)), _slow, workers=2, keys=["a"] * 4)
    assert len({pid for _, pid in out}) == 2, "one process computed every item: the other waited"


def test_an_incumbent_a_worker_lowers_is_seen_by_all():
    best = SharedBest(shared=True)

    def offer(i: int) -> int:
        time.sleep(0.05)
        best.offer(-1.0 if os.getpid() != PARENT else float(i))
        return os.getpid()

    pids = run_items(list(range(6)), offer, workers=2)
    assert any(pid != PARENT for pid in pids)
    assert best.value == -1.0


def test_the_first_error_in_item_order_is_raised():
    def work(i: int) -> int:
        time.sleep(0.02)
        if i >= 3:
            raise ValueError(f"item {i}")
        return i

    with pytest.raises(ValueError, match="item 3"):
        run_items(list(range(8)), work, workers=2)


FORK_AFTER_THREADS = """
import os, torch
from polyshard.planner.workers import run_items
torch.set_num_threads(2)
torch.ones(1 << 22).repeat(4)  # the parent starts OpenMP's threads
out = run_items(list(range(4)), lambda i: (float(torch.ones(1 << 22).repeat(4).sum()), os.getpid()), workers=2)
assert len({pid for _, pid in out}) == 2, out
print("done")
"""


def test_a_worker_forked_after_the_parent_ran_threads_runs_ops_that_would_use_them():
    run = subprocess.run([sys.executable, "-c", FORK_AFTER_THREADS], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "done", run.stderr[-2000:]


def test_a_worker_that_dies_is_reported():
    def work(i: int) -> int:
        time.sleep(0.05)
        if os.getpid() != PARENT:
            os._exit(3)
        return i

    with pytest.raises(PolyshardError, match="exited with code 3"):
        run_items(list(range(6)), work, workers=2)


@pytest.mark.parametrize("name,cluster,batch,limit_gib", [
    ("gpt-small", "2x4xH100-80G", 32, None),
    ("gpt:layers=8,hidden=2048,heads=16,seq=1024,vocab=8192", "4x8xA100-80G", 256, 12),  # recompute costed too
])
def test_processes_side_by_side_pick_what_one_process_picks(name, cluster, batch, limit_gib):
    model, cluster = models.build(name, "meta"), Cluster.preset(cluster)
    limit = limit_gib and limit_gib * 2**30
    alone, ranked = search(model, model.example_inputs(1), cluster, batch, limit, workers=1)
    both, ranked_both = search(model, model.example_inputs(1), cluster, batch, limit, workers=2)
    assert both.report["config"] == alone.report["config"]
    assert both.nodes == alone.nodes
    assert chosen_row(both.report)["step_s"] == chosen_row(alone.report)["step_s"]
    assert {c.mesh for c in ranked} == {c.mesh for c in ranked_both}


@pytest.mark.parametrize("workers", [1, 2])
def test_the_search_tells_its_progress_in_splits_costed(workers):
    """Told in this process after each piece of work it does: the count never falls, the total is every split the
    search tries, and one process alone counts them all."""
    model, cluster = models.build("gpt-small", "meta"), Cluster.preset("2x4xH100-80G")
    told = []
    _, ranked = search(model, model.example_inputs(1), cluster, 32, workers=workers,
                       progress=lambda done, total: told.append((done, total)))
    totals = {total for _, total in told}
    assert totals == {len({c.mesh for c in ranked})}
    done = [d for d, _ in told]
    assert done == sorted(done) and done[0] == 0 and done[-1] <= totals.pop()  # told before the first split too
    if workers == 1:
        assert done == list(range(len(done))) and len(done) == told[0][1] + 1
