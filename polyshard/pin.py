"""A user's pinned strategy for one module or function (MindSpore's ``shard``)."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from polyshard.errors import PolyshardError

PIN_ATTR = "_polyshard_pin"  # what a pinned module or function carries its Pin in
COPIES_ATTR = "_polyshard_copies"  # set by micro_batch_interleaved: the copies a model asks to be split into

Strategy = Sequence[Sequence[Any]]


@dataclass(frozen=True)
class Pin:
    """in_strategy: per input, slices per dim (``(2, 1)``) or a named spec (``("tp", None)``).
    out_strategy: the output's, or None for the op's natural output (partial sums reduced).
    fn: the pinned function (None for a module); name: how errors and plans call it;
    manual_split: an embedding table's rows per piece, where its dim 0 is split unevenly."""

    in_strategy: tuple
    out_strategy: tuple | None
    fn: Callable | None = None
    name: str = ""
    manual_split: tuple[int, ...] | None = None


def make_pin(in_strategy: Strategy, out_strategy: Sequence | None, fn: Callable | None, name: str,
             manual_split: Sequence[int] | None = None) -> Pin:
    """Validate the strategy's form (not its fit to shapes: that needs the tensors)."""
    if not isinstance(in_strategy, (tuple, list)) or not all(isinstance(s, (tuple, list)) for s in in_strategy):
        raise PolyshardError(
            f"`{name}`: in_strategy must be a tuple with one tuple per input, e.g. ((2, 1), (1, 1)); "
            f"got {in_strategy!r}"
        )
    for s in in_strategy:
        for c in s:
            if not (c is None or isinstance(c, str) or (type(c) is int and c >= 1)):
                raise PolyshardError(f"`{name}`: entry {c!r} of {tuple(s)} is not a positive slice count or axis name")
    counts = {type(c) is int for s in in_strategy for c in s}
    if len(counts) > 1:
        raise PolyshardError(f"`{name}`: in_strategy {tuple(map(tuple, in_strategy))} mixes slice counts and axis "
                             "names; give every dim a count, e.g. (1, 2), or every dim an axis name or None, e.g. "
                             "(None, 'tp')")
    out = tuple(out_strategy) if out_strategy is not None else None
    if manual_split is not None and (not isinstance(manual_split, (tuple, list)) or len(manual_split) < 2
                                     or not all(type(r) is int and r >= 1 for r in manual_split)):
        raise PolyshardError(f"`{name}`: manual_split gives the table's rows per piece, two or more positive "
                             f"integers such as (10, 20, 30, 4); got {manual_split!r}")
    return Pin(tuple(tuple(s) for s in in_strategy), out, fn, name,
               tuple(manual_split) if manual_split is not None else None)


# transformers' tensor-parallel styles (a model's ``_tp_plan``) as pins: (weight spec, output replicated)
# (a row-wise product whose input arrives whole slices it where it is: the pin's split input costs no collective)
_TP_STYLES = {"colwise": ("out", False), "rowwise": ("in", False), "colwise_gather_output": ("out", True),
              "colwise_rep": ("out", True), "rowwise_split_input": ("in", True), "rowwise_rep": ("in", True),
              "embedding_rowwise": ("rows", False)}
# styles that ask for what the rules do unpinned: a parameter kept whole on every rank, and (with its gradient summed
# over them) on a split input, as Qwen3's per-head q and k norms between a column- and a row-parallel product
_TP_AS_RULES = {"replicate", "replicated_with_grad_allreduce"}


def tp_plan_pins(plan: dict[str, str], calls: dict[str, int], axes: tuple[str, ...]) -> dict[str, Pin]:
    """The pins a transformers ``_tp_plan`` asks for (``{"model.layers.*.mlp.up_proj": "colwise", ...}``),
    per module path among ``calls`` (path -> rank of the module's input), splitting over ``axes``."""
    unknown = sorted({s for s in plan.values() if s not in _TP_STYLES and s not in _TP_AS_RULES})
    if unknown:
        raise PolyshardError(f"tensor-parallel styles {unknown} in the model's tp plan have no polyshard "
                             f"equivalent; known: {', '.join([*_TP_STYLES, *sorted(_TP_AS_RULES)])}")
    split = axes if len(axes) > 1 else axes[0]
    pins = {}
    for path, ndim in calls.items():
        style = next((s for pattern, s in plan.items() if fnmatch.fnmatchcase(path, pattern)), None)
        if style is None or style in _TP_AS_RULES:
            continue
        weight, gather = _TP_STYLES[style]
        x = [None] * ndim
        if weight == "in":
            x[-1] = split
        w = {"out": (split, None), "in": (None, split), "rows": (split, None)}[weight]
        out = (None,) * (ndim + (weight == "rows")) if gather else None
        pins[path] = Pin((tuple(x), w), out, None, f"{path} ({style})")
    return pins


def model_tp_plan(model) -> dict[str, str] | None:
    """A transformers model's own tensor-parallel plan (its ``_tp_plan``: module patterns and their styles), in
    module paths from ``model``: found on ``model`` or the outermost submodule carrying one (a wrapper's)."""
    for prefix, module in model.named_modules():
        plan = getattr(module, "_tp_plan", None)
        if plan:
            return {f"{prefix}.{pattern}" if prefix else pattern: style for pattern, style in plan.items()}
    return None


def tp_plan_agreement(model, params: dict) -> dict | None:
    """Where a plan's weight layouts follow the model's own tensor-parallel plan (its ``_tp_plan``): a module
    follows when its weight is split along its style's dim and nowhere else. None without a tp plan or a split."""
    plan = model_tp_plan(model)
    if not plan or not any(layout.axes for layout in params.values()):
        return None
    followed, departures = 0, []
    for path, _ in model.named_modules():
        style = next((s for pattern, s in plan.items() if fnmatch.fnmatchcase(path, pattern)), None)
        layout = params.get(f"{path}.weight")
        if style not in _TP_STYLES or layout is None:
            continue
        dim = {"out": 0, "in": 1, "rows": 0}[_TP_STYLES[style][0]]  # Linear weights are (out, in)
        split = [bool(d) for d in layout.dims]
        if split == [i == dim for i in range(len(split))]:
            followed += 1
        else:
            departures.append([path, style, layout.describe() or "R"])
    return {"followed": followed, "modules": followed + len(departures), "departures": departures}


def pin_module(module, in_strategy: Strategy, out_strategy: Sequence | None = None,
               manual_split: Sequence[int] | None = None):
    """Mark ``module`` with its pinned strategy (what :func:`polyshard.shard` does to a module), without loading
    the runtime."""
    from torch import nn

    if manual_split is not None and not isinstance(module, nn.Embedding):
        raise PolyshardError(f"manual_split splits an embedding table's rows; {type(module).__name__} is "
                             "not an nn.Embedding")
    setattr(module, PIN_ATTR, make_pin(in_strategy, out_strategy, None, type(module).__name__, manual_split))
    return module
