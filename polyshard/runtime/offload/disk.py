"""Optimizer entries in files, one per parameter, streamed through each step and committed atomically.

A step writes new files (never over committed ones), then a manifest naming them with their sizes and
checksums, written last by rename: a process killed at any point leaves the previous step whole.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from polyshard.errors import PolyshardError
from polyshard.runtime.checkpoint import confined

MANIFEST = "manifest.json"
FORMAT = 1

try:
    _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
except (OSError, AttributeError):  # not glibc: its allocator keeps no such heap
    _malloc_trim = None


def entry_bytes(entry: dict) -> dict[str, int]:
    """Tensor bytes of an entry under each top-level key (what the ledger reports)."""
    return {key: _tensor_bytes(value) for key, value in entry.items()}


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def in_background(fn: Callable, items: Iterable, slots: int) -> Iterator:
    """``fn(item)`` for each item in order, computed by one background thread up to ``slots`` items ahead."""
    with ThreadPoolExecutor(1) as pool:
        ahead: deque = deque()
        for item in items:
            ahead.append(pool.submit(fn, item))
            if len(ahead) > slots:
                yield ahead.popleft().result()
        while ahead:
            yield ahead.popleft().result()


def _fsync(path: Path) -> None:
    """Flushes a file, or a directory's renames, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` to a temporary name, flushed to disk, then renamed: readers see all of it or none."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    _fsync(tmp)
    os.replace(tmp, path)


def _crc32(path: Path) -> int:
    """Checksum of a file read through a mapping, so no buffer of its size is allocated."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
        return zlib.crc32(view)


class DiskStore:
    """Entries (dicts of tensors) keyed by parameter index, one file each under ``path``."""

    place = "disk"

    def __init__(self, path: str | os.PathLike, prefetch: int = 2, resume: bool = False):
        if prefetch < 1:
            raise PolyshardError(f"prefetch must be at least 1, got {prefetch}")
        self.path, self.prefetch = Path(path), prefetch
        self.path.mkdir(parents=True, exist_ok=True)
        manifest = self._read_manifest()
        if manifest is not None and not resume:
            raise PolyshardError(f"{self.path} holds step {manifest['step']} of an earlier run; "
                                 "pass resume=True to continue from it, or use an empty directory")
        if manifest is None and resume:
            raise PolyshardError(f"{self.path} holds no committed step to resume from")
        manifest = manifest or {"version": 0, "step": 0, "files": {}}
        self.version, self.step = manifest["version"], manifest["step"]
        self.files = {int(i): record for i, record in manifest["files"].items()}
        for record in self.files.values():
            confined(self.path, record["file"])  # it is read, and replaced files are deleted
        self._remove_strays()
        for record in self.files.values():
            file = self.path / record["file"]
            if not file.is_file() or file.stat().st_size != record["size"]:
                raise PolyshardError(f"{file} is missing or not the size the manifest of step {self.step} records; "
                                     "the directory was changed after that step was committed")

    def _read_manifest(self) -> dict | None:
        file = self.path / MANIFEST
        if not file.exists():
            return None
        try:
            manifest = json.loads(file.read_text())
        except (ValueError, OSError) as exc:
            raise PolyshardError(f"{file} cannot be read as a manifest: {exc}") from exc
        if manifest.get("format") != FORMAT:
            raise PolyshardError(f"{file} has format {manifest.get('format')!r}; this version reads {FORMAT}")
        return manifest

    def _remove_strays(self) -> None:
        """Files of a step that never committed (the process stopped before its manifest was renamed)."""
        named = {record["file"] for record in self.files.values()}
        for file in [*self.path.glob("param-*.pt"), *self.path.glob("*.tmp")]:
            if file.name not in named:
                file.unlink()

    def load(self, index: int) -> dict | None:
        """The committed entry of ``index`` (None when it has none), checked against the manifest."""
        record = self.files.get(index)
        if record is None:
            return None
        file = self.path / record["file"]
        try:
            intact = file.stat().st_size == record["size"] and _crc32(file) == record["crc32"]
        except OSError as exc:
            raise PolyshardError(f"{file} of step {self.step} cannot be read: {exc.strerror}") from exc
        if not intact:
            raise PolyshardError(f"{file} does not match the size and checksum the manifest of step {self.step} "
                                 "records; the directory was changed after that step was committed")
        # Mapped, not read: the checksum pulled the pages into the page cache, and they leave this
        # process's memory when the entry is dropped (heap buffers would stay with the allocator).
        return torch.load(file, mmap=True, weights_only=True)

    def stream(self, indices: Iterable[int]) -> Iterator[tuple[int, dict | None]]:
        """``(index, entry)`` in order, read and checked ahead by a background thread, at most ``prefetch`` ahead."""
        return in_background(lambda i: (i, self.load(i)), indices, self.prefetch)

    def _write(self, version: int, index: int, entry: dict) -> tuple[int, dict]:
        name = f"param-{index}.v{version}.pt"
        record = {"file": name, "bytes": entry_bytes(entry)}

        def write(tmp: Path) -> None:
            torch.save(entry, tmp)
            record.update(size=tmp.stat().st_size, crc32=_crc32(tmp))

        _atomic_write(self.path / name, write)
        return index, record

    def commit(self, step: int, entries: Iterable[tuple[int, dict]]) -> None:
        """Writes ``entries`` (a background writer persists each while the next is produced), then the manifest."""
        version = self.version + 1
        written = dict(in_background(lambda item: self._write(version, *item), entries, self.prefetch))
        files = {**self.files, **written}
        _fsync(self.path)
        manifest = {"format": FORMAT, "version": version, "step": step,
                    "files": {str(i): record for i, record in sorted(files.items())}}
        _atomic_write(self.path / MANIFEST, lambda tmp: tmp.write_text(json.dumps(manifest, indent=1)))
        _fsync(self.path)
        stale = {r["file"] for r in self.files.values()} - {r["file"] for r in files.values()}
        self.files, self.version, self.step = files, version, step
        for name in stale:
            (self.path / name).unlink()
        if _malloc_trim is not None:
            # glibc keeps freed heap memory for reuse (buffers up to 32 MiB come from its heap once one
            # that large was freed): hand it back, so streaming the state lowers the process's memory.
            _malloc_trim(0)

    def tensor_bytes(self) -> dict[str, int]:
        """Tensor bytes held in the files, per entry key."""
        total: dict[str, int] = {}
        for record in self.files.values():
            for key, n in record["bytes"].items():
                total[key] = total.get(key, 0) + n
        return total
