"""Lowering: a captured graph and a Plan become this rank's runnable module.

Parameters are cut to this rank's pieces; a redistribution is inserted wherever a value's
layout differs from what its consumer needs; shape arguments become local (sizes read from a
split tensor report the whole tensor, so model arithmetic stays global); split ops run on DTensors.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from polyshard.compiler.ops import ShardedFunction, ShardedModule, VocabParallelCrossEntropy
from polyshard.compiler.redistribute import redistribute, redistribute_local, to_dtensor
from polyshard.compiler.rows import RowSplitEmbedding, gather_rows, row_slice
from polyshard.compiler.spatial import (
    SpatialBatchNorm2d, SpatialCrossEntropy, SpatialGlobalPool, SpatialUpsample, SpatialWindow, Split,
)
from polyshard.graph.capture import shape_of
from polyshard.graph.ops import op_key
from polyshard.halo import BILINEAR_HALO, SPLIT_DIMS, halo, pair
from polyshard.layout import Layout
from polyshard.mesh import Mesh
from polyshard.pin import PIN_ATTR
from polyshard.plan import Plan, takes_moved_dtensor
from polyshard.planner.rules.spatial import upsampling


class Redistribute:
    """Graph op: move this rank's piece from one layout to another (waited for where first used); ``to_dtensor``:
    hand the moved DTensor itself to the split ops that take it, so that their input gradient's partial sums go
    back to ``src`` in one redistribution (a reduce-scatter under sequence parallel, not an all-reduce and a slice).
    """

    def __init__(self, src: Layout, dst: Layout, mesh: Mesh, to_dtensor: bool = False):
        self.src, self.dst, self.mesh, self.to_dtensor = src, dst, mesh, to_dtensor
        self.__name__ = f"redistribute_{src}_to_{dst}".replace("(", "").replace(")", "")

    def __call__(self, local: torch.Tensor):
        shape = self.src.global_shape(local.shape)
        if self.to_dtensor:
            return redistribute(to_dtensor(local, self.src, shape, self.mesh), self.dst, self.mesh, async_op=True)
        return redistribute_local(local, self.src, self.dst, shape, self.mesh, async_op=True)


def to_local(x: DTensor) -> torch.Tensor:
    """Graph op: this rank's piece of a moved DTensor, for an op that runs on pieces."""
    return x.to_local()


class ToDTensor:
    """Graph op: this rank's piece as one DTensor for every split op that takes it in ``layout``, so
    their input gradients add up as partial sums and are reduced once (Megatron's f operator), not
    once per op."""

    def __init__(self, layout: Layout, mesh: Mesh):
        self.layout, self.mesh = layout, mesh
        self.__name__ = "to_dtensor"

    def __call__(self, local: torch.Tensor):
        return to_dtensor(local, self.layout, self.layout.global_shape(local.shape), self.mesh)


class GlobalSize:
    """Graph op: ``x.size(...)`` of the whole tensor, from this rank's piece."""

    def __init__(self, multipliers: tuple[int, ...]):
        self.multipliers = multipliers
        self.__name__ = "global_size"

    def __call__(self, x: torch.Tensor, dim: int | None = None):
        size = torch.Size(s * m for s, m in zip(x.shape, self.multipliers))
        return size if dim is None else size[dim]


def shard_parameters(model: nn.Module, plan: Plan, mesh: Mesh) -> None:
    """Replace each split parameter by this rank's piece (shared parameters stay shared)."""
    paths: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        paths.setdefault(id(p), []).append(name)
    for name, p in list(model.named_parameters()):
        layout = plan.params[name]
        if layout.is_replicated:
            continue
        if name in plan.row_splits:
            local = p.detach()[row_slice(plan.row_splits[name], mesh.piece_index(layout, 0))]
        else:
            layout.check_divides(p.shape, f"parameter `{name}`")
            local = distribute_tensor(p.detach(), mesh.device_mesh(layout.axes), layout.placements(),
                                      src_data_rank=None).to_local()
        new = nn.Parameter(local.clone(), requires_grad=p.requires_grad)
        for path in paths[id(p)]:
            owner, _, attr = path.rpartition(".")
            setattr(model.get_submodule(owner), attr, new)


def lower(gm: fx.GraphModule, plan: Plan, mesh: Mesh) -> fx.GraphModule:
    """Rewrite ``gm`` in place to run this rank's share of ``plan``; returns it."""
    shard_parameters(gm, plan, mesh)
    graph = gm.graph
    out_layout = {name: n.output for name, n in plan.nodes.items()}
    moved: dict[tuple[str, Layout], fx.Node] = {}
    shared = _shared_split_inputs(graph, plan)
    dtensors = _moved_dtensors(graph, plan)
    pieces: dict[tuple[str, Layout], fx.Node] = {}  # of a moved DTensor, for the ops that run on pieces
    wrapped: dict[tuple[str, Layout], fx.Node] = {}
    for node in list(graph.nodes):
        entry = plan.nodes[node.name]
        in_layouts = [entry.inputs[n.name] for n in node.args if isinstance(n, fx.Node) and n.name in entry.inputs]
        for inp in list(node.all_input_nodes):
            src, dst = out_layout.get(inp.name), entry.inputs.get(inp.name)
            if dst is None or src == dst:
                continue
            key = (inp.name, dst)
            if key not in moved:
                with graph.inserting_before(node):
                    moved[key] = graph.call_function(Redistribute(src, dst, mesh, key in dtensors), (inp,))
            taken = moved[key]
            if key in dtensors and entry.impl != "dtensor":
                if key not in pieces:
                    with graph.inserting_before(node):
                        pieces[key] = graph.call_function(to_local, (moved[key],))
                taken = pieces[key]
            node.replace_input_with(inp, taken)
        for name, dst in entry.inputs.items() if entry.impl == "dtensor" else ():
            if (name, dst) not in shared or (name, dst) in dtensors:
                continue
            current = moved.get((name, dst)) or next(n for n in node.all_input_nodes if n.name == name)
            if (name, dst) not in wrapped:
                with graph.inserting_before(node):
                    wrapped[(name, dst)] = graph.call_function(ToDTensor(dst, mesh), (current,))
            node.replace_input_with(current, wrapped[(name, dst)])
        if node.target is torch.ops.aten.view.default:  # a piece a redistribution made may not be viewable
            node.target = torch.ops.aten.reshape.default
        if _reads_size(node):
            _global_size(node, out_layout[node.args[0].name], graph)
        elif entry.shape_divisors:
            _localize_shape(node, entry.shape_divisors, graph)
        elif entry.impl == "dtensor":
            _use_dtensor(gm, node, entry, in_layouts, mesh)
        elif entry.impl == "spatial":
            _use_spatial(gm, node, entry, mesh)
        elif entry.impl == "rows":
            _use_rows(gm, node, entry, plan, mesh)
        elif entry.impl == "vocab_ce":
            if op_key(node) == "cross_entropy_loss":  # aten's positional form: only ignore_index may differ
                ignore = node.args[4] if len(node.args) > 4 else node.kwargs.get("ignore_index", -100)
                node.args, node.kwargs = node.args[:2], {"ignore_index": ignore}
            node.target = VocabParallelCrossEntropy(entry.inputs[node.args[0].name], mesh)
    graph.lint()
    gm.recompile()
    return gm


def _moved_dtensors(graph: fx.Graph, plan: Plan) -> set[tuple[str, Layout]]:
    """(value, layout) pairs a split op takes after a move that keeps the device matrix: the move hands it the
    DTensor (the cost model prices its gradient's way back so)."""
    out = set()
    for node in graph.nodes:
        entry = plan.nodes.get(node.name)
        if entry is None or entry.impl != "dtensor":
            continue
        for inp in node.all_input_nodes:
            src, dst = plan.nodes[inp.name].output if inp.name in plan.nodes else None, entry.inputs.get(inp.name)
            if isinstance(src, Layout) and dst is not None and takes_moved_dtensor(src, dst, [entry]):
                out.add((inp.name, dst))
    return out


def _shared_split_inputs(graph: fx.Graph, plan: Plan) -> set[tuple[str, Layout]]:
    """(value, layout) pairs that two or more split ops take (q, k and v of one input, or gate and up)."""
    counts: dict[tuple[str, Layout], int] = {}
    for node in graph.nodes:
        entry = plan.nodes.get(node.name)
        if entry is not None and entry.impl == "dtensor":
            for inp in node.all_input_nodes:
                if inp.name in entry.inputs:
                    key = (inp.name, entry.inputs[inp.name])
                    counts[key] = counts.get(key, 0) + 1
    return {key for key, n in counts.items() if n > 1}


def _reads_size(node: fx.Node) -> bool:
    return (node.op == "call_method" and node.target == "size") or op_key(node) == "sym_size" or (
        node.op == "call_function" and node.target is getattr and node.args[1] == "shape")


def _global_size(node: fx.Node, layout: Layout, graph: fx.Graph) -> None:
    multipliers = tuple(layout.num_shards(d) for d in range(layout.ndim))
    if all(m == 1 for m in multipliers):
        return
    with graph.inserting_after(node):
        new = graph.call_function(GlobalSize(multipliers), (node.args[0],) + tuple(node.args[1:2]) if node.target != getattr else (node.args[0],))
    node.replace_all_uses_with(new)
    graph.erase_node(node)


def _localize_shape(node: fx.Node, divisors: dict[int, int], graph: fx.Graph) -> None:
    """Divide the split dims of a view/reshape target shape by their piece counts."""
    x, *shape = node.args
    packed = len(shape) == 1 and isinstance(shape[0], (tuple, list))
    shape = list(shape[0]) if packed else shape
    for dim, n in divisors.items():
        s = shape[dim]
        if isinstance(s, fx.Node):
            with graph.inserting_before(node):
                shape[dim] = graph.call_function(operator.floordiv, (s, n))
        elif s != -1:
            shape[dim] = s // n
    node.args = (x, tuple(shape)) if packed else (x, *shape)


def _use_dtensor(gm: fx.GraphModule, node: fx.Node, entry, in_layouts: list[Layout], mesh: Mesh) -> None:
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        name = "_sharded_" + node.target.replace(".", "_")
        gm.add_submodule(name, ShardedModule(module, entry.params, in_layouts, entry.output, mesh))
        node.target = name
    else:  # a pinned function, or an op a rule runs on DTensors
        fn = getattr(node.target, PIN_ATTR).fn if hasattr(node.target, PIN_ATTR) else node.target
        node.target = ShardedFunction(fn, in_layouts, entry.output, mesh, getattr(fn, "__name__", "fn"))


def _use_rows(gm: fx.GraphModule, node: fx.Node, entry, plan: Plan, mesh: Mesh) -> None:
    """A table split unevenly by rows: this rank's rows looked up, the pieces' lookups summed."""
    weight = entry.params["weight"]
    rows = plan.row_splits[f"{node.target}.weight"]
    offset = row_slice(rows, mesh.piece_index(weight, 0)).start
    name = "_rows_" + node.target.replace(".", "_")
    gm.add_submodule(name, RowSplitEmbedding(gm.get_submodule(node.target), offset, entry.output, mesh,
                                             weight.dims[0]))
    node.target = name


def whole_parameter(piece: torch.Tensor, name: str, plan: Plan, mesh: Mesh) -> torch.Tensor:
    """Parameter ``name`` whole, from this rank's ``piece`` (every rank of its split takes part)."""
    layout = plan.params[name]
    if layout.is_replicated:
        return piece.detach().clone()
    if name in plan.row_splits:
        return gather_rows(piece.detach(), plan.row_splits[name], mesh.group(layout.dims[0]))
    return to_dtensor(piece.detach(), layout, layout.global_shape(piece.shape), mesh).full_tensor()


def _use_spatial(gm: fx.GraphModule, node: fx.Node, entry, mesh: Mesh) -> None:
    """A convolutional module (or a per-pixel loss) on an image split by height and width: its tile's op
    with halos (see polyshard.compiler.spatial)."""
    x = node.args[0]
    layout, shape = entry.inputs[x.name], shape_of(x)
    split = {d: layout.dims[d] for d in SPLIT_DIMS if layout.dims[d]}
    axes = tuple(a for d in split.values() for a in d)
    module = gm.get_submodule(node.target) if node.op == "call_module" else None
    if isinstance(module, nn.Upsample) or op_key(node) is F.interpolate:  # bilinear, by a whole factor
        _, factor = upsampling(node, module)
        lo, hi = BILINEAR_HALO
        splits = tuple(Split(d, mesh.group(a), lo, hi, shape[d] // layout.num_shards(d) * factor[d - 2])
                       for d, a in split.items())
        wrapped = SpatialUpsample(factor, splits)
        if module is None:  # F.interpolate: its size and mode are the wrapper's now
            node.target, node.args, node.kwargs = wrapped, (x,), {}
            return
        name = "_spatial_" + node.name
        gm.add_submodule(name, wrapped)
        node.target = name
        return
    if node.op != "call_module":  # a per-pixel cross-entropy
        node.target = SpatialCrossEntropy(mesh.group(axes), node.kwargs.get("ignore_index", -100))
        node.kwargs = {}
        return
    if isinstance(module, nn.ConvTranspose2d):
        splits = tuple(Split(d, mesh.group(a), 0, 0, shape[d] // layout.num_shards(d) * pair(module.stride)[d - 2])
                       for d, a in split.items())
        wrapped = SpatialWindow(module, splits, mesh.group(axes))
    elif isinstance(module, nn.BatchNorm2d):
        wrapped = SpatialBatchNorm2d(module, mesh.group(mesh.data_axes + axes), mesh.group(axes))
    elif isinstance(module, nn.AdaptiveAvgPool2d):
        wrapped = SpatialGlobalPool(layout.num_shards(2) * layout.num_shards(3), mesh.group(axes))
    else:
        kernel, stride, padding = (pair(getattr(module, k)) for k in ("kernel_size", "stride", "padding"))
        splits = tuple(Split(d, mesh.group(a), *halo(shape[d], layout.num_shards(d), kernel[d - 2], stride[d - 2],
                                                      padding[d - 2])) for d, a in split.items())
        wrapped = SpatialWindow(module, splits, mesh.group(axes))
    name = "_spatial_" + node.name  # per call: one module called on two image sizes halos each its own way
    gm.add_submodule(name, wrapped)
    node.target = name
