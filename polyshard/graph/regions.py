"""Which nodes of a graph a recompute mode runs again in backward.

One definition for both sides: the planner's memory model counts what these regions free, and the
runtime outlines the same regions into checkpointed calls.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import cached_property
from typing import Mapping

import torch.nn.functional as F
from torch import fx, nn

from polyshard.graph.capture import is_product, is_weight_product
from polyshard.graph.ops import op_key
from polyshard.graph.params import modules_of
from polyshard.plan import RECOMPUTE_COMMS, RECOMPUTE_MODES, check_choice

RECOMPUTE_ATTR = "_polyshard_recompute"
_VIEWS = {"view", "transpose", "reshape", "permute", "contiguous"}


@dataclass(frozen=True)
class Region:
    """Consecutive nodes recomputed together; ``comm``: "keep" or "recompute" their collectives;
    ``keeps_every``: 0 keeps no output; n keeps attention's, batched products' and every n-th weight product's
    (the first, the n+1-th, ...: as a checkpoint policy counting mm and addmm sees them), the rest runs again."""

    nodes: list[fx.Node]
    comm: str
    label: str
    keeps_every: int = 0

    def kept(self, modules: Mapping[str, nn.Module]) -> set[fx.Node]:
        """The nodes whose outputs this region keeps rather than runs again."""
        if not self.keeps_every:
            return set()
        weighted = [n for n in self.nodes if is_weight_product(n, modules)]
        dropped = set(weighted) - set(weighted[::self.keeps_every])
        return {n for n in self.nodes if n not in dropped and (
            is_product(n, modules) or op_key(n) is F.scaled_dot_product_attention)}


def marked_modules(model: nn.Module) -> dict[str, str]:
    """Each module of ``model`` marked by ``polyshard.recompute``: its path -> its ``comm``."""
    return {name: getattr(m, RECOMPUTE_ATTR) for name, m in model.named_modules() if hasattr(m, RECOMPUTE_ATTR)}


def recompute_regions(gm: fx.GraphModule, mode: str, comm: str,
                      marked_paths: Mapping[str, str] | None = None) -> list[Region]:
    """The regions of ``gm`` to recompute.

    ``mode``: "full" recomputes every block (each child of a repeated ModuleList), "half" every second one in the
    order they run (the second, fourth, ...), "pointwise" every block but its products' and attention's outputs,
    which it keeps, "alternate" those too but every second product by a weight, "selective" every attention core
    (scaled_dot_product_attention and the views feeding it), "none" nothing; each module path in
    ``marked_paths`` is recomputed too, whole, with its own ``comm``.
    """
    check_choice("recompute", mode, RECOMPUTE_MODES)
    check_choice("recompute_comm", comm, RECOMPUTE_COMMS)
    marked = dict(marked_paths or {})
    if mode == "none" and not marked:
        return []
    paths = {path for node in gm.graph.nodes for path, _ in node.meta.get("nn_module_stack", {}).values()}
    # blocks: children of a ModuleList (or Sequential), whose last name is their index
    blocked = mode in ("full", "half", "pointwise", "alternate")
    every = {"pointwise": 1, "alternate": 2}.get(mode, 0)
    blocks = {path for path in paths if path.rpartition(".")[2].isdigit()} if blocked else set()
    if mode == "half":
        ordered = dict.fromkeys(path for path, _ in _module_runs(gm.graph, dict.fromkeys(blocks, comm)))
        blocks = set(list(ordered)[1::2])
    comms = dict.fromkeys(blocks, comm) | marked
    runs = _module_runs(gm.graph, comms)
    # a block holding a module the user marked runs again whole, that module's products included
    regions = [Region(nodes, comms[path], path, 0 if any(m == path or m.startswith(path + ".") for m in marked)
                      else every) for path, nodes in runs]
    cores = _attention_cores(gm.graph, {n for _, nodes in runs for n in nodes}) if mode == "selective" else []
    regions += [Region(nodes, comm, nodes[-1].name) for nodes in cores]
    for path in sorted(set(marked) - paths):
        warnings.warn(f"polyshard: recompute() marks `{path or type(gm).__name__}`, which runs no op of "
                      "its own in the captured graph; mark one of its submodules", stacklevel=3)
    if mode != "none" and not (blocks or cores):
        what = "blocks (children of a ModuleList)" if blocked else "scaled_dot_product_attention call"
        warnings.warn(f"polyshard: recompute={mode!r} finds no {what} to recompute in {type(gm).__name__}",
                      stacklevel=3)
    return regions


def _module_runs(graph: fx.Graph, paths: Mapping[str, str]) -> list[tuple[str, list[fx.Node]]]:
    """Maximal runs of consecutive nodes inside one of ``paths`` (the outermost, if nested).

    Nodes without a module stack (added by lowering: redistributions, local sizes) join the run
    they lie inside."""
    runs: list[tuple[str, list[fx.Node]]] = []
    current, pending = None, []
    for node in graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if not stack:
            pending.append(node)
            continue
        path = next((p for p, _ in stack.values() if p in paths), None)
        if path is not None and path == current:
            runs[-1][1].extend(pending + [node])
        elif path is not None:
            runs.append((path, [node]))
        current, pending = path, []
    return runs


def _attention_cores(graph: fx.Graph, taken: set[fx.Node]) -> list[list[fx.Node]]:
    """Each scaled_dot_product_attention call with the views that feed it from the q/k/v projections."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    cores = []
    for node in graph.nodes:
        if node.op != "call_function" or op_key(node) is not F.scaled_dot_product_attention or node in taken:
            continue
        core, todo = {node}, list(node.all_input_nodes)
        while todo:
            n = todo.pop()
            if (n.op in ("call_method", "call_function") and op_key(n) in _VIEWS and n not in taken and n not in core
                    and all(u in core for u in n.users)):
                core.add(n)
                todo.extend(n.all_input_nodes)
        cores.append(sorted(core, key=order.__getitem__))
    return cores


@dataclass(frozen=True)
class Recomputed:
    """What a recompute mode does to a graph, by node name: ``rerun`` (forward again in backward),
    ``freed`` (outputs not kept for backward), per region in graph order the outputs it frees, which are
    alive again while that region's backward runs, ``cached``: outputs a region keeps for its rerun
    whether or not a backward reads them (a region's kept products and attention), and the nodes of regions
    whose checkpoint policy watches every op: ``watched`` always (a region keeping products), ``watched_if_split`` where
    the program splits operators (a region keeping its collectives' results)."""

    rerun: frozenset[str] = frozenset()
    freed: frozenset[str] = frozenset()
    regions: tuple[frozenset[str], ...] = ()
    comm: str = "keep"
    cached: frozenset[str] = frozenset()
    watched: frozenset[str] = frozenset()
    watched_if_split: frozenset[str] = frozenset()

    def alike(self, name: str, twin: str) -> bool:
        """Whether recompute treats a node as its twin: both run again or neither, both outputs are freed, held or
        cached alike, and both are watched alike (a module marked for recompute in one layer only differs from its
        twin)."""
        return self._marks.get(name) == self._marks.get(twin)

    @cached_property
    def _marks(self) -> dict[str, tuple[bool, ...]]:
        """Per node in any of the sets :meth:`alike` compares, which of them hold it (a cost model asks of every
        node with a twin, for every plan it prices)."""
        sets = (self.rerun, self.freed, self.held, self.cached, self.watched, self.watched_if_split)
        return {name: tuple(name in names for names in sets) for name in frozenset().union(*sets)}

    @cached_property
    def held(self) -> frozenset[str]:
        """The largest region's freed outputs: what is alive again at the worst moment of backward."""
        return max(self.regions, key=len, default=frozenset())


def recomputed(gm: fx.GraphModule, mode: str, comm: str = "keep") -> Recomputed:
    """The nodes ``mode`` (and modules marked in ``gm``) recompute; quiet where a mode finds nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        regions = recompute_regions(gm, mode, comm, marked_modules(gm))
    modules = modules_of(gm)
    kept = [r.kept(modules) for r in regions]
    inner = tuple(frozenset(n.name for n in r.nodes if n not in keep and all(u in members for u in n.users))
                  for r, keep in zip(regions, kept) for members in [set(r.nodes)])
    rerun = frozenset(n.name for r, keep in zip(regions, kept) for n in r.nodes if n not in keep)
    cached = frozenset(n.name for keep in kept for n in keep)
    watched = frozenset(n.name for r in regions if r.keeps_every for n in r.nodes)
    keeping = frozenset(n.name for r in regions if r.comm == "keep" for n in r.nodes)
    return Recomputed(rerun, frozenset().union(*inner), inner, comm, cached, watched, keeping - watched)
