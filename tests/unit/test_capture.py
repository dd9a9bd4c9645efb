"""Capture: shapes looked up for repeated ops equal the shapes torch's ShapeProp computes for every node."""

import copy
import dataclasses

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.shape_prop import ShapeProp

from polyshard import models
from polyshard.graph.capture import capture
from polyshard.graph.export import SIGNATURE_KEY


def _shapes(gm):
    return {n.name: n.meta.get("tensor_meta") for n in gm.graph.nodes}


def _reference(gm, inputs, fake: bool):
    """The same graph again, every node computed by torch's own ShapeProp."""
    plain = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    for n in plain.graph.nodes:
        n.meta.pop("tensor_meta", None)
    if fake:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        ShapeProp(plain, fake_mode=mode).propagate(*[mode.from_tensor(t) for t in inputs])
    else:
        ShapeProp(plain).propagate(*[t.to("meta") for t in inputs])
    return _shapes(plain)


class _Heads(nn.Module):
    """Same module type on the same input, different output widths: a shape looked up from the wrong one would show."""

    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList(nn.Sequential(nn.Linear(8, w), nn.LayerNorm(w), nn.GELU()) for w in (16, 16, 32))

    def forward(self, x):
        return sum(head(x).view(x.size(0), 2, -1).sum() for head in self.heads)


def test_repeated_blocks_get_the_shapes_shape_prop_computes():
    cfg = dataclasses.replace(models.CONFIGS["gpt-tiny"], num_layers=6)
    meta = models.GPT(cfg).to("meta")
    inputs = meta.example_inputs(3)
    gm = capture(meta, inputs)
    assert _shapes(gm) == _reference(gm, inputs, fake=False)
    real = models.GPT(cfg)
    gm = capture(real, inputs)
    assert _shapes(gm) == _reference(gm, inputs, fake=True)


def test_modules_of_different_widths_are_not_mistaken_for_each_other():
    model, x = _Heads(), torch.randn(2, 8)
    gm = capture(model, (x,))
    assert _shapes(gm) == _reference(gm, (x,), fake=True)
    assert gm.graph.find_nodes(op="call_module", target="heads.2.0")[0].meta["tensor_meta"].shape == (2, 32)


class _Sums(nn.Module):
    """``+=`` into a product's own result, and into a view of another."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        y = self.a(x)
        y += self.b(x)  # nothing else reads y's old value: the same as y + b(x)
        z = self.b(y)
        flat = z.view(-1)
        flat += 1  # writes into z through the view: stays a write
        return z.sum()


class _MergedHeads(nn.Module):
    """ALiBi attention as BLOOM writes it: batch and heads merged into one dim for ``baddbmm`` and ``bmm``, the
    per-head table (H, 1, S) repeated for each row, or one per row (B, H, S) from a padding mask, and cast to the
    compute dtype; ``scores_too`` also returns the merged scores, a use the 4-D form cannot stand in for."""

    def __init__(self, scores_too: bool = False):
        super().__init__()
        self.scores_too = scores_too

    def forward(self, q, k, v, table):  # q, k, v: (B, H, S, D); table: float32
        b, h, s, d = q.shape
        bias = table.repeat(b, 1, 1) if table.shape[0] == h else table.reshape(b * h, 1, s)
        scores = bias.to(q.dtype).baddbmm(q.reshape(b * h, s, d), k.reshape(b * h, s, d).transpose(-1, -2),
                                          beta=1.0, alpha=0.5)
        probs = scores.view(b, h, s, s).softmax(-1)
        out = torch.bmm(probs.view(b * h, s, s), v.reshape(b * h, s, d)).view(b, h, s, d)
        return (out, scores.sum()) if self.scores_too else out


_PRODUCTS = (torch.ops.aten.matmul.default, torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default)


def test_attention_over_merged_batch_and_heads_is_captured_on_its_4d_values():
    """No layout can name heads split inside a merged batch x heads dim, so capture runs such attention on the 4-D
    values (as ``matmul``, which splits by heads like any attention), computing what the model computes; where a
    merged value has another use, its products stay as written."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 4, 6, 2, generator=g, dtype=torch.float64) for _ in range(3))
    for table, scores_too, left in (((4, 1, 6), False, []), ((3, 4, 6), False, []),
                                    ((4, 1, 6), True, [torch.ops.aten.baddbmm.default])):
        inputs = {"q": q, "k": k, "v": v, "table": torch.randn(*table, generator=g)}
        model = _MergedHeads(scores_too)
        gm = capture(model, inputs)
        products = [n.target for n in gm.graph.nodes if n.target in _PRODUCTS]
        assert products == left + [torch.ops.aten.matmul.default] * (2 - len(left)), products
        signature = gm.meta[SIGNATURE_KEY]
        torch.testing.assert_close(signature.unflatten(gm(*signature.flatten((), inputs))), model(**inputs))


def test_a_sum_written_in_place_into_a_result_nothing_else_reads_is_captured_as_a_plain_sum():
    """Export keeps a model's ``+=``; a split op hands its result on as a view of its piece, which autograd will not
    let the next op write into, so capture writes it as ``+`` where that computes the same."""
    model, x = _Sums(), torch.randn(3, 4)
    gm = capture(model, {"x": x})  # keywords: exported
    adds = [n.target for n in gm.graph.nodes if n.op == "call_function" and "add" in str(n.target)]
    assert adds == [torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor]
    signature = gm.meta[SIGNATURE_KEY]
    torch.testing.assert_close(signature.unflatten(gm(*signature.flatten((), {"x": x}))), model(x), rtol=0, atol=0)
