"""polyshard.plan: every decision for one model on one mesh, made once, in one process, before anything runs.

Propagation or the search lays out each op; then come the copies to interleave, the recompute and schedule
settings asked for, and a pipeline's stage cuts. Compiling and running read the Plan and change nothing.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Mapping, Sequence

import torch
from torch import fx, nn
from torch.utils._pytree import tree_map

from polyshard.cluster import Cluster
from polyshard.errors import PolyshardError
from polyshard.graph.capture import batch_rows, capture, example_inputs_of, shape_of
from polyshard.graph.export import SCALED_LOOKUP
from polyshard.graph.stage_cuts import check_boundary_count, stage_boundaries_of
from polyshard.mesh import Mesh, current_mesh
from polyshard.pin import COPIES_ATTR, PIN_ATTR, model_tp_plan, tp_plan_pins
from polyshard.plan import RECOMPUTE_COMMS, RECOMPUTE_MODES, Plan, check_choice
from polyshard.planner.check import check_plan
from polyshard.planner.config import Fixed
from polyshard.planner.cost.overlap import choose_copies, first_bucket_bytes
from polyshard.planner.dataset import input_layouts
from polyshard.planner.propagate import propagate
from polyshard.planner.search import search as search_plan
from polyshard.planner.stages import balanced_boundaries, pp_plan_units
from polyshard.schedule import check_schedule


def plan_model(model: nn.Module, example_inputs: Sequence | Mapping | None = None, mesh: Mesh | None = None,
               **options) -> Plan:
    """The Plan :func:`polyshard.compile` runs for ``model`` on ``mesh`` (default: the current one). The
    ``options`` are :func:`polyshard.parallelize`'s: ``plan``, ``copies``, ``search``, ``memory_limit_bytes``,
    ``recompute``, ``recompute_comm``, ``schedule``, ``micro_batches``, ``virtual_stages``,
    ``sequence_parallel``, ``tp_plan``, ``pp_plan``, ``dataset_strategy``, ``settings`` and ``bucket_bytes``."""
    mesh = mesh or current_mesh()
    example_inputs = example_inputs_of(model, example_inputs)
    return plan_captured(model, capture(model, example_inputs), example_inputs, mesh, **options)


def plan_captured(model: nn.Module, gm: fx.GraphModule, example_inputs: Sequence | Mapping, mesh: Mesh,
                  plan: Plan | None = None, copies: int | str | None = None, search: bool = False,
                  memory_limit_bytes: float | None = None, recompute: str | Sequence[str] | None = None,
                  recompute_comm: str | None = None, schedule: str | None = None, micro_batches: int | None = None,
                  virtual_stages: int | None = None, sequence_parallel: bool = False, tp_plan: bool = False,
                  pp_plan: bool = False, dataset_strategy: Sequence | None = None,
                  settings: Mapping[str, object] | None = None, bucket_bytes: int | None = None) -> Plan:
    """:func:`plan_model` on ``gm``, ``model`` captured on ``example_inputs`` (the caller lowers it next)."""
    given = plan is not None
    stage_recompute = None
    if recompute is not None and not isinstance(recompute, str):  # a mode per pipeline chunk
        stage_recompute, recompute = tuple(recompute), None
        for mode in stage_recompute:
            check_choice("recompute", mode, RECOMPUTE_MODES)
    if recompute is not None:
        check_choice("recompute", recompute, RECOMPUTE_MODES)
        stage_recompute = ()  # one mode for every chunk
    if recompute_comm is not None:
        check_choice("recompute_comm", recompute_comm, RECOMPUTE_COMMS)
    if dataset_strategy is not None and (plan is not None or mesh.pp > 1):
        raise PolyshardError("dataset_strategy lays out the inputs for propagation or the search (a plan lays out "
                             "its own inputs); it does not combine with a given plan or a pipeline yet: drop one")
    inputs = input_layouts(gm, dataset_strategy, mesh.op_axes)
    if tp_plan:
        if not mesh.op_axes:
            raise PolyshardError(f"tp_plan=True needs an operator axis to split over; the mesh {mesh} has none")
        pin_tp_plan(model, gm, tuple(a for a, _ in mesh.op_axes))
    if pp_plan and mesh.pp == 1:
        raise PolyshardError(f"pp_plan=True needs a pipeline axis to cut stages for; the mesh {mesh} has no pp")
    if plan is not None:
        check_plan(plan, gm, mesh.axes)
    elif search:
        cluster = mesh.cluster or Cluster.from_env()
        row = tree_map(lambda t: t[:1] if isinstance(t, torch.Tensor) else t, example_inputs)
        plan, _ = search_plan(model, row, cluster, batch_rows(example_inputs) * mesh.num_data_shards,
                              memory_limit_bytes, meshes=[mesh.axes], data_axes=mesh.data_axes,
                              fixed=Fixed(sp=1) if sequence_parallel else Fixed(), pp_plan=pp_plan,
                              dataset_strategy=dataset_strategy)
    else:
        plan = propagate(gm, mesh.op_axes, _warn_once(), sequence_parallel, inputs)
    plan = dataclasses.replace(plan, mesh=mesh.axes, data_axes=mesh.data_axes)
    copies = copies if copies is not None else getattr(model, COPIES_ATTR, None)
    if copies == "auto":
        copies, _ = choose_copies(gm, plan, mesh.cluster or Cluster.from_env(), batch_rows=batch_rows(example_inputs))
    if copies is not None and (not isinstance(copies, int) or copies < 1):
        raise PolyshardError(f"copies must be a positive integer or 'auto', got {copies!r}")
    asked = dict(recompute=recompute, stage_recompute=stage_recompute, recompute_comm=recompute_comm,
                 schedule=schedule, micro_batches=micro_batches, virtual_stages=virtual_stages)
    plan = dataclasses.replace(plan, copies=copies or plan.copies,
                               **{**(settings or {}), **{k: v for k, v in asked.items() if v is not None}})
    if not given or bucket_bytes is not None:  # a given plan keeps its buckets unless asked otherwise
        size = bucket_bytes or plan.bucket_bytes
        plan = dataclasses.replace(plan, bucket_bytes=size,
                                   first_bucket_bytes=first_bucket_bytes(mesh.cluster or Cluster.from_env(), size))
    if mesh.pp > 1:
        plan = _cut_stages(model, gm, plan, mesh.pp, pp_plan)
    return plan


def _cut_stages(model: nn.Module, gm: fx.GraphModule, plan: Plan, pp: int, pp_plan: bool) -> Plan:
    """The plan's own stage cuts, else the modules marked by ``pipeline_stage``, else balanced ones."""
    check_schedule(plan.schedule, pp, plan.micro_batches, plan.virtual_stages)
    units = pp_plan_units(model, gm) if pp_plan else ()
    boundaries = (plan.stage_boundaries or (() if units else stage_boundaries_of(model))
                  or balanced_boundaries(gm, pp * plan.virtual_stages, plan, units))
    check_boundary_count(boundaries, pp, plan.virtual_stages)
    return dataclasses.replace(plan, stage_boundaries=tuple(boundaries))


def _warn_once():
    """A warning sink that says each message once."""
    seen: set[str] = set()

    def warn(msg: str) -> None:
        if msg not in seen:
            seen.add(msg)
            warnings.warn(f"polyshard: {msg}", stacklevel=4)

    return warn


def pin_tp_plan(model: nn.Module, gm: fx.GraphModule, axes: tuple[str, ...], asked_by: str = "tp_plan=True",
                name: str = "") -> None:
    """Pins from the model's own tensor-parallel plan (:func:`model_tp_plan`), splitting over the operator
    ``axes``, for the modules ``gm`` (the model's capture) calls whole; a refusal names the option that asked
    (``asked_by``) and the model (``name``, else its class)."""
    plan = model_tp_plan(model)
    if not plan:
        raise PolyshardError(f"{asked_by}: {name or type(model).__name__} carries no tensor-parallel plan of its own "
                             f"(transformers models name one in `_tp_plan`); leave out {asked_by} and the rules "
                             "split it")
    nodes = {n.target: n for n in gm.graph.nodes if n.op == "call_module"}
    calls = {target: len(shape_of(n.args[0])) for target, n in nodes.items()}
    for path, pin in tp_plan_pins(plan, calls, axes).items():
        module = model.get_submodule(path)
        if not _pinnable(module, nodes[path]):
            raise PolyshardError(f"the tp plan splits `{path}`, a {type(module).__name__}; polyshard pins plans "
                                 "on Linear and Embedding modules; leave tp_plan off and let the rules split it")
        setattr(module, PIN_ATTR, pin)


def _pinnable(module: nn.Module, call: fx.Node) -> bool:
    """Whether a pin's split of a Linear or Embedding holds for ``module``: torch's own, or a subclass whose forward
    capture saw only scale the rows it looks up (Gemma's embedding)."""
    return type(module) in (nn.Linear, nn.Embedding) or \
        (isinstance(module, nn.Embedding) and bool(call.meta.get(SCALED_LOOKUP)))
