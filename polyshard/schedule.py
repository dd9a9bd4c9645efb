"""Pipeline schedules as plain action lists (``2F0``: chunk 2 runs forward of micro-batch 0),
and a single-process simulator that runs them to check for deadlocks and predict bubbles.

Chunk c of ``pp * virtual_stages`` runs on stage rank ``c % pp`` (round robin, so rank s holds
chunks s, s+pp, ...); each chunk's forward needs the previous chunk's, each backward the next one's.
"""

from __future__ import annotations

import functools
import re
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from polyshard.errors import PolyshardError
from polyshard.plan import SCHEDULES, check_choice


@dataclass(frozen=True)
class Action:
    """One unit of pipeline work: ``kind`` "F" (forward) or "B" (backward) of ``micro`` on ``chunk``."""

    chunk: int
    kind: str
    micro: int

    def __str__(self) -> str:
        return f"{self.chunk}{self.kind}{self.micro}"

    @staticmethod
    def parse(text: str) -> Action:
        match = re.fullmatch(r"(\d+)([FB])(\d+)", text.strip())
        if not match:
            raise PolyshardError(f"pipeline action {text!r} is not CHUNK F|B MICRO (e.g. '1F0')")
        return Action(int(match[1]), match[2], int(match[3]))


class ActionTime(NamedTuple):
    """When an action ran (seconds from the step's start) on pipeline ``stage``, measured or simulated."""

    stage: int
    chunk: int
    kind: str
    micro: int
    start_s: float
    end_s: float


def check_schedule(schedule: str, pp: int, micro_batches: int, virtual_stages: int) -> None:
    """Raise a PolyshardError for a schedule these settings cannot run."""
    check_choice("schedule", schedule, SCHEDULES)
    for name, value in (("pp", pp), ("micro_batches", micro_batches), ("virtual_stages", virtual_stages)):
        if type(value) is not int or value < 1:
            raise PolyshardError(f"{name} must be a positive integer; got {value!r}")
    if schedule == "interleaved":
        if virtual_stages < 2:
            raise PolyshardError(f"schedule 'interleaved' needs virtual_stages >= 2 chunks per stage, got "
                                 f"{virtual_stages}; use '1f1b' for one chunk per stage")
        if micro_batches % pp:
            raise PolyshardError(f"schedule 'interleaved' runs micro-batches in groups of pp={pp}; "
                                 f"micro_batches={micro_batches} is not a multiple of {pp}")
    elif virtual_stages != 1:
        raise PolyshardError(f"virtual_stages={virtual_stages} needs schedule 'interleaved', not {schedule!r}")


def schedule_actions(schedule: str, pp: int, micro_batches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """Each stage rank's actions in the order it runs them."""
    return [[Action(c, "F" if forward else "B", i) for c, forward, i in todo]
            for todo in _steps(schedule, pp, micro_batches, virtual_stages)]


def _steps(schedule: str, pp: int, m: int, v: int) -> list[list[tuple[int, bool, int]]]:
    """:func:`schedule_actions` as (chunk, forward, micro), what the simulator reads."""
    check_schedule(schedule, pp, m, v)
    make = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved": _interleaved}[schedule]
    return [make(s, pp, m, v) for s in range(pp)]


def _gpipe(s: int, pp: int, m: int, v: int) -> list[tuple[int, bool, int]]:
    """All forwards, then all backwards: every micro-batch's activations are alive at once."""
    return [(s, True, i) for i in range(m)] + [(s, False, i) for i in range(m)]


def _one_f_one_b(s: int, pp: int, m: int, v: int) -> list[tuple[int, bool, int]]:
    """pp-1-s forwards to fill the pipe, then one forward and one backward in turn, then the
    remaining backwards: stage s holds at most pp-s micro-batches' activations."""
    warm = min(pp - 1 - s, m)
    steady = [a for i in range(m - warm) for a in ((s, True, warm + i), (s, False, i))]
    return [(s, True, i) for i in range(warm)] + steady + [(s, False, i) for i in range(m - warm, m)]


def _interleaved(s: int, pp: int, m: int, v: int) -> list[tuple[int, bool, int]]:
    """Megatron-LM's interleaved 1F1B: micro-batches go in groups of pp through chunk s, then
    s+pp, ...; backwards visit the chunks in reverse. Warm-up covers the longer fill of v chunks."""
    total = m * v
    # the k-th forward (or backward) runs chunk (its local index, reversed for backwards) x pp + s on micro-batch
    # k // (pp v) x pp + k % pp
    forwards = [((k // pp) % v * pp + s, True, k // (pp * v) * pp + k % pp) for k in range(total)]
    backwards = [((v - 1 - (k // pp) % v) * pp + s, False, k // (pp * v) * pp + k % pp) for k in range(total)]
    warm = min((pp - s - 1) * 2 + (v - 1) * pp, total)
    steady = [a for k in range(total - warm) for a in (forwards[warm + k], backwards[k])]
    return forwards[:warm] + steady + backwards[total - warm:]


def simulate(actions: list[list[Action]], forward_s: list[float], backward_s: list[float]) -> list[ActionTime]:
    """Run every stage's actions as early as their inputs allow (forward after the previous chunk's
    forward, backward after the next chunk's backward); chunk c's times are ``forward_s[c]``,
    ``backward_s[c]``. Raises a PolyshardError where no stage can go on (a deadlock)."""
    times: list[ActionTime] = []

    def record(stage: int, chunk: int, forward: bool, micro: int, start_s: float, end_s: float) -> None:
        times.append(ActionTime(stage, chunk, "F" if forward else "B", micro, start_s, end_s))

    _run(_plain(actions), forward_s, backward_s, record)
    return times


def simulated_span(schedule: str, pp: int, micro_batches: int, virtual_stages: int,
                   forward_s: Sequence[float], backward_s: Sequence[float]) -> float:
    """The seconds from the first action's start to the last one's end under a built-in schedule, as
    :func:`simulate` times it, without its records (the planner times thousands)."""
    return max(_run(_built_in(schedule, pp, micro_batches, virtual_stages), forward_s, backward_s))


def _plain(actions: list[list[Action]]) -> list[list[tuple[int, bool, int]]]:
    """Each stage's actions as (chunk, forward, micro)."""
    return [[(a.chunk, a.kind == "F", a.micro) for a in todo] for todo in actions]


_built_in = functools.lru_cache(maxsize=64)(_steps)  # read only


def _run(actions: list[list[tuple[int, bool, int]]], forward_s: Sequence[float], backward_s: Sequence[float],
         record: Callable[[int, int, bool, int, float, float], None] | None = None) -> list[float]:
    """Each stage's last end, its actions as (chunk, forward, micro) run as early as :func:`simulate` says;
    ``record(stage, chunk, forward, micro, start_s, end_s)`` is told of each.

    A stage is visited again only when an action it waits for is done, so each action is handled
    about once however many stages and micro-batches there are."""
    last = len(forward_s) - 1
    stage_of = {chunk: s for s, todo in enumerate(actions) for chunk, _, _ in todo}
    next_stage = [stage_of.get(c + 1) for c in range(last + 1)]  # who waits for a chunk's forward
    previous_stage = [stage_of.get(c - 1) for c in range(last + 1)]  # and for its backward
    micros = 1 + max((micro for todo in actions for _, _, micro in todo), default=0)
    forward_done = [[None] * micros for _ in forward_s]
    backward_done = [[None] * micros for _ in forward_s]
    free = [0.0] * len(actions)
    nxt = [0] * len(actions)
    visit = deque(range(len(actions)))
    while visit:
        s = visit.popleft()
        todo, at, end = actions[s], nxt[s], free[s]
        while at < len(todo):
            chunk, forward, micro = todo[at]
            if forward:  # after the previous chunk's forward
                ready = forward_done[chunk - 1][micro] if chunk > 0 else 0.0
                if ready is None:
                    break
                start = ready if ready > end else end
                end = forward_done[chunk][micro] = start + forward_s[chunk]
                waiter = next_stage[chunk]
            else:  # after its own forward and the next chunk's backward
                own = forward_done[chunk][micro]
                ready = backward_done[chunk + 1][micro] if chunk < last else 0.0
                if own is None or ready is None:
                    break
                start = max(end, own, ready)
                end = backward_done[chunk][micro] = start + backward_s[chunk]
                waiter = previous_stage[chunk]
            if record is not None:
                record(s, chunk, forward, micro, start, end)
            at += 1
            if waiter is not None and waiter != s:
                visit.append(waiter)
        nxt[s], free[s] = at, end
    if any(n < len(todo) for n, todo in zip(nxt, actions)):
        stuck = ", ".join(f"stage {s}: {Action(c, 'F' if f else 'B', i)}" for s, todo in enumerate(actions)
                          if nxt[s] < len(todo) for c, f, i in [todo[nxt[s]]])
        raise PolyshardError(f"pipeline schedule deadlocks; waiting: {stuck}")
    return free
