"""Repeated blocks: each node of the third and later of a run of identical blocks, and its twin in the second.

A twin computes the same op on the same shapes, so the planner enumerates, and where the plan lays both
out alike costs, one block's nodes and reuses them: an 80-layer model is planned as two layers.
"""

from __future__ import annotations

import re
import weakref

from torch import fx, nn

from polyshard.graph.capture import shape_of

_TWINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per graph: every split asks again
_BLOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per graph: twins and the planner group alike


def twins(gm: fx.GraphModule) -> dict[str, fx.Node]:
    """Node name -> the node at the same position in the second block of its run (third block on)."""
    found = _TWINS.get(gm)
    if found is None:
        found = _TWINS[gm] = _twins(blocks(gm), dict(gm.named_modules()))
    return found


def blocks(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """Each block's nodes in graph order (see :func:`block_of`), by block."""
    found = _BLOCKS.get(gm)
    if found is None:
        found = _BLOCKS[gm] = {}
        for n in gm.graph.nodes:
            if block := block_of(n):
                found.setdefault(block, []).append(n)
    return found


def _twins(block_nodes: dict[str, list[fx.Node]], modules: dict[str, nn.Module]) -> dict[str, fx.Node]:
    out: dict[str, fx.Node] = {}
    run: list[list[fx.Node]] = []
    run_signature = None
    for members in list(block_nodes.values()) + [[]]:
        signature = _signature(members, modules)
        if run and signature == run_signature:
            run.append(members)
            continue
        for later in run[2:]:
            out.update({m.name: t for m, t in zip(later, run[1])})
        run, run_signature = [members], signature
    return out


def _signature(members: list[fx.Node], modules: dict[str, nn.Module]) -> tuple:
    """What makes blocks alike: each member's op, target (indices aside), module type, shape and inputs (the
    members of one Sequential, a Conv2d then a BatchNorm2d, are blocks of one node each, and not alike)."""
    return tuple((m.op, stripped(m), type(modules[m.target]) if m.op == "call_module" else None, shape_of(m),
                  len(m.all_input_nodes)) for m in members)


def block_of(node: fx.Node) -> str:
    """The innermost indexed module (a ModuleList's child) ``node`` runs in, or ""."""
    for path in (node.meta.get("nn_module_stack") or {}).values():
        name = path[0] if isinstance(path, tuple) else path
        if re.fullmatch(r".*\.\d+", name):
            return name
    return ""


def stripped(node: fx.Node) -> str:
    """``node``'s target with its indices blanked: layer 3's q_proj reads as layer 5's."""
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return re.sub(r"\d+", "#", target)

