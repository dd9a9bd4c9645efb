"""Capture: shapes looked up for repeated ops equal the shapes torch's ShapeProp computes for every node."""

import copy
import dataclasses

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.shape_prop import ShapeProp

from polyshard import models
from polyshard.graph.capture import capture


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
