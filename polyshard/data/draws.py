"""Seeded draws of batches: the same on every rank, and resumable from where they stood."""

from __future__ import annotations

import torch


class SeededDraws:
    """An endless batch iterator whose draws come from one seeded generator (subclasses define ``__next__``)."""

    def __init__(self, seed: int) -> None:
        self._generator = torch.Generator().manual_seed(seed)

    def position(self) -> torch.Tensor:
        """Where the sampling stands (its generator's state), to save and resume from."""
        return self._generator.get_state()

    def seek(self, position: torch.Tensor) -> None:
        """Continue from a saved :meth:`position`."""
        self._generator.set_state(position)

    def __iter__(self) -> SeededDraws:
        return self
