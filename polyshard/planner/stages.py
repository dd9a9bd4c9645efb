"""Where pipeline stages begin: the model's repeated blocks as units, and the contiguous split of
units into stages that minimises the largest stage's load (the planner's search and the runtime's
default cuts both use it)."""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Callable, Sequence

import numpy as np
import torch
from torch import fx, nn
from torch.utils._pytree import tree_map

from polyshard.errors import PolyshardError
from polyshard.cluster import Cluster
from polyshard.graph.capture import capture, shape_of
from polyshard.graph.regions import Recomputed
from polyshard.graph.stage_cuts import assign_chunks, block_paths, check_boundary_count, first_nodes
from polyshard.planner.cost.compute import TRAIN_FLOPS_PER_FORWARD, forward_flops, forward_seconds, op_overhead
from polyshard.planner.cost.memory import kept_copies, local_numel
from polyshard.plan import DTYPES, Plan
from polyshard.planner.propagate import propagate
from polyshard.schedule import ActionTime, schedule_actions, simulate

# load(band) -> [part, a, b]: the load of units part+a .. part+b as that part (inf where it may not hold them),
# read where a <= b; band(m) views an (units+1) x (units+1) matrix m of [start, end] values so indexed
Load = Callable[[Callable[[np.ndarray], np.ndarray]], np.ndarray]


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
    runs = first_nodes(gm)
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

    Dynamic program over (units taken, parts made) on the band of starts and ends that leave every
    part a unit: the loads of the whole band in one call, then one numpy pass per part; ties go to
    the earliest cut."""
    if not 1 <= parts <= units:
        return float("inf"), []
    width = units - parts + 1  # part k starts in k .. k+width-1 and ends in k+1 .. k+width

    def banded(matrix: np.ndarray) -> np.ndarray:  # [k, a, b] = matrix[k + a, k + 1 + b], a view
        rows, cols = matrix.strides
        return np.lib.stride_tricks.as_strided(matrix[:, 1:], (parts, width, width), (rows + cols, rows, cols),
                                               writeable=False)

    loads = np.maximum(load(banded), _empty_parts(width))
    best = np.full(units + 1, np.inf)
    best[0] = 0.0
    picks = []
    for k in range(parts):
        cost = np.maximum(best[k:k + width, None], loads[k])
        picks.append(k + cost.argmin(axis=0))  # the start of part k, by its end - (k + 1)
        best = np.full(units + 1, np.inf)
        best[k + 1:k + 1 + width] = cost.min(axis=0)
    if not np.isfinite(best[units]):
        return float("inf"), []
    cuts, j = [], units
    for k in range(parts - 1, 0, -1):
        j = int(picks[k][j - k - 1])
        cuts.append(j)
    return float(best[units]), cuts[::-1]


@functools.lru_cache(maxsize=64)
def _empty_parts(width: int) -> np.ndarray:
    """Over a band of starts k+a (rows) and ends k+1+b (columns): inf where the part would hold no unit
    (a > b), -inf elsewhere, so that a maximum with it blocks exactly those."""
    return np.where(np.triu(np.ones((width, width), dtype=bool)), -np.inf, np.inf)


def range_sums(costs: Sequence[float]) -> np.ndarray:
    """[i, j]: the sum of units i .. j-1's costs (a part's load where every part may hold any units)."""
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    return prefix[None, :] - prefix[:, None]


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
        flops[unit[node.name]] += forward_flops(node, plan.nodes[node.name], modules)
        out, shape = plan.nodes[node.name].output, shape_of(node)
        if shape is not None:
            memory[unit[node.name]] += local_numel(shape, out) * kept_copies(node, Recomputed())
        if node.op == "call_module":
            memory[unit[node.name]] += sum(p.numel() for p in modules[node.target].parameters())
    loads = np.maximum(*(range_sums(np.array(x) / (sum(x) or 1)) for x in (flops, memory)))
    _, cuts = min_max_partition(lambda banded: banded(loads), len(blocks), stages)
    return tuple(blocks[i] for i in cuts)


def chunk_seconds(gm: fx.GraphModule, plan: Plan, cluster: Cluster) -> tuple[list[float], list[float]]:
    """Predicted forward and backward seconds of each chunk the plan's stage boundaries cut ``gm`` into: its
    ops' compute plus their fixed costs, backward doing the work twice over (as the cost model counts them)."""
    modules = dict(gm.named_modules())
    dtype, itemsize = DTYPES[plan.precision]
    back = TRAIN_FLOPS_PER_FORWARD - 1
    chunks = len(plan.stage_boundaries) + 1
    chunk_of = assign_chunks(gm, plan.stage_boundaries)
    forward, backward = [0.0] * chunks, [0.0] * chunks
    for node in gm.graph.nodes:
        c = chunk_of.get(node.name)
        if c is not None:
            entry = plan.nodes[node.name]
            seconds = forward_seconds(node, entry, modules, cluster, dtype, itemsize)
            forward[c] += seconds + op_overhead(node, entry, cluster, 1, dtype)
            backward[c] += back * seconds + op_overhead(node, entry, cluster, back, dtype)
    return forward, backward


def predict_timings(model: nn.Module, example_inputs, plan: Plan, pp: int, cluster: Cluster) -> list[ActionTime]:
    """The plan's schedule simulated with the cost model's per-chunk times on one micro-batch of
    ``example_inputs``, without any process (``model`` may live on the meta device); a plan without stage
    cuts is cut into balanced ones first, as :func:`polyshard.plan` cuts it."""
    micro = tree_map(lambda t: t[:t.size(0) // plan.micro_batches] if isinstance(t, torch.Tensor) else t,
                     example_inputs)
    gm = capture(model, micro)
    if not plan.stage_boundaries:
        plan = replace(plan, stage_boundaries=balanced_boundaries(gm, pp * plan.virtual_stages, plan))
    check_boundary_count(plan.stage_boundaries, pp, plan.virtual_stages)
    actions = schedule_actions(plan.schedule, pp, plan.micro_batches, plan.virtual_stages)
    return simulate(actions, *chunk_seconds(gm, plan, cluster))
