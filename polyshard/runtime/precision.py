"""Mixed precision: forward, backward and gradient communication in bf16 or fp16, the loss and the step in fp32.

The model's parameters are cast to the low precision; the optimizer keeps fp32 master copies (and fp32
state), receives the communicated gradients cast up, steps, and the masters are copied down (all done by
:class:`polyshard.runtime.zero.ZeroOptimizer`). fp16's narrow range needs dynamic loss scaling
(:class:`LossScaler`); bf16 has fp32's range and needs none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import fx, nn

from polyshard.errors import PolyshardError
from polyshard.graph.export import CASTS
from polyshard.graph.ops import LOSS_DTYPE, LOSSES, op_name

COMPUTE_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(precision: str) -> torch.dtype | None:
    """The dtype forward and backward run in (None: the parameters' own)."""
    if precision not in COMPUTE_DTYPES:
        raise PolyshardError(f"precision {precision!r} is unknown; choose one of {', '.join(COMPUTE_DTYPES)}")
    return COMPUTE_DTYPES[precision]


def cast_inputs(module: nn.Module, dtype: torch.dtype):
    """Cast floating-point inputs of ``module`` to ``dtype`` before its forward (integer ids stay as they are);
    returns the hook's handle."""
    def hook(_, args):
        return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    return module.register_forward_pre_hook(hook)


def compute_casts_in(module: nn.Module, dtype: torch.dtype) -> None:
    """Casts to float32 written into captured programs (transformers' norms and logits ``.float()``,
    recorded by torch.export at the capture's dtype) cast to ``dtype`` instead, so a program computes
    in ``dtype`` throughout rather than mixing it with float32; only each loss reads its logits cast up to
    ``LOSS_DTYPE`` (export drops a cast its capture made no change by, so none is left before a loss)."""
    programs = [m for m in module.modules() if isinstance(m, fx.GraphModule)]
    programs += [getattr(module, "_single_copy")] if hasattr(module, "_single_copy") else []
    for gm in programs:
        changed = False
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target in CASTS:
                changed |= _retarget_cast(node, dtype)
            elif op_name(node) in LOSSES and not _cast_up(node.args[0]):  # once, however often it is called
                with gm.graph.inserting_before(node):
                    node.update_arg(0, gm.graph.call_method("to", (node.args[0], LOSS_DTYPE)))
                changed = True
        if changed:
            gm.recompile()


def _cast_up(value) -> bool:
    """Whether ``value`` is a loss's logits as this module casts them up."""
    return isinstance(value, fx.Node) and value.op == "call_method" and value.target == "to" and \
        value.args[1:] == (LOSS_DTYPE,)


def _retarget_cast(node: fx.Node, dtype: torch.dtype) -> bool:
    """Make a cast to float32 cast to ``dtype``; whether it was one."""
    at = CASTS[node.target]
    if node.kwargs.get("dtype") == torch.float32:
        node.kwargs = {**node.kwargs, "dtype": dtype}
        return True
    if at is not None and len(node.args) > at and node.args[at] == torch.float32:
        node.args = (*node.args[:at], dtype, *node.args[at + 1:])
        return True
    return False


@dataclass
class LossScaler:
    """Dynamic loss scaling (as torch.amp.GradScaler): the loss is multiplied by ``scale`` so small fp16
    gradients do not flush to zero; a step whose gradients hold inf/nan is skipped and the scale halved;
    after ``growth_interval`` good steps in a row the scale doubles. The first scale is the largest power of
    two fp16 holds (max 65504): a loss computed in fp16 passes the scale itself as its first gradient."""

    scale: float = 2.0**15
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    good_steps: int = 0

    def unscale_and_check(self, grads: list[torch.Tensor]) -> bool:
        """Divide ``grads`` by the scale in place; True when every rank's are finite (all ranks agree,
        since each holds different pieces)."""
        bad = torch.zeros((), device=grads[0].device if grads else None)
        for g in grads:
            g.mul_(1.0 / self.scale)
            bad = torch.maximum(bad, (~torch.isfinite(g)).any().to(bad.dtype))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return not bad.item()

    def update(self, finite: bool) -> None:
        """Halve the scale after an overflow; grow it after ``growth_interval`` finite steps."""
        if not finite:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
