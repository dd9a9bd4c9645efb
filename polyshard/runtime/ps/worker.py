"""A parameter-server worker: pulls parameters, computes its slice of each batch's gradient, pushes it.

Embedding tables stay on the servers: a lookup pulls only the rows its indices touch, and the push
carries only those rows' gradients.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from polyshard.runtime.ps.spec import PSSpec, embedding_tables, placement_of
from polyshard.runtime.ps.wire import PEER_LOST, connect, from_wire, receive, send, to_wire


class ServerLost(Exception):
    """A server went away mid-step and has been reconnected to: the step starts again."""

    def __init__(self, server: int) -> None:
        super().__init__(f"server {server} was lost")
        self.server = server


class Links:
    """This worker's connection to each server, remade when a server restarts."""

    def __init__(self, spec: PSSpec, worker: int) -> None:
        self.spec, self.worker = spec, worker
        self.seen = [0] * len(spec.servers)  # the newest update of each server this worker has seen
        self.conns = [self._join(s) for s in range(len(spec.servers))]

    def _join(self, server: int):
        """Connect and say hello, retried together: a restarting server may accept and then drop a connection."""
        deadline = time.monotonic() + self.spec.retry_seconds
        while True:
            conn = connect(self.spec.servers[server], self.spec.key, max(0.0, deadline - time.monotonic()))
            try:
                send(conn, ("hello", self.worker, self.seen[server]))
                _, version = receive(conn)
                break
            except PEER_LOST:
                time.sleep(0.2)
        if version < self.seen[server]:
            print(f"worker {self.worker}: server {server} came back at update {version}, "
                  f"{self.seen[server] - version} behind what this worker saw", flush=True)
        self.seen[server] = version
        return conn

    def call(self, server: int, message: tuple) -> tuple:
        try:
            send(self.conns[server], message)
            reply = receive(self.conns[server])
        except PEER_LOST:
            self.conns[server] = self._join(server)
            raise ServerLost(server) from None
        self.seen[server] = reply[1]
        return reply

    def close(self) -> None:
        for conn in self.conns:
            try:
                send(conn, ("bye",))
                conn.close()
            except PEER_LOST:
                pass


class RemoteEmbedding(nn.Module):
    """An ``nn.Embedding`` whose table lives on the servers, split by rows; rows are pulled as looked up."""

    def __init__(self, name: str, embedding: nn.Embedding, bounds: tuple[tuple[int, int], ...], links: Links) -> None:
        super().__init__()
        self.name, self.bounds, self.links = name, bounds, links
        self.rows, self.dim, self.dtype = embedding.num_embeddings, embedding.embedding_dim, embedding.weight.dtype
        self.touched: list[tuple[torch.Tensor, torch.Tensor]] = []  # (row ids, their pulled rows) per lookup

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        ids, inverse = torch.unique(index, return_inverse=True)
        if len(ids) and (ids[0] < 0 or ids[-1] >= self.rows):
            raise IndexError(f"embedding {self.name!r} has rows 0..{self.rows - 1}; looked up {ids[0]}..{ids[-1]}")
        weight = torch.empty(len(ids), self.dim, dtype=self.dtype)
        for server, (lo, hi) in enumerate(self.bounds):
            mine = (ids >= lo) & (ids < hi)
            if mine.any():
                _, _, rows = self.links.call(server, ("rows", {self.name: (ids[mine] - lo).numpy()}))
                weight[mine] = from_wire(rows)[self.name]
        weight.requires_grad_()
        self.touched.append((ids, weight))
        return F.embedding(inverse, weight)

    def row_grads(self, server: int) -> tuple | None:
        """(row ids local to ``server``, their gradients) from this step's lookups, or None if none fell there."""
        if not self.touched:
            return None
        lo, hi = self.bounds[server]
        ids = torch.cat([i for i, _ in self.touched])
        grads = torch.cat([w.grad if w.grad is not None else torch.zeros_like(w) for _, w in self.touched])
        mine = (ids >= lo) & (ids < hi)
        return ((ids[mine] - lo).numpy(), grads[mine].numpy()) if mine.any() else None


def _swap_tables(model: nn.Module, spec: PSSpec, links: Links) -> list[RemoteEmbedding]:
    placement = placement_of(model, spec)
    remote = []
    for name, embedding in embedding_tables(model, spec.tables).items():
        parent_name, _, attr = name.rpartition(".")
        table = RemoteEmbedding(f"{name}.weight", embedding, placement.rows_of(f"{name}.weight"), links)
        setattr(model.get_submodule(parent_name), attr, table)
        remote.append(table)
    return remote


def work(spec: PSSpec, worker: int) -> None:
    """Train until every server has made ``spec.steps`` updates; a lost server is waited for and the step redone."""
    model = spec.build()
    owner = dict(placement_of(model, spec).dense)
    links = Links(spec, worker)
    tables = _swap_tables(model, spec, links)
    params = dict(model.named_parameters())
    servers = range(len(spec.servers))
    next_pull = [0] * len(spec.servers)  # sync: the update each server must have made before the next pull
    pushed: dict[int, tuple] = {}  # sync: the last push to each server, for one that comes back without it
    drawn = 0
    while True:
        try:
            versions = []
            for s in servers:
                _, version, values = links.call(s, ("pull", next_pull[s]))
                for name, value in from_wire(values).items():
                    params[name].data.copy_(value)
                versions.append(version)
            if min(versions) >= spec.steps:
                break
            for p in params.values():
                p.grad = None
            for table in tables:
                table.touched.clear()
            step = min(versions) if spec.mode == "sync" else drawn
            loss = model(*spec.batch_fn(step, worker, spec.workers))
            loss.backward()
            drawn += 1
            for s in servers:
                if versions[s] >= spec.steps:
                    continue
                grads = to_wire({n: p.grad if p.grad is not None else torch.zeros_like(p)  # unused this step
                                 for n, p in params.items() if owner[n] == s})
                rows = {t.name: r for t in tables if (r := t.row_grads(s)) is not None}
                pushed[s] = ("push", versions[s], grads, rows, loss.item())
                status, _ = links.call(s, pushed[s])
                next_pull[s] = versions[s] + 1 if spec.mode == "sync" and status == "ack" else 0
        except ServerLost as lost:
            next_pull[lost.server] = _push_again(links, lost.server, pushed) if spec.mode == "sync" else 0
    links.close()


def _push_again(links: Links, server: int, pushed: dict[int, tuple]) -> int:
    """sync: a server back at the update this worker last pushed a gradient for (stopped before it made that update,
    the pushes it held gone) is sent that gradient again, so the update is made as it would have been. Returns the
    update the next pull from it waits for: that one, or 0 (whatever it holds) where it came back elsewhere."""
    message = pushed.get(server)
    while message is not None and links.seen[server] == message[1]:
        try:
            status, _ = links.call(server, message)
        except ServerLost:
            continue
        return message[1] + 1 if status == "ack" else 0
    return 0
