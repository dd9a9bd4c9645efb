"""Token files as nanoGPT's prepare scripts write them: a flat array of uint16 or uint32 ids, read by memmap."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from polyshard.errors import PolyshardError

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
SCANNED = 1 << 22  # tokens checked against the vocabulary before launch, from each end of the file


def open_tokens(path: str, dtype: str = "uint16") -> np.memmap:
    """The file's tokens, mapped (nothing read until a window is); refuses what cannot be a token file."""
    p = Path(path)
    if not p.is_file():
        raise PolyshardError(f"--data {path!r} is not a file; give a token file (uint16 or uint32 ids, as "
                             "nanoGPT's prepare.py writes)")
    if dtype not in DTYPES:
        raise PolyshardError(f"--data-dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    size, item = p.stat().st_size, np.dtype(DTYPES[dtype]).itemsize
    if size == 0 or size % item:
        raise PolyshardError(f"--data {path!r} has {size} bytes, not a whole number of {dtype} tokens; pass the "
                             "--data-dtype it was written in")
    return np.memmap(p, dtype=DTYPES[dtype], mode="r")


def check_tokens(tokens: np.ndarray, path: str, vocab_size: int, seq_len: int) -> None:
    """Long enough for one window, and ids inside the vocabulary (checked at both ends of a large file;
    the trainer checks every batch it reads)."""
    if len(tokens) <= seq_len:
        raise PolyshardError(f"--data {path!r} holds {len(tokens)} tokens; a window of the model's sequence "
                             f"({seq_len} + 1) needs more")
    for part in (tokens[:SCANNED], tokens[-SCANNED:]):
        top = int(part.max())
        if top >= vocab_size:
            raise PolyshardError(out_of_vocabulary(path, top, vocab_size))


def out_of_vocabulary(path: str, token: int, vocab_size: int) -> str:
    return (f"--data {path!r} holds token id {token}, but the model's vocabulary has {vocab_size} ids; train a "
            "model with a larger vocabulary (e.g. --model gpt:...,vocab=N) or check --data-dtype")
