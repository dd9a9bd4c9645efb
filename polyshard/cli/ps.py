"""``polyshard ps``: parameter-server training, every role on this machine, or one role of a cluster job."""

from __future__ import annotations

import argparse
import functools
import math
import os

from polyshard.errors import PolyshardError, check_output_file

KEY_ENV = "POLYSHARD_PS_KEY"  # the run's shared secret, hex, for roles started one by one (e.g. by Kubernetes)
OPTIMIZERS = {"sgd": "SGD", "adam": "Adam"}  # flag -> torch.optim's class (torch loads once a job runs)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``ps`` on the ``polyshard`` subcommands."""
    p = sub.add_parser("ps", help="train with parameter servers (embedding tables split by rows, sync or async)",
                       description="Servers hold the parameters and optimizer state, embedding tables split by rows "
                                   "over them; workers pull parameters (only the table rows a batch touches), compute "
                                   "gradients and push them. Every role runs on this machine and is restarted if it "
                                   "dies; with --role, this process is one role of a job started elsewhere.")
    p.add_argument("--servers", type=int, default=1, help="parameter servers (default 1)")
    p.add_argument("--workers", type=int, default=2, help="workers (default 2); each computes batch-size/workers rows")
    p.add_argument("--model", default="recsys-small", help="recsys-tiny, recsys-small (a click model with a 100k-row "
                   "table; default), or a GPT name or gpt:... shape (see `polyshard models`)")
    p.add_argument("--steps", type=int, default=50, help="updates each server applies (default 50)")
    p.add_argument("--batch-size", type=int, default=64, help="global batch rows per update (default 64)")
    p.add_argument("--optimizer", choices=list(OPTIMIZERS), default="sgd", help="run on the servers (default sgd)")
    p.add_argument("--lr", type=float, default=0.1, help="learning rate (default 0.1)")
    p.add_argument("--mode", choices=["sync", "async"], default="sync", help="sync: each update averages every live "
                   "worker's gradient; async: each gradient is applied as it arrives (default sync)")
    p.add_argument("--staleness", type=int, default=None, help="async: drop a gradient whose parameters are more "
                   "than this many updates old (default: keep all)")
    p.add_argument("--straggler-timeout", type=float, default=None, help="sync: seconds an update waits for a "
                   "silent worker once another's gradient is in, then goes on without it (default 60)")
    p.add_argument("--seed", type=int, default=0, help="init and data (default 0)")
    p.add_argument("--snapshot-dir", default="", help="where servers snapshot their parameters and optimizer state "
                   "(default: a temporary folder); a restarted server resumes from it")
    p.add_argument("--snapshot-every", type=int, default=10, help="updates between snapshots (default 10)")
    p.add_argument("--resume", action="store_true", help="continue the run whose snapshots --snapshot-dir holds "
                   "(stopped, or ended short of --steps) from the newest update every server kept")
    p.add_argument("--max-restarts", type=int, default=3, help="restarts per role before the run gives up on it "
                   "(default 3)")
    p.add_argument("--log-every", type=int, default=10, help="updates per progress line (default 10)")
    p.add_argument("--out", default="", help="write the trained parameters here (a torch .pt file)")
    p.add_argument("--role", choices=["server", "worker"], default=None, help="be one role of a job whose roles "
                   f"start separately (e.g. pods); needs --index, --addresses and the key in ${KEY_ENV}")
    p.add_argument("--index", type=int, default=0, help="with --role: this role's index (default 0)")
    p.add_argument("--addresses", default="", help="with --role: every server's HOST:PORT, comma-separated")
    p.set_defaults(handler=run)


def job_of(args: argparse.Namespace) -> dict:
    import torch

    from polyshard.runtime.ps.jobs import NamedBatches, NamedModel, check_name
    from polyshard.runtime.ps.launch import MIN_STRAGGLER_SECONDS

    check_name(args.model)
    for flag, value in (("--servers", args.servers), ("--workers", args.workers), ("--steps", args.steps),
                        ("--batch-size", args.batch_size), ("--snapshot-every", args.snapshot_every),
                        ("--log-every", args.log_every)):
        if value < 1:
            raise PolyshardError(f"{flag} must be at least 1, got {value}")
    if args.max_restarts < 0:
        raise PolyshardError(f"--max-restarts must be 0 or more, got {args.max_restarts}")
    if args.batch_size % args.workers:
        raise PolyshardError(f"--batch-size {args.batch_size} must split evenly over --workers {args.workers}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise PolyshardError(f"--lr must be positive and finite, got {args.lr}")
    if args.straggler_timeout is not None and args.mode == "async":
        raise PolyshardError("--straggler-timeout is how long a sync update waits for a silent worker, and async "
                             "applies each gradient as it arrives; leave it out or use --mode sync")
    if args.straggler_timeout is not None and not args.straggler_timeout >= MIN_STRAGGLER_SECONDS:
        raise PolyshardError(f"--straggler-timeout must be at least {MIN_STRAGGLER_SECONDS} seconds, got "
                             f"{args.straggler_timeout}")
    if args.staleness is not None and args.mode == "sync":
        raise PolyshardError("--staleness bounds how old an async gradient may be, and sync waits for every worker's; "
                             "leave it out or use --mode async")
    if args.staleness is not None and args.staleness < 0:
        raise PolyshardError(f"--staleness must be 0 or more updates, got {args.staleness}")
    waits = {} if args.straggler_timeout is None else {"straggler_seconds": args.straggler_timeout}
    optimizer = functools.partial(getattr(torch.optim, OPTIMIZERS[args.optimizer]), lr=args.lr)
    return dict(model_fn=NamedModel(args.model), batch_fn=NamedBatches(args.model, args.batch_size, args.seed),
                workers=args.workers, steps=args.steps, optimizer=optimizer,
                mode=args.mode, staleness=args.staleness, seed=args.seed, snapshot_every=args.snapshot_every,
                log_every=args.log_every, **waits)


def run(args: argparse.Namespace) -> int:
    """All roles here (the default), or the one ``--role`` names."""
    job = job_of(args)
    if args.role:
        return _one_role(args, job)
    if args.index or args.addresses:
        raise PolyshardError(f"{'--index' if args.index else '--addresses'} places one role of a job started "
                             "elsewhere: give --role too, or leave it out to run every role here")
    if args.resume and not args.snapshot_dir:
        raise PolyshardError("--resume continues a run from its snapshots: give their --snapshot-dir")
    if args.out:
        check_output_file("--out", args.out)
    from polyshard.runtime.ps import train_ps
    from polyshard.runtime.signals import Stopped

    try:
        result = train_ps(servers=args.servers, snapshot_dir=args.snapshot_dir or None,
                          max_restarts=args.max_restarts, resume=args.resume, **job)
    except Stopped as exc:
        if args.snapshot_dir:  # else they were in a temporary folder, gone with the run
            exc.then = (f"; the servers' last snapshots are in {args.snapshot_dir} (the same command with --resume "
                        "continues from them)")
        raise
    restarted = {role: n for role, n in result.restarts.items() if n}
    print(f"polyshard ps: {len(result.losses)} updates, loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}"
          + (f"; restarted {restarted}" if restarted else "")
          + (f"; {result.lost} update(s) lost to a server restart and redone" if result.lost else "")
          + (f"; {result.stale} stale gradient(s) dropped" if result.stale else ""))
    if args.out:
        import torch

        torch.save(result.params, args.out)
        print(f"polyshard ps: parameters written to {args.out}")
    return 0


def _one_role(args: argparse.Namespace, job: dict) -> int:
    from polyshard.runtime.ps.launch import check, run_role
    from polyshard.runtime.ps.spec import PSSpec
    from polyshard.runtime.ps.wire import parse_address

    if args.resume:
        raise PolyshardError("--resume continues a run started here; a --role server resumes from its "
                             "--snapshot-dir by itself")
    key = os.environ.get(KEY_ENV, "")
    if not key:
        raise PolyshardError(f"--role needs the run's key in ${KEY_ENV} (the same hex string for every role)")
    addresses = tuple(parse_address(a) for a in args.addresses.split(",") if a)
    if not addresses:
        raise PolyshardError("--role needs --addresses: every server's HOST:PORT, comma-separated")
    if len(addresses) != args.servers:
        raise PolyshardError(f"--addresses names {len(addresses)} server(s) and --servers is {args.servers}; give "
                             "every server's address once")
    count = len(addresses) if args.role == "server" else args.workers
    if not 0 <= args.index < count:
        raise PolyshardError(f"--index {args.index} is not a {args.role} of this job (0 .. {count - 1})")
    if not args.snapshot_dir and args.role == "server":
        raise PolyshardError("--role server needs --snapshot-dir, a folder that outlives the process, to restart from")
    try:
        secret = bytes.fromhex(key)
    except ValueError:
        raise PolyshardError(f"${KEY_ENV} is not a hex string") from None
    spec = PSSpec(servers=addresses, key=secret, snapshot_dir=args.snapshot_dir, **job)
    check(spec, len(addresses), args.max_restarts)
    run_role(spec, args.role, args.index)
    return 0
