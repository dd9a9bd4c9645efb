"""A run's state as tensors named by the plan and sized as on one device, whatever splits them here.

Each parameter is ``model/NAME`` and each of its optimizer state tensors ``optim/NAME/KEY``, wrapped as a
DTensor of the parameter's layout (a plain tensor when replicated), so a checkpoint of this state loads
under any other plan: the loader reads, of every saved piece, the part the new layout puts here. ZeRO's
flat shards are gathered over the data group into each parameter's piece first (one bucket at a time),
and the weights saved are the fp32 masters where mixed precision keeps them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from polyshard.compiler.lower import whole_parameter
from polyshard.compiler.redistribute import to_dtensor
from polyshard.compiler.rows import row_slice
from polyshard.errors import PolyshardError
from polyshard.runtime import checkpoint
from polyshard.runtime.offload import OffloadedOptimizer
from polyshard.runtime.sync import Bucket
from polyshard.runtime.zero import ZeroOptimizer

MODEL, OPTIM, SCALER = "model/", "optim/", "scaler/"

# name -> (this rank's piece of the weights, {optimizer state key -> piece, or a 0-d tensor})
LocalState = dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]]


def save(directory, pm, opt, step: int, *, keep: int = 0, async_save: bool = False,
         extra: dict[str, torch.Tensor] | None = None, files: dict[str, str] | None = None,
         info: dict | None = None, group=None) -> checkpoint.Pending:
    """Checkpoint ``pm`` and ``opt`` at ``step`` under ``directory`` (every rank calls this; call ``wait()``
    on the result to commit it). ``extra``: more tensors (a rank's own under a key naming the rank);
    ``files``: small text files rank 0 adds; ``info``: JSON-able facts for the manifest; ``group``: see
    :func:`polyshard.runtime.checkpoint.save`."""
    manifest = dict(info or {}, optimizer=pm.plan.optimizer, params=global_shapes_all(pm))
    files = {"plan.json": pm.plan.to_json(), **(files or {})}
    return checkpoint.save(directory, step, {**state_dict(pm, opt), **(extra or {})}, manifest, keep=keep,
                           async_save=async_save, files=files, group=group)


def load(path, pm, opt, extra: dict[str, torch.Tensor] | None = None) -> dict:
    """Restore ``pm`` and ``opt`` (whatever their plan) from the checkpoint at ``path``, and fill ``extra``'s
    tensors in place where the checkpoint has them; returns its manifest (``step`` among it)."""
    manifest = checkpoint.read_manifest(path)
    meta = checkpoint.read_metadata(path)
    saved = checkpoint.tensor_entries(meta)
    mine = global_shapes(pm)
    missing = sorted(n for n in mine if MODEL + n not in saved)
    wrong = sorted(n for n in mine if MODEL + n in saved and saved[MODEL + n][0] != mine[n])
    if missing or wrong:
        raise PolyshardError(f"checkpoint {path} is of another model: "
                             + (f"it lacks {', '.join(missing[:5])}" if missing else
                                f"{wrong[0]} is {list(saved[MODEL + wrong[0]][0])} there, {list(mine[wrong[0]])} here"))
    state = empty_state_dict(pm, saved) | {k: v for k, v in (extra or {}).items() if k in saved}
    state |= {k: torch.zeros(shape, dtype=dtype) for k, (shape, dtype) in saved.items() if k.startswith(SCALER)}
    checkpoint.load(path, state, meta)
    load_state_dict(pm, opt, state)
    return manifest


def global_shapes_all(pm) -> dict[str, list[int]]:
    """Every stage's parameters' one-device shapes (pipeline ranks hold only their own stages')."""
    mine = {n: list(s) for n, s in global_shapes(pm).items()}
    group = getattr(pm, "pipe_group", None)
    if group is None:
        return mine
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, mine, group=group)
    return {k: v for part in parts for k, v in part.items()}


def state_dict(pm, opt) -> dict[str, torch.Tensor]:
    """``pm``'s parameters and ``opt``'s state by their names in the plan, as global tensors."""
    out = {}
    scaler = getattr(opt, "scaler", None)
    if scaler is not None:
        out[SCALER + "scale"] = torch.tensor(scaler.scale, dtype=torch.float64)
        out[SCALER + "good_steps"] = torch.tensor(scaler.good_steps, dtype=torch.int64)
    for name, (value, state) in local_state(pm, opt).items():
        out[MODEL + name] = _global(pm, name, value)
        for key, t in state.items():
            out[f"{OPTIM}{name}/{key}"] = _global(pm, name, t) if t.shape == value.shape and t.dim() else t
    return out


def load_state_dict(pm, opt, loaded: dict[str, torch.Tensor]) -> None:
    """Set ``pm``'s parameters and ``opt``'s state from tensors shaped as :func:`empty_state_dict` made them."""
    local = {}
    for name in pm.local_parameters():
        prefix = f"{OPTIM}{name}/"
        state = {k[len(prefix):]: _local(pm, name, v) for k, v in loaded.items() if k.startswith(prefix)}
        local[name] = (_local(pm, name, loaded[MODEL + name]), state)
    set_local_state(pm, opt, local)
    scaler = getattr(opt, "scaler", None)
    if scaler is not None and SCALER + "scale" in loaded:
        scaler.load_state_dict({k: loaded[SCALER + k].item() for k in ("scale", "good_steps")})


def empty_state_dict(pm, saved: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    """Tensors for a checkpoint's keys (``saved``: key -> global shape and dtype) laid out as ``pm``'s plan
    splits them here, on this rank's device; keys of parameters this rank does not hold are left out."""
    out = {}
    for name, p in pm.local_parameters().items():
        layout = pm.plan.params[name]
        for key in [MODEL + name] + [k for k in saved if k.startswith(f"{OPTIM}{name}/")]:
            shape, dtype = saved[key]
            if len(shape) and not layout.is_replicated and name not in pm.plan.row_splits:
                local = torch.zeros(layout.local_shape(shape), dtype=dtype, device=pm.mesh.device)
                out[key] = to_dtensor(local, layout, shape, pm.mesh)
            else:
                out[key] = torch.zeros(shape, dtype=dtype, device=pm.mesh.device)
    return out


def global_shapes(pm) -> dict[str, tuple[int, ...]]:
    """Each of this rank's parameters' shape on one device."""
    out = {}
    for name, p in pm.local_parameters().items():
        shape = tuple(pm.plan.params[name].global_shape(_shape(pm, p)))
        rows = pm.plan.row_splits.get(name)
        out[name] = (sum(rows), *shape[1:]) if rows else shape
    return out


def _shape(pm, p: nn.Parameter) -> torch.Size:
    """A parameter's local shape, also while ZeRO level 3 has released it."""
    sync = getattr(pm, "grad_sync", None)
    b = sync.bucket_of.get(id(p)) if sync is not None else None
    return b.shapes[[id(q) for q in b.params].index(id(p))] if b is not None else p.shape


def _global(pm, name: str, piece: torch.Tensor) -> torch.Tensor:
    layout = pm.plan.params[name]
    if layout.is_replicated:
        return piece
    if name in pm.plan.row_splits:  # pieces of uneven rows: saved whole, read back by rows (see _local)
        return whole_parameter(piece, name, pm.plan, pm.mesh)
    if piece.storage_offset():  # DCP's async staging fails on a DTensor over a view at an offset (a bucket's)
        piece = piece.clone()
    return to_dtensor(piece, layout, layout.global_shape(piece.shape), pm.mesh)


def _local(pm, name: str, t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a loaded tensor of parameter ``name`` (a table split by rows was saved whole)."""
    if name in pm.plan.row_splits and t.dim():
        return t[row_slice(pm.plan.row_splits[name], pm.mesh.piece_index(pm.plan.params[name], 0))]
    return t.to_local() if hasattr(t, "to_local") else t


def local_state(pm, opt) -> LocalState:
    """This rank's piece of every parameter and of its optimizer state (ints become 0-d int64 tensors)."""
    names = {id(p): n for n, p in pm.local_parameters().items()}
    if isinstance(opt, ZeroOptimizer):
        return _zero_state(opt, names)
    if isinstance(opt, OffloadedOptimizer):
        params = [p for g in opt.param_groups for p in g["params"]]
        saved = opt.state_dict()["state"]
        out = {}
        for i, p in enumerate(params):
            entry = dict(saved.get(i, {}))
            value = entry.pop("master", p.detach())
            out[names[id(p)]] = (value, _tensors(entry))
        return out
    return {names[id(p)]: (p.detach(), _tensors(opt.state.get(p, {})))
            for g in opt.param_groups for p in g["params"]}


def set_local_state(pm, opt, local: LocalState) -> None:
    """Inverse of :func:`local_state`: weights into the parameters (and masters), state into the optimizer."""
    params = pm.local_parameters()
    if isinstance(opt, ZeroOptimizer):
        _set_zero_state(opt, {id(params[n]): v for n, v in local.items()})
        return
    with torch.no_grad():
        for name, (value, _) in local.items():
            params[name].copy_(value)
    if isinstance(opt, OffloadedOptimizer):
        order = [p for g in opt.param_groups for p in g["params"]]
        by_id = {id(params[n]): v for n, v in local.items()}
        packed = opt.state_dict()
        packed["state"] = {i: {**_numbers(by_id[id(p)][1]), "master": by_id[id(p)][0]}
                           for i, p in enumerate(order) if by_id[id(p)][1]}
        opt.load_state_dict(packed)
        return
    for name, (_, state) in local.items():
        if state:
            opt.state[params[name]] = {k: v.clone() for k, v in _numbers(state).items()}


def _tensors(state: dict) -> dict[str, torch.Tensor]:
    """Optimizer state with Python ints as 0-d int64 tensors (torch's own steps are float tensors)."""
    return {k: (v.detach() if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.int64))
            for k, v in state.items() if isinstance(v, (torch.Tensor, int))}


def _numbers(state: dict[str, torch.Tensor]) -> dict:
    return {k: int(v) if v.dtype == torch.int64 and v.dim() == 0 else v for k, v in state.items()}


def _gather(opt: ZeroOptimizer, b: Bucket, shard: torch.Tensor) -> list[torch.Tensor]:
    """Each parameter's piece of a bucket-shaped tensor of which this rank holds ``shard``."""
    if not b.sharded:
        return b.views(shard)
    full = shard.new_empty(b.shard_numel * opt.world)
    dist.all_gather_into_tensor(full, shard.contiguous(), group=opt.group)
    return [v.clone() for v in b.views(full)]


def _zero_state(opt: ZeroOptimizer, names: dict[int, str]) -> LocalState:
    out = {}
    for b in opt.buckets:
        state = opt.optimizer.state.get(b.master, {})
        values = _gather(opt, b, b.master.detach())
        pieces = {k: _gather(opt, b, v) if v.dim() else [v] * len(b.params)
                  for k, v in _tensors(state).items()}
        for i, p in enumerate(b.params):
            out[names[id(p)]] = (values[i], {k: v[i] for k, v in pieces.items()})
    return out


def _shard_of(b: Bucket, pieces: list[torch.Tensor]) -> torch.Tensor:
    """This rank's slice of the bucket the parameters' pieces fill (zero padded)."""
    whole = torch.cat([t.reshape(-1) for t in pieces])
    flat = whole.new_zeros(b.flat.numel())
    flat[:whole.numel()] = whole
    return flat[b.lo:b.lo + b.shard_numel].clone()


def _set_zero_state(opt: ZeroOptimizer, local: dict[int, tuple[torch.Tensor, dict[str, torch.Tensor]]]) -> None:
    with torch.no_grad():
        for b in opt.buckets:
            entries = [local[id(p)] for p in b.params]
            b.master.copy_(_shard_of(b, [v for v, _ in entries]))
            if b.resident:
                for p, (value, _) in zip(b.params, entries):
                    p.copy_(value)
            keys = entries[0][1].keys()
            if keys:
                state = {k: _shard_of(b, [s[k] for _, s in entries]) if entries[0][1][k].dim()
                         else entries[0][1][k].clone() for k in keys}
                opt.optimizer.state[b.master] = _numbers(state)
