"""The models and data `polyshard ps` trains by name: the click models on synthetic clicks, GPTs on the corpus."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from polyshard import models
from polyshard.data.corpus import load_corpus
from polyshard.errors import PolyshardError
from polyshard.models.recsys import ClickModel, RecsysConfig, click_batch

RECSYS = {
    "recsys-tiny": RecsysConfig(rows=1000, dim=8, fields=4, hidden=16),
    "recsys-small": RecsysConfig(),
}


def check_name(name: str) -> None:
    if name not in RECSYS and name not in models.CONFIGS and not name.startswith("gpt:"):
        raise PolyshardError(f"--model {name!r} is unknown for a parameter-server run; use one of "
                             f"{', '.join([*RECSYS, *models.CONFIGS])} or a gpt:... shape")


@dataclass(frozen=True)
class NamedModel:
    """Builds the named model (picklable, so spawned roles can build it too)."""

    name: str

    def __call__(self) -> nn.Module:
        if self.name in RECSYS:
            return ClickModel(RECSYS[self.name])
        return models.GPT(models.config(self.name))


@dataclass(frozen=True)
class NamedBatches:
    """Worker ``worker``'s rows of global batch ``step``: synthetic clicks, or corpus windows for a GPT."""

    name: str
    batch_size: int
    seed: int

    def __call__(self, step: int, worker: int, workers: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self._global(step)
        lo, hi = worker * self.batch_size // workers, (worker + 1) * self.batch_size // workers
        return tuple(t[lo:hi] for t in batch)

    def _global(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.name in RECSYS:
            return click_batch(RECSYS[self.name], step, self.batch_size, self.seed)
        seq = models.config(self.name).seq_len
        tokens = load_corpus()
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        windows = tokens[torch.randint(len(tokens) - seq, (self.batch_size, 1), generator=g) + torch.arange(seq + 1)]
        return windows[:, :-1], windows[:, 1:]
