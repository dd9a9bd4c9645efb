"""transformers models, unmodified, on a mesh vs one device: the loss the model computes itself
(``model(input_ids=..., labels=...).loss``), trained several AdamW steps in float64.

Llama-style models run their RMSNorm and rotary tables in float32 whatever the model's dtype, so
even a float64 run carries float32 rounding of gradients (one ulp, ~6e-8, where sharded sums round
differently). AdamW turns that into update noise proportional to its learning rate; 1e-3 keeps it
two orders under the tolerance, while a wrong gradient still moves parameters by ~lr."""

from __future__ import annotations

import torch
import torch.distributed as dist

import polyshard as ps
from polyshard.models import hf
from tests.distributed.cases import rel_err

LR = 1e-3


def hf_parity(mesh: str, family: str, steps: int = 3, batch: int = 4, seq: int = 8, **options) -> dict:
    """Worst loss and parameter errors after ``steps`` AdamW steps; ``options`` go to parallelize."""
    ps.init(mesh)
    torch.manual_seed(0)
    ref = hf.build(family, torch.float64)
    par = hf.build(family, torch.float64)
    par.load_state_dict(ref.state_dict())
    batches = [hf.batch(ref, batch, seq, seed=s) for s in range(steps)]
    rows = batch // ps.current_mesh().num_data_shards
    example = {k: v[:rows] for k, v in batches[0].items()}
    pm = ps.parallelize(par, example_inputs=example, **options)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    loss_err = 0.0
    for b in batches:
        ref_loss = ref(**b).loss
        ref_loss.backward()
        ref_opt.step(), ref_opt.zero_grad()
        ids, labels = pm.local_batch(b["input_ids"], b["labels"])
        loss = pm(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step(), opt.zero_grad()
        total = loss.detach().clone()
        if pm.grad_sync is not None:
            dist.all_reduce(total, group=pm.grad_sync.group)
            total /= pm.grad_sync.world
        loss_err = max(loss_err, rel_err(total, ref_loss.detach()))
    full = pm.full_state_dict()
    param_err = max(rel_err(full[k], p.detach()) for k, p in ref.named_parameters() if k in full)
    return {"loss_err": loss_err, "param_err": param_err, "missing": sorted(set(dict(ref.named_parameters())) - set(full)),
            "layouts": {k: str(v) for k, v in pm.plan.params.items()}}
