"""A byte-level text corpus every Python install ships: the pydoc topic help texts."""

from __future__ import annotations

import functools

import numpy as np
import torch
from pydoc_data.topics import topics

from polyshard.data.draws import SeededDraws
from polyshard.errors import PolyshardError

VOCAB_SIZE = 256  # one token per byte


@functools.cache
def load_corpus() -> torch.Tensor:
    """All corpus bytes as a 1-D long tensor; cached per process, so do not modify it."""
    text = "\n".join(topics[key] for key in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


class TokenBatches(SeededDraws):
    """Endless (inputs, targets) batches of random windows of ``tokens`` (a 1-D tensor, or a numpy array
    such as a memmap of a token file), the same windows on every process for one seed.

    Every data-parallel rank draws the same global batch's window starts and reads only its own ``rows``
    of it (default: all), so a rank touches only its windows of a file on disk. ``read=False`` (a middle
    pipeline stage, which takes neither inputs nor labels) reads nothing: its batches are zeros of the
    same shape, drawn in step with the others.
    """

    def __init__(self, tokens: torch.Tensor | np.ndarray, batch_size: int, seq_len: int, seed: int,
                 rows: slice = slice(None), read: bool = True) -> None:
        if tokens.ndim != 1:
            raise PolyshardError(f"tokens have shape {tuple(tokens.shape)}; pass a 1-D tensor")
        if batch_size < 1 or seq_len < 1:
            raise PolyshardError(
                f"batch_size={batch_size}, seq_len={seq_len}: both must be at least 1"
            )
        if seq_len >= len(tokens):
            raise PolyshardError(
                f"seq_len={seq_len} needs more than the corpus's {len(tokens)} tokens; "
                f"use a seq_len below {len(tokens)}"
            )
        self.tokens, self.rows, self.read = tokens, rows, read
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        super().__init__(seed)
        self._offsets = torch.arange(seq_len + 1)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(
            len(self.tokens) - self.seq_len, (self.batch_size, 1), generator=self._generator
        )[self.rows]
        if not self.read:
            windows = torch.zeros(len(starts), self.seq_len + 1, dtype=torch.long)
        elif isinstance(self.tokens, torch.Tensor):
            windows = self.tokens[starts + self._offsets]
        else:  # one read per window, of just its tokens
            windows = torch.from_numpy(np.stack([self.tokens[s:s + self.seq_len + 1] for s in starts[:, 0].tolist()])
                                       .astype(np.int64))
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
