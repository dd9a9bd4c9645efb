"""Communication each op causes, per mesh axis, and its time on the link that axis rides.

Bytes come from the transition table (polyshard.transitions); time is the alpha-beta model,
latency per ring step x steps + bytes / bandwidth, on the intra-node link when the axis and every axis inside it fit
in one node, else on the inter-node link.
"""

from __future__ import annotations

from torch import fx, nn

from polyshard.cluster import Cluster, Link
from polyshard.graph.capture import shape_of
from polyshard.layout import Axes, Layout
from polyshard.planner.plan import Plan
from polyshard.transitions import transition_bytes, wire_bytes


def axis_link(mesh_axes: Axes, axis: str, cluster: Cluster) -> Link:
    """The link class an axis's collectives cross (inner axes are consecutive ranks): the intra-node
    link only when the axis and the axes inside it span a whole divisor of a node, so that no group
    straddles two nodes.

    A part of an axis (``tp:0`` of a refined ``tp``) is taken to ride its whole axis's link."""
    base = axis.split(":")[0]
    span = 1
    for name, size in reversed(mesh_axes):
        span *= size
        if name == base:
            break
    return cluster.intra_node if cluster.devices_per_node % span == 0 else cluster.inter_node


def node_comm_bytes(node: fx.Node, plan: Plan, modules: dict[str, nn.Module], itemsize: int,
                    backend: str) -> dict[str, float]:
    """Bytes this rank sends, per axis, for ``node``: its input redistributions and its partial sums."""
    entry = plan.nodes[node.name]
    out: dict[str, float] = {}
    for inp in node.all_input_nodes:
        src, dst = plan.nodes[inp.name].output, entry.inputs.get(inp.name)
        if isinstance(src, Layout) and dst is not None and src != dst:
            for axis, b in transition_bytes(src, dst, shape_of(inp), itemsize, backend).items():
                out[axis] = out.get(axis, 0.0) + b
    for axis, b in partial_sum_bytes(node, entry, modules, itemsize, backend).items():
        out[axis] = out.get(axis, 0.0) + b
    return out


def partial_sum_bytes(node, entry, modules, itemsize, backend) -> dict[str, float]:
    """A split contraction (row-parallel Linear, vocabulary-parallel Embedding) all-reduces its output."""
    if entry.impl != "dtensor" or node.op != "call_module":
        return {}
    module, weight = modules[node.target], entry.params.get("weight")
    if weight is None:
        return {}
    axes = weight.dims[1] if isinstance(module, nn.Linear) else weight.dims[0] if isinstance(module, nn.Embedding) else ()
    shape, layout = shape_of(node), entry.output
    local = itemsize
    for d, s in enumerate(shape):
        local *= s // layout.num_shards(d)
    return {a: wire_bytes("all_reduce", local, weight.axis_sizes[a], backend) for a in axes}


def collective_latency(link: Link, group_size: int) -> float:
    """A ring collective's fixed cost: the link's latency once per step, group_size - 1 steps."""
    return link.latency_s * max(group_size - 1, 1)


def comm_seconds(bytes_by_axis: dict[str, float], mesh_axes: Axes, cluster: Cluster) -> tuple[float, float]:
    """Alpha-beta time of one op's collectives (one per axis, one after another): (transfer, latency)."""
    transfer = latency = 0.0
    sizes = dict(mesh_axes)
    for axis, b in bytes_by_axis.items():
        if b:
            link = axis_link(mesh_axes, axis, cluster)
            transfer += b / link.bandwidth_bytes_per_s
            latency += collective_latency(link, sizes.get(axis.split(":")[0], 2))
    return transfer, latency
