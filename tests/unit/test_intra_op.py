"""The intra-op integer program: exhaustive optimum on small graphs, pins, tied blocks, memory."""

import dataclasses
import itertools

import numpy as np
import pytest
import torch

import polyshard as ps
from polyshard import models
from polyshard.cluster import Cluster
from polyshard.errors import PolyshardError
from polyshard.graph.capture import capture, shape_of
from polyshard.planner.candidates import candidates
from polyshard.graph.regions import recomputed
from polyshard.plan import Plan
from polyshard.transitions import transition_bytes
from polyshard.planner.cost.overlap import op_costs
from polyshard.planner.cost.comm import comm_seconds
from polyshard.planner.intra_op import BOUND_MARGIN, build_program, evaluate, forward_floor, solve

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
        assert result.lower_bound_s == pytest.approx(result.cost_s * (1 - BOUND_MARGIN), rel=1e-9), tp


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


class _TwoReaders(torch.nn.Module):
    """One value read by two products, as a norm's output is by q, k and v, or by gate and up; here the value
    may come out split, so taking it whole costs an all-gather."""

    def __init__(self):
        super().__init__()
        self.inp, self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 256), torch.nn.Linear(64, 256)
        self.out = torch.nn.Linear(256, 16)

    def forward(self, x, y):
        h = self.inp(x)
        return torch.nn.functional.cross_entropy(self.out(self.a(h) * self.b(h)), y)


def _moved_once_seconds(gm, program, picked, axes, cluster) -> float:
    """The ops' own seconds, plus one redistribution per value and layout its consumers take it in (as lowering
    inserts them), however many consumers take it so, and its gradient's way back: reduced once where the
    products taking it whole split their outputs, then moved back (in one go where a product takes the moved
    DTensor)."""
    x = np.zeros(len(program.var_of))
    x[[program.var_of[(name, i)] for name, i in picked.items()]] = 1.0
    chosen = {n: program.options[n][picked[program.rep[n]]] for n in program.options}
    nodes = {n.name: n for n in gm.graph.nodes}
    takers: dict[tuple, list] = {}
    for n in gm.graph.nodes:
        for u in n.all_input_nodes:
            if chosen[n.name].inputs.get(u.name) is not None and n.op != "output":
                takers.setdefault((u.name, chosen[n.name].inputs[u.name]), []).append(chosen[n.name])
    seconds = float(program.node_cost @ x)
    for (u, dst), entries in takers.items():
        src, shape = chosen[u].output, shape_of(nodes[u])
        sent = [transition_bytes(src, dst, shape, 4)] if src != dst else []
        if nodes[u].meta["tensor_meta"].requires_grad:
            split = {a for e in entries if e.impl == "dtensor" for d in e.output.dims for a in d}
            back = dst.with_dims(dst.dims, [a for a in split if dst.dim_of(a) is None])
            if src != dst and any(e.impl == "dtensor" for e in entries):  # handed the moved DTensor
                sent += [transition_bytes(back, src.with_dims(src.dims), shape, 4)]
            else:
                sent += [transition_bytes(back, dst, shape, 4), transition_bytes(dst, src.with_dims(src.dims), shape, 4)]
        seconds += sum(sum(comm_seconds(c, axes, cluster)) for c in sent if any(c.values()))
    return seconds


def test_a_value_two_ops_take_alike_is_paid_once_in_the_program_as_lowering_moves_it():
    """The program's objective is, for every choice, its ops plus one move per value and layout, and its optimum
    is the least of those."""
    gm = capture(_TwoReaders(), (torch.zeros(1, 64), torch.zeros(1, dtype=torch.long)))
    cl, axes = Cluster.preset("2xA100-80G"), (("tp", 2),)
    program = build_program(gm, axes, cl, 1)
    names = sorted({program.rep[n] for n in program.options})
    seconds = []
    for picks in itertools.product(*(range(len(program.options[n])) for n in names)):
        picked = dict(zip(names, picks))
        seconds.append(_moved_once_seconds(gm, program, picked, axes, cl))
        assert evaluate(program, picked)[0] == pytest.approx(seconds[-1], rel=1e-12), picked
        plan = Plan(op_axes=axes, nodes={n: program.options[n][picked[program.rep[n]]] for n in program.options})
        predicted = sum(c.compute_s + c.comm_s + c.latency_s + c.overhead_s for c in op_costs(gm, plan, cl))
        # and the plan's predicted cost: within 1e-6, as the program also prices reading the batch (1e-11 s here)
        assert predicted == pytest.approx(seconds[-1], rel=1e-6), picked
    layouts = [{d.inputs.get("inp") for d in program.options[n]} - {None} for n in ("a", "b")]
    assert layouts[0] == layouts[1] and len(layouts[0]) > 1 and len(seconds) > 100  # both may take it whole or split
    assert solve(gm, axes, cl, 1, 2**40).cost_s == pytest.approx(min(seconds), rel=1e-9)


def test_llama_attention_and_mlp_are_split_as_transformers_own_tensor_parallel_plan():
    """Llama-3-8B's shape (grouped k and v heads): q, k and v read one norm output, which the search all-gathers
    once for the three, so it splits them by columns as the model's ``base_model_tp_plan`` does (priced once per
    reader, k and v came out split by rows: an all-to-all and a reduce-scatter more, 1.2% slower)."""
    hf = pytest.importorskip("polyshard.models.hf", reason="the [hf] extra (part of [dev]) is not installed")
    pytest.importorskip("transformers", reason="the [hf] extra (part of [dev]) is not installed")
    model = hf.CausalLM(hf.build("llama-3-8b", device="meta", num_hidden_layers=3), 1024)
    gm = capture(model, model.example_inputs(1))
    cl = Cluster.preset("1x8xA100-80G")
    result = solve(gm, (("tp", 4),), cl, 1, float("inf"), precision="bf16")
    assert result.cost_s == pytest.approx(
        sum(c.compute_s + c.comm_s + c.latency_s + c.overhead_s for c in op_costs(gm, result.plan, cl, "bfloat16", 2)),
        rel=1e-6)  # the solver's tolerance
    split = {"colwise": ("tp",), "rowwise": ()}  # dim 0 of an nn.Linear weight: its output features
    # the first layer's output projection adds into the embedding's feature-split output: split by columns after
    # an all-gather, it moves the bytes the reduce-scatter after a split by rows would, so either may win
    tied = "model.model.layers.0.self_attn.o_proj.weight"
    for pattern, style in model.model.config.base_model_tp_plan.items():
        for layer in range(3):
            name = f"model.model.{pattern.replace('*', str(layer))}.weight"
            assert result.plan.params[name].dims[0] == split[style] or name == tied, \
                (name, result.plan.params[name].describe())


def test_logits_a_model_returns_are_gathered_in_the_plans_cost_as_in_the_program():
    """A transformers model called with labels returns its logits too, which lowering moves to the output's layout
    (whole), once a step: the plan's predicted cost pays for it as the integer program does (it left it out)."""
    hf = pytest.importorskip("polyshard.models.hf", reason="the [hf] extra (part of [dev]) is not installed")
    pytest.importorskip("transformers", reason="the [hf] extra (part of [dev]) is not installed")
    model = hf.build("llama-3-8b", device="meta", num_hidden_layers=2)
    gm = capture(model, hf.batch(model, 1, 1024))
    cl = Cluster.preset("1x8xA100-80G")
    result = solve(gm, (("tp", 4),), cl, 1, float("inf"), precision="bf16")
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    logits = [u for u in output.all_input_nodes if result.plan.nodes[u.name].output != result.plan.nodes[
        output.name].inputs[u.name]]
    assert logits, "the logits come out split by the vocabulary and are returned whole"
    def predicted(plan):
        return sum(c.compute_s + c.comm_s + c.latency_s + c.overhead_s for c in op_costs(gm, plan, cl, "bfloat16", 2))

    assert result.cost_s == pytest.approx(predicted(result.plan), rel=1e-6)
    # paid once, in forward: no gradient flows back into the returned logits
    (head,), returned = logits, result.plan.nodes[output.name]
    src, dst = result.plan.nodes[head.name].output, returned.inputs[head.name]
    kept = dataclasses.replace(result.plan, nodes={**result.plan.nodes, output.name: dataclasses.replace(
        returned, inputs={**returned.inputs, head.name: src})})
    gather = comm_seconds(transition_bytes(src, dst, shape_of(head), 2, cl.backend, cl.all_to_all), (("tp", 4),), cl)
    assert predicted(result.plan) - predicted(kept) == pytest.approx(sum(gather), rel=1e-9)


def test_a_vocabulary_that_does_not_divide_splits_the_tied_table_by_features():
    """GPT-2's 50257 tokens do not divide by 8: the table splits its features instead and the tied head runs
    row-parallel on them, which costs less than both running whole on every rank (as they had to before)."""
    model = models.build("gpt:layers=2,hidden=1024,heads=16,seq=512,vocab=50257", "meta")
    cl, axes = Cluster.preset("8xA100-80G"), (("tp", 8),)
    free = solve(capture(model, model.example_inputs(1)), axes, cl, 8, 2**40)
    assert free.plan.params["wte.weight"].dims == ((), ("tp",))
    assert free.plan.nodes["lm_head"].params["weight"].dims == ((), ("tp",))  # contracting the split features
    ps.shard(model.wte, in_strategy=((1, 1), (1, 1)))  # the table whole: its tied head too
    whole = solve(capture(model, model.example_inputs(1)), axes, cl, 8, 2**40)
    assert whole.plan.params["wte.weight"].is_replicated and whole.cost_s > free.cost_s * 1.05


def test_a_collective_waits_the_call_skew_of_its_group():
    """Ranks time-sliced on shared cores reach each call apart: a pair of the node's ranks waits the pairs' call
    skew, the node's whole group the node's; what the call transfers is unchanged."""
    plain = Cluster.preset("cpu-gloo:4")
    skewed = dataclasses.replace(plain, call_skew_s=2e-3, node_call_skew_s=3e-3)

    def extra(axes, axis):
        return comm_seconds({axis: 1e5}, axes, skewed)[1] - comm_seconds({axis: 1e5}, axes, plain)[1]

    assert extra((("dp", 2), ("tp", 2)), "tp") == pytest.approx(2e-3)
    assert extra((("tp", 4),), "tp") == pytest.approx(3e-3)
    assert comm_seconds({"tp": 1e5}, (("tp", 2),), skewed)[0] == comm_seconds({"tp": 1e5}, (("tp", 2),), plain)[0]
