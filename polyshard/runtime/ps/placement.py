"""Which parameter server holds what: dense tensors whole, embedding tables split into row ranges."""

from __future__ import annotations

from dataclasses import dataclass

from polyshard.errors import PolyshardError


@dataclass(frozen=True)
class Placement:
    """dense: tensor name -> its server; tables: table name -> ((first row, end row) per server)."""

    servers: int
    dense: tuple[tuple[str, int], ...]
    tables: tuple[tuple[str, tuple[tuple[int, int], ...]], ...]

    def dense_on(self, server: int) -> list[str]:
        return [name for name, s in self.dense if s == server]

    def rows_of(self, table: str) -> tuple[tuple[int, int], ...]:
        return dict(self.tables)[table]


def place(dense: dict[str, int], tables: dict[str, int], servers: int) -> Placement:
    """Tables split evenly by rows over every server (each lookup touches few rows, so all servers share
    the traffic); dense tensors, largest first, each to the server holding the fewest elements so far."""
    if servers < 1:
        raise PolyshardError(f"a parameter-server run needs at least 1 server, got {servers}")
    for name, rows in tables.items():
        if rows < servers:
            raise PolyshardError(f"embedding table {name!r} has {rows} rows, fewer than the {servers} servers "
                                 "it is split over; use at most that many servers")
    load = [0] * servers
    split = []
    for name, rows in tables.items():
        bounds = [rows * s // servers for s in range(servers + 1)]
        split.append((name, tuple(zip(bounds[:-1], bounds[1:]))))
    owners = []
    for name, numel in sorted(dense.items(), key=lambda kv: (-kv[1], kv[0])):
        server = min(range(servers), key=lambda s: (load[s], s))
        load[server] += numel
        owners.append((name, server))
    return Placement(servers, tuple(owners), tuple(split))
