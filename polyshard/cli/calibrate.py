"""``polyshard calibrate``: time this machine's matmuls and collectives into a cluster YAML for ``plan``."""

from __future__ import annotations

import argparse
import os
import sys

from polyshard.errors import PolyshardError, check_output_file


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``calibrate`` on the ``polyshard`` subcommands."""
    c = sub.add_parser("calibrate", help="measure this machine's compute and link speeds into a cluster YAML",
                       description="Time matmuls and collectives on N local processes, fit latency and bandwidth, "
                                   "and write a cluster file for `polyshard plan --cluster FILE.yaml`. With one "
                                   "process (one GPU) only the device is timed.")
    c.add_argument("--nproc", type=int, default=2, help="processes to launch through torchrun (default 2; "
                   "1 measures the device alone and keeps the detected preset's links)")
    c.add_argument("--out", default="cluster.yaml", help="write the cluster YAML here (default cluster.yaml)")
    c.add_argument("--max-bytes", default="16MiB", help="largest message timed; sizes run 4KiB, 16KiB, ... "
                   "by powers of 4 up to it (default 16MiB)")
    c.add_argument("--repeats", type=int, default=5, help="timed runs per measurement, after one warm-up; "
                   "the median counts (default 5)")
    c.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Relaunch through torchrun when not under it; under it, calibrate on every rank."""
    from polyshard.cli.launch import under_torchrun

    in_torchrun = under_torchrun()
    if not in_torchrun and args.nproc < 1:
        raise PolyshardError(f"--nproc must be at least 1, got {args.nproc}")
    if args.repeats < 1:
        raise PolyshardError(f"--repeats must be at least 1, got {args.repeats}")
    check_output_file("--out", args.out)
    from polyshard.calibrate import message_sizes
    from polyshard.cluster import parse_bytes

    sizes = message_sizes(parse_bytes(args.max_bytes))
    if not in_torchrun:
        from polyshard.cli.launch import launch

        return launch(args.nproc, ["-m", "polyshard.cli.main", "calibrate", "--out", args.out,
                                    "--max-bytes", args.max_bytes, "--repeats", str(args.repeats)])
    _calibrate_here(args.out, sizes, args.repeats)
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)  # the file is written: skip the interpreter's teardown, where gloo's threads can abort it


def _calibrate_here(out: str, sizes: list[int], repeats: int) -> None:
    """This rank's part: join the group (nccl on GPUs, else gloo with one thread), measure, leave."""
    import torch
    import torch.distributed as dist

    from polyshard.calibrate import calibrate

    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    try:
        calibrate(out, sizes, repeats)
    finally:
        dist.destroy_process_group()
