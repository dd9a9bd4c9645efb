"""The entry points: ``shard`` pins a strategy; ``plan`` decides; ``compile`` builds this rank's share;
``parallelize`` does both."""

from __future__ import annotations

from typing import Mapping, Sequence, TypeVar

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from polyshard.compiler.eager import ShardedCallable
from polyshard.errors import PolyshardError
from polyshard.graph.capture import capture, example_inputs_of
from polyshard.mesh import Mesh, current_mesh
from polyshard.pin import Strategy, make_pin, pin_module
from polyshard.plan import Plan
from polyshard.planner.check import check_plan
from polyshard.planner.plan_model import plan_captured, plan_model
from polyshard.runtime.parallel import ParallelModule, compile_captured
from polyshard.runtime.pipeline import PipelineModule

plan = plan_model

T = TypeVar("T")


def shard(target: T, in_strategy: Strategy, out_strategy: Sequence | None = None,
          manual_split: Sequence[int] | None = None) -> T:
    """Pin a strategy, MindSpore-style: per input, slices per dim (``((2, 1), (1, 1))``) or axis names.

    A module is returned as is, marked: :func:`polyshard.parallelize` honours the pin (for Linear
    the strategy covers ``(input, weight)``, weight as stored). A function is returned wrapped: it
    runs sharded when called, eagerly, and as a pinned op inside a parallelized model.
    ``manual_split`` (an ``nn.Embedding``'s, MindSpore's Gather option): the table's rows per piece where
    its strategy splits them unevenly, ``(10, 20, 30, 4)`` for 64 rows in 4 pieces; each rank keeps its
    rows, looks up the ids they hold, and the pieces' lookups are summed.
    """
    if isinstance(target, nn.Module):
        return pin_module(target, in_strategy, out_strategy, manual_split)
    if manual_split is not None:
        raise PolyshardError("manual_split splits an nn.Embedding's table; pin the module, not a function")
    if callable(target):
        name = getattr(target, "__name__", type(target).__name__)
        return ShardedCallable(target, make_pin(in_strategy, out_strategy, target, name))
    raise PolyshardError(f"shard() takes an nn.Module or a function, not {type(target).__name__}")


__all__ = ["shard"]


def compile(model: nn.Module, plan: Plan, example_inputs: Sequence | Mapping | None = None,  # noqa: A001
            mesh: Mesh | None = None) -> ParallelModule | PipelineModule:
    """This rank's share of ``model`` as ``plan`` (from :func:`plan`, or edited by hand) lays it out, checked
    against the model first."""
    mesh = mesh or current_mesh()
    example_inputs = on_device(model, example_inputs_of(model, example_inputs), mesh)
    gm = capture(model, example_inputs)
    check_plan(plan, gm, mesh.axes)
    return compile_captured(model, gm, example_inputs, plan, mesh)


def on_device(model: nn.Module, example_inputs: Sequence | Mapping, mesh: Mesh) -> Sequence | Mapping:
    """Move ``model`` to this rank's device, as FSDP2 places what it shards, and return ``example_inputs`` there
    too, so the captured program and the split parameters live on the GPU; a model on the meta device stays."""
    if any(p.device.type == "meta" for p in model.parameters()):
        return example_inputs
    model.to(mesh.device)
    return tree_map_only(torch.Tensor, lambda t: t.to(mesh.device), example_inputs)


def parallelize(model: nn.Module, example_inputs: Sequence | Mapping | None = None, mesh: Mesh | None = None,
                plan: Plan | None = None, bucket_bytes: int | None = None,
                copies: int | str | None = None, search: bool = False,
                memory_limit_bytes: float | None = None, recompute: str | Sequence[str] | None = None,
                recompute_comm: str | None = None, schedule: str | None = None, micro_batches: int | None = None,
                virtual_stages: int | None = None, sequence_parallel: bool = False,
                tp_plan: bool = False, pp_plan: bool = False,
                dataset_strategy: Sequence | None = None,
                settings: Mapping[str, object] | None = None) -> ParallelModule | PipelineModule:
    """Split ``model`` over the mesh, :func:`compile` of :func:`plan` (the model captured once): pinned ops keep
    their strategies, the others follow the op rules. The model moves to the rank's device (its GPU) first.

    ``example_inputs`` (one rank's batch; shapes matter, not values): the positional arguments (a lone tensor:
    the one argument), or a mapping of keyword arguments (``{"input_ids": ..., "labels": ...}`` for a
    transformers model, which is then called as written and returns its own output); by default the model's
    ``example_inputs()``.
    A given ``plan`` (e.g. edited by hand) is used instead of propagation and completed (copies, stage cuts).
    ``copies``: interleaved batch slices (multi-copy parallel); "auto" lets the cost model choose;
    by default the plan's, or what :func:`micro_batch_interleaved` set on the model.
    ``search``: choose every op's strategy by the cost model's integer program (pins kept) instead
    of the rules' defaults, and recompute and offload where memory needs them, under
    ``memory_limit_bytes`` per device (default: the device's memory).
    ``recompute`` ("none", "selective", "pointwise", "alternate", "half", "full") and ``recompute_comm``
    ("keep", "recompute"): see :class:`Plan`; by default the plan's; in a pipeline also one mode per chunk
    (``("full", "none")``: the first stage recomputes, the second keeps its activations). Modules marked by
    :func:`polyshard.recompute` are recomputed too.
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
    ``settings``: other :class:`Plan` fields to set as given (``optimizer``, ``zero``, ``precision``, ``offload``, ...).
    ``bucket_bytes``: gradients per data-parallel collective (default 25 MiB, or a given plan's); the plan's first
    bucket is small only where communication runs beside compute.
    """
    mesh = mesh or current_mesh()
    example_inputs = on_device(model, example_inputs_of(model, example_inputs), mesh)
    gm = capture(model, example_inputs)
    made = plan_captured(model, gm, example_inputs, mesh, plan, copies, search, memory_limit_bytes, recompute,
                         recompute_comm, schedule, micro_batches, virtual_stages, sequence_parallel, tp_plan,
                         pp_plan, dataset_strategy, settings, bucket_bytes)
    return compile_captured(model, gm, example_inputs, made, mesh)
