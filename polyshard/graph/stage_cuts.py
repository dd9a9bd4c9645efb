"""Where a captured graph may be cut into pipeline stages: its repeated blocks, the modules a user marked,
and which chunk each node falls in once the cuts are chosen. Planning chooses the cuts; compiling makes them."""

from __future__ import annotations

import bisect
from typing import Sequence

from torch import fx, nn

from polyshard.errors import PolyshardError

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


def first_nodes(gm: fx.GraphModule) -> dict[str, int]:
    """Each module path that runs in ``gm``, with the index of its first node."""
    first: dict[str, int] = {}
    for i, node in enumerate(gm.graph.nodes):
        for path, _ in node.meta.get("nn_module_stack", {}).values():
            first.setdefault(path, i)
    return first


def block_paths(gm: fx.GraphModule) -> list[str]:
    """The model's repeated blocks (outermost children of a ModuleList: paths ending in an index), in run order."""
    paths = [p for p in first_nodes(gm) if p.rpartition(".")[2].isdigit()]
    return [p for p in paths if not any(p.startswith(q + ".") for q in paths)]


def assign_chunks(gm: fx.GraphModule, boundaries: Sequence[str]) -> dict[str, int]:
    """Each computing node's chunk: chunk k runs from the first node of ``boundaries[k-1]`` on."""
    first, nodes = first_nodes(gm), list(gm.graph.nodes)
    missing = [b for b in boundaries if b not in first]
    if missing:
        raise PolyshardError(f"stage boundaries {missing} are not modules that run in {type(gm).__name__}; "
                             f"blocks are: {', '.join(block_paths(gm)) or 'none'}")
    starts = [first[b] for b in boundaries]
    if any(a >= b for a, b in zip(starts, starts[1:])):
        raise PolyshardError(f"stage boundaries {list(boundaries)} are not in the order the model runs them")
    return {n.name: bisect.bisect_right(starts, i) for i, n in enumerate(nodes)
            if n.op not in ("placeholder", "get_attr", "output")}


def check_boundary_count(boundaries: Sequence[str], pp: int, virtual_stages: int) -> None:
    """``pp`` x ``virtual_stages`` chunks need one boundary fewer."""
    chunks = pp * virtual_stages
    if len(boundaries) != chunks - 1:
        raise PolyshardError(f"{len(boundaries)} stage boundaries {list(boundaries)} make {len(boundaries) + 1} "
                             f"stages; pp={pp} x virtual_stages={virtual_stages} needs {chunks}, "
                             f"so {chunks - 1} boundaries")
