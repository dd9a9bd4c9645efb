"""Pipeline cases run on every rank of a pool. Each trains its own single-device reference (same
model, data and seed) and returns how far the pipelined run is from it."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import polyshard as ps
from polyshard import models
from polyshard.cluster import Cluster
from polyshard.graph.capture import capture
from polyshard.planner.config import Fixed
from polyshard.planner.search import search
from polyshard.planner.stage_rows import batch_values, rows_layouts, shared_parameters, with_rows_chunks
from polyshard.planner.stages import predict_timings
from tests.distributed.cases import _batch, _optimizer, rel_err


def _gpt(layers: int, dtype, tied: bool) -> models.GPT:
    torch.manual_seed(7)
    cfg = dataclasses.replace(models.CONFIGS["gpt-tiny"], num_layers=layers, tied=tied)
    return models.GPT(cfg).to(dtype)


class SkipNet(nn.Module):
    """Blocks of Linear+GELU where block ``skip_from``'s output also feeds the head: a value the last
    stage needs from an earlier one, past the stages between."""

    def __init__(self, skip_from: int = 0, width: int = 16, depth: int = 4, classes: int = 8):
        super().__init__()
        self.skip_from = skip_from
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x, y):
        h = x
        for i, block in enumerate(self.blocks):
            h = block(h)
            if i == self.skip_from:
                kept = h
        return F.cross_entropy(self.head(h + kept), y)


def _train(ref: nn.Module, par: nn.Module, batches, steps_kwargs: dict, optimizer: str, accum: int,
           mark: tuple[str, ...] = ()) -> dict:
    """The same steps on one device and pipelined; worst loss error, final parameter error, and the
    largest difference between two stages' copies of a tied parameter."""
    for k, path in enumerate(mark, start=1):
        ps.pipeline_stage(par.get_submodule(path), k)
    mesh = ps.current_mesh()
    rows = batches[0][0].size(0) // mesh.num_data_shards // accum
    pm = ps.parallelize(par, example_inputs=tuple(t[:rows] for t in batches[0]), **steps_kwargs)
    ref_opt, opt = _optimizer(ref.parameters(), optimizer), _optimizer(pm.parameters(), optimizer)
    loss_err = 0.0
    for batch in batches:
        ref_loss = ref(*batch)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        local = pm.local_batch(*batch)
        if not pm.reads_batch:  # a middle stage takes neither inputs nor labels: what it is handed is unused
            local = tuple(torch.zeros_like(t) for t in local)
        total = torch.zeros((), dtype=ref_loss.dtype, device=ref_loss.device)
        for i, micro in enumerate(zip(*(t.chunk(accum) for t in local))):
            with pm.no_sync() if i < accum - 1 else contextlib.nullcontext():
                total += pm.train_step(*micro, scale=1 / accum) / accum
        if pm.data_group is not None:
            dist.all_reduce(total, group=pm.data_group)
            total /= mesh.num_data_shards
        opt.step()
        opt.zero_grad()
        loss_err = max(loss_err, rel_err(total, ref_loss.detach()))
    full = pm.full_state_dict()
    param_err = max(rel_err(full[k], p.detach()) for k, p in ref.named_parameters())
    copies = [None] * mesh.pp
    dist.all_gather_object(copies, {name: p.detach() for name, p in pm.local_parameters().items()},
                           group=pm.pipe_group)
    tied = [[c[name] for c in copies if name in c] for name in pm.split.tied]
    tied_gap = max((rel_err(a, b) for held in tied for a in held for b in held), default=0.0)
    result = {"loss_err": loss_err, "param_err": param_err, "tied_gap": tied_gap, "tied": sorted(pm.split.tied),
              "boundaries": pm.plan.stage_boundaries, "edges": [(e.name, e.src, e.dst) for e in pm.split.edges],
              "params": sorted(pm.local_parameters()), "reads_batch": pm.reads_batch,
              "layouts": {k: v.describe() or "R" for k, v in pm.plan.params.items()},
              "recomputed": {int(c): [name for name, _ in m.named_children() if name.startswith("recompute_")]
                             for c, m in pm.chunks.items()}}
    del pm, opt
    return result


def gpt_parity(mesh: str, schedule: str = "1f1b", dtype=torch.float64, optimizer: str = "adamw", tied: bool = True,
               accum: int = 1, micro_batches: int = 4, virtual_stages: int = 1, layers: int = 4, steps: int = 5,
               batch: int = 8, mark: tuple[str, ...] = (), recompute=None) -> dict:
    """A GPT of ``layers`` blocks trained ``steps`` steps on ``mesh`` (with a ``pp`` axis) vs one device;
    ``recompute``: a mode, or one per chunk."""
    ps.init(mesh)
    ref, par = _gpt(layers, dtype, tied).to(ps.current_mesh().device), _gpt(layers, dtype, tied)
    batches = [_batch(ref, batch, seed=s) for s in range(steps)]
    kwargs = dict(schedule=schedule, micro_batches=micro_batches, virtual_stages=virtual_stages, recompute=recompute)
    return _train(ref, par, batches, kwargs, optimizer, accum, mark)


def stage_layouts_parity(steps: int = 4) -> dict:
    """pp=2 x tp=2, each stage's operators pinned its own way: stage 0 splits its block's rows over tp (tp as
    a second data axis there, weights whole), stage 1 splits its block's weights Megatron-style (columns,
    then rows). The activations crossing the cut change layout on the way."""
    ps.init("pp=2,tp=2")
    ref, par = _gpt(2, torch.float64, True), _gpt(2, torch.float64, True)
    first, second = par.blocks
    for m in (first.attn.q, first.attn.k, first.attn.v, first.attn.proj, first.mlp.fc, first.mlp.proj):
        ps.shard(m, in_strategy=((2, 1, 1), (1, 1)))
    for m in (second.attn.q, second.attn.k, second.attn.v, second.mlp.fc):
        ps.shard(m, in_strategy=((1, 1, 1), (2, 1)))
    for m in (second.attn.proj, second.mlp.proj):
        ps.shard(m, in_strategy=((1, 1, 2), (1, 2)))
    batches = [_batch(ref, 8, seed=s) for s in range(steps)]
    plan = ps.plan(par, example_inputs=tuple(t[:4] for t in batches[0]), schedule="1f1b", micro_batches=2)
    outputs = {name: n.output.describe() for name, n in plan.nodes.items() if "mlp_fc" in name}
    return _train(ref, par, batches, dict(plan=plan), "adamw", 1) | {"fc_outputs": outputs}


def searched_recompute_parity(limit_bytes: float, batch: int = 16, steps: int = 4) -> dict:
    """A GPT of 4 blocks planned for pp=2 under ``limit_bytes`` per device (the search chooses each stage's
    recompute mode), then trained on that plan against one device."""
    ps.init("pp=2")
    mesh = ps.current_mesh()
    ref, par = _gpt(4, torch.float64, True), _gpt(4, torch.float64, True)
    plan, _ = search(par, par.example_inputs(1), Cluster.preset("cpu-gloo:2"), batch, limit_bytes,
                     meshes=[mesh.axes], data_axes=mesh.data_axes, fixed=Fixed(offload="none", m=4))
    batches = [_batch(ref, batch, seed=s) for s in range(steps)]
    return _train(ref, par, batches, dict(plan=plan), "adamw", 1) | {"stage_recompute": plan.stage_recompute}


def tp_split_parity(tp_split: tuple[str, ...], steps: int = 4) -> dict:
    """pp=2 x tp=2: the rules' plan (Megatron-style splits, the tied table and head split by vocabulary), with the
    chunks ``tp_split`` names "rows" laid out by :mod:`polyshard.planner.stage_rows`, trained against one device."""
    ps.init("pp=2,tp=2")
    ref, par = _gpt(2, torch.float64, True), _gpt(2, torch.float64, True)
    batches = [_batch(ref, 8, seed=s) for s in range(steps)]
    plan = ps.plan(par, example_inputs=tuple(t[:4] for t in batches[0]), schedule="1f1b", micro_batches=2)
    gm, wider = (capture(par, tuple(t[:rows] for t in batches[0])) for rows in (1, 2))
    shared = {name: plan.params[name] for name in shared_parameters(wider)}
    rows = rows_layouts(wider, batch_values(gm, wider), plan.op_axes, shared)
    plan = with_rows_chunks(plan, rows, wider, tp_split)
    fc = {name: entry.output.describe() for name, entry in plan.nodes.items() if name.endswith("mlp_fc")}
    return _train(ref, par, batches, dict(plan=plan), "adamw", 1) | {"fc": fc}


def searched_tp_split_parity(tp_split: str, tied: bool, batch: int = 8, steps: int = 4) -> dict:
    """A GPT of 4 blocks searched on pp=2 x tp=2 with what each chunk's tp ranks split fixed (rows: the chunk's
    weights whole, each rank half of every micro-batch's rows), then trained on that plan (in float64 on CPU
    ranks) against one device."""
    ps.init("pp=2,tp=2")
    mesh = ps.current_mesh()
    ref, par = _gpt(4, torch.float64, tied), _gpt(4, torch.float64, tied)
    # planned for GPUs, where the chunks that split operators split them Megatron-style
    plan, _ = search(par, par.example_inputs(1), Cluster.preset("4xA100-80G"), batch, meshes=[mesh.axes],
                     data_axes=mesh.data_axes, fixed=Fixed(tp_split=tp_split, m=2, precision="fp32"))
    batches = [_batch(ref, batch, seed=s) for s in range(steps)]
    fc = {name: entry.output.describe() for name, entry in plan.nodes.items() if name.endswith("mlp_fc")}
    return _train(ref, par, batches, dict(plan=plan), "adamw", 1) | {"tp_split": plan.stage_tp_split, "fc": fc}


def skip_parity(mesh: str, schedule: str = "1f1b", skip_from: int = 0, virtual_stages: int = 1,
                steps: int = 5) -> dict:
    """SkipNet on ``mesh``: block ``skip_from``'s output travels straight to the last stage."""
    ps.init(mesh)
    torch.manual_seed(3)
    ref = SkipNet(skip_from).double()
    par = SkipNet(skip_from).double()
    par.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 16, generator=g, dtype=torch.float64), torch.randint(0, 8, (8,), generator=g))
               for _ in range(steps)]
    kwargs = dict(schedule=schedule, micro_batches=4, virtual_stages=virtual_stages)
    return _train(ref, par, batches, kwargs, "adamw", 1)


class _Held:
    """A tensor autograd saved for backward, counted while it is alive."""

    live = peak = 0

    def __init__(self, t: torch.Tensor):
        self.t, self.bytes = t, t.numel() * t.element_size()
        _Held.live += self.bytes
        _Held.peak = max(_Held.peak, _Held.live)

    def __del__(self):
        _Held.live -= self.bytes


def saved_activation_peaks(micro_batches: int = 8) -> dict:
    """Most bytes autograd holds for backward at once on each stage during one step, per schedule,
    and what one micro-batch's forward of this rank's first chunk saves."""
    ps.init("pp=2")
    out = {}
    for schedule in ("gpipe", "1f1b"):
        model = _gpt(4, torch.float32, True)
        x, y = _batch(model, 2 * micro_batches, seed=0)
        pm = ps.parallelize(model, example_inputs=(x, y), schedule=schedule, micro_batches=micro_batches)
        _Held.live = _Held.peak = 0
        with torch.autograd.graph.saved_tensors_hooks(_Held, lambda held: held.t):
            pm.train_step(x, y)
        out[schedule] = _Held.peak
    if pm.mesh.stage == 0:
        _Held.live = _Held.peak = 0
        with torch.autograd.graph.saved_tensors_hooks(_Held, lambda held: held.t):
            kept = pm.chunks["0"](x[:2])
        out["one_micro_batch"] = _Held.peak
        del kept
    del pm
    return out


def recorded_timings(schedule: str = "1f1b", micro_batches: int = 4) -> dict:
    """One recorded step's action times gathered on rank 0, with the predicted ones."""
    ps.init("pp=2")
    model = _gpt(4, torch.float32, True)
    x, y = _batch(model, 8, seed=0)
    pm = ps.parallelize(model, example_inputs=(x, y), schedule=schedule, micro_batches=micro_batches)
    pm.train_step(x, y, record=True)
    predicted = predict_timings(_gpt(4, torch.float32, True), (x, y), pm.plan, 2, Cluster.from_env())
    result = {"measured": pm.gather_timings(), "predicted": predicted, "actions": pm.actions}
    del pm
    return result
