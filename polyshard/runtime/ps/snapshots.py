"""The servers' snapshots on disk. Each server keeps its newest two, so a stopped sync run can resume from an update
every server holds: servers stopped mid-run may be an update apart, and a snapshot apart."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from polyshard.errors import PolyshardError


def snapshot_path(snapshot_dir: str, index: int, previous: bool = False) -> Path:
    return Path(snapshot_dir) / (f"server-{index}.prev.pt" if previous else f"server-{index}.pt")


def write_snapshot(snapshot_dir: str, index: int, state: dict) -> None:
    """Written whole then renamed, so a kill mid-write leaves the snapshots before; the newest becomes the previous."""
    path = snapshot_path(snapshot_dir, index)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    if path.exists():
        os.replace(path, snapshot_path(snapshot_dir, index, previous=True))
    os.replace(tmp, path)


def read_snapshot(snapshot_dir: str, index: int) -> dict | None:
    """Server ``index``'s newest snapshot (the previous one where a kill came between the renames), if any."""
    for previous in (False, True):
        path = snapshot_path(snapshot_dir, index, previous)
        if path.exists():
            return torch.load(path, weights_only=True)
    return None


def servers_in(snapshot_dir: str) -> int:
    """How many servers left snapshots in ``snapshot_dir`` (0 where none did)."""
    found = {int(m[1]) for p in Path(snapshot_dir).glob("server-*.pt")
             if (m := re.fullmatch(r"server-(\d+)(\.prev)?\.pt", p.name))}
    return max(found) + 1 if found else 0


def resume_points(snapshot_dir: str, servers: int, sync: bool) -> list[tuple[int, Path]]:
    """Per server, the update a resumed run starts it from and the file that holds it: in sync mode the newest
    update every server holds (each worker computes one batch on parameters all of one update), else each
    server's newest."""
    held = []
    for index in range(servers):
        versions = {}
        for previous in (True, False):  # the newest last: it wins a tie
            path = snapshot_path(snapshot_dir, index, previous)
            if path.exists():
                versions[torch.load(path, weights_only=True, mmap=True)["version"]] = path  # tensors left unread
        if not versions:
            raise PolyshardError(f"server {index} left no snapshot in {snapshot_dir!r} to resume from")
        held.append(versions)
    if not sync:
        return [(max(v), v[max(v)]) for v in held]
    common = set.intersection(*(set(v) for v in held))
    if not common:
        newest = ", ".join(f"server {i}: {sorted(v)}" for i, v in enumerate(held))
        raise PolyshardError(f"the servers' snapshots in {snapshot_dir!r} share no update ({newest}), and a sync run "
                             "resumes only where every server was; resume with --mode async, or start afresh")
    return [(max(common), v[max(common)]) for v in held]


def make_newest(snapshot_dir: str, index: int, path: Path) -> None:
    """Server ``index`` restarts from ``path``: it becomes the newest, and what was newer is dropped."""
    if path != snapshot_path(snapshot_dir, index):
        os.replace(path, snapshot_path(snapshot_dir, index))
