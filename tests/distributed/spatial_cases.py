"""Spatial parallel cases run on every rank of a pool: a ResNet-style classifier and a UNet-style segmenter
on images split by height and width (and rows over data parallel) trained against the same model, data
and seed on one device."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import polyshard as ps
from polyshard.models.resnet import ResNet
from polyshard.models.unet import UNet
from tests.distributed.cases import rel_err


def image_parity(model: str, mesh: str, strategy: tuple, steps: int = 3, batch: int = 8, image: int = 32,
                 search: bool = False) -> dict:
    """AdamW steps in float64 of ``model`` ("resnet": a classifier; "unet", "unet-nearest", "unet-bilinear":
    per-pixel classes, upsampling by transposed convolutions, nearest neighbours or bilinear) on ``mesh``
    with the images laid out by ``strategy`` (and a UNet's masks alike), against one device: every loss,
    every parameter and batch norm's running statistics. ``search``: the cost model's plan, not the rules'."""
    ps.init(mesh)
    m = ps.current_mesh()
    torch.manual_seed(0)
    build = {"resnet": ResNet, "unet": UNet, "unet-nearest": lambda **kw: UNet(up="nearest", **kw),
             "unet-bilinear": lambda **kw: UNet(up="bilinear", **kw)}[model]
    ref = build(image_size=image).double()
    par = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(1)
    labels = (batch,) if model == "resnet" else (batch, image, image)
    batches = [(torch.randn(batch, 3, image, image, generator=g, dtype=torch.float64),
                torch.randint(0, 3, labels, generator=g)) for _ in range(steps)]
    rows = batch // m.num_data_shards
    masks = None if model == "resnet" else strategy[:1] + strategy[2:]
    pm = ps.parallelize(par, example_inputs=tuple(t[:rows] for t in batches[0]), dataset_strategy=(strategy, masks),
                        search=search)
    ref_opt, opt = torch.optim.AdamW(ref.parameters(), lr=1e-2), torch.optim.AdamW(pm.parameters(), lr=1e-2)
    loss_err, tile = 0.0, None
    for x, y in batches:
        ref_loss = ref(x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        local = pm.local_batch(x, y)
        tile = tuple(local[0].shape)
        loss = pm(*local)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if m.data_group() is not None:
            dist.all_reduce(total, group=m.data_group())
            total /= m.num_data_shards
        loss_err = max(loss_err, rel_err(total, ref_loss.detach()))
    full, buffers = pm.full_state_dict(), dict(pm._single_copy.named_buffers())
    return {"loss_err": loss_err, "tile": tile,
            "param_err": max(rel_err(full[k], p.detach()) for k, p in ref.named_parameters()),
            "buffer_err": max(rel_err(buffers[k], b) for k, b in ref.named_buffers() if b.dtype.is_floating_point),
            "spatial": sorted(n for n, e in pm.plan.nodes.items() if e.impl == "spatial")}


def train_images(root: str, mesh: str, model: str, plan: str = "", steps: int = 3) -> list[float]:
    """``polyshard train``'s losses for an image model on generated 32-pixel images (float64), on ``mesh`` or
    as the ``plan`` file lays it out."""
    from polyshard.train.config import TrainConfig
    from polyshard.train.trainer import train

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        cfg = TrainConfig(model=model, mesh=mesh, plan=plan, steps=steps, batch_size=4, image_size=32, lr=1e-2,
                          log_every=100, metrics=f"{root}/metrics.jsonl")
        return [r["loss"] for r in train(cfg)]
    finally:
        torch.set_default_dtype(default)
