"""A plan compiled for this rank: its share of the program, lowered, with data-parallel gradient sync."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import fx, nn

from polyshard.compiler.lower import lower, whole_parameter
from polyshard.errors import PolyshardError
from polyshard.graph.export import SIGNATURE_KEY
from polyshard.graph.regions import marked_modules
from polyshard.layout import Layout
from polyshard.mesh import Mesh
from polyshard.pin import COPIES_ATTR
from polyshard.plan import Plan
from polyshard.runtime.sync import data_parallel
from polyshard.runtime.fusion import fusion_groups
from polyshard.compiler.interleave import interleave
from polyshard.runtime.pipeline import PipelineModule, compile_pipeline
from polyshard.compiler.recompute import apply_recompute



class ParallelModule(nn.Module):
    """This rank's share of a model. Call it with this rank's batch (see :meth:`local_batch`)."""

    def __init__(self, program: fx.GraphModule, plan: Plan, mesh: Mesh, recompute_paths: dict[str, str] | None = None):
        super().__init__()
        object.__setattr__(self, "_single_copy", program)  # not a submodule: the same parameters
        self.recompute_paths = recompute_paths or {}
        self.plan = plan
        self.program = self._runnable(plan.copies)
        self.mesh = mesh
        group = mesh.data_group()
        self.grad_sync = data_parallel(list(program.parameters()), group, plan.bucket_bytes, plan.first_bucket_bytes,
                                       fusion_groups(program)) if group is not None else None
        self.zero = None  # the ZeroOptimizer whose engine syncs gradients instead (see use_optimizer)

    def set_copies(self, copies: int) -> None:
        """Run each batch as ``copies`` interleaved slices (1: as one)."""
        self.plan = dataclasses.replace(self.plan, copies=copies)
        self.program = self._runnable(copies)

    def _runnable(self, copies: int) -> fx.GraphModule:
        """The program with the plan's recomputed regions outlined, interleaved into ``copies``."""
        recomputed = apply_recompute(self._single_copy, self.plan.recompute, self.plan.recompute_comm,
                                     self.recompute_paths, collectives=self.plan.splits_operators)
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

    def train_step(self, *batch: torch.Tensor, scale: float = 1.0, record: bool = False,
                   **keywords: torch.Tensor) -> torch.Tensor:
        """Forward and backward of a model whose call returns its loss, gradients scaled by ``scale`` (and by
        the loss scale of ``zero``'s fp16), as a pipeline's ``train_step`` does; ``record``: a pipeline keeps
        its schedule's timings, one program has none. Returns the loss."""
        loss = self(*batch, **keywords)
        scaled = loss * scale
        (self.zero.scale_loss(scaled) if self.zero is not None else scaled).backward()
        return loss.detach()

    def use_optimizer(self, zero, dtype: torch.dtype | None) -> None:
        """Hand gradient sync to ``zero``'s engine (a ZeroOptimizer over this module, see ``setup_zero``);
        ``dtype`` matters to a pipeline's values between stages only (one program casts inside)."""
        if self.grad_sync is not None:
            self.grad_sync.remove()
        self.grad_sync = zero.sync
        self.zero = zero

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


def compile_captured(model: nn.Module, gm: fx.GraphModule, example_inputs: Sequence | Mapping, plan: Plan,
                     mesh: Mesh) -> ParallelModule | PipelineModule:
    """This rank's share of ``plan`` for ``model`` (``gm``: its capture on ``example_inputs``, which lowering
    rewrites); the plan was checked against ``gm``. Staged plans give a :class:`PipelineModule`."""
    if dist.is_initialized() and dist.get_world_size() != mesh.world_size:
        raise PolyshardError(f"mesh {mesh} does not match the world of {dist.get_world_size()} processes")
    if mesh.pp > 1:
        return compile_pipeline(model, example_inputs, plan, mesh)
    if plan.stage_recompute:
        raise PolyshardError(f"stage_recompute sets a mode per pipeline chunk, and mesh {mesh} has no pp axis; "
                             "set recompute instead")
    return ParallelModule(lower(gm, plan, mesh), plan, mesh, marked_modules(model))


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
