"""Starting ranks: torchrun on this machine (one machine of several, when asked), and a bad input the
ranks find said once."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from polyshard.errors import PolyshardError

ERRORS_ENV = "POLYSHARD_ERRORS_DIR"  # where ranks launched by `polyshard` leave the bad input they found


def check_nodes(nnodes: int, node_rank: int, rdzv: str) -> tuple[str, int] | None:
    """The (host, port) machines meet at, None for one machine; refuses counts and addresses that cannot work."""
    if nnodes < 1:
        raise PolyshardError(f"--nnodes must be at least 1, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise PolyshardError(f"--node-rank {node_rank} is not one of the {nnodes} machines' indices 0 .. {nnodes - 1}")
    if not rdzv:
        if nnodes > 1:
            raise PolyshardError(f"--nnodes {nnodes} needs --rdzv HOST:PORT, node 0's address and a free port, the "
                                 "same on every machine")
        return None
    host, _, port = rdzv.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PolyshardError(f"--rdzv {rdzv!r} is not HOST:PORT (e.g. 10.0.0.1:29500)")
    return host, int(port)


def launch(nproc: int, command: list[str], nodes: tuple[int, int] = (1, 0),
            rendezvous: tuple[str, int] | None = None) -> int:
    """torchrun: ``nproc`` ranks on this machine, one thread each, machine ``nodes[1]`` of ``nodes[0]`` meeting
    the others at ``rendezvous`` (default: this machine alone, on a free port). A bad input the ranks find is
    said once, with exit code 2, instead of once per rank under torchrun's own report."""
    if rendezvous is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            rendezvous = ("127.0.0.1", s.getsockname()[1])
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--nnodes={nodes[0]}",
           f"--node-rank={nodes[1]}", f"--master-addr={rendezvous[0]}", f"--master-port={rendezvous[1]}", *command]
    with tempfile.TemporaryDirectory(prefix="polyshard-errors-") as errors:
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **{ERRORS_ENV: errors})
        proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE)
        last = b"\n"
        while chunk := os.read(proc.stderr.fileno(), 1 << 16):
            if not os.listdir(errors):  # after a rank's error, the rest is the other ranks stopping
                sys.stderr.buffer.write(chunk)
                sys.stderr.flush()
                last = chunk[-1:]
        code = proc.wait()
        said = sorted({p.read_text() for p in Path(errors).iterdir()})
    for message in said:
        print(("" if last == b"\n" else "\n") + f"polyshard: error: {message}", file=sys.stderr)
        last = b"\n"
    return 2 if said else code


def without_flag(argv: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out
