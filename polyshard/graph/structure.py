"""What decides a model's exported graph, as a hashable key: two models with equal keys export the same graph.

Exporting a transformers model takes seconds of symbolic-shape work, and a process that captures the same
model again (each rank of a job that plans then runs, a benchmark's settings, a notebook's retries) would
repeat it exactly. The key reads the module tree (each module's class, mode, attributes, and its parameters'
and buffers' shapes, dtypes and devices, never their values), the inputs' structure, dtypes and sizes past the
batch dim, and the global modes export traces under. Where it meets what it cannot read (a hook, an object
of an unknown kind, a tensor held outside the parameters and buffers) there is no key, and the model is
exported afresh.
"""

from __future__ import annotations

import dataclasses
import enum
import types
from typing import Any, Callable

import torch
from torch import nn
from torch.overrides import _get_current_function_mode_stack as _function_mode_stack
from torch.utils._pytree import tree_flatten

_MODULE_STATE = frozenset(nn.Module().__dict__)  # nn.Module's own bookkeeping, read apart below
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, enum.Enum,
          type, types.FunctionType, types.BuiltinFunctionType)
_DEPTH = 8  # nested attributes read before giving up (a config of configs is 2-3 deep)


class _Unreadable(Exception):
    """Something in the model the key cannot stand for."""


def structure_key(model: nn.Module, args: tuple, kwargs: dict, is_leaf: Callable[[nn.Module], bool],
                  batched: bool) -> tuple | None:
    """The key of ``model`` called with ``(args, kwargs)``, captured with ``is_leaf`` modules kept whole; None
    where some part of it cannot be read. ``batched``: the tensor inputs share a leading batch dim, whose size
    the key leaves out."""
    if _global_hooks():
        return None
    try:
        modules = tuple(_module(name, m, is_leaf) for name, m in model.named_modules(remove_duplicate=False))
        leaves, spec = tree_flatten((tuple(args), dict(kwargs)))
        inputs = tuple(_input(v, batched) for v in leaves)
    except _Unreadable:
        return None
    function_modes = tuple((type(mode), getattr(mode, "device", None)) for mode in _function_mode_stack())
    modes = (torch.get_default_dtype(), torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"),
             torch.is_autocast_enabled("cuda"), function_modes)  # e.g. `with torch.device(...)` around the capture
    return modules, spec, inputs, modes


def _global_hooks() -> bool:
    registry = nn.modules.module
    return any(getattr(registry, name, None) for name in (
        "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks", "_global_backward_pre_hooks"))


def _module(name: str, m: nn.Module, is_leaf: Callable[[nn.Module], bool]) -> tuple:
    if any(getattr(m, hooks, None) for hooks in _HOOKS):
        raise _Unreadable(f"{name} has hooks")
    own = tuple((k, _value(v, 0)) for k, v in m.__dict__.items() if k not in _MODULE_STATE)
    params = tuple((k, None if p is None else (_tensor(p), p.requires_grad)) for k, p in m._parameters.items())
    buffers = tuple((k, None if b is None else _tensor(b), k in m._non_persistent_buffers_set)
                    for k, b in m._buffers.items())
    return name, type(m), m.training, bool(is_leaf(m)), own, params, buffers


def _input(v: Any, batched: bool) -> tuple:
    """A tensor input by its dtype, device, grad and sizes (past the batch dim where there is one: the capture
    records shapes at the rows asked for); any other input by its value."""
    if isinstance(v, torch.Tensor):
        sizes = tuple(v.shape[1:] if batched and v.dim() else v.shape)
        return "tensor", v.dim(), sizes, v.dtype, v.device, v.requires_grad
    return "value", _value(v, 0)


def _tensor(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.dtype, t.device


def _value(v: Any, depth: int) -> Any:
    """``v`` as a hashable value that is equal exactly where the values are."""
    if depth > _DEPTH:
        raise _Unreadable("nested too deep")
    if isinstance(v, torch.Tensor):  # a plain tensor attribute may be traced in as a constant: its values count
        raise _Unreadable("a tensor attribute")
    if isinstance(v, _ATOMS):
        return type(v), v
    if isinstance(v, (tuple, list)):
        return type(v), tuple(_value(x, depth + 1) for x in v)
    if isinstance(v, (set, frozenset)):
        return type(v), frozenset(_value(x, depth + 1) for x in v)
    if isinstance(v, dict):
        return type(v), tuple((_value(k, depth + 1), _value(x, depth + 1)) for k, x in v.items())
    if isinstance(v, nn.Module):  # a module held as a plain attribute: the tree above reads it where it is a child
        raise _Unreadable("a module attribute")
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        # a config: its fields, and what it holds besides (a transformers config its attention and experts
        # implementations)
        fields = {f.name: getattr(v, f.name) for f in dataclasses.fields(v)}
        return type(v), _value(fields | getattr(v, "__dict__", {}), depth + 1)
    if hasattr(v, "__dict__") and not callable(v):  # an object of plain fields (a transformers config)
        return type(v), _value(vars(v), depth + 1)
    raise _Unreadable(f"an attribute of type {type(v).__name__}")
