"""A mesh split as the search costs it: the sizes of its axes by role, the splits worth trying, one split's
predicted step and memory (Candidate), and the JSON rows a plan's report keeps of them."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from polyshard.buckets import BUCKET_BYTES
from polyshard.cluster import Cluster
from polyshard.mesh import PIPELINE_AXIS, SPATIAL_AXES
from polyshard.plan import chunks_text, recompute_text
from polyshard.planner.config import Fixed
from polyshard.planner.cost.memory import MemoryEstimate
from polyshard.planner.pipeline import PipelineCost, ideal_bubble


def operator_axes(mesh, data_axes) -> tuple:
    """The axes of ``mesh`` that split operators (neither data nor pipeline), of 2 ranks or more."""
    return tuple((n, s) for n, s in mesh if n not in data_axes and n != PIPELINE_AXIS and s > 1)


def operator_size(mesh, data_axes) -> int:
    """Ranks each operator is split over."""
    return math.prod(s for _, s in operator_axes(mesh, data_axes))


def data_size(mesh, data_axes) -> int:
    """Data-parallel replicas."""
    return math.prod(s for n, s in mesh if n in data_axes)


def spatial_sizes(mesh) -> dict[str, int]:
    """An image mesh's height and width splits (``{"h": 2, "w": 1}``); empty for other meshes."""
    sizes = dict(mesh)
    return {a: sizes.get(a, 1) for a in SPATIAL_AXES} if sizes.keys() & set(SPATIAL_AXES) else {}


def stage_count(mesh) -> int:
    """Pipeline stages (1 without a pipeline axis)."""
    return dict(mesh).get(PIPELINE_AXIS, 1)


def mesh_text(mesh) -> str:
    """``dp=2 x tp=4``."""
    return " x ".join(f"{n}={s}" for n, s in mesh)


@dataclass(frozen=True)
class Candidate:
    """One mesh split: predicted step time (compute, op-parallel communication, data-parallel
    gradient communication; pipelined: the busiest rank's, plus its p2p sends and idle time) and
    per-device memory, at ``rows`` rows per device (per data-parallel replica when pipelined)."""

    mesh: tuple[tuple[str, int], ...]
    rows: int
    compute_s: float
    op_comm_s: float
    dp_comm_s: float
    memory: MemoryEstimate
    gap: float = 0.0  # the intra-op program's distance from its LP lower bound
    recompute: str = "none"  # activations recomputed in backward (see Plan): the most any chunk recomputes
    stage_recompute: tuple[str, ...] = ()  # a pipeline's mode per chunk, where they differ
    stage_tp_split: tuple[str, ...] = ()  # what each pipeline chunk's operator ranks split, where one splits rows
    offload: str = "none"  # where the optimizer state lives, if not on the device (see Plan)
    zero: int = 0  # optimizer parallel level over the data axes (see Plan)
    precision: str = "fp32"
    pruned: bool = False  # not costed: a lower bound already lost (figures are lower bounds)
    memory_floor: bool = False  # memory is a lower bound, already over the limit (not estimated further)
    pipeline: PipelineCost | None = None  # a pipelined split's stages, micro-batches and schedule
    accumulation: int = 1  # micro-batches per step without a pipeline (gradient accumulation)
    sequence: bool = False  # sequence parallel: row-parallel products reduce-scatter along the sequence
    refused_s: float = float("inf")  # the fastest option memory refused here (fewer micro-batches), if any
    bucket_bytes: int = BUCKET_BYTES  # gradients per data-parallel collective
    skew_s: float = 0.0  # waiting for ranks that reach the step's collectives apart (Cluster.arrival_skew)

    @property
    def micro_batches(self) -> int:
        return self.pipeline.micro_batches if self.pipeline else self.accumulation

    @property
    def pp(self) -> int:
        return dict(self.mesh).get(PIPELINE_AXIS, 1)

    @property
    def p2p_s(self) -> float:
        return self.pipeline.p2p_s if self.pipeline else 0.0

    @property
    def bubble_s(self) -> float:
        return self.pipeline.bubble_s if self.pipeline else 0.0

    @property
    def step_s(self) -> float:
        return self.compute_s + self.op_comm_s + self.dp_comm_s + self.p2p_s + self.bubble_s + self.skew_s

    @property
    def key(self) -> tuple:
        return (self.mesh, self.recompute, self.stage_recompute, self.stage_tp_split, self.offload, self.zero,
                self.precision)

    @property
    def recompute_text(self) -> str:
        return recompute_text(self.recompute, self.stage_recompute)

    def describe(self, brief: bool = False) -> str:
        """The split and its settings in words (the search's name for it); ``brief``: settings per pipeline
        chunk counted, not listed, as a report's table shows them."""
        p = self.pipeline
        recompute = per_chunk(self.stage_recompute, "none") if brief and self.stage_recompute else self.recompute_text
        tp_split = per_chunk(self.stage_tp_split, "ops") if brief else chunks_text(self.stage_tp_split)
        extras = ([f"{p.schedule} m={p.micro_batches}" + f" v={p.virtual_stages}" * (p.virtual_stages > 1)] if p
                  else [f"accumulate m={self.accumulation}"] * (self.accumulation > 1)) + \
            [f"recompute {recompute}"] * (self.recompute != "none") + \
            [f"tp splits {tp_split}"] * bool(self.stage_tp_split) + \
            [f"offload {self.offload}"] * (self.offload != "none") + [f"zero {self.zero}"] * (self.zero > 0) + \
            [self.precision] * (self.precision != "fp32") + ["sequence parallel"] * self.sequence + \
            [f"buckets {self.bucket_bytes / 2**20:g} MiB"] * (self.bucket_bytes != BUCKET_BYTES)
        return ", ".join([mesh_text(self.mesh), *extras])

    def config(self, data_axes: tuple[str, ...] = ("dp",)) -> Fixed:
        """This candidate's settings in the ``--config`` spelling."""
        p, tp, spatial = self.pipeline, operator_size(self.mesh, data_axes), spatial_sizes(self.mesh)
        tp //= math.prod(spatial.values())
        dp = data_size(self.mesh, data_axes)
        return Fixed(dp=dp, tp=tp if tp > 1 or not spatial else None, pp=self.pp,
                     **spatial, sp=int(self.sequence) if tp > 1 else None,
                     mbs=self.rows // self.micro_batches, m=self.micro_batches, schedule=p.schedule if p else None,
                     v=p.virtual_stages if p else None, zero=self.zero, recompute=self.recompute_text,
                     precision=self.precision, offload=self.offload,
                     bucket=self.bucket_bytes // 2**20 if dp > 1 or self.bucket_bytes != BUCKET_BYTES else None,
                     tp_split=chunks_text(self.stage_tp_split) or None)


def per_chunk(values: Sequence[str], usual: str) -> str:
    """Settings per pipeline chunk counted: each but ``usual`` with the chunks that hold it ("pointwise on 97 of
    128 chunks")."""
    counts = Counter(v for v in values if v != usual).most_common()
    return " and ".join(f"{v} on {n}" for v, n in counts) + f" of {len(values)} chunks" if counts else usual


def mesh_candidates(num_devices: int, blocks: int = 1,
                    devices_per_node: int | None = None) -> list[tuple[tuple[str, int], ...]]:
    """Every (dp, pp, tp) factorisation with at most ``blocks`` pipeline stages (a stage holds whole
    repeated blocks): pp outermost so stages talk over the slowest links, tp innermost on the fastest.
    Given ``devices_per_node``, tp divides a node or spans whole nodes (as Alpa's submesh shapes): any
    other size puts some of its groups across two nodes, on the slow link, for no gain in splitting."""
    out = []
    for pp in (p for p in range(1, min(num_devices, max(blocks, 1)) + 1) if num_devices % p == 0):
        for tp in (t for t in range(1, num_devices // pp + 1) if num_devices // pp % t == 0):
            if devices_per_node and devices_per_node % tp and tp % devices_per_node:
                continue
            dp = num_devices // pp // tp
            out.append((("dp", dp), ("tp", tp)) if pp == 1 else ((PIPELINE_AXIS, pp), ("dp", dp), ("tp", tp)))
    return out


def search_report(candidates: list[Candidate], chosen: Candidate, limit_bytes: float, reserve_bytes: float = 0.0,
                  data_axes: tuple[str, ...] = ("dp",), cluster: Cluster | None = None) -> dict:
    """JSON-able figures of every candidate split and the choice (plain Python numbers only)."""
    def row(c: Candidate) -> dict:
        return {"mesh": c.describe(), "brief": c.describe(brief=True), "split": mesh_text(c.mesh), "config": c.config(data_axes).text(),
                "recompute": c.recompute_text, "offload": c.offload, "zero": c.zero, "precision": c.precision,
                "pp": c.pp,
                "rows": c.rows, "micro_batches": c.micro_batches, "step_s": float(c.step_s),
                "compute_s": float(c.compute_s), "op_comm_s": float(c.op_comm_s), "dp_comm_s": float(c.dp_comm_s),
                "p2p_s": float(c.p2p_s), "bubble_s": float(c.bubble_s), "skew_s": float(c.skew_s), "gap": float(c.gap),
                "memory": _memory_row(c.memory), "memory_floor": bool(c.memory_floor),
                "fits": bool(c.memory.total_bytes <= limit_bytes and not c.pruned), "pruned": bool(c.pruned),
                **({"pipeline": _pipeline_row(c.pipeline)} if c.pipeline else {})}
    return {"chosen": chosen.describe(), "config": chosen.config(data_axes).text(), "limit_bytes": float(limit_bytes),
            "reserve_bytes": float(reserve_bytes), **({"cluster": _cluster_row(cluster)} if cluster else {}),
            "candidates": [row(c) for c in candidates]}


def _cluster_row(cluster: Cluster) -> dict:
    return {"num_nodes": cluster.num_nodes, "devices_per_node": cluster.devices_per_node,
            "device_name": cluster.device_name}


def _memory_row(m: MemoryEstimate) -> dict:
    return {k: float(v) for k, v in (("params", m.params_bytes), ("grads", m.grads_bytes),
                                     ("optimizer", m.optimizer_bytes), ("activations", m.activations_bytes),
                                     ("buffers", m.buffers_bytes), ("apart", m.apart_bytes),
                                     ("total", m.total_bytes))}


def _pipeline_row(p: PipelineCost) -> dict:
    pp = len({s.rank for s in p.stages})
    return {"schedule": p.schedule, "micro_batches": p.micro_batches, "virtual_stages": p.virtual_stages,
            "boundaries": list(p.boundaries), "bubble": float(p.bubble), "span_s": float(p.span_s),
            "ideal_bubble": ideal_bubble(pp, p.micro_batches, p.virtual_stages),
            "stages": [{"rank": s.rank, "first": s.first, "last": s.last, "forward_s": float(s.forward_s),
                        "backward_s": float(s.backward_s), "memory": _memory_row(s.memory),
                        "recompute": s.recompute, "tp_split": s.tp_split} for s in p.stages]}
