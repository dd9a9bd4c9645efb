"""Communication each op causes, per mesh axis, and its time on the link that axis rides.

Bytes come from the transition table (polyshard.transitions); time is the alpha-beta model,
latency per ring step x steps + bytes / bandwidth, on the intra-node link when the axis and every axis inside it fit
in one node, else on the inter-node link, as many NICs as the group has ranks in a node (see axis_link).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch.nn.functional as F
from torch import fx, nn

from polyshard.cluster import Cluster, Link
from polyshard.graph.capture import linear_dims, shape_of
from polyshard.graph.ops import op_key
from polyshard.halo import BILINEAR_HALO, SPLIT_DIMS, halo, pair
from polyshard.layout import Axes, Layout
from polyshard.plan import NodePlan, Plan, takes_moved_dtensor
from polyshard.transitions import PAIRWISE, transition_bytes, wire_bytes


@dataclass(frozen=True)
class DataSync:
    """A step's data-parallel communication: ``during`` backward, of which ``hides`` seconds hide per second of
    backward it runs beside, leaving at least ``last`` (the last bucket) exposed; then ``after`` backward, alone.
    Backward beside it takes ``slowdown`` longer (Cluster.overlap_slowdown).
    Computed once per (bytes, level, micro-batches, bucket size), read at each backward length."""

    during: float
    after: float = 0.0
    last: float = 0.0
    hides: float = 0.0
    slowdown: float = 0.0

    def exposed(self, overlap_s: float) -> float:
        """Seconds left exposed beside ``overlap_s`` of backward: what it cannot hide, or at least the floor."""
        hidden = overlap_s * self.hides if self.hides else 0.0
        return max(self.during - hidden, self.floor) + self.after

    @property
    def floor(self) -> float:
        """Seconds of ``during`` exposed however long backward is: the last bucket, and what backward loses while
        the rest runs beside it."""
        if not self.hides:
            return self.during
        return self.last + lost_beside(self.during - self.last, self.slowdown)


def lost_beside(seconds: float, slowdown: float) -> float:
    """What compute loses while a collective runs beside it for ``seconds``: it does 1 / (1 + slowdown) of a
    second's work in each (Cluster.overlap_slowdown)."""
    return seconds * slowdown / (1 + slowdown)


def axis_link(mesh_axes: Axes, axis: str, cluster: Cluster, ring: bool = True) -> Link:
    """The link an axis's collectives ride (inner axes are consecutive ranks): the intra-node link when the axis
    and the axes inside it span a whole divisor of a node, so that no group straddles two nodes; else the
    inter-node link, one NIC per device. A ring collective (all-reduce, all-gather, reduce-scatter) whose group
    holds g ranks of each node runs as g rings side by side, each crossing every node once on its own NIC and
    passing the node's other ranks over the intra-node link (NCCL's channels, one per NIC): g NICs' rate, up to
    the intra-node link's (NCCL's maintainers: about 24 GB/s of bus bandwidth per HDR NIC, times the NICs, up to
    the NVLink figure; NVIDIA/nccl-tests#119, NVIDIA/nccl#412). ``ring=False`` (a pipeline's sends, an all-to-all,
    whose bytes to each other node leave through the sender's own NIC): one NIC.

    A part of an axis (``tp:0`` of a refined ``tp``) is taken to ride its whole axis's link."""
    base = axis.split(":")[0]
    inner = span = 1
    for name, size in reversed(mesh_axes):
        span *= size
        if name == base:
            break
        inner = span
    per_node = cluster.devices_per_node
    if per_node % span == 0:
        return cluster.intra_node
    # groups of whole nodes hold the same ranks in each node; one straddling a node boundary gets one NIC
    whole = span % per_node == 0 and (per_node % inner == 0 or inner % per_node == 0)
    rails = max(1, per_node // inner) if ring and whole else 1
    if rails == 1:
        return cluster.inter_node
    return Link(min(rails * cluster.inter_node.bandwidth_bytes_per_s, cluster.intra_node.bandwidth_bytes_per_s),
                cluster.inter_node.latency_s)


def node_comm_bytes(node: fx.Node, plan: Plan, modules: dict[str, nn.Module], itemsize: int,
                    backend: str, all_to_all: bool = True) -> list[dict[str, float]]:
    """Bytes this rank sends for ``node`` in forward, per collective and axis: its input redistributions (each
    value moved to a layout once, by its first consumer that takes it so, as lowering does), then its own."""
    entry = plan.nodes[node.name]
    out = []
    for inp in node.all_input_nodes:
        src, dst = plan.nodes[inp.name].output, entry.inputs.get(inp.name)
        if isinstance(src, Layout) and dst is not None and src != dst and first_to_take(node, inp, dst, plan):
            out.append(transition_bytes(src, dst, shape_of(inp), itemsize, backend, all_to_all))
    return out + own_collectives(node, entry, modules, itemsize, backend)[0]


def node_backward_bytes(node: fx.Node, plan: Plan, modules: dict[str, nn.Module], itemsize: int,
                        backend: str, all_to_all: bool = True) -> list[dict[str, float]]:
    """Bytes this rank sends for ``node`` in backward, per collective and axis: its own, then its inputs'
    gradients brought back (:func:`gradient_bytes`), each once, by the first consumer taking the value so."""
    entry = plan.nodes[node.name]
    out = own_collectives(node, entry, modules, itemsize, backend)[1]
    for inp in node.all_input_nodes:
        src, dst = plan.nodes[inp.name].output, entry.inputs.get(inp.name)
        if isinstance(src, Layout) and dst is not None and first_to_take(node, inp, dst, plan):
            takers = [plan.nodes[u.name] for u in inp.users if plan.nodes[u.name].inputs.get(inp.name) == dst]
            out += gradient_bytes(inp, src, dst, takers, itemsize, backend, all_to_all)
    return out


def gradient_layout(taken: Layout, takers: Sequence[NodePlan]) -> Layout:
    """The layout the gradient of a value taken in ``taken`` by the ops run as ``takers`` comes back in: whole
    where it was a pending sum (a sum's gradient is each summand's), and pending over each axis a DTensor op
    splits its output or weights over while taking the value whole (each rank adds its part's contribution:
    Megatron's f operator, reduced once for all the ops that take the value so, as lowering wraps it once)."""
    split = {a for e in takers if e.impl == "dtensor"
             for layout in (e.output, *e.params.values()) if isinstance(layout, Layout) for d in layout.dims for a in d}
    return taken.with_dims(taken.dims, [a for a, _ in taken.axes if a in split and taken.dim_of(a) is None])


def gradient_path(value: fx.Node, src: Layout, dst: Layout, takers: Sequence[NodePlan]) -> tuple[Layout, ...]:
    """The layouts the gradient of ``value``, made in ``src`` and taken in ``dst`` by ``takers``, passes through on
    its way back, as DTensor's autograd moves it: from the layout it comes back in (:func:`gradient_layout`) to
    ``src``'s (a pending sum's gradient left whole), straight where a DTensor op takes the move's DTensor (under
    sequence parallel a split product's input gradient is reduce-scattered), else reduced to ``dst`` first
    (from_local's backward). Empty for a value no gradient flows into (token ids, masks, rotary tables)."""
    if not getattr(value.meta.get("tensor_meta"), "requires_grad", True):
        return ()
    back, home = gradient_layout(dst, takers), src.with_dims(src.dims)
    return (back, home) if takes_moved_dtensor(src, dst, takers) else (back, dst.with_dims(dst.dims), home)


def gradient_bytes(value: fx.Node, src: Layout, dst: Layout, takers: Sequence[NodePlan], itemsize: int, backend: str,
                   all_to_all: bool = True) -> list[dict[str, float]]:
    """Bytes each rank sends, per collective and axis, to bring back the gradient of ``value`` along
    :func:`gradient_path`."""
    path = gradient_path(value, src, dst, takers)
    sent = [transition_bytes(a, b, shape_of(value), itemsize, backend, all_to_all)
            for a, b in zip(path, path[1:]) if a != b]
    return [s for s in sent if any(s.values())]


def first_to_take(node: fx.Node, inp: fx.Node, dst: Layout, plan: Plan) -> bool:
    """Whether ``node`` is the first of ``inp``'s consumers to take it in ``dst``."""
    first = next(u for u in inp.users if u is node or plan.nodes[u.name].inputs.get(inp.name) == dst)
    return first is node


def own_collectives(node, entry, modules, itemsize: int, backend: str) -> tuple[list[dict[str, float]], ...]:
    """Bytes an op's own collectives send per axis, (forward, backward), one dict per collective: its partial sums
    (reduced in forward; in backward gathered again where they were scattered along the sequence), its halo (and its
    gradient's), a vocabulary-parallel loss's two reductions of one value per token (forward only)."""
    pending = partial_sum_layouts(node, entry, modules)
    forward, backward = [], []
    if pending is not None:
        shape, (before, after) = shape_of(node), pending
        forward.append(transition_bytes(before, after, shape, itemsize, backend))
        backward.append(transition_bytes(after, before.with_dims(before.dims), shape, itemsize, backend))
    halo = halo_bytes(node, entry, modules, itemsize, backend)
    forward, backward = forward + [halo], backward + [halo]
    if entry.impl == "vocab_ce":
        logits = entry.inputs[node.args[0].name]
        tokens, sizes = math.prod(shape_of(node.args[0])[:-1]), logits.axis_sizes
        for values in (tokens, 2 * tokens):  # the maximum, then the exponentials' sum and the target's logit
            forward.append({a: wire_bytes("all_reduce", values * itemsize, sizes[a], backend) for a in logits.dims[-1]})
    return [c for c in forward if any(c.values())], [c for c in backward if any(c.values())]


def halo_bytes(node, entry, modules, itemsize: int, backend: str) -> dict[str, float]:
    """Bytes a window op on an image split by height and width sends its neighbours, per axis: the rows
    before its tile's end to the next rank, those after its start to the previous one (polyshard.halo);
    batch norm all-reduces two values per channel and global pooling its pooled output."""
    module = modules[node.target] if node.op == "call_module" else None
    bilinear = entry.impl == "spatial" and (isinstance(module, nn.Upsample) or op_key(node) is F.interpolate)
    if entry.impl != "spatial" or (module is None and not bilinear):
        return {}
    x = node.args[0]
    layout, shape = entry.inputs[x.name], shape_of(x)
    out: dict[str, float] = {}
    if isinstance(module, (nn.BatchNorm2d, nn.AdaptiveAvgPool2d)):
        for axis in (a for d in SPLIT_DIMS for a in layout.dims[d]):
            values = shape[1] * (2 if isinstance(module, nn.BatchNorm2d) else shape[0])
            out[axis] = wire_bytes("all_reduce", values * itemsize, layout.axis_sizes[axis], backend)
        return out
    if not bilinear and (not hasattr(module, "padding") or isinstance(module, nn.ConvTranspose2d)):
        return out
    local = list(layout.local_shape(shape))
    if not bilinear:
        kernel, stride, padding = (pair(getattr(module, k)) for k in ("kernel_size", "stride", "padding"))
    for d in SPLIT_DIMS:
        for axis in layout.dims[d]:
            before, after = BILINEAR_HALO if bilinear else \
                halo(shape[d], layout.num_shards(d), kernel[d - 2], stride[d - 2], padding[d - 2])[:2]
            rows = max(before, 0) + max(after, 0)
            out[axis] = out.get(axis, 0.0) + rows * math.prod(local) / local[d] * itemsize
            local[d] += rows  # the width's halo runs on the tile grown by the height's
    return out


def partial_sum_layouts(node, entry, modules) -> tuple[Layout, Layout] | None:
    """A split contraction (row-parallel Linear, vocabulary-parallel Embedding) reduces its partial sums into its
    output's layout (an all-reduce, or a reduce-scatter along the sequence): (pending, reduced); None for others."""
    if entry.impl not in ("dtensor", "rows") or node.op != "call_module":
        return None
    module, weight, out = modules[node.target], entry.params.get("weight"), entry.output
    order = linear_dims(module)
    if weight is None or not isinstance(out, Layout) or (order is None and not isinstance(module, nn.Embedding)):
        return None
    axes = weight.dims[order[1]] if order is not None else weight.dims[0]
    pending = out.with_dims([tuple(a for a in d if a not in axes) for d in out.dims], axes)
    return (pending, out) if axes else None


def weight_sum_bytes(node, entry, modules, itemsize: int, backend: str) -> list[dict[str, float]]:
    """Bytes a module whose weights are all whole, run on a split input (a norm under sequence parallel, a layer
    of a stage whose ranks split the batch), sends to sum its weights' gradients over the split axes: in each
    backward, one all-reduce per weight and axis (DTensor reduces each gradient on its own), whatever the rows.
    A function run on DTensors does the same for each whole trainable input beside a split one."""
    if entry.impl != "dtensor":
        return []
    if node.op == "call_module":
        if not entry.params or not all(l.is_replicated for l in entry.params.values()):
            return []
        sizes = next(iter(entry.params.values())).axis_sizes
        weights = [p.numel() for name, p in modules[node.target].named_parameters(recurse=False)
                   if name in entry.params]
    else:
        whole = [n for n in node.all_input_nodes if getattr(n.meta.get("tensor_meta"), "requires_grad", False)
                 and n.name in entry.inputs and entry.inputs[n.name].is_replicated]
        sizes = next(iter(entry.inputs.values())).axis_sizes if entry.inputs else {}
        weights = [math.prod(shape_of(n)) for n in whole]
    split = {a for l in entry.inputs.values() for d in l.dims for a in d}
    return [{a: wire_bytes("all_reduce", numel * itemsize, sizes[a], backend)} for numel in weights for a in split]


def weight_sum_seconds(node, entry, modules, itemsize: int, mesh_axes: Axes, cluster: Cluster) -> float:
    """Seconds of :func:`weight_sum_bytes`' all-reduces, one after another."""
    return sum(collectives_seconds(weight_sum_bytes(node, entry, modules, itemsize, cluster.backend), mesh_axes,
                                   cluster))


def collectives_seconds(collectives: Sequence[dict[str, float]], mesh_axes: Axes, cluster: Cluster
                        ) -> tuple[float, float]:
    """(transfer, latency) of collectives run one after another, each paying its own latency."""
    times = [comm_seconds(c, mesh_axes, cluster) for c in collectives]
    return sum(t for t, _ in times), sum(latency for _, latency in times)


# A ring all-reduce is a reduce-scatter then an all-gather, 2(n-1) steps; each of those alone runs n-1.
# A link's latency is fitted on all-reduces, per (n-1) of their steps, so the one-way collectives pay half.
_RING_SHARE = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5}


def collective_latency(link: Link, group_size: int, collective: str = "all_reduce", backend: str = "nccl") -> float:
    """A ring collective's fixed cost: the link's latency once per group_size - 1 ring steps of an all-reduce,
    half of that for an all-gather or a reduce-scatter; gloo's reduce-scatter is no ring and costs what its
    all-reduce does (`polyshard calibrate` times it at 0.99-1.18 of the all-reduce's latency)."""
    share = 1.0 if (collective, backend) == ("reduce_scatter", "gloo") else _RING_SHARE[collective]
    return link.latency_s * max(group_size - 1, 1) * share


def comm_seconds(bytes_by_axis: dict[str, float], mesh_axes: Axes, cluster: Cluster) -> tuple[float, float]:
    """Alpha-beta time of one op's collectives (one per axis, one after another; an all-to-all's bytes, under
    PAIRWISE, apart): (transfer, latency), the latency with the cluster's call skew for the group."""
    transfer = latency = 0.0
    sizes = dict(mesh_axes)
    for axis, b in bytes_by_axis.items():
        if b:
            base = axis.removesuffix(PAIRWISE)
            link = axis_link(mesh_axes, base, cluster, ring=not axis.endswith(PAIRWISE))
            size = sizes.get(base.split(":")[0], 2)
            transfer += b / link.bandwidth_bytes_per_s
            latency += collective_latency(link, size) + cluster.call_skew_for(size)
    return transfer, latency
