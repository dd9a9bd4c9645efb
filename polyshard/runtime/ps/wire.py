"""Messages between parameter servers and workers: authenticated sockets carrying pickled numpy arrays.

torch.distributed.rpc is not used: its agent refuses a process that restarts under its old name ("worker
name is not unique") and its store dies with rank 0, while a parameter server has to take back restarted
workers and servers. Python's ``multiprocessing.connection`` gives sockets with an HMAC handshake, so only
processes holding the run's key can connect, and a dead peer shows as a closed connection.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
from multiprocessing.connection import Client, Connection

import numpy as np
import torch

from polyshard.errors import PolyshardError

# what a lost peer looks like from a send or a receive
PEER_LOST = (EOFError, ConnectionError, OSError)


def send(conn: Connection, message: tuple) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=5))


def receive(conn: Connection) -> tuple:
    return pickle.loads(conn.recv_bytes())  # peers passed the key handshake: they are the run's own processes


def to_wire(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {name: t.detach().cpu().numpy() for name, t in tensors.items()}


def from_wire(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in arrays.items()}


def no_delay(conn: Connection) -> Connection:
    """Sends at once: a message goes out as header and body, and Nagle's algorithm would hold the body back
    for the peer's delayed acknowledgement (40 ms a round trip)."""
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def connect(address: tuple[str, int], key: bytes, within: float) -> Connection:
    """A connection to ``address``, retried until ``within`` seconds pass (a server may be starting or restarting)."""
    deadline = time.monotonic() + within
    while True:
        try:
            return no_delay(Client(address, authkey=key))
        except PEER_LOST as exc:
            if time.monotonic() > deadline:
                raise PolyshardError(f"no parameter server answers at {address[0]}:{address[1]} after {within:.0f} "
                                     f"s ({exc}); check the address and that the server runs") from exc
            time.sleep(0.2)


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` as a (host, port) pair, or one clear error."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PolyshardError(f"server address {text!r} is not HOST:PORT")
    return host, int(port)
