"""A click model with a wide embedding table, trained by 2 parameter servers and 2 workers on this machine.
Run: python examples/parameter_server.py"""

import functools

import torch
from torch import nn

import polyshard as ps


class Clicks(nn.Module):
    """Written as for one device: the table is split over the servers by rows, the MLP stays whole."""

    def __init__(self, rows: int = 50_000, dim: int = 16) -> None:
        super().__init__()
        self.table = nn.Embedding(rows, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, ids: torch.Tensor, clicks: torch.Tensor) -> torch.Tensor:
        logits = self.mlp(self.table(ids).sum(1)).squeeze(-1)
        return nn.functional.binary_cross_entropy_with_logits(logits, clicks)


def batch(step: int, worker: int, workers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This worker's half of global batch `step`: 6 ids per example, clicked when their hidden scores say so."""
    g = torch.Generator().manual_seed(step)
    ids = (torch.rand(128, 6, generator=g) ** 3 * 50_000).long()
    clicks = (torch.randn(50_000, generator=torch.Generator().manual_seed(0))[ids].sum(1) > 0).float()
    rows = slice(worker * 128 // workers, (worker + 1) * 128 // workers)
    return ids[rows], clicks[rows]


if __name__ == "__main__":
    result = ps.train_ps(Clicks, batch, servers=2, workers=2, steps=200, mode="sync",
                         optimizer=functools.partial(torch.optim.Adagrad, lr=0.5), log_every=50)
    print(f"loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}; table {tuple(result.params['table.weight'].shape)}")
