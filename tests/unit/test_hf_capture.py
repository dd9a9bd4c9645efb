"""transformers models captured as written: every op ruled, leaf modules whole, errors that say where."""

import pytest
import torch
from torch import nn

pytest.importorskip("transformers", reason="the [hf] extra (part of [dev]) is not installed")

from polyshard.cluster import Cluster  # noqa: E402
from polyshard.errors import PolyshardError  # noqa: E402
from polyshard.graph.capture import capture  # noqa: E402
from polyshard.graph.export import SIGNATURE_KEY  # noqa: E402
from polyshard import models  # noqa: E402
from polyshard.models import hf  # noqa: E402
from polyshard.planner.candidates import candidates  # noqa: E402
from polyshard.planner.config import Fixed  # noqa: E402
from polyshard.planner.cost.comm import node_comm_bytes  # noqa: E402
from polyshard.planner.propagate import propagate  # noqa: E402
from polyshard.planner.report import render  # noqa: E402
from polyshard.planner.search import search  # noqa: E402
from polyshard.planner.stages import pp_plan_units  # noqa: E402
from tests.unit.embedding_cases import ShiftedEmbedding  # noqa: E402


def _unruled(gm) -> list[str]:
    warnings: list[str] = []
    propagate(gm, (("tp", 2),), warnings.append)
    return [w for w in warnings if w.startswith("no sharding rule")]


@pytest.mark.parametrize("family", sorted(hf.TINY))
def test_every_family_is_captured_and_counted(family):
    model = hf.build(family)
    gm = capture(model, hf.batch(model, 2, 8))
    unruled = _unruled(gm)
    print(f"{family}: {len(unruled)} op kinds replicated for want of a rule {unruled}")
    assert unruled == []
    linears = sum(isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D" for m in model.modules())
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert len(calls) >= linears  # each projection is one call the rules see whole


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma"])  # Gemma's embedding: one call that scales
def test_captured_graph_computes_the_models_own_output(family):
    torch.manual_seed(0)
    model = hf.build(family, torch.float64)
    batch = hf.batch(model, 3, 8, seed=1)
    gm = capture(model, hf.batch(model, 2, 8))  # the batch dim stays symbolic: any rows run
    signature = gm.meta[SIGNATURE_KEY]
    out = signature.unflatten(gm(*signature.flatten((), batch)))
    ref = model(**batch)
    assert type(out) is type(ref)
    torch.testing.assert_close(out.loss, ref.loss, rtol=0, atol=0)
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)


def test_one_row_capture_names_nodes_as_the_full_batch_does():
    model = hf.build("gpt2")
    names = [[n.name for n in capture(model, hf.batch(model, rows, 8)).graph.nodes] for rows in (1, 4)]
    assert names[0] == names[1]  # the search plans on one row, the runtime lowers the rank's batch


@pytest.mark.parametrize("family", sorted(hf.TINY))
def test_a_capture_on_meta_is_the_graph_a_run_captures(family):
    """`polyshard plan` captures on meta, a run on its device, and a plan names nodes: one graph either way, though
    attention returns another memory layout on meta (a `.contiguous()` traced on one device only)."""
    graphs = []
    for device in ("meta", "cpu"):
        model = models.build(f"hf:{family}", device=device)
        graphs.append([(n.name, n.op, n.target) for n in capture(model, model.example_inputs(2)).graph.nodes])
    assert graphs[0] == graphs[1]


def test_a_call_unlike_the_capture_is_refused():
    model = hf.build("llama")
    gm = capture(model, hf.batch(model, 2, 8))
    with pytest.raises(PolyshardError, match="captured with"):
        gm.meta[SIGNATURE_KEY].flatten((), {"input_ids": torch.zeros(2, 8, dtype=torch.long)})


def test_real_size_config_captures_on_meta_without_weights():
    model = hf.build("llama-3-8b", device="meta", num_hidden_layers=2)
    ids = torch.zeros(1, 128, dtype=torch.long, device="meta")
    gm = capture(model, {"input_ids": ids, "labels": ids})
    assert all(p.device.type == "meta" for p in model.parameters())
    assert _unruled(gm) == []


@pytest.mark.parametrize("name,billions", [("llama-2-13b", 13), ("llama-2-70b", 69), ("llama-3-8b", 8),
                                           ("llama-3-70b", 70), ("llama-3.1-405b", 405), ("bloom-176b", 176),
                                           ("mixtral-8x7b", 47), ("qwen1.5-moe-a2.7b", 14.3)])
def test_shipped_real_sizes_count_the_parameters_their_makers_give(name, billions):
    """The Llama 2 paper's 13B and 69B (its Table 1's "70B"), Llama 3's 8B, 70B and 405B, BLOOM's 176B, Mixtral
    8x7B's 47B (Jiang et al. 2024) and Qwen1.5-MoE-A2.7B's 14.3B (Qwen's release) parameters, within 1B (the FLOPs
    bench_published.py counts its rows by)."""
    assert models.config(f"hf:{name}", 2048).num_params() / 1e9 == pytest.approx(billions, abs=1.0)


@pytest.mark.parametrize("name,billions", [("mixtral-8x7b", 12.9), ("qwen1.5-moe-a2.7b", 2.7), ("llama-3-8b", 8.0)])
def test_model_flops_count_the_parameters_a_token_passes_through(name, billions):
    """A mixture of experts' token meets its top-k experts only: Mixtral 8x7B's 12.9B active parameters (of 47B;
    Jiang et al. 2024) and Qwen1.5-MoE-A2.7B's 2.7B (of 14.3B), within 0.1B; a dense model's are all of them. The
    reports' model TFLOP/s count 6 FLOPs per active parameter and token."""
    cfg = models.config(f"hf:{name}", 2048)
    assert cfg.active_params() / 1e9 == pytest.approx(billions, abs=0.1)
    attention = 12 * cfg.num_layers * cfg.hidden * 2048
    assert models.flops_per_token(cfg) == 6 * cfg.active_params() + attention


class _BranchesOnValues(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, **kwargs):
        if self.fc(x).sum() > 0:  # control flow on a tensor's value
            return x.sum()
        return -x.sum()


def test_uncapturable_code_gets_one_error_naming_its_line():
    with pytest.raises(PolyshardError, match=r"could not capture _BranchesOnValues at .*test_hf_capture.py:\d+"):
        capture(_BranchesOnValues(), {"x": torch.randn(2, 4)})


def test_unknown_hf_spec_lists_what_is_known(tmp_path):
    with pytest.raises(PolyshardError, match="llama-3-70b"):
        hf.build("no-such-model")
    bad = tmp_path / "config.json"
    bad.write_text("{}")
    with pytest.raises(PolyshardError, match="model_type"):
        hf.build(str(bad))


def test_tp_plan_styles_become_pins_over_the_operator_axes():
    from polyshard.pin import tp_plan_pins

    plan = {"lm_head": "colwise_gather_output", "model.layers.*.mlp.up_proj": "colwise",
            "model.layers.*.mlp.down_proj": "rowwise", "model.embed_tokens": "embedding_rowwise",
            "model.layers.*.self_attn.q_norm": "replicated_with_grad_allreduce"}
    calls = {"lm_head": 3, "model.layers.0.mlp.up_proj": 3, "model.layers.1.mlp.down_proj": 3,
             "model.embed_tokens": 2, "model.layers.0.self_attn.q_proj": 3, "model.layers.0.self_attn.q_norm": 4}
    pins = tp_plan_pins(plan, calls, ("tp",))
    assert pins["model.layers.0.mlp.up_proj"].in_strategy == ((None, None, None), ("tp", None))
    assert pins["model.layers.1.mlp.down_proj"].in_strategy == ((None, None, "tp"), (None, "tp"))
    assert pins["lm_head"].out_strategy == (None, None, None)  # its output gathered
    assert pins["model.embed_tokens"].in_strategy == ((None, None), ("tp", None))
    assert "model.layers.0.self_attn.q_proj" not in pins
    assert "model.layers.0.self_attn.q_norm" not in pins  # kept whole on split heads, as the rules keep it
    with pytest.raises(PolyshardError, match="sequence_parallel_x"):
        tp_plan_pins({"lm_head": "sequence_parallel_x"}, calls, ("tp",))


def test_the_trainers_wrapper_pins_and_reports_its_models_tp_plan():
    """polyshard's causal-LM wrapper holds the transformers model one level down: its tp plan is found there, in
    the wrapper's module paths, pinned for the search, and the pick's report counts the modules that follow it."""
    from polyshard.pin import model_tp_plan
    from polyshard.planner.plan_model import pin_tp_plan

    model = models.build("hf:llama", device="meta")
    plan = model_tp_plan(model)
    assert plan["model.model.layers.*.self_attn.q_proj"] == "colwise" and "model.lm_head" in plan
    row = model.example_inputs(1)
    pin_tp_plan(model, capture(model, row), ("tp",))
    picked, _ = search(model, row, Cluster.preset("cpu-gloo:2"), 4, fixed=Fixed.parse("tp=2"))
    q, o = (picked.params[f"model.model.layers.0.self_attn.{n}.weight"] for n in ("q_proj", "o_proj"))
    assert q.describe() == "tp=2:S(0)" and o.describe() == "tp=2:S(1)", (q.describe(), o.describe())
    agreement = picked.report["tp_plan"]
    assert agreement["modules"] == agreement["followed"] > 0 and not agreement["departures"]


def test_tp_plan_on_a_model_without_one_is_refused():
    import polyshard as ps
    from polyshard.mesh import Mesh

    model = hf.build("gpt2")
    with pytest.raises(PolyshardError, match="carries no tensor-parallel plan"):
        ps.parallelize(model, example_inputs=hf.batch(model, 2, 8), mesh=Mesh((("tp", 2),), ("dp",), "cpu", 0),
                       tp_plan=True)


def test_a_directory_with_safetensors_loads_its_weights(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(3)
    saved = hf.build("llama")
    saved.config.to_json_file(str(tmp_path / "config.json"))
    save_file({k: v.contiguous() for k, v in saved.state_dict().items()}, str(tmp_path / "model.safetensors"))
    loaded = hf.build(str(tmp_path))
    for name, p in saved.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], p), name


# Megatron's layout, as transformers' Llama plan spells it: q/k/v, gate and up split by output rows, o and down by
# input columns, the embedding by vocabulary rows (written out here, not read from polyshard.pin)
LLAMA_SPLIT_DIM = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0, "o_proj": 1, "down_proj": 1,
                   "embed_tokens": 0, "lm_head": 0}


# At the real size all but one follow it: the embedding, split by features, hands its lookups on with no partial
# sums to reduce (gathered for the first norm, an all-to-all into the sequence split for the residual).
@pytest.mark.parametrize("size,cluster,followed", [("real", "8xA100-80G", 15), ("tiny", "cpu-gloo:4", 0)])
def test_the_report_says_where_the_plan_follows_the_models_tp_plan(size, cluster, followed):
    from polyshard.cluster import Cluster
    from polyshard.planner.config import Fixed
    from polyshard.planner.report import render
    from polyshard.planner.search import search

    dims = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=16, num_key_value_heads=16,
                vocab_size=32000) if size == "real" else {}
    model = hf.build("llama", device="meta", **dims)
    plan, _ = search(model, hf.batch(model, 1, 512 if dims else 8), Cluster.load(cluster), 64,
                     fixed=Fixed(tp=8 if dims else 4))
    agreement = plan.report["tp_plan"]
    assert (agreement["followed"], agreement["modules"]) == (followed, 16)  # 2 layers x 7, embedding, head
    if dims:
        assert agreement["departures"] == [["model.embed_tokens", "embedding_rowwise", "tp=8:S(1)"]]
    for name, layout in plan.params.items():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and module.split(".")[-1] in LLAMA_SPLIT_DIM:
            split = [bool(d) for d in layout.dims]
            follows = split == [i == LLAMA_SPLIT_DIM[module.split(".")[-1]] for i in range(len(split))]
            assert follows == (module not in {d[0] for d in agreement["departures"]}), (name, layout)
    assert f"followed by {followed} of 16 modules" in render(plan, layouts=0)


def test_the_pipeline_plan_names_each_layer_and_the_modules_around_them():
    model = hf.build("llama")
    gm = capture(model, hf.batch(model, 2, 8))
    assert pp_plan_units(model, gm) == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm",
                                        "lm_head"]
    gpt2 = hf.build("gpt2")
    with pytest.raises(PolyshardError, match="carries no pipeline plan"):
        pp_plan_units(gpt2, capture(gpt2, hf.batch(gpt2, 2, 8)))


@pytest.mark.parametrize("pp_plan", [False, True])
def test_the_report_says_where_the_cuts_stand_against_the_pipeline_plan(pp_plan):
    model = hf.build("llama", num_hidden_layers=4)
    plan, _ = search(model, hf.batch(model, 1, 8), Cluster.load("cpu-gloo:4"), 8, fixed=Fixed.parse("pp=4"),
                     pp_plan=pp_plan)
    report = plan.report["pp_plan"]
    assert report["cuts"] == list(plan.stage_boundaries) and report["departures"] == []
    assert report["not_considered"] == ([] if pp_plan else ["model.norm", "lm_head"])
    assert "the model's pipeline plan (_pp_plan): stages begin at" in render(plan)


def test_a_returned_value_is_moved_to_the_outputs_layout_once():
    """Llama returns its logits whole: a loss that takes them whole shares that one gather (lowering inserts
    one redistribution per value and layout), so where collectives are slow the search gathers once and
    computes a plain loss, as torch's own plan for the model does, and charges the gather once. (Its vocabulary
    is wider than its hidden size, as real models' are: split by rows instead, the head would all-reduce the logits
    and gather only the hidden size's gradient, which at equal widths costs the same.)"""
    model = hf.build("llama", hidden_size=256, intermediate_size=688, num_attention_heads=8, num_key_value_heads=4,
                     max_position_embeddings=128, vocab_size=1024)
    row = hf.batch(model, 1, 128)
    plan, _ = search(model, row, Cluster.load("cpu-gloo:2"), 8, meshes=[(("tp", 2),)])
    gm = capture(model, row)
    head = next(n for n in gm.graph.nodes if n.target == "lm_head")
    whole = plan.nodes["output"].inputs["lm_head"]
    assert plan.nodes["lm_head"].output != whole  # split over the vocabulary by the head
    assert all(plan.nodes[u.name].inputs[head.name] == whole for u in head.users)
    modules = dict(gm.named_modules())
    charged = [node_comm_bytes(u, plan, modules, 4, "gloo") for u in head.users]
    assert sum(1 for c in charged if c) == 1


class _TiedShifted(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = ShiftedEmbedding(64, 16), nn.Linear(16, 64, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.embed(ids))


def test_a_table_the_graph_reads_whole_keeps_its_tied_head_whole():
    """An embedding whose own forward does more than look up and scale is traced through, so the graph reads its
    table as a value, and the head is tied to that table: neither propagation nor any of the search's candidates
    may split the head's weight, which the graph would then read as if whole. The table keeps its own name."""
    axes = (("tp", 2),)
    gm = capture(_TiedShifted(), {"ids": torch.zeros(1, 8, dtype=torch.long)})  # keywords: the export path
    assert "embed" not in {n.target for n in gm.graph.nodes if n.op == "call_module"}
    plan = propagate(gm, axes, lambda msg: None)
    assert "embed.weight" in plan.params and "head.weight" not in plan.params
    assert plan.params["embed.weight"].is_replicated
    head = next(n.name for n in gm.graph.nodes if n.op == "call_module" and n.target == "head")
    options = [d.params["weight"] for d in candidates(gm, axes)[0][head]]
    assert options and all(w.is_replicated for w in options)
    llama = models.build("hf:llama", device="meta")
    llama_gm = capture(llama, llama.example_inputs(1))
    llama_head = next(n.name for n in llama_gm.graph.nodes if n.op == "call_module" and n.target.endswith("lm_head"))
    assert any(not d.params["weight"].is_replicated for d in candidates(llama_gm, axes)[0][llama_head])


def test_gemmas_scaled_embedding_is_one_lookup_and_its_tied_head_splits_by_the_vocabulary():
    """Gemma's embedding scales the rows it looks up, in a forward of its own: captured as one call, it splits as a
    lookup does, so the head tied to it splits by the vocabulary too, as the model's own tensor-parallel plan
    has it. OPT's positional embedding, which reads the attention mask, stays traced through."""
    model = models.build("hf:gemma", device="meta")
    gm = capture(model, model.example_inputs(1))
    assert "model.model.embed_tokens" in {n.target for n in gm.graph.nodes if n.op == "call_module"}
    plan = propagate(gm, (("tp", 2),), lambda msg: None)
    table = plan.params["model.model.embed_tokens.weight"]
    assert table.dims == (("tp",), ())
    head = next(n.name for n in gm.graph.nodes if n.op == "call_module" and n.target.endswith("lm_head"))
    assert plan.nodes[head].params["weight"] == table
    opt = models.build("hf:opt", device="meta")
    traced = capture(opt, opt.example_inputs(1))
    assert "model.model.decoder.embed_positions" not in {n.target for n in traced.graph.nodes if n.op == "call_module"}


# Megatron's tensor parallel in a block whose q/k/v are one fused product: column-parallel products, then row-parallel
_MEGATRON_SPLIT = {"self_attention.query_key_value.weight": "S(0)", "self_attention.dense.weight": "S(1)",
                   "mlp.dense_h_to_4h.weight": "S(0)", "mlp.dense_4h_to_h.weight": "S(1)"}


def _searched_on_a100s(family: str, **config):
    """A 2048-wide member of ``family`` searched at tp=8 on a node of A100s: the plan, and how its first layer's
    products split their weights."""
    model = hf.build(family, device="meta", hidden_size=2048, vocab_size=32000, **config)
    plan, _ = search(model, hf.batch(model, 1, 512), Cluster.load("8xA100-80G"), 64, fixed=Fixed(tp=8))
    layer = "transformer.h.0."
    products = {name.removeprefix(layer): str(layout) for name, layout in plan.params.items()
                if name.startswith(layer) and name.endswith("weight") and layout.ndim == 2}
    return plan, products


def test_blooms_attention_over_merged_batch_and_heads_splits_by_heads_as_megatron_does():
    """BLOOM merges batch and heads for its ALiBi ``baddbmm`` and ``bmm``: captured on the 4-D values, the search on a
    node of A100s splits q/k/v by heads and the attention's output product by its input, as the MLP's."""
    assert _searched_on_a100s("bloom", n_head=16)[1] == _MEGATRON_SPLIT


def test_falcons_written_out_products_and_grouped_qkv_split_as_megatron_does():
    """Falcon writes each product as ``input @ weight.T`` and takes k and v out of q/k/v fused by kv group with an
    index: capture keeps each product one Linear call, and on a node of A100s the search splits q/k/v and the MLP's
    first product by their outputs (each rank its kv groups) and the products after them by their inputs."""
    plan, products = _searched_on_a100s("falcon", num_attention_heads=16, num_kv_heads=8)
    assert products == _MEGATRON_SPLIT
    for index in ("index", "index_1"):  # k and v read out of each rank's own kv groups: nothing gathered first
        assert next(iter(plan.nodes[index].inputs.values())).dims[2] == ("tp",), plan.nodes[index]


def test_a_squared_relu_mlp_splits_as_megatron_does():
    """Nemotron squares its MLP's ReLU (``torch.square``) between the column- and the row-parallel product: on a node
    of A100s each rank squares its own slice of the hidden features, nothing gathered in between."""
    model = hf.build("nemotron", device="meta", hidden_size=2048, intermediate_size=8192, vocab_size=32000,
                     num_attention_heads=16, num_key_value_heads=8, head_dim=128)
    plan, _ = search(model, hf.batch(model, 1, 512), Cluster.load("8xA100-80G"), 64, fixed=Fixed(tp=8))
    assert str(plan.params["model.layers.0.mlp.up_proj.weight"]) == "S(0)"
    assert str(plan.params["model.layers.0.mlp.down_proj.weight"]) == "S(1)"
    assert str(plan.nodes["square"].output) == "S(2)"


_MIXTRAL = dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)  # the tiny Llama's shape


@pytest.mark.parametrize("family,config", [("qwen2_moe", {}), ("llama", _MIXTRAL)])
def test_grouped_experts_are_ruled_and_count_each_rows_product(family, config):
    """transformers' default experts sort the token-expert pairs by expert and multiply each run of rows by its
    expert's matrices in grouped products: no op of theirs runs replicated for want of a rule, and the products count
    2 FLOPs a multiply-add, as the batched implementation's do: 2 x tokens x top-k x (hidden x 2 ffn + ffn x hidden)
    per layer (gate and up in one product, then down)."""
    from polyshard.graph.capture import is_product
    from polyshard.planner.cost.compute import forward_flops

    counted = {}
    for impl in ("grouped_mm", "batched_mm"):
        model = hf.build(family, experts_implementation=impl, **config)
        gm = capture(model, hf.batch(model, 2, 8))
        assert _unruled(gm) == []
        plan, modules = propagate(gm, (("tp", 1),), lambda _: None), dict(gm.named_modules())
        counted[impl] = sum(forward_flops(n, plan.nodes[n.name], modules) for n in gm.graph.nodes
                            if n.op == "call_function" and is_product(n, modules) and ".experts" in str(n.meta))
    cfg = model.config
    ffn = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    expected = cfg.num_hidden_layers * 2 * 16 * cfg.num_experts_per_tok * 3 * cfg.hidden_size * ffn
    assert counted == {"grouped_mm": expected, "batched_mm": expected}
