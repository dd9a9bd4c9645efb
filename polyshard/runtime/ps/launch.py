"""Run every role of a parameter-server job on this machine, restart the ones that die, collect the result."""

from __future__ import annotations

import functools
import json
import multiprocessing as mp
import multiprocessing.forkserver
import os
import pickle
import secrets
import signal
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from polyshard.errors import PolyshardError
from polyshard.runtime.ps.server import serve
from polyshard.runtime.ps.snapshots import make_newest, read_snapshot, resume_points, servers_in
from polyshard.runtime.ps.spec import MODES, PSSpec, placement_of
from polyshard.runtime.ps.worker import work
from polyshard.runtime.signals import Interrupt, Stopped, interrupts_raised


@dataclass(frozen=True)
class PSResult:
    """params: the trained parameters by name, whole; losses: server 0's loss per update (the mean over the
    workers in that update); restarts: per role ("server 1", "worker 0"), how often it was restarted;
    lost: updates redone because a server came back from an older snapshot; stale: async gradients dropped;
    seconds: server 0's time from its first update to its last (startup left out), for throughput."""

    params: dict[str, torch.Tensor]
    losses: list[float]
    restarts: dict[str, int]
    lost: int
    stale: int
    seconds: float


def train_ps(model_fn: Callable[[], nn.Module], batch_fn: Callable[[int, int, int], tuple], *, servers: int = 1,
             workers: int = 2, steps: int = 10, optimizer: Callable | None = None, mode: str = "sync",
             staleness: int | None = None, seed: int = 0, snapshot_dir: str | None = None, snapshot_every: int = 10,
             tables: tuple[str, ...] | None = None, max_restarts: int = 3, log_every: int = 10,
             straggler_seconds: float = 60.0, resume: bool = False) -> PSResult:
    """Train ``model_fn()`` with ``servers`` parameter servers and ``workers`` workers, each a process here.

    ``batch_fn(step, worker, workers)`` gives a worker its rows of global batch ``step`` as ``model(...)``'s
    arguments, and the model returns the loss. ``optimizer(tensors)`` runs on the servers (default SGD, lr
    0.01). Both functions must be importable (module level), as every role is a fresh process. In sync
    mode, a worker silent ``straggler_seconds`` after another's gradient came in is left out of that update.
    ``resume``: continue the run whose snapshots ``snapshot_dir`` holds, to ``steps`` updates in all.
    """
    optimizer = optimizer or functools.partial(torch.optim.SGD, lr=0.01)
    spec = PSSpec(model_fn=model_fn, batch_fn=batch_fn, optimizer=optimizer,
                  servers=(), workers=workers, steps=steps, key=secrets.token_bytes(32), snapshot_dir="", mode=mode,
                  staleness=staleness, snapshot_every=snapshot_every, seed=seed, tables=tables, log_every=log_every,
                  straggler_seconds=straggler_seconds)
    check(spec, servers, max_restarts)
    with tempfile.TemporaryDirectory(prefix="polyshard-ps-") as scratch:
        folder = snapshot_dir or scratch
        if resume:
            _resume(folder, spec, servers)
        else:
            _check_snapshot_dir(folder)
        spec = replace(spec, servers=tuple(("127.0.0.1", port) for port in free_ports(servers)), snapshot_dir=folder)
        return _Supervisor(spec, max_restarts).run()


MIN_STRAGGLER_SECONDS = 0.1  # shorter waits drop workers that are merely slow to answer


def check(spec: PSSpec, servers: int, max_restarts: int) -> None:
    """Every argument, and the model against the server count, before any process starts."""
    if spec.mode not in MODES:
        raise PolyshardError(f"mode must be one of {', '.join(MODES)}, got {spec.mode!r}")
    for what, value, least in (("servers", servers, 1), ("workers", spec.workers, 1), ("steps", spec.steps, 1),
                               ("snapshot_every", spec.snapshot_every, 1), ("max_restarts", max_restarts, 0),
                               ("log_every", spec.log_every, 1),
                               ("straggler_seconds", spec.straggler_seconds, MIN_STRAGGLER_SECONDS)):
        if not value >= least:  # nan too
            raise PolyshardError(f"{what} must be at least {least}, got {value}")
    if spec.staleness is not None and (spec.mode != "async" or spec.staleness < 0):
        raise PolyshardError(f"staleness {spec.staleness} bounds how old an async gradient may be: it needs the "
                             "async mode and a bound of 0 or more")
    try:
        pickle.dumps(spec)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise PolyshardError(f"the model, batch and optimizer functions must be importable module-level objects, "
                             f"as every role is a fresh process: {exc}") from exc
    with torch.device("meta"):
        placement_of(spec.model_fn(), replace(spec, servers=(("", 0),) * servers))


def _check_snapshot_dir(folder: str) -> None:
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise PolyshardError(f"snapshot directory {folder!r} is a file")
    if any(path.glob("server-*.pt")):
        raise PolyshardError(f"snapshot directory {folder!r} holds another run's server snapshots; use an empty "
                             "directory, or resume that run")
    path.mkdir(parents=True, exist_ok=True)


def _resume(folder: str, spec: PSSpec, servers: int) -> None:
    """Make each server's snapshot of the update the run resumes from its newest, once every one is found to fit
    this run (its model, server count, optimizer and steps); nothing changes where one does not."""
    found = servers_in(folder) if Path(folder).is_dir() else 0
    if not found:
        raise PolyshardError(f"snapshot directory {folder!r} holds no server snapshots to resume from")
    if found != servers:
        raise PolyshardError(f"snapshot directory {folder!r} holds the snapshots of {found} servers; resume with "
                             f"--servers {found}")
    points = resume_points(folder, servers, sync=spec.mode == "sync")
    with torch.device("meta"):
        model = spec.model_fn()
    placement = placement_of(model, replace(spec, servers=(("", 0),) * servers))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    optimizer = spec.optimizer([torch.zeros(1, requires_grad=True)])
    for index, (version, path) in enumerate(points):
        snapshot = torch.load(path, weights_only=True, mmap=True)  # shapes only: the tensors stay unread
        want = {n: shapes[n] for n in placement.dense_on(index)}
        for name, bounds in placement.tables:
            want[name] = (bounds[index][1] - bounds[index][0], *shapes[name][1:])
        have = {n: tuple(t.shape) for n, t in snapshot["tensors"].items()}
        if have != want:
            name = min(n for n in have.keys() | want.keys() if have.get(n) != want.get(n))
            raise PolyshardError(f"server {index}'s snapshot in {folder!r} is of another model: {name} is "
                                 f"{have.get(name, 'missing')} there and {want.get(name, 'not a parameter')} in "
                                 "this run's; resume with the run's --model")
        if set(snapshot["optimizer"]["param_groups"][0]) != set(optimizer.state_dict()["param_groups"][0]):
            raise PolyshardError(f"server {index}'s snapshot holds {snapshot.get('optimizer_class', 'another')} "
                                 f"state; this run's optimizer is {type(optimizer).__name__}")
        if version >= spec.steps:
            raise PolyshardError(f"server {index}'s snapshot is at update {version}, and {spec.steps} updates end "
                                 "there; raise the steps to train on")
    for index, (_, path) in enumerate(points):
        make_newest(folder, index, path)
    versions = sorted({v for v, _ in points})
    print(f"polyshard ps: resuming from update {'/'.join(map(str, versions))} (snapshots in {folder})", flush=True)


def free_ports(count: int) -> list[int]:
    """Ports free on this machine now (each bound once, then let go)."""
    socks = [socket.socket() for _ in range(count)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def run_role(spec: PSSpec, role: str, index: int, log_dir: str = "") -> None:
    """One role's process: a server or a worker, single-threaded; with ``log_dir``, its output goes to
    ``ROLE-INDEX.out`` / ``.err`` there (appended across restarts) for the launcher to relay."""
    if log_dir:
        for fd, suffix in ((1, "out"), (2, "err")):
            with open(Path(log_dir, f"{role}-{index}.{suffix}"), "ab") as log:
                os.dup2(log.fileno(), fd)
    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the launcher ends the roles
    try:
        (serve if role == "server" else work)(spec, index)
    except PolyshardError as exc:  # a bad input or an unreachable peer: one line, not a traceback
        print(f"polyshard: error: {role} {index}: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    except Exception:  # noqa: BLE001 - say what failed, and exit non-zero so the launcher acts on it
        traceback.print_exc()
        sys.exit(1)


class _Relay:
    """Copies what the roles write into their log files onto this process's stdout and stderr."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir, self.read = log_dir, {}

    def pump(self) -> None:
        for path in sorted(self.log_dir.glob("*-*.*")):
            with open(path, "rb") as log:
                log.seek(self.read.get(path, 0))
                text = log.read()
            if text:
                self.read[path] = self.read.get(path, 0) + len(text)
                stream = sys.stdout if path.suffix == ".out" else sys.stderr
                stream.write(text.decode(errors="replace"))
                stream.flush()


def role_context() -> mp.context.BaseContext:
    """The roles' start method: forks of one process that imports torch once. That process starts with Ctrl-C
    ignored, and so does each role from its first instruction; before, a Ctrl-C to the terminal's group could raise
    in a role still starting, ahead of ``run_role``'s own ignore (the launcher ends the roles itself)."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["polyshard.runtime.ps.launch"])
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited across exec: the server keeps it, and so
    try:  # do the roles, as a fork restores the handlers the server started with
        mp.forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, before)
    return context


# a server asked to stop snapshots within a turn of its loop; one that takes longer is stuck, and is killed
_STOP_GRACE_S = 10.0


class _Supervisor:
    """Starts the roles, restarts each dead one up to ``max_restarts`` times, and collects the servers' result."""

    def __init__(self, spec: PSSpec, max_restarts: int) -> None:
        self.spec, self.max_restarts = spec, max_restarts
        self.context = role_context()
        self.roles = [("server", i) for i in range(len(spec.servers))] + [("worker", i) for i in range(spec.workers)]
        self.procs: dict[tuple[str, int], mp.Process] = {}
        self.restarts = {f"{r} {i}": 0 for r, i in self.roles}
        self.given_up: set[tuple[str, int]] = set()
        self.logs = Path(spec.snapshot_dir, "logs")
        self.logs.mkdir(exist_ok=True)
        self.relay = _Relay(self.logs)

    def run(self) -> PSResult:
        try:
            with interrupts_raised():
                for role in self.roles:
                    self._start(role)
                while not all(self._finished(("server", i)) for i in range(len(self.spec.servers))):
                    time.sleep(0.1)
                    self.relay.pump()
                    for role, proc in list(self.procs.items()):
                        if proc.exitcode not in (None, 0) and role not in self.given_up:
                            self._died(role, proc.exitcode)
                    if all(r in self.given_up for r in self.roles if r[0] == "worker"):
                        raise PolyshardError("every worker failed and used up its restarts; see their output above")
        except Interrupt as exc:  # the roles are ended below
            raise Stopped(exc.signum, "every server and worker") from None
        finally:
            self._end()
            self.relay.pump()
        return self._result()

    def _end(self) -> None:
        """Servers still running are asked to stop (SIGTERM: each snapshots the update it reached) while the
        workers run on, so that none sees a worker leave and updates without it; then whatever is left is killed."""
        servers = [proc for (role, _), proc in self.procs.items() if role == "server" and proc.is_alive()]
        for proc in servers:
            proc.terminate()
        deadline = time.monotonic() + _STOP_GRACE_S
        for proc in servers:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
            proc.join()

    def _finished(self, role: tuple[str, int]) -> bool:
        return self.procs[role].exitcode == 0

    def _start(self, role: tuple[str, int]) -> None:
        proc = self.context.Process(target=run_role, args=(self.spec, *role, str(self.logs)),
                                    name=f"{role[0]}-{role[1]}")
        proc.start()
        self.procs[role] = proc
        pids = {f"{r}-{i}": p.pid for (r, i), p in self.procs.items()}
        tmp = Path(self.spec.snapshot_dir, "roles.json.tmp")
        tmp.write_text(json.dumps(pids))
        os.replace(tmp, Path(self.spec.snapshot_dir, "roles.json"))  # which process is which role, for operators

    def _died(self, role: tuple[str, int], code: int) -> None:
        name = f"{role[0]} {role[1]}"
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        if self.restarts[name] < self.max_restarts:
            self.restarts[name] += 1
            print(f"polyshard ps: {name} {how}; restarting it ({self.restarts[name]} of {self.max_restarts})",
                  flush=True)
            self._start(role)
        elif role[0] == "worker":
            self.given_up.add(role)
            print(f"polyshard ps: {name} {how} and has no restarts left; the run goes on without it", flush=True)
        else:
            raise PolyshardError(f"{name} {how} and has no restarts left (max_restarts={self.max_restarts}); its "
                                 f"last snapshot is in {self.spec.snapshot_dir}")

    def _result(self) -> PSResult:
        with torch.device("meta"):
            placement = placement_of(self.spec.model_fn(), self.spec)
        snapshots = [read_snapshot(self.spec.snapshot_dir, i) for i in range(len(self.spec.servers))]
        params = {name: snapshots[s]["tensors"][name] for name, s in placement.dense}
        for name, _ in placement.tables:
            params[name] = torch.cat([snap["tensors"][name] for snap in snapshots])
        return PSResult(params=params, losses=snapshots[0]["losses"], restarts=self.restarts,
                        lost=max(s["lost"] for s in snapshots), stale=sum(s["stale"] for s in snapshots),
                        seconds=snapshots[0]["busy"])
