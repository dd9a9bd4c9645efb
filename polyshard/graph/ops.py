"""What a graph node computes, one name for both captures (torch.fx's and torch.export's)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx

# aten ops (export's graphs) that the rules, cost model and recompute know by their torch function
_ATEN_AS = {"scaled_dot_product_attention": F.scaled_dot_product_attention, "_softmax": "softmax",
            "_log_softmax": "log_softmax", "_unsafe_view": "view", "_to_copy": "to", "mm": "matmul",
            "bmm": "matmul", "t": "transpose", "numpy_T": "t", "broadcast_to": "expand"}


# ops (by op_name) that only reinterpret their input's storage: they move no data and keep nothing for backward
SHAPE_OPS = {"view", "reshape", "transpose", "permute", "size", "expand", "unsqueeze", "flatten", "squeeze", "t",
             "alias", "slice", "select", "split", "getitem", "getattr"}
# the loss over logits, by op_name: torch's function and aten's op it is exported as
CROSS_ENTROPY = ("cross_entropy", "cross_entropy_loss")
# ... and the runtime's vocabulary-parallel implementation that a program may call instead (compiler.ops)
LOSSES = (*CROSS_ENTROPY, "vocab_parallel_cross_entropy")
# The dtype a loss runs in under every precision: its logits are cast up to it, as Megatron-LM
# (fp16_lm_cross_entropy off by default), torchtitan's cross_entropy_loss and transformers' losses do, so the
# log-softmax over a large vocabulary is summed, kept and differentiated in float32.
LOSS_DTYPE = torch.float32


def op_key(node: fx.Node):
    """What a node computes, one name for both captures: a torch function or method name for fx's nodes,
    and for an aten op (``aten.view.default``) its name ("view") or its torch function."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        name = target.overloadpacket.__name__
        return _ATEN_AS.get(name, name)
    return target


def op_name(node: fx.Node) -> str:
    """The op's name ("add" for operator.add, torch.add, Tensor.add and aten.add); "" for a module or a graph
    input or output."""
    if node.op not in ("call_function", "call_method"):
        return ""
    key = op_key(node)
    return key if isinstance(key, str) else getattr(key, "__name__", "")


def is_shape_op(node: fx.Node) -> bool:
    """Whether ``node`` only reinterprets its input's storage (a view, a slice, a shape query)."""
    return op_name(node) in SHAPE_OPS
