"""The planner's per-device memory estimate against memory measured in a real step, in one process."""

import dataclasses
import math
import tempfile

import pytest
import torch

import polyshard as ps
from polyshard import models
from polyshard.cluster import Cluster
from polyshard.graph.capture import capture
from polyshard.planner.cost.memory import estimate_memory
from polyshard.planner.propagate import propagate
from polyshard.planner.search import search
from polyshard.runtime.memory_probe import step_peak_bytes
from polyshard.train.trainer import make_optimizer

ROWS = 8


def _batch():
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randint(0, 256, (ROWS, 16), generator=g) for _ in range(2))


def _measure(plan=None, recompute="none", offload="none", name="gpt-tiny"):
    """(measured peak by category, the plan the step ran) for ``name`` under these settings."""
    ps.init()
    torch.manual_seed(0)
    pm = ps.parallelize(models.build(name), _batch(), plan=plan, recompute=None if plan else recompute)
    pm.plan = dataclasses.replace(pm.plan, offload=plan.offload if plan else offload)
    with tempfile.TemporaryDirectory() as folder:
        opt = make_optimizer(pm, 1e-3, folder)
        return step_peak_bytes(pm, opt, _batch(), state_on_device=pm.plan.offload == "none",
                               micro_batches=pm.plan.micro_batches), pm.plan


def _estimate(plan, name="gpt-tiny"):
    return estimate_memory(capture(models.build(name, "meta"), _batch()), plan)


def _estimate_at(plan, rows):
    """The estimate at ``rows`` rows per micro-batch, as the search makes it (captured at one row)."""
    meta = models.build("gpt-tiny", "meta")
    return estimate_memory(capture(meta, meta.example_inputs(1)), plan, rows=rows)


@pytest.mark.parametrize("recompute,offload", [("none", "none"), ("selective", "none"), ("pointwise", "none"),
                                               ("alternate", "none"), ("half", "none"), ("full", "none"),
                                               ("none", "host"), ("none", "disk"), ("full", "disk")])
def test_estimate_is_within_15_percent_of_the_measured_peak(recompute, offload):
    measured, plan = _measure(recompute=recompute, offload=offload)
    estimate = _estimate(plan)
    assert abs(estimate.total_bytes / measured["total"] - 1) <= 0.15, (estimate, measured)
    assert (measured["optstate"] == 0) == (offload != "none") == (estimate.optimizer_bytes == 0)


# attention written out: its two batched products are kept by pointwise and alternate alike, and alternate's count
# of products by a weight (the checkpoint policy's mm and addmm) passes over them
_MATH = "gpt:layers=2,hidden=32,heads=2,seq=16,vocab=256,attention=math"


@pytest.mark.parametrize("recompute,name", [("none", "gpt-tiny"), ("pointwise", "gpt-tiny"), ("alternate", "gpt-tiny"),
                                            ("pointwise", _MATH), ("alternate", _MATH)])
def test_activations_estimate_is_within_5_percent_of_the_measured_peak(recompute, name):
    # pointwise recompute keeps the products' and attention's outputs, alternate half the products by a weight:
    # what that frees must show in both
    measured, plan = _measure(recompute=recompute, name=name)
    assert abs(_estimate(plan, name).activations_bytes / measured["activation"] - 1) <= 0.05, measured


def test_full_recompute_keeps_at_most_40_percent_of_the_activations():
    plain, _ = _measure()
    full, _ = _measure(recompute="full")
    assert full["activation"] <= 0.4 * plain["activation"]


def test_under_a_limit_below_its_need_the_planner_makes_it_fit_and_it_does():
    plain, _ = _measure()
    limit = 0.75 * plain["total"]
    meta = models.build("gpt-tiny", "meta")
    plan, _ = search(meta, meta.example_inputs(1), Cluster.preset("cpu-gloo:1"), ROWS, limit, meshes=[(("dp", 1),)])
    assert (plan.recompute, plan.offload, plan.micro_batches) != ("none", "none", 1)
    measured, _ = _measure(plan=plan)
    assert measured["total"] <= limit, (plan.recompute, plan.offload, plan.micro_batches, measured, limit)


def test_accumulation_estimate_is_within_15_percent_of_the_measured_peak():
    plain, plan = _measure()
    accumulated, plan = _measure(plan=dataclasses.replace(plan, micro_batches=4))
    estimate = _estimate_at(plan, ROWS // 4)
    assert accumulated["total"] < plain["total"]
    assert abs(estimate.total_bytes / accumulated["total"] - 1) <= 0.15, (estimate, accumulated)


# transformers models as written, wide enough that layers, not the vocabulary, hold the memory
_SEQ = 128
_WIDE = {"llama": dict(hidden_size=64, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2),
         "qwen2": dict(hidden_size=64, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2),
         "gpt2": dict(n_embd=64, n_positions=_SEQ), "gpt_neox": dict(hidden_size=64, intermediate_size=256),
         "opt": dict(hidden_size=64, ffn_dim=256, word_embed_proj_dim=64)}


@pytest.mark.parametrize("family", sorted(_WIDE))
def test_transformers_estimate_is_within_15_percent_of_torch_measured_peak(family):
    """What a transformers model's captured program holds in a training step (torch's own AdamW, MemTracker)
    against the estimate of its capture: the activations autograd keeps (GQA's repeated keys, a norm's inside, not
    every op's output) and the gradients alive while each op's backward runs."""
    hf = pytest.importorskip("polyshard.models.hf", reason="the [hf] extra (part of [dev]) is not installed")
    pytest.importorskip("transformers")

    def build(device):
        torch.manual_seed(0)
        config = _WIDE[family] | ({} if family == "gpt2" else {"max_position_embeddings": _SEQ})
        return hf.CausalLM(hf.build(family, device=device, vocab_size=64, **config), _SEQ)

    g = torch.Generator().manual_seed(0)
    batch = tuple(torch.randint(0, 64, (4, _SEQ), generator=g) for _ in range(2))
    program = _Loss(capture(build("cpu"), batch))  # as it runs: Llama's RMSNorms fused
    measured = step_peak_bytes(program, torch.optim.AdamW(program.parameters()), batch)
    gm = capture(build("meta"), batch)
    estimate = estimate_memory(gm, propagate(gm, (), lambda _: None))
    total, kept = estimate.total_bytes / measured["total"], estimate.activations_bytes / measured["activation"]
    print(f"{family}: estimate / measured {total:.3f} (peak), {kept:.3f} (activations)")
    assert abs(total - 1) <= 0.15, (estimate, measured)
    assert abs(kept - 1) <= 0.3, (estimate, measured)


class _Loss(torch.nn.Module):
    """A captured program called as its model is: the loss, out of the program's flat outputs."""

    def __init__(self, gm):
        super().__init__()
        self.gm = gm

    def forward(self, *batch):
        return self.gm(*batch)[0]


def _saved_bytes(pm, batch) -> int:
    """Bytes of the distinct tensors autograd keeps for backward in one forward of ``pm``, parameters aside."""
    skip = {p.untyped_storage().data_ptr() for p in pm.parameters()}
    kept: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        pm(*batch)
    return sum(kept.values())


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_bf16_activations_count_the_float32_a_norm_keeps(family):
    """Under bf16 transformers' RMSNorm keeps a float32 copy of its input, which its captured call cannot show
    (GPT-NeoX's torch LayerNorm keeps bf16): the estimate of a bf16 step's kept activations is as close to what
    autograd keeps as the fp32 one's."""
    hf = pytest.importorskip("polyshard.models.hf", reason="the [hf] extra (part of [dev]) is not installed")
    ps.init()
    ratios = {}
    for precision in ("fp32", "bf16"):
        torch.manual_seed(0)
        config = _WIDE[family] | {"hidden_size": 256, "intermediate_size": 688, "max_position_embeddings": _SEQ}
        pm = ps.parallelize(hf.CausalLM(hf.build(family, vocab_size=256, **config), _SEQ), (batch := (
            torch.randint(0, 256, (4, _SEQ), generator=torch.Generator().manual_seed(0)),) * 2),
            settings={"precision": precision})
        with tempfile.TemporaryDirectory() as folder:
            make_optimizer(pm, 1e-3, folder)  # casts the parameters to bf16
            measured = _saved_bytes(pm, batch)
        meta = hf.CausalLM(hf.build(family, device="meta", vocab_size=256, **config), _SEQ)
        ratios[precision] = estimate_memory(capture(meta, batch), pm.plan).activations_bytes / measured
    print(f"{family}: estimate / kept activations {ratios}")
    assert abs(ratios["bf16"] - 1) <= 0.15 and abs(ratios["bf16"] - ratios["fp32"]) <= 0.03, ratios


def test_bf16_activations_count_the_float32_log_probabilities_the_loss_keeps():
    """Under bf16 the loss runs over its logits cast to float32 and keeps their float32 log-probabilities: with a
    vocabulary 256 times the width, most of what a step keeps; the estimate follows it as closely as in fp32."""
    ps.init()
    spec, g = "gpt:layers=1,hidden=32,heads=2,seq=32,vocab=8192", torch.Generator().manual_seed(0)
    batch = tuple(torch.randint(0, 8192, (8, 32), generator=g) for _ in range(2))
    ratios, measured = {}, {}
    for precision in ("fp32", "bf16"):
        torch.manual_seed(0)
        pm = ps.parallelize(models.build(spec), batch, settings={"precision": precision})
        with tempfile.TemporaryDirectory() as folder:
            make_optimizer(pm, 1e-3, folder)  # casts the parameters to bf16
            measured[precision] = _saved_bytes(pm, batch)
        ratios[precision] = estimate_memory(capture(models.build(spec, "meta"), batch), pm.plan).activations_bytes / \
            measured[precision]
    print(f"estimate / kept activations {ratios}, kept {measured}")
    assert measured["bf16"] > 0.9 * measured["fp32"]  # the log-probabilities are float32 in both
    assert abs(ratios["bf16"] - 1) <= 0.03 and abs(ratios["fp32"] - 1) <= 0.03, ratios


def test_a_python_norm_is_priced_by_the_passes_its_own_code_makes():
    """transformers' RMSNorm runs as several elementwise passes (and, in bf16, casts to float32 and back), where
    torch's LayerNorm is one kernel: the captured call keeps what running it measured, and the cost model reads it."""
    hf = pytest.importorskip("polyshard.models.hf", reason="the [hf] extra (part of [dev]) is not installed")
    from polyshard.graph.upcast import PROBED
    from polyshard.planner.cost.compute import TRAIN_FLOPS_PER_FORWARD, forward_bytes

    llama, neox = (hf.build(f) for f in ("llama", "gpt_neox"))
    norms = {}
    for model in (llama, neox):
        gm = capture(model, hf.batch(model, 2, 8))
        plan = propagate(gm, (), lambda _: None)
        modules = dict(gm.named_modules())
        norms[model] = [(n, plan.nodes[n.name], modules) for n in gm.graph.nodes
                        if n.op == "call_module" and "norm" in type(modules[n.target]).__name__.lower()]
    probed = norms[llama][0][0].meta[PROBED]
    full, half = probed.moved_bytes_full, probed.moved_bytes_half
    assert full >= 3 * 3 * 8 and half > full  # a one-kernel norm moves 8 bytes an element in float32 forward
    for node, entry, modules in norms[llama]:
        elements = math.prod(node.meta["tensor_meta"].shape)
        assert forward_bytes(node, entry, modules, 2) == pytest.approx(elements * half / TRAIN_FLOPS_PER_FORWARD,
                                                                       rel=0.01)
    assert norms[neox] and not any(PROBED in n.meta for n, _, _ in norms[neox])


def test_a_norm_that_will_not_run_in_bf16_on_the_cpu_keeps_its_graphs_figures():
    """The probe is a measurement, not a requirement: a norm it cannot run leaves the capture as it was."""

    class PickyRMSNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(16))

        def forward(self, x):
            if x.dtype == torch.bfloat16:
                raise RuntimeError("no bf16 kernel here")
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.head = PickyRMSNorm(), torch.nn.Linear(16, 4)

        def forward(self, x, y):
            return torch.nn.functional.cross_entropy(self.head(self.norm(x)), y)

    from polyshard.graph.saved import KEPT_INSIDE
    from polyshard.graph.upcast import PROBED

    gm = capture(Model(), {"x": torch.randn(4, 16), "y": torch.randint(0, 4, (4,))})  # keywords: torch.export
    (norm,) = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "norm"]
    assert KEPT_INSIDE in norm.meta and PROBED not in norm.meta
