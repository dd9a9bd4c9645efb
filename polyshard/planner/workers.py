"""Independent work spread over forked processes, one per core: a search's splits share nothing but the best
step time found so far, so they can be costed side by side.

Workers are forked, so each starts with everything the caller computed before (the captured model) and needs
nothing sent to it; only results travel back, pickled. Items are taken in order, each by the first process free
that may take it (items sharing a key go to the process that took the first of them, which holds what they
share), and results come back in item order whoever computed them."""

from __future__ import annotations

import functools
import multiprocessing
import os
import traceback
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from polyshard.errors import PolyshardError

FORKS = "fork" in multiprocessing.get_all_start_methods()  # elsewhere every item runs in this process


def available_cores() -> int:
    """Cores this process may run on (its affinity, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class SharedBest:
    """The least value any process has offered (a search's incumbent step time): read without a lock, lowered
    under one. In one process alone it is a plain float."""

    def __init__(self, shared: bool):
        self._value = multiprocessing.get_context("fork").Value("d", float("inf")) if shared and FORKS else None
        self._local = float("inf")

    @property
    def value(self) -> float:
        return self._value.value if self._value is not None else self._local

    def offer(self, value: float) -> None:
        if self._value is None:
            self._local = min(self._local, value)
            return
        with self._value.get_lock():
            if value < self._value.value:
                self._value.value = value


class SharedTally:
    """Work any process has done (splits costed), counted under a lock where processes share it, and told by the
    process that made the tally (``tell(done)``) after each piece it does itself: the others only count."""

    def __init__(self, shared: bool, tell: Callable[[int], None]):
        self._value = multiprocessing.get_context("fork").Value("i", 0) if shared and FORKS else None
        self._local = 0
        self._owner = os.getpid()
        self._tell = tell

    def add(self, count: int) -> None:
        if self._value is None:
            self._local += count
            done = self._local
        else:
            with self._value.get_lock():
                self._value.value += count
                done = self._value.value
        if os.getpid() == self._owner:
            self._tell(done)


def run_items(items: Sequence[Any], work: Callable[[Any], Any], workers: int,
              keys: Sequence[Hashable] | None = None) -> list[Any]:
    """``[work(item) for item in items]``, computed by this process and ``workers - 1`` forked ones. This process
    takes the first item; each process, when free, takes the next item whose key (``keys``, per item; default: each
    its own) no other process has taken, so that what items of one key share is built once, and where none is left,
    the next item of all. An exception raised by ``work`` is raised here (the first item's, in order)."""
    workers = min(workers, len(items)) if FORKS else 1
    if workers <= 1:
        return [work(item) for item in items]
    context = multiprocessing.get_context("fork")
    numbered: dict[Hashable, int] = {}
    key_of = [numbered.setdefault(key, len(numbered)) for key in (range(len(items)) if keys is None else keys)]
    taken = context.Array("b", len(items))  # whether a process took item i
    owner = context.Array("i", [-1] * len(numbered))  # the process that took key k's first item
    taken[0], owner[key_of[0]] = 1, 0  # this process's first

    def attempt(index: int) -> tuple[bool, Any]:
        try:
            return True, work(items[index])
        except Exception as exc:  # raised in the caller, in item order
            return False, exc

    def drain(me: int) -> dict[int, tuple[bool, Any]]:
        done = {}
        while True:
            with taken.get_lock():
                left = [i for i in range(len(items)) if not taken[i]]
                if not left:
                    return done
                # the next of its own keys or of no process's; else another's (building what it shares again), rather
                # than wait
                index = next((i for i in left if owner[key_of[i]] in (-1, me)), left[0])
                taken[index] = 1
                if owner[key_of[index]] == -1:
                    owner[key_of[index]] = me
            done[index] = attempt(index)
            if not done[index][0]:
                return done

    children = []
    for me in range(1, workers):
        receive, send = context.Pipe(duplex=False)
        child = context.Process(target=_child, args=(functools.partial(drain, me), send), daemon=True)
        child.start()
        send.close()
        children.append((child, receive))
    results: dict[int, Any] = {0: attempt(0)}
    if results[0][0]:
        results.update(drain(0))
    for child, receive in children:
        try:
            results.update(receive.recv())
        except EOFError:
            child.join()
            raise PolyshardError(f"a search worker exited with code {child.exitcode} before sending its "
                                 "results") from None
        child.join()
    for index in sorted(results):
        ok, value = results[index]
        if not ok:
            raise value
    return [results[i][1] for i in range(len(items))]


def _child(drain: Callable[[], dict], send) -> None:
    """A forked worker: drain items and send back what it computed (as text what pickle cannot carry), on one
    thread (it has a core of its own, and GNU OpenMP's threads, which the parent may have started, do not survive
    a fork: an op that reached for them would wait forever)."""
    torch.set_num_threads(1)
    done = drain()
    try:
        send.send(done)
    except Exception as exc:
        send.send({i: (False, PolyshardError(_text(value) if not ok else
                                             f"a search worker could not send its result back: {_text(exc)}"))
                   for i, (ok, value) in done.items()})
    send.close()


def _text(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(exc)).strip()
