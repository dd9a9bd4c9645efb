"""What a norm captured as one call keeps for backward in half precision, where its own code computes in float32.

transformers' RMSNorm casts its input to float32, normalizes, and casts back: under bf16 it keeps the float32 copy
(4 bytes an element) and the bf16 result, not its bf16 input. The captured program was traced in the model's own
dtype, where those casts do nothing, so its graph cannot show them; running the module once on a few bf16 rows
on the CPU does.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call


def may_upcast(module: nn.Module) -> bool:
    """A module of Python code of its own (not one of torch's) with per-feature parameters only: a norm that may
    compute in float32 whatever its input."""
    return not type(module).__module__.startswith("torch.") and all(p.ndim <= 1 for p in module.parameters())


def kept_inside_half(module: nn.Module, features: tuple[int, ...]) -> float:
    """Bytes ``module`` keeps for backward on a bf16 input of ``features`` per row, beyond its parameters, as
    copies of its bf16 output, less the one copy of its input the graph counts as kept by its caller (autograd
    keeps the input itself only where the module saves it)."""
    x = torch.randn(2, *features, dtype=torch.bfloat16, requires_grad=True)
    state = {name: torch.ones(t.shape, dtype=torch.bfloat16 if t.is_floating_point() else t.dtype,
                              requires_grad=t.is_floating_point())
             for name, t in [*module.named_parameters(), *module.named_buffers()]}
    skip = {t.untyped_storage().data_ptr() for t in state.values()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = functional_call(module, state, (x,))
    input_kept = kept.pop(x.untyped_storage().data_ptr(), None) is not None
    return sum(kept.values()) / (out.numel() * out.element_size()) - (not input_kept)
