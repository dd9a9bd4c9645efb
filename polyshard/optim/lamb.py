"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning", algorithm 2), correct on sharded tensors.

Per whole model tensor w, with Adam's moments bias-corrected as in the paper and NVIDIA's FusedLAMB
(``bias_correction=True``; no gradient clipping, no clamp of the trust ratio):

    m = b1 m + (1 - b1) g          v = b2 v + (1 - b2) g^2
    u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + weight_decay * w
    w = w - lr * r * u,   r = ||w|| / ||u||  (1 when either norm is 0)

A tensor the optimizer sees may be a piece of model tensors (a tensor-parallel piece, a ZeRO shard of a flat
bucket): its :class:`NormSpec` says which ranges are which model tensor and over which process groups
their squared norms are summed, so r is the whole tensor's ratio on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from polyshard.errors import PolyshardError
from polyshard.optim.closure import closure_loss


@dataclass(frozen=True)

class NormSpec:
    """segments: (offset, numel) of each model tensor within the flat optimizer tensor (numel may be 0
    on ranks holding none of it, so every rank lists the same tensors); groups: per segment, the process
    groups holding its other pieces, whose squared norms are summed (one after another)."""

    segments: tuple[tuple[int, int], ...]
    groups: tuple[tuple, ...]

    def __post_init__(self) -> None:
        if len(self.segments) != len(self.groups):
            raise PolyshardError(f"NormSpec: {len(self.segments)} segments but {len(self.groups)} group lists")


class Lamb(torch.optim.Optimizer):
    """LAMB; ``norm_specs`` maps optimizer tensors that are pieces of model tensors to their :class:`NormSpec`
    (a tensor without one is a whole model tensor). Defaults as NVIDIA's implementation."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.01,
                 norm_specs: Mapping[torch.Tensor, NormSpec] | None = None):
        if not lr > 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1 or not eps > 0 or weight_decay < 0:
            raise PolyshardError(f"LAMB needs lr > 0, 0 <= betas < 1, eps > 0, weight_decay >= 0; got "
                                 f"lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.norm_specs: dict[torch.Tensor, NormSpec] = dict(norm_specs or {})

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = state["step"]
                m, v, g = state["exp_avg"], state["exp_avg_sq"], p.grad
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                update = (m / (1 - b1 ** t)).div_((v / (1 - b2 ** t)).sqrt_().add_(group["eps"]))
                update.add_(p, alpha=group["weight_decay"])
                spec = self.norm_specs.get(p)
                for (offset, numel), ratio in zip(spec.segments if spec else ((0, p.numel()),),
                                                  _trust_ratios(p, update, spec)):
                    p.view(-1)[offset:offset + numel].add_(update.view(-1)[offset:offset + numel], alpha=-group["lr"] * ratio)
        return loss


def _trust_ratios(w: torch.Tensor, update: torch.Tensor, spec: NormSpec | None) -> list[float]:
    """||w|| / ||update|| per segment, squared norms summed over each segment's groups first."""
    segments = spec.segments if spec else ((0, w.numel()),)
    flat_w, flat_u = w.view(-1), update.view(-1)
    sq = torch.stack([torch.stack([flat_w[o:o + n].square().sum(), flat_u[o:o + n].square().sum()])
                      for o, n in segments])
    if spec:
        for groups in dict.fromkeys(spec.groups):  # first-seen order: the same on every rank
            rows = [i for i, g in enumerate(spec.groups) if g == groups]
            if groups and rows:
                part = sq[rows].contiguous()
                for pg in groups:
                    dist.all_reduce(part, group=pg)
                sq[rows] = part
    w_norm, u_norm = sq.sqrt().unbind(1)
    ratios = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
    return ratios.tolist()
