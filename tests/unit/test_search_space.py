"""The search's bounds, the settings a user fixes, and the cost terms the published comparison rests on."""

import dataclasses
import math

import pytest
import torch

from polyshard import models
from polyshard.buckets import BUCKET_BYTES, bucket_count, cut_buckets
from polyshard.cluster import Cluster, Link
from polyshard.errors import PolyshardError
from polyshard.planner.config import Fixed
from polyshard.layout import Layout
from polyshard.plan import RECOMPUTE_MODES, chunk_values, chunks_text
from polyshard.planner.report import chosen_row
from polyshard.planner.cost.comm import DataSync, axis_link, comm_seconds
from polyshard.graph.capture import capture, shape_of
from polyshard.planner.cost.overlap import first_bucket_bytes, op_costs
from polyshard.planner.precision import precisions_to_cost
from polyshard.planner.propagate import propagate
from polyshard.planner.candidates import covers, enumerated
from polyshard.planner.intra_op import solve
from polyshard.planner.cost.data_parallel import dp_seconds
from polyshard.planner.search import BUCKET_CHOICES, _Costs, default_reserve_bytes, search
from polyshard.planner.split import mesh_candidates
from polyshard.transitions import PAIRWISE, transition_bytes, wire_bytes


def _cluster(name: str) -> Cluster:
    """A preset, or "cpu-mixed": 4 CPU ranks whose bf16 products run twice fp32's rate while each bf16 op
    costs 3x the fixed time, shallow bf16 products a fraction of that rate, small-head attention a fifth
    of fp32's share and GELU a fifth of fp32's rate (as on a CPU with bf16 instructions), so that neither
    precision is priced faster in every term."""
    if name == "cpu-skewed":  # ranks on shared cores, reaching collectives apart by a quarter of their compute
        return dataclasses.replace(Cluster.preset("cpu-gloo:4"), arrival_skew=0.25)
    if name != "cpu-mixed":
        return Cluster.preset(name)
    base = Cluster.preset("cpu-gloo:4")
    points = ((16.0, 8.0, 0.05), (256.0, 8.0, 0.5), (1024.0, 8.0, 1.0))
    return dataclasses.replace(base, flops_per_s={"float32": 5e10, "bfloat16": 1e11},
                               op_overheads_s={"bfloat16": 3 * base.op_overhead_s},
                               matmul_shares={"float32": ((32, 0.9), (128, 1.0)),
                                              "bfloat16": ((16, 0.1), (64, 0.4), (512, 1.0))},
                               attention_shares={"float32": points,
                                                 "bfloat16": tuple((seq, dim, sh / 5) for seq, dim, sh in points)},
                               pointwise_rates={"float32": {"gelu": 1e9}, "bfloat16": {"gelu": 2e8}})


def _search(name, cluster, batch, fixed=Fixed(), limit=None):
    model = models.build(name, "meta")
    return search(model, model.example_inputs(1), _cluster(cluster), batch, limit, fixed=fixed)


def _settings(c) -> Fixed:
    """Everything a candidate decided, as a Fixed that prices it alone."""
    k = c.config()
    return Fixed(dp=k.dp, tp=k.tp, pp=k.pp, zero=c.zero, precision=c.precision, recompute=c.recompute,
                 offload=c.offload)


@pytest.mark.parametrize("name,cluster,batch,limit_mib", [
    ("gpt-small", "cpu-gloo:4", 16, None), ("gpt-tiny", "8xA100-80G", 16, None),
    ("gpt-small", "2x4xH100-80G", 32, None),
    # tight: offloaded (fp32) settings and recompute are bounded too
    ("gpt-small", "8xA100-80G", 64, 4096 + 6), ("gpt-small", "cpu-gloo:4", 16, 8),
    # neither precision dominates: both are costed, and the bounds hold for both
    ("gpt-small", "cpu-mixed", 16, None), ("gpt-tiny", "cpu-mixed", 16, None),
    # a step whose ranks communicate also waits for them: bounds leave that out, and stay below
    ("gpt-small", "cpu-skewed", 16, None),
])
def test_every_pruned_bound_is_below_what_the_split_costs(name, cluster, batch, limit_mib):
    limit = limit_mib and limit_mib * 2**20
    _, ranked = _search(name, cluster, batch, limit=limit)
    pruned = [c for c in ranked if c.pruned]
    assert pruned, "no candidate was pruned: the test checks nothing"
    assert limit is None or any(c.recompute != "none" for c in pruned), "no recompute setting was pruned"
    assert cluster.startswith("cpu") or limit is None or any(c.offload != "none" for c in pruned), \
        "no offloaded setting was pruned"
    for c in pruned:
        _, alone = _search(name, cluster, batch, _settings(c))  # a time bound holds at any memory
        costed = [a for a in alone if not a.pruned]
        assert costed and c.step_s <= min(a.step_s for a in costed) * (1 + 1e-9), c.describe()


def test_fixed_settings_are_kept_and_the_rest_chosen():
    plan, ranked = _search("gpt-small", "cpu-gloo:4", 16, Fixed(dp=2, pp=2, m=4, zero=1))
    config = dict(kv.split("=") for kv in plan.report["config"].split(","))
    assert (config["dp"], config["pp"], config["m"], config["zero"], config["tp"]) == ("2", "2", "4", "1", "1")
    assert config["mbs"] == "2" and config["schedule"] in ("1f1b", "gpipe", "interleaved")
    assert all(c.config().dp == 2 and c.pp == 2 for c in ranked)


def test_config_spelling_round_trips_and_refuses_nonsense():
    text = "dp=8,tp=8,pp=16,mbs=1,schedule=interleaved,v=2,zero=1,recompute=full,precision=bf16"
    assert Fixed.parse(text).text() == "dp=8,tp=8,pp=16,mbs=1,schedule=interleaved,v=2,zero=1,recompute=full,precision=bf16"
    assert Fixed.parse("pp=2,v=2,recompute=full/full/selective/none").stage_recompute == \
        ("full", "full", "selective", "none")
    assert Fixed.parse("dp=8,bucket=100").bucket_bytes == 100 * 2**20 and Fixed().bucket_bytes == BUCKET_BYTES
    assert Fixed.parse("pp=2,tp_split=rows/ops").stage_tp_split == ("rows", "ops")
    runs = "pp=4,v=2,recompute=pointwise*3/none*4/full,tp_split=rows*2/ops*6"  # a run of chunks as VALUE*COUNT
    assert Fixed.parse(runs).stage_recompute == ("pointwise",) * 3 + ("none",) * 4 + ("full",)
    assert Fixed.parse(runs).stage_tp_split == ("rows",) * 2 + ("ops",) * 6 and Fixed.parse(runs).text() == runs
    assert chunks_text(("full", "full", "none", "full")) == "full*2/none/full" and chunks_text(()) == ""
    assert chunk_values("full*2/none/full", "recompute") == ("full", "full", "none", "full")
    assert Fixed.parse("tp_split=rows").stage_tp_split == ("rows",) and Fixed().stage_tp_split == ()
    for bad, needle in (("tp=0", "positive"), ("tq=2", "unknown"), ("tp", "KEY=VALUE"), ("tp=2,tp=4", "twice"),
                        ("schedule=zigzag", "schedule"), ("zero=5", "zero"), ("v=2,schedule=1f1b", "interleaved"),
                        ("overlap=2", "0 or 1"), ("bucket=0", "positive"),
                        ("pp=2,recompute=full/sometimes", "recompute must be one of"),
                        ("recompute=full/none", "give pp"), ("pp=2,v=2,recompute=full/none", "pp x v is 2"),
                        ("pp=2,tp_split=rows/cols", "tp_split must be one of"), ("tp_split=rows/ops", "give pp"),
                        ("pp=2,recompute=full*0/none", "'full\\*0' is not VALUE or VALUE\\*COUNT"),
                        ("pp=2,recompute=full*/none", "positive COUNT"), ("pp=2,tp_split=rows*x", "'rows\\*x'"),
                        ("pp=2,recompute=full*3", "3 pipeline chunks")):
        with pytest.raises(PolyshardError, match=needle):
            Fixed.parse(bad)


@pytest.mark.parametrize("text", ["schedule=interleaved,pp=1", "schedule=gpipe,pp=1", "v=2,pp=1", "cuts=even,pp=1",
                                  "tp_split=rows,pp=1", "tp_split=ops,pp=1", "pp=1,recompute=full/none"])
def test_settings_of_a_pipeline_are_refused_beside_pp_1(text):
    with pytest.raises(PolyshardError, match="sets how pipeline stages run, and pp=1 has none"):
        Fixed.parse(text)


def test_interleaving_one_chunk_per_rank_is_refused():
    with pytest.raises(PolyshardError, match="v >= 2 chunks"):
        Fixed.parse("schedule=interleaved,v=1")
    assert Fixed.parse("schedule=1f1b,v=1").pipeline_keys == ("schedule",)
    assert Fixed.parse("v=1,recompute=full,m=4").pipeline_keys == ()  # one chunk a rank and accumulation: no pipeline


@pytest.mark.parametrize("text", ["schedule=gpipe", "v=2", "cuts=even", "tp_split=ops"])
def test_settings_of_a_pipeline_with_pp_left_to_the_search_choose_a_pipeline(text):
    def config(plan) -> dict:
        return dict(kv.split("=") for kv in plan.report["config"].split(","))

    unpinned, _ = _search("gpt-small", "cpu-gloo:4", 16)
    plan, ranked = _search("gpt-small", "cpu-gloo:4", 16, Fixed.parse(text))
    assert config(unpinned)["pp"] == "1"  # so the pin, not the model, makes the pipeline
    assert config(plan)["pp"] != "1" and all(c.pp > 1 for c in ranked)
    key, value = text.split("=")
    assert config(plan).get(key, value) == value  # the spelling names no cuts: the plan's stages are where they are


def test_a_gradient_reduction_after_backward_is_priced_whole():
    name, cluster = "gpt:layers=12,hidden=1024,heads=16,seq=512,vocab=8192", Cluster.preset("2x8xA100-80G")
    split = dict(dp=16, tp=1, pp=1, zero=0, mbs=2, precision="bf16", bucket=BUCKET_BYTES // 2**20)
    beside, after = (chosen_row(_search(name, "2x8xA100-80G", 32, Fixed(**split, overlap=o))[0].report)
                     for o in (1, 0))
    assert beside["compute_s"] == pytest.approx(after["compute_s"])
    # a ring all-reduce of the bf16 gradients over 16 ranks across the nodes, a bucket at a time, none hidden: eight
    # rings side by side, one per NIC, at eight NICs' rate up to NVLink's
    grads = 2 * sum(p.numel() for p in models.build(name, "meta").parameters())
    buckets = bucket_count(grads, BUCKET_BYTES, first_bucket_bytes(cluster, BUCKET_BYTES))
    link = Link(min(8 * cluster.inter_node.bandwidth_bytes_per_s, cluster.intra_node.bandwidth_bytes_per_s),
                cluster.inter_node.latency_s)
    ring_s = 2 * 15 / 16 * grads / link.bandwidth_bytes_per_s + buckets * 15 * link.latency_s
    assert after["dp_comm_s"] == pytest.approx(ring_s, rel=0.01) and beside["dp_comm_s"] < 0.8 * ring_s


@pytest.mark.parametrize("config", ["dp=4", "dp=2,pp=2", "dp=2,tp=2"])
def test_a_step_whose_ranks_communicate_waits_the_clusters_arrival_skew(config):
    skewed, even = (chosen_row(_search("gpt-small", name, 16, Fixed.parse(config))[0].report)
                    for name in ("cpu-skewed", "cpu-gloo:4"))
    assert skewed["skew_s"] == pytest.approx(0.25 * skewed["compute_s"]) and even["skew_s"] == 0
    assert skewed["step_s"] == pytest.approx(even["step_s"] + skewed["skew_s"])


@pytest.mark.parametrize("config, call_skew_s", [("dp=4", 3e-3), ("dp=2,pp=2", 2e-3)])
def test_a_gradient_sync_waits_the_call_skew_of_its_group(config, call_skew_s):
    """The step's gradient sync waits once for its group's ranks: the node's call skew for the whole node, the
    pairs' for a group of two of its four ranks."""
    late = dataclasses.replace(Cluster.preset("cpu-gloo:4"), node_call_skew_s=3e-3, call_skew_s=2e-3)
    model, fixed = models.build("gpt-small", "meta"), Fixed.parse(config)
    skewed, even = (chosen_row(search(model, model.example_inputs(1), cluster, 16, fixed=fixed)[0].report)
                    for cluster in (late, Cluster.preset("cpu-gloo:4")))
    assert skewed["skew_s"] == pytest.approx(call_skew_s) and even["skew_s"] == 0
    assert skewed["step_s"] == pytest.approx(even["step_s"] + call_skew_s)


def test_one_rank_waits_for_no_other():
    model = models.build("gpt-tiny", "meta")
    alone = dataclasses.replace(Cluster.preset("cpu-gloo:1"), arrival_skew=0.25)
    assert chosen_row(search(model, model.example_inputs(1), alone, 4)[0].report)["skew_s"] == 0


def test_parameters_small_enough_to_stay_whole_are_all_reduced_at_every_level():
    """polyshard.runtime.zero shards no parameter under its threshold: gpt-tiny's are all under 64 KiB, so at
    levels 1 and 2 its gradients are all-reduced as at level 0, and nothing is gathered after the step."""
    model = models.build("gpt-tiny", "meta")
    assert max(p.numel() * 4 for p in model.parameters()) < 64 * 2**10
    tiny, small = ({z: chosen_row(_search(name, "cpu-gloo:4", 16, Fixed.parse(f"dp=4,precision=fp32,zero={z}"))[0]
                                  .report)["dp_comm_s"] for z in (0, 1, 2)} for name in ("gpt-tiny", "gpt-small"))
    assert tiny[1] == pytest.approx(tiny[0]) and tiny[2] == pytest.approx(tiny[0])
    assert small[1] > small[0]  # gpt-small's larger tables are sharded, and gathered after the step


def test_a_configuration_no_split_allows_is_refused():
    with pytest.raises(PolyshardError, match="tp=3"):
        _search("gpt-small", "cpu-gloo:4", 16, Fixed(tp=3))


def test_gpu_plans_leave_a_reserve():
    cluster = Cluster.preset("8xA100-80G")
    assert default_reserve_bytes(cluster) == 4 * 2**30 and default_reserve_bytes(Cluster.preset("cpu-gloo:2")) == 0
    plan, _ = _search("gpt-tiny", "8xA100-80G", 8)
    assert plan.report["limit_bytes"] == 76 * 2**30 and plan.report["reserve_bytes"] == 4 * 2**30


def test_zero_levels_move_what_the_runtime_issues():
    cluster = Cluster.preset("cpu-gloo:4")  # nothing hides on CPU: the whole traffic is charged
    mesh, grad = (("dp", 4),), 4e6
    link = cluster.intra_node
    one_pass = wire_bytes("reduce_scatter", grad, 4) / link.bandwidth_bytes_per_s  # (n-1)/n of the bytes
    latency = link.latency_s * 3  # an all-reduce's; a ring all-gather runs half its steps, gloo's scatter all
    gather = latency / 2
    seconds = [dp_seconds(grad, mesh, ("dp",), cluster, zero, modules=5) for zero in range(4)]
    assert seconds[0] == pytest.approx(2 * one_pass + latency)  # all-reduce
    assert seconds[1] == pytest.approx(3 * one_pass + latency + gather)  # all-reduce, then all-gather of the shards
    assert seconds[2] == pytest.approx(2 * one_pass + latency + gather)  # reduce-scatter, all-gather
    assert seconds[3] == pytest.approx(3 * one_pass + 5 * (2 * gather + latency))  # per module: 2 gathers, 1 scatter
    accumulated = dp_seconds(grad, mesh, ("dp",), cluster, 3, modules=5, micro_batches=4)
    assert accumulated == pytest.approx(9 * one_pass + 5 * (8 * gather + latency))  # gathered in each micro-batch
    # parameters under the threshold stay whole: all-reduced once, never gathered
    small = dp_seconds(grad, mesh, ("dp",), cluster, 3, modules=0, micro_batches=4, whole_bytes=grad)
    assert small == pytest.approx(seconds[0])
    quarter = dp_seconds(grad, mesh, ("dp",), cluster, 3, modules=2, whole_bytes=grad / 4)
    assert quarter == pytest.approx(3 * 0.75 * one_pass + 2 * (2 * gather + latency) + 2 * 0.25 * one_pass + latency)


def test_every_gradient_bucket_pays_its_collectives_fixed_cost():
    cluster = Cluster.preset("cpu-gloo:4")
    mesh, grad, link = (("dp", 4),), 100 * 2**20, cluster.intra_node
    one_pass, latency = wire_bytes("reduce_scatter", grad, 4) / link.bandwidth_bytes_per_s, link.latency_s * 3
    tensors = [2**20] * 100  # the buckets the runtime cuts 100 MiB of 1 MiB gradients into, the first as large on CPU
    buckets = len(cut_buckets(tensors, [None] * len(tensors), BUCKET_BYTES, first_bucket_bytes(cluster, BUCKET_BYTES)))
    assert buckets == 4
    assert dp_seconds(grad, mesh, ("dp",), cluster, 0) == pytest.approx(2 * one_pass + buckets * latency)
    assert dp_seconds(grad, mesh, ("dp",), cluster, 2) == pytest.approx(2 * one_pass + buckets * 1.5 * latency)


@pytest.mark.parametrize("batch,fixed", [(32, Fixed(dp=16, tp=1, zero=2)), (64, Fixed(dp=8, pp=2, zero=2)),
                                         (32, Fixed(dp=16, tp=1, zero=0))])
def test_the_search_takes_the_bucket_size_no_fixed_size_beats(batch, fixed):
    name, cluster = "gpt:layers=12,hidden=1024,heads=16,seq=512,vocab=8192", "2x8xA100-80G"
    plan, _ = _search(name, cluster, batch, fixed)
    steps = {}
    for size in BUCKET_CHOICES:
        pinned, _ = _search(name, cluster, batch, dataclasses.replace(fixed, bucket=size // 2**20))
        assert pinned.bucket_bytes == size and f"bucket={size // 2**20}" in pinned.report["config"]
        steps[size] = chosen_row(pinned.report)["step_s"]
    assert chosen_row(plan.report)["step_s"] == pytest.approx(min(steps.values()), rel=1e-12)
    assert steps[plan.bucket_bytes] == min(steps.values()) and len(set(steps.values())) > 1  # the size matters here


@pytest.mark.parametrize("fixed,small,large", [(Fixed(dp=16, tp=1, pp=1, zero=0, mbs=2), 100, 400),
                                               (Fixed(dp=8, tp=1, pp=2, zero=0, m=4), 100, 400),
                                               (Fixed(dp=8, tp=1, pp=2, zero=0, m=4), 1, 5)])
def test_a_bucket_whose_buffer_does_not_fit_is_not_taken(fixed, small, large):
    # nothing hidden: the fewer buckets the faster, and at level 0 each bucket is also a buffer
    name, cluster = "gpt:layers=12,hidden=1024,heads=16,seq=512,vocab=8192", "2x8xA100-80G"
    fixed = dataclasses.replace(fixed, precision="bf16", overlap=0, schedule="1f1b" if fixed.pp > 1 else None)
    held = {mib: chosen_row(_search(name, cluster, 32, dataclasses.replace(fixed, bucket=mib))[0].report)
            for mib in (small, large)}
    assert held[large]["step_s"] < held[small]["step_s"]
    assert held[large]["memory"]["total"] > held[small]["memory"]["total"]
    usable = (held[small]["memory"]["total"] + held[large]["memory"]["total"]) / 2
    plan, _ = _search(name, cluster, 32, fixed, limit=usable + default_reserve_bytes(_cluster(cluster)))
    assert plan.bucket_bytes == small * 2**20 and chosen_row(plan.report)["memory"]["total"] <= usable


def test_on_nccl_rings_a_reduce_scatter_and_an_all_gather_cost_one_all_reduce():
    cluster, mesh, grad = Cluster.preset("8xA100-80G"), (("dp", 8),), 4e6
    level = [dp_seconds(grad, mesh, ("dp",), cluster, zero) for zero in range(3)]
    assert level[2] == pytest.approx(level[0]) and level[1] > level[0]


def test_level3_gathers_only_modules_holding_a_parameter_over_the_threshold():
    from polyshard.planner.pipeline import level3_traffic
    groups = ((10, 20), (40_000,), (5, 30_000))  # fp32: 40 and 80 bytes; 160 kB; 20 bytes and 120 kB
    assert level3_traffic(groups, 4) == ((10 + 20 + 5) * 4, 2)
    assert level3_traffic(groups, 2) == ((10 + 20 + 5 + 30_000) * 2, 1)  # in bf16 30,000 weighs 60 kB: whole too


def test_gpu_data_parallel_traffic_hides_behind_backward_but_the_last_bucket():
    cluster = Cluster.preset("2x8xA100-80G")
    mesh, grad = (("dp", 16), ("tp", 1)), 4e9
    exposed = dp_seconds(grad, mesh, ("dp",), cluster, 0, overlap_s=0.0)
    # traffic longer than backward: the step lasts as long as the traffic, however slow backward runs beside it
    assert dp_seconds(grad, mesh, ("dp",), cluster, 0, overlap_s=exposed / 2) == pytest.approx(exposed / 2)
    uncontended = dataclasses.replace(cluster, overlap_slowdown=0.0)
    last = dp_seconds(grad, mesh, ("dp",), uncontended, 0, overlap_s=math.inf)
    assert 0 < last < exposed / 50
    # backward long enough to hide it all: what it hides, it hides at 1 / (1 + slowdown) of its pace
    slowdown = cluster.overlap_slowdown
    tail = dp_seconds(grad, mesh, ("dp",), cluster, 0, overlap_s=math.inf)
    assert slowdown > 0 and tail == pytest.approx(last + (exposed - last) * slowdown / (1 + slowdown))


def test_compute_beside_traffic_takes_the_slowdown_longer():
    sync = DataSync(during=10.0, last=1.0, hides=1.0, slowdown=0.25)
    assert sync.exposed(100.0) == pytest.approx(1.0 + 9.0 * 0.25 / 1.25)  # 9 s beside backward, at 0.8 its pace
    assert sync.exposed(4.0) == pytest.approx(6.0)  # 4 s of backward take 5, and 5 s of traffic hide behind them
    assert DataSync(during=10.0, last=1.0, hides=1.0).exposed(4.0) == pytest.approx(6.0)
    assert DataSync(during=10.0, after=2.0, last=1.0).exposed(100.0) == pytest.approx(12.0)  # nothing hides


def test_model_shapes_and_written_out_attention():
    cfg = models.config("gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200")
    assert round(cfg.num_params() / 1e9, 1) == 174.6  # GPT-3 175B as Megatron-LM counts it
    assert models.config(models.shape_spec(cfg)) == cfg
    assert models.config("gpt-small", seq_len=32).seq_len == 32
    # Megatron-Core's 462B benchmark GPT: its own LM head, 131,072 tokens
    untied = models.config("gpt:layers=112,hidden=18432,heads=144,seq=4096,vocab=131072,tied=0")
    assert not untied.tied and round(untied.num_params() / 1e9) == 462
    assert models.config(models.shape_spec(untied)) == untied and "tied=False" not in models.shape_spec(untied)
    assert "lm_head.weight" in dict(models.build("gpt:layers=1,hidden=8,heads=2,seq=4,vocab=16,tied=0",
                                                 "meta").named_parameters())
    for bad in ("gpt:layers=2,hidden=30,heads=4", "gpt:layers=2,heads=4", "gpt:layers=2,hidden=32,heads=4,dropout=2",
                "gpt:layers=2,hidden=32,heads=4,attention=flash", "gpt:depth=2,hidden=32,heads=4",
                "gpt:layers=2,hidden=32,heads=4,tied=yes"):
        with pytest.raises(PolyshardError, match="model shape"):
            models.config(bad)
    spec = "gpt:layers=2,hidden=32,heads=4,seq=16,vocab=64"
    fused, math_ = models.build(spec, seed=3), models.build(spec + ",attention=math", seed=3)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    a, b = fused(x, x), math_(x, x)
    a.backward()
    b.backward()
    assert torch.allclose(a, b, rtol=1e-6)
    for (name, p), q in zip(fused.named_parameters(), math_.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), name


@pytest.mark.parametrize("cluster,limit_mib", [("cpu-gloo:4", 6.5), ("8xA100-80G", 4096 + 6)])
def test_the_free_pick_is_no_slower_than_any_setting_fixed(cluster, limit_mib):
    # under a tight limit the search must reach every (recompute, offload) that might win
    limit = limit_mib * 2**20
    usable = limit - default_reserve_bytes(Cluster.preset(cluster))
    free, ranked = _search("gpt-small", cluster, 64, limit=limit)
    best = min(c.step_s for c in ranked if c.describe() == free.report["chosen"])
    for recompute in RECOMPUTE_MODES:
        for offload in ("none", "host"):
            try:
                _, alone = _search("gpt-small", cluster, 64, Fixed(recompute=recompute, offload=offload), limit)
            except PolyshardError:
                continue  # nothing fits with this setting
            fitting = [c for c in alone if not c.pruned and c.memory.total_bytes <= usable]
            if fitting:
                assert best <= min(c.step_s for c in fitting) * (1 + 1e-9), (recompute, offload)


def test_recompute_that_frees_nothing_and_half_are_priced_only_when_asked():
    # gpt-small's attention is one fused call: recomputing it and its views frees no activation autograd keeps;
    # half frees, but the free search leaves it to the user (its alternating blocks are costed one by one)
    limit = 6.5 * 2**20
    _, free = _search("gpt-small", "cpu-gloo:4", 64, limit=limit)
    # memory is tight enough that recompute is tried: each mode that frees something
    assert {c.recompute for c in free} == {"none", "pointwise", "alternate", "full"}
    for mode in ("selective", "half"):
        _, asked = _search("gpt-small", "cpu-gloo:4", 64, Fixed(recompute=mode), limit)
        assert asked and all(c.recompute == mode for c in asked)


def test_offload_that_fits_with_room_does_not_stop_recompute_being_tried():
    # host copies at 1 MB/s: offload fits with room but takes seconds; recompute fits and is fast
    model = models.build("gpt-small", "meta")
    slow = dataclasses.replace(Cluster.preset("cpu-gloo:1"), host_bandwidth_bytes_per_s=1e6)
    _, plain = search(model, model.example_inputs(1), slow, 4, fixed=Fixed(m=1))
    limit = 0.97 * plain[0].memory.total_bytes
    plan, ranked = search(model, model.example_inputs(1), slow, 4, limit, fixed=Fixed(m=1))
    hosted = [c for c in ranked if c.offload == "host" and not c.pruned]
    assert hosted and min(c.memory.total_bytes for c in hosted) <= 0.9 * limit  # offload alone fits, with room
    assert plan.offload == "none" and plan.recompute in ("pointwise", "alternate", "half", "full"), (plan.recompute,
                                                                                                   plan.offload)


def test_offload_on_a_cpu_pays_the_plain_step_and_the_copies():
    # a CPU's host is its device: offloaded state is stepped as the plain run steps it, and the copies come on top
    cal = dataclasses.replace(Cluster.preset("cpu-gloo:4"), memory_bandwidth_bytes_per_s=5e9, optimizer_overhead_s=1e-4)
    model = models.build("gpt-small", "meta")
    priced = {}
    for offload in ("none", "host"):
        _, ranked = search(model, model.example_inputs(1), cal, 16,
                           fixed=Fixed(dp=4, zero=0, precision="fp32", m=1, offload=offload))
        priced[offload] = min((c for c in ranked if not c.pruned), key=lambda c: c.step_s)
    copies = 2 * 4 * sum(p.numel() for p in model.parameters()) / cal.host_bandwidth_bytes_per_s
    assert priced["host"].step_s == pytest.approx(priced["none"].step_s + copies, rel=1e-9)


@pytest.mark.parametrize("cluster,fixed", [("8xA100-80G", Fixed(zero=z)) for z in range(4)] +
                         [("8xA100-80G", Fixed(precision=p)) for p in ("fp32", "fp16")] +
                         [("cpu-mixed", Fixed(precision=p)) for p in ("fp32", "bf16")])
def test_variants_the_search_skips_as_dominated_are_never_faster(cluster, fixed):
    # the free search tries no level 1 (level 2 sends less, holds no more) and no fp32 where bf16 is faster
    free, ranked = _search("gpt-small", cluster, 64)
    best = min(c.step_s for c in ranked if c.describe() == free.report["chosen"])
    _, alone = _search("gpt-small", cluster, 64, fixed)
    usable = _cluster(cluster).memory_bytes - default_reserve_bytes(_cluster(cluster)) if \
        cluster != "cpu-mixed" else float("inf")
    fitting = [c for c in alone if not c.pruned and c.memory.total_bytes <= usable]
    assert fitting and best <= min(c.step_s for c in fitting) * (1 + 1e-9)


def test_both_precisions_are_costed_where_neither_is_priced_faster_in_every_term():
    assert precisions_to_cost(Cluster.preset("8xA100-80G"), "none", None) == ("bf16",)
    assert precisions_to_cost(Cluster.preset("cpu-gloo:4"), "none", None) == ("fp32",)  # equal rates: fp32 kept
    assert precisions_to_cost(_cluster("cpu-mixed"), "none", None) == ("fp32", "bf16")
    assert precisions_to_cost(_cluster("cpu-mixed"), "host", None) == ("fp32",)
    _, ranked = _search("gpt-tiny", "cpu-mixed", 16)
    assert {c.precision for c in ranked if not c.pruned} == {"fp32", "bf16"}


def test_each_precision_is_costed_with_the_strategies_solved_in_it():
    """Where neither precision is faster in every term, a split's strategies are solved in each: the free search
    prices every candidate as the search of its settings alone does (one solve for both would price bf16 with
    strategies chosen for the rates of neither)."""
    _, ranked = _search("gpt-tiny", "cpu-mixed", 16)
    costed = [c for c in ranked if not c.pruned and c.pp == 1]
    assert {c.precision for c in costed} == {"fp32", "bf16"}
    for c in costed:
        _, alone = _search("gpt-tiny", "cpu-mixed", 16, _settings(c))
        same = [a for a in alone if a.key == c.key and not a.pruned]
        assert same and same[0].step_s == pytest.approx(c.step_s, rel=1e-9), c.describe()


def test_a_precision_slower_at_shallow_products_is_costed_beside_the_other():
    gpu = Cluster.preset("8xA100-80G")
    shallow = dataclasses.replace(gpu, matmul_shares={"bfloat16": ((64, 0.01), (1024, 1.0))})
    assert precisions_to_cost(shallow, "none", None) == ("fp32", "bf16")  # bf16 at 3 TFLOP/s 64 deep: fp32 wins


def test_a_precision_slower_at_a_pointwise_op_is_costed_beside_the_other():
    gpu = Cluster.preset("8xA100-80G")
    slow_gelu = dataclasses.replace(gpu, pointwise_rates={"float32": {"gelu": 1e12}, "bfloat16": {"gelu": 1e9}})
    assert precisions_to_cost(slow_gelu, "none", None) == ("fp32", "bf16")
    even = dataclasses.replace(gpu, pointwise_rates={"float32": {"gelu": 1e9}, "bfloat16": {"gelu": 1e12}})
    assert precisions_to_cost(even, "none", None) == ("bf16",)


def test_a_transcendental_pointwise_op_is_no_faster_than_its_measured_rate():
    """On CPUs bf16 GELU is bound by its arithmetic, not its bytes: priced at the rate calibrate measured, for
    F.gelu and nn.GELU alike, and unchanged where no rate is measured."""
    model = models.build("gpt-tiny", "meta")
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU())
    plain = Cluster.preset("cpu-gloo:1")
    rated = dataclasses.replace(plain, pointwise_rates={"float32": {"gelu": 1e6}})
    for m, rows in ((model, 4), (mlp, 32)):
        example = model.example_inputs(rows) if m is model else (torch.randn(rows, 64),)
        plan, _ = search(m, example, plain, rows)
        gm = capture(m, example)
        costs = dict(zip([n.name for n in gm.graph.nodes if n.name in plan.nodes and n.op.startswith("call_")],
                         [c.compute_s for c in op_costs(gm, plan, rated)]))
        modules = dict(gm.named_modules())
        gelus = [n for n in gm.graph.nodes if n.target is torch.nn.functional.gelu or
                 (n.op == "call_module" and isinstance(modules[n.target], torch.nn.GELU))]
        assert gelus
        for n in gelus:  # three forward-equivalents of one element per output element
            assert costs[n.name] == pytest.approx(3 * math.prod(shape_of(n)) / 1e6)
        base = dict(zip(costs, [c.compute_s for c in op_costs(gm, plan, plain)]))
        assert all(base[n.name] < costs[n.name] / 10 for n in gelus)
        assert all(base[k] == costs[k] for k in costs if k not in {n.name for n in gelus})


def test_cross_entropy_works_through_its_logits_at_the_rate_measured_for_what_runs_it():
    """The loss returns one number but computes over every logit: on CPUs its exponentials bound it, at torch's
    measured rate over whole logits, at the vocabulary-parallel loss's over a rank's slice of the classes; and its
    fixed cost is what a call of that implementation was measured to take (dozens of ops), not one op's."""
    model = models.build("gpt-tiny", "meta")
    gm = capture(model, model.example_inputs(4))
    loss = next(n for n in gm.graph.nodes if n.name == "cross_entropy")
    logits = math.prod(shape_of(loss.args[0]))
    rated = dataclasses.replace(Cluster.preset("cpu-gloo:4"), pointwise_rates={
        "float32": {"cross_entropy": 1e6, "vocab_parallel_cross_entropy": 2e5}})
    fixed = dataclasses.replace(rated, loss_overheads_s={
        "float32": {"cross_entropy": 1e-3, "vocab_parallel_cross_entropy": 4e-3}})
    for mesh, seconds, call_s in (((), 3 * logits / 1e6, 1e-3), ((("tp", 4),), 3 * logits / 4 / 2e5, 4e-3)):
        plan = propagate(gm, mesh, lambda msg: None)
        assert (plan.nodes[loss.name].impl == "vocab_ce") == bool(mesh)
        names = [n.name for n in gm.graph.nodes if n.name in plan.nodes and n.op.startswith("call_")]
        costs, measured = (dict(zip(names, op_costs(gm, plan, c))) for c in (rated, fixed))
        assert costs[loss.name].compute_s == pytest.approx(seconds)
        assert measured[loss.name].overhead_s - costs[loss.name].overhead_s == \
            pytest.approx(call_s - rated.op_overhead_s)
        assert all(measured[k] == costs[k] for k in names if k != loss.name)


class _TwoAttentions(torch.nn.Module):
    """Causal attention on heads of 64 x 8 and on heads of 32 x 32: equal FLOPs, different shapes."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(8, 8)

    def forward(self, narrow, wide):
        sdpa = torch.nn.functional.scaled_dot_product_attention
        first = sdpa(self.q(narrow), narrow, narrow, is_causal=True)
        return first.mean() + sdpa(wide, wide, wide, is_causal=True).mean()


def test_attention_is_priced_at_its_heads_share_by_length_and_head_dim():
    """Two attentions of equal FLOPs run at their own measured shares: heads of 8 at half the share of heads of 32."""
    model, rows = _TwoAttentions(), 2
    example = (torch.randn(rows, 2, 64, 8), torch.randn(rows, 2, 32, 32))
    grid = ((32.0, 8.0, 0.1), (64.0, 8.0, 0.1), (32.0, 32.0, 0.2), (64.0, 32.0, 0.2))
    cluster = dataclasses.replace(Cluster.preset("cpu-gloo:1"), attention_shares={"float32": grid})
    plan, _ = search(model, example, cluster, rows)
    gm = capture(model, example)
    costs = {n.name: c.compute_s for n, c in zip([n for n in gm.graph.nodes if n.name in plan.nodes and
                                                  n.op.startswith("call_")], op_costs(gm, plan, cluster))}
    narrow, wide = [n for n in gm.graph.nodes if n.target is torch.nn.functional.scaled_dot_product_attention]
    flops = 4 * rows * 2 * 64 * 64 * 8  # 4 x B x H x T x S x D, the same for 32 x 32
    peak = cluster.flops_per_s["float32"]
    assert costs[narrow.name] == pytest.approx(3 * flops / (0.1 * peak))
    assert costs[wide.name] == pytest.approx(3 * flops / (0.2 * peak))


def test_tensor_axes_divide_a_node_or_span_whole_nodes():
    tps = {dict(m)["tp"] for m in mesh_candidates(48, 1, devices_per_node=8)}
    assert tps == {1, 2, 4, 8, 16, 24, 48}
    cluster = Cluster.preset("6x8xA100-80G")
    # an axis of 6 on 8-device nodes puts some of its groups across two nodes: the slow link
    assert axis_link((("dp", 8), ("tp", 6)), "tp", cluster) == cluster.inter_node
    assert axis_link((("dp", 12), ("tp", 4)), "tp", cluster) == cluster.intra_node
    nic, nvlink = cluster.inter_node.bandwidth_bytes_per_s, cluster.intra_node.bandwidth_bytes_per_s
    # a ring over whole nodes runs one ring per NIC its group has in a node, up to the intra-node link's rate
    # (pipeline sends ride one NIC)
    assert axis_link((("dp", 12), ("tp", 4)), "dp", cluster) == Link(2 * nic, cluster.inter_node.latency_s)
    assert axis_link((("dp", 48),), "dp", cluster) == Link(min(8 * nic, nvlink), cluster.inter_node.latency_s)
    assert axis_link((("dp", 6), ("tp", 8)), "dp", cluster) == cluster.inter_node
    assert axis_link((("pp", 6), ("tp", 8)), "pp", cluster, ring=False) == cluster.inter_node
    assert axis_link((("pp", 12), ("tp", 4)), "pp", cluster, ring=False) == cluster.inter_node
    # a split moving between dims over an axis of two whole nodes: the all-to-all sends through each rank's own NIC,
    # the gather the same shard would take instead runs eight rings
    wide, shape = (("tp", 16),), (64, 4096)
    src, dst = Layout(wide, (("tp",), ())), Layout(wide, ((), ("tp",)))
    nccl = Cluster.preset("2x8xA100-80G")
    moved = transition_bytes(src, dst, shape, 2, nccl.backend)
    gathered = transition_bytes(src, dst, shape, 2, nccl.backend, all_to_all=False)
    assert list(moved) == ["tp" + PAIRWISE] and list(gathered) == ["tp"]
    nic, rails = nccl.inter_node.bandwidth_bytes_per_s, min(8 * nic, nccl.intra_node.bandwidth_bytes_per_s)
    assert comm_seconds(moved, wide, nccl)[0] == pytest.approx(moved["tp" + PAIRWISE] / nic)
    assert comm_seconds(gathered, wide, nccl)[0] == pytest.approx(gathered["tp"] / rails)


@pytest.mark.parametrize("name", ["gpt:layers=2,hidden=4096,heads=32,seq=2048,vocab=32000", "hf:llama-3-8b"])
def test_a_program_on_fewer_ranks_of_an_axis_bounds_one_on_more(name):  # wide enough that their plans split ops
    model = models.build(name, "meta")
    gm = capture(model, model.example_inputs(1))
    bounded = 0
    for k0, k in [(4, 8), (4, 16), (8, 16), (2, 16)]:
        costs = _Costs(gm, Cluster.preset("16x2xA100-80G"), ("dp",), 64, float("inf"))  # tp=4 and up span nodes
        costs.terms((("tp", k0),), "none", "none")  # the only program built
        for rows in (1, 8):
            bound = costs.divisor_bound((("tp", k),), "none", rows, float("inf"))
            exact = solve(gm, (("tp", k),), costs.bounds, rows, float("inf"), precision=costs.narrowest)
            assert bound <= exact.lower_bound_s * (1 + 1e-9), (k0, k, rows)
            assert k0 > 2 or bound == 0  # tp=2 rides the node's link, tp=16 the slower one between nodes
            bounded += bound > 0.45 * exact.lower_bound_s
    assert bounded, "no program bounded another: the test checks nothing"


def test_a_program_bounds_another_only_where_it_offers_every_strategy_the_other_does():
    model = models.build("gpt:layers=2,hidden=768,heads=12,seq=128,vocab=512", "meta")  # 12 heads split 4, not 16 ways
    gm = capture(model, model.example_inputs(1))
    four, sixteen = (enumerated(gm, (("tp", k),), None) for k in (4, 16))
    assert covers(four, sixteen) and not covers(sixteen, four)
    costs = _Costs(gm, Cluster.preset("16x2xA100-80G"), ("dp",), 64, float("inf"))
    costs.terms((("tp", 16),), "none", "none")
    assert costs.divisor_bound((("tp", 32),), "none", 4, float("inf")) > 0
    assert costs.divisor_bound((("tp", 8),), "none", 4, float("inf")) == 0  # fewer ranks: no bound from more


def test_no_program_bounds_another_where_a_smaller_product_may_run_nearer_peak():
    model = models.build("gpt:layers=2,hidden=768,heads=12,seq=128,vocab=512", "meta")
    gm = capture(model, model.example_inputs(1))
    dipping = dataclasses.replace(Cluster.preset("16x2xA100-80G"), matmul_depth_shares=((64, 0.9), (4096, 0.6)))
    assert not dipping.shares_grow_with_size
    costs = _Costs(gm, dipping, ("dp",), 64, float("inf"))
    costs.terms((("tp", 16),), "none", "none")
    assert costs.divisor_bound((("tp", 32),), "none", 4, float("inf")) == 0


@pytest.mark.parametrize("name,meshes,raised", [
    ("gpt:layers=4,hidden=4096,heads=32,seq=2048,vocab=32000",
     ["pp=2,dp=2,tp=2", "pp=2,dp=1,tp=4", "pp=4,dp=1,tp=2"], 1.3),
    ("hf:llama-3-8b", ["pp=4,dp=1,tp=2"], 1.05),
])
def test_a_pipelines_bound_without_a_program_of_its_own_is_below_what_it_costs(name, meshes, raised):
    """At the schedule where it waits least, a pipeline whose operators split k ways takes no less than the
    unsplit program's bound / k per micro-batch, (m + (p-1)/v) / p times over: the split, costed alone on 8 A100s
    at 8 rows a step, never beats it, and it says more than the unsplit bound at rows / p where few rows leave a
    bubble (wide ops, whose time grows with their rows)."""
    model = models.build(name, "meta")
    costs = _Costs(capture(model, model.example_inputs(1)), _cluster("8xA100-80G"), ("dp",), 8, float("inf"))
    gains = []
    for text in meshes:
        fixed = Fixed.parse(text)
        mesh, rows = (("pp", fixed.pp), ("dp", fixed.dp), ("tp", fixed.tp)), 8 // fixed.dp
        bound = costs.pipelined_bound("none", mesh, rows, fixed.tp)
        _, alone = _search(name, "8xA100-80G", 8, fixed)
        costed = [c.step_s for c in alone if not c.pruned]
        assert costed and 0 < bound <= min(costed) * (1 + 1e-9), text
        gains.append(bound / (costs.unsplit_bound("none", rows / fixed.pp, float("inf")) / fixed.tp))
    assert max(gains) > raised, gains


@pytest.mark.parametrize("config,cluster", [
    ("dp=32,tp=1,zero=0", "32x1xA100-80G"), ("dp=32,tp=1,zero=3", "32x1xA100-80G"),
    ("dp=16,tp=2,zero=2", "4x8xA100-80G"), ("dp=8,tp=4,zero=2", "4x8xA100-80G")])
def test_a_whole_splits_bound_hides_no_more_traffic_than_backward_does(config, cluster):
    """Without a pipeline, gradient traffic hides only beside backward (level 3: forward too), so a split whose
    program takes at least the unsplit bound / k is bounded by what stays exposed then: never above what it costs
    alone on 32 A100s at one row per replica (and 2-4 where tp splits), and at dp=32 over nodes of one GPU (one
    NIC a ring), where the traffic is three times the compute, well above the bound that hides all of it (which
    still pays what backward loses beside it)."""
    name = "gpt:layers=4,hidden=4096,heads=32,seq=2048,vocab=32000"
    model = models.build(name, "meta")
    fixed = Fixed.parse(f"{config},pp=1")
    costs = _Costs(capture(model, model.example_inputs(1)), _cluster(cluster), ("dp",), 32, float("inf"),
                   fixed=fixed)
    mesh = (("dp", fixed.dp), ("tp", fixed.tp))
    least = costs.unsplit_bound("none", 32 // fixed.dp, float("inf")) / fixed.tp
    bound = costs.whole_bound(mesh, "none", "none", least)
    _, alone = _search(name, cluster, 32, fixed)
    costed = [c.step_s for c in alone if not c.pruned]
    assert costed and bound <= min(costed) * (1 + 1e-9)
    assert bound > (1.5 if fixed.dp == 32 else 1.1) * (least + costs.floor(mesh, "none"))


def test_the_first_split_tried_holds_its_parameter_state_unsharded():
    """The first split sets the incumbent the rest are pruned against: of those whose operator axes fill a node,
    the shallowest pipeline whose ranks hold their share of the weights, gradients and optimizer state unsharded
    (12 to 16 bytes a parameter in mixed precision: the limit below holds them on 4 stages of tp=8, not on 2)."""
    model = models.build("gpt:layers=8,hidden=1024,heads=16,seq=128,vocab=512", "meta")
    gm = capture(model, model.example_inputs(1))
    numel = sum(p.numel() for p in gm.parameters())
    meshes = mesh_candidates(32, 8, 8)
    tight = _Costs(gm, Cluster.preset("4x8xA100-80G"), ("dp",), 64, 0.6 * numel)
    assert tight.order(meshes)[0] == (("pp", 4), ("dp", 1), ("tp", 8))
    loose = _Costs(gm, Cluster.preset("4x8xA100-80G"), ("dp",), 64, float("inf"))
    assert loose.order(meshes)[0] == (("dp", 4), ("tp", 8))
