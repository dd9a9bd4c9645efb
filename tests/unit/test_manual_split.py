"""manual_split: an embedding table's rows split unevenly. Bad splits are refused naming the module, the plan
keeps the split (and its JSON), lowering is checked against it, and the memory model counts the tallest piece."""

import pytest
import torch
from torch import nn

import polyshard as ps
from polyshard.planner.check import check_plan
from polyshard.errors import PolyshardError
from polyshard.graph.capture import capture
from polyshard.models.recsys import ClickModel, RecsysConfig, click_batch
from polyshard.planner.cost.comm import node_comm_bytes
from polyshard.planner.cost.memory import estimate_memory
from polyshard.plan import Plan
from polyshard.planner.propagate import propagate
from tests.unit.embedding_cases import ShiftedEmbedding

TP4 = (("tp", 4),)


def _click(rows=None, pieces=4, columns=1):
    model = ClickModel(RecsysConfig(rows=64, dim=8, fields=4, hidden=16))
    ps.shard(model.table, in_strategy=((1, 1), (pieces, columns)), manual_split=rows)
    return model, capture(model, click_batch(model.cfg, 0, 2, seed=0))


def _plan(gm):
    return propagate(gm, TP4, lambda _: None)


def test_the_plan_keeps_the_split_and_its_json_does_too():
    model, gm = _click((10, 20, 30, 4))
    plan = _plan(gm)
    assert plan.row_splits == {"table.weight": (10, 20, 30, 4)} and plan.nodes["table"].impl == "rows"
    assert "table.weight  tp=4:S(0)  rows 10/20/30/4" in plan.summary()
    again = Plan.from_json(plan.to_json())
    assert again.row_splits == plan.row_splits
    check_plan(again, gm, TP4)


def test_a_hand_edited_split_that_does_not_add_up_is_refused():
    _, gm = _click((10, 20, 30, 4))
    bad = Plan.from_json(_plan(gm).to_json().replace('"table.weight": [\n   10', '"table.weight": [\n   11'))
    with pytest.raises(PolyshardError, match="splits parameter `table.weight`'s 64 rows as \\(11, 20, 30, 4\\)"):
        check_plan(bad, gm, TP4)


@pytest.mark.parametrize("rows,pieces,columns,message", [
    ((10, 20, 34), 4, 1, "gives 3 pieces, but the strategy splits the table's rows into 4"),
    ((10, 20, 30, 5), 4, 1, "adds up to 65 rows; the table has 64"),
    ((32, 32), 2, 2, "splits the table's rows only"),
])
def test_a_split_that_does_not_fit_the_table_names_the_module(rows, pieces, columns, message):
    _, gm = _click(rows, pieces, columns)
    with pytest.raises(PolyshardError, match=f"`table`: manual_split.*{message}"):
        _plan(gm)


def test_manual_split_is_for_embedding_tables():
    with pytest.raises(PolyshardError, match="Linear is not an nn.Embedding"):
        ps.shard(nn.Linear(4, 4), in_strategy=((1, 2), (1, 2)), manual_split=(2, 2))
    with pytest.raises(PolyshardError, match="two or more positive integers"):
        ps.shard(nn.Embedding(8, 2), in_strategy=((1,), (2, 1)), manual_split=(8, 0))


def test_a_tied_table_cannot_be_split_unevenly():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(64, 8)
            self.head = nn.Linear(8, 64, bias=False)
            self.head.weight = self.wte.weight

        def forward(self, ids):
            return self.head(self.wte(ids)).sum()

    model = Tied()
    ps.shard(model.wte, in_strategy=((1, 1), (2, 1)), manual_split=(40, 24))
    with pytest.raises(PolyshardError, match="`wte`: manual_split splits a table that `head` shares"):
        propagate(capture(model, (torch.zeros(2, 3, dtype=torch.long),)), (("tp", 2),), lambda _: None)


def test_a_table_whose_own_forward_capture_did_not_check_cannot_be_split_unevenly():
    """Each piece runs the module's own forward on its rows: right for a lookup that only scales (checked as a
    transformers model is captured), wrong for one that reads a row by its place, as this one does."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = ShiftedEmbedding(64, 8)

        def forward(self, ids):
            return self.wte(ids).sum()

    model = Model()
    ps.shard(model.wte, in_strategy=((1, 1), (2, 1)), manual_split=(40, 24))
    with pytest.raises(PolyshardError, match="`wte`: manual_split runs each piece through ShiftedEmbedding's own"):
        propagate(capture(model, (torch.zeros(2, 3, dtype=torch.long),)), (("tp", 2),), lambda _: None)


def test_memory_counts_the_tallest_piece_and_traffic_the_one_all_reduce():
    _, uneven = _click((10, 20, 30, 4))
    _, even = _click(None)
    plans = _plan(uneven), _plan(even)
    params = [estimate_memory(g, p).params_bytes for g, p in zip((uneven, even), plans)]
    assert params[0] - params[1] == (30 - 16) * 8 * 4  # the 30-row piece against 16 rows, fp32
    sent = [node_comm_bytes(next(n for n in g.graph.nodes if n.name == "table"), p, dict(g.named_modules()), 4,
                            "gloo") for g, p in zip((uneven, even), plans)]
    assert sent[0] == sent[1] and sum(c.get("tp", 0) for c in sent[0]) > 0
