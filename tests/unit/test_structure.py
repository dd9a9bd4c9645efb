"""An exported capture reused for a model of the same structure: the same graph, over the new model's own weights;
anything the structure key cannot read, or that differs, exports afresh."""

import pytest
import torch
from torch import nn

pytest.importorskip("transformers", reason="the [hf] extra (part of [dev]) is not installed")

from polyshard.graph import export  # noqa: E402
from polyshard.graph.capture import capture, is_leaf  # noqa: E402
from polyshard.graph.export import SIGNATURE_KEY  # noqa: E402
from polyshard.graph.structure import structure_key  # noqa: E402
from polyshard.models import hf  # noqa: E402


@pytest.fixture
def exports(monkeypatch):
    """The calls to torch.export this test makes, from a process that has captured nothing yet."""
    calls = []
    real = torch.export.export

    def counted(*args, **kwargs):
        calls.append(type(args[0]).__name__)
        return real(*args, **kwargs)

    monkeypatch.setattr(export, "_KEPT", type(export._KEPT)())
    monkeypatch.setattr(torch.export, "export", counted)
    return calls


def _nodes(gm) -> list:
    return [(n.op, str(n.target), n.name, getattr(n.meta.get("tensor_meta"), "shape", None)) for n in gm.graph.nodes]


def _built(family: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return hf.build(family, torch.float64)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_second_model_of_one_structure_runs_its_own_weights_on_the_first_ones_graph(family, exports):
    first, second = _built(family, 0), _built(family, 1)
    capture(first, hf.batch(first, 2, 8))
    assert exports and (done := len(exports))
    reused = {rows: capture(second, hf.batch(second, rows, 8)) for rows in (2, 3, 1)}
    assert len(exports) == done  # no export for the second model, at any rows

    export._KEPT.clear()
    for rows, gm in reused.items():
        assert _nodes(gm) == _nodes(capture(second, hf.batch(second, rows, 8)))  # as its own export records it
    batch = hf.batch(second, 3, 8, seed=1)
    signature = reused[2].meta[SIGNATURE_KEY]
    out = signature.unflatten(reused[2](*signature.flatten((), batch)))
    ref = second(**batch)
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)
    torch.testing.assert_close(out.loss, ref.loss, rtol=0, atol=0)
    assert not torch.allclose(first(**batch).logits, ref.logits)  # the second model's weights, not the first's


def test_a_model_unlike_the_first_is_exported_afresh(exports):
    first = _built("gpt2", 0)
    capture(first, hf.batch(first, 2, 8))
    done = len(exports)
    for other in (_built("gpt2", 0).eval(),  # dropout traced out
                  hf.build("gpt2", torch.float64, n_layer=3),  # another config
                  hf.build("gpt2", torch.float32)):  # another dtype
        capture(other, hf.batch(other, 2, 8))
        assert len(exports) > done, other
        done = len(exports)
    capture(first, hf.batch(first, 2, 7))  # another sequence length
    assert len(exports) > done


def test_a_config_setting_outside_its_fields_makes_another_structure(exports):
    """A transformers config is a dataclass that keeps its attention and experts implementations outside its fields:
    a model alike but for one of them exports its own graph, not the first one's."""
    first = hf.build("llama", torch.float64)
    graph = capture(first, hf.batch(first, 2, 8))
    done = len(exports)
    eager = hf.build("llama", torch.float64, attn_implementation="eager")
    other = capture(eager, hf.batch(eager, 2, 8))
    assert len(exports) > done
    fused = [[n for n in gm.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
             for gm in (graph, other)]
    assert fused[0] and not fused[1]  # eager attention: its products and softmax written out


def test_what_the_key_cannot_read_is_exported_every_time(exports):
    hooked = _built("gpt2", 0)
    hooked.transformer.h[0].mlp.register_forward_hook(lambda module, args, out: out * 2)
    held = _built("gpt2", 0)
    held.transformer.h[0].attn.scale_table = torch.ones(4)  # a plain tensor: export may bake its values in
    for model in (hooked, held):
        batch = hf.batch(model, 2, 8)
        assert structure_key(model, (), batch, is_leaf, batched=True) is None
        for _ in range(2):
            done = len(exports)
            capture(model, batch)
            assert len(exports) > done


def test_the_key_follows_the_inputs_and_pins():
    model = _built("llama", 0)
    key = lambda m, b, batched=True: structure_key(m, (), b, is_leaf, batched)  # noqa: E731
    assert key(model, hf.batch(model, 2, 8)) == key(_built("llama", 5), hf.batch(model, 4, 8))  # rows left out
    assert key(model, hf.batch(model, 2, 8), batched=False) != key(model, hf.batch(model, 4, 8), batched=False)
    assert key(model, hf.batch(model, 2, 8)) != key(model, {"input_ids": hf.batch(model, 2, 8)["input_ids"]})
    pinned = _built("llama", 0)
    pinned.model.layers[0].mlp.pinned_here = True  # an attribute the forward may read
    assert key(pinned, hf.batch(model, 2, 8)) != key(model, hf.batch(model, 2, 8))
