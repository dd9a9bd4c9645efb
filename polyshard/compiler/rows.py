"""Tables split unevenly by rows (MindSpore's manual_split): this rank's rows, its lookup, the table whole again."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from polyshard.compiler.redistribute import redistribute_local
from polyshard.layout import Layout
from polyshard.mesh import Mesh


def row_slice(rows: tuple[int, ...], index: int) -> slice:
    """Piece ``index``'s rows of a table split as ``rows``."""
    start = sum(rows[:index])
    return slice(start, start + rows[index])


class RowSplitEmbedding(nn.Module):
    """An embedding holding only this rank's rows of its table (``module.weight``, from ``offset``): it looks
    up the ids those rows hold, zeros for the others, and the lookups of every piece are summed into
    ``out`` (one all-reduce; its gradient reaches each piece's rows whole, no collective). A subclass's own
    forward (Gemma's, which scales what it finds) runs on this rank's rows, so the pieces sum to its result."""

    def __init__(self, module: nn.Embedding, offset: int, out: Layout, mesh: Mesh, axes: tuple[str, ...]):
        super().__init__()
        self.module, self.offset, self.out, self.mesh = module, offset, out, mesh
        self.pending = out.with_dims(out.dims, axes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        table = self.module.weight
        local = ids - self.offset
        mine = (local >= 0) & (local < table.shape[0])
        found = self._here()(torch.where(mine, local, 0)) * mine.unsqueeze(-1).to(table.dtype)
        return redistribute_local(found, self.pending, self.out, self.pending.global_shape(found.shape), self.mesh)

    def _here(self) -> nn.Embedding:
        """The module as this rank's piece: its rows, its padding row among them at its place there (or none)."""
        rows, pad = self.module.weight.shape[0], self.module.padding_idx
        here = copy.copy(self.module)  # the same parameters and buffers; only the padding row is its own
        here.padding_idx = pad - self.offset if pad is not None and 0 <= pad - self.offset < rows else None
        return here


def gather_rows(piece: torch.Tensor, rows: tuple[int, ...], group) -> torch.Tensor:
    """The whole table from every rank's ``piece`` (ranks of ``group`` in piece order)."""
    padded = piece.new_zeros((max(rows), *piece.shape[1:]))
    padded[:piece.shape[0]] = piece
    pieces = [torch.empty_like(padded) for _ in rows]
    dist.all_gather(pieces, padded.contiguous(), group=group)
    return torch.cat([p[:r] for p, r in zip(pieces, rows)])
