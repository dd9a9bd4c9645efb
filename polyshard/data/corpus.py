"""A byte-level text corpus every Python install ships: the pydoc topic help texts."""

from __future__ import annotations

import functools

import torch
from pydoc_data.topics import topics

from polyshard.errors import PolyshardError

VOCAB_SIZE = 256  # one token per byte


@functools.cache
def load_corpus() -> torch.Tensor:
    """All corpus bytes as a 1-D long tensor; cached per process, so do not modify it."""
    text = "\n".join(topics[key] for key in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


class TokenBatches:
    """Endless (inputs, targets) batches of random corpus windows, the same on every process for one seed.

    Every data-parallel rank draws the same global batch and keeps its own rows.
    """

    def __init__(self, tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int) -> None:
        if tokens.dim() != 1:
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
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self._generator = torch.Generator().manual_seed(seed)
        self._offsets = torch.arange(seq_len + 1)

    def position(self) -> torch.Tensor:
        """Where the sampling stands (its generator's state), to save and resume from."""
        return self._generator.get_state()

    def seek(self, position: torch.Tensor) -> None:
        """Continue from a saved :meth:`position`."""
        self._generator.set_state(position)

    def __iter__(self) -> TokenBatches:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(
            len(self.tokens) - self.seq_len, (self.batch_size, 1), generator=self._generator
        )
        windows = self.tokens[starts + self._offsets]
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
