"""transformers' RMSNorms run fused: the same bits forward and backward, keeping only the input and each row's scale."""

import pytest
import torch

from polyshard.graph.capture import capture
from polyshard.graph.fused_norm import FusedRMSNorm, fused_eps

hf = pytest.importorskip("polyshard.models.hf", reason="the [hf] extra (part of [dev]) is not installed")


def _kept_bytes(fn, x) -> int:
    """Bytes of the distinct tensors autograd keeps for backward in ``fn(x)``, parameters aside."""
    kept: dict[int, int] = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter) and t.shape != x.shape[-1:]:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return sum(kept.values())


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("dtypes", [(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.float64,) * 2,
                                    (torch.bfloat16, torch.float32)], ids=["fp32", "bf16", "fp64", "bf16-fp32"])
def test_a_transformers_rms_norm_and_its_fused_twin_agree_to_the_bit(family, dtypes):
    x_dtype, w_dtype = dtypes
    norm = next(m for m in hf.build(family).modules() if type(m).__name__.endswith("RMSNorm")).to(w_dtype)
    features = norm.weight.shape[0]
    torch.manual_seed(0)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(features))
    fused = FusedRMSNorm(norm.weight, fused_eps(norm, features))
    x = torch.randn(3, 5, features).to(x_dtype).requires_grad_()
    grad = torch.randn(3, 5, features)
    results = []
    for module in (norm, fused):
        y = module(x)
        results.append((y, *torch.autograd.grad(y, (x, norm.weight), grad.to(y.dtype))))
    for theirs, ours in zip(*results):
        assert theirs.dtype == ours.dtype and torch.equal(theirs, ours)
    rows = 3 * 5
    kept = _kept_bytes(fused, x)
    assert kept == x.numel() * x.element_size() + rows * 4  # the input and a float32 scale a row
    assert _kept_bytes(norm, x) >= kept + x.numel() * 4  # at least one float32 copy more


def test_a_norm_of_other_arithmetic_runs_as_written():
    """Gemma scales by 1 + weight: its output differs from the fused norm's, so its capture calls its own class."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.head = GemmaRMSNorm(16), torch.nn.Linear(16, 4)

        def forward(self, x, y):
            return torch.nn.functional.cross_entropy(self.head(self.norm(x)), y)

    assert fused_eps(GemmaRMSNorm(16), 16) is None
    gm = capture(Model(), {"x": torch.randn(4, 16), "y": torch.randint(0, 4, (4,))})
    assert isinstance(gm.get_submodule("norm"), GemmaRMSNorm)


def test_a_llama_capture_runs_its_norms_fused_over_the_users_own_weights():
    """The program's norms are fused and hold the model's own Parameters; the model keeps its classes; a step of the
    program gives the model's loss and gradients."""
    model = hf.build("llama")
    batch = hf.batch(model, 2, 8)
    gm = capture(model, batch)
    norms = [n.target for n in gm.graph.nodes if n.op == "call_module" and n.target.endswith("norm")]
    assert len(norms) == 2 * model.config.num_hidden_layers + 1
    for path in norms:
        assert isinstance(gm.get_submodule(path), FusedRMSNorm)
        assert type(model.get_submodule(path)).__name__ == "LlamaRMSNorm"
        assert gm.get_submodule(path).weight is model.get_submodule(path).weight
    losses, grads = [], []
    for run in (lambda: model(**batch).loss, lambda: gm(**batch)[0]):
        model.zero_grad(set_to_none=True)
        loss = run()
        loss.backward()
        losses.append(loss.detach())
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_a_traced_models_rms_norm_runs_fused_at_every_row_count():
    """A model fx traces (a user's own, with transformers' Llama norm in it): its capture and the capture at more
    rows run the norm fused, and a step of either gives the model's loss and gradients to the bit."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from polyshard.graph.capture import at_rows

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.norm, self.head = torch.nn.Linear(8, 16), LlamaRMSNorm(16, eps=1e-5), torch.nn.Linear(16, 4)

        def forward(self, x):
            return self.head(self.norm(self.up(x))).square().mean()

    torch.manual_seed(0)
    model, x = Model(), torch.randn(4, 8)
    gm = capture(model, (x[:1],))
    wider = at_rows(model, gm, (x[:1],), 4)
    for program in (gm, wider):
        assert isinstance(program.get_submodule("norm"), FusedRMSNorm)
    assert isinstance(model.norm, LlamaRMSNorm)
    results = []
    for run in (model, wider):
        loss = run(x)
        results.append((loss, *torch.autograd.grad(loss, list(model.parameters()))))
    for theirs, ours in zip(*results):
        assert torch.equal(theirs, ours)


def test_a_norm_polyshard_was_told_of_runs_as_written():
    """A pinned norm keeps its class (and its pin) in the capture; the same class unpinned beside it is fused."""
    import polyshard as ps
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.head = LlamaRMSNorm(16), LlamaRMSNorm(16), torch.nn.Linear(16, 4)

        def forward(self, x):
            return self.head(self.b(self.a(x))).square().mean()

    model = Model()
    ps.shard(model.a, in_strategy=((1, 1),))
    gm = capture(model, (torch.randn(2, 16),))
    assert isinstance(gm.get_submodule("a"), LlamaRMSNorm) and isinstance(gm.get_submodule("b"), FusedRMSNorm)
