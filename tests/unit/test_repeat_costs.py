"""A stack of layers is costed as two: a layer's node that runs as its twin does reuses the twin's costs,
and every op's cost is what costing it on its own gives, however the plan lays out each layer."""

import pytest

import polyshard as ps
from polyshard.cluster import Cluster
from polyshard.graph.capture import capture
from polyshard.graph.regions import recomputed
from polyshard.graph.twins import twins
from polyshard.planner import intra_op
from polyshard.planner.cost import overlap
from polyshard.planner.propagate import propagate
from polyshard.planner.search import search

pytest.importorskip("transformers", reason="the [hf] extra (part of [dev]) is not installed")

from polyshard.models import hf  # noqa: E402

CLUSTER = Cluster.load("1x8xA100-80G")


def _llama():
    return hf.build("llama", num_hidden_layers=5)


def _each_on_its_own(monkeypatch, gm, plan):
    with monkeypatch.context() as m:
        m.setattr(overlap, "costed_as", lambda *_: {})
        return overlap.op_costs(gm, plan, CLUSTER, "bfloat16", 2)


def test_searched_plan_costs_layers_two_to_four_as_layer_one(monkeypatch):
    model = _llama()
    gm = capture(model, hf.batch(model, 1, 8))
    plan, _ = search(model, hf.batch(model, 1, 8), CLUSTER, 8, meshes=[(("dp", 2), ("tp", 4))])
    reused = overlap.costed_as(gm, plan)
    assert len(reused) == len(twins(gm))  # every node of layers 2-4
    assert overlap.op_costs(gm, plan, CLUSTER, "bfloat16", 2) == _each_on_its_own(monkeypatch, gm, plan)


def test_a_layer_laid_out_otherwise_is_costed_on_its_own(monkeypatch):
    model = _llama()
    ps.shard(model.model.layers[3].mlp.down_proj, in_strategy=((1, 1, 1), (1, 1)))  # replicated here only
    gm = capture(model, hf.batch(model, 2, 8))
    plan = propagate(gm, (("tp", 2),), lambda _: None)
    reused = overlap.costed_as(gm, plan)
    pinned = next(n.name for n in gm.graph.nodes if n.op == "call_module" and n.target.endswith("3.mlp.down_proj"))
    fourth = next(n.name for n in gm.graph.nodes if n.op == "call_module" and n.target.endswith("4.mlp.down_proj"))
    assert pinned not in reused and fourth in reused
    costs = overlap.op_costs(gm, plan, CLUSTER, "bfloat16", 2)
    assert costs == _each_on_its_own(monkeypatch, gm, plan)



def test_a_module_recomputed_in_one_layer_only_is_costed_on_its_own(monkeypatch):
    """The integer program's terms with twins reusing costs are those of costing every node alone."""
    found = []
    for alone in (False, True):
        model = _llama()
        ps.recompute(model.model.layers[3].mlp.down_proj)
        gm = capture(model, hf.batch(model, 1, 8))
        rc = recomputed(gm, "none")
        with monkeypatch.context() as m:
            if alone:
                m.setattr(intra_op, "twins", lambda _: {})
            found.append(intra_op.program_terms(gm, (("tp", 2),), CLUSTER, rc, "none", "bf16"))
    assert len(found[0].var_of) == len(found[1].var_of) and rc.rerun
    for mine, alone in zip(found[0].cost + found[0].mem, found[1].cost + found[1].mem):
        assert mine == pytest.approx(alone, rel=1e-12)
