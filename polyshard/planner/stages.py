"""Where pipeline stages begin: the model's repeated blocks as units, and the contiguous split of
units into stages that minimises the largest stage's load (the planner's search and the runtime's
default cuts both use it)."""

from __future__ import annotations

import bisect
from typing import Callable, Sequence

import numpy as np
from torch import fx, nn

from polyshard.errors import PolyshardError
from polyshard.graph.capture import shape_of
from polyshard.graph.regions import Recomputed
from polyshard.planner.cost.compute import forward_flops
from polyshard.planner.cost.memory import kept_copies, local_numel
from polyshard.plan import Plan
from polyshard.planner.propagate import propagate

# load(part, starts, ends) -> each unit range's load as part ``part`` (inf where the part may not hold it)
Load = Callable[[int, np.ndarray, np.ndarray], np.ndarray]


def block_paths(gm: fx.GraphModule) -> list[str]:
    """The model's repeated blocks (outermost children of a ModuleList: paths ending in an index), in run order."""
    paths = [p for p in _first_node(gm) if p.rpartition(".")[2].isdigit()]
    return [p for p in paths if not any(p.startswith(q + ".") for q in paths)]


def model_pp_plan(model: nn.Module) -> dict[str, tuple] | None:
    """A transformers model's own pipeline plan (its ``_pp_plan``: the modules a pipeline may cut
    between, in module paths from ``model``), found on ``model`` or the outermost submodule carrying one."""
    for prefix, module in model.named_modules():
        plan = getattr(module, "_pp_plan", None)
        if plan:
            return {f"{prefix}.{path}" if prefix else path: io for path, io in plan.items()}
    return None


def pp_plan_units(model: nn.Module, gm: fx.GraphModule) -> list[str]:
    """Stage units as the model's own pipeline plan names them, in run order (``gm``: its capture): each
    named module that runs, a ModuleList's children one by one (``model.layers`` -> ``model.layers.0``, ...)."""
    pp_plan = model_pp_plan(model)
    if not pp_plan:
        raise PolyshardError(f"pp_plan asked for, but {type(model).__name__} carries no pipeline plan "
                             "(transformers models have one in `_pp_plan`)")
    runs = _first_node(gm)
    units = []
    for path in pp_plan:
        if path in runs:
            units.append(path)
        else:
            units.extend(p for p in runs if p.startswith(path + ".") and p[len(path) + 1:].isdigit())
    return sorted(units, key=runs.__getitem__)


def pp_plan_agreement(model: nn.Module, gm: fx.GraphModule, boundaries: Sequence[str],
                      units: Sequence[str]) -> dict | None:
    """Where stage cuts stand against the model's own pipeline plan: the cuts, those at modules it does
    not name, and the cuts it allows that were not among the ``units`` considered. None without either."""
    if not model_pp_plan(model) or not boundaries:
        return None
    named = pp_plan_units(model, gm)
    return {"cuts": list(boundaries), "departures": [b for b in boundaries if b not in named],
            "not_considered": [u for u in named[1:] if u not in units]}


def _first_node(gm: fx.GraphModule) -> dict[str, int]:
    """Each module path that runs in ``gm``, with the index of its first node."""
    first: dict[str, int] = {}
    for i, node in enumerate(gm.graph.nodes):
        for path, _ in node.meta.get("nn_module_stack", {}).values():
            first.setdefault(path, i)
    return first


def assign_chunks(gm: fx.GraphModule, boundaries: Sequence[str]) -> dict[str, int]:
    """Each computing node's chunk: chunk k runs from the first node of ``boundaries[k-1]`` on."""
    first, nodes = _first_node(gm), list(gm.graph.nodes)
    missing = [b for b in boundaries if b not in first]
    if missing:
        raise PolyshardError(f"stage boundaries {missing} are not modules that run in {type(gm).__name__}; "
                             f"blocks are: {', '.join(block_paths(gm)) or 'none'}")
    starts = [first[b] for b in boundaries]
    if any(a >= b for a, b in zip(starts, starts[1:])):
        raise PolyshardError(f"stage boundaries {list(boundaries)} are not in the order the model runs them")
    return {n.name: bisect.bisect_right(starts, i) for i, n in enumerate(nodes)
            if n.op not in ("placeholder", "get_attr", "output")}


def even_partition(units: int, parts: int) -> list[int]:
    """Starts of parts 2.. when ``units`` are dealt out as evenly as counts allow, the larger parts first
    (Megatron-LM's layers per stage; DeepSpeed's uniform partition); [] when a part would be empty."""
    if not 1 <= parts <= units:
        return []
    size, extra = divmod(units, parts)
    starts = [k * size + min(k, extra) for k in range(1, parts)]
    return starts


def min_max_partition(load: Load, units: int, parts: int) -> tuple[float, list[int]]:
    """(largest part's load, starts of parts 2..) of the contiguous split of ``units`` units into
    ``parts`` non-empty parts that minimises the largest part's load; (inf, []) when none is allowed.

    Dynamic program over (units taken, parts made), one numpy pass per part over the band of
    starts and ends that leave every part a unit; ties go to the earliest cut."""
    if not 1 <= parts <= units:
        return float("inf"), []
    width = units - parts + 1  # part k ends somewhere in k+1 .. k+width
    offsets = np.arange(width)
    best = np.full(units + 1, np.inf)
    best[0] = 0.0
    picks = []
    for k in range(parts):
        start, end = k + offsets[:, None], k + 1 + offsets[None, :]  # broadcast to every (start, end)
        cost = np.where(start < end, np.maximum(best[start], load(k, start, end)), np.inf)
        pick = cost.argmin(axis=0)
        best = np.full(units + 1, np.inf)
        best[k + 1:k + 1 + width] = cost[pick, offsets]
        picks.append(k + pick)  # the start of part k, by its end - (k + 1)
    if not np.isfinite(best[units]):
        return float("inf"), []
    cuts, j = [], units
    for k in range(parts - 1, 0, -1):
        j = int(picks[k][j - k - 1])
        cuts.append(j)
    return float(best[units]), cuts[::-1]


def sum_load(costs: Sequence[float]) -> Load:
    """A part's load as the sum of its units' costs."""
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    return lambda k, i, j: prefix[j] - prefix[i]


def balanced_boundaries(gm: fx.GraphModule, stages: int, plan: Plan | None = None,
                        units: Sequence[str] = ()) -> tuple[str, ...]:
    """Cuts between ``units`` (default: the repeated blocks) that even out the stages' loads, a stage's
    load being the larger of its shares of forward FLOPs and of memory (parameters and kept activations)."""
    blocks = list(units) or block_paths(gm)
    if len(blocks) < stages:
        raise PolyshardError(f"{type(gm).__name__} has {len(blocks)} "
                             f"{'units' if units else 'repeated blocks (children of a ModuleList)'} to cut into "
                             f"{stages} pipeline stages; use fewer stages or mark the cuts with "
                             "polyshard.pipeline_stage")
    plan = plan or propagate(gm, (), lambda msg: None)
    unit = assign_chunks(gm, blocks[1:])
    modules = dict(gm.named_modules())
    flops, memory = [0.0] * len(blocks), [0.0] * len(blocks)
    for node in gm.graph.nodes:
        if node.name not in unit:
            continue
        flops[unit[node.name]] += forward_flops(node, plan, modules)
        out, shape = plan.nodes[node.name].output, shape_of(node)
        if shape is not None:
            memory[unit[node.name]] += local_numel(shape, out) * kept_copies(node, Recomputed())
        if node.op == "call_module":
            memory[unit[node.name]] += sum(p.numel() for p in modules[node.target].parameters())
    share_flops, share_memory = (sum_load(np.array(x) / (sum(x) or 1)) for x in (flops, memory))
    _, cuts = min_max_partition(lambda k, i, j: np.maximum(share_flops(k, i, j), share_memory(k, i, j)),
                                len(blocks), stages)
    return tuple(blocks[i] for i in cuts)
