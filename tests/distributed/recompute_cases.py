"""Recompute cases run on every rank of a pool: parity with one device, collectives issued in backward."""

from __future__ import annotations

import torch

import polyshard as ps
from tests.distributed.cases import _batch, _build, _optimizer, rel_err
from tests.distributed.comm_counter import CommCounter


def recompute_parity(mesh: str, mode: str, comm: str = "keep", dtype=torch.float64, optimizer: str = "adamw",
                     copies: int = 1, steps: int = 5, batch: int = 8) -> dict:
    """Train ``steps`` steps on one device and, recomputing, on the mesh: errors, losses, backward collectives."""
    ps.init(mesh)
    ref, par = _build("gpt-tiny", dtype, True), _build("gpt-tiny", dtype, True)
    pm = ps.parallelize(par, example_inputs=_batch(ref, batch, seed=0), recompute=mode, recompute_comm=comm,
                        copies=copies)
    ref_opt, opt = _optimizer(ref.parameters(), optimizer), _optimizer(pm.parameters(), optimizer)
    losses, loss_err, backward_collectives = [], 0.0, []
    for s in range(steps):
        x, y = _batch(ref, batch, seed=s)
        ref_loss, loss = ref(x, y), pm(x, y)
        ref_loss.backward()
        with CommCounter() as counter:
            loss.backward()
        backward_collectives.append(len(counter.calls))
        ref_opt.step(), opt.step(), ref_opt.zero_grad(), opt.zero_grad()
        losses.append(loss.item())
        loss_err = max(loss_err, rel_err(loss.detach(), ref_loss.detach()))
    full = pm.full_state_dict()
    param_err = max(rel_err(full[k], p.detach()) for k, p in ref.named_parameters())
    regions = [name for name, _ in pm.program.named_children() if name.startswith("recompute_")]
    del pm, opt
    return {"loss_err": loss_err, "param_err": param_err, "losses": losses, "regions": regions,
            "backward_collectives": backward_collectives}
