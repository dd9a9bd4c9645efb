"""The Plan: every parameter's and every op's layouts, as plain data that round-trips through JSON.

Lowering needs nothing else, so a plan written or edited by hand runs too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from polyshard.errors import PolyshardError
from polyshard.layout import Axes, Layout


@dataclass
class NodePlan:
    """How one graph node runs (a rule's Decision).

    impl: "local" (the op runs on each rank's pieces as written), "dtensor" (the op runs on
      DTensors built from the pieces: split weights, contractions), or "vocab_ce"
      (vocabulary-parallel cross-entropy).
    inputs: the layout each tensor input must be in (by input node name).
    output: the layout of the node's value (None for non-tensors, a tuple for tuples).
    params: for a module node, each parameter's layout (by the parameter's own name).
    shape_divisors: for view-like ops, output dim -> pieces, to turn global shape args local.
    """

    impl: str
    inputs: dict[str, Layout]
    output: Any
    params: dict[str, Layout] = field(default_factory=dict)
    shape_divisors: dict[int, int] = field(default_factory=dict)


@dataclass
class Plan:
    """op_axes: the device matrix operators split over; params: layout per parameter name;
    nodes: per graph node, how it runs; mesh/data_axes: the whole mesh it was made for;
    copies: how many interleaved slices each batch runs as (multi-copy parallel);
    model/global_batch: what it was made for, when a search made it; report: the search's figures."""

    op_axes: Axes
    params: dict[str, Layout] = field(default_factory=dict)
    nodes: dict[str, NodePlan] = field(default_factory=dict)
    mesh: Axes = ()
    data_axes: tuple[str, ...] = ()
    copies: int = 1
    model: str = ""
    global_batch: int = 0
    report: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({
            "mesh": [list(a) for a in self.mesh], "data_axes": list(self.data_axes), "copies": self.copies,
            "model": self.model, "global_batch": self.global_batch, "report": self.report,
            "op_axes": [list(a) for a in self.op_axes],
            "params": {k: _layout_out(v) for k, v in self.params.items()},
            "nodes": {k: {"impl": n.impl, "inputs": {i: _layout_out(l) for i, l in n.inputs.items()},
                          "output": _value_out(n.output), "params": {p: _layout_out(l) for p, l in n.params.items()},
                          "shape_divisors": {str(d): v for d, v in n.shape_divisors.items()}}
                      for k, n in self.nodes.items()},
        }, indent=1)

    @staticmethod
    def from_json(text: str) -> Plan:
        try:
            raw = json.loads(text)
            return Plan(
                op_axes=_axes_in(raw["op_axes"]),
                params={k: _layout_in(v) for k, v in raw["params"].items()},
                nodes={k: NodePlan(n["impl"], {i: _layout_in(l) for i, l in n["inputs"].items()},
                                   _value_in(n["output"]), {p: _layout_in(l) for p, l in n["params"].items()},
                                   {int(d): v for d, v in n["shape_divisors"].items()})
                       for k, n in raw["nodes"].items()},
                mesh=_axes_in(raw.get("mesh", [])), data_axes=tuple(raw.get("data_axes", [])),
                copies=int(raw.get("copies", 1)), model=raw.get("model", ""),
                global_batch=int(raw.get("global_batch", 0)), report=raw.get("report", {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PolyshardError(f"not a polyshard plan: {type(exc).__name__}: {exc}") from exc

    def summary(self) -> str:
        """One line per parameter: name, layout (per axis), e.g. ``blocks.0.mlp.fc.weight  tp=2:S(0)``."""
        width = max((len(k) for k in self.params), default=0)
        return "\n".join(f"{k:<{width}}  {v.describe() or 'R'}" for k, v in self.params.items())


def _axes_in(raw) -> Axes:
    return tuple((str(n), int(s)) for n, s in raw)


def _layout_out(l: Layout) -> dict:
    return {"axes": [list(a) for a in l.axes], "dims": [list(d) for d in l.dims], "partial": list(l.partial)}


def _layout_in(raw: dict) -> Layout:
    return Layout(_axes_in(raw["axes"]), tuple(tuple(d) for d in raw["dims"]), tuple(raw.get("partial", ())))


def _value_out(v: Any) -> Any:
    if isinstance(v, Layout):
        return _layout_out(v)
    if isinstance(v, tuple):
        return {"tuple": [_value_out(x) for x in v]}
    return None


def _value_in(raw: Any) -> Any:
    if raw is None:
        return None
    if "tuple" in raw:
        return tuple(_value_in(x) for x in raw["tuple"])
    return _layout_in(raw)
