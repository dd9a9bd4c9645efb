"""Multi-copy parallel: the batch split into copies whose ops run in lock step, interleaved.

Every op runs for copy 0, then copy 1, ...; collectives are waited for only where their result
is first used, so while one copy's collective is in flight the next copy's compute runs.
Losses (0-dim outputs, taken as batch means) merge as a row-weighted mean; batched outputs concatenate.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.fx.node import map_arg
from torch.utils._pytree import tree_flatten, tree_unflatten

from polyshard.errors import PolyshardError


def split_batch(x: torch.Tensor, copies: int) -> tuple[torch.Tensor, ...]:
    """Rows of ``x`` in ``copies`` nearly equal parts (the first ones one row larger when uneven)."""
    if x.size(0) < copies:
        raise PolyshardError(f"a batch of {x.size(0)} rows cannot feed {copies} copies; use fewer copies")
    return torch.tensor_split(x, copies)


def merge_outputs(outputs: list, rows: list[int]):
    """One output from the copies': 0-dim tensors by row-weighted mean, others concatenated on dim 0."""
    flat = [tree_flatten(o) for o in outputs]
    total = sum(rows)
    merged = []
    for leaves in zip(*(f[0] for f in flat)):
        first = leaves[0]
        if isinstance(first, torch.Tensor) and first.ndim == 0:
            merged.append(sum(v * (r / total) for v, r in zip(leaves, rows)))
        elif isinstance(first, torch.Tensor):
            merged.append(torch.cat(leaves))
        else:
            merged.append(first)
    return tree_unflatten(merged, flat[0][1])


def interleave(gm: fx.GraphModule, copies: int) -> fx.GraphModule:
    """A module computing what ``gm`` does, on ``copies`` slices of its batched inputs, interleaved."""
    if copies < 1:
        raise PolyshardError(f"copies must be at least 1, got {copies}")
    if copies == 1:
        return gm
    graph = fx.Graph()
    envs: list[dict[fx.Node, fx.Node]] = [{} for _ in range(copies)]
    rows = None
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            parts = graph.call_function(split_batch, (graph.placeholder(node.name), copies))
            for c, env in enumerate(envs):
                env[node] = graph.call_function(operator.getitem, (parts, c))
            if rows is None:
                rows = [graph.call_method("size", (env[node], 0)) for env in envs]
        elif node.op == "output":
            outs = [map_arg(node.args[0], lambda n, env=env: env[n]) for env in envs]
            graph.output(graph.call_function(merge_outputs, (outs, rows)))
        else:
            for env in envs:
                env[node] = graph.node_copy(node, lambda n, env=env: env[n])
    return fx.GraphModule(gm, graph, class_name=f"{type(gm).__name__}x{copies}")
