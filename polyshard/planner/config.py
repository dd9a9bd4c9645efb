"""A training configuration in one line, as people write them (``dp=8,tp=8,pp=16,mbs=1,zero=1``):
the settings a user fixes for the search, and the spelling every plan is reported in."""

from __future__ import annotations

from dataclasses import dataclass, fields

from polyshard.buckets import BUCKET_BYTES
from polyshard.errors import PolyshardError
from polyshard.plan import (OFFLOADS, PRECISIONS, RECOMPUTE_COMMS, RECOMPUTE_MODES, SCHEDULES, TP_SPLITS,
                            ZERO_LEVELS, check_choice, chunk_values, most_recompute)


@dataclass(frozen=True)
class Fixed:
    """Settings the search must keep; None leaves one to the search.

    dp / tp / pp: data-parallel replicas, operator-parallel ranks, pipeline stages; h / w: ranks that split each image
    by height / width (an image model's spatial parallel); sp: sequence parallel (1: row-parallel products
    reduce-scatter along the sequence wherever they can, 0: never; left out, the search decides op by op); mbs: rows per
    micro-batch; m: micro-batches per step (pipeline micro-batches, or gradient accumulation when pp=1); schedule:
    pipeline schedule; v: virtual stages per rank (interleaved); zero: optimizer parallel level; recompute: none /
    selective / pointwise / alternate / half / full, or in a pipeline one per chunk joined by "/", a run of chunks as
    MODE*COUNT (``full/none``: the first stage recomputes, the second does not; ``full*3/none``); recompute_comm: keep
    the results of collectives in recomputed regions or issue them again (recompute); precision: fp32 / bf16 / fp16;
    offload: where the optimizer state lives; cuts: where pipeline stages begin, "balanced" (the search's, by time and
    memory) or "even" (block counts as equal as they can be, the larger stages first: Megatron-LM's layers per stage,
    DeepSpeed's uniform partition); overlap: 1 (the default, as polyshard's runtime runs it) prices the data-parallel
    gradient reduction beside backward, 0 after it (as Megatron-LM did before its 2023 overlap option, and DeepSpeed's
    pipeline engine does): a pricing choice only, for comparing with runs of other systems; bucket: MiB of gradients per
    data-parallel collective; tp_split: what a pipeline chunk's tp ranks split, "ops" (its operators) or "rows" (its
    micro-batch's rows, every weight of the chunk whole), for every chunk or one per chunk joined by "/"; tp_comm: the
    collectives that move values between split ops, "any" (the default) or "all_reduce" (every value between the split
    products whole on each rank, their partial sums all-reduced: Megatron-LM's tensor parallel before sequence parallel,
    for comparing with its runs)."""

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    h: int | None = None
    w: int | None = None
    sp: int | None = None
    mbs: int | None = None
    m: int | None = None
    schedule: str | None = None
    v: int | None = None
    zero: int | None = None
    recompute: str | None = None
    recompute_comm: str | None = None
    precision: str | None = None
    offload: str | None = None
    cuts: str | None = None
    overlap: int | None = None
    bucket: int | None = None
    tp_split: str | None = None
    tp_comm: str | None = None

    @staticmethod
    def parse(text: str) -> Fixed:
        """``key=value`` pairs joined by commas, keys as the fields are named."""
        known = {f.name for f in fields(Fixed)}
        values: dict[str, object] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or not value:
                raise PolyshardError(f"--config entry {part!r} is not KEY=VALUE (e.g. 'tp=8')")
            if key not in known:
                raise PolyshardError(f"--config key {key!r} is unknown; keys: {', '.join(sorted(known))}")
            if key in values:
                raise PolyshardError(f"--config sets {key!r} twice")
            values[key] = value if key in _CHOICES else _positive(key, value)
        fixed = Fixed(**values)
        fixed.check()
        return fixed

    def check(self) -> None:
        """Raise a PolyshardError for a value no plan can hold."""
        for key, allowed in _CHOICES.items():
            per_chunk = {"recompute": self.recompute_modes or (), "tp_split": self.stage_tp_split}
            for value in per_chunk.get(key, (getattr(self, key),)):
                if value is not None:
                    check_choice(f"--config {key}", value, allowed)
        chunks = len(self.stage_recompute)
        if chunks and (self.pp is None or chunks % self.pp or (self.v or chunks // self.pp) * self.pp != chunks):
            raise PolyshardError(f"--config recompute={self.recompute} gives a mode to each of {chunks} pipeline "
                                 f"chunks; give pp (and v) whose pp x v is {chunks}")
        splits = self.stage_tp_split
        if len(splits) > 1 and (self.pp is None or len(splits) % self.pp):
            raise PolyshardError(f"--config tp_split={self.tp_split} gives a split to each of {len(splits)} pipeline "
                                 f"chunks; give pp (and v) whose pp x v is {len(splits)}")
        for key in ("sp", "overlap"):
            if getattr(self, key) not in (None, 0, 1):
                raise PolyshardError(f"--config {key} must be 0 or 1; got {getattr(self, key)}")
        if self.zero is not None and self.zero not in ZERO_LEVELS:
            raise PolyshardError(f"--config zero must be one of {ZERO_LEVELS}; got {self.zero}")
        modes = self.recompute_modes
        if self.recompute_comm is not None and modes is not None and all(m == "none" for m in modes):
            raise PolyshardError(f"--config recompute_comm={self.recompute_comm} applies to recomputed regions, and "
                                 f"recompute={self.recompute} recomputes nothing; leave out one of them")
        if self.tp_comm == "all_reduce" and self.sp:
            raise PolyshardError("--config sp=1 reduce-scatters along the sequence, and tp_comm=all_reduce allows "
                                 "all-reduces alone; leave out one of them")
        if self.offload not in (None, "none") and (self.zero or self.precision not in (None, "fp32")):
            other = f"zero={self.zero}" if self.zero else f"precision={self.precision}"
            raise PolyshardError(f"--config offload={self.offload} keeps the whole fp32 optimizer state off the "
                                 f"device, and {other} changes that state; leave out one of them")
        if self.v is not None and self.v > 1 and self.schedule not in (None, "interleaved"):
            raise PolyshardError(f"--config v={self.v} needs schedule=interleaved, not {self.schedule!r}")
        if self.v == 1 and self.schedule == "interleaved":
            raise PolyshardError("--config schedule=interleaved runs v >= 2 chunks on each pipeline rank, and v=1 "
                                 "gives each one; leave out v, or use schedule=1f1b")
        if self.pp == 1 and self.pipeline_keys:
            given = ",".join(f"{k}={getattr(self, k)}" for k in self.pipeline_keys)
            raise PolyshardError(f"--config {given} sets how pipeline stages run, and pp=1 has none; leave out "
                                 f"one of them")

    def check_devices(self, devices: int) -> None:
        """Raise unless the fixed dp / tp / pp / h / w can split ``devices``."""
        given = {k: getattr(self, k) for k in ("dp", "tp", "pp", "h", "w") if getattr(self, k) is not None}
        product = 1
        for key, size in given.items():
            product *= size
            if devices % product:
                raise PolyshardError(f"--config {','.join(f'{k}={v}' for k, v in given.items())} does not divide the "
                                     f"{devices} devices of the cluster; choose sizes that divide {devices}")
        if {"dp", "tp", "pp"} <= set(given) and product != devices:
            raise PolyshardError(f"--config {' x '.join(given)} = {product}, and the cluster has {devices} devices")

    def conflict(self, global_batch: int, blocks: int) -> str:
        """The first rule of a plan that these settings break for ``global_batch`` rows and a model of ``blocks``
        repeated blocks, in words; '' where each could hold."""
        # the fewest pipeline chunks these settings allow: a pipeline has 2 stages or more, interleaving 2 chunks a rank
        pp, v = self.pp or (2 if self.pipeline_keys else 1), self.v or (2 if self.schedule == "interleaved" else 1)
        chunks, rows = pp * v, global_batch // (self.dp or 1)
        given = ",".join(f"{k}={getattr(self, k)}" for k in ("pp", "schedule", "v") if getattr(self, k) is not None)
        cut = " x ".join(f"{k}={getattr(self, k)}" for k in ("mbs", "m") if getattr(self, k))
        per_step = (self.mbs or 1) * (self.m or 1)
        rules = (
            (chunks > blocks, f"{given} makes {'' if self.pp and (self.v or v == 1) else 'at least '}{chunks} pipeline "
                              f"chunks, and the model has {blocks} blocks to cut them at"),
            (self.dp and global_batch % self.dp, f"dp={self.dp} does not split the batch of {global_batch}"),
            (self.dp and rows % per_step, f"{cut} does not divide a replica's {rows} rows (the batch of "
                                          f"{global_batch} at dp={self.dp})"),
            (self.dp == 1 and self.zero, f"zero={self.zero} shards over data-parallel replicas, and dp=1 has one"),
        )
        return next((words for broken, words in rules if broken), "")

    @property
    def bucket_bytes(self) -> int:
        """The fixed bucket size in bytes, else the default."""
        return BUCKET_BYTES if self.bucket is None else self.bucket * 2**20

    @property
    def recompute_modes(self) -> tuple[str, ...] | None:
        """The fixed recompute mode, or each pipeline chunk's."""
        return None if self.recompute is None else chunk_values(self.recompute, "--config recompute")

    @property
    def stage_tp_split(self) -> tuple[str, ...]:
        """What each pipeline chunk's tp ranks split (one entry: every chunk's); empty if not fixed."""
        return () if self.tp_split is None else chunk_values(self.tp_split, "--config tp_split")

    @property
    def pipeline_keys(self) -> tuple[str, ...]:
        """The fixed settings only a pipeline has: a schedule, chunks per rank beyond one, cuts, tp ranks' split,
        a recompute mode per chunk."""
        return tuple(k for k in ("schedule", "v", "cuts", "tp_split", "recompute") if getattr(self, k) is not None
                     and (k != "v" or self.v > 1) and (k != "recompute" or self.stage_recompute))

    @property
    def stage_recompute(self) -> tuple[str, ...]:
        """Each pipeline chunk's fixed recompute mode, where they are given one by one; else empty."""
        modes = self.recompute_modes or ()
        return modes if len(modes) > 1 else ()

    def allows(self, **settings) -> bool:
        """Whether every given setting agrees with what is fixed (a recompute mode per chunk allows the
        most of them)."""
        def fixed(k: str):
            if k == "recompute" and self.recompute is not None:
                return most_recompute(self.recompute_modes)
            return getattr(self, k)
        return all(fixed(k) is None or fixed(k) == v for k, v in settings.items())

    def text(self) -> str:
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self) if getattr(self, f.name) is not None)


CUTS = ("balanced", "even")
TP_COMMS = ("any", "all_reduce")
_CHOICES = {"schedule": SCHEDULES, "recompute": RECOMPUTE_MODES, "recompute_comm": RECOMPUTE_COMMS,
            "precision": PRECISIONS, "offload": OFFLOADS, "cuts": CUTS, "tp_split": TP_SPLITS, "tp_comm": TP_COMMS}


def _positive(key: str, value: str) -> int:
    whole = key in ("zero", "sp", "overlap")
    if not value.isdigit() or (int(value) < 1 and not whole):
        raise PolyshardError(f"--config {key}={value!r} must be a {'whole number' if whole else 'positive integer'}")
    return int(value)
