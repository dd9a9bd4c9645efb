"""transformers models, unmodified, on a mesh vs one device: the loss the model computes itself
(``model(input_ids=..., labels=...).loss``), trained several AdamW steps in float64.

Llama-style models run their RMSNorm and rotary tables in float32 whatever the model's dtype, so
even a float64 run carries float32 rounding of gradients (one ulp, ~6e-8, where sharded sums round
differently). AdamW turns that into update noise proportional to its learning rate; 1e-3 keeps it
two orders under the tolerance, while a wrong gradient still moves parameters by ~lr."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

import polyshard as ps
from polyshard.cluster import Cluster
from polyshard.models import hf
from polyshard.planner.config import Fixed
from polyshard.planner.search import search
from polyshard.runtime.pipeline import PipelineModule
from polyshard.runtime.zero import setup_zero
from tests.distributed.cases import rel_err
from tests.distributed.comm_counter import CommCounter

LR = 1e-3


def products_slow_against_links() -> Cluster:
    """Four A100s whose products run at 10 MFLOP/s and whose ops cost nothing fixed: splitting a tiny model's every
    product pays, as it does a large model's on real A100s."""
    a100 = Cluster.preset("4xA100-80G")
    return dataclasses.replace(a100, flops_per_s=dict.fromkeys(a100.flops_per_s, 1e7), op_overhead_s=0.0,
                               split_op_overhead_s=0.0)


def hf_parity(mesh: str, family: str, steps: int = 3, batch: int = 4, seq: int = 8, zero: int | None = None,
              layers: int | None = None, precision: str = "fp32", optimizer: str | None = None,
              table_rows: tuple[int, ...] | None = None, table_columns: int | None = None, tp_split: str | None = None,
              tp_comm: str | None = None, collectives: bool = False, config: dict | None = None, **options) -> dict:
    """Worst loss and parameter errors after ``steps`` optimizer steps; ``zero``: optimizer parallel level (by
    :func:`setup_zero`); ``layers``: decoder layers instead of the tiny config's; ``precision``: "bf16" or
    "fp16" computes in half precision over fp32 masters, against an fp32 reference (the others: float64);
    ``optimizer``: "adamw" or "sgd" (default: AdamW in float64, SGD with momentum in half precision);
    ``table_rows``: the input embedding's rows split so over the operator axis (manual_split); ``table_columns``:
    its features split in that many pieces (a tied head follows); ``tp_split``, ``tp_comm``: the plan searched (for
    A100s, on a meta twin of the model; given ``tp_comm``, for :func:`products_slow_against_links`) with what each
    pipeline chunk's tp ranks split, or the collectives that move values between split ops, fixed so;
    ``collectives``: also return the collectives the mesh's steps ran, as (kind, bytes in), the data-parallel
    gradient sync's eager all-reduces aside; ``config``: settings of the tiny config changed; ``options`` go to
    parallelize."""
    ps.init(mesh)
    torch.manual_seed(0)
    depth = {} if layers is None else {"n_layer" if family == "gpt2" else "num_hidden_layers": layers}
    depth |= config or {}
    dtype = torch.float64 if precision == "fp32" else torch.float32
    zero = 0 if zero is None and precision != "fp32" else zero
    ref = hf.build(family, dtype, **depth)
    par = hf.build(family, dtype, **depth)
    par.load_state_dict(ref.state_dict())
    ref.to(ps.current_mesh().device)  # parallelize moves ``par`` there
    if table_rows is not None:
        ps.shard(par.get_input_embeddings(), in_strategy=((1, 1), (len(table_rows), 1)), manual_split=table_rows)
    if table_columns is not None:
        ps.shard(par.get_input_embeddings(), in_strategy=((1, 1), (1, table_columns)))
    batches = [{k: v.to(ps.current_mesh().device) for k, v in hf.batch(ref, batch, seq, seed=s).items()}
               for s in range(steps)]
    rows = batch // ps.current_mesh().num_data_shards
    if tp_split is not None or tp_comm is not None:  # searched on meta, as `polyshard plan` does, and run here
        mesh = ps.current_mesh()
        meta = hf.build(family, dtype, device="meta", **depth)
        row = {k: v[:1].to("meta") for k, v in batches[0].items()}
        cluster = products_slow_against_links() if tp_comm else Cluster.preset("4xA100-80G")
        options["plan"], _ = search(meta, row, cluster, batch, meshes=[mesh.axes],
                                    data_axes=mesh.data_axes,
                                    fixed=Fixed(tp_split=tp_split, tp_comm=tp_comm, precision="fp32", **options))
        options = {"plan": options["plan"]}
    pm = ps.parallelize(par, example_inputs={k: v[:rows] for k, v in batches[0].items()}, **options)
    # half precision: SGD with momentum, which passes rounding through unamplified (AdamW would turn noise
    # on the key bias's gradient, zero in exact arithmetic, into full-size updates)
    name = optimizer or ("adamw" if precision == "fp32" else "sgd")
    kwargs = {"lr": LR} if name == "adamw" else {"lr": 0.1, "momentum": 0.9}
    optimizer_class = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[name]
    ref_opt = optimizer_class(ref.parameters(), **kwargs)
    opt = setup_zero(pm, zero, name, precision, threshold_bytes=256, **kwargs) if zero is not None else \
        optimizer_class(pm.parameters(), **kwargs)
    group = opt.group if zero is not None else pm.mesh.data_group()
    loss_err = 0.0
    counter = CommCounter() if collectives else contextlib.nullcontext()
    for b in batches:
        ref_loss = ref(**b).loss
        ref_loss.backward()
        ref_opt.step(), ref_opt.zero_grad()
        ids, labels = pm.local_batch(b["input_ids"], b["labels"])
        with counter:
            if isinstance(pm, PipelineModule):  # forward and backward through the schedule
                loss = pm.train_step(input_ids=ids, labels=labels)
            else:
                loss = pm(input_ids=ids, labels=labels).loss
                (opt.scale_loss(loss) if zero is not None else loss).backward()
        opt.step(), opt.zero_grad()
        total = loss.detach().clone()
        if group is not None:
            dist.all_reduce(total, group=group)
            total /= dist.get_world_size(group)
        loss_err = max(loss_err, rel_err(total, ref_loss.detach()))
    with opt.gathered() if zero is not None else contextlib.nullcontext():
        full = pm.full_state_dict()
    # OPT's key bias: softmax ignores it, so its gradient is rounding noise that AdamW turns into steps of
    # ~1e-15; it is compared on the scale of one step (LR), the others on their own
    errors = [(rel_err(full[k].to(p.dtype), p.detach(), floor=LR), k) for k, p in ref.named_parameters()
              if k in full]
    result = {"loss_err": loss_err, "param_err": max(errors)[0], "worst": max(errors),
              "missing": sorted(set(dict(ref.named_parameters())) - set(full)),
              "layouts": {k: str(v) for k, v in pm.plan.params.items()},
              "outputs": {k: str(v.output) for k, v in pm.plan.nodes.items()},
              "sequence_parallel": pm.plan.sequence_parallel, "boundaries": list(pm.plan.stage_boundaries),
              "tp_split": pm.plan.stage_tp_split}
    if collectives:
        result["collectives"] = [(kind, nbytes) for kind, group, _, nbytes in counter.calls if group != "eager"]
    if zero is not None:
        opt.remove()
    return result
