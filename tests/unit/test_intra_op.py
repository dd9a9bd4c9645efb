"""The intra-op integer program: exhaustive optimum on small graphs, pins, tied blocks, memory."""

import itertools

import pytest
import torch

import polyshard as ps
from polyshard import models
from polyshard.cluster import Cluster
from polyshard.errors import PolyshardError
from polyshard.graph.capture import capture
from polyshard.planner.candidates import candidates
from polyshard.graph.regions import recomputed
from polyshard.planner.intra_op import build_program, evaluate, forward_floor, solve

CLUSTERS = ["cpu-gloo:2", "2xA100-80G"]


def _mlp():
    return models.MLPClassifier(in_features=64, hidden=256, num_classes=16)


@pytest.mark.parametrize("cluster", CLUSTERS)
@pytest.mark.parametrize("rows", [1, 64])
def test_program_optimum_equals_exhaustive_enumeration(cluster, rows):
    model = _mlp()
    gm = capture(model, (torch.zeros(1, 64), torch.zeros(1, dtype=torch.long)))
    cl, axes = Cluster.preset(cluster), (("tp", 2),)
    program = build_program(gm, axes, cl, rows)
    names = sorted({program.rep[n] for n in program.options})
    best = min(evaluate(program, dict(zip(names, picks)))[0]
               for picks in itertools.product(*(range(len(program.options[n])) for n in names))
               if _allowed(program, dict(zip(names, picks))))
    result = solve(gm, axes, cl, rows, 2**40)
    assert result.cost_s == pytest.approx(best, rel=1e-9)
    assert result.lower_bound_s <= result.cost_s * (1 + 1e-9)


def _allowed(program, picks):
    return all(not (picks[a] == i and picks[b] == j) for (a, i), (b, j) in program.conflicts)


def test_memory_limit_trades_time_for_memory():
    model = _mlp()
    gm = capture(model, (torch.zeros(1, 64), torch.zeros(1, dtype=torch.long)))
    cl, axes = Cluster.preset("2xA100-80G"), (("tp", 2),)
    program = build_program(gm, axes, cl, 1)
    names = sorted({program.rep[n] for n in program.options})
    leanest = min(evaluate(program, dict(zip(names, picks)))[1]
                  for picks in itertools.product(*(range(len(program.options[n])) for n in names)))
    free = solve(gm, axes, cl, 1, 2**40)
    assert free.memory_bytes > leanest  # unconstrained, the fastest choice is not the leanest
    limit = (free.memory_bytes + leanest) / 2
    tight = solve(gm, axes, cl, 1, limit)
    assert tight.memory_bytes <= limit and tight.cost_s >= free.cost_s
    with pytest.raises(PolyshardError, match="no strategy fits"):
        solve(gm, axes, cl, 1, leanest * 0.99)


def test_pins_are_kept():
    model = _mlp()
    ps.shard(model.fc2, in_strategy=((1, 2), (1, 2)))
    gm = capture(model, (torch.zeros(1, 64), torch.zeros(1, dtype=torch.long)))
    plan = solve(gm, (("tp", 2),), Cluster.preset("cpu-gloo:2"), 1, 2**40).plan
    assert plan.params["fc2.weight"].dims == ((), ("tp",))


def test_identical_blocks_share_variables_and_tied_weights_agree():
    small = models.build("gpt-small", "meta")  # 4 blocks
    gm = capture(small, small.example_inputs(1))
    program = build_program(gm, (("tp", 4),), Cluster.preset("4xA100-80G"), 8)
    gm_blocks = {n.name: _block(n) for n in gm.graph.nodes}
    later = [name for name, block in gm_blocks.items() if block in ("blocks.2", "blocks.3")]
    assert later and all(gm_blocks[program.rep[name]] not in ("blocks.2", "blocks.3") for name in later)
    # blocks 2 and 3 take block 1's variables (block 0 differs: its input arrives whole, not split by sequence)
    plan = solve(gm, (("tp", 4),), Cluster.preset("4xA100-80G"), 8, 2**40).plan
    for k in range(1, 4):
        assert plan.params[f"blocks.{k}.mlp.fc.weight"] == plan.params["blocks.0.mlp.fc.weight"]
    assert plan.nodes["wte"].params["weight"] == plan.nodes["lm_head"].params["weight"]


def _block(node) -> str:
    paths = [p for p, _ in (node.meta.get("nn_module_stack") or {}).values()]
    return next((p for p in paths if p.startswith("blocks.") and p.count(".") == 1), "")


def test_a_copied_layers_candidates_are_its_twins_on_its_own_inputs():
    """Layers 2 and later read their twins' candidates lazily; read whole, they are the twin's with every input
    renamed to the layer's own, as enumerating the layer would give."""
    model = models.build("gpt:layers=4,hidden=32,heads=2,vocab=64,seq=8", device="meta")
    gm = capture(model, model.example_inputs(1))
    options, copied = candidates(gm, (("tp", 2),))
    nodes = {n.name: n for n in gm.graph.nodes}
    assert len(copied) > 10
    for name, twin in copied.items():
        rename = {b.name: a.name for a, b in zip(nodes[name].all_input_nodes, nodes[twin].all_input_nodes)}
        mine, theirs = list(options[name]), options[twin]
        assert len(mine) == len(theirs) and options[name][-1] == mine[-1] and options[name][:2] == mine[:2]
        assert all(m.inputs == {rename[k]: v for k, v in t.inputs.items()} and
                   (m.impl, m.output, m.params) == (t.impl, t.output, t.params) for m, t in zip(mine, theirs))


def test_the_relaxation_of_a_real_width_layer_stack_is_its_optimum():
    """Each pair of neighbouring picks is tied to both picks (the local polytope), so the LP bound the search
    prunes with is the plan's own cost here; pair rows that only bound a pair from below left a gap of 0.2-3%."""
    model = models.build("gpt:layers=4,hidden=4096,heads=32,vocab=32000,seq=2048", device="meta")
    gm = capture(model, model.example_inputs(1))
    for tp in (2, 4, 8):
        result = solve(gm, (("tp", tp),), Cluster.preset("8xA100-80G"), 8, float("inf"), precision="bf16")
        assert result.lower_bound_s == pytest.approx(result.cost_s, rel=1e-9), tp


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_recompute_costs_at_least_the_plain_optimum_and_its_cheapest_reruns(cluster):
    """The search prunes a recompute mode before building its program with this bound."""
    model = models.build("gpt-small", "meta")
    gm = capture(model, model.example_inputs(1))
    cl, axes, rows = Cluster.preset(cluster), (("tp", 2),), 8
    plain = solve(gm, axes, cl, rows, float("inf"))
    full = solve(gm, axes, cl, rows, float("inf"), recompute="full")
    reruns = forward_floor(gm, axes, cl, "fp32", recomputed(gm, "full").rerun.__contains__)
    assert plain.cost_s < plain.lower_bound_s + rows * reruns <= full.cost_s * (1 + 1e-9)
