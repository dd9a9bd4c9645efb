"""Starting ranks: torchrun on this machine (one machine of several, when asked), and a bad input the
ranks find said once."""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import signal
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

from polyshard.errors import PolyshardError
from polyshard.runtime.signals import Interrupt, Stopped, interrupts_raised

STOP_GRACE_S = 5.0  # after a rank's error or a stop, how long the processes may take to end before they are killed
# A stopped run that checkpoints gets this long: its ranks end the step they are in and save it before they exit.
SAVE_STOP_GRACE_S = 60.0
ERRORS_ENV = "POLYSHARD_ERRORS_DIR"  # where ranks launched by `polyshard` leave the bad input they found
STOPS_ENV = "POLYSHARD_STOPS_DIR"  # where they leave word that they stopped on purpose, and how
# `polyshard train`'s flags for the launch itself, as argparse takes them: the ranks are started without them
LAUNCH_FLAGS = {
    "--nproc": dict(type=int, default=None,
                    help="processes to launch through torchrun (default: 1, or the current torchrun world)"),
    "--nnodes": dict(type=int, default=1, help="machines the run spans (default 1): start the same command on each, "
                     "with its own --node-rank; --nproc is per machine"),
    "--node-rank": dict(type=int, default=0, help="this machine's index, 0 .. nnodes-1 (default 0)"),
    "--rdzv": dict(default="", help="HOST:PORT where the machines meet: node 0's address and a free port (needed "
                   "with --nnodes 2 or more)"),
    "--rdzv-timeout": dict(type=float, default=600, help="seconds a machine other than 0 waits for machine 0 at "
                           "--rdzv before giving up (default 600)"),
    "--max-restarts": dict(type=int, default=0, help="when a process dies, restart the job up to N times; with "
                           "--save-dir it resumes from the newest checkpoint by itself"),
}


def under_torchrun() -> bool:
    """This process is a rank torchrun started (a scheduler such as Kubernetes' PyTorchJob sets RANK and
    WORLD_SIZE on the launching process too, but never LOCAL_RANK)."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def check_nodes(nnodes: int, node_rank: int, rdzv: str, rdzv_timeout: float) -> tuple[str, int] | None:
    """The (host, port) machines meet at, None for one machine; refuses counts, addresses and waits that cannot
    work."""
    if not (rdzv_timeout > 0 and math.isfinite(rdzv_timeout)):
        raise PolyshardError(f"--rdzv-timeout must be a positive, finite number of seconds, got {rdzv_timeout}")
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


def reach_rendezvous(rendezvous: tuple[str, int], node_rank: int, timeout: float) -> None:
    """The rendezvous host resolves, and (on machines other than 0) machine 0 listens there within ``timeout``
    seconds: otherwise torchrun would retry for many minutes without a word."""
    host, port = rendezvous
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise PolyshardError(f"--rdzv host {host!r} does not resolve ({exc.strerror}); give machine 0's name or "
                             "IP address") from None
    if node_rank == 0:
        return
    deadline, said = time.monotonic() + timeout, False
    while True:
        try:
            with socket.create_connection((host, port), timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise PolyshardError(f"machine 0 did not answer at {host}:{port} within --rdzv-timeout {timeout:g} s; "
                                     "start it with the same --rdzv, or check the address and that the port is "
                                     "open") from None
            if not said:
                print(f"polyshard: waiting for machine 0 at {host}:{port} (up to {timeout:g} s)", file=sys.stderr)
                said = True
            time.sleep(0.5)


def check_gpus(nproc: int) -> None:
    """On a machine with GPUs each rank takes its own (its LOCAL_RANK): refuse more ranks than GPUs before any
    starts, instead of ranks failing one by one on a device they cannot select."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count and nproc > count:
        raise PolyshardError(f"--nproc {nproc} puts one process on each GPU, and this machine has {count}: use "
                             f"--nproc {count} or fewer, or run on the CPU with CUDA_VISIBLE_DEVICES=''")


def launch(nproc: int, command: list[str], nodes: tuple[int, int] = (1, 0), rendezvous: tuple[str, int] | None = None,
           max_restarts: int = 0, stop_grace_s: float = STOP_GRACE_S) -> int:
    """torchrun: ``nproc`` ranks on this machine, one thread each (one GPU each, where it has GPUs), machine
    ``nodes[1]`` of ``nodes[0]`` meeting the others at ``rendezvous`` (default: this machine alone, on a free
    port). A bad input the ranks find is said once, with exit code 2, instead of once per rank under torchrun's
    own report; a rank that dies otherwise restarts the job up to ``max_restarts`` times. Stopped (Ctrl-C,
    SIGTERM), the ranks get ``stop_grace_s`` seconds to end before they are killed; ranks that stopped on purpose
    (those of another machine, their peers told to stop) end the job here too, restarting nothing."""
    check_gpus(nproc)
    if rendezvous is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            rendezvous = ("127.0.0.1", s.getsockname()[1])
    host, port = rendezvous
    if nodes[0] == 1 or max_restarts:  # c10d rendezvous: each restart meets afresh (a static one reuses stale keys)
        meet = ["--rdzv-backend=c10d", f"--rdzv-endpoint={host}:{port}", "--rdzv-id=polyshard",
                f"--rdzv-conf=is_host={int(nodes[1] == 0)}"]
    else:  # static: machine r holds ranks r*nproc .., so node 0 holds rank 0
        meet = [f"--node-rank={nodes[1]}", f"--master-addr={host}", f"--master-port={port}"]
    with tempfile.TemporaryDirectory(prefix="polyshard-launch-") as scratch:  # torchrun's logs too: it keeps them
        errors, stops = os.path.join(scratch, "errors"), os.path.join(scratch, "stops")
        os.mkdir(errors)
        os.mkdir(stops)
        argv = [f"--nproc-per-node={nproc}", f"--nnodes={nodes[0]}", *meet, f"--max-restarts={max_restarts}",
                # stopped, the agent too gives its ranks the grace before it kills them (torchrun's default: 30 s)
                f"--shutdown-timeout={math.ceil(stop_grace_s)}",
                f"--log-dir={os.path.join(scratch, 'logs')}", *command]
        env = dict(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), **{ERRORS_ENV: errors, STOPS_ENV: stops},
                   # the ranks' own store, new for each restart: the agent's shared one keeps the last attempt's
                   # addresses, which a restarted rank can read before its peer replaces them
                   TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        proc = _Agent(argv, env)  # forked before the handlers below: the agent keeps torchrun's own
        with interrupts_raised():
            try:
                last = _relay(proc, errors, stop_after_error=not max_restarts, stops=stops, ranks=nproc,
                              stop_grace_s=stop_grace_s)
            except Interrupt as exc:
                _end(proc, stop_grace_s)
                raise _said_stop(stops) or Stopped(exc.signum) from None
        code = proc.wait()
        stopped = _said_stop(stops)
        if stopped:
            raise stopped
        said = sorted({p.read_text() for p in Path(errors).iterdir()})
    for message in said:
        print(("" if last == b"\n" else "\n") + f"polyshard: error: {message}", file=sys.stderr)
        last = b"\n"
    return 2 if said and code else code  # a restart that then finished overrides what a rank said


def _end(proc: _Agent, grace_s: float) -> None:
    """Stop the agent and the ranks under it: SIGTERM, ``grace_s`` seconds to end (its output dropped: torchrun's
    shutdown chatter), then SIGKILL for what is left."""
    job = set(_descendants(proc.pid) + [proc.pid])  # taken now: a rank outliving the agent is no longer under it
    _signal(job, signal.SIGTERM)
    stop_at = time.monotonic() + grace_s
    while time.monotonic() < stop_at:
        if select.select([proc.stderr], [], [], 0.1)[0] and not os.read(proc.stderr.fileno(), 1 << 16):
            break  # every writer of the pipe has ended
    _signal(job | set(_descendants(proc.pid)), signal.SIGKILL)
    proc.wait()


def _signal(pids, signum: int) -> None:
    """Send ``signum`` to each of ``pids`` still there."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


class _Agent:
    """torchrun's agent (``torch.distributed.run``) in a fork of this process, with its stderr piped here: torch is
    loaded already, so no second interpreter starts (seconds on a small machine) before the ranks do."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        sys.stdout.flush()
        sys.stderr.flush()  # nothing buffered here is written again by the fork
        read, write = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(read)
            os.dup2(write, 2)
            os.close(write)
            os.environ.update(env)
            os._exit(_run_agent(argv))
        os.close(write)
        self.stderr = os.fdopen(read, "rb", buffering=0)

    def wait(self) -> int:
        code = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        self.stderr.close()
        return code


def _run_agent(argv: list[str]) -> int:
    """``torchrun ARGV``'s exit code, its error said on stderr as torchrun says it; a failed rank in one line, the
    job ending with the rank's own exit code (its output above says why)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main

    try:
        main(argv)
        return 0
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        how = f"was ended by {failure.signal_name()}" if failure.exitcode < 0 else \
            f"exited with code {failure.exitcode}"
        print(f"polyshard: error: rank {rank} (pid {failure.pid}) {how}, and the job stopped", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    except SystemExit as exc:  # as the interpreter ends on one: None is success, a message is said and fails
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _relay(proc: _Agent, errors: str, stop_after_error: bool, stops: str, ranks: int, stop_grace_s: float) -> bytes:
    """Copy torchrun's stderr through until a rank says an error or that it stopped. After an error, if
    ``stop_after_error``, give the job STOP_GRACE_S seconds to end and kill what is left (a hung or stopped rank);
    after a stop, kill the agent (which would restart the job) once this machine's ``ranks`` have all said it, or
    ``stop_grace_s`` seconds after the first did. Returns the last byte."""
    last, kill_at = b"\n", None
    while True:
        if select.select([proc.stderr], [], [], 0.5)[0]:
            chunk = os.read(proc.stderr.fileno(), 1 << 16)
            if not chunk:
                return last
            if not os.listdir(errors) and not os.listdir(stops):  # the rest is the ranks ending
                sys.stderr.buffer.write(chunk)
                sys.stderr.flush()
                last = chunk[-1:]
        stopped = len(os.listdir(stops))
        if kill_at is None and (stopped or stop_after_error and os.listdir(errors)):
            kill_at = time.monotonic() + (stop_grace_s if stopped else STOP_GRACE_S)
        if kill_at is not None and kill_at < math.inf and (time.monotonic() > kill_at or stopped >= ranks):
            _signal(_descendants(proc.pid) + [proc.pid], signal.SIGKILL)  # each rank is in a session of its own
            kill_at = math.inf


def say_stopped(stops: str, exc: Stopped) -> None:
    """Leave word in ``stops`` (a rank's :data:`STOPS_ENV`) that this rank stopped on purpose, and how."""
    rank = os.environ.get("RANK", "0")
    sys.stdout.flush()
    sys.stderr.flush()  # before the launcher may end this process
    written = Path(stops).parent / f"stop-rank{rank}"
    written.write_text(json.dumps([exc.signum, exc.processes, exc.then]))
    os.replace(written, Path(stops, f"rank{rank}"))  # whole, or not there


def _said_stop(stops: str) -> Stopped | None:
    """The stop the lowest rank of this machine left word of in ``stops``, if any did."""
    said = sorted(Path(stops).iterdir(), key=lambda p: int(p.name.removeprefix("rank")))
    return Stopped(*json.loads(said[0].read_text())) if said else None


def _descendants(root: int) -> list[int]:
    """Every process under ``root`` (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # "pid (name) state ppid ...": the name may hold spaces and parentheses
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


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
