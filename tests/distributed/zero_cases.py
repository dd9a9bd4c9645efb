"""Optimizer parallel cases run on every rank of a pool. Each builds its single-device reference itself
(same model, data, seed; a plain torch optimizer, or the LAMB below written from the paper) and returns
how far the ZeRO run is from it."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

import polyshard as ps
from polyshard.runtime.pipeline import PipelineModule
from polyshard.runtime.zero import setup_zero
from tests.distributed.cases import _batch, _build, rel_err

OPTIMIZER_KWARGS = {"adamw": {"lr": 1e-2}, "sgd": {"lr": 0.1, "momentum": 0.9}, "lamb": {"lr": 1e-2}}


class ReferenceLamb:
    """LAMB on whole tensors, from You et al. 2019 (algorithm 2, bias-corrected moments, phi = identity)."""

    def __init__(self, params, lr, b1=0.9, b2=0.999, eps=1e-6, wd=0.01):
        self.params, self.lr, self.b1, self.b2, self.eps, self.wd = list(params), lr, b1, b2, eps, wd
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.t = 0

    @torch.no_grad()
    def step(self):
        self.t += 1
        for p, m, v in zip(self.params, self.m, self.v):
            m.copy_(self.b1 * m + (1 - self.b1) * p.grad)
            v.copy_(self.b2 * v + (1 - self.b2) * p.grad * p.grad)
            m_hat, v_hat = m / (1 - self.b1 ** self.t), v / (1 - self.b2 ** self.t)
            r = m_hat / (v_hat.sqrt() + self.eps) + self.wd * p
            w_norm, r_norm = p.norm().item(), r.norm().item()
            ratio = w_norm / r_norm if w_norm > 0 and r_norm > 0 else 1.0
            p.sub_(self.lr * ratio * r)

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def reference_optimizer(params, name: str):
    if name == "lamb":
        return ReferenceLamb(params, **OPTIMIZER_KWARGS["lamb"])
    return {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[name](params, **OPTIMIZER_KWARGS[name])


def zero_parity(mesh: str, level: int, model: str = "gpt-tiny", steps: int = 5, dtype=torch.float64,
                optimizer: str = "adamw", accum: int = 1, batch: int = 8, threshold_bytes: int = 1024,
                shard_accumulated_grads: bool = False, schedule: str | None = None,
                micro_batches: int | None = None, virtual_stages: int | None = None) -> dict:
    """``steps`` optimizer steps at ZeRO ``level`` on ``mesh`` vs one device: worst loss and parameter errors,
    the collectives of the last step, which gradients the ranks still hold whole, and (with a ``pp`` axis, run
    by ``schedule``, ``micro_batches``, ``virtual_stages``) the largest gap between stages' copies of a tied parameter."""
    ps.init(mesh)
    ref, par = _build(model, dtype, True).to(ps.current_mesh().device), _build(model, dtype, True)
    batches = [_batch(ref, batch, seed=s) for s in range(steps)]
    shards = ps.current_mesh().num_data_shards
    pm = ps.parallelize(par, example_inputs=_batch(ref, batch // shards // accum, seed=0), schedule=schedule,
                        micro_batches=micro_batches, virtual_stages=virtual_stages)
    opt = setup_zero(pm, level, optimizer, threshold_bytes=threshold_bytes,
                     shard_accumulated_grads=shard_accumulated_grads, **OPTIMIZER_KWARGS[optimizer])
    ref_opt = reference_optimizer(ref.parameters(), optimizer)
    loss_err, comm = 0.0, {}
    for x, y in batches:
        ref_loss = ref(x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        total, whole_grads = _train_step(pm, opt, *pm.local_batch(x, y), accum, dtype)
        comm = opt.comm.take()
        loss_err = max(loss_err, rel_err(total, ref_loss.detach()))
    with opt.gathered():
        full, tied_gap = pm.full_state_dict(), _tied_gap(pm)
    param_err = max(rel_err(full[k], p.detach()) for k, p in ref.named_parameters())
    buckets = [(b.sharded, b.resident, len(b.params)) for b in opt.buckets]
    tied = sorted(pm.split.tied) if isinstance(pm, PipelineModule) else []
    opt.remove()
    del pm, opt
    return {"loss_err": loss_err, "param_err": param_err, "comm": comm, "whole_grads": whole_grads,
            "buckets": buckets, "tied": tied, "tied_gap": tied_gap}


def _tied_gap(pm) -> float:
    """The largest difference between two pipeline stages' copies of a tied parameter (0.0 without stages)."""
    if not isinstance(pm, PipelineModule):
        return 0.0
    copies = [None] * pm.mesh.pp
    dist.all_gather_object(copies, {n: p.detach() for n, p in pm.local_parameters().items()}, group=pm.pipe_group)
    return max((rel_err(a[n], b[n]) for n in pm.split.tied for a in copies for b in copies if n in a and n in b),
               default=0.0)


def _train_step(pm, opt, x, y, accum: int, dtype) -> tuple[torch.Tensor, int]:
    """One optimizer step of ``accum`` micro-batches (a pipeline's each run by its schedule); returns the loss
    averaged over the data group and how many sharded parameters held a whole gradient after backward."""
    total = torch.zeros((), dtype=dtype, device=x.device)
    for i, (mx, my) in enumerate(zip(x.chunk(accum), y.chunk(accum))):
        with (pm.no_sync() if i < accum - 1 else contextlib.nullcontext()):
            if isinstance(pm, PipelineModule):
                loss = pm.train_step(mx, my, scale=1 / accum) / accum
            else:
                loss = pm(mx, my) / accum
                opt.scale_loss(loss).backward()
        total += loss.detach().to(dtype)
    whole_grads = sum(p.grad is not None for b in opt.buckets if b.sharded for p in b.params)
    opt.step()
    opt.zero_grad()
    if opt.group is not None:
        dist.all_reduce(total, group=opt.group)
        total /= opt.world
    return total, whole_grads


def precision_run(precision: str, level: int, steps: int = 6, inject_step: int = -1, mesh: str = "dp=4",
                  schedule: str | None = None, micro_batches: int | None = None) -> dict:
    """A GPT trained in ``precision`` at ZeRO ``level`` on ``mesh`` vs fp32 on one device (SGD with momentum, which
    passes rounding through unamplified): per-step loss errors and the final parameter error. ``inject_step``: on
    rank 1, one gradient element of its first MLP weight becomes inf in that step's backward; the fp32 reference
    then skips that batch, as the low-precision run must."""
    ps.init(mesh)
    ref, par = _build("gpt-tiny", torch.float32, True), _build("gpt-tiny", torch.float32, True)
    batches = [_batch(ref, 8, seed=s) for s in range(steps)]
    pm = ps.parallelize(par, example_inputs=_batch(ref, 8 // ps.current_mesh().num_data_shards, seed=0),
                        schedule=schedule, micro_batches=micro_batches)
    opt = setup_zero(pm, level, "sgd", precision, threshold_bytes=1024, **OPTIMIZER_KWARGS["sgd"])
    ref_opt = reference_optimizer(ref.parameters(), "sgd")
    loss_errs, skipped, scales, unchanged = [], [], [], None
    victim = next(p for n, p in pm.local_parameters().items() if n.endswith("mlp.fc.weight"))
    for step, (x, y) in enumerate(batches):
        inject = step == inject_step
        if not inject:
            ref_loss = ref(x, y)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
        handle = victim.register_hook(_poison) if inject and dist.get_rank() == 1 else None
        if inject:
            with opt.gathered():
                before = pm.full_state_dict()
        total, _ = _train_step(pm, opt, *pm.local_batch(x, y), 1, torch.float32)
        if handle:
            handle.remove()
        if inject:
            with opt.gathered():
                after = pm.full_state_dict()
            unchanged = all(torch.equal(before[k], after[k]) for k in before)
        else:
            loss_errs.append(rel_err(total, ref_loss.detach()))
        skipped.append(opt.skipped)
        scales.append(opt.scaler.scale if opt.scaler else None)
    with opt.gathered():
        full = pm.full_state_dict()
    param_err = max(rel_err(full[k].float(), p.detach()) for k, p in ref.named_parameters())
    dtypes = sorted({str(p.dtype) for p in pm.parameters()} | {str(b.master.dtype) for b in opt.buckets})
    opt.remove()
    del pm, opt
    return {"loss_errs": loss_errs, "param_err": param_err, "skipped": skipped, "scales": scales,
            "unchanged_on_skip": unchanged, "dtypes": dtypes}


def _poison(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad.view(-1)[0] = math.inf
    return grad


def fusion_buckets(level: int) -> dict:
    """Blocks 0 and 1 marked as fusion groups 1 and 2: the fusion groups found in each bucket (by parameter
    name), the collectives of one step, and parity with one device. ``level`` None: plain data parallel."""
    ps.init("dp=4")
    ref, par = _build("gpt-tiny", torch.float64, True), _build("gpt-tiny", torch.float64, True)
    ps.comm_fusion(par.blocks[0], 1)
    ps.comm_fusion(par.blocks[1], 2)
    x, y = _batch(ref, 8, seed=0)
    pm = ps.parallelize(par, example_inputs=_batch(ref, 2, seed=0))
    names = {id(p): n for n, p in pm.local_parameters().items()}
    opt = pm.grad_sync if level is None else setup_zero(pm, level, "sgd", threshold_bytes=1024,
                                                         **OPTIMIZER_KWARGS["sgd"])
    loss = pm(*pm.local_batch(x, y))
    loss.backward()
    comm = opt.comm.take()
    groups = [sorted({_block(names[id(p)]) for p in b.params}) for b in opt.buckets]
    ref(x, y).backward()
    if level is None:
        grad_err = max(rel_err(p.grad, r.grad) for p, r in zip(pm.local_parameters().values(), ref.parameters()))
    else:
        opt.remove()
        grad_err = 0.0
    del pm, opt
    return {"groups": groups, "comm": comm, "grad_err": grad_err}


def _block(name: str) -> str:
    """The fusion group a GPT parameter was marked with in :func:`fusion_buckets` ("-" when unmarked)."""
    return {"blocks.0": "1", "blocks.1": "2"}.get(name[:8], "-")


def memory_per_level(level: int, threshold_bytes: int = 1024, bucket_bytes: int = 16 * 1024) -> dict:
    """Bytes this rank holds after a step (parameters, gradients, AdamW state, communication buffers),
    summed over distinct storages, beside :func:`state_bytes_per_rank`'s prediction."""
    from polyshard.planner.cost.zero_memory import state_bytes_per_rank

    ps.init("dp=4")
    model = _build("gpt-tiny", torch.float32, True)
    x, y = _batch(model, 8, seed=0)
    pm = ps.parallelize(model, example_inputs=_batch(model, 2, seed=0))
    predicted = state_bytes_per_rank(_unit_numels(pm), level, 4, threshold_bytes, 4, 2, bucket_bytes)
    opt = setup_zero(pm, level, "adamw", threshold_bytes=threshold_bytes, bucket_bytes=bucket_bytes,
                     **OPTIMIZER_KWARGS["adamw"])
    pm(*pm.local_batch(x, y)).backward()
    opt.step()
    params = list(pm.parameters()) + [b.master for b in opt.buckets]
    state = [t for s in opt.optimizer.state.values() for t in s.values()
             if isinstance(t, torch.Tensor) and t.dim() > 0]
    buffers = [t for b in opt.buckets for t in (b.grad, b.sent, b.gather_src) if t is not None]
    buffers += [b.flat for b in opt.buckets if not b.resident]
    counted: set[int] = set()
    measured = {}
    for kind, tensors in (("params", params), ("grads", [t.grad for t in params if t.grad is not None]),
                          ("optimizer", state), ("buffers", buffers)):
        measured[kind] = 0
        for t in tensors:
            storage = t.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in counted:
                counted.add(storage.data_ptr())
                measured[kind] += storage.nbytes()
    opt.remove()
    del pm, opt
    return {"predicted": predicted, "measured": measured}


def gathered_modules(precision: str, threshold_bytes: int) -> dict:
    """Modules level 3 gathers on this rank, as run and as the planner counts them (level3_traffic)."""
    from polyshard.plan import DTYPES
    from polyshard.planner.pipeline import level3_traffic

    ps.init("dp=4")
    model = _build("gpt-tiny", torch.float32, True)
    pm = ps.parallelize(model, example_inputs=_batch(model, 2, seed=0))
    groups = _unit_numels(pm)
    opt = setup_zero(pm, 3, "adamw", precision, threshold_bytes=threshold_bytes, **OPTIMIZER_KWARGS["adamw"])
    run = sum(not b.resident for b in opt.buckets)
    opt.remove()
    return {"run": run, "priced": level3_traffic(groups, DTYPES[precision][1], threshold_bytes)[1]}


def _unit_numels(pm) -> tuple[tuple[int, ...], ...]:
    """The sizes of the parameters each call unit of ``pm`` uses first, in forward order, as the planner
    groups them (a unit that only reuses parameters is left out)."""
    from polyshard.runtime.zero import _call_units

    seen: set[int] = set()
    groups = []
    for m in _call_units(pm):
        fresh = [p for p in m.parameters() if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        groups.append(tuple(p.numel() for p in fresh))
    return tuple(g for g in groups if g)
