"""Pipeline stages as the plan cuts them: the captured graph split into chunks at its stage boundaries,
and each chunk rebuilt as a graph of its own and lowered for the ranks of its stage.

A value a chunk needs from an earlier chunk becomes an edge (its local shape is known from the captured
graph, so no handshake is needed at run time); graph inputs are read from the batch; sizes and other
non-tensor values are computed again where they are used; a parameter used by two chunks is tied.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch
from torch import fx, nn
from torch.utils._pytree import tree_map

from polyshard.compiler.lower import lower
from polyshard.errors import PolyshardError
from polyshard.graph.capture import capture, shape_of
from polyshard.graph.stage_cuts import assign_chunks, check_boundary_count
from polyshard.mesh import Mesh
from polyshard.plan import NodePlan, Plan
from polyshard.schedule import check_schedule


@dataclass(frozen=True)
class Edge:
    """A value chunk ``src`` sends to chunk ``dst``: the producing node, this rank's piece's shape
    and dtype (what the receiver allocates), and whether a gradient goes back."""

    name: str
    src: int
    dst: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    grad: bool


@dataclass(frozen=True)
class Split:
    """A graph cut into chunks. inputs: per chunk, the graph inputs it reads (by position);
    copied: per chunk, the nodes of earlier chunks it computes again (sizes, attributes);
    edges: values sent between chunks; tied: each parameter used by several chunks, by chunk,
    with its name there; canonical: a parameter's name in the model for each name it goes by."""

    chunk_of: dict[str, int]
    inputs: tuple[tuple[int, ...], ...]
    copied: tuple[frozenset[str], ...]
    edges: tuple[Edge, ...]
    tied: dict[str, dict[int, str]]
    canonical: dict[str, str]
    loss_dtype: torch.dtype

    @property
    def chunks(self) -> int:
        return len(self.inputs)

    def received(self, chunk: int) -> list[int]:
        return [k for k, e in enumerate(self.edges) if e.dst == chunk]

    def sent(self, chunk: int) -> list[int]:
        return [k for k, e in enumerate(self.edges) if e.src == chunk]


def split_graph(gm: fx.GraphModule, plan: Plan, boundaries: Sequence[str]) -> Split:
    """Cut ``gm`` (laid out by ``plan``) before each boundary module."""
    chunk_of = assign_chunks(gm, boundaries)
    chunks = len(boundaries) + 1
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output, loss = nodes[-1], loss_node(gm)
    if loss is None:
        raise PolyshardError(f"pipeline stages need {type(gm).__name__}.forward to return the loss "
                             "(one 0-dim tensor), so the last stage can start backward from it")
    inputs, copied, received = [], [], []
    for c in range(chunks):
        own = [n for n in nodes if chunk_of.get(n.name) == c] + ([output] if c == chunks - 1 else [])
        needs = _external_needs(own, chunk_of, c)
        inputs.append(tuple(i for i, p in enumerate(placeholders) if p in needs))
        copied.append(frozenset(n.name for n in needs if n.op != "placeholder" and _recomputable(n)))
        received.append([n for n in nodes if n in needs and n.op != "placeholder" and not _recomputable(n)])
    edges = tuple(_edge(n, chunk_of[n.name], c, plan) for c, values in enumerate(received) for n in values)
    canonical, tied = _parameter_uses(gm, chunk_of, copied)
    return Split(chunk_of, tuple(inputs), tuple(copied), edges, tied, canonical, loss.meta["tensor_meta"].dtype)


def loss_node(gm: fx.GraphModule) -> fx.Node | None:
    """The value a pipeline trains on: the graph's output if a 0-dim tensor, else the first such among its
    outputs (a transformers model returns its loss with the logits, which stages do not hand on)."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    values = out if isinstance(out, (tuple, list)) else [out]
    return next((v for v in values if isinstance(v, fx.Node) and shape_of(v) == ()), None)


def _recomputable(node: fx.Node) -> bool:
    """Values a chunk computes again rather than receives: attributes, and sizes and other non-tensors."""
    return node.op == "get_attr" or (node.op in ("call_function", "call_method") and shape_of(node) is None)


def _external_needs(own: list[fx.Node], chunk_of: dict[str, int], c: int) -> set[fx.Node]:
    """The nodes outside chunk ``c`` its nodes read, with what the recomputed ones read in turn."""
    needs: set[fx.Node] = set()
    todo = [i for n in own for i in n.all_input_nodes if chunk_of.get(i.name) != c]
    while todo:
        n = todo.pop()
        if n in needs:
            continue
        needs.add(n)
        if n.op != "placeholder" and _recomputable(n):
            todo.extend(n.all_input_nodes)
        elif n.op != "placeholder" and shape_of(n) is None:
            raise PolyshardError(f"`{n.name}` ({n.target}) hands a non-tensor value from stage chunk "
                                 f"{chunk_of[n.name]} to chunk {c}; move the stage boundary so both are in one")
    return needs


def _edge(node: fx.Node, src: int, dst: int, plan: Plan) -> Edge:
    meta = node.meta["tensor_meta"]
    layout = plan.nodes[node.name].output
    return Edge(node.name, src, dst, tuple(layout.local_shape(meta.shape)), meta.dtype,
                bool(meta.requires_grad) and meta.dtype.is_floating_point)


def _parameter_uses(gm: fx.GraphModule, chunk_of: dict[str, int],
                    copied: list[frozenset[str]]) -> tuple[dict[str, str], dict[str, dict[int, str]]]:
    """Each parameter name's canonical name, and the parameters that several chunks use."""
    first = {id(p): name for name, p in reversed(list(gm.named_parameters()))}
    canonical = {name: first[id(p)] for name, p in gm.named_parameters(remove_duplicate=False)}
    uses: dict[str, dict[int, str]] = {}
    for node in gm.graph.nodes:
        users = {chunk_of[node.name]} if node.name in chunk_of else {c for c, names in enumerate(copied)
                                                                       if node.name in names}
        if node.op == "call_module":
            names = [f"{node.target}.{n}" for n, _ in gm.get_submodule(node.target).named_parameters()]
        else:
            names = [node.target] if node.op == "get_attr" and node.target in canonical else []
        for name, c in ((name, c) for name in names for c in users):
            uses.setdefault(canonical[name], {}).setdefault(c, name)
    return canonical, {name: by_chunk for name, by_chunk in uses.items() if len(by_chunk) > 1}


def build_chunk(gm: fx.GraphModule, plan: Plan, split: Split, c: int, mesh: Mesh) -> fx.GraphModule:
    """Chunk ``c`` lowered for this rank: ``(*graph inputs it reads, *values it receives)`` -> the
    values it sends (the last chunk: the loss)."""
    graph = fx.Graph()
    entries: dict[str, NodePlan] = {}
    env: dict[fx.Node, fx.Node] = {}
    nodes = {n.name: n for n in gm.graph.nodes}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i in split.inputs[c]:
        env[placeholders[i]] = graph.placeholder(placeholders[i].name)
        entries[env[placeholders[i]].name] = plan.nodes[placeholders[i].name]
    for k in split.received(c):
        name = split.edges[k].name
        env[nodes[name]] = graph.placeholder(name)
        entries[env[nodes[name]].name] = NodePlan("local", {}, plan.nodes[name].output)
    for node in gm.graph.nodes:
        if node.name in split.copied[c] or split.chunk_of.get(node.name) == c:
            env[node] = graph.node_copy(node, env.__getitem__)
            entries[env[node].name] = plan.nodes[node.name]
    if c == split.chunks - 1:
        out = graph.output(env[loss_node(gm)])
        entries[out.name] = plan.nodes["output"]
    else:
        out = graph.output(tuple(env[nodes[split.edges[k].name]] for k in split.sent(c)))
        entries[out.name] = NodePlan("local", {}, None)
    module = fx.GraphModule(gm, graph, class_name=f"{type(gm).__name__}Chunk{c}")
    params = {name: plan.params[split.canonical[name]] for name, _ in module.named_parameters()}
    return lower(module, replace(plan, nodes=entries, params=params), mesh)


def micro_batches(t: torch.Tensor, m: int) -> tuple[torch.Tensor, ...]:
    """``t``'s rows in ``m`` equal micro-batches."""
    if t.size(0) % m:
        raise PolyshardError(f"micro_batches={m} does not divide the batch of {t.size(0)} rows; "
                             f"use a batch that is a multiple of {m}")
    return t.chunk(m)


def pipeline_split(model: nn.Module, example_inputs: Sequence[torch.Tensor], plan: Plan,
                   pp: int) -> tuple[fx.GraphModule, Split]:
    """One micro-batch of ``model`` captured and cut into pp x virtual_stages chunks at the plan's stage
    boundaries. Needs no process group."""
    check_schedule(plan.schedule, pp, plan.micro_batches, plan.virtual_stages)
    if not plan.stage_boundaries:
        raise PolyshardError(f"the plan has no stage boundaries to cut pp={pp} stages at; make the plan with "
                             "polyshard.plan (it cuts balanced stages) or give its stage_boundaries")
    check_boundary_count(plan.stage_boundaries, pp, plan.virtual_stages)
    for name, per_chunk in (("stage_recompute", plan.stage_recompute), ("stage_tp_split", plan.stage_tp_split)):
        if per_chunk and len(per_chunk) != pp * plan.virtual_stages:
            raise PolyshardError(f"{name} gives {len(per_chunk)} modes {[str(m) for m in per_chunk]}; pp={pp} x "
                                 f"virtual_stages={plan.virtual_stages} makes {pp * plan.virtual_stages} chunks, "
                                 "one mode each")
    micro = tree_map(lambda t: micro_batches(t, plan.micro_batches)[0] if isinstance(t, torch.Tensor) else t,
                     example_inputs)
    gm = capture(model, micro)
    split = split_graph(gm, plan, plan.stage_boundaries)
    for name, by_chunk in split.tied.items():
        if len({c % pp for c in by_chunk}) < len(by_chunk):
            raise PolyshardError(f"parameter `{name}` is used by chunks {sorted(by_chunk)}, two of them on one "
                                 "stage; move the boundaries so each stage uses it in one chunk")
    return gm, split
