"""Forward FLOPs and seconds each op takes on one rank, from its global shapes and the plan's layouts.

Matrix products count 2 FLOPs per multiply-add (nanoGPT's estimate_mfu convention); attention
counts its two products, 4*B*H*T*S*D; elementwise ops count one FLOP per output element.
Products run at the share of peak their contraction depths reach (``Cluster.matmul_share``); every
other op at the slower of its FLOPs at peak and the bytes it reads and writes over the memory
bandwidth (the roofline model: LayerNorm, GELU or a residual add are bound by memory, not FLOPs), and a
pointwise op with a transcendental function no faster than its elements at the rate measured for it
(``Cluster.pointwise_rate``: on CPUs bf16 GELU is bound by its arithmetic). Cross-entropy works through every
element of its logits, at the rate measured for its implementation, in the passes over memory that makes, in float32
whatever the precision (the runtime casts its logits up).
Training costs 3x forward (backward does two products per forward one, and reads and writes about
twice the bytes); an op that recompute runs again in backward costs one forward more. Fused
attention runs at its own share of peak (``Cluster.attention_share``, by head shape), and the optimizer step
is memory-bound.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F
from torch import fx, nn

from polyshard.graph.capture import GROUPED_PRODUCTS, is_product, linear_dims, shape_of
from polyshard.graph.ops import CROSS_ENTROPY, LOSS_DTYPE, is_shape_op, op_key, op_name
from polyshard.graph.upcast import moved_bytes
from polyshard.layout import Layout
from polyshard.cluster import Cluster
from polyshard.graph.regions import Recomputed
from polyshard.plan import NodePlan

TRAIN_FLOPS_PER_FORWARD = 3
_POINTWISE_MODULES = {nn.GELU: "gelu", nn.SiLU: "silu", nn.Tanh: "tanh", nn.Sigmoid: "sigmoid"}
# Each implementation of cross-entropy, by its plan's impl: the name it is measured under (Cluster.pointwise_rates,
# loss_overheads_s) and the passes over its logits it makes in training, in LOSS_DTYPE. torch's (any other impl):
# log-softmax reads the logits and writes log-probabilities; backward writes the loss's gradient of them, reads it
# and them, and writes the logits' gradient (an H100's profile: both softmax kernels stream at about 3 TB/s).
# Vocabulary-parallel (compiler.ops): the maximum, the shift, its exponentials, their sum and the softmax in forward
# (8), scaling and scaling again in backward (4).
_LOSSES = {"vocab_ce": ("vocab_parallel_cross_entropy", 12)}
_TORCH_LOSS = ("cross_entropy", 6)


def forward_flops(node: fx.Node, entry: NodePlan, modules: dict[str, nn.Module]) -> float:
    """FLOPs of ``node``'s forward on this rank under its strategy ``entry``."""
    shape = shape_of(node)
    out = computed_layout(node, entry, modules)
    if shape is None or not isinstance(out, Layout):
        return 0.0
    if op_name(node) in CROSS_ENTROPY:
        return _logits_elements(node, entry)
    local = math.prod(shape) / out.pieces
    if node.op == "call_module":
        module, order = modules[node.target], linear_dims(modules[node.target])
        if order is not None:
            weight = entry.params["weight"]
            return 2 * local * module.weight.shape[order[1]] / weight.num_shards(order[1])
        if isinstance(module, nn.Embedding):
            return 0.0
        if isinstance(module, nn.Conv2d):  # a multiply-add per output element and weight of its filter
            return 2 * local * module.weight[0].numel()
        if isinstance(module, nn.ConvTranspose2d):  # a multiply-add per input element and weight it spreads
            return 2 * math.prod(shape_of(node.args[0])) / out.pieces * module.weight[0].numel()
    if op_key(node) is F.scaled_dot_product_attention:
        q, k = (shape_of(n) for n in node.args[:2])
        return 4 * local / q[-1] * k[-2] * q[-1]
    if op_key(node) in (torch.matmul, operator.matmul, torch.bmm, torch.mm, "matmul", "bmm", *GROUPED_PRODUCTS):
        a = shape_of(node.args[0]) if isinstance(node.args[0], fx.Node) else None
        return 2 * local * a[-1] / _split(entry, node.args[0], -1) if a else local
    return local


def forward_seconds(node: fx.Node, entry: NodePlan, modules: dict[str, nn.Module], cluster: Cluster,
                    dtype: str = "float32", itemsize: int = 4) -> float:
    """Seconds of ``node``'s forward on this rank under its strategy ``entry``, fixed costs aside: the slower
    of its FLOPs (at the achievable rate for products and attention, at peak for the rest) and its bytes over
    memory bandwidth. A product of a thin inner dimension (attention scores of 64-128 wide heads) is bound
    by the bytes it writes, not by its FLOPs."""
    flops = forward_flops(node, entry, modules)
    peak = cluster.flops_per_s[dtype]
    if op_key(node) is F.scaled_dot_product_attention:
        q, k = (shape_of(n) for n in node.args[:2])
        peak *= cluster.attention_share(dtype, math.sqrt(q[-2] * k[-2]), q[-1])  # by one head's shape
    elif is_product(node, modules):
        peak *= cluster.matmul_share(*_product_dims(node, entry, modules, flops), dtype)
    bandwidth = cluster.memory_bandwidth_bytes_per_s
    moved = forward_bytes(node, entry, modules, itemsize) if bandwidth else 0.0
    rate = cluster.pointwise_rate(_pointwise_name(node, entry, modules), dtype)
    return max(flops / peak, moved / bandwidth if bandwidth else 0.0, flops / rate if rate else 0.0)


def optimizer_seconds(numel: float, precision: str, cluster: Cluster, tensors: int = 0) -> float:
    """Seconds of one optimizer step on the device over ``numel`` local parameters in ``tensors`` tensors."""
    return step_seconds(numel, precision, cluster.memory_bandwidth_bytes_per_s, cluster.optimizer_overhead_s, tensors)


def step_seconds(numel: float, precision: str, bandwidth: float, per_tensor_s: float, tensors: int) -> float:
    """An AdamW step where memory streams ``bandwidth`` bytes per second (0: unknown, left out): memory-bound, it
    reads parameter, gradient and two moments and writes three of them back, 28 bytes in fp32 (half precision
    adds the half gradient read and the half parameter written: 32); plus ``per_tensor_s`` per tensor."""
    moved = numel * (28 if precision == "fp32" else 32) / bandwidth if bandwidth else 0.0
    return moved + tensors * per_tensor_s


def forward_bytes(node: fx.Node, entry: NodePlan, modules: dict[str, nn.Module], itemsize: int) -> float:
    """Bytes ``node``'s forward reads and writes on this rank under ``entry``: its tensor inputs, its parameters
    and its output; for a norm of Python code, a third of what its own ops move in forward and backward (measured
    when it was captured; a pass recompute adds is priced at that share too)."""
    if node.op in ("placeholder", "output", "get_attr") or is_shape_op(node):
        return 0.0
    if op_name(node) in CROSS_ENTROPY:
        return _logits_elements(node, entry) * _loss_bytes_per_logit(entry, itemsize) / TRAIN_FLOPS_PER_FORWARD
    total = 0.0
    if node.op == "call_module":
        for name, p in modules[node.target].named_parameters(recurse=False):
            layout = entry.params.get(name)
            shards = layout.pieces if layout is not None else 1
            total += p.numel() / shards * itemsize
    computed = computed_layout(node, entry, modules)
    per_element = moved_bytes(node, itemsize)  # a norm's own forward and backward, measured when captured
    if per_element is not None and isinstance(computed, Layout):  # a pass's share: training is priced as three
        return total + math.prod(shape_of(node)) / computed.pieces * per_element / TRAIN_FLOPS_PER_FORWARD
    for value, layout in [(node, computed)] + [(i, entry.inputs.get(i.name)) for i in node.all_input_nodes]:
        shape = shape_of(value)
        if isinstance(layout, Layout) and shape is not None:
            total += math.prod(shape) / layout.pieces * itemsize
    return total


def computed_layout(node: fx.Node, entry, modules: dict[str, nn.Module]):
    """The layout an op computes its output in: its plan's output, except that a row-parallel product
    computes whole along the dims its partial sums are then reduce-scattered over (sequence parallel)."""
    out, weight = entry.output, entry.params.get("weight")
    order = linear_dims(modules[node.target]) if node.op == "call_module" else None
    if order is None or weight is None or not isinstance(out, Layout):
        return out
    summed = set(weight.dims[order[1]])
    return out.with_dims([tuple(a for a in d if a not in summed) for d in out.dims], out.partial)


def _product_dims(node: fx.Node, entry: NodePlan, modules: dict[str, nn.Module],
                  flops: float) -> tuple[float, float, float]:
    """(m, n, k) of the products ``node`` runs on this rank: k contracted, n the output's last dim, m
    its rows (a Linear's flattened leading dims; one batch entry's rows for a batched product)."""
    shape, out = shape_of(node), computed_layout(node, entry, modules)
    if not shape or not isinstance(out, Layout):
        return 1.0, 1.0, 1.0
    numel = math.prod(shape) / out.pieces
    n = shape[-1] / out.num_shards(len(shape) - 1)
    batched = node.op != "call_module" and len(shape) > 2
    m = shape[-2] / out.num_shards(len(shape) - 2) if batched else numel / n
    return m, n, flops / 2 / max(numel, 1.0)


def _pointwise_name(node: fx.Node, entry: NodePlan, modules: dict[str, nn.Module]) -> str:
    """The op name a pointwise rate is measured under ("gelu" for F.gelu, nn.GELU or aten.gelu; cross-entropy's
    by the implementation that runs it)."""
    if node.op == "call_module":
        return _POINTWISE_MODULES.get(type(modules[node.target]), "")
    if op_name(node) in CROSS_ENTROPY:
        return _loss(entry)[0]
    return op_name(node)


def _loss(entry: NodePlan) -> tuple[str, int]:
    """The implementation cross-entropy run as ``entry`` plans: the name it is measured under
    (Cluster.pointwise_rates, loss_overheads_s) and its passes over the logits in training."""
    return _LOSSES.get(entry.impl, _TORCH_LOSS)


def _loss_bytes_per_logit(entry: NodePlan, itemsize: int) -> int:
    """Bytes a loss run as ``entry`` plans moves per logit in training: its passes in ``LOSS_DTYPE`` and, where the
    logits are narrower, their cast up and their gradient's cast down (each read in one dtype, written in the other)."""
    wide = LOSS_DTYPE.itemsize
    return wide * _loss(entry)[1] + (2 * (itemsize + wide) if itemsize < wide else 0)


def _logits_elements(node: fx.Node, entry: NodePlan) -> float:
    """Elements of a cross-entropy's logits on this rank under ``entry``."""
    logits = node.args[0]
    layout = entry.inputs.get(logits.name)
    return math.prod(shape_of(logits)) / (layout.pieces if isinstance(layout, Layout) else 1)


def _split(entry: NodePlan, arg: fx.Node, dim: int) -> int:
    """Pieces the contracted dim of ``arg`` comes in to the op ``entry`` plans (1 when not split)."""
    layout = entry.inputs.get(arg.name)
    return layout.num_shards(dim % layout.ndim) if isinstance(layout, Layout) else 1


# What the model returns is moved to the layout it is returned in once per step, in forward: no gradient flows back
# into a returned value the loss was not computed from (logits gathered whole), and a returned loss's move sends
# nothing back (a pending sum reduced to one value: its gradient is the same value everywhere).
RETURNED_PASSES = 1


def passes(name: str, recomputed: Recomputed) -> tuple[int, int]:
    """(forward-equivalents of compute, passes of communication) per training step for node ``name``:
    3 and 2 (forward, backward), one more of each when recompute runs it again (communication
    only if its collectives are recomputed rather than kept)."""
    again = name in recomputed.rerun
    return TRAIN_FLOPS_PER_FORWARD + again, 2 + (again and recomputed.comm == "recompute")


def op_overhead(node: fx.Node, entry: NodePlan, cluster: Cluster, compute_passes: int = TRAIN_FLOPS_PER_FORWARD,
                dtype: str = "float32") -> float:
    """Fixed cost of one op per training step in ``dtype``, however small: more when it runs on split tensors
    (DTensor's Python dispatch), except on GPUs, where the host dispatches ahead of the device
    (kernels launch asynchronously) and only the launches cost device time. A loss costs what its implementation's
    call was measured to, where it was (its forward and backward run dozens of ops)."""
    split = cluster.split_op_overhead_s if entry.impl != "local" and cluster.device_type != "cuda" else 0.0
    loss = cluster.loss_overhead(_loss(entry)[0], dtype) if op_name(node) in CROSS_ENTROPY else None
    return ((cluster.op_overhead_for(dtype) if loss is None else loss) + split) * compute_passes / \
        TRAIN_FLOPS_PER_FORWARD


def recompute_overhead(name: str, recomputed: Recomputed, cluster: Cluster, splits: bool) -> float:
    """What checkpointing adds to node ``name`` per training step beyond its rerun's own cost, where the host runs
    the device's work (GPUs' hosts run ahead of their kernels): its bookkeeping, if the node runs again, and the
    policy's call, if its region's policy watches ops (``splits``: the program splits operators, so a region
    keeping its collectives' results watches for them)."""
    if cluster.device_type == "cuda":
        return 0.0
    watched = name in recomputed.watched or splits and name in recomputed.watched_if_split
    return (name in recomputed.rerun) * cluster.recompute_op_overhead_s + watched * cluster.watched_op_overhead_s
