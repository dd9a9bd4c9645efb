"""Tables split unevenly by rows (manual_split) on every rank of a pool: parity with one device, the
collectives a lookup issues, and checkpoints saved under one split and loaded under another."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import polyshard as ps
from polyshard.models.recsys import ClickModel, RecsysConfig, click_batch
from polyshard.runtime import training_state
from polyshard.runtime.checkpoint import step_dir
from tests.distributed.cases import rel_err
from tests.distributed.comm_counter import CommCounter


def _click(rows: tuple[int, ...] | None, pieces: int, mesh: str, steps: int, batch: int):
    """A click model on ``mesh`` (float64) with its table pinned over tp: split as ``rows``, or evenly when
    None; its reference copy; the batches; the parallel model."""
    ps.init(mesh)
    torch.manual_seed(0)
    ref = ClickModel(RecsysConfig(rows=64, dim=8, fields=4, hidden=16)).double()
    par = copy.deepcopy(ref)
    ps.shard(par.table, in_strategy=((1, 1), (pieces, 1)), manual_split=rows)
    batches = [tuple(t.double() if t.is_floating_point() else t for t in click_batch(ref.cfg, s, batch, seed=1))
               for s in range(steps)]
    share = batch // ps.current_mesh().num_data_shards
    return ref, par, batches, ps.parallelize(par, example_inputs=tuple(t[:share] for t in batches[0]))


def click_parity(mesh: str, rows: tuple[int, ...] | None, pieces: int, steps: int = 3, batch: int = 8) -> dict:
    """AdamW steps against one device: every loss and parameter; this rank's rows; the collectives one forward
    and one backward issue (the data-parallel gradient sync aside)."""
    ref, _, batches, pm = _click(rows, pieces, mesh, steps, batch)
    ref_opt, opt = torch.optim.AdamW(ref.parameters(), lr=1e-2), torch.optim.AdamW(pm.parameters(), lr=1e-2)
    loss_err, ops = 0.0, {}
    for x, y in batches:
        ref_loss = ref(x, y)
        ref_loss.backward()
        local = pm.local_batch(x, y)
        with CommCounter() as forward:
            loss = pm(*local)
        with CommCounter() as backward:
            loss.backward()
        ops = {"forward": _op_axes(forward), "backward": _op_axes(backward)}
        loss_err = max(loss_err, _mean_loss_err(loss, ref_loss))
        ref_opt.step(), opt.step(), ref_opt.zero_grad(), opt.zero_grad()
    whole = pm.full_state_dict()
    param_err = max(rel_err(whole[k], v) for k, v in ref.state_dict().items())
    return {"loss_err": loss_err, "param_err": param_err, "ops": ops,
            "table": tuple(pm.local_parameters()["table.weight"].shape), "row_splits": pm.plan.row_splits}


def _op_axes(counter: CommCounter) -> list[str]:
    """The collectives issued over operator axes (the data-parallel gradient sync's are eager ones)."""
    return [kind for kind, group, _, _ in counter.calls if group != "eager"]


def _mean_loss_err(loss: torch.Tensor, ref: torch.Tensor) -> float:
    group = ps.current_mesh().data_group()
    mean = loss.detach().clone()
    if group is not None:
        dist.all_reduce(mean, group=group)
        mean /= dist.get_world_size(group)
    return rel_err(mean, ref.detach())


def checkpoint_across_splits(root: str, saved: tuple[int, ...], loaded: tuple[int, ...] | None, pieces: int,
                             steps: int = 2) -> dict:
    """Train ``steps`` AdamW steps with the table split as ``saved`` on tp=4 and save; load into the same model
    split as ``loaded`` (evenly when None) in ``pieces``; both take one more step. Returns the largest gaps:
    of the loaded weights, then of the next loss and weights (the optimizer state came back too)."""
    _, _, batches, pm = _click(saved, len(saved), "tp=4", steps + 1, 8)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    for x, y in batches[:steps]:
        _step(pm, opt, x, y)
    training_state.save(root, pm, opt, steps).wait()
    _, _, _, other = _click(loaded, pieces, "tp=4", steps + 1, 8)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    training_state.load(step_dir(root, steps), other, other_opt)
    a, b = pm.full_state_dict(), other.full_state_dict()
    loaded_gap = max(rel_err(b[k], v) for k, v in a.items())
    losses = [_step(m, o, *batches[steps]) for m, o in ((pm, opt), (other, other_opt))]
    a, b = pm.full_state_dict(), other.full_state_dict()
    dist.barrier()
    return {"loaded_gap": loaded_gap, "loss_gap": rel_err(losses[1], losses[0]),
            "param_gap": max(rel_err(b[k], v) for k, v in a.items()),
            "table": tuple(other.local_parameters()["table.weight"].shape)}


def _step(pm, opt, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = pm(*pm.local_batch(x, y))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()
