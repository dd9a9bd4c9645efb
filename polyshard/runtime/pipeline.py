"""Pipeline parallel: the captured graph cut into chunks at module boundaries; each rank lowers and
runs only its own chunks (tensor parallel inside its stage) under a schedule of micro-batches.

A value a chunk needs from an earlier chunk is sent rank to rank along ``pp`` (its local shape is
known from the captured graph, so no handshake); graph inputs are read from the batch every rank
is given; sizes and other non-tensor values are computed again where they are used. A parameter
used by two stages (a tied embedding) has a copy on each, whose gradients are summed every step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, replace
from typing import Sequence

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.utils._pytree import tree_map

from polyshard.cluster import Cluster
from polyshard.compiler.lower import lower, whole_parameter
from polyshard.errors import PolyshardError
from polyshard.graph.capture import capture, shape_of
from polyshard.graph.export import SIGNATURE_KEY, CallSignature
from polyshard.graph.regions import marked_modules
from polyshard.mesh import Mesh
from polyshard.planner.cost.compute import TRAIN_FLOPS_PER_FORWARD, forward_seconds, op_overhead
from polyshard.plan import DTYPES, NodePlan, Plan
from polyshard.planner.stages import assign_chunks, balanced_boundaries
from polyshard.runtime.data_parallel import DEFAULT_BUCKET_BYTES, GradientSync, Pausable
from polyshard.runtime.recompute import apply_recompute
from polyshard.runtime.schedules import Action, ActionTime, check_schedule, schedule_actions, simulate

STAGE_ATTR = "_polyshard_stage"


def pipeline_stage(module: nn.Module, k: int) -> nn.Module:
    """Mark ``module`` as the first of pipeline stage ``k`` (stages count from 0, so k >= 1);
    :func:`polyshard.parallelize` cuts the model there when the mesh has a ``pp`` axis."""
    if type(k) is not int or k < 1:
        raise PolyshardError(f"pipeline_stage(k={k!r}): k is the stage the module begins, an integer >= 1 "
                             "(stage 0 begins with the model)")
    setattr(module, STAGE_ATTR, k)
    return module


def stage_boundaries_of(model: nn.Module) -> tuple[str, ...]:
    """The module paths marked by :func:`pipeline_stage`, in stage order (empty when none)."""
    marks = {name: getattr(m, STAGE_ATTR) for name, m in model.named_modules() if hasattr(m, STAGE_ATTR)}
    if sorted(marks.values()) != list(range(1, len(marks) + 1)):
        raise PolyshardError(f"pipeline_stage marks {marks}: mark each of stages 1..{len(marks)} exactly once")
    return tuple(sorted(marks, key=marks.__getitem__))


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


def chunk_seconds(gm: fx.GraphModule, plan: Plan, split: Split, cluster: Cluster) -> tuple[list[float], list[float]]:
    """Predicted forward and backward seconds of each chunk: its ops' compute plus their fixed costs,
    backward doing the work twice over (as the cost model counts them)."""
    modules = dict(gm.named_modules())
    dtype, itemsize = DTYPES[plan.precision]
    back = TRAIN_FLOPS_PER_FORWARD - 1
    forward, backward = [0.0] * split.chunks, [0.0] * split.chunks
    for node in gm.graph.nodes:
        c = split.chunk_of.get(node.name)
        if c is not None:
            seconds, entry = forward_seconds(node, plan, modules, cluster, dtype, itemsize), plan.nodes[node.name]
            forward[c] += seconds + op_overhead(entry, cluster, 1)
            backward[c] += back * seconds + op_overhead(entry, cluster, back)
    return forward, backward


def micro_batches(t: torch.Tensor, m: int) -> tuple[torch.Tensor, ...]:
    """``t``'s rows in ``m`` equal micro-batches."""
    if t.size(0) % m:
        raise PolyshardError(f"micro_batches={m} does not divide the batch of {t.size(0)} rows; "
                             f"use a batch that is a multiple of {m}")
    return t.chunk(m)


class PipelineModule(nn.Module, Pausable):
    """This rank's chunks of a pipelined model. :meth:`train_step` runs a batch's forward and
    backward through the schedule (no optimizer step), so gradients land in ``.grad`` as on one device."""

    def local_batch(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's rows of a global batch (every rank passes the same global batch)."""
        return self.mesh.local_rows(*tensors)

    def __init__(self, chunks: dict[int, fx.GraphModule], split: Split, plan: Plan, mesh: Mesh,
                 seconds: tuple[list[float], list[float]], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 recompute_paths: dict[str, str] | None = None, signature: CallSignature | None = None):
        super().__init__()
        self.signature = signature  # how keyword calls map to the graph's inputs (captured by export)
        self.chunks = nn.ModuleDict({str(c): apply_recompute(m, plan.recompute, plan.recompute_comm, recompute_paths)
                                     for c, m in chunks.items()})
        self.split, self.plan, self.mesh, self.seconds = split, plan, mesh, seconds
        self._names = {id(p): split.canonical[n] for m in chunks.values() for n, p in m.named_parameters()}
        self.actions = schedule_actions(plan.schedule, mesh.pp, plan.micro_batches, plan.virtual_stages)[mesh.stage]
        self.data_group = mesh.data_group()
        self.grad_syncs = {c: GradientSync(list(m.parameters()), self.data_group, bucket_bytes)
                           for c, m in chunks.items()} if self.data_group is not None else {}
        self.tied = [(chunks[c].get_parameter(name), [mesh.stage_rank(k % mesh.pp) for k in sorted(by_chunk)])
                     for by_chunk in split.tied.values() for c, name in by_chunk.items() if c in chunks]
        self.pipe_group = mesh.axis_mesh(mesh.pipeline_axis).get_group()
        self.timings: list[ActionTime] = []
        self.zero = None  # the ZeroOptimizer syncing gradients instead of grad_syncs (see use_optimizer)

    def forward(self, *batch):
        raise PolyshardError("a pipelined model runs forward and backward together: call train_step(*batch)")

    @property
    def reads_batch(self) -> bool:
        """Whether this rank's chunks take any of the batch (inputs or labels); a middle stage's do not."""
        return any(self.split.inputs[int(c)] for c in self.chunks)

    def use_optimizer(self, zero, dtype: torch.dtype | None) -> None:
        """Hand gradient sync to ``zero`` (a ZeroOptimizer over this rank's chunks, see ``setup_zero``): it
        syncs each chunk in the chunk's last backward and scales the loss; values between stages travel in
        ``dtype`` (the compute dtype of mixed precision; None: as captured)."""
        for sync in self.grad_syncs.values():
            sync.remove()
        self.grad_syncs = {int(c): zero for c in self.chunks}
        self.zero = zero
        if dtype is not None:
            self.split = replace(self.split, edges=tuple(replace(e, dtype=dtype) if e.dtype.is_floating_point else e
                                                         for e in self.split.edges))

    def train_step(self, *batch: torch.Tensor, scale: float = 1.0, record: bool = False,
                   **keywords: torch.Tensor) -> torch.Tensor:
        """Forward and backward of this rank's batch in ``plan.micro_batches`` micro-batches; gradients
        of ``scale`` x the batch's mean loss are added to ``.grad``, then averaged over the data group
        and summed over tied copies (not in :meth:`no_sync`). Returns the mean loss on every stage.
        ``record``: keep each action's start and end in :attr:`timings`."""
        if self.signature is not None:  # called as the model is, e.g. train_step(input_ids=..., labels=...)
            batch = self.signature.flatten(batch, keywords)
        step = _Step(self, [micro_batches(t, self.plan.micro_batches) for t in batch], scale)
        if record:
            dist.barrier(group=self.pipe_group)
            self.timings, t0 = [], time.perf_counter()
        for a in self.actions:
            received = step.receive(a)
            start = time.perf_counter()  # the action's own time, not its wait for inputs
            (step.forward if a.kind == "F" else step.backward)(a.chunk, a.micro, received)
            if record:
                self.timings.append(ActionTime(self.mesh.stage, a.chunk, a.kind, a.micro, start - t0,
                                               time.perf_counter() - t0))
        step.wait_sends()
        if self.syncing:
            self._sum_tied()
        loss = (torch.stack(step.losses).sum() / self.plan.micro_batches if step.losses
                else torch.zeros((), dtype=self.split.loss_dtype))
        dist.broadcast(loss, src=self.mesh.stage_rank(self.mesh.pp - 1), group=self.pipe_group)
        return loss

    def _sum_tied(self) -> None:
        """Each tied parameter's gradient summed over its copies, in stage order (equal on every copy);
        under ZeRO the gradient of its master (its own bucket, laid out alike on every stage), which the step reads."""
        tag = 2 * len(self.split.edges) * self.plan.micro_batches  # after every schedule message's tag
        for i, (param, ranks) in enumerate(self.tied):
            p = self.zero.master_of(param) if self.zero is not None else param
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            peers = [r for r in ranks if r != self.mesh.rank]
            parts = {r: torch.empty_like(grad) for r in peers} | {self.mesh.rank: grad}
            works = ([dist.isend(grad, r, tag=tag + i) for r in peers]
                     + [dist.irecv(parts[r], r, tag=tag + i) for r in peers])
            for w in works:
                w.wait()
            p.grad = torch.stack([parts[r] for r in ranks]).sum(0)

    def local_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's piece of each of its stages' parameters, by its name in the plan."""
        return {self._names[id(p)]: p for p in self.parameters()}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every stage's parameters whole (split ones gathered), on every rank, by their names in the plan."""
        mine = {name: whole_parameter(p, name, self.plan, self.mesh) for name, p in self.local_parameters().items()}
        stages = [None] * self.mesh.pp
        dist.all_gather_object(stages, mine, group=self.pipe_group)
        return {k: v for part in stages for k, v in part.items()}

    def predicted_timings(self) -> list[ActionTime]:
        """The schedule simulated with the cost model's per-chunk times (what :attr:`timings` predicts)."""
        actions = schedule_actions(self.plan.schedule, self.mesh.pp, self.plan.micro_batches, self.plan.virtual_stages)
        return simulate(actions, *self.seconds)

    def gather_timings(self) -> list[ActionTime] | None:
        """The recorded :attr:`timings` of every stage of this rank's pipeline, on its first stage
        (rank 0 gets its own pipeline's); None on the others. Every rank calls it."""
        parts = [None] * self.mesh.pp if self.mesh.stage == 0 else None
        dist.gather_object(self.timings, parts, dst=self.mesh.stage_rank(0), group=self.pipe_group)
        return [t for part in parts for t in part] if parts is not None else None


class _Step:
    """One train_step's state: each micro-batch's chunk inputs and outputs kept for backward,
    values passed between chunks of this rank, sends in flight, losses."""

    def __init__(self, pm: PipelineModule, batch: list[tuple[torch.Tensor, ...]], scale: float):
        self.pm, self.batch, self.scale = pm, batch, scale
        self.kept: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self.local: dict[tuple[int, int, bool], torch.Tensor] = {}
        self.sends: list[tuple[object, torch.Tensor]] = []
        self.losses: list[torch.Tensor] = []

    def receive(self, a: Action) -> list[torch.Tensor]:
        """What ``a`` needs from other chunks, once it is here: their values for a forward, the
        gradients of this chunk's outputs for a backward."""
        split = self.pm.split
        if a.kind == "F":
            return [self._recv(k, a.micro, grad=False) for k in split.received(a.chunk)]
        return [self._recv(k, a.micro, grad=True) for k in split.sent(a.chunk) if split.edges[k].grad]

    def forward(self, c: int, i: int, received: list[torch.Tensor]) -> None:
        split = self.pm.split
        out = self.pm.chunks[str(c)](*(self.batch[j][i] for j in split.inputs[c]), *received)
        if c == split.chunks - 1:
            self.losses.append(out.detach().to(split.loss_dtype))
            zero = self.pm.zero
            out = ((zero.scale_loss(out) if zero is not None else out) * (self.scale / self.pm.plan.micro_batches),)
        else:
            for k, t in zip(split.sent(c), out):
                self._send(k, i, t, grad=False)
        self.kept[(c, i)] = (received, list(out))

    def backward(self, c: int, i: int, grads: list[torch.Tensor]) -> None:
        split, pm = self.pm.split, self.pm
        received, outs = self.kept.pop((c, i))
        if c == split.chunks - 1:
            pairs = [(outs[0], None)]
        else:
            pairs = list(zip([t for k, t in zip(split.sent(c), outs) if split.edges[k].grad], grads))
        sync = pm.syncing and i == pm.plan.micro_batches - 1  # all-reduce over dp during the chunk's last backward
        with contextlib.nullcontext() if sync or c not in pm.grad_syncs else pm.grad_syncs[c].no_sync():
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        for k, t in zip(split.received(c), received):
            if split.edges[k].grad:
                self._send(k, i, t.grad if t.grad is not None else torch.zeros_like(t), grad=True)

    def _peer(self, k: int) -> int | None:
        """The rank at the other end of edge ``k`` from this one (None: both chunks are this rank's)."""
        e, pp = self.pm.split.edges[k], self.pm.mesh.pp
        if e.src % pp == e.dst % pp:
            return None
        return self.pm.mesh.stage_rank((e.src if e.dst % pp == self.pm.mesh.stage else e.dst) % pp)

    def _tag(self, k: int, i: int, grad: bool) -> int:
        return (k * self.pm.plan.micro_batches + i) * 2 + grad

    def _send(self, k: int, i: int, t: torch.Tensor, grad: bool) -> None:
        if isinstance(t, AsyncCollectiveTensor):
            t = t.wait()
        t = t.detach().to(self.pm.split.edges[k].dtype).contiguous()  # a mask stays fp32 under bf16
        peer = self._peer(k)
        if peer is None:
            self.local[(k, i, grad)] = t
        else:
            self.sends.append((dist.isend(t, peer, tag=self._tag(k, i, grad)), t))

    def _recv(self, k: int, i: int, grad: bool) -> torch.Tensor:
        e, peer = self.pm.split.edges[k], self._peer(k)
        if peer is None:
            t = self.local.pop((k, i, grad))
        else:
            t = torch.empty(e.shape, dtype=e.dtype)
            dist.recv(t, peer, tag=self._tag(k, i, grad))
        return t.requires_grad_() if e.grad and not grad else t

    def wait_sends(self) -> None:
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()


def pipeline_split(model: nn.Module, example_inputs: Sequence[torch.Tensor], plan: Plan,
                   pp: int) -> tuple[fx.GraphModule, Split, tuple[str, ...]]:
    """One micro-batch of ``model`` captured and cut into pp x virtual_stages chunks: at the plan's
    stage boundaries, else the modules marked by :func:`pipeline_stage`, else balanced ones; returns the
    cuts it made too. Needs no process group."""
    check_schedule(plan.schedule, pp, plan.micro_batches, plan.virtual_stages)
    micro = tree_map(lambda t: micro_batches(t, plan.micro_batches)[0] if isinstance(t, torch.Tensor) else t,
                     example_inputs)
    gm = capture(model, micro)
    chunks = pp * plan.virtual_stages
    boundaries = plan.stage_boundaries or stage_boundaries_of(model) or balanced_boundaries(gm, chunks, plan)
    if len(boundaries) != chunks - 1:
        raise PolyshardError(f"{len(boundaries)} stage boundaries {list(boundaries)} make {len(boundaries) + 1} "
                             f"stages; pp={pp} x virtual_stages={plan.virtual_stages} needs {chunks}, "
                             f"so {chunks - 1} boundaries")
    split = split_graph(gm, plan, boundaries)
    for name, by_chunk in split.tied.items():
        if len({c % pp for c in by_chunk}) < len(by_chunk):
            raise PolyshardError(f"parameter `{name}` is used by chunks {sorted(by_chunk)}, two of them on one "
                                 "stage; move the boundaries so each stage uses it in one chunk")
    return gm, split, tuple(boundaries)


def predict_timings(model: nn.Module, example_inputs: Sequence[torch.Tensor], plan: Plan, pp: int,
                    cluster: Cluster) -> list[ActionTime]:
    """The plan's schedule simulated with the cost model's per-chunk times, without any process
    (for planning and explaining; ``model`` may live on the meta device)."""
    gm, split, _ = pipeline_split(model, example_inputs, plan, pp)
    actions = schedule_actions(plan.schedule, pp, plan.micro_batches, plan.virtual_stages)
    return simulate(actions, *chunk_seconds(gm, plan, split, cluster))


def parallelize_pipeline(model: nn.Module, example_inputs: Sequence[torch.Tensor], plan: Plan, mesh: Mesh,
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> PipelineModule:
    """The pipeline path of :func:`polyshard.parallelize` (see :func:`pipeline_split` for the cuts);
    each rank builds only its own chunks."""
    if plan.copies != 1:
        raise PolyshardError(f"copies={plan.copies} (multi-copy interleave) does not combine with pipeline "
                             "stages; micro-batches already overlap the stages' work: use copies=1")
    gm, split, boundaries = pipeline_split(model, example_inputs, plan, mesh.pp)
    plan = dataclasses.replace(plan, stage_boundaries=boundaries)
    seconds = chunk_seconds(gm, plan, split, mesh.cluster or Cluster.from_env())
    mine = {c: build_chunk(gm, plan, split, c, mesh) for c in range(mesh.stage, split.chunks, mesh.pp)}
    return PipelineModule(mine, split, plan, mesh, seconds, bucket_bytes, marked_modules(model),
                          gm.meta.get(SIGNATURE_KEY))
