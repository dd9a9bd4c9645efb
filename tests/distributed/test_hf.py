"""transformers models as written (tiny configs, random init) on 4 gloo ranks vs one device: every
parallel mode, the loss the model computes itself, 3 AdamW steps in float64."""

from functools import partial

import pytest

pytest.importorskip("transformers", reason="the [hf] extra (part of [dev]) is not installed")

from polyshard.models import hf  # noqa: E402
from tests.distributed import hf_cases  # noqa: E402

TOL = 1e-5
MODES = {
    "dp": ("dp=4", {}),
    "tp": ("tp=4", {}),
    "dp_tp": ("dp=2,tp=2", {}),
    "search": ("dp=2,tp=2", {"search": True}),
    "pp_1f1b": ("dp=2,pp=2", {"micro_batches": 2}),
    "pp_tp_gpipe": ("pp=2,tp=2", {"micro_batches": 2, "schedule": "gpipe"}),
    "pp_interleaved": ("pp=2,dp=2", {"micro_batches": 2, "schedule": "interleaved", "virtual_stages": 2,
                                     "layers": 4}),
    "pp_stage_recompute": ("dp=2,pp=2", {"micro_batches": 2, "recompute": ("full", "none")}),
    "zero1": ("dp=4", {"zero": 1}),
    "zero2_tp": ("dp=2,tp=2", {"zero": 2}),
    "zero3": ("dp=4", {"zero": 3}),
    "recompute_full": ("tp=4", {"recompute": "full"}),
    "recompute_selective": ("dp=2,tp=2", {"recompute": "selective"}),
    "recompute_pointwise": ("dp=2,tp=2", {"recompute": "pointwise"}),
    "recompute_alternate": ("dp=2,tp=2", {"recompute": "alternate"}),
    "multi_copy": ("tp=4", {"copies": 2}),
    "sequence_parallel": ("dp=2,tp=2", {"sequence_parallel": True}),
}
# the model's own tensor-parallel plan as pins (GPT-2 carries none: its refusal is a unit test)
TP_PLAN = {"tp_plan": ("dp=2,tp=2", {"tp_plan": True}), "tp_plan_search": ("tp=4", {"tp_plan": True, "search": True})}


def _check(results):
    for r in results:
        assert r["loss_err"] < TOL and r["param_err"] < TOL and not r["missing"], r


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_gpt2_and_llama_in_every_mode(pools, family, mode):
    mesh, options = MODES[mode]
    _check(pools(4).run(partial(hf_cases.hf_parity, **options), mesh, family))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_stage_whose_tp_ranks_split_rows(pools, family):
    """A searched plan on pp=2 x tp=2 whose first chunk's tp ranks split rows (the model's weights whole there), the
    second's operators: rotary tables, masks and norms as transformers writes them on half of the rows each."""
    results = pools(4).run(partial(hf_cases.hf_parity, tp_split="rows/ops", m=2), "pp=2,tp=2", family)
    _check(results)
    assert results[0]["tp_split"] == ("rows", "ops")


def test_llama_split_by_all_reduces_alone_as_megatron_before_sequence_parallel(pools):
    """A plan searched with tp_comm=all_reduce where splitting every product pays (the free search there picks
    sequence parallel): the ranks' steps run no collective but all-reduces, besides gathering the logits the model
    returns (each rank's 2 rows x 8 positions x half the vocabulary, in float64), and train as one device does."""
    results = pools(4).run(partial(hf_cases.hf_parity, tp_comm="all_reduce", collectives=True), "dp=2,tp=2", "llama")
    _check(results)
    logits = 2 * 8 * hf.build("llama").config.vocab_size // 2 * 8
    for r in results:
        assert {kind for kind, _ in r["collectives"]} == {"all_reduce", "all_gather"}, r["collectives"]
        assert [b for kind, b in r["collectives"] if kind == "all_gather"] == [logits] * 3, r["collectives"]
    layouts = results[0]["layouts"]
    assert layouts["model.layers.0.self_attn.q_proj.weight"] == layouts["model.layers.0.mlp.up_proj.weight"] == "S(0)"
    assert layouts["model.layers.0.self_attn.o_proj.weight"] == layouts["model.layers.0.mlp.down_proj.weight"] == "S(1)"


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_token_table_split_by_features(pools, family):
    """The input embedding's features split over tp (GPT-2's tied head then runs row-parallel on them), its
    lookups handed on split into the sequence-parallel layers: as one device trains."""
    results = pools(4).run(partial(hf_cases.hf_parity, table_columns=2, sequence_parallel=True), "dp=2,tp=2", family)
    _check(results)
    table = next(v for k, v in results[0]["layouts"].items() if k.endswith(("wte.weight", "embed_tokens.weight")))
    assert table == "S(1)" and results[0]["sequence_parallel"]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("mesh,zero", [("dp=2,tp=2", None), ("dp=4", 3)])
def test_bf16_close_to_fp32(pools, family, mesh, zero):
    """bf16 compute over fp32 masters, SGD with momentum, against fp32 on one device: the GPT's bounds
    (tests/distributed/test_zero.py), 1e-2 in loss and 5e-2 in parameters."""
    for r in pools(4).run(partial(hf_cases.hf_parity, precision="bf16", zero=zero), mesh, family):
        assert 0 < r["loss_err"] < 1e-2 and r["param_err"] < 5e-2 and not r["missing"], r


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "phi3"])  # Phi-3's plan gathers its fused products' outputs
@pytest.mark.parametrize("mode", sorted(TP_PLAN))
def test_the_models_own_tp_plan_as_pins(pools, family, mode):
    mesh, options = TP_PLAN[mode]
    _check(pools(4).run(partial(hf_cases.hf_parity, **options), mesh, family))


@pytest.mark.parametrize("family", ["gemma", "gemma3"])
def test_gemmas_own_tp_plan_splits_its_scaled_embedding_by_rows(pools, family):
    """The Gemmas' embedding scales the rows it looks up in a forward of its own; their tp plan splits it by
    vocabulary rows as a plain Embedding, with the head tied to it (SGD: see test_families_under_sgd)."""
    results = pools(4).run(partial(hf_cases.hf_parity, tp_plan=True, optimizer="sgd"), "dp=2,tp=2", family)
    _check(results)
    assert results[0]["layouts"]["model.embed_tokens.weight"] == "S(0)", results[0]["layouts"]


@pytest.mark.parametrize("family,search", [("llama", False), ("gpt_neox", True)])
def test_the_models_own_pp_plan_as_stage_units(pools, family, search):
    """Four stages of a two-layer model: only the pipeline plan's units (embedding, each layer, final norm,
    head) make that many, so some stage begins at a module that is not a decoder layer."""
    results = pools(4).run(partial(hf_cases.hf_parity, pp_plan=True, search=search, micro_batches=2), "pp=4", family)
    _check(results)
    boundaries = results[0]["boundaries"]
    assert len(boundaries) == 3 and any(".layers." not in b for b in boundaries), boundaries


@pytest.mark.parametrize("family", ["qwen2", "mistral", "gpt_neox", "glm4"])
@pytest.mark.parametrize("mode", ["dp_tp", "pp_1f1b"])
def test_more_families(pools, family, mode):
    mesh, options = MODES[mode]
    _check(pools(4).run(partial(hf_cases.hf_parity, **options), mesh, family))


@pytest.mark.parametrize("family", ["opt", "phi3", "gemma"])
@pytest.mark.parametrize("mode", ["dp_tp", "pp_1f1b"])
def test_families_under_sgd(pools, family, mode):
    # transformers' causal-LM losses cast the logits to float32, so even a float64 run rounds there (a split
    # vocabulary sums in another order: 1e-7 of the loss, as for every family); AdamW turns that noise into
    # large differences of its steps where a gradient is near its eps: OPT's embedding rows, one of the tiny
    # Phi-3's down_proj entries (6e-9 in float64, against 6e-3 for the largest), and the tiny Gemma's o_proj
    # (2e-5 apart, its vocabulary split with the head tied to it). These run SGD with momentum.
    mesh, options = MODES[mode]
    _check(pools(4).run(partial(hf_cases.hf_parity, optimizer="sgd", **options), mesh, family))


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "gpt_bigcode", "gptj", "olmo2", "qwen2_moe"])
def test_more_architectures_under_sgd(pools, family):
    # what each adds is in hf.TINY's comments; SGD as above: AdamW turns the float32 rounding some of them add (Qwen3
    # rounds each head's q and k in its norms) into steps far apart where a gradient is near its eps
    results = pools(4).run(partial(hf_cases.hf_parity, optimizer="sgd"), "dp=2,tp=2", family)
    _check(results)
    split = [name for name, layout in results[0]["layouts"].items() if layout != "R" and ".0." in name]
    assert len(split) >= 2, results[0]["layouts"]  # the first layer's products at least split, not all run whole


def test_qwen3s_own_tp_plan_leaves_its_head_norms_whole_on_split_heads(pools):
    """Qwen3's plan keeps its per-head q and k norms whole on every rank, between the column- and row-parallel
    products (their gradients summed over the ranks): the rules' own layout there. SGD, as above."""
    result = pools(4).run(partial(hf_cases.hf_parity, tp_plan=True, optimizer="sgd"), "dp=2,tp=2", "qwen3")
    _check(result)
    layouts = result[0]["layouts"]
    assert layouts["model.layers.0.self_attn.q_proj.weight"] == "S(0)"
    assert layouts["model.layers.0.self_attn.q_norm.weight"] == "R"
    assert layouts["model.layers.0.self_attn.o_proj.weight"] == "S(1)"


def test_bloom_splits_its_alibi_attention_by_heads_as_megatron_does(pools):
    """BLOOM's attention over batch and heads merged into one dim (ALiBi's ``baddbmm``, then ``bmm``) runs on each
    rank's heads, and trains as one device does (SGD, as above)."""
    result = pools(4).run(partial(hf_cases.hf_parity, optimizer="sgd"), "dp=2,tp=2", "bloom")
    _check(result)
    layouts = result[0]["layouts"]
    assert layouts["transformer.h.0.self_attention.query_key_value.weight"] == "S(0)"
    assert layouts["transformer.h.0.self_attention.dense.weight"] == "S(1)"


def test_falcon_splits_its_written_out_products_as_megatron_does(pools):
    """Falcon's products written as `input @ weight.T`, its q/k/v fused by kv group and read by index, attention and
    MLP side by side on one input: each rank takes its kv group and half the MLP, and trains as one device does."""
    result = pools(4).run(hf_cases.hf_parity, "dp=2,tp=2", "falcon")
    _check(result)
    layouts = result[0]["layouts"]
    assert layouts["transformer.h.0.self_attention.query_key_value.weight"] == "S(0)"
    assert layouts["transformer.h.0.self_attention.dense.weight"] == "S(1)"
    assert layouts["transformer.h.0.mlp.dense_h_to_4h.weight"] == "S(0)"
    assert layouts["transformer.h.0.mlp.dense_4h_to_h.weight"] == "S(1)"


def test_sequence_parallel_reaches_llamas_rms_norms(pools):
    result = pools(4).run(partial(hf_cases.hf_parity, sequence_parallel=True), "dp=2,tp=2", "llama")[0]
    assert result["sequence_parallel"]  # row-parallel products reduce-scatter; RMSNorm runs on a slice


@pytest.mark.parametrize("family", ["olmo", "nemotron"])
def test_sequence_parallel_reaches_norms_written_as_calls(pools, family):
    """OLMo's LayerNorms without weights and Nemotron's that scale by weight + 1 are calls, not modules: under sequence
    parallel every norm after the first runs on each rank's slice of the sequence (Nemotron's weights summing their
    gradients over it), and the model trains as one device does."""
    results = pools(4).run(partial(hf_cases.hf_parity, sequence_parallel=True, optimizer="sgd"), "dp=2,tp=2", family)
    _check(results)
    norms = [layout for name, layout in results[0]["outputs"].items() if name.startswith("layer_norm")]
    assert norms == ["R"] + ["S(1)"] * (len(norms) - 1), norms


def test_tensor_parallel_splits_llama_as_megatron_does(pools):
    layouts = pools(4).run(hf_cases.hf_parity, "dp=2,tp=2", "llama")[0]["layouts"]
    assert layouts["model.layers.0.self_attn.q_proj.weight"] == "S(0)"   # column-parallel
    assert layouts["model.layers.0.self_attn.o_proj.weight"] == "S(1)"   # row-parallel
    assert layouts["model.layers.0.mlp.gate_proj.weight"] == "S(0)"
    assert layouts["model.layers.0.mlp.down_proj.weight"] == "S(1)"
    assert layouts["lm_head.weight"] == "S(0)"                          # vocabulary-parallel head and loss
