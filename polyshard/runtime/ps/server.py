"""A parameter server: holds its share of the parameters and their optimizer state, applies workers' gradients.

sync: an update waits for a gradient from every live worker and applies their mean, so the run equals one
device on the concatenated batch; a worker that leaves is dropped from the wait, and one that comes back is
waited for again. async: each gradient is applied as it comes, unless it is staler than the bound.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from multiprocessing.connection import Connection, Listener, wait
from pathlib import Path

import numpy as np
import torch

from polyshard.runtime.ps.snapshots import read_snapshot, write_snapshot
from polyshard.runtime.ps.spec import PSSpec, placement_of
from polyshard.runtime.ps.wire import PEER_LOST, from_wire, no_delay, receive, send, to_wire
from polyshard.runtime.signals import StopRequest


class Server:
    """One server's state and its reactions to messages; ``serve`` runs it until the training is done."""

    def __init__(self, spec: PSSpec, index: int) -> None:
        self.spec, self.index = spec, index
        model = spec.build()
        placement = placement_of(model, spec)
        params = dict(model.named_parameters())
        self.tensors = {n: params[n].detach().clone() for n in placement.dense_on(index)}
        self.row_start = {}
        for name, bounds in placement.tables:
            lo, hi = bounds[index]
            self.tensors[name], self.row_start[name] = params[name].detach()[lo:hi].clone(), lo
        self.optimizer = spec.optimizer(list(self.tensors.values()))
        self.sparse = _leaves_untouched_rows(self.optimizer)
        self.version, self.losses, self.stale, self.lost = 0, [], 0, 0
        self.first_update_at, self.busy = 0.0, 0.0  # busy: seconds from this process's first update to its last
        self.first_push_at = 0.0  # when the first gradient of the update being gathered came in
        self.restored_at: int | None = None
        self.saved: int | None = None  # the update the newest snapshot on disk holds
        snapshot = read_snapshot(spec.snapshot_dir, index)
        if snapshot is not None:
            self._restore(snapshot)
        self.live: dict[int, Connection] = {}
        self.joined: set[int] = set()
        self.pending: dict[int, tuple[dict, dict, float]] = {}
        self.waiting: list[tuple[Connection, int]] = []  # sync pulls of a version not yet made
        self.started_at = time.monotonic()

    # ---- state on disk
    def _restore(self, snapshot: dict) -> None:
        for name, t in snapshot["tensors"].items():
            self.tensors[name].copy_(t)
        settings = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        self.optimizer.load_state_dict(snapshot["optimizer"])
        for group, setting in zip(self.optimizer.param_groups, settings):
            group.update(setting)  # this run's (a resumed run may change the learning rate)
        self.version, self.losses = snapshot["version"], snapshot["losses"]
        self.stale, self.lost = snapshot["stale"], snapshot["lost"]
        self.restored_at = self.saved = self.version
        self._say(f"restored update {self.version} from its snapshot")

    def snapshot(self) -> None:
        write_snapshot(self.spec.snapshot_dir, self.index, {
            "version": self.version, "tensors": self.tensors, "optimizer": self.optimizer.state_dict(),
            "optimizer_class": type(self.optimizer).__name__, "losses": self.losses, "stale": self.stale,
            "lost": self.lost, "busy": self.busy})
        self.saved = self.version

    def save(self) -> None:
        """A snapshot, unless the newest already holds this update: writing it again would push out the one before,
        which a sync run stopped with this server an update ahead of another resumes from."""
        if self.saved != self.version:
            self.snapshot()

    # ---- messages
    def handle(self, conn: Connection, message: tuple) -> None:
        kind = message[0]
        if kind == "hello":
            self._hello(conn, *message[1:])
        elif kind == "pull":
            self._pull(conn, message[1])
        elif kind == "rows":
            rows = {name: self.tensors[name][torch.from_numpy(index)] for name, index in message[1].items()}
            send(conn, ("rows", self.version, to_wire(rows)))
        elif kind == "push":
            worker = next((w for w, c in self.live.items() if c is conn), None)
            send(conn, self._push(worker, *message[1:]) if worker is not None else ("stale", self.version))
        elif kind == "bye":
            self.left(conn, quiet=True)

    def _hello(self, conn: Connection, worker: int, last_seen: int) -> None:
        if worker in self.joined:
            self._say(f"worker {worker} joined again at update {self.version}")
        if self.restored_at is not None and last_seen > self.restored_at:
            lost = last_seen - self.restored_at
            if lost > self.lost:
                self._say(f"worker {worker} had seen update {last_seen}: the restart lost "
                          f"{lost - self.lost} more update(s), {lost} in all")
                self.lost = lost
        self.live[worker] = conn
        self.joined.add(worker)
        send(conn, ("welcome", self.version))

    def _pull(self, conn: Connection, min_version: int) -> None:
        if self.version >= min_version or self.version >= self.spec.steps:
            send(conn, ("params", self.version, to_wire(self.dense())))
        else:
            self.waiting.append((conn, min_version))

    def dense(self) -> dict[str, torch.Tensor]:
        return {n: t for n, t in self.tensors.items() if n not in self.row_start}

    def _push(self, worker: int, tag: int, grads: dict, rows: dict, loss: float) -> tuple:
        if self.version >= self.spec.steps:
            return ("ack", self.version)
        if self.spec.mode == "async":
            if self.spec.staleness is not None and self.version - tag > self.spec.staleness:
                self.stale += 1
                return ("stale", self.version)
            self._apply([(from_wire(grads), rows, loss)])
            return ("ack", self.version)
        if tag != self.version:
            return ("stale", self.version)
        if not self.pending:
            self.first_push_at = time.monotonic()
        self.pending[worker] = (from_wire(grads), rows, loss)
        return ("ack", self.version)

    def left(self, conn: Connection, quiet: bool = False) -> None:
        worker = next((w for w, c in self.live.items() if c is conn), None)
        if worker is None:
            return
        del self.live[worker]
        self.waiting = [(c, v) for c, v in self.waiting if c is not conn]
        if not quiet and self.version < self.spec.steps:
            self._say(f"worker {worker} left at update {self.version}; going on with {len(self.live)} of "
                      f"{self.spec.workers} workers")

    # ---- updates
    def ready(self) -> bool:
        """sync: every live worker's gradient is in (and all workers joined once, or the grace ran out)."""
        started = len(self.joined) >= self.spec.workers or time.monotonic() - self.started_at > self.spec.join_grace
        return bool(self.pending) and started and set(self.live) <= set(self.pending)

    def stragglers(self) -> list[Connection]:
        """sync: live workers still silent ``straggler_seconds`` after the first gradient of this update came
        in; they are dropped (and rejoin when they next call), so one hung worker does not stop the run."""
        if not self.pending or time.monotonic() - self.first_push_at < self.spec.straggler_seconds:
            return []
        late = [(w, c) for w, c in self.live.items() if w not in self.pending]
        for worker, conn in late:
            del self.live[worker]
            self.waiting = [(c, v) for c, v in self.waiting if c is not conn]
            self._say(f"worker {worker} sent no gradient for {self.spec.straggler_seconds:g} s after the first of "
                      f"update {self.version}; going on without it")
        return [c for _, c in late]

    def update(self) -> None:
        self._apply(list(self.pending.values()))
        self.pending.clear()
        still = []
        for conn, min_version in self.waiting:
            if self.version >= min_version:
                send(conn, ("params", self.version, to_wire(self.dense())))
            else:
                still.append((conn, min_version))
        self.waiting = still

    def _apply(self, pushes: list[tuple[dict, dict, float]]) -> None:
        """The mean of the pushed gradients, one optimizer step; row gradients are added into the rows they name."""
        for name, t in self.tensors.items():
            if name in self.row_start:
                touched = [rows[name] for _, rows, _ in pushes if name in rows]
                index = torch.from_numpy(np.concatenate([i for i, _ in touched] or [np.zeros(0, np.int64)]))
                values = torch.from_numpy(np.concatenate([v for _, v in touched] or [np.zeros((0, *t.shape[1:]))]))
                if self.sparse:
                    grad = torch.sparse_coo_tensor(index[None], values.to(t.dtype), t.shape).coalesce()
                else:
                    grad = torch.zeros_like(t).index_add_(0, index, values.to(t.dtype))
            else:
                grad = sum(g[name] for g, _, _ in pushes)
            t.grad = grad / len(pushes)
        self.optimizer.step()
        self.version += 1
        now = time.monotonic()
        self.first_update_at = self.first_update_at or now
        self.busy = now - self.first_update_at
        self.losses.append(sum(loss for _, _, loss in pushes) / len(pushes))
        if self.version % self.spec.snapshot_every == 0 or self.version == self.spec.steps:
            self.snapshot()
        if self.index == 0 and (self.version % self.spec.log_every == 0 or self.version == self.spec.steps):
            print(f"update {self.version}/{self.spec.steps}  loss {self.losses[-1]:.4f}  workers "
                  f"{len(self.live)}", flush=True)

    def done(self) -> bool:
        return self.version >= self.spec.steps and bool(self.joined) and not self.live

    def _say(self, text: str) -> None:
        print(f"server {self.index}: {text}", flush=True)


def _leaves_untouched_rows(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a zero gradient leaves a row as it is, so a table's update may visit only the rows pushed:
    plain SGD and Adagrad without weight decay (momentum or Adam's moments would move untouched rows)."""
    plain_sgd = isinstance(optimizer, torch.optim.SGD) and all(
        g["momentum"] == 0 and g["weight_decay"] == 0 for g in optimizer.param_groups)
    adagrad = isinstance(optimizer, torch.optim.Adagrad) and all(g["weight_decay"] == 0 for g in optimizer.param_groups)
    return plain_sgd or adagrad


def serve(spec: PSSpec, index: int) -> None:
    """Accept workers and answer them until every update is made and every worker has gone; stopped by SIGTERM (the
    launcher ending the run, or a scheduler), snapshot the update reached and exit with the signal's code."""
    stop = StopRequest()
    signal.signal(signal.SIGTERM, stop.note)
    Path(spec.snapshot_dir).mkdir(parents=True, exist_ok=True)
    torch.sparse.check_sparse_tensor_invariants.disable()  # said, not implied: the sparse optimizers warn otherwise
    server = Server(spec, index)
    listener = Listener(("0.0.0.0", spec.servers[index][1]), authkey=spec.key)
    arrivals: queue.Queue = queue.Queue()

    def accept() -> None:
        while True:
            try:
                arrivals.put(no_delay(listener.accept()))
            except Exception:  # noqa: BLE001 - a peer without the run's key, or one that hung up mid-handshake
                continue

    threading.Thread(target=accept, daemon=True).start()
    conns: list[Connection] = []
    parent = os.getppid()
    while not server.done() and not stop.signum:
        while not arrivals.empty():
            conns.append(arrivals.get())
        for conn in wait(conns, timeout=0.05):
            try:
                server.handle(conn, receive(conn))
            except PEER_LOST:
                server.left(conn)
                conns.remove(conn)
        if spec.mode == "sync":
            for conn in server.stragglers():
                conn.close()
                conns.remove(conn)
            if server.ready() and not stop.signum:  # stopping: a worker the stop ends is no worker that left
                server.update()
        if os.getppid() != parent:  # the launcher is gone: nobody will restart or collect this run
            break
    server.save()
    if stop.signum:
        server._say(f"stopped by {signal.Signals(stop.signum).name} at update {server.version}, which its snapshot "
                    "holds")
        raise SystemExit(128 + stop.signum)
