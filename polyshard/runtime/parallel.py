"""parallelize: capture -> propagate -> Plan -> lower, plus data-parallel gradient sync."""

from __future__ import annotations

import contextlib
import warnings
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from polyshard.compiler.lower import lower
from polyshard.compiler.redistribute import to_dtensor
from polyshard.errors import PolyshardError
from polyshard.graph.capture import capture
from polyshard.mesh import Mesh, current_mesh
from polyshard.planner.plan import Plan
from polyshard.planner.propagate import propagate
from polyshard.runtime.data_parallel import DEFAULT_BUCKET_BYTES, GradientSync


class ParallelModule(nn.Module):
    """This rank's share of a model. Call it with this rank's batch (see :meth:`local_batch`)."""

    def __init__(self, program: nn.Module, plan: Plan, mesh: Mesh, bucket_bytes: int):
        super().__init__()
        self.program = program
        self.plan = plan
        self.mesh = mesh
        group = mesh.data_group()
        self.grad_sync = GradientSync(list(program.parameters()), group, bucket_bytes) if group is not None else None

    def forward(self, *args):
        return self.program(*args)

    def local_batch(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's rows of a global batch (every rank passes the same global batch)."""
        n, i = self.mesh.num_data_shards, self.mesh.data_index
        out = []
        for t in tensors:
            if t.size(0) % n:
                raise PolyshardError(f"batch of {t.size(0)} rows does not split over {n} data shards; use a multiple of {n}")
            out.append(t.chunk(n)[i])
        return tuple(out)

    def no_sync(self):
        """Skip the gradient all-reduce (inner steps of gradient accumulation)."""
        return self.grad_sync.no_sync() if self.grad_sync is not None else contextlib.nullcontext()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, on every rank (gathers split ones)."""
        out = {}
        for name, p in self.program.named_parameters():
            layout = self.plan.params[name]
            if layout.is_replicated:
                out[name] = p.detach().clone()
            else:
                dt = to_dtensor(p.detach(), layout, layout.global_shape(p.shape), self.mesh)
                out[name] = dt.full_tensor()
        return out


def parallelize(model: nn.Module, example_inputs: Sequence[torch.Tensor] | None = None, mesh: Mesh | None = None,
                plan: Plan | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> ParallelModule:
    """Split ``model`` over the mesh: pinned ops keep their strategies, the others follow the op rules.

    ``example_inputs`` (one rank's batch; shapes matter, not values) default to the model's own
    ``example_inputs()``. A given ``plan`` (e.g. edited by hand) is used instead of propagation.
    """
    mesh = mesh or current_mesh()
    if example_inputs is None:
        if not hasattr(model, "example_inputs"):
            raise PolyshardError(
                f"{type(model).__name__} has no example_inputs(); pass example_inputs=(batch tensors...) "
                "so polyshard can read the shapes"
            )
        example_inputs = model.example_inputs()
    gm = capture(model, example_inputs)
    if plan is None:
        seen: set[str] = set()

        def warn(msg: str) -> None:
            if msg not in seen:
                seen.add(msg)
                warnings.warn(f"polyshard: {msg}", stacklevel=3)

        plan = propagate(gm, mesh.op_axes, warn)
    plan.mesh, plan.data_axes = mesh.axes, mesh.data_axes
    if dist.is_initialized() and dist.get_world_size() != mesh.world_size:
        raise PolyshardError(f"mesh {mesh} does not match the world of {dist.get_world_size()} processes")
    return ParallelModule(lower(gm, plan, mesh), plan, mesh, bucket_bytes)
