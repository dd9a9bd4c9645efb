"""Errors a user can cause; each message names the offending value and a fix."""

from pathlib import Path


class PolyshardError(ValueError):
    """Bad input to polyshard: a strategy, mesh, cluster or flag that cannot work."""


def check_output_file(flag: str, path: str) -> None:
    """A file a command writes when its work is done, refused before the work if it names a folder or sits in
    none."""
    target = Path(path)
    if target.is_dir():
        raise PolyshardError(f"{flag} {path!r} is a folder; name a file in it")
    if not target.resolve().parent.is_dir():
        raise PolyshardError(f"{flag} {path!r} is in a folder that does not exist; create it first")
