"""Checkpoints through torch.distributed.checkpoint (DCP), visible only once every rank's part is on disk.

A checkpoint is a directory ``step-NNNNNNNN`` under the save directory. Ranks write DCP files into a hidden
``.step-NNNNNNNN.partial``; when DCP has written its metadata (after every rank's files), rank 0 adds the
manifest (``polyshard.json``: step, model, plan, file sizes, the metadata's hash) and renames the directory,
which is the commit: a run killed before it leaves no checkpoint, only a partial directory that is ignored
and later removed. Reading trusts nothing on disk: the manifest and file sizes are checked, DCP's pickled
metadata is read with an unpickler that admits only its own record types, and every file it names must be a
plain name inside the checkpoint.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import shutil
import warnings
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from polyshard.errors import PolyshardError

FORMAT = "polyshard-checkpoint/1"
MANIFEST = "polyshard.json"
DCP_METADATA = ".metadata"
_NAME = re.compile(r"step-(\d{8})")


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def committed(root: str | Path) -> list[Path]:
    """The complete checkpoints under ``root``, oldest first (partial ones are hidden and not listed)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _NAME.fullmatch(p.name) and p.is_dir())


NEWEST = ("auto", "if-any")  # the --resume values that mean the newest checkpoint under --save-dir


def resolve(resume: str, root: str) -> Path | None:
    """The checkpoint ``--resume`` names: ``auto`` and ``if-any`` the newest under ``root`` (None when there is
    none)."""
    if resume in NEWEST:
        found = committed(root)
        return found[-1] if found else None
    path = Path(resume)
    if not path.is_dir():
        raise PolyshardError(f"--resume {resume}: no such checkpoint directory")
    return path


class Pending:
    """A save still being written (``--async-save``): :meth:`wait` (every rank calls it) commits it."""

    def __init__(self, future: Future | None, partial: Path, final: Path, manifest: dict, keep: int):
        self.future, self.partial, self.final, self.manifest, self.keep = future, partial, final, manifest, keep

    def wait(self) -> Path:
        if self.future is not None:
            self.future.result()
        if dist.get_rank() == 0:
            _commit(self.partial, self.final, self.manifest, self.keep)
        dist.barrier()  # no rank reads the save directory before the commit
        return self.final


def save(root: str | Path, step: int, state: dict[str, torch.Tensor], manifest: dict, keep: int = 0,
         async_save: bool = False, files: dict[str, str] | None = None, group=None) -> Pending:
    """Write ``state`` (every rank calls this) as checkpoint ``step`` under ``root``, with rank 0's text
    ``files`` beside it; ``keep``: how many checkpoints to leave (0: all). Blocking unless ``async_save``
    (then ``group``, a gloo group of all ranks, carries the background save's collectives, apart from
    training's); call ``wait()`` on the result to commit."""
    root = Path(root)
    final, partial = step_dir(root, step), root / f".step-{step:08d}.partial"
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)  # a save killed before its commit
        partial.mkdir(parents=True)
        for name, text in (files or {}).items():
            confined(partial, name).write_text(text)
    dist.barrier()
    manifest = dict(manifest, format=FORMAT, step=step, world=dist.get_world_size())
    if async_save:
        future = dcp.async_save(state, checkpoint_id=str(partial), process_group=group)
        return Pending(future, partial, final, manifest, keep)
    dcp.save(state, checkpoint_id=str(partial))
    return Pending(None, partial, final, manifest, keep)


def _commit(partial: Path, final: Path, manifest: dict, keep: int) -> None:
    files = {p.name: p.stat().st_size for p in sorted(partial.iterdir())}
    manifest = dict(manifest, files=files,
                    metadata_sha256=hashlib.sha256((partial / DCP_METADATA).read_bytes()).hexdigest())
    tmp = partial / (MANIFEST + ".tmp")
    with tmp.open("w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(partial / MANIFEST)
    if final.exists():  # the same step saved again (a rerun past it): the new one replaces it
        shutil.rmtree(final)
    partial.rename(final)
    if keep:
        for old in committed(final.parent)[:-keep]:
            shutil.rmtree(old)


def read_manifest(path: str | Path) -> dict:
    """A checkpoint's manifest, once its files are checked against it; a clear error for anything else."""
    path = Path(path)
    if not path.is_dir():
        raise PolyshardError(f"checkpoint {path}: no such directory")
    mpath = path / MANIFEST
    if not mpath.is_file():
        partial = " (a save that never finished)" if path.name.endswith(".partial") else ""
        raise PolyshardError(f"checkpoint {path} has no {MANIFEST}: not a complete polyshard checkpoint{partial}")
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PolyshardError(f"checkpoint {path}: {MANIFEST} is not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise PolyshardError(f"checkpoint {path}: {MANIFEST} is not a {FORMAT} manifest")
    files = manifest.get("files")
    if not isinstance(files, dict) or DCP_METADATA not in files:
        raise PolyshardError(f"checkpoint {path}: its manifest lists no files")
    for name, size in files.items():
        confined(path, name)
    for name, size in files.items():
        f = path / name
        if not f.is_file() or f.stat().st_size != size:
            have = f"{f.stat().st_size} bytes" if f.is_file() else "missing"
            raise PolyshardError(f"checkpoint {path}: file {name} should hold {size} bytes, is {have}; "
                                 "the checkpoint is damaged")
    digest = hashlib.sha256((path / DCP_METADATA).read_bytes()).hexdigest()
    if digest != manifest.get("metadata_sha256"):
        raise PolyshardError(f"checkpoint {path}: {DCP_METADATA} does not match its manifest's hash; "
                             "it was changed after the save")
    return manifest


def read_metadata(path: str | Path) -> Metadata:
    """DCP's metadata of a checkpoint, unpickled admitting only DCP's record types and torch sizes/dtypes,
    with every file it points into confined to the checkpoint."""
    path = Path(path)
    try:
        meta = _SafeUnpickler(io.BytesIO((path / DCP_METADATA).read_bytes())).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError) as e:
        raise PolyshardError(f"checkpoint {path}: {DCP_METADATA} cannot be read safely ({e})") from None
    if not isinstance(meta, Metadata):
        raise PolyshardError(f"checkpoint {path}: {DCP_METADATA} holds {type(meta).__name__}, not DCP metadata")
    for info in (meta.storage_data or {}).values():
        confined(path, getattr(info, "relative_path", ""))
    return meta


def tensor_entries(meta: Metadata) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Each saved tensor's global shape and dtype, by key."""
    return {k: (tuple(v.size), v.properties.dtype) for k, v in meta.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}


def load(path: str | Path, state: dict[str, torch.Tensor], meta: Metadata) -> None:
    """Fill ``state``'s tensors (any layout) from the checkpoint at ``path`` (every rank calls this), by
    ``meta``, its metadata as :func:`read_metadata` checked it (DCP does not read it again)."""
    dcp.load(state, storage_reader=_SafeReader(path, meta))


def read_full(path: str | Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """The checkpoint's tensors whose keys start with ``prefix``, whole, in this process alone (no process
    group): for export and inspection."""
    read_manifest(path)
    meta = read_metadata(path)
    state = {k: torch.zeros(shape, dtype=dtype) for k, (shape, dtype) in tensor_entries(meta).items()
             if k.startswith(prefix)}
    with warnings.catch_warnings():  # DCP warns that it loads in one process: that is the point here
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=_SafeReader(path, meta), no_dist=True)
    return state


def confined(root: Path, name: object) -> Path:
    """``root / name`` for a plain file name read from disk; anything reaching outside ``root`` is refused."""
    if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\0"):
        raise PolyshardError(f"{root} names the file {name!r}, which is not a plain name inside it")
    return root / name


class _SafeUnpickler(pickle.Unpickler):
    """Only the classes DCP's metadata is made of."""

    MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
               "torch.distributed.checkpoint.planner", "torch.distributed.checkpoint.storage")
    OTHERS = {("torch", "Size"), ("torch", "device"), ("collections", "OrderedDict"), ("builtins", "set"),
              ("builtins", "frozenset"), ("torch", "layout"), ("torch", "memory_format"),
              ("torch.serialization", "_get_layout"), ("torch.storage", "_get_dtype_from_pickle_storage_type"),
              ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}

    def find_class(self, module: str, name: str):
        if module in self.MODULES or (module, name) in self.OTHERS or (
                module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                              torch.memory_format))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP metadata")


class _SafeReader(dcp.FileSystemReader):
    """DCP's file reader handed the metadata already read and checked, instead of unpickling it itself."""

    def __init__(self, path: str | Path, meta: Metadata):
        super().__init__(path)
        self._meta = meta

    def read_metadata(self, *args, **kwargs) -> Metadata:
        meta = self._meta
        meta.storage_meta = meta.storage_meta or dcp.metadata.StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta
