"""transformers' causal masks, materialized when traced, become ``is_causal`` attention where they are the
triangle, and stay where they are not: a sliding window narrower than the sequence, or a padding mask the
caller passes."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers", reason="the [hf] extra (part of [dev]) is not installed")

from polyshard.graph.capture import capture  # noqa: E402
from polyshard.graph.export import SIGNATURE_KEY  # noqa: E402
from polyshard.graph.ops import op_key  # noqa: E402
from polyshard.models import hf  # noqa: E402


def _attention_calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and op_key(n) is F.scaled_dot_product_attention]


def _masked(call) -> bool:
    return len(call.args) > 3 or "attn_mask" in call.kwargs


def _same_loss(model, gm, batch):
    """The captured program's loss is the model's own."""
    signature = gm.meta[SIGNATURE_KEY]
    args, kwargs = (), batch
    got = signature.unflatten(gm(*signature.flatten(args, kwargs))).loss
    torch.testing.assert_close(got, model(**batch).loss, rtol=1e-12, atol=0)


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "mistral", "gpt_neox", "opt"])
def test_a_causal_mask_built_from_shapes_becomes_is_causal(family):
    model = hf.build(family, torch.float64)
    batch = hf.batch(model, 2, 8)
    gm = capture(model, batch)
    calls = _attention_calls(gm)
    assert calls and all(c.kwargs.get("is_causal") and not _masked(c) for c in calls)
    _same_loss(model, gm, batch)


def test_a_sliding_window_narrower_than_the_sequence_stays_a_mask():
    model = hf.build("mistral", torch.float64, sliding_window=4)
    batch = hf.batch(model, 2, 8)
    gm = capture(model, batch)
    assert all(_masked(c) and not c.kwargs.get("is_causal") for c in _attention_calls(gm))
    _same_loss(model, gm, batch)


def test_a_padding_mask_from_the_caller_stays_a_mask():
    model = hf.build("llama", torch.float64)
    batch = hf.batch(model, 2, 8) | {"attention_mask": torch.ones(2, 8, dtype=torch.long)}
    gm = capture(model, batch)
    assert all(_masked(c) for c in _attention_calls(gm))
    batch["attention_mask"][0, :3] = 0  # the program reads the values it is given
    _same_loss(model, gm, batch)
