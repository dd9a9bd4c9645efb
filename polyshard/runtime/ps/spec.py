"""What every role of a parameter-server run is given: the model, the data, the optimizer and the addresses."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from polyshard.runtime.ps.placement import Placement, place

MODES = ("sync", "async")


@dataclass(frozen=True)
class PSSpec:
    """model_fn builds the model (seeded with ``seed`` first, so every role builds the same); batch_fn(step,
    worker, workers) is that worker's slice of global batch ``step``, the arguments of ``model(...)``, which
    returns the loss; optimizer(tensors) builds the servers' optimizer; tables: patterns naming embedding
    modules to split by rows and pull sparsely (None: every plain, untied ``nn.Embedding``); steps: updates
    each server applies; staleness: in async mode, the most updates a gradient's parameters may lag the
    server's (None: any); snapshot_every: updates between each server's snapshots in snapshot_dir;
    join_grace: seconds a server waits for all workers before its first update; retry_seconds: how long a
    worker keeps reconnecting to a lost server; straggler_seconds: in sync mode, how long an update waits
    for a live worker once another's gradient is in, before it goes on without that worker (a hung one)."""

    model_fn: Callable[[], nn.Module]
    batch_fn: Callable[[int, int, int], tuple]
    optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
    servers: tuple[tuple[str, int], ...]
    workers: int
    steps: int
    key: bytes
    snapshot_dir: str
    mode: str = "sync"
    staleness: int | None = None
    snapshot_every: int = 10
    seed: int = 0
    tables: tuple[str, ...] | None = None
    log_every: int = 10
    join_grace: float = 60.0
    retry_seconds: float = 60.0
    straggler_seconds: float = 60.0

    def build(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return self.model_fn()


def embedding_tables(model: nn.Module, patterns: tuple[str, ...] | None) -> dict[str, nn.Embedding]:
    """The embeddings served as row-split tables: plain lookups (no padding row, max norm or sparse flag)
    whose weight no other module shares, named by module path, chosen by ``patterns`` when given."""
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    found = {}
    for name, m in model.named_modules():
        if type(m) is not nn.Embedding or uses[id(m.weight)] > 1:
            continue
        if m.padding_idx is not None or m.max_norm is not None or m.sparse:
            continue
        if patterns is None or any(fnmatch.fnmatchcase(name, p) for p in patterns):
            found[name] = m
    return found


def placement_of(model: nn.Module, spec: PSSpec) -> Placement:
    """The run's placement: the same in every role, as it depends only on the model and the server count."""
    tables = {f"{name}.weight": m.num_embeddings for name, m in embedding_tables(model, spec.tables).items()}
    dense = {n: p.numel() for n, p in model.named_parameters() if n not in tables}
    return place(dense, tables, len(spec.servers))
