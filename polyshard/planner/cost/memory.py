"""Bytes one device holds for training: parameters, gradients, optimizer state, activations.

Activations are the values autograd keeps for backward (polyshard.graph.saved), at this rank's
share of the shapes. Recompute frees the outputs inside its regions; the largest region holds its
own again while its backward runs.
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass

from torch import fx, nn

from polyshard.graph.capture import shape_of
from polyshard.graph.params import parameters_of
from polyshard.graph.ops import CROSS_ENTROPY, LOSS_DTYPE, is_shape_op, op_name
from polyshard.graph.saved import KEPT_INSIDE, needs_grad, read_by_loss, saved
from polyshard.graph.upcast import kept_inside_half
from polyshard.graph.regions import Recomputed, recomputed
from polyshard.layout import Layout
from polyshard.planner.cost.zero_memory import state_bytes_per_rank
from polyshard.plan import Plan

STATES = {"adamw": 2, "lamb": 2, "sgd": 1}  # fp32 optimizer state tensors per parameter (SGD: momentum)

@dataclass(frozen=True)
class MemoryEstimate:
    """Per-device bytes: params_bytes, grads_bytes, optimizer_bytes (AdamW: two fp32 moments),
    activations_bytes (kept for backward), buffers_bytes (gradient buckets); offloaded_bytes
    (optimizer state kept on the host or disk instead: not in the total)."""

    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    buffers_bytes: float
    offloaded_bytes: float = 0.0
    # grads + activations less their peak together: backward frees activations as it makes grads
    # (negative when the gradients flowing through backward add more than that frees)
    apart_bytes: float = 0.0

    @property
    def total_bytes(self) -> float:
        return (self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes
                + self.buffers_bytes - self.apart_bytes)


def local_numel(shape, layout: Layout) -> float:
    return math.prod(shape) / layout.pieces


def param_numel(plan: Plan, name: str, shape) -> float:
    """Parameter ``name``'s elements on the rank holding most of it (a table split unevenly by rows: its
    tallest piece)."""
    rows = plan.row_splits.get(name)
    return max(rows) * math.prod(shape[1:]) if rows else local_numel(shape, plan.params[name])


def kept_copies(node: fx.Node, rc: Recomputed, itemsize: int = 4) -> float:
    """How many tensors of ``node``'s output size (at ``itemsize`` bytes an element) autograd keeps for it:
    its output if a backward reads it (or a recompute region keeps it for its rerun), plus what a module captured
    as one op keeps inside; none where recompute frees them (the largest region holds its own again)."""
    if node.name in rc.freed and node.name not in rc.held:
        return 0.0
    return with_cached(_kept(node, itemsize), node.name, rc)


def with_cached(copies: float, name: str, rc: Recomputed) -> float:
    """``copies`` kept of ``name``'s output, at least one where a recompute region keeps it for its rerun."""
    return max(copies, 1.0) if name in rc.cached else copies


def frees_activations(gm: fx.GraphModule, rc: Recomputed) -> bool:
    """Whether recompute ``rc`` leaves unkept an activation autograd would keep (one over views frees none)."""
    return any(_kept(n) for n in gm.graph.nodes if n.name in rc.freed)


def _kept(node: fx.Node, itemsize: int = 4) -> float:
    inside = node.meta.get(KEPT_INSIDE, 0.0)
    if itemsize < 4 and (half := kept_inside_half(node)) is not None:  # a norm keeping float32 copies
        inside = half
    copies = float(node.name in saved(node.graph))
    if copies and itemsize < LOSS_DTYPE.itemsize and read_by_loss(node):  # the loss keeps its log-probabilities
        copies = _loss_widening(itemsize)
    return max(copies + inside, 0.0)


def _loss_widening(itemsize: int) -> float:
    """Items of ``itemsize`` bytes a loss's value of one element takes (it runs in ``LOSS_DTYPE``)."""
    return max(LOSS_DTYPE.itemsize / itemsize, 1.0)


@dataclass(frozen=True)
class _Backward:
    """What :func:`backward_peaks` reads of a graph whatever the plan, nodes in reverse (backward's) order:
    each node's elements (None: not a tensor), the copies of its output autograd keeps, for an op with a
    backward the inputs whose gradients it makes (and whether the gradient of its log-probabilities is
    alive too), and the parameters of a module call."""

    order: tuple[str, ...]
    numel: dict[str, float | None]
    kept: dict[bool, dict[str, float]]  # by half precision or not
    grad_inputs: dict[str, tuple[tuple[str, ...], bool]]
    params: dict[str, tuple[tuple[str, nn.Parameter], ...]]
    position: dict[str, int]


_BACKWARD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per graph: every plan asks again


def _backward(gm: fx.GraphModule) -> _Backward:
    found = _BACKWARD.get(gm.graph)
    if found is None:
        owned = parameters_of(gm).owned
        nodes = list(gm.graph.nodes)
        numel = {n.name: (math.prod(shape) if (shape := shape_of(n)) is not None else None) for n in nodes}
        kept = {half: {n.name: copies for n in nodes if (copies := _kept(n, 2 if half else 4))}
                for half in (False, True)}
        grad_inputs = {n.name: (tuple(i.name for i in n.all_input_nodes if needs_grad(i)),
                                op_name(n) in CROSS_ENTROPY)
                       for n in nodes if not is_shape_op(n) and needs_grad(n)}
        params = {n.name: tuple((name, p) for _, name, p in owned[n.target]) for n in nodes if n.op == "call_module"}
        found = _BACKWARD[gm.graph] = _Backward(tuple(n.name for n in reversed(nodes)), numel, kept, grad_inputs,
                                                params, {n.name: i for i, n in enumerate(nodes)})
    return found


def _value_bytes(graph: _Backward, plan: Plan, itemsize: float):
    """A node's output bytes on one rank under ``plan`` (0 for a non-tensor), each asked for once."""
    @functools.cache
    def held(name: str) -> float:
        entry, numel = plan.nodes.get(name), graph.numel[name]
        ok = entry is not None and numel is not None and isinstance(entry.output, Layout)
        return numel / entry.output.pieces * itemsize if ok else 0.0
    return held


def gradient_transients(gm: fx.GraphModule, plan: Plan, itemsize: int = 4) -> dict[str, float]:
    """Per op with a backward, the gradient bytes alive while that backward runs, at one row: of its output
    and of its inputs (and of the loss's log-probabilities; the loss's in its own dtype)."""
    graph = _backward(gm)
    held = _value_bytes(graph, plan, itemsize)
    return {name: held(name) + sum(map(held, inputs)) * (2 * _loss_widening(itemsize) if through_log_probs else 1)
            for name, (inputs, through_log_probs) in graph.grad_inputs.items()}


def backward_peaks(gm: fx.GraphModule, plan: Plan, rc: Recomputed, rows: int = 1,
                   itemsize: int = 4, grad_share: float = 1.0) -> tuple[float, float]:
    """(most activation bytes alive at once, most activation plus gradient bytes alive at once).

    At the end of forward every kept output is alive and no gradient yet (they are set to None
    between steps). Backward walks the graph in reverse: each output is freed once its backward
    ran, each parameter's gradient appears there, and a recompute region brings its own outputs
    back while its backward runs. While an op's backward runs, the gradients of its output and of
    its inputs are alive too. Under gradient accumulation the last micro-batch's backward begins with
    every gradient made. ``grad_share``: the part of each parameter's gradient a rank keeps
    (optimizer parallel from level 2 reduce-scatters them as they come)."""
    graph = _backward(gm)
    held = _value_bytes(graph, plan, itemsize * rows)
    transient = {name: b * rows for name, b in gradient_transients(gm, plan, itemsize).items()}
    size, grads, seen = {}, {}, set()
    kept = graph.kept[itemsize < 4]
    for name in graph.order:
        if copies := with_cached(kept.get(name, 0.0), name, rc):
            size[name] = held(name) * copies
        for pname, p in graph.params.get(name, ()):
            if id(p) not in seen and pname in plan.params:
                seen.add(id(p))
                grads[name] = grads.get(name, 0.0) + param_numel(plan, pname, p.shape) * itemsize * grad_share
    last_of = {}  # a region's last node -> the bytes its recompute brings back
    for region in rc.regions:
        names = sorted((name for name in region if name in graph.position), key=graph.position.__getitem__)
        if names:
            last_of[names[-1]] = sum(size.get(n, 0.0) for n in names)
    alive = sum(b for name, b in size.items() if name not in rc.freed)
    made = sum(grads.values()) if plan.micro_batches > 1 else 0.0  # the earlier micro-batches' gradients
    act_peak = joint_peak = alive
    for name in graph.order:
        alive += last_of.get(name, 0.0)  # backward enters a region at its last node: recompute it
        act_peak, joint_peak = max(act_peak, alive), max(joint_peak, alive + made + transient.get(name, 0.0))
        alive -= size.get(name, 0.0)
        made += grads.get(name, 0.0)
    return act_peak, max(joint_peak, made)


def estimate_memory(gm: fx.GraphModule, plan: Plan, data_world: int = 1, rows: int = 1,
                    rc: Recomputed | None = None) -> MemoryEstimate:
    """The per-device memory of training ``gm`` under ``plan`` (captured at one row) on ``rows`` rows,
    over ``data_world`` data-parallel ranks: the plan's optimizer-parallel level, precision (half
    precision weights, gradients and activations over fp32 masters and state) and offload; ``rc``: the
    plan's recompute, where the caller has it."""
    itemsize = 4 if plan.precision == "fp32" else 2
    state_per_element = 4 * (STATES[plan.optimizer] + (plan.precision != "fp32"))  # fp32 moments and master
    listed = parameters_of(gm)
    params = dict(listed.named)
    units = [[param_numel(plan, name, p.shape) for _, name, p in listed.owned[n.target] if name in plan.params]
             for n in gm.graph.nodes if n.op == "call_module"]
    numel = sum(param_numel(plan, name, params[name].shape) for name in plan.params if name in params)
    held = state_bytes_per_rank([u for u in units if u] or [0], plan.zero, data_world, plan.zero_threshold_bytes,
                                itemsize, optimizer_states=1, bucket_bytes=plan.bucket_bytes,
                                accumulating=plan.micro_batches > 1, first_bucket_bytes=plan.first_bucket_bytes)
    scale = numel / max(sum(map(sum, units)), 1)  # parameters used outside modules (rare) count like the rest
    param_bytes, grad_bytes = held["params"] * scale, held["grads"] * scale
    state = held["optimizer"] / itemsize * state_per_element * scale
    rc = rc or recomputed(gm, plan.recompute, plan.recompute_comm)
    activations, together = backward_peaks(gm, plan, rc, rows, itemsize, grad_bytes / max(numel * itemsize, 1))
    buffers = min(plan.bucket_bytes, param_bytes) if data_world > 1 and plan.zero == 0 else 0.0
    on_device = state if plan.offload == "none" else 0.0
    return MemoryEstimate(param_bytes, grad_bytes, on_device, activations, buffers, state - on_device,
                          activations + grad_bytes - together)
