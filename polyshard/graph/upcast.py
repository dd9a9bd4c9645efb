"""What a norm of Python code, captured as one call, keeps for backward and moves through memory, found by running it.

transformers' RMSNorm casts its input to float32, normalizes in several elementwise passes, and casts back: under
bf16 it keeps the float32 copy (4 bytes an element) and the bf16 result, not its bf16 input, and each pass reads
and writes the whole tensor. The captured program was traced in the model's own dtype, where the casts do nothing,
and its one call looks like one fused kernel; running the module on a few rows on the CPU, in float32 and in bf16,
shows both.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


_ROWS = 16  # enough that reading the weight once is a small part of the traffic
PROBED = "norm_probe"  # a probed call's node meta: its Probed


class Probed(NamedTuple):
    """Per element of a norm's output: copies of it kept inside (beyond the input copy the graph counts as kept by
    its caller), and bytes its own ops read and write in forward and backward, in float32 and in bf16."""

    kept_inside_full: float
    kept_inside_half: float
    moved_bytes_full: float
    moved_bytes_half: float


def may_upcast(module: nn.Module) -> bool:
    """A module of Python code of its own (not one of torch's) with per-feature parameters only: a norm that may
    compute in float32 whatever its input, in passes of its own."""
    return not type(module).__module__.startswith("torch.") and all(p.ndim <= 1 for p in module.parameters())


def kept_inside_half(node) -> float | None:
    """Copies a probed call keeps inside under half precision (None: not probed)."""
    probed = node.meta.get(PROBED)
    return None if probed is None else probed.kept_inside_half


def moved_bytes(node, itemsize: int) -> float | None:
    """Bytes per output element a probed call moves in forward and backward at ``itemsize`` (None: not probed)."""
    probed = node.meta.get(PROBED)
    return None if probed is None else probed.moved_bytes_half if itemsize < 4 else probed.moved_bytes_full


def probe(module: nn.Module, features: tuple[int, ...]) -> Probed | None:
    """``module`` run on a few rows of ``features`` (its input's last dims) in float32 and in bf16; None where it
    will not run so on the CPU (its graph's figures stand then)."""
    try:
        kept_half, moved_half = _run(module, features, torch.bfloat16)
        kept_full, moved_full = _run(module, features, torch.float32)
    except RuntimeError:
        return None
    return Probed(kept_full, kept_half, moved_full, moved_half)


def _run(module: nn.Module, features: tuple[int, ...], dtype: torch.dtype) -> tuple[float, float]:
    """(copies kept inside, bytes moved by forward and backward) per output element of one step in ``dtype``."""
    x = torch.randn(_ROWS, *features, dtype=dtype, requires_grad=True)
    state = {name: torch.ones(t.shape, dtype=dtype if t.is_floating_point() else t.dtype,
                              requires_grad=t.is_floating_point())
             for name, t in [*module.named_parameters(), *module.named_buffers()]}
    skip = {t.untyped_storage().data_ptr() for t in state.values()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in skip:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _Traffic() as traffic:
        out = functional_call(module, state, (x,))
        out.backward(torch.ones_like(out))
    input_kept = kept.pop(x.untyped_storage().data_ptr(), None) is not None
    out_bytes = out.numel() * out.element_size()
    return sum(kept.values()) / out_bytes - (not input_kept), traffic.bytes / out.numel()


class _Traffic(TorchDispatchMode):
    """Bytes the ops run under it read and write: their tensor inputs and outputs (views move none)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        read = {t.untyped_storage().data_ptr() for t in inputs}
        if not any(t.untyped_storage().data_ptr() in read for t in outputs):  # not a view
            self.bytes += sum(t.numel() * t.element_size() for t in inputs + outputs)
        return out
