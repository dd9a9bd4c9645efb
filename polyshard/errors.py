"""Errors a user can cause; each message names the offending value and a fix."""

from pathlib import Path


class PolyshardError(ValueError):
    """Bad input to polyshard: a strategy, mesh, cluster or flag that cannot work."""


def file_in_the_way(path: str) -> Path | None:
    """The file standing where ``path`` or one of the folders above it must be, if any (the nearest that exists)."""
    existing = next((p for p in (Path(path), *Path(path).parents) if p.exists()), None)
    return existing if existing is not None and not existing.is_dir() else None


def check_output_file(flag: str, path: str) -> None:
    """A file a command writes when its work is done, refused before the work if it names a folder or sits in
    none."""
    target = Path(path)
    if target.is_dir():
        raise PolyshardError(f"{flag} {path!r} is a folder; name a file in it")
    if not target.resolve().parent.is_dir():
        raise PolyshardError(f"{flag} {path!r} is in a folder that does not exist; create it first")
