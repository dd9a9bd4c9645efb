"""A recommendation-style click model with one wide embedding table, and synthetic clicks to train it on.

Each example names a few ids of a large vocabulary (users, items, context); the model sums their
embeddings and an MLP predicts the click. A batch touches a few hundred of the table's rows, which is
where a parameter server that pulls only touched rows beats all-reducing the whole table's gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class RecsysConfig:
    rows: int = 100_000
    dim: int = 32
    fields: int = 8
    hidden: int = 64


class ClickModel(nn.Module):
    """``forward(ids, clicks)``: ids (batch, fields) -> mean binary cross-entropy against clicks (batch,)."""

    def __init__(self, cfg: RecsysConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.table = nn.Embedding(cfg.rows, cfg.dim)
        nn.init.normal_(self.table.weight, std=0.05)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, cfg.hidden), nn.ReLU(), nn.Linear(cfg.hidden, 1))

    def forward(self, ids: torch.Tensor, clicks: torch.Tensor) -> torch.Tensor:
        logits = self.mlp(self.table(ids).sum(1)).squeeze(-1)
        return F.binary_cross_entropy_with_logits(logits, clicks)


def click_batch(cfg: RecsysConfig, step: int, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch ``step``: ids drawn with a heavy head (as real ids are), clicks from a fixed hidden score
    per id, so the model has something to learn; the same for every process given the same arguments."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    ids = (torch.rand(batch_size, cfg.fields, generator=g) ** 3 * cfg.rows).long()
    hidden = torch.Generator().manual_seed(seed)
    score = torch.randn(cfg.rows, generator=hidden)
    clicks = (score[ids].sum(1) > 0).to(torch.get_default_dtype())
    return ids, clicks
