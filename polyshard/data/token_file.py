"""Token files as nanoGPT's prepare scripts write them: a flat array of uint16 or uint32 ids, read by memmap;
`datasets` datasets saved to disk (their input_ids, polyshard.data.saved_dataset); and text files (or a
saved dataset's text rows) tokenized into a token file by a local tokenizer.json."""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import numpy as np

from polyshard.data.saved_dataset import ChunkedTokens, is_saved_dataset, saved_texts, saved_tokens
from polyshard.errors import PolyshardError

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
SCANNED = 1 << 22  # tokens checked against the vocabulary before launch, from each end of the file


def open_tokens(path: str, dtype: str = "uint16") -> np.memmap | ChunkedTokens:
    """The file's tokens, mapped (nothing read until a window is), or a saved dataset's input_ids; refuses
    what cannot be a token file."""
    if is_saved_dataset(path):
        return saved_tokens(path)
    p = Path(path)
    if not p.is_file():
        raise PolyshardError(f"--data {path!r} is not a file; give a token file (uint16 or uint32 ids, as "
                             "nanoGPT's prepare.py writes) or a folder `datasets` saved")
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


def tokenized(text_path: str, tokenizer_path: str, folder: str) -> tuple[str, str]:
    """A text file tokenized once into a token file in ``folder`` (named by a hash of both inputs, so a
    rerun finds it); returns (its path, its dtype)."""
    text, tokenizer = Path(text_path), _tokenizer_file(tokenizer_path)
    if not text.is_file() and not is_saved_dataset(text_path):
        raise PolyshardError(f"--data {text_path!r} is not a file; give a UTF-8 text file to tokenize, or a "
                             "folder `datasets` saved with a text column")
    stamp = tuple((p.stat().st_size, p.stat().st_mtime_ns) for p in (*_sources(text), tokenizer))
    return _tokenized(text.resolve(), tokenizer.resolve(), Path(folder), stamp)


@functools.lru_cache(maxsize=8)
def _tokenized(text: Path, tokenizer: Path, folder: Path, stamp: tuple) -> tuple[str, str]:
    """:func:`tokenized`, once per process for unchanged files (``stamp``: their sizes and times)."""
    digest = hashlib.sha256(tokenizer.read_bytes())
    for source in _sources(text):
        with open(source, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
    vocab = _load_tokenizer(tokenizer).get_vocab_size()
    dtype = "uint16" if vocab <= 1 << 16 else "uint32"
    out = folder / f"{text.stem}-{digest.hexdigest()[:16]}.{dtype}.bin"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        content = "\n".join(saved_texts(str(text))) if text.is_dir() else text.read_text(encoding="utf-8")
        ids = _load_tokenizer(tokenizer).encode(content).ids
        tmp = out.with_suffix(".tmp")
        np.asarray(ids, dtype=DTYPES[dtype]).tofile(tmp)
        os.replace(tmp, out)  # whole or absent: another process may be reading the folder
    return str(out), dtype


def _sources(text: Path) -> list[Path]:
    """The files a text's tokens come from: the text file, or a saved dataset's Arrow files."""
    return sorted(text.glob("*.arrow")) if text.is_dir() else [text]


def _tokenizer_file(path: str) -> Path:
    p = Path(path)
    p = p / "tokenizer.json" if p.is_dir() else p
    if not p.is_file():
        raise PolyshardError(f"--tokenizer {path!r} is neither a tokenizer.json nor a folder holding one")
    return p


def _load_tokenizer(path: Path):
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise PolyshardError("--tokenizer needs the tokenizers package: pip install 'polyshard[hf]'") from exc
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - the library raises its own exception type for a bad file
        raise PolyshardError(f"--tokenizer {str(path)!r} cannot be read: {exc}") from exc
