"""A captured graph's modules and parameters by full name and by the module call that owns them, listed once per
graph: the planner asks for every split it costs, and walking a large model's modules each time costs seconds."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from torch import fx, nn


@dataclass(frozen=True)
class Parameters:
    """named: ``gm.named_parameters()``; name_of: id -> the first full name a parameter goes by (a tied
    weight: its first module's); owned: a module's target -> its own (name, full name, parameter)."""

    named: tuple[tuple[str, nn.Parameter], ...]
    name_of: dict[int, str]
    owned: dict[str, tuple[tuple[str, str, nn.Parameter], ...]]


_LISTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_READ: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per graph: read_whole
_MODULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per graph: modules_of


def modules_of(gm: fx.GraphModule) -> dict[str, nn.Module]:
    """``gm``'s submodules by full name, shared: read it, never change it. ``gm`` itself is left out, as the entry
    would keep it alive."""
    found = _MODULES.get(gm)
    if found is None:
        found = _MODULES[gm] = {name: m for name, m in gm.named_modules() if name}
    return found


def parameters_of(gm: fx.GraphModule) -> Parameters:
    found = _LISTED.get(gm)
    if found is None:
        named = tuple(gm.named_parameters())
        owned = {n.target: tuple((k, f"{n.target}.{k}", p)
                                 for k, p in gm.get_submodule(n.target).named_parameters(recurse=False))
                 for n in gm.graph.nodes if n.op == "call_module"}
        found = _LISTED[gm] = Parameters(named, {id(p): name for name, p in reversed(named)}, owned)
    return found


def read_whole(gm: fx.GraphModule) -> dict[int, str]:
    """The parameters the graph reads as plain values (``get_attr``: a module traced through reads its own weight,
    as Gemma's scaled embedding does), by id, with the name read: each rank holds these whole, and so must every
    module that shares one (Gemma's head, tied to that table)."""
    found = _READ.get(gm)
    if found is None:
        params = dict(gm.named_parameters(remove_duplicate=False))
        found = _READ[gm] = {id(params[n.target]): n.target for n in gm.graph.nodes
                             if n.op == "get_attr" and n.target in params}
    return found
