"""Capture with a stack of identical layers stamped from the second: node for node the full export."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from polyshard.graph.capture import is_leaf
from polyshard.graph import export
from polyshard.graph.export import export_graph
from polyshard.graph.stamp import Stack, find_stack, stamp
from polyshard.models import hf


def _fingerprint(gm: fx.GraphModule) -> list[tuple]:
    """Each node's op, target, inputs (by position), shape, grad flag and module path."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    out = []
    for n in nodes:
        meta = n.meta.get("tensor_meta")
        out.append((n.op, str(n.target), str(fx.node.map_arg((n.args, n.kwargs), lambda a: index[a])),
                    tuple(meta.shape) if hasattr(meta, "shape") else None, getattr(meta, "requires_grad", None),
                    tuple(path for path, _ in (n.meta.get("nn_module_stack") or {}).values())))
    return out


# Qwen2-MoE's grouped experts size their buffers by the batch's tokens: export records that size once, in layer 0,
# and every later layer reads it there
@pytest.mark.parametrize("family, config", [
    ("llama", {"num_hidden_layers": 4}), ("gpt2", {"n_layer": 4}), ("opt", {"num_hidden_layers": 4}),
    ("qwen2_moe", {"num_hidden_layers": 4, "experts_implementation": "grouped_mm"})])
def test_stamped_capture_is_the_full_export(family, config, monkeypatch):
    stamped = []
    monkeypatch.setattr(export, "stamp", lambda *a: stamped.append(stamp(*a)) or stamped[-1])
    model = hf.CausalLM(hf.build(family, **config), 16)
    assert find_stack(model).count == 4
    example = model.example_inputs(2)
    kept, full = (export_graph(model, example, {}, is_leaf, stamped=s) for s in (True, False))
    assert stamped == [True]  # layers 2 and 3 stamped, not exported whole after a failed check
    assert _fingerprint(kept) == _fingerprint(full)
    x = torch.randint(0, 256, (2, 16))
    assert kept(x, x)[0].item() == model(x, x).item()


class _Layer(nn.Module):
    def __init__(self, index: int, scale: float = 1.0) -> None:
        super().__init__()
        self.index, self.scale, self.fc = index, scale, nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x) * self.scale
        return y.relu() if self.index % 2 else y.tanh()  # odd layers differ from even ones


class _Net(nn.Module):
    def __init__(self, scales=(1.0,) * 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(i, s) for i, s in enumerate(scales))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_layers_with_other_settings_are_not_a_stack():
    assert find_stack(_Net(scales=(1.0, 1.0, 2.0, 1.0))) is None
    assert find_stack(_Net()) == Stack("layers", 4)


def test_layers_whose_graphs_differ_are_exported_whole():
    """Same settings but for the index, which the code branches on: layer 1 does not repeat layer 0, so
    nothing is stamped, and every layer keeps its own ops."""
    net = _Net()
    gm = export_graph(net, (torch.randn(2, 8),), {}, is_leaf)
    assert _fingerprint(gm) == _fingerprint(export_graph(net, (torch.randn(2, 8),), {}, is_leaf, stamped=False))
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.aten.relu.default) == 2 and ops.count(torch.ops.aten.tanh.default) == 2



def test_a_module_pinned_in_one_layer_stays_one_call():
    """A pin keeps its module one call (its strategy applies to it whole): layers alike but for one layer's pin are
    not a stack to stamp."""
    import polyshard as ps

    model = hf.CausalLM(hf.build("llama", num_hidden_layers=4), 16)
    ps.shard(model.model.model.layers[2].mlp, ((1, 1, 1),))
    gm = export_graph(model, model.example_inputs(2), {}, is_leaf)
    calls = [n.target for n in gm.graph.nodes if n.op == "call_module" and ".layers.2.mlp" in n.target]
    assert calls == ["model.model.layers.2.mlp"], calls
