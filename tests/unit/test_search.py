"""Mesh search and the memory model on meta models, in one process."""

import dataclasses

import pytest

from polyshard import models
from polyshard.cluster import Cluster, parse_bytes
from polyshard.errors import PolyshardError
from polyshard.graph.capture import capture
from polyshard.planner.cost.memory import estimate_memory
from polyshard.plan import Plan
from polyshard.planner.propagate import propagate
from polyshard.planner.report import chosen_row, render
from polyshard.planner.config import Fixed
from polyshard.planner.search import search
from polyshard.transitions import common_axes, plan_transition


def _search(limit=None, batch=8):
    model = models.build("gpt-small", "meta")
    return search(model, model.example_inputs(1), Cluster.preset("cpu-gloo:4"), batch, limit)


def test_every_split_is_costed_and_the_fastest_fitting_one_wins():
    plan, candidates = _search()
    assert sorted({c.describe().split(",")[0] for c in candidates}) == [
        "dp=1 x tp=4", "dp=2 x tp=2", "dp=4 x tp=1",  # and pipelines of 2 or 4 of its 4 blocks
        "pp=2 x dp=1 x tp=2", "pp=2 x dp=2 x tp=1", "pp=4 x dp=1 x tp=1"]
    assert plan.report["chosen"] == candidates[0].describe()
    assert [c.step_s for c in candidates] == sorted(c.step_s for c in candidates)


def test_memory_limit_moves_the_choice_to_a_leaner_split():
    _, candidates = _search()
    by_mesh = {c.describe(): c.memory.total_bytes for c in candidates}
    limit = (by_mesh["dp=2 x tp=2"] + by_mesh["dp=4 x tp=1"]) / 2  # dp=4 no longer fits as it was
    plan, ranked = _search(limit)
    chosen = next(c for c in ranked if c.describe() == plan.report["chosen"])
    assert chosen.memory.total_bytes <= limit
    assert dict(plan.mesh)["tp"] > 1 or plan.recompute != "none" or plan.offload != "none" or plan.zero > 0


def test_gradient_accumulation_fits_without_recompute_or_a_pipeline():
    one = [(("dp", 1),)]
    model = models.build("gpt-small", "meta")
    cluster = Cluster.preset("cpu-gloo:1")
    _, ranked = search(model, model.example_inputs(1), cluster, 8, meshes=one)
    need = ranked[0].memory
    limit = need.total_bytes - 0.5 * need.activations_bytes
    plan, ranked = search(model, model.example_inputs(1), cluster, 8, limit, meshes=one, fixed=Fixed(recompute="none"))
    chosen = next(c for c in ranked if c.describe() == plan.report["chosen"])
    assert plan.recompute == "none" and plan.micro_batches == chosen.accumulation > 1
    assert chosen.memory.total_bytes <= limit < need.total_bytes
    assert chosen.compute_s < need.total_bytes  # a sanity line: seconds and bytes are not mixed up
    assert f"m={plan.micro_batches}" in plan.report["config"] and "mbs=" in plan.report["config"]
    one_batch = next((c for c in ranked if c.accumulation == 1 and c.recompute == "none" and not c.pruned), None)
    assert one_batch is None or one_batch.memory.total_bytes > limit


def test_recompute_is_chosen_when_and_only_when_the_limit_needs_it():
    one = [(("dp", 1),)]  # one device: no optimizer parallel to reach for first
    model = models.build("gpt-small", "meta")
    cluster = Cluster.preset("cpu-gloo:1")
    plain, ranked = search(model, model.example_inputs(1), cluster, 8, meshes=one)
    assert plain.recompute == "none" and [c.recompute for c in ranked] == ["none"]  # roomy: not even tried
    need = ranked[0].memory
    limit = need.total_bytes - 0.5 * need.activations_bytes
    # gradient accumulation would fit for less time (see the test below): held at one micro-batch here
    plan, ranked = search(model, model.example_inputs(1), cluster, 8, limit, meshes=one, fixed=Fixed(m=1))
    by_setting = {(c.recompute, c.offload): c for c in ranked}
    assert plan.recompute != "none" and by_setting[(plan.recompute, plan.offload)].memory.total_bytes <= limit
    plain = by_setting[("none", "none")]
    _, (full, *_) = search(model, model.example_inputs(1), cluster, 8, limit, meshes=one,
                           fixed=Fixed(m=1, recompute="full"))
    assert full.memory.activations_bytes <= 0.4 * need.activations_bytes
    assert full.compute_s > plain.compute_s  # the forward runs twice
    host = by_setting[("none", "host")]  # offload moves the optimizer state off the device, for copy time
    assert host.memory.optimizer_bytes == 0 and host.memory.offloaded_bytes == plain.memory.optimizer_bytes
    assert host.compute_s > plain.compute_s


def test_a_model_that_cannot_fit_is_told_by_how_much():
    with pytest.raises(PolyshardError, match=r"does not fit: .* over the 1 MiB limit"):
        _search(parse_bytes("1MiB"))


def test_a_model_no_split_can_hold_is_refused_before_its_capture(monkeypatch):
    """No plan holds less than each parameter's fp32 weight and gradient (offload keeps fp32 and moves only the
    optimizer state) spread over every device: every candidate the search costs lies above that floor, the leanest
    fits at its own memory, and a limit under the floor is refused without capturing the model."""
    import polyshard.planner.search as search_module

    model, cluster = models.build("gpt-small", "meta"), Cluster.preset("cpu-gloo:4")
    floor = sum(p.numel() for p in model.parameters()) * (4 + 4) / cluster.num_devices
    lean = Fixed(pp=4, offload="host", recompute="full")
    costed = [c for fixed in (Fixed(), lean) for c in search(model, model.example_inputs(1), cluster, 8,
                                                              fixed=fixed)[1] if not c.pruned]
    assert min(c.memory.total_bytes for c in costed) > floor
    leanest = min(c.memory.total_bytes for c in costed if c.offload == "host")
    plan, _ = search(model, model.example_inputs(1), cluster, 8, leanest, reserve_bytes=0, fixed=lean)
    assert plan.offload == "host"
    monkeypatch.setattr(search_module, "capture", lambda *a: pytest.fail("captured a model that cannot fit"))
    with pytest.raises(PolyshardError, match=r"does not fit: its [\d,]+ parameters need 8 bytes each at the least "
                                             r"\(weight and gradient, the optimizer state offloaded\)"):
        search(model, model.example_inputs(1), cluster, 8, 0.99 * floor, reserve_bytes=0)


def test_parameter_memory_follows_the_layouts():
    model = models.build("gpt-tiny", "meta")
    gm = capture(model, model.example_inputs(1))
    full = estimate_memory(gm, propagate(gm, (), print))
    split = estimate_memory(gm, propagate(gm, (("tp", 2),), print))
    numel = sum(p.numel() for p in model.parameters())
    assert full.params_bytes == numel * 4 and full.optimizer_bytes == 2 * numel * 4
    replicated = sum(p.numel() for n, p in model.named_parameters() if "ln" in n or "wpe" in n or "proj.bias" in n)
    assert split.params_bytes == (replicated + (numel - replicated) / 2) * 4


def test_search_report_survives_json_and_renders():
    plan, _ = _search()
    plan = dataclasses.replace(plan, model="gpt-small")
    again = Plan.from_json(plan.to_json())
    text = render(again)
    assert again.report == plan.report and "runner-up" in text and chosen_row(plan.report)["brief"] in text
    rows = text.splitlines()
    legend = next(line for line in rows if line.startswith("  * the choice"))
    assert ("x over the memory limit" in legend) == any(line.startswith("x ") for line in rows)
    assert ("> a lower bound" in legend) == any(" >" in line for line in rows if line[:2] in ("  ", "x ")
                                                and line != legend)


def test_large_models_plan_in_seconds():
    model = models.build("pangu-alpha-2.6b", "meta")
    plan, candidates = search(model, model.example_inputs(1), Cluster.preset("8xA100-80G"), 8)
    # 4 dp x tp splits of 8 devices, and 3 + 2 + 1 with 2, 4 or 8 pipeline stages
    assert len({c.describe().split(",")[0] for c in candidates}) == 4 + 3 + 2 + 1 and plan.report["chosen"]
    assert plan.precision == "bf16"  # an A100 multiplies bf16 16x faster than fp32


def test_pins_survive_the_search_and_rule_out_splits_that_cannot_hold_them():
    import polyshard as ps

    model = models.build("gpt-small", "meta")
    for block in model.blocks:
        ps.shard(block.mlp.fc, in_strategy=((1, 1, 2), (1, 2)))
    plan, candidates = search(model, model.example_inputs(1), Cluster.preset("cpu-gloo:2"), 4)
    assert [c.describe() for c in candidates] == ["dp=1 x tp=2"]  # dp=2 x tp=1 has no axis to split on
    assert plan.params["blocks.3.mlp.fc.weight"].dims == ((), ("tp",))


def test_a_model_pinned_by_axis_name_is_costed_on_every_split_that_holds_its_pins():
    """Pins naming the tp axis (Llama's own tensor-parallel plan) hold on every split with one: each is costed (no
    bound from the unsplit program, which no such pin can hold, and no chunk's ranks splitting rows), and the pick
    is the fastest of them."""
    from polyshard.planner.plan_model import pin_tp_plan

    model = models.build("hf:llama", device="meta")
    row = model.example_inputs(1)
    graph = capture(model, row)
    pin_tp_plan(model, graph, ("tp",))
    cluster = Cluster.preset("8xA100-80G")
    plan, candidates = search(model, row, cluster, 64, graph=graph, workers=1)
    assert {dict(c.mesh).get("tp", 1) for c in candidates} == {2, 4, 8}
    for mesh in {c.mesh for c in candidates if not c.pruned}:
        alone, _ = search(model, row, cluster, 64, graph=graph, meshes=[mesh], workers=1)
        assert chosen_row(plan.report)["step_s"] <= chosen_row(alone.report)["step_s"] * (1 + 1e-9), mesh


def test_fixed_cost_of_split_ops_decides_between_splitting_and_replicating():
    """Where a DTensor op's fixed cost dwarfs its compute (tiny models on CPU), the cheapest plan
    keeps ops whole; with no such cost, splitting the large matmuls wins."""
    model = models.build("gpt-small", "meta")
    base = Cluster.preset("cpu-gloo:4")

    def split_ops(cluster):
        plan, _ = search(model, model.example_inputs(1), cluster, 8, meshes=[(("dp", 1), ("tp", 4))])
        return sum(n.impl != "local" for n in plan.nodes.values())

    assert split_ops(dataclasses.replace(base, split_op_overhead_s=1.0)) == 0
    assert split_ops(dataclasses.replace(base, op_overhead_s=0.0, split_op_overhead_s=0.0)) > 10


@pytest.mark.parametrize("config", [dict(dp=4, m=1), dict(dp=4, m=4), dict(dp=2, pp=2, m=4, schedule="1f1b"),
                                    dict(dp=4, m=2, zero=2)])
def test_the_optimizers_cost_per_tensor_comes_once_a_step(config):
    """However many micro-batches a step runs, it steps the optimizer once: a cost per tensor stepped adds
    that many times it to the step, per parameter for torch's AdamW (fp32, level 0; in a pipeline, the
    parameters of the rank holding the most), per flat bucket of masters for polyshard's optimizer parallel."""
    model = models.build("gpt-tiny", "meta")
    base = Cluster.preset("cpu-gloo:4")
    fixed = Fixed(tp=1, precision="fp32", recompute="none", **{"zero": 0, **config})

    def step_s(cluster):
        plan, candidates = search(model, model.example_inputs(1), cluster, 16, fixed=fixed)
        return candidates[0].step_s, plan

    plain, plan = step_s(base)
    charged, _ = step_s(dataclasses.replace(base, optimizer_overhead_s=1.0))
    names = [n for n, _ in model.named_parameters()]
    if plan.zero:
        tensors = 1  # gpt-tiny's parameters fill one 25 MiB bucket
    elif plan.stage_boundaries:  # the rank holding the most parameters: the first stage's wte, wpe and blocks.0
        assert plan.stage_boundaries == ("blocks.1",)
        tensors = sum(n.startswith(("wte.", "wpe.", "blocks.0.")) for n in names)
    else:
        tensors = len(names)
    assert charged - plain == pytest.approx(tensors, rel=1e-6)


@pytest.mark.parametrize("m", [1, 2])
def test_each_precision_pays_its_own_fixed_cost_per_op(m):
    """A dtype timed apart (a CPU's bf16 kernels) charges its own fixed cost on every op of every
    micro-batch, and only plans computing in it; other dtypes keep the float32 figure."""
    model = models.build("gpt-tiny", "meta")
    ops = sum(n.op.startswith("call_") for n in capture(model, model.example_inputs(1)).graph.nodes)
    base = Cluster.preset("cpu-gloo:4")
    slow_bf16 = dataclasses.replace(base, op_overheads_s={"bfloat16": base.op_overhead_s + 1.0})

    def step_s(cluster, precision):
        fixed = Fixed(dp=4, tp=1, m=m, zero=0, precision=precision, recompute="none")
        return search(model, model.example_inputs(1), cluster, 16, fixed=fixed)[1][0].step_s

    assert step_s(slow_bf16, "bf16") - step_s(base, "bf16") == pytest.approx(m * ops, rel=1e-6)
    assert step_s(slow_bf16, "fp32") == step_s(base, "fp32")
    assert search(model, model.example_inputs(1), slow_bf16, 16)[0].precision == "fp32"


def test_a_transformer_written_elsewhere_is_planned_like_polyshards_own():
    """Its own module names, a hand-written attention: on GPUs where splitting pays, the search
    splits its MLP column- then row-parallel and its attention by heads, as for the GPT."""
    from tests.foreign import TinyLM

    model = TinyLM(vocab=4096, width=2048, heads=16, depth=4, seq=512).to("meta")
    plan, _ = search(model, model.batch(1), Cluster.preset("8xA100-80G"), 8, meshes=[(("dp", 1), ("tp", 8))])
    layouts = {name: layout.describe() for name, layout in plan.params.items()}
    for layer in range(4):
        assert layouts[f"layers.{layer}.up.weight"] == layouts[f"layers.{layer}.mix.query.weight"] == "tp=8:S(0)"
        assert layouts[f"layers.{layer}.down.weight"] == layouts[f"layers.{layer}.mix.out.weight"] == "tp=8:S(1)"


def _collectives_between_ops(gm, plan: Plan) -> set[str]:
    """The collectives a plan's moves of values between ops take (weights, inputs and returned values aside; a
    row-parallel product that hands on its sums reduced runs its all-reduce itself)."""
    kinds = set()
    for n in gm.graph.nodes:
        for u in n.all_input_nodes:
            src, dst = plan.nodes[u.name].output, plan.nodes[n.name].inputs.get(u.name)
            if u.op not in ("get_attr", "placeholder") and n.op != "output" and src != dst and dst is not None:
                kinds |= {step.collective for step in plan_transition(*common_axes(src, dst))}
    return kinds


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_all_reduce_only_splits_as_megatron_before_sequence_parallel(family):
    """tp_comm=all_reduce, where splitting every product pays: values move between ops by all-reduces alone (the
    free search gathers and scatters), at a cost no lower. GPT-2's fused q/k/v product is cut along its output, which
    q, k and v split again: its attention stays whole, its MLP splits column- then row-parallel."""
    pytest.importorskip("transformers")
    from polyshard.models import hf
    from tests.distributed.hf_cases import products_slow_against_links

    model = hf.build(family, device="meta")
    row = {k: v[:1].to("meta") for k, v in hf.batch(hf.build(family), 4, 8, seed=0).items()}
    gm, cluster, mesh = capture(model, row), products_slow_against_links(), [(("dp", 2), ("tp", 2))]
    steps, kinds, plans = [], [], []
    for fixed in (Fixed(precision="fp32"), Fixed(precision="fp32", tp_comm="all_reduce")):
        plan, ranked = search(model, row, cluster, 4, meshes=mesh, fixed=fixed, graph=gm)
        steps.append(next(c.step_s for c in ranked if c.describe() == plan.report["chosen"]))
        kinds.append(_collectives_between_ops(gm, plan))
        plans.append({name: layout.describe() for name, layout in plan.params.items()})
    assert kinds[0] - {"all_reduce"} and kinds[1] <= {"all_reduce"}, kinds  # a row-parallel op may sum its own
    assert steps[1] >= steps[0]
    layouts = plans[1]
    if family == "llama":
        column, row = (f"model.layers.0.{m}.weight" for m in ("self_attn.q_proj", "mlp.up_proj")), \
            (f"model.layers.0.{m}.weight" for m in ("self_attn.o_proj", "mlp.down_proj"))
        assert {layouts[p] for p in column} == {"tp=2:S(0)"} and {layouts[p] for p in row} == {"tp=2:S(1)"}
    else:  # Conv1D weights are (in, out)
        block = "transformer.h.0"
        assert layouts[f"{block}.attn.c_attn.weight"] == layouts[f"{block}.attn.c_proj.weight"] == "tp=2:R"
        mlp = (layouts[f"{block}.mlp.c_fc.weight"], layouts[f"{block}.mlp.c_proj.weight"])
        assert mlp == ("tp=2:S(1)", "tp=2:S(0)")
