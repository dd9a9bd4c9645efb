"""Optimizer parallel (ZeRO) over the data group: each of its N ranks updates 1/N of the parameters.

Parameters are replicated over the data group (a tensor-parallel piece is the same on its data-parallel
peers), so the optimizer's work and state can be split over it, as MindSpore's optimizer parallel does:

    level 0  plain data parallel: gradients all-reduced, every rank steps everything
    level 1  gradients all-reduced; each rank keeps optimizer state for, and steps, only its shard of each
             bucket; the updated shards are all-gathered into the parameters
    level 2  gradients reduce-scattered: a rank receives only its shard's averaged gradient
    level 3  parameters kept as shards too: a module's are gathered before its forward and freed after,
             gathered again before its backward; the next module's gather starts one module ahead

Parameters go into flat buckets (fusion groups respected, see polyshard.runtime.fusion) padded to a multiple
of N; each bucket's gradient collective starts from backward's hooks as soon as its gradients exist, and
is waited for at the end of backward. Parameters under ``threshold_bytes`` in the compute dtype stay whole
(all-reduced, stepped by every rank): sharding them saves little memory and adds latency. Mixed precision
lives here too: the buckets hold bf16/fp16 parameters and gradients, the optimizer fp32 masters
(polyshard.runtime.precision).
Level 3 is our own hooks rather than FSDP2: FSDP2 shards whole modules and cannot keep small parameters
whole, fuse by comm_fusion group, or run on the pieces of a lowered tensor-parallel program.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import fx, nn

from polyshard.errors import PolyshardError
from polyshard.optim import Lamb, NormSpec, build_optimizer
from polyshard.plan import ZERO_LEVELS, ZERO_THRESHOLD_BYTES
from polyshard.runtime.fusion import fusion_groups, plan_buckets
from polyshard.buckets import BUCKET_BYTES, FIRST_BUCKET_BYTES
from polyshard.runtime.sync import Bucket, GradientSync
from polyshard.runtime.sync.gather import ModuleGathers
from polyshard.runtime.pipeline import PipelineModule
from polyshard.runtime.precision import LossScaler, cast_inputs, compute_casts_in, compute_dtype


class ZeroOptimizer:
    """Optimizer parallel at ``level`` over ``group`` for ``module``'s parameters; step it like a torch optimizer.

    ``optimizer``: "adamw", "sgd", "lamb" (keyword arguments go to it) or ``factory(params) -> Optimizer``.
    ``precision``: "fp32" (the parameters' dtype), "bf16" or "fp16" (fp32 masters; fp16 with loss scaling:
    call ``scale_loss(loss).backward()``). ``shard_accumulated_grads`` (level 2+): every micro-step of
    gradient accumulation reduce-scatters, so no rank ever holds a full gradient (more communication).
    ``split_groups``: id(parameter) -> the process groups its other tensor-parallel pieces live on (LAMB's norms).
    ``parts``: submodules of ``module`` run (forward and backward) apart, as pipeline chunks are; a bucket holds
    one part's parameters and a backward syncs only the parts it reached (default: ``module`` as one part).
    ``solo``: parameters given buckets of their own, so :meth:`master_of` is theirs alone (pipeline tied copies).
    ``bucket_bytes`` / ``first_bucket_bytes``: the buckets' size, and the first one's (a plan's, by setup_zero).
    State dicts hold this rank's shard only.
    """

    def __init__(self, module: nn.Module, optimizer: str | Callable = "adamw", level: int = 1, group=None,
                 threshold_bytes: int = ZERO_THRESHOLD_BYTES, bucket_bytes: int = BUCKET_BYTES,
                 precision: str = "fp32", shard_accumulated_grads: bool = False,
                 split_groups: Mapping[int, tuple] | None = None, parts: Sequence[nn.Module] = (),
                 solo: Iterable[nn.Parameter] = (), first_bucket_bytes: int = FIRST_BUCKET_BYTES,
                 **optimizer_kwargs):
        if level not in ZERO_LEVELS:
            raise PolyshardError(f"ZeRO level must be one of {ZERO_LEVELS}, got {level!r}")
        if threshold_bytes < 0:
            raise PolyshardError(f"threshold_bytes must be non-negative, got {threshold_bytes}")
        params = [p for p in dict.fromkeys(module.parameters()) if p.requires_grad]
        if not params:
            raise PolyshardError(f"{type(module).__name__} has no trainable parameters to optimize")
        self.level, self.group = level, group
        self.world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        if level > 0 and self.world == 1:
            warnings.warn(f"polyshard: ZeRO level {level} has no data-parallel peers to shard over; "
                          "every rank keeps everything (as level 0)", stacklevel=2)
        self.dtype = compute_dtype(precision) or params[0].dtype
        self.scaler = LossScaler() if precision == "fp16" else None
        self.skipped = False
        parts = list(parts) or [module]
        part_of = {id(p): i for i, part in enumerate(parts) for p in part.parameters()}
        # the collective groups a bucket must not mix: fusion groups, each within one part, and solo parameters
        fusion = {k: (part_of[k], g) for k, g in fusion_groups(module).items()} | {id(p): id(p) for p in solo}

        def sharded(p: nn.Parameter) -> bool:
            # in the bytes it is communicated in (the compute dtype), as the planner counts it
            return level > 0 and self.world > 1 and p.numel() * self.dtype.itemsize >= threshold_bytes

        def bucket(members: list[nn.Parameter], shard: bool, resident: bool) -> Bucket:
            return Bucket(members, shard, self.world, self.rank, self.dtype, resident, part_of[id(members[0])])

        units, uses = _level3_units(module, params, fusion, sharded) if level == 3 else ([], {})
        in_units = {id(p) for unit in units for p in unit}
        self.buckets = [bucket(unit, True, resident=False) for unit in units]
        rest = [p for p in params if id(p) not in in_units]
        self.buckets += [bucket(b, sharded(b[0]), resident=True) for b in plan_buckets(
            rest, bucket_bytes, first_bucket_bytes, lambda p: (part_of[id(p)], fusion.get(id(p)), sharded(p), p.dtype))]
        self.sync = GradientSync(self.buckets, group, level, shard_accumulated_grads)  # syncs gradients
        self.comm = self.sync.comm
        masters = [b.master for b in self.buckets]
        self.optimizer = build_optimizer(optimizer, masters, **optimizer_kwargs) if isinstance(optimizer, str) \
            else optimizer(masters)
        if isinstance(self.optimizer, Lamb):
            self.optimizer.norm_specs.update({b.master: self._norm_spec(b, split_groups or {}) for b in self.buckets})
        self._hooks = []
        if precision != "fp32":
            self._hooks += [cast_inputs(part, self.dtype) for part in parts]
            compute_casts_in(module, self.dtype)
        self.gathers = ModuleGathers({m: [self.buckets[i] for i in idx] for m, idx in uses.items()}, parts, group,
                                     self.comm) if units else None

    # ---- gradients: synced by the engine, scaled under fp16 ----

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on: multiplied by the loss scale under fp16, else unchanged."""
        return loss.float() * self.scaler.scale if self.scaler else loss

    # ---- the step ----

    @torch.no_grad()
    def step(self) -> None:
        """Step the masters (this rank's shards), then publish them into the parameters. Under fp16 a step
        whose gradients overflowed on any rank is skipped by all (``skipped`` tells)."""
        if self.scaler:
            finite = self.scaler.unscale_and_check([b.master.grad for b in self.buckets if b.master.grad is not None])
            self.scaler.update(finite)
            self.skipped = not finite
            if self.skipped:
                self.zero_grad()
                return
        self.optimizer.step()
        for b in self.buckets:
            if b.resident and b.sharded:
                b.gather_src = b.master.detach().to(b.flat.dtype)
                b.gather_work = dist.all_gather_single(b.flat, b.gather_src, group=self.group, async_op=True)
                self.comm.record("all_gather", b.flat.numel() * b.flat.element_size())
            elif b.resident and b.master.data_ptr() != b.flat.data_ptr():
                b.flat.copy_(b.master)
        for b in self.buckets:
            b.wait_gather()

    def master_of(self, p: nn.Parameter) -> nn.Parameter:
        """The master stepped for ``p``'s bucket: ``p``'s alone (whole or this rank's shard) when ``p`` is solo."""
        return self.sync.bucket_of[id(p)].master

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (or zero) the gradients of the parameters and of the masters."""
        for t in [p for b in self.buckets for p in b.params] + [b.master for b in self.buckets]:
            if set_to_none:
                t.grad = None
            elif t.grad is not None:
                t.grad.zero_()

    def state_dict(self) -> dict:
        """This rank's optimizer state (its shards), the loss scale, and what it was made for."""
        return {"optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict() if self.scaler else None,
                "level": self.level, "world": self.world, "rank": self.rank}

    def load_state_dict(self, state: dict) -> None:
        made_for = (state["level"], state["world"], state["rank"])
        if made_for != (self.level, self.world, self.rank):
            raise PolyshardError(f"optimizer state of level {made_for[0]}, rank {made_for[2]} of {made_for[1]} "
                                 f"cannot load into level {self.level}, rank {self.rank} of {self.world}")
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler:
            self.scaler.load_state_dict(state["scaler"])

    def _norm_spec(self, b: Bucket, split_groups: Mapping[int, tuple]) -> NormSpec:
        """Where each parameter lies in ``b``'s master, and the groups holding its other pieces."""
        segments, groups, offset = [], [], 0
        for p, shape in zip(b.params, b.shapes):
            start, end = max(offset, b.lo), min(offset + shape.numel(), b.lo + b.shard_numel)
            segments.append((start - b.lo, end - start) if end > start else (0, 0))
            groups.append(((self.group,) if b.sharded else ()) + tuple(split_groups.get(id(p), ())))
            offset += shape.numel()
        return NormSpec(tuple(segments), tuple(groups))

    def gathered(self):
        """Every parameter whole while inside (level 3; e.g. to read or save them); a no-op below level 3."""
        return self.gathers.gathered() if self.gathers is not None else contextlib.nullcontext()

    def remove(self) -> None:
        """Take this optimizer's hooks off the parameters and modules."""
        self.sync.remove()
        if self.gathers is not None:
            self.gathers.remove()
        for h in self._hooks:
            h.remove()


def _level3_units(root: nn.Module, params: list[nn.Parameter], fusion: Mapping[int, Hashable],
                  sharded: Callable[[nn.Parameter], bool]) -> tuple[list[list[nn.Parameter]], dict[nn.Module, list[int]]]:
    """Level 3's gather units: the sharded parameters of each called module (of each fusion group, when
    marked), in call order; and for each module, the units it needs (a shared parameter's unit too)."""
    wanted = {id(p) for p in params if sharded(p)}
    units: list[list[nn.Parameter]] = []
    unit_of_key: dict[tuple, int] = {}
    owner: dict[int, int] = {}
    uses: dict[nn.Module, list[int]] = {}
    for m in _call_units(root):
        for p in dict.fromkeys(m.parameters()):
            if id(p) not in wanted:
                continue
            if id(p) not in owner:
                key = ("fusion", fusion[id(p)]) if id(p) in fusion else ("module", id(m))
                if key not in unit_of_key:
                    unit_of_key[key] = len(units)
                    units.append([])
                owner[id(p)] = unit_of_key[key]
                units[owner[id(p)]].append(p)
            uses.setdefault(m, [])
            if owner[id(p)] not in uses[m]:
                uses[m].append(owner[id(p)])
    return units, uses


def _call_units(root: nn.Module) -> list[nn.Module]:
    """Modules called as one piece that hold parameters, in call order: the modules a lowered (fx) program
    calls (its Linear/Embedding/LayerNorm and their sharded wrappers), else those owning parameters."""
    calls: dict[nn.Module, None] = {}
    for gm in root.modules():
        if isinstance(gm, fx.GraphModule):
            for node in gm.graph.nodes:
                if node.op == "call_module":
                    m = gm.get_submodule(node.target)
                    if not isinstance(m, fx.GraphModule) and next(m.parameters(), None) is not None:
                        calls.setdefault(m)
    return list(calls) or [m for m in root.modules() if next(m.parameters(recurse=False), None) is not None]


def setup_zero(pm, level: int | None = None, optimizer: str | Callable | None = None, precision: str | None = None,
               threshold_bytes: int | None = None, bucket_bytes: int | None = None,
               shard_accumulated_grads: bool = False, **optimizer_kwargs) -> ZeroOptimizer:
    """Optimizer parallel for a ParallelModule or PipelineModule over its data group; returns the optimizer to step.

    The optimizer's sync engine replaces ``pm.grad_sync`` (``pm.zero`` is the optimizer), so ``pm.no_sync()``
    keeps working. On a pipeline it covers this rank's chunks,
    each chunk a part of its own, and tied copies get buckets of their own, summed over stages before the step.
    Arguments left None come from ``pm.plan`` (zero, optimizer, precision, zero_threshold_bytes, bucket_bytes);
    the first bucket is the plan's (no larger than the others); the plan is left as it is.
    """
    plan = pm.plan
    level = plan.zero if level is None else level
    optimizer = plan.optimizer if optimizer is None else optimizer
    precision = plan.precision if precision is None else precision
    threshold_bytes = plan.zero_threshold_bytes if threshold_bytes is None else threshold_bytes
    bucket_bytes = plan.bucket_bytes if bucket_bytes is None else bucket_bytes
    group = pm.mesh.data_group()
    pipelined = isinstance(pm, PipelineModule)
    layout = dict(parts=list(pm.chunks.values()), solo=[p for p, _ in pm.tied]) if pipelined else {}
    opt = ZeroOptimizer(pm, optimizer, level, group, threshold_bytes, bucket_bytes, precision, shard_accumulated_grads,
                        _split_groups(pm), **layout, first_bucket_bytes=plan.first_bucket_bytes,
                        **optimizer_kwargs)
    pm.use_optimizer(opt, compute_dtype(precision))
    return opt


def _split_groups(pm) -> dict[int, tuple]:
    """id(parameter) -> the process group over the mesh axes that split it (its other pieces)."""
    out = {}
    for name, p in pm.local_parameters().items():
        layout = pm.plan.params[name]
        axes = tuple(a for dim in layout.dims for a in dim)
        if axes:
            sub = pm.mesh.device_mesh(layout.axes)[axes]
            out[id(p)] = ((sub._flatten() if len(axes) > 1 else sub).get_group(),)
    return out
