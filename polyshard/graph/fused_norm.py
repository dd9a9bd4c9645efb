"""An RMSNorm that keeps only its input and each row's scale for backward, as fused kernels do.

transformers' RMSNorm (Llama, Mistral, Qwen) is Python: autograd keeps the normalized value besides its input (under
bf16, a float32 copy of the input in its place), a copy more than a fused norm (torchtitan's, Megatron's) keeps in
float32 and two more under bf16. A norm whose output and gradients this one reproduces bit for bit, in float32 and in
bf16, runs as this one: the same forward ops, and a backward that normalizes the kept input again.
"""

from __future__ import annotations

import torch
from torch import fx, nn
from torch.func import functional_call

from polyshard.graph.stamp import settings_of

FUSED_NORM = "fused_norm"  # a captured norm call's node meta: the eps it runs as FusedRMSNorm with
_ROWS = 8


class _RMSNorm(torch.autograd.Function):
    """``weight * (x / rms(x)).to(x.dtype)`` computed in float32, as transformers' Llama writes it. Backward runs
    the ops autograd runs for that Python, in its order and with its casts, from the input normalized again: the
    gradients are the same bits."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        wide = x.to(torch.float32)
        scale = torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, scale)
        return weight * (wide * scale).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, scale = ctx.saved_tensors
        wide = x.to(torch.float32)
        normed = wide * scale
        grad_x = grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * normed.to(x.dtype)).sum(dim=tuple(range(grad.ndim - 1))).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            grad_normed = (grad * weight).to(x.dtype).to(torch.float32)
            grad_scale = (grad_normed * wide).sum(-1, keepdim=True)
            grad_squares = (grad_scale * -0.5 * scale.pow(3)).expand(wide.shape) / wide.shape[-1]
            grad_x = (grad_normed * scale + grad_squares * (2 * wide)).to(x.dtype)
        return grad_x, grad_weight, None


class FusedRMSNorm(nn.Module):
    """Runs a norm's own ``weight`` (the same Parameter) through :class:`_RMSNorm`."""

    def __init__(self, weight: nn.Parameter, eps: float):
        super().__init__()
        self.weight, self.eps = weight, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNorm.apply(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def fused_eps(module: nn.Module, features: int) -> float | None:
    """The eps ``module`` runs as :class:`FusedRMSNorm` with, or None where it is not that norm: its output on random
    rows must equal the fused one's exactly in float32 and in bf16, and so must its gradients."""
    eps = next((v for v in (getattr(module, n, None) for n in ("variance_epsilon", "eps")) if isinstance(v, float)),
               None)
    params = dict(module.named_parameters())
    if eps is None or _told(module) or list(params) != ["weight"] or tuple(params["weight"].shape) != (features,) or \
            any(True for _ in module.buffers()):
        return None
    g = torch.Generator().manual_seed(0)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(_ROWS, features, generator=g).to(dtype).requires_grad_()
            weight = torch.randn(features, generator=g).to(dtype).requires_grad_()
            theirs, ours = functional_call(module, {"weight": weight}, (x,)), _RMSNorm.apply(x, weight, eps)
            grad = torch.randn(theirs.shape, generator=g).to(dtype)
            expected, got = (torch.autograd.grad(y, (x, weight), grad) for y in (theirs, ours))
            if theirs.dtype != ours.dtype or not all(map(torch.equal, (theirs, *expected), (ours, *got))):
                return None
    except RuntimeError:
        return None
    return eps


def _told(module: nn.Module) -> bool:
    """Whether the user told polyshard something of this module (a pin, recompute, a stage): it runs as written."""
    return any(k.startswith("_polyshard") for k in vars(module))


def fused_eps_alike(module: nn.Module, features: int, seen: dict) -> float | None:
    """:func:`fused_eps`, found once per class, features and settings (``seen`` holds what was found)."""
    if _told(module):
        return None
    key = (type(module), features, tuple(sorted((k, repr(v)) for k, v in settings_of(module).items())))
    if key not in seen:
        seen[key] = fused_eps(module, features)
    return seen[key]


def install_fused_norms(gm: fx.GraphModule) -> fx.GraphModule:
    """Each norm call marked ``FUSED_NORM`` runs as :class:`FusedRMSNorm` over its own weight. A graph module holds
    modules of its own above its leaves (fx copies the path), so the user's model keeps its norms."""
    for node in gm.graph.nodes:
        if node.op == "call_module" and (eps := node.meta.get(FUSED_NORM)) is not None:
            gm.set_submodule(node.target, FusedRMSNorm(gm.get_submodule(node.target).weight, eps))
    return gm
