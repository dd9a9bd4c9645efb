"""Pipeline parallel: each rank runs only its own chunks of the plan's stages (tensor parallel inside its
stage) under a schedule of micro-batches.

A value a chunk needs from an earlier chunk is sent rank to rank along ``pp``. A parameter used by two
stages (a tied embedding) has a copy on each, whose gradients are summed every step.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Sequence

import torch
import torch.distributed as dist
from torch import fx, nn

from polyshard.compiler.lower import whole_parameter
from polyshard.compiler.stages import Split, build_chunk, micro_batches, pipeline_split
from polyshard.errors import PolyshardError
from polyshard.graph.export import SIGNATURE_KEY, CallSignature
from polyshard.graph.regions import marked_modules
from polyshard.mesh import Mesh
from polyshard.plan import Plan
from polyshard.runtime.sync import Pausable, data_parallel
from polyshard.compiler.recompute import apply_recompute
from polyshard.runtime.pipeline.executor import Step
from polyshard.schedule import ActionTime, schedule_actions


class PipelineModule(nn.Module, Pausable):
    """This rank's chunks of a pipelined model. :meth:`train_step` runs a batch's forward and
    backward through the schedule (no optimizer step), so gradients land in ``.grad`` as on one device."""

    def local_batch(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's rows of a global batch (every rank passes the same global batch)."""
        return self.mesh.local_rows(*tensors)

    def __init__(self, chunks: dict[int, fx.GraphModule], split: Split, plan: Plan, mesh: Mesh,
                 recompute_paths: dict[str, str] | None = None, signature: CallSignature | None = None):
        super().__init__()
        self.signature = signature  # how keyword calls map to the graph's inputs (captured by export)
        self.chunks = nn.ModuleDict({str(c): apply_recompute(m, plan.recompute_of(c), plan.recompute_comm,
                                                             recompute_paths, collectives=plan.splits_operators)
                                     for c, m in chunks.items()})
        self.split, self.plan, self.mesh = split, plan, mesh
        self._names = {id(p): split.canonical[n] for m in chunks.values() for n, p in m.named_parameters()}
        self.actions = schedule_actions(plan.schedule, mesh.pp, plan.micro_batches, plan.virtual_stages)[mesh.stage]
        self.data_group = mesh.data_group()
        self.grad_sync = data_parallel(list(self.chunks.parameters()), self.data_group, plan.bucket_bytes,
                                       plan.first_bucket_bytes, parts=list(self.chunks.values())) \
            if self.data_group is not None else None
        self.tied = [(chunks[c].get_parameter(name), [mesh.stage_rank(k % mesh.pp) for k in sorted(by_chunk)])
                     for by_chunk in split.tied.values() for c, name in by_chunk.items() if c in chunks]
        self.pipe_group = mesh.axis_mesh(mesh.pipeline_axis).get_group()
        self.timings: list[ActionTime] = []
        self.zero = None  # the ZeroOptimizer whose engine syncs gradients instead (see use_optimizer)

    def forward(self, *batch):
        raise PolyshardError("a pipelined model runs forward and backward together: call train_step(*batch)")

    @property
    def reads_batch(self) -> bool:
        """Whether this rank's chunks take any of the batch (inputs or labels); a middle stage's do not."""
        return any(self.split.inputs[int(c)] for c in self.chunks)

    def use_optimizer(self, zero, dtype: torch.dtype | None) -> None:
        """Hand gradient sync to ``zero``'s engine (a ZeroOptimizer over this rank's chunks, see ``setup_zero``):
        it syncs each chunk in the chunk's last backward, and ``zero`` scales the loss; values between stages
        travel in ``dtype`` (the compute dtype of mixed precision; None: as captured)."""
        if self.grad_sync is not None:
            self.grad_sync.remove()
        self.grad_sync = zero.sync
        self.zero = zero
        if dtype is not None:
            self.split = replace(self.split, edges=tuple(replace(e, dtype=dtype) if e.dtype.is_floating_point else e
                                                         for e in self.split.edges))

    def train_step(self, *batch: torch.Tensor, scale: float = 1.0, record: bool = False,
                   **keywords: torch.Tensor) -> torch.Tensor:
        """Forward and backward of this rank's batch in ``plan.micro_batches`` micro-batches; gradients
        of ``scale`` x the batch's mean loss are added to ``.grad``, then averaged over the data group
        and summed over tied copies (not in :meth:`no_sync`). Returns the mean loss on every stage.
        ``record``: keep each action's start and end in :attr:`timings`."""
        if self.signature is not None:  # called as the model is, e.g. train_step(input_ids=..., labels=...)
            batch = self.signature.flatten(batch, keywords)
        step = Step(self, [micro_batches(t, self.plan.micro_batches) for t in batch], scale)
        if record:
            dist.barrier(group=self.pipe_group)
            self.timings, t0 = [], time.perf_counter()
        for a in self.actions:
            received = step.receive(a)
            start = time.perf_counter()  # the action's own time, not its wait for inputs
            (step.forward if a.kind == "F" else step.backward)(a.chunk, a.micro, received)
            if record:
                self.timings.append(ActionTime(self.mesh.stage, a.chunk, a.kind, a.micro, start - t0,
                                               time.perf_counter() - t0))
        step.wait_sends()
        if self.syncing:
            self._sum_tied()
        loss = (torch.stack(step.losses).sum() / self.plan.micro_batches if step.losses
                else torch.zeros((), dtype=self.split.loss_dtype, device=self.mesh.device))
        dist.broadcast(loss, src=self.mesh.stage_rank(self.mesh.pp - 1), group=self.pipe_group)
        return loss

    def _sum_tied(self) -> None:
        """Each tied parameter's gradient summed over its copies, in stage order (equal on every copy);
        under ZeRO the gradient of its master (its own bucket, laid out alike on every stage), which the step reads."""
        tag = 2 * len(self.split.edges) * self.plan.micro_batches  # after every schedule message's tag
        for i, (param, ranks) in enumerate(self.tied):
            p = self.zero.master_of(param) if self.zero is not None else param
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            peers = [r for r in ranks if r != self.mesh.rank]
            parts = {r: torch.empty_like(grad) for r in peers} | {self.mesh.rank: grad}
            works = ([dist.isend(grad, r, tag=tag + i) for r in peers]
                     + [dist.irecv(parts[r], r, tag=tag + i) for r in peers])
            for w in works:
                w.wait()
            p.grad = torch.stack([parts[r] for r in ranks]).sum(0)

    def local_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's piece of each of its stages' parameters, by its name in the plan."""
        return {self._names[id(p)]: p for p in self.parameters()}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every stage's parameters whole (split ones gathered), on every rank, by their names in the plan."""
        mine = {name: whole_parameter(p, name, self.plan, self.mesh) for name, p in self.local_parameters().items()}
        stages = [None] * self.mesh.pp
        dist.all_gather_object(stages, mine, group=self.pipe_group)
        return {k: v for part in stages for k, v in part.items()}

    def gather_timings(self) -> list[ActionTime] | None:
        """The recorded :attr:`timings` of every stage of this rank's pipeline, on its first stage
        (rank 0 gets its own pipeline's); None on the others. Every rank calls it."""
        parts = [None] * self.mesh.pp if self.mesh.stage == 0 else None
        dist.gather_object(self.timings, parts, dst=self.mesh.stage_rank(0), group=self.pipe_group)
        return [t for part in parts for t in part] if parts is not None else None


def compile_pipeline(model: nn.Module, example_inputs: Sequence[torch.Tensor], plan: Plan,
                     mesh: Mesh) -> PipelineModule:
    """The pipeline path of :func:`polyshard.compile`: each rank builds only its own chunks."""
    if plan.copies != 1:
        raise PolyshardError(f"copies={plan.copies} (multi-copy interleave) does not combine with pipeline "
                             "stages; micro-batches already overlap the stages' work: use copies=1")
    gm, split = pipeline_split(model, example_inputs, plan, mesh.pp)
    mine = {c: build_chunk(gm, plan, split, c, mesh) for c in range(mesh.stage, split.chunks, mesh.pp)}
    return PipelineModule(mine, split, plan, mesh, marked_modules(model), gm.meta.get(SIGNATURE_KEY))
