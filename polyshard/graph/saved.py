"""Which values of a graph autograd keeps for backward.

A value is kept when the backward of an op that reads it needs it: a product's, a norm's or an
activation function's input, or an op's own output where its backward reads that (tanh, softmax).
Sums, negation, concatenation, casts and copies need none of their inputs, a product by a constant or
by a value without gradient keeps only the other factor, and an op whose output needs no gradient has
no backward at all. Views keep their base; an expanded value that a view then copies (GQA's repeated
keys and values) is kept at its expanded size. A module captured as one op (a norm written in Python)
also keeps what its own ops keep inside: ``KEPT_INSIDE`` in its node's meta, as a multiple of its output
(under half precision a norm written in Python may keep more: :mod:`polyshard.graph.upcast` measures it, and a
loss keeps the log-probabilities of its logits cast up to ``LOSS_DTYPE``: :func:`read_by_loss`).
"""

from __future__ import annotations

import math
import weakref
from typing import Callable

from torch import fx

from polyshard.graph.ops import LOSSES, SHAPE_OPS, op_name

KEPT_INSIDE = "kept_inside"

# ops whose backward reads none of their inputs
_READS_NO_INPUT = {"add", "iadd", "sub", "rsub", "neg", "cat", "stack", "to", "type", "float", "clone",
                   "pad", "sum", "mean", "dropout", "expand"}
# ops whose backward reads their own output instead
_READS_OUTPUT = {"tanh", "sigmoid", "exp", "softmax", "log_softmax", "rsqrt", "relu"}
_VIEWS = (SHAPE_OPS - {"expand"}) | {"contiguous"}  # seen through: what their consumers keep is their base
_SAVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per graph: the names of the values kept


def needs_grad(node: fx.Node) -> bool:
    meta = node.meta.get("tensor_meta")
    if meta is None:  # before shapes are recorded: the traced value
        meta = node.meta.get("val")
    return bool(getattr(meta, "requires_grad", False))


def saved(graph: fx.Graph) -> frozenset[str]:
    """The names of the nodes whose values autograd keeps for backward."""
    found = _SAVED.get(graph)
    if found is None:
        found = _SAVED[graph] = frozenset(n.name for n in graph.nodes if is_kept(n))
    return found


def is_kept(node: fx.Node, grad: Callable[[fx.Node], bool] = needs_grad, within: set | None = None) -> bool:
    """Whether autograd keeps ``node``'s value (see the module's docstring); ``grad``: whether a value
    needs a gradient; ``within``: the consumers that count (all when None)."""
    if node.op in ("placeholder", "get_attr", "output") or op_name(node) in _VIEWS:
        return False
    if op_name(node) in _READS_OUTPUT and grad(node):
        return True
    return _read_in_backward(node, grad, within)


def read_by_loss(node: fx.Node) -> bool:
    """Whether a loss reads ``node``'s value (seen through views): the logits it runs over in ``LOSS_DTYPE``."""
    return any(op_name(u) in LOSSES or op_name(u) in _VIEWS and read_by_loss(u) for u in node.users)


def kept_inside(nodes: list[fx.Node], output: fx.Node) -> float:
    """What the ops of a run that becomes one module call keep inside it for their own backward, as a
    multiple of its output (every value inside depends on the module's input or weights, so needs a
    gradient; what the module's consumers keep of its output counts there)."""
    inside = set(nodes)
    grad = lambda n: n in inside or needs_grad(n)  # noqa: E731
    return sum(_numel(n) for n in nodes if n is not output and is_kept(n, grad, inside)) / max(_numel(output), 1)


def _read_in_backward(node: fx.Node, grad: Callable[[fx.Node], bool], within: set | None) -> bool:
    """Whether a consumer of ``node``'s value (seen through views) has a backward that reads it."""
    for user in node.users:
        name = op_name(user)
        if user.op == "output" or not grad(user) or (within is not None and user not in within):
            continue
        if name in _VIEWS:
            if _read_in_backward(user, grad, within):
                return True
        elif name in ("mul", "div", "truediv"):  # x * y keeps x for y's gradient only
            others = [o for o in user.all_input_nodes if o is not node]
            if any(grad(o) for o in others) or sum(a is node for a in user.args) > 1 or \
                    (name != "mul" and user.args[-1] is node):
                return True
        elif name not in _READS_NO_INPUT and name not in _READS_OUTPUT:
            return True
    return False


def _numel(node: fx.Node) -> float:
    """Elements of a node's value, a symbolic size at its example value."""
    val = node.meta.get("val")
    shape = getattr(val, "shape", None)
    if shape is None:
        return 0.0
    return float(math.prod(int(getattr(d, "node", None).hint) if hasattr(d, "node") else int(d) for d in shape))
