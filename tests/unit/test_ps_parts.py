"""The parameter server's pieces in one process: placement, and sparse lookups against nn.Embedding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from polyshard.errors import PolyshardError
from polyshard.runtime.ps.placement import place
from polyshard.runtime.ps.spec import embedding_tables
from polyshard.runtime.ps.wire import to_wire
from polyshard.runtime.ps.worker import RemoteEmbedding


def test_tables_split_by_rows_and_dense_tensors_balanced():
    p = place({"a": 100, "b": 60, "c": 50, "d": 5}, {"emb.weight": 10}, servers=3)
    assert p.rows_of("emb.weight") == ((0, 3), (3, 6), (6, 10))
    assert dict(p.dense) == {"a": 0, "b": 1, "c": 2, "d": 2}
    with pytest.raises(PolyshardError, match="3 rows, fewer than the 4 servers"):
        place({}, {"t": 3}, servers=4)


def test_tied_and_padded_embeddings_stay_dense():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.plain, self.tied = nn.Embedding(8, 2), nn.Embedding(8, 2)
            self.padded = nn.Embedding(8, 2, padding_idx=0)
            self.head = nn.Linear(2, 8, bias=False)
            self.head.weight = self.tied.weight

    assert list(embedding_tables(M(), None)) == ["plain"]
    assert list(embedding_tables(M(), ("padded*",))) == []


class _FakeLinks:
    """Serves a table split at row 5 over two 'servers' and records which rows each lookup asked for."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight, self.asked = weight, []

    def call(self, server: int, message: tuple) -> tuple:
        _, request = message
        (name, rows), = request.items()
        self.asked.append((server, sorted(rows.tolist())))
        return "rows", 0, to_wire({name: self.weight[torch.from_numpy(rows) + 5 * server]})


def test_lookups_pull_and_push_only_touched_rows_and_match_nn_embedding():
    torch.manual_seed(0)
    ref = nn.Embedding(10, 3)
    links = _FakeLinks(ref.weight.detach())
    remote = RemoteEmbedding("e.weight", ref, ((0, 5), (5, 10)), links)
    index = torch.tensor([[1, 7, 1], [3, 7, 8]])
    out, expected = remote(index), ref(index)
    torch.testing.assert_close(out, expected)
    assert links.asked == [(0, [1, 3]), (1, [2, 3])]  # local row ids: 7, 8 are rows 2, 3 of server 1
    (out * torch.arange(3.0)).sum().backward()
    (expected * torch.arange(3.0)).sum().backward()
    for server, lo in ((0, 0), (1, 5)):
        rows, grads = remote.row_grads(server)
        torch.testing.assert_close(torch.from_numpy(grads), ref.weight.grad[torch.from_numpy(rows) + lo])
        assert set((torch.from_numpy(rows) + lo).tolist()) == {1, 3, 7, 8} & set(range(lo, lo + 5))


def test_a_table_not_looked_up_this_step_pushes_nothing():
    table = nn.Embedding(10, 3)
    assert RemoteEmbedding("e.weight", table, ((0, 5), (5, 10)), _FakeLinks(table.weight.detach())).row_grads(0) is None
