"""The Plan: every parameter's and every op's layouts, as plain data that round-trips through JSON.

Lowering needs nothing else, so a plan written or edited by hand runs too.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from polyshard.buckets import BUCKET_BYTES, FIRST_BUCKET_BYTES
from polyshard.errors import PolyshardError
from polyshard.layout import Axes, Layout

class Choice(str, Enum):
    """One of an option's values: it compares, prints and goes to JSON as its string, so "full" and
    ``Recompute.FULL`` are the same setting."""

    __str__, __format__, __repr__ = str.__str__, str.__format__, str.__repr__


class Recompute(Choice):
    """Activations run again in backward instead of kept: none; the attention cores; every block's ops but its
    products and attention; those and every second of its weight products; every second block; every block."""

    NONE, SELECTIVE, POINTWISE, ALTERNATE, HALF, FULL = "none", "selective", "pointwise", "alternate", "half", "full"


class RecomputeComm(Choice):
    """In recomputed regions, keep the results of collectives, or communicate again in backward."""

    KEEP, RECOMPUTE = "keep", "recompute"


class Schedule(Choice):
    """The order a pipeline stage runs its micro-batches' forwards and backwards in."""

    GPIPE, ONE_F_ONE_B, INTERLEAVED = "gpipe", "1f1b", "interleaved"


class Optimizer(Choice):
    """The update rule the optimizer step runs."""

    ADAMW, SGD, LAMB = "adamw", "sgd", "lamb"


class Precision(Choice):
    """The compute dtype; master weights stay fp32."""

    FP32, BF16, FP16 = "fp32", "bf16", "fp16"


class Offload(Choice):
    """Where the optimizer state (and its step) lives instead of the device."""

    NONE, HOST, DISK = "none", "host", "disk"


RECOMPUTE_MODES = tuple(Recompute)
RECOMPUTE_COMMS = tuple(RecomputeComm)
SCHEDULES = tuple(Schedule)
ZERO_LEVELS = (0, 1, 2, 3)
ZERO_THRESHOLD_BYTES = 64 * 1024  # parameters smaller than this stay whole at optimizer levels 1-3
OPTIMIZERS = tuple(Optimizer)
PRECISIONS = tuple(Precision)
DTYPES = {"fp32": ("float32", 4), "bf16": ("bfloat16", 2), "fp16": ("float16", 2)}  # precision -> (dtype, bytes)
OFFLOADS = tuple(Offload)
TP_SPLITS = ("ops", "rows")  # what a pipeline chunk's operator ranks split: its operators, or its batch rows


def most_recompute(modes) -> str:
    """Of recompute modes, the one that runs the most again (a pipeline's recompute when its chunks differ)."""
    return max(modes, key=RECOMPUTE_MODES.index)


def recompute_text(recompute: str, stage_recompute: tuple[str, ...] = ()) -> str:
    """A recompute setting as ``--config`` spells it: the mode, or each pipeline chunk's (:func:`chunks_text`)."""
    return chunks_text(stage_recompute) or str(recompute)


def chunks_text(values: Sequence[str]) -> str:
    """A setting per pipeline chunk as ``--config`` spells it: joined by "/", a run of chunks that share a value as
    VALUE*COUNT ("pointwise*24/none*8": 128 chunks stay one short line)."""
    runs = ((str(value), len(list(run))) for value, run in itertools.groupby(values))
    return "/".join(value + f"*{count}" * (count > 1) for value, count in runs)


def chunk_values(text: str, what: str) -> tuple[str, ...]:
    """Each chunk's value in a :func:`chunks_text` spelling (VALUE or VALUE*COUNT, joined by "/"); ``what``: the
    setting, named in the error."""
    values: list[str] = []
    for entry in text.split("/"):
        value, star, count = entry.partition("*")
        if star and not (count.isdigit() and int(count) > 0):
            raise PolyshardError(f"{what}={text}: {entry!r} is not VALUE or VALUE*COUNT with a positive COUNT of "
                                 "pipeline chunks (e.g. 'none*8')")
        values += [value] * (int(count) if star else 1)
    return tuple(values)


def check_choice(what: str, value: Any, allowed: tuple) -> None:
    """Raise a PolyshardError naming ``what`` unless ``value`` is one of ``allowed`` (a string for a Choice)."""
    kind = str if isinstance(allowed[0], str) else int
    if type(value) is bool or not isinstance(value, kind) or value not in allowed:
        raise PolyshardError(f"{what} must be one of {', '.join(map(repr, allowed))}; got {value!r}")


@dataclass
class NodePlan:
    """How one graph node runs (a rule's answer).

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


def takes_moved_dtensor(src: Layout, dst: Layout, takers: Sequence[NodePlan]) -> bool:
    """Whether a DTensor op among ``takers`` takes the value as the DTensor its move from ``src`` made (lowering
    hands it over where the move keeps the device matrix), so that its gradient goes back in one redistribution."""
    return src != dst and src.axes == dst.axes and any(t.impl == "dtensor" for t in takers)


def splits_operators(op_axes) -> bool:
    """Whether an operator axis of ``op_axes`` ((name, size), ...) has 2 ranks or more, so ops may communicate."""
    return any(size > 1 for _, size in op_axes)


@dataclass(frozen=True)
class Plan:
    """op_axes: the device matrix operators split over; params: layout per parameter name;
    nodes: per graph node, how it runs; mesh/data_axes: the whole mesh it was made for;
    copies: how many interleaved slices each batch runs as (multi-copy parallel);
    recompute: activations run again in backward instead of stored ("none"; "selective": attention
      cores, cheap to run and large to store; "pointwise": each block's ops but its products and attention,
      norms and activation functions among them, keeping the products' and attention's outputs; "alternate":
      those and every second product by a weight in a block (the second, fourth, ...), as torchtitan's selective
      op checkpointing; "half": every second block whole (the second, fourth, ...), as torchtitan's selective layer
      checkpointing, which the search prices where asked only; "full": every block, keeping only block inputs);
    recompute_comm: in recomputed regions, "keep" the results of collectives or "recompute" them
      (communicating again in backward, for less memory);
    stage_recompute: a pipeline's own mode per chunk, in chunk order, instead of ``recompute``'s (early
      stages hold more micro-batches in flight, so they may recompute where later ones need not);
    stage_tp_split: what each pipeline chunk's operator ranks split, in chunk order: "ops" (its operators, as
      ``nodes`` lay them out), or "rows" (each rank a share of the micro-batch's rows, every weight of the chunk
      whole: a sub-mesh of data parallel for that stage); empty when every chunk splits its operators;
    stage_boundaries: module paths where pipeline stages 2, 3, ... begin (the mesh's "pp" axis has
      the stages); schedule: "gpipe", "1f1b" or "interleaved"; micro_batches per step;
      virtual_stages: stages per rank under the interleaved schedule;
    zero: optimizer parallel level over the data axes (1: optimizer state, 2: and gradients,
      3: and parameters sharded); zero_threshold_bytes: smaller parameters stay whole;
    bucket_bytes: gradients per data-parallel collective; first_bucket_bytes: the first bucket backward
      closes (small where communication runs beside compute, so it starts early);
    optimizer: "adamw", "sgd" or "lamb"; precision: "fp32", "bf16" or "fp16" (fp32 master weights);
    offload: optimizer state (and its step) kept on the "host" or on "disk" instead of the device;
    model/global_batch/seq_len/image_size: what it was made for, when a search made it (rows of seq_len tokens, or
      square images of image_size pixels; 0 where unknown or not that kind of model); report: the search's figures;
    row_splits: a table split unevenly by rows (MindSpore's manual_split): its rows per piece, by parameter
      name, the pieces in the order of the axes that split its dim 0."""

    op_axes: Axes
    params: dict[str, Layout] = field(default_factory=dict)
    nodes: dict[str, NodePlan] = field(default_factory=dict)
    mesh: Axes = ()
    data_axes: tuple[str, ...] = ()
    copies: int = 1
    recompute: Recompute = Recompute.NONE
    recompute_comm: RecomputeComm = RecomputeComm.KEEP
    stage_recompute: tuple[Recompute, ...] = ()
    stage_tp_split: tuple[str, ...] = ()
    stage_boundaries: tuple[str, ...] = ()
    schedule: Schedule = Schedule.ONE_F_ONE_B
    micro_batches: int = 1
    virtual_stages: int = 1
    zero: int = 0
    zero_threshold_bytes: int = ZERO_THRESHOLD_BYTES
    bucket_bytes: int = BUCKET_BYTES
    first_bucket_bytes: int = FIRST_BUCKET_BYTES
    optimizer: Optimizer = Optimizer.ADAMW
    precision: Precision = Precision.FP32
    offload: Offload = Offload.NONE
    model: str = ""
    global_batch: int = 0
    seq_len: int = 0
    image_size: int = 0
    report: dict = field(default_factory=dict)
    row_splits: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def splits_operators(self) -> bool:
        """Whether an operator axis has 2 ranks or more, so ops may communicate."""
        return splits_operators(self.op_axes)

    @property
    def sequence_parallel(self) -> bool:
        """Whether a row-parallel product reduce-scatters its sums along the sequence (the dim before
        the features) instead of all-reducing them: Megatron's sequence parallel."""
        def scatters(n: NodePlan) -> bool:
            w, out = n.params.get("weight"), n.output
            return (n.impl == "dtensor" and w is not None and w.ndim == 2 and isinstance(out, Layout)
                    and out.ndim >= 3 and bool(set(w.dims[1]) & set(out.dims[-2])))
        return any(map(scatters, self.nodes.values()))

    def __post_init__(self) -> None:
        for name, allowed in _CHOICES.items():
            check_choice(name, getattr(self, name), allowed)
            if isinstance(allowed[0], Choice):
                object.__setattr__(self, name, type(allowed[0])(getattr(self, name)))
        for name in ("copies", "micro_batches", "virtual_stages", "bucket_bytes", "first_bucket_bytes"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise PolyshardError(f"{name} must be a positive integer; got {getattr(self, name)!r}")
        object.__setattr__(self, "stage_boundaries", tuple(self.stage_boundaries))  # a list read from JSON
        for mode in self.stage_recompute:
            check_choice("stage_recompute", mode, RECOMPUTE_MODES)
        object.__setattr__(self, "stage_recompute", tuple(map(Recompute, self.stage_recompute)))
        for split in self.stage_tp_split:
            check_choice("stage_tp_split", split, TP_SPLITS)
        object.__setattr__(self, "stage_tp_split", tuple(self.stage_tp_split))

    def recompute_of(self, chunk: int) -> Recompute:
        """The recompute mode pipeline chunk ``chunk`` runs."""
        return self.stage_recompute[chunk] if self.stage_recompute else self.recompute

    def to_json(self) -> str:
        return json.dumps({
            "mesh": [list(a) for a in self.mesh], "data_axes": list(self.data_axes),
            **{name: getattr(self, name) for name in _SETTINGS}, "stage_boundaries": list(self.stage_boundaries),
            "stage_recompute": list(self.stage_recompute), "stage_tp_split": list(self.stage_tp_split),
            "model": self.model, "global_batch": self.global_batch, "seq_len": self.seq_len,
            "image_size": self.image_size, "report": self.report,
            "row_splits": {k: list(v) for k, v in self.row_splits.items()},
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
        except json.JSONDecodeError as exc:
            raise PolyshardError(f"not a polyshard plan: not JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(raw, dict):
            raise PolyshardError(f"not a polyshard plan: a plan is a JSON object, not a {type(raw).__name__}")
        missing = [k for k in ("op_axes", "params", "nodes") if k not in raw]
        if missing:
            raise PolyshardError(f"not a polyshard plan: no {', '.join(map(repr, missing))} key; write plans with "
                                 "`polyshard plan --out`")
        try:
            return Plan(
                op_axes=_axes_in(raw["op_axes"]),
                params={k: _layout_in(v) for k, v in raw["params"].items()},
                nodes={k: NodePlan(n["impl"], {i: _layout_in(l) for i, l in n["inputs"].items()},
                                   _value_in(n["output"]), {p: _layout_in(l) for p, l in n["params"].items()},
                                   {int(d): v for d, v in n["shape_divisors"].items()})
                       for k, n in raw["nodes"].items()},
                mesh=_axes_in(raw.get("mesh", [])), data_axes=tuple(raw.get("data_axes", [])),
                **{name: raw[name] for name in _SETTINGS if name in raw},
                stage_boundaries=tuple(raw.get("stage_boundaries", ())),
                stage_recompute=tuple(raw.get("stage_recompute", ())),
                stage_tp_split=tuple(raw.get("stage_tp_split", ())), model=raw.get("model", ""),
                global_batch=int(raw.get("global_batch", 0)), seq_len=int(raw.get("seq_len", 0)),
                image_size=int(raw.get("image_size", 0)), report=raw.get("report", {}),
                row_splits={k: tuple(int(r) for r in v) for k, v in raw.get("row_splits", {}).items()},
            )
        except PolyshardError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise PolyshardError(f"not a polyshard plan: {type(exc).__name__}: {exc}") from exc

    def summary(self) -> str:
        """One line per parameter: name, layout (per axis), e.g. ``blocks.0.mlp.fc.weight  tp=2:S(0)``, and the
        rows per piece of a table split unevenly."""
        width = max((len(k) for k in self.params), default=0)
        rows = {k: f"  rows {'/'.join(map(str, r))}" for k, r in self.row_splits.items()}
        return "\n".join(f"{k:<{width}}  {v.describe() or 'R'}{rows.get(k, '')}" for k, v in self.params.items())


_CHOICES = {"recompute": RECOMPUTE_MODES, "recompute_comm": RECOMPUTE_COMMS, "schedule": SCHEDULES,
            "zero": ZERO_LEVELS, "optimizer": OPTIMIZERS, "precision": PRECISIONS, "offload": OFFLOADS}
# Whole-model settings: plain JSON scalars, absent from older plan files (which then take the defaults).
_SETTINGS = ("copies", "micro_batches", "virtual_stages", "zero_threshold_bytes", "bucket_bytes", "first_bucket_bytes",
             *_CHOICES)


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
