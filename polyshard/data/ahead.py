"""Batches drawn one step ahead in a background thread, so reading the data does not stall the step."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch


class Ahead:
    """Wraps batches that have ``position()`` / ``seek()``; its position is the one before the batch it has
    drawn but not yet handed out, so a checkpoint resumes with that batch."""

    def __init__(self, batches) -> None:
        self.batches = batches
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="polyshard-data")
        self._draw()

    def _draw(self) -> None:
        self._before = self.batches.position()
        self._next = self._pool.submit(next, self.batches)

    def __iter__(self) -> Ahead:
        return self

    def __next__(self):
        batch = self._next.result()
        self._draw()
        return batch

    def position(self) -> torch.Tensor:
        return self._before

    def seek(self, position: torch.Tensor) -> None:
        self._next.result()
        self.batches.seek(position)
        self._draw()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
