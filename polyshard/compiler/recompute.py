"""Recompute (activation checkpointing): regions keep no activations for backward, which runs them again.

Time for memory, as MindSpore's ``recompute``: each region of the lowered program is outlined into a
sub-module called through ``torch.utils.checkpoint``, so only its inputs (and, with ``comm="keep"``,
the results of its collectives; in a region that keeps its products, the outputs of its matrix products
and attention, or of every second product by a weight, as torchtitan's selective op checkpointing) stay alive
between forward and backward.
"""

from __future__ import annotations

import functools
import operator
from typing import Callable, Mapping, TypeVar

import torch
from torch import fx, nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts, noop_context_fn

from polyshard.errors import PolyshardError
from polyshard.graph.regions import RECOMPUTE_ATTR, Region, recompute_regions
from polyshard.plan import RECOMPUTE_COMMS, check_choice

Target = TypeVar("Target", bound=Callable)


# The aten ops a region that keeps its products saves: what polyshard.graph.regions.Region.kept names in the
# captured graph (a product by a weight runs mm or addmm, a batched product bmm, fused attention one of these).
_WEIGHT_PRODUCT_OPS = frozenset((torch.ops.aten.mm, torch.ops.aten.addmm))
_PRODUCT_OPS = _WEIGHT_PRODUCT_OPS | frozenset(
    op for name in ("bmm", "baddbmm", "_scaled_dot_product_flash_attention",
                    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
                    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_fused_attention_overrideable")
    if (op := getattr(torch.ops.aten, name, None)) is not None)


def _saving(collectives: bool, every: int) -> Callable:
    """A checkpoint policy for one region's call: collectives' results saved (backward does not talk again) and /
    or (``every`` > 0) attention's and batched products' outputs and every ``every``-th weight product's, counted
    apart in forward and in the rerun so both pick the same; the rest reruns."""
    weighted = {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        packet = getattr(op, "overloadpacket", None)
        if packet in _WEIGHT_PRODUCT_OPS:
            weighted[ctx.is_recompute] += 1
        saved = (collectives and op.namespace == "_c10d_functional"
                 or every and packet in _PRODUCT_OPS
                 and (packet not in _WEIGHT_PRODUCT_OPS or (weighted[ctx.is_recompute] - 1) % every == 0))
        return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


@functools.cache
def _context_fn(comm: str, keeps_every: int = 0) -> Callable:
    if comm == "recompute" and not keeps_every:
        return noop_context_fn
    return lambda: create_selective_checkpoint_contexts(_saving(comm == "keep", keeps_every))


def _checkpointed(fn: Callable, context_fn: Callable, *args, **kwargs):
    return checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def recompute(target: Target, *, comm: str = "keep") -> Target:
    """Recompute ``target`` in backward instead of storing its activations.

    A module is marked (and returned): :func:`polyshard.parallelize` recomputes it. A function comes
    back wrapped, checkpointed as it runs. ``comm``: "keep" saves the results of collectives inside,
    "recompute" issues them again in backward (less memory, more communication).
    """
    check_choice("comm", comm, RECOMPUTE_COMMS)
    if isinstance(target, nn.Module):
        setattr(target, RECOMPUTE_ATTR, comm)
        return target
    if not callable(target):
        raise PolyshardError(f"recompute() takes a module or a function, got {type(target).__name__}")

    @functools.wraps(target)
    def run(*args, **kwargs):
        return _checkpointed(target, _context_fn(comm), *args, **kwargs)

    return run


class Recomputed(nn.Module):
    """A region of the program, run under checkpoint (its modules are the program's own: same parameters)."""

    def __init__(self, region: fx.GraphModule, comm: str, keeps_every: int = 0):
        super().__init__()
        self.region, self.comm, self.keeps_every = region, comm, keeps_every

    def forward(self, *args):
        return _checkpointed(self.region, _context_fn(self.comm, self.keeps_every), *args)


def apply_recompute(gm: fx.GraphModule, mode: str, comm: str,
                    marked_paths: Mapping[str, str] | None = None, collectives: bool = True) -> fx.GraphModule:
    """A module computing what ``gm`` does, with the regions of
    :func:`polyshard.graph.regions.recompute_regions` outlined into checkpointed calls; ``gm`` is left as it was.
    ``collectives``: whether the program may communicate inside a region; where it cannot, "keep" has nothing
    to keep, and the regions run as plain checkpoints (watching each op for collectives costs a Python call
    per op: on CPU, a checkpointed forward took 1.8x a plain one, and 1.25x without the watch)."""
    regions = recompute_regions(gm, mode, comm, marked_paths)
    return _outline(gm, regions, collectives) if regions else gm


def _outline(gm: fx.GraphModule, regions: list[Region], collectives: bool = True) -> fx.GraphModule:
    """Each region becomes one call, where its last node was, to a :class:`Recomputed` submodule.

    Regions' members are used outside only after their last node (runs are consecutive, cores
    feed only their attention call), so each call sees every input it needs."""
    graph = fx.Graph()
    modules: dict[str, nn.Module] = {}
    env: dict[fx.Node, fx.Node] = {}
    ends = {r.nodes[-1]: r for r in regions}
    inside = {n for r in regions for n in r.nodes}
    for node in gm.graph.nodes:
        if node in ends:
            nodes, comm, label, keeps = ends[node].nodes, ends[node].comm, ends[node].label, ends[node].keeps_every
            members = set(nodes)
            inputs = list(dict.fromkeys(i for n in nodes for i in n.all_input_nodes if i not in members))
            outputs = [n for n in nodes if any(u not in members for u in n.users)]
            name = f"recompute_{len(modules)}_{label.replace('.', '_')}"
            modules[name] = Recomputed(_region(gm, nodes, inputs, outputs), comm if collectives else "recompute", keeps)
            call = graph.call_module(name, tuple(env[i] for i in inputs))
            for k, out in enumerate(outputs):
                env[out] = graph.call_function(operator.getitem, (call, k))
        elif node not in inside:
            env[node] = graph.node_copy(node, env.__getitem__)
    attrs = {n.target: operator.attrgetter(n.target)(gm) for n in graph.nodes
             if n.op in ("get_attr", "call_module") and n.target not in modules}
    return fx.GraphModule(modules | attrs, graph, class_name=type(gm).__name__)


def _region(gm: fx.GraphModule, nodes: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]) -> fx.GraphModule:
    """The nodes as a module of their own: inputs in, the values used after them out (a tuple)."""
    graph = fx.Graph()
    env = {i: graph.placeholder(i.name) for i in inputs}
    for n in nodes:
        env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(gm, graph, class_name="Region")
