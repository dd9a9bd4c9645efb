"""parallelize: capture -> propagate -> Plan -> lower, plus data-parallel gradient sync."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.utils._pytree import tree_map

from polyshard.cluster import Cluster
from polyshard.compiler.check import check_plan
from polyshard.compiler.lower import lower, whole_parameter
from polyshard.errors import PolyshardError
from polyshard.graph.capture import PIN_ATTR, batch_rows, capture, shape_of
from polyshard.graph.export import SIGNATURE_KEY
from polyshard.layout import Layout
from polyshard.mesh import Mesh, current_mesh
from polyshard.planner.cost.overlap import choose_copies
from polyshard.planner.config import Fixed
from polyshard.plan import RECOMPUTE_COMMS, RECOMPUTE_MODES, Plan, check_choice
from polyshard.planner.propagate import propagate
from polyshard.planner.dataset import input_layouts
from polyshard.pin import tp_plan_pins
from polyshard.planner.search import search as search_plan
from polyshard.planner.stages import balanced_boundaries, pp_plan_units
from polyshard.runtime.data_parallel import DEFAULT_BUCKET_BYTES, GradientSync
from polyshard.runtime.fusion import fusion_groups
from polyshard.runtime.interleave import interleave
from polyshard.graph.regions import marked_modules
from polyshard.runtime.recompute import apply_recompute

COPIES_ATTR = "_polyshard_copies"


class ParallelModule(nn.Module):
    """This rank's share of a model. Call it with this rank's batch (see :meth:`local_batch`)."""

    def __init__(self, program: fx.GraphModule, plan: Plan, mesh: Mesh, bucket_bytes: int,
                 recompute_paths: dict[str, str] | None = None):
        super().__init__()
        object.__setattr__(self, "_single_copy", program)  # not a submodule: the same parameters
        self.recompute_paths = recompute_paths or {}
        self.plan = plan
        self.program = self._runnable(plan.copies)
        self.mesh = mesh
        group = mesh.data_group()
        self.grad_sync = (GradientSync(list(program.parameters()), group, bucket_bytes, fusion_groups(program))
                          if group is not None else None)

    def set_copies(self, copies: int) -> None:
        """Run each batch as ``copies`` interleaved slices (1: as one)."""
        self.plan = dataclasses.replace(self.plan, copies=copies)
        self.program = self._runnable(copies)

    def _runnable(self, copies: int) -> fx.GraphModule:
        """The program with the plan's recomputed regions outlined, interleaved into ``copies``."""
        recomputed = apply_recompute(self._single_copy, self.plan.recompute, self.plan.recompute_comm,
                                     self.recompute_paths)
        return interleave(recomputed, copies)

    def forward(self, *args, **kwargs):
        """Called as the model is: a captured call signature maps keywords in and structured outputs out."""
        signature = self._single_copy.meta.get(SIGNATURE_KEY)
        if signature is None:
            return self.program(*args, **kwargs)
        return signature.unflatten(self.program(*signature.flatten(args, kwargs)))

    def local_batch(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's rows of a global batch (every rank passes the same global batch), and of each input a
        dataset strategy splits (an image by height and width), its piece."""
        rows = self.mesh.local_rows(*tensors)
        inputs = [n.name for n in self._single_copy.graph.nodes if n.op == "placeholder"]
        return tuple(_piece(t, self.plan.nodes[name].output, self.mesh) if name in self.plan.nodes else t
                     for t, name in zip(rows, inputs))

    def no_sync(self):
        """Skip the gradient all-reduce (inner steps of gradient accumulation)."""
        return self.grad_sync.no_sync() if self.grad_sync is not None else contextlib.nullcontext()

    def local_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's piece of each parameter, by its name in the plan (whatever wraps the program)."""
        return dict(self._single_copy.named_parameters())

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, on every rank (gathers split ones)."""
        return {name: whole_parameter(p, name, self.plan, self.mesh) for name, p in self.local_parameters().items()}


def _piece(t: torch.Tensor, layout, mesh: Mesh) -> torch.Tensor:
    """This rank's piece of ``t`` in ``layout`` (a slice, no communication)."""
    if not isinstance(layout, Layout) or layout.is_replicated:
        return t
    layout.check_divides(t.shape, "input")
    return t[mesh.piece(layout, t.shape)]


def parallelize(model: nn.Module, example_inputs: Sequence | Mapping | None = None, mesh: Mesh | None = None,
                plan: Plan | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                copies: int | str | None = None, search: bool = False,
                memory_limit_bytes: float | None = None, recompute: str | None = None,
                recompute_comm: str | None = None, schedule: str | None = None, micro_batches: int | None = None,
                virtual_stages: int | None = None, sequence_parallel: bool = False,
                tp_plan: bool = False, pp_plan: bool = False,
                dataset_strategy: Sequence | None = None) -> ParallelModule:
    """Split ``model`` over the mesh: pinned ops keep their strategies, the others follow the op rules.

    ``example_inputs`` (one rank's batch; shapes matter, not values): the positional arguments, or a
    mapping of keyword arguments (``{"input_ids": ..., "labels": ...}`` for a transformers model, which
    is then called as written and returns its own output); by default the model's ``example_inputs()``. A given ``plan`` (e.g. edited by hand) is used instead of propagation.
    ``copies``: interleaved batch slices (multi-copy parallel); "auto" lets the cost model choose;
    by default the plan's, or what :func:`micro_batch_interleaved` set on the model.
    ``search``: choose every op's strategy by the cost model's integer program (pins kept) instead
    of the rules' defaults, and recompute and offload where memory needs them, under
    ``memory_limit_bytes`` per device (default: the device's memory).
    ``recompute`` ("none", "selective", "full") and ``recompute_comm`` ("keep", "recompute"): see
    :class:`Plan`; by default the plan's. Modules marked by :func:`polyshard.recompute` are recomputed too.
    A mesh with a ``pp`` axis gives a :class:`~polyshard.runtime.pipeline.PipelineModule`, run by the
    plan's (or these) ``schedule``, ``micro_batches`` and ``virtual_stages``.
    ``sequence_parallel``: row-parallel products reduce-scatter along the sequence instead of
    all-reducing, so norms, dropout and residual adds run on a slice of it (Megatron's sequence parallel).
    ``tp_plan``: pin the modules a transformers model's own tensor-parallel plan names (its ``_tp_plan``:
    colwise, rowwise, ...) over the operator axes; the other ops follow the rules (or the search).
    ``pp_plan``: pipeline stages may begin at every module a transformers model's own pipeline plan names
    (its ``_pp_plan``: the embedding, each decoder layer, the final norm, the head), not only at its layers.
    ``dataset_strategy`` (MindSpore's): per positional input, how its dims split over the operator axes,
    as slice counts (``(1, 1, 2, 2)``: an image by height and width on h=2, w=2) or axis names
    (``(None, None, "h", "w")``), or None for whole; each rank is then called with its piece
    (:meth:`ParallelModule.local_batch` cuts them). Convolutions, pooling and batch norm keep the split.
    """
    if recompute is not None:
        check_choice("recompute", recompute, RECOMPUTE_MODES)
    if recompute_comm is not None:
        check_choice("recompute_comm", recompute_comm, RECOMPUTE_COMMS)
    mesh = mesh or current_mesh()
    if example_inputs is None:
        if not hasattr(model, "example_inputs"):
            raise PolyshardError(
                f"{type(model).__name__} has no example_inputs(); pass example_inputs=(batch tensors...) "
                "so polyshard can read the shapes"
            )
        example_inputs = model.example_inputs()
    gm = capture(model, example_inputs)
    if dataset_strategy is not None and (plan is not None or mesh.pp > 1):
        raise PolyshardError("dataset_strategy lays out the inputs for propagation or the search (a plan lays out "
                             "its own inputs); it does not combine with a given plan or a pipeline yet: drop one")
    inputs = input_layouts(gm, dataset_strategy, mesh.op_axes)
    if tp_plan:
        _pin_tp_plan(model, gm, mesh)
    if pp_plan and mesh.pp == 1:
        raise PolyshardError(f"pp_plan=True needs a pipeline axis to cut stages for; the mesh {mesh} has no pp")
    units = pp_plan_units(model, gm) if pp_plan else ()
    if plan is not None:
        check_plan(plan, gm, mesh.axes)
    else:
        seen: set[str] = set()

        def warn(msg: str) -> None:
            if msg not in seen:
                seen.add(msg)
                warnings.warn(f"polyshard: {msg}", stacklevel=3)

        if search:
            cluster = mesh.cluster or Cluster.from_env()
            row = tree_map(lambda t: t[:1] if isinstance(t, torch.Tensor) else t, example_inputs)
            plan, _ = search_plan(model, row, cluster, batch_rows(example_inputs) * mesh.num_data_shards,
                                  memory_limit_bytes, meshes=[mesh.axes], data_axes=mesh.data_axes,
                                  fixed=Fixed(sp=1) if sequence_parallel else Fixed(), pp_plan=pp_plan,
                                  dataset_strategy=dataset_strategy)
        else:
            plan = propagate(gm, mesh.op_axes, warn, sequence_parallel, inputs)
    plan = dataclasses.replace(plan, mesh=mesh.axes, data_axes=mesh.data_axes)
    copies = copies if copies is not None else getattr(model, COPIES_ATTR, None)
    if copies == "auto":
        cluster = mesh.cluster or Cluster.from_env()
        copies, _ = choose_copies(gm, plan, cluster, batch_rows=batch_rows(example_inputs))
    if copies is not None and (not isinstance(copies, int) or copies < 1):
        raise PolyshardError(f"copies must be a positive integer or 'auto', got {copies!r}")
    plan = dataclasses.replace(plan, copies=copies or plan.copies, recompute=recompute or plan.recompute,
                               recompute_comm=recompute_comm or plan.recompute_comm,
                               schedule=schedule or plan.schedule, micro_batches=micro_batches or plan.micro_batches,
                               virtual_stages=virtual_stages or plan.virtual_stages)
    if units and not plan.stage_boundaries:
        plan = dataclasses.replace(plan, stage_boundaries=balanced_boundaries(
            gm, mesh.pp * plan.virtual_stages, plan, units))
    if dist.is_initialized() and dist.get_world_size() != mesh.world_size:
        raise PolyshardError(f"mesh {mesh} does not match the world of {dist.get_world_size()} processes")
    if mesh.pp > 1:
        from polyshard.runtime.pipeline import parallelize_pipeline  # it builds on this module

        return parallelize_pipeline(model, example_inputs, plan, mesh, bucket_bytes)
    return ParallelModule(lower(gm, plan, mesh), plan, mesh, bucket_bytes, marked_modules(model))


def _pin_tp_plan(model: nn.Module, gm: fx.GraphModule, mesh: Mesh) -> None:
    """Pins from the model's own tensor-parallel plan, for the modules the graph calls whole."""
    plan = getattr(model, "_tp_plan", None)
    if not plan:
        raise PolyshardError(f"tp_plan=True, but {type(model).__name__} carries no tensor-parallel plan "
                             "(transformers models have one in `_tp_plan`)")
    if not mesh.op_axes:
        raise PolyshardError(f"tp_plan=True needs an operator axis to split over; the mesh {mesh} has none")
    calls = {n.target: len(shape_of(n.args[0])) for n in gm.graph.nodes if n.op == "call_module"}
    for path, pin in tp_plan_pins(plan, calls, tuple(a for a, _ in mesh.op_axes)).items():
        module = model.get_submodule(path)
        if type(module) not in (nn.Linear, nn.Embedding):
            raise PolyshardError(f"the tp plan splits `{path}`, a {type(module).__name__}; polyshard pins plans "
                                 "on Linear and Embedding modules; leave tp_plan off and let the rules split it")
        setattr(module, PIN_ATTR, pin)


def micro_batch_interleaved(model: nn.Module, copies: int = 2) -> nn.Module:
    """Run each batch as ``copies`` interleaved slices, so one slice's collectives overlap another's
    compute. On a ParallelModule it takes effect at once; on a model, when it is parallelized."""
    if not isinstance(copies, int) or copies < 1:
        raise PolyshardError(f"copies must be a positive integer, got {copies!r}")
    if isinstance(model, ParallelModule):
        model.set_copies(copies)
    else:
        setattr(model, COPIES_ATTR, copies)
    return model
