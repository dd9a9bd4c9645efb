"""Ctrl-C and SIGTERM: in a process that supervises others, an exception (it ends them, then says it stopped); in a
training rank, a request noted for the ranks to agree on, so they stop together after a checkpoint."""

from __future__ import annotations

import contextlib
import signal
import threading


class Stopped(Exception):
    """A job stopped from outside (Ctrl-C, or a scheduler's SIGTERM), once every process of it has ended; ``then``:
    what the command adds, such as where to continue from."""

    def __init__(self, signum: int, processes: str = "every process of the job", then: str = ""):
        super().__init__(f"stopped by {signal.Signals(signum).name}, and {processes} with it")
        self.signum, self.processes, self.then = signum, processes, then


class Interrupt(BaseException):
    """The signal that asks a supervisor to stop (a BaseException, as no ``except Exception`` may swallow it)."""

    def __init__(self, signum: int):
        self.signum = signum


STOPS = (signal.SIGINT, signal.SIGTERM)  # what asks a job to stop: Ctrl-C, and a scheduler's


@contextlib.contextmanager
def interrupts_raised():
    """Inside the block, SIGINT and SIGTERM raise :class:`Interrupt` (SIGTERM would end the process at once, leaving
    its children running; SIGINT would raise a KeyboardInterrupt that no caller tells from a bug)."""
    def interrupt(signum, frame):
        for s in STOPS:  # a second Ctrl-C while the processes end is not a second stop
            signal.signal(s, signal.SIG_IGN)
        raise Interrupt(signum)

    with _handled(interrupt):
        yield


class StopRequest:
    """The first SIGINT or SIGTERM a training rank was sent (``signum``; 0 while none), noted instead of ending it
    mid-step: a rank ended there would leave the others waiting in a collective, and the step unsaved."""

    def __init__(self):
        self.signum = 0

    def note(self, signum: int, frame) -> None:
        self.signum = self.signum or signum


@contextlib.contextmanager
def stops_noted():
    """Inside the block, SIGINT and SIGTERM are noted on the :class:`StopRequest` it yields (in the main thread,
    the only one signals reach; elsewhere nothing is noted)."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    with _handled(request.note):
        yield request


@contextlib.contextmanager
def _handled(handler):
    """SIGINT and SIGTERM go to ``handler`` inside the block, and to what they went to before after it."""
    kept = {s: signal.signal(s, handler) for s in STOPS}
    try:
        yield
    finally:
        for s, before in kept.items():
            signal.signal(s, before)
