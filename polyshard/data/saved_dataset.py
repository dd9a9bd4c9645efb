"""A `datasets` dataset saved to disk (``Dataset.save_to_disk``) read as one stream of tokens: its ``input_ids``
rows end to end, straight from the memory-mapped Arrow files, so a window reads only its own pages. A dataset
of ``text`` rows is tokenized once by a local tokenizer instead (see polyshard.data.token_file)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from polyshard.errors import PolyshardError


def is_saved_dataset(path: str) -> bool:
    """Whether ``path`` is a folder ``save_to_disk`` wrote: a dataset's state.json, or a dict of splits'
    dataset_dict.json."""
    p = Path(path)
    return p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file())


def load_saved(path: str):
    """The dataset at ``path``, memory-mapped (nothing read yet)."""
    try:
        import datasets
    except ImportError as exc:
        raise PolyshardError(f"--data {path!r} is a datasets dataset; reading it needs the datasets package: "
                             "pip install 'polyshard[data]'") from exc
    try:
        found = datasets.load_from_disk(path)
    except Exception as exc:  # noqa: BLE001 - the library raises its own kinds for a folder it cannot read
        raise PolyshardError(f"--data {path!r} cannot be read as a saved dataset: {exc}") from exc
    if isinstance(found, datasets.DatasetDict):
        if "train" not in found:
            raise PolyshardError(f"--data {path!r} holds the splits {sorted(found)} and no 'train'; save one split")
        found = found["train"]
    return found


def saved_tokens(path: str) -> ChunkedTokens:
    """The ``input_ids`` rows of the dataset at ``path``, end to end, without copying them."""
    dataset = load_saved(path)
    if "input_ids" not in dataset.column_names:
        text = " (its text column: add --tokenizer)" if "text" in dataset.column_names else ""
        raise PolyshardError(f"--data {path!r} has the columns {dataset.column_names} and no input_ids{text}")
    chunks = [c.flatten().to_numpy(zero_copy_only=True) for c in dataset.data.table.column("input_ids").chunks]
    return ChunkedTokens([c for c in chunks if len(c)])


def saved_texts(path: str) -> list[str]:
    """The ``text`` rows of the dataset at ``path`` (to tokenize once)."""
    dataset = load_saved(path)
    if "text" not in dataset.column_names:
        raise PolyshardError(f"--data {path!r} has the columns {dataset.column_names} and no text to tokenize; a "
                             "dataset of input_ids needs no --tokenizer")
    return dataset["text"]


class ChunkedTokens:
    """Arrays of token ids end to end, indexed as one 1-D array (a window across two chunks is joined)."""

    ndim = 1

    def __init__(self, chunks: list[np.ndarray]) -> None:
        if not chunks:
            raise PolyshardError("the dataset holds no tokens")
        self.chunks = chunks
        self.starts = np.cumsum([0] + [len(c) for c in chunks])
        self.dtype = chunks[0].dtype

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: slice) -> np.ndarray:
        start, stop, step = index.indices(len(self))
        if step != 1:
            raise PolyshardError("token windows are read in order")
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        parts = []
        while start < stop:
            chunk, offset = self.chunks[first], start - int(self.starts[first])
            take = min(stop - start, len(chunk) - offset)
            parts.append(chunk[offset:offset + take])
            start, first = start + take, first + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else self.chunks[0][:0]
