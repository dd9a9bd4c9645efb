"""Embedding tables looked up on the host; only the rows move."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from polyshard.errors import PolyshardError
from polyshard.runtime.offload.ledger import HOST


class HostEmbedding(nn.Embedding):
    """An nn.Embedding whose table stays on the host: lookups run there and only the rows move to the
    device of the indices. Shares the Parameter of the embedding it comes from (optimizers keep working)."""

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding) -> HostEmbedding:
        e = embedding
        host = cls(e.num_embeddings, e.embedding_dim, e.padding_idx, e.max_norm, e.norm_type,
                   e.scale_grad_by_freq, e.sparse, _weight=e.weight.detach())
        host.weight = e.weight
        host.weight.data = host.weight.data.to(HOST)
        return host

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx.to(self.weight.device)).to(idx.device, copy=True)


def offload_embedding(module: nn.Module) -> list[str]:
    """Replaces each nn.Embedding inside ``module`` by a HostEmbedding; returns their names. Embeddings
    whose table another module shares (a tied LM head needs all of it on the device) stay, with a warning."""
    users: dict[int, int] = {}
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None:
                users[id(p)] = users.get(id(p), 0) + 1
    replaced, tied = [], []
    for parent_name, parent in list(module.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if type(child) is not nn.Embedding:
                continue
            if users[id(child.weight)] > 1:
                tied.append(full)
                continue
            setattr(parent, name, HostEmbedding.from_embedding(child))
            replaced.append(full)
    if not replaced:
        raise PolyshardError(f"no untied nn.Embedding in {type(module).__name__} to keep on the host"
                             + (f" ({', '.join(tied)} share their table)" if tied else ""))
    for name in tied:
        warnings.warn(f"{name}'s table is shared with another module (tied weights), which needs all of it on "
                      f"the device; {name} stays as it is", stacklevel=2)
    return replaced
