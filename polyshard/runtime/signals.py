"""Ctrl-C and SIGTERM, in a process that supervises others, as an exception: it ends them, then says it stopped."""

from __future__ import annotations

import contextlib
import signal


class Stopped(Exception):
    """A job stopped from outside (Ctrl-C, or a scheduler's SIGTERM), once every process of it has ended; ``then``:
    what the command adds, such as where to continue from."""

    def __init__(self, signum: int, processes: str = "every process of the job"):
        super().__init__(f"stopped by {signal.Signals(signum).name}, and {processes} with it")
        self.signum = signum
        self.then = ""


class Interrupt(BaseException):
    """The signal that asks a supervisor to stop (a BaseException, as no ``except Exception`` may swallow it)."""

    def __init__(self, signum: int):
        self.signum = signum


@contextlib.contextmanager
def interrupts_raised():
    """Inside the block, SIGINT and SIGTERM raise :class:`Interrupt` (SIGTERM would end the process at once, leaving
    its children running; SIGINT would raise a KeyboardInterrupt that no caller tells from a bug)."""
    def interrupt(signum, frame):
        for s in kept:  # a second Ctrl-C while the processes end is not a second stop
            signal.signal(s, signal.SIG_IGN)
        raise Interrupt(signum)

    kept = {s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in kept.items():
            signal.signal(s, handler)
