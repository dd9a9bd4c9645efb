"""Pipeline stages whose tp ranks split the batch rows instead of operators: their layouts, their costs, and the
search's choice of them per stage."""

import dataclasses
import itertools

import numpy as np
import pytest
import torch

from polyshard import models
from polyshard.cluster import Cluster
from polyshard.errors import PolyshardError
from polyshard.graph.capture import at_rows, capture
from polyshard.layout import Layout
from polyshard.plan import Plan
from polyshard.planner.config import Fixed
from polyshard.planner.pipeline import cost_pipeline
from polyshard.planner.search import default_reserve_bytes, search
from polyshard.planner.stage_rows import batch_values, rows_layouts, shared_parameters
from tests.unit.test_search_pipeline import MiB, _setup, _units

TP = (("tp", 2),)


def _gpt(tied: bool):
    config = dataclasses.replace(models.config("gpt:layers=2,hidden=32,heads=4,seq=16,vocab=64"), tied=tied)
    return models.GPT(config)


def _rows(model, op_axes=TP, shared=None):
    gm, wider = capture(model, model.example_inputs(1)), capture(model, model.example_inputs(2))
    return rows_layouts(wider, batch_values(gm, wider), op_axes, shared or {})


def test_a_stage_splitting_rows_splits_what_holds_the_batch_and_keeps_weights_whole():
    plan = _rows(_gpt(tied=False))
    assert plan.nodes["blocks_0_mlp_fc"].inputs["blocks_0_ln2"].describe() == "tp=2:S(0)"
    assert plan.nodes["blocks_0_mlp_fc"].impl == "dtensor"  # DTensor sums the whole weight's gradients over tp
    assert all(layout.is_replicated for layout in plan.params.values())
    assert plan.nodes["wte"].output.describe() == "tp=2:S(0)"  # the lookup of half of the rows on each rank
    # the positions' table has no batch dim: it stays whole, and so does the sum it is broadcast into (a trainable
    # value broadcast over a split dim would get a gradient from half of the rows on each rank)
    assert plan.nodes["wpe"].output.is_replicated and plan.nodes["add"].output.is_replicated


def test_a_table_tied_to_a_head_keeps_the_layout_the_operator_plan_gives_it():
    model = _gpt(tied=True)
    gm = capture(model, model.example_inputs(2))
    assert shared_parameters(gm) == ("wte.weight",)
    vocab = Layout(TP, (("tp",), ()))
    plan = _rows(model, shared={"wte.weight": vocab})
    assert plan.params["wte.weight"] == vocab and plan.nodes["wte"].params["weight"] == vocab
    assert plan.params["blocks.0.mlp.fc.weight"].is_replicated


def test_captures_of_other_graphs_give_no_batch_values():
    model = _gpt(tied=False)
    other = models.build("gpt:layers=3,hidden=32,heads=4,seq=16,vocab=64", "meta")
    assert batch_values(capture(model, model.example_inputs(1)), capture(other, other.example_inputs(2))) is None


def test_each_stage_splits_rows_only_where_it_is_faster_and_fits():
    """Units whose rows plan is sometimes faster (no activation collectives) and always holds more (whole weights):
    the cuts and each chunk's split minimise the slowest stage over every cut and choice that fits (brute force),
    each chunk in the faster split that fits; a split fixed per chunk is kept."""
    mixed = 0
    for seed in range(6):
        mixed += _splits_match_brute_force(np.random.default_rng(seed))
    assert mixed, "no limit mixed the splits: the test checks nothing new"


def _splits_match_brute_force(rng) -> int:
    """One random pipeline against brute force at limits from tight to loose; how many limits mixed the splits."""
    n, pp, m, ways = int(rng.integers(3, 7)), int(rng.integers(2, 4)), 4, 2
    seconds, faster, acts, numels = rng.uniform(1, 3, n), rng.uniform(0.5, 1.5, n), rng.uniform(2, 8, n), \
        rng.integers(1, 4, n)
    ops = _units(list(seconds), list(acts), [int(k) * 2**16 for k in numels])
    rows = dataclasses.replace(_units(list(seconds * faster), list(acts), [int(k) * ways * 2**16 for k in numels]),
                               split_rows=ways)

    def stage(s, i, j, limit):  # (seconds, split) of stage s holding units i..j-1: its fastest split that fits
        held = 2 * min(m, pp - s)  # rows of the micro-batches in flight
        options = [(2 * seconds[i:j].sum(), "ops", numels[i:j].sum()),
                   (2 * (seconds * faster)[i:j].sum(), "rows", ways * numels[i:j].sum())]
        fits = [(t, split) for t, split, state in options if state + acts[i:j].sum() * held <= limit]
        return min(fits, default=(np.inf, None), key=lambda o: o[0])

    mixed = 0
    for limit in np.linspace(4, 60, 29):
        found = cost_pipeline((ops, rows), _setup(pp, 2 * m, limit * MiB), m, "1f1b", 1)  # 2 rows per micro-batch
        best = min(max(stage(s, i, j, limit)[0] for s, (i, j) in enumerate(zip((0, *cuts), (*cuts, n))))
                   for cuts in itertools.combinations(range(1, n), pp - 1))
        if not np.isfinite(best):
            assert found is None, limit
            continue
        assert max(s.forward_s + s.backward_s for s in found.stages) == pytest.approx(best), limit
        cuts = [int(b[1:]) for b in found.boundaries]
        parts = list(zip((0, *cuts), (*cuts, n)))
        assert all(s.memory.total_bytes <= limit * MiB * (1 + 1e-12) for s in found.stages)
        assert found.tp_split == tuple(stage(s, i, j, limit)[1] for s, (i, j) in enumerate(parts)), limit
        mixed += len(set(found.tp_split)) > 1
        fixed = cost_pipeline((ops, rows), dataclasses.replace(_setup(pp, 2 * m, limit * MiB),
                                                               fixed=Fixed(pp=pp, tp_split="/".join(["ops"] * pp))),
                              m, "1f1b", 1)
        assert fixed is None or fixed.tp_split == ("ops",) * pp
    # one row per micro-batch does not divide over two ranks: no chunk may split rows
    odd = cost_pipeline((ops, rows), _setup(pp, m), m, "1f1b", 1)
    assert odd is None or "rows" not in odd.tp_split
    return mixed


def test_the_search_splits_rows_in_the_stages_where_it_pays():
    """A 24-block GPT on pp=2 x tp=4 A100s, from loose to tight memory: the free pick is no slower than the pick
    with every chunk's split fixed either way, its stages split rows where memory allows (whole weights: no
    activation all-reduces, one gradient all-reduce per micro-batch), and mixes the two under some limits."""
    model = models.build("gpt:layers=24,hidden=2048,heads=16,seq=1024,vocab=50304", "meta")
    cluster, mesh = Cluster.preset("8xA100-80G"), (("pp", 2), ("tp", 4))
    reserve = default_reserve_bytes(cluster)

    def pick(limit_gib, split=None):
        try:
            plan, ranked = search(model, model.example_inputs(1), cluster, 64, limit_gib * 2**30, meshes=[mesh],
                                  fixed=Fixed(tp_split=split))
        except PolyshardError:
            return None, float("inf")
        best = min((c for c in ranked if not c.pruned and c.memory.total_bytes <= limit_gib * 2**30 - reserve),
                   key=lambda c: c.step_s)
        assert best.stage_tp_split == plan.stage_tp_split
        return plan, best.step_s

    splits = set()
    for limit_gib in (80, 40, 32, 25, 20):
        plan, step_s = pick(limit_gib)
        assert step_s <= min(pick(limit_gib, "ops")[1], pick(limit_gib, "rows")[1]) * (1 + 1e-9), limit_gib
        splits.add(frozenset(plan.stage_tp_split or ("ops",)))
        assert Plan.from_json(plan.to_json()).stage_tp_split == plan.stage_tp_split
    assert frozenset({"rows"}) in splits and frozenset({"ops", "rows"}) in splits and frozenset({"ops"}) in splits
    loose, loose_s = pick(80)
    assert "rows" in loose.stage_tp_split and loose_s < pick(80, "ops")[1]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_an_exported_graph_at_more_rows_is_what_exporting_them_records(family):
    """Export keeps the batch symbolic, so a search needing the model at more rows records the shapes again
    instead of exporting twice; the batch values and the rows layout follow."""
    hf = pytest.importorskip("polyshard.models.hf", reason="the [hf] extra (part of [dev]) is not installed")
    model = hf.build(family)
    row = hf.batch(model, 1, 8)
    gm = capture(model, row)
    again, exported = at_rows(model, gm, row, 4), capture(model, hf.batch(model, 4, 8))
    assert [(n.name, n.target) for n in again.graph.nodes] == [(n.name, n.target) for n in exported.graph.nodes]
    assert [n.meta.get("tensor_meta") for n in again.graph.nodes] == \
        [n.meta.get("tensor_meta") for n in exported.graph.nodes]
    batch = batch_values(gm, again)
    assert batch and batch == batch_values(gm, exported)
    plan = rows_layouts(again, batch, (("tp", 4),), {})
    projections = [n for n in again.graph.nodes if n.op == "call_module" and n.target.endswith(("q_proj", "c_attn"))]
    assert projections and all(plan.nodes[n.name].output.dims[0] == ("tp",) for n in projections)


@pytest.mark.parametrize("tied", [False, True])
def test_a_traced_graph_at_more_rows_is_what_tracing_them_records(tied):
    """A symbolic trace never sees the inputs: the graph at more rows is the one-row graph, its shapes propagated
    again, as tracing the model again at those rows records them; the one-row capture keeps its own shapes."""
    model = _gpt(tied)
    row = model.example_inputs(1)
    gm = capture(model, row)
    before = [n.meta.get("tensor_meta") for n in gm.graph.nodes]
    again, traced = at_rows(model, gm, row, 4), capture(model, model.example_inputs(4))
    assert [(n.name, n.target) for n in again.graph.nodes] == [(n.name, n.target) for n in traced.graph.nodes]
    assert [n.meta.get("tensor_meta") for n in again.graph.nodes] == \
        [n.meta.get("tensor_meta") for n in traced.graph.nodes]
    assert [n.meta.get("tensor_meta") for n in gm.graph.nodes] == before != \
        [n.meta.get("tensor_meta") for n in again.graph.nodes]
    assert torch.equal(again(*model.example_inputs(4)), model(*model.example_inputs(4)))


def test_one_capture_serves_every_split_of_rows_as_its_own_would(monkeypatch):
    """Pipelines on 8 and 16 operator ranks, whose stages may split rows, share one capture at 16 rows (the 8-rank
    one, costed first, would capture 8, then 16), and cost every candidate as a capture per rank count does."""
    import polyshard.planner.search as search_module

    model = models.build("gpt:layers=8,hidden=2048,heads=16,seq=1024,vocab=50304", "meta")
    meshes = [(("pp", 4), ("tp", 8)), (("pp", 2), ("tp", 16))]
    rows_asked = []

    def counted(model, gm, row, rows):
        rows_asked.append(rows)
        return at_rows(model, gm, row, rows)

    monkeypatch.setattr(search_module, "at_rows", counted)

    def costs():
        _, ranked = search(model, model.example_inputs(1), Cluster.preset("4x8xA100-80G"), 64, meshes=meshes,
                           workers=1)
        return sorted((c.describe(), c.stage_tp_split, c.step_s, c.memory.total_bytes) for c in ranked)

    shared = costs()
    assert rows_asked == [16]
    monkeypatch.setattr(search_module, "_rows_splits", lambda *args: 1)
    rows_asked.clear()
    assert costs() == shared and rows_asked == [8, 16]
    assert any("rows" in split for _, split, _, _ in shared)
