"""The cluster vocabulary: how many devices, how fast they compute, how fast they talk."""

from __future__ import annotations

import functools
import math
import os
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
import yaml

from polyshard.errors import PolyshardError

GiB = 2**30


@dataclass(frozen=True)
class Link:
    """A point-to-point connection, costed as latency + bytes / bandwidth."""

    bandwidth_bytes_per_s: float  # bytes per second, one direction, per device
    latency_s: float  # fixed cost of one message, in seconds


@dataclass(frozen=True)
class _Device:
    """Published figures for one device type; a row of `_DEVICES`."""

    device_type: str  # "cpu" or "cuda"
    memory_bytes: int  # memory of one device
    flops_per_s: dict[str, float]  # peak dense FLOP/s per dtype name
    intra_node: Link  # between devices of one node
    inter_node: Link  # between nodes, one NIC a device (a ring with g ranks in each node rides g: comm.axis_link)
    overheads: tuple[float, float, float]  # (op_overhead_s, split_op_overhead_s, optimizer_overhead_s) of Cluster
    # (host_bandwidth_bytes_per_s, disk_bandwidth_bytes_per_s, host_memory_bandwidth_bytes_per_s,
    # host_optimizer_overhead_s) of Cluster
    offload: tuple[float, float, float, float]
    memory_bandwidth_bytes_per_s: float  # achievable device-memory bandwidth (read + write)
    matmul_efficiency: float  # share of peak FLOP/s a large matrix product reaches
    attention_efficiency: float  # share of peak FLOP/s fused attention reaches in training
    matmul_depth_shares: tuple[tuple[float, float], ...] = ()  # of matmul_efficiency, by contraction depth
    overlap_slowdown: float = 0.0  # how much longer compute takes while a collective runs beside it


def _flops(fp32: float, half: float) -> dict[str, float]:
    return {"float32": fp32, "bfloat16": half, "float16": half}


# Collectives are costed at the bus bandwidth NCCL reaches, not the line rate (nccl-tests' busbw):
# inter-node, one NIC per GPU at about 92% of line rate: InfiniBand HDR 200 Gb/s (A100 systems, NVIDIA
# ConnectX-6) and NDR 400 Gb/s (H100/H200 systems, ConnectX-7).
_IB_HDR = Link(bandwidth_bytes_per_s=0.92 * 25e9, latency_s=5e-6)
_IB_NDR = Link(bandwidth_bytes_per_s=0.92 * 50e9, latency_s=5e-6)
# NVLink 3 (A100: 600 GB/s total, 300 per direction) and NVLink 4 (H100/H200: 900 GB/s total, 450 per
# direction), at the ~78% of the per-direction rate that NCCL's all-reduce bus bandwidth reaches in
# one DGX node; 2 us is a typical NCCL small-message latency there (datasheets omit it).
_NVLINK3 = Link(bandwidth_bytes_per_s=0.78 * 300e9, latency_s=2e-6)
_NVLINK4 = Link(bandwidth_bytes_per_s=0.78 * 450e9, latency_s=2e-6)
# Loopback TCP between processes of one machine (typical measured figure).
_LOOPBACK = Link(bandwidth_bytes_per_s=5e9, latency_s=20e-6)
# 10 Gb Ethernet between CPU machines (IEEE 802.3ae line rate).
_ETHERNET_10G = Link(bandwidth_bytes_per_s=1.25e9, latency_s=50e-6)

# Fixed cost per op and micro-batch (forward and backward), as `polyshard calibrate` measures it:
# on GPUs about three kernel launches of 5 us, plus DTensor's Python dispatch for a split op;
# on CPU, eager dispatch of tiny ops, typical of a desktop core. The optimizer's fixed cost per tensor it
# steps is left to calibration (0: a GPU's fused step is a few launches for all tensors; on CPU,
# torch's AdamW measures about 100 us per tensor on one core of a shared 2-core VM).
_GPU_OVERHEADS = (15e-6, 150e-6, 0.0)
_CPU_OVERHEADS = (40e-6, 400e-6, 0.0)
# Device <-> host copies and host <-> disk: PCIe 4.0 x16 (A100) or 5.0 x16 (H100, H200) at about 80% of
# line rate, one NVMe SSD (typical sequential figure); on CPU, a memory copy and a SATA-class disk.
_PCIE4, _PCIE5, _NVME = 25e9, 50e9, 3e9
# The host steps offloaded state: a GPU node's host memory per GPU at line rate (8 GPUs share it), until
# `polyshard calibrate` measures it: DGX A100, two AMD EPYC 7742 with 8 channels of DDR4-3200 (204.8 GB/s a
# socket); DGX H100 and H200, two Xeon Platinum 8480C with 8 channels of DDR5-4800 (307.2 GB/s a socket). Per
# tensor, torch's AdamW on a host core (about 100 us, as on the CPU VM above). A CPU's host is the device itself.
_DGX_A100_HOST, _DGX_H100_HOST = (2 * 204.8e9 / 8, 100e-6), (2 * 307.2e9 / 8, 100e-6)
_CPU_OFFLOAD = (10e9, 0.5e9, 0.0, 0.0)
# Measured on one H100 SXM (bench/bench_device.py, bench/results/h100-80g.json): bf16 products of
# 1024..16384 per side reach 768 of the 989 TFLOP/s peak (0.78), fp32 50 of 67 (0.75); causal flash
# attention (head dim 128, forward + backward, counted as 3 x 4*B*H*T*T*D) 530 (0.55); a copy moves
# 2.92 of the 3.35 TB/s of HBM3 (0.87). Other GPUs take the same shares of their datasheet figures
# until `polyshard calibrate` measures them.
_MATMUL_SHARE, _ATTENTION_SHARE, _STREAM_SHARE = 0.78, 0.55, 0.87
# The same run, by contraction depth k (median over m, n >= 4096, less the timing loop's 34 us per call):
# a product's share falls from 0.79 at k = 16384 to 0.71 at 2048 and 0.46 at 256, as its tiles see fewer
# steps of k; as shares of the large product's. A tensor-parallel row split shrinks k, a column split
# shrinks backward's k (the output width), so a wide split runs its products below the large rate.
_GPU_MATMUL_DEPTHS = ((256, 0.586), (512, 0.760), (1024, 0.844), (2048, 0.904), (4096, 0.940), (8192, 0.962),
                      (16384, 1.0))
# Compute that runs beside a collective takes longer: NCCL's kernels hold SMs and memory bandwidth. Lee et al.,
# "Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning" (arXiv 2507.03114,
# 2025), training GPT and Llama models on A100, H100, MI250 and MI210: 18.9% slower on average (at most 40%) than
# the same compute alone.
_GPU_OVERLAP_SLOWDOWN = 0.189
_GPU_RATES = (_MATMUL_SHARE, _ATTENTION_SHARE, _GPU_MATMUL_DEPTHS, _GPU_OVERLAP_SLOWDOWN)
# Measured on one H200 SXM (bench/bench_device.py, bench/results/h200-141g.json): products as the H100's (791 best,
# 703 median of sizes >= 4096 against 793 / 720), a copy 4.11 of 4.8 TB/s (0.86), but causal flash attention
# (head dim 128, forward + backward) 590-611 TFLOP/s: 0.61 of peak, where the H100 reached 0.55.
_H200_RATES = (_MATMUL_SHARE, 0.61, _GPU_MATMUL_DEPTHS, _GPU_OVERLAP_SLOWDOWN)

# Device types by preset name. The cpu row's memory is a placeholder: `_device` reads the machine's RAM.
_DEVICES: dict[str, _Device] = {
    # NVIDIA A100 datasheet: 40 GB HBM2 at 1555 GB/s, 19.5 TFLOP/s fp32, 312 bf16/fp16, NVLink 3.
    "A100-40G": _Device("cuda", 40 * GiB, _flops(19.5e12, 312e12), _NVLINK3, _IB_HDR, _GPU_OVERHEADS,
                        (_PCIE4, _NVME, *_DGX_A100_HOST), _STREAM_SHARE * 1555e9, *_GPU_RATES),
    # NVIDIA A100 datasheet: 80 GB HBM2e at 2039 GB/s, same compute and NVLink as the 40 GB part.
    "A100-80G": _Device("cuda", 80 * GiB, _flops(19.5e12, 312e12), _NVLINK3, _IB_HDR, _GPU_OVERHEADS,
                        (_PCIE4, _NVME, *_DGX_A100_HOST), _STREAM_SHARE * 2039e9, *_GPU_RATES),
    # NVIDIA H100 SXM datasheet: 80 GB HBM3 at 3.35 TB/s, 67 TFLOP/s fp32, 989 bf16/fp16 dense, NVLink 4.
    "H100-80G": _Device("cuda", 80 * GiB, _flops(67e12, 989e12), _NVLINK4, _IB_NDR, _GPU_OVERHEADS,
                        (_PCIE5, _NVME, *_DGX_H100_HOST), _STREAM_SHARE * 3.35e12, *_GPU_RATES),
    # NVIDIA H200 SXM datasheet: 141 GB HBM3e at 4.8 TB/s, H100 compute, NVLink 4.
    "H200-141G": _Device("cuda", 141 * 10**9, _flops(67e12, 989e12), _NVLINK4, _IB_NDR, _GPU_OVERHEADS,
                         (_PCIE5, _NVME, *_DGX_H100_HOST), _STREAM_SHARE * 4.8e12, *_H200_RATES),
    # A modest multi-core CPU; half precision is not faster than fp32 there. Matmul rates above are
    # already what such a core reaches, and memory-bound ops are left to the per-op cost.
    "cpu": _Device("cpu", 0, _flops(5e10, 5e10), _LOOPBACK, _ETHERNET_10G, _CPU_OVERHEADS, _CPU_OFFLOAD, 0.0, 1.0, 1.0),
}
DEVICE_TYPES = tuple(_DEVICES)  # what a preset's TYPE may name

_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
_OVERHEAD_KEYS = ("op_overhead_s", "split_op_overhead_s", "optimizer_overhead_s")
_RECOMPUTE_KEYS = ("recompute_op_overhead_s", "watched_op_overhead_s")
_OFFLOAD_KEYS = ("host_bandwidth_bytes_per_s", "disk_bandwidth_bytes_per_s", "host_memory_bandwidth_bytes_per_s",
                 "host_optimizer_overhead_s")
_RATE_KEYS = ("memory_bandwidth_bytes_per_s", "matmul_efficiency", "attention_efficiency")
_SKEW_KEYS = ("arrival_skew", "node_call_skew_s", "call_skew_s")
_CONTENTION_KEYS = ("overlap_slowdown",)

_SPEC = re.compile(r"(?:(\d+)x)?(\d+)x(.+?)(?:-nvlink|-ib)*", re.IGNORECASE)
_CPU_GLOO = re.compile(r"cpu-gloo(?::(\d+))?", re.IGNORECASE)


@dataclass(frozen=True)
class Cluster:
    """The machines a job runs on, with the figures the planner costs strategies by."""

    num_nodes: int  # machines
    devices_per_node: int  # devices (processes) per machine
    device_type: str  # "cpu" or "cuda"
    device_name: str  # preset name of the device, e.g. "A100-80G" or "cpu"
    memory_bytes: int  # memory of one device
    intra_node: Link  # between devices of one node
    inter_node: Link  # between nodes, one NIC a device (a ring with g ranks in each node rides g: comm.axis_link)
    # Peak dense FLOP/s per dtype name ("float32", "bfloat16", "float16"); left out of the hash.
    flops_per_s: dict[str, float] = field(default_factory=dict, hash=False)
    # Fixed seconds per op and micro-batch (forward and backward), however small the op: dispatch and launches.
    op_overhead_s: float = 0.0
    # Fixed seconds per op by compute dtype name, where one was timed apart (on CPUs a small bf16 kernel costs
    # more than fp32's: 1.8x on gpt-tiny); a dtype left out pays op_overhead_s. Left out of the hash.
    op_overheads_s: dict[str, float] = field(default_factory=dict, hash=False)
    # What an op run on split tensors (DTensor) pays on top of op_overhead_s.
    split_op_overhead_s: float = 0.0
    # On hosts that run the device's work (CPUs), what checkpointing adds per op it runs again, beyond the op's own
    # fixed cost (saved-tensor hooks, unpacking, the rerun's dispatch), and what a selective checkpoint policy adds
    # per op of a region it watches (a Python call per op, in forward and again in the rerun); 0: unmeasured.
    recompute_op_overhead_s: float = 0.0
    watched_op_overhead_s: float = 0.0
    # Fixed seconds per tensor an optimizer step walks, once per step whatever the micro-batches.
    optimizer_overhead_s: float = 0.0
    # Copies between a device and its host's memory, and between host memory and local disk (offload).
    host_bandwidth_bytes_per_s: float = 0.0
    disk_bandwidth_bytes_per_s: float = 0.0
    # Where a GPU node's host steps offloaded state: the memory bandwidth one device's process reaches there, and
    # the step's fixed seconds per tensor (a CPU cluster's host is its device, priced by the device's figures).
    host_memory_bandwidth_bytes_per_s: float = 0.0
    host_optimizer_overhead_s: float = 0.0
    # Device-memory bytes per second (read + write) that memory-bound ops reach; 0: cost them by FLOPs alone.
    memory_bandwidth_bytes_per_s: float = 0.0
    # Share of flops_per_s a large matrix product reaches (1.0 where flops_per_s were measured on products).
    matmul_efficiency: float = 1.0
    # Share of flops_per_s fused attention (scaled_dot_product_attention) reaches in training.
    attention_efficiency: float = 1.0
    # Of matmul_efficiency, the share a product reaches by its contraction depth: ((depth, share), ...),
    # ascending; empty: every depth at matmul_efficiency. Left out of the hash.
    matmul_depth_shares: tuple[tuple[float, float], ...] = field(default=(), hash=False)
    # Of compute that runs beside a collective (gradient traffic hidden behind backward, another copy's
    # collective), the share longer it takes than alone; 0 where nothing runs beside compute (gloo on CPU).
    overlap_slowdown: float = 0.0
    # Measured shares of flops_per_s a product reaches by contraction depth, per dtype name: ((depth, share), ...),
    # ascending; where a dtype has them they replace matmul_efficiency and matmul_depth_shares (on a CPU with bf16
    # instructions, bf16 products 32 to 128 deep run at 0.55 to 0.84 of its large ones' rate, fp32's at about 1).
    # Left out of the hash.
    matmul_shares: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict, hash=False)
    # Measured shares of fused attention by shape, per dtype name: ((sequence length, head dim, share of
    # flops_per_s forward and backward reach), ...), ascending by head dim, then length; where a dtype has them
    # they replace attention_efficiency. Both dims count apart: at equal FLOPs a CPU runs heads of 32 at twice
    # the share of heads of 8 (small heads run far below peak on CPUs). Left out of the hash.
    attention_shares: dict[str, tuple[tuple[float, float, float], ...]] = field(default_factory=dict, hash=False)
    # Measured elements per second of pointwise ops with a transcendental function, per dtype name, then op name
    # ({"bfloat16": {"gelu": 3e8, ...}}), counted as three forwards per training step; where one is measured it
    # bounds the op beside its bytes (on CPUs bf16 GELU is bound by its arithmetic). Left out of the hash.
    pointwise_rates: dict[str, dict[str, float]] = field(default_factory=dict, hash=False)
    # Measured fixed seconds of one training call of each implementation of cross-entropy (its forward and backward
    # run dozens of small ops: the vocabulary-parallel one thirty-odd), per dtype name, then op name as in
    # pointwise_rates; where measured it stands for the loss node's fixed cost per op. Left out of the hash.
    loss_overheads_s: dict[str, dict[str, float]] = field(default_factory=dict, hash=False)
    # Whether the network runs all-to-all; without it a split moving between dims is gathered and sliced.
    all_to_all: bool = True
    # Of the compute between two collectives, how much later than the average rank the last one reaches the
    # second: ranks time-sliced on shared cores drift apart (0.02-0.2 with 4 processes on 2 cores); 0 where
    # every rank has its own device. A step whose ranks communicate waits this share of its compute.
    arrival_skew: float = 0.0
    # Seconds each collective of the node's whole group waits for its ranks on top of that share: once the
    # compute before it outlasts a time slice, ranks sharing cores reach it about a slice apart (about 3 ms for
    # 4 processes on 2 cores); 0 where every rank has its own device.
    node_call_skew_s: float = 0.0
    # The same for each collective of a group smaller than the node (about 2 ms for pairs of 4 processes on 2
    # cores).
    call_skew_s: float = 0.0

    def call_skew_for(self, group_size: int) -> float:
        """Seconds one collective of a group of ``group_size`` ranks waits for them to arrive."""
        return self.call_skew_s if group_size < self.devices_per_node else self.node_call_skew_s

    def op_overhead_for(self, dtype: str) -> float:
        """Fixed seconds per op and micro-batch of an op computing in ``dtype``."""
        return self.op_overheads_s.get(dtype, self.op_overhead_s)

    def attention_share(self, dtype: str, seq: float, head_dim: float) -> float:
        """The share of peak attention reaches on heads of ``seq`` x ``head_dim``: interpolated on log length
        among each measured head dim's points, then on log head dim between those; the nearest outside them;
        attention_efficiency unmeasured."""
        points = self.attention_shares.get(dtype)
        if not points:
            return self.attention_efficiency
        return _interpolate_log(tuple((dim, _interpolate_log(row, seq)) for dim, row in _rows(points)), head_dim)

    def pointwise_rate(self, op: str, dtype: str) -> float | None:
        """Elements per second ``op`` runs at in ``dtype`` (per forward-equivalent), where it was measured."""
        return self.pointwise_rates.get(dtype, {}).get(op)

    def loss_overhead(self, op: str, dtype: str) -> float | None:
        """Fixed seconds of one training call of the loss ``op`` in ``dtype``, where it was measured."""
        return self.loss_overheads_s.get(dtype, {}).get(op)

    @property
    def shares_grow_with_size(self) -> bool:
        """Whether no product or attention reaches a larger share of peak for being smaller (measured tables may
        dip where timings were noisy): what lets a bound take work split k ways as no faster than 1 / k of it."""
        tables = [*self.matmul_shares.values(), self.matmul_depth_shares]
        for points in self.attention_shares.values():  # each head dim's row, and across head dims at each length
            rows = _rows(points)
            tables += [row for _, row in rows]
            seqs = {seq for seq, _, _ in points}
            tables += [tuple((dim, _interpolate_log(row, seq)) for dim, row in rows) for seq in seqs]
        return all(a <= b for points in tables for (_, a), (_, b) in zip(points, points[1:]))

    def matmul_share(self, m: float, n: float, k: float, dtype: str = "float32") -> float:
        """The share of ``dtype``'s peak a product of (m x k) by (k x n) reaches over a training step: forward
        contracts k, the input's gradient n and the weight's gradient m, each at its depth's share
        (interpolated on log depth), the three passes taking equal FLOPs."""
        measured = self.matmul_shares.get(dtype)
        if measured:
            return 3 / sum(1 / _interpolate_log(measured, d) for d in (k, n, m))
        if not self.matmul_depth_shares:
            return self.matmul_efficiency
        shares = [_interpolate_log(self.matmul_depth_shares, d) for d in (k, n, m)]
        return self.matmul_efficiency * 3 / sum(1 / s for s in shares)

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.devices_per_node < 1:
            raise PolyshardError(
                f"cluster of num_nodes={self.num_nodes} x devices_per_node={self.devices_per_node}: "
                "both must be at least 1"
            )
        if self.device_type not in _BACKENDS:
            raise PolyshardError(
                f"device_type {self.device_type!r} is unknown; use one of {sorted(_BACKENDS)}"
            )
        positive = {f"{link}.bandwidth_bytes_per_s": getattr(self, link).bandwidth_bytes_per_s
                    for link in ("intra_node", "inter_node")}
        positive |= {f"flops_per_s.{dtype}": rate for dtype, rate in self.flops_per_s.items()}
        if self.device_type == "cuda":  # a CPU's memory is the host's, 0 in its preset
            positive["memory_bytes"] = self.memory_bytes
        at_least_zero = {f"{link}.latency_s": getattr(self, link).latency_s for link in ("intra_node", "inter_node")}
        at_least_zero |= {key: getattr(self, key) for key in _OVERHEAD_KEYS + _OFFLOAD_KEYS + _RATE_KEYS[:1] +
                          _SKEW_KEYS + _CONTENTION_KEYS}
        at_least_zero |= {f"op_overheads_s.{dtype}": s for dtype, s in self.op_overheads_s.items()}
        positive |= {f"pointwise_rates.{dtype}.{op}": rate for dtype, rates in self.pointwise_rates.items()
                     for op, rate in rates.items()}
        at_least_zero |= {f"loss_overheads_s.{dtype}.{op}": s for dtype, costs in self.loss_overheads_s.items()
                          for op, s in costs.items()}
        for key, value in positive.items():
            if not value > 0:
                raise PolyshardError(f"cluster {key} must be positive; got {value!r}")
        for key, value in at_least_zero.items():
            if not value >= 0:
                raise PolyshardError(f"cluster {key} must be zero or more; got {value!r}")
        for key in _RATE_KEYS[1:]:
            if not 0 < getattr(self, key) <= 1:
                raise PolyshardError(f"cluster {key} is a share of peak, in (0, 1]; got {getattr(self, key)!r}")
        for key, points in [(f"matmul_shares.{d}", p) for d, p in self.matmul_shares.items()] + \
                [("matmul_depth_shares", self.matmul_depth_shares)] * bool(self.matmul_depth_shares):
            sizes = [f for f, _ in points]
            if not points or sizes != sorted(set(sizes)) or not all(f > 0 and 0 < sh <= 1 for f, sh in points):
                raise PolyshardError(f"cluster {key} must be (size, share) pairs, sizes positive and "
                                     f"ascending, shares in (0, 1]; got {points!r}")
        for dtype, points in self.attention_shares.items():
            shapes = [(dim, seq) for seq, dim, *_ in points]
            if not points or shapes != sorted(set(shapes)) or \
                    not all(len(p) == 3 and min(p[:2]) > 0 and 0 < p[2] <= 1 for p in points):
                raise PolyshardError(f"cluster attention_shares.{dtype} must be (sequence length, head dim, share) "
                                     f"triples, dims positive, ascending by head dim then length, shares in (0, 1] (a "
                                     f"file timed before head dims counted apart: calibrate again); got {points!r}")

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node

    @property
    def backend(self) -> str:
        """The torch.distributed backend for this device type."""
        return _BACKENDS[self.device_type]

    @classmethod
    def preset(cls, spec: str) -> Cluster:
        """Parse `NODESxDEVICESxTYPE`, `DEVICESxTYPE` (optional -nvlink/-ib suffix) or `cpu-gloo[:N]`."""
        text = spec.strip()
        if m := _CPU_GLOO.fullmatch(text):
            nodes, per_node, name = 1, int(m[1]) if m[1] else _env_int("WORLD_SIZE", 1), "cpu"
        elif m := _SPEC.fullmatch(text):
            nodes, per_node, name = int(m[1] or 1), int(m[2]), _device_name(m[3], spec)
        else:
            raise PolyshardError(
                f"cluster spec {spec!r} is not understood; write e.g. '128x8xA100-80G', "
                "'8xH100-80G' or 'cpu-gloo:4'"
            )
        if nodes < 1 or per_node < 1:
            raise PolyshardError(f"cluster spec {spec!r} has zero nodes or devices; counts start at 1")
        return _cluster(nodes, per_node, name, _device(name, per_node))

    @classmethod
    def from_env(cls) -> Cluster:
        """The cluster torchrun launched this process into (WORLD_SIZE, LOCAL_WORLD_SIZE)."""
        world = _env_int("WORLD_SIZE", 1)
        local = _env_int("LOCAL_WORLD_SIZE", world)
        if local < 1 or world % local:
            raise PolyshardError(
                f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}; "
                "launch the same number of processes on every node"
            )
        return cls.of_machines(world // local, local)

    @classmethod
    def of_machines(cls, nodes: int, per_node: int) -> Cluster:
        """``nodes`` machines like this one, ``per_node`` ranks on each (what a launch from here makes)."""
        name, device = _detect_device(per_node)
        return _cluster(nodes, per_node, name, device)

    @classmethod
    def from_yaml(cls, path: str | Path) -> Cluster:
        """Read a cluster written by `to_yaml` (or by hand with the same keys)."""
        try:
            data = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as e:
            raise PolyshardError(f"cannot read cluster file {str(path)!r}: {e}") from e
        if isinstance(data, dict):  # files written before these figures existed: their device type's preset
            like = _DEVICES["cpu" if data.get("device_type") == "cpu" else "A100-80G"]
            data = {**dict(zip(_OVERHEAD_KEYS, like.overheads)), **dict(zip(_OFFLOAD_KEYS, like.offload)),
                    "memory_bandwidth_bytes_per_s": 0.0, "matmul_efficiency": 1.0, "attention_efficiency": 1.0,
                    "matmul_depth_shares": [], "matmul_shares": {}, "attention_shares": {}, "op_overheads_s": {},
                    "all_to_all": True, **dict.fromkeys(_SKEW_KEYS + _RECOMPUTE_KEYS, 0.0), "pointwise_rates": {},
                    "loss_overheads_s": {}, "overlap_slowdown": like.overlap_slowdown, **data}
        data = _check_keys(data, {f.name for f in fields(cls)}, str(path))
        if not isinstance(data["all_to_all"], bool):
            raise PolyshardError(f"cluster file {str(path)!r}: all_to_all must be true or false, got "
                                 f"{data['all_to_all']!r}")
        links = {
            key: _check_keys(data[key], {f.name for f in fields(Link)}, f"{path}: {key}")
            for key in ("intra_node", "inter_node")
        }
        try:
            return cls(
                num_nodes=int(data["num_nodes"]),
                devices_per_node=int(data["devices_per_node"]),
                device_type=str(data["device_type"]),
                device_name=str(data["device_name"]),
                memory_bytes=parse_bytes(str(data["memory_bytes"])),
                intra_node=Link(**{k: float(v) for k, v in links["intra_node"].items()}),
                inter_node=Link(**{k: float(v) for k, v in links["inter_node"].items()}),
                flops_per_s={str(k): float(v) for k, v in dict(data["flops_per_s"]).items()},
                **{key: float(data[key])
                   for key in _OVERHEAD_KEYS + _RECOMPUTE_KEYS + _OFFLOAD_KEYS + _RATE_KEYS + _SKEW_KEYS +
                   _CONTENTION_KEYS},
                op_overheads_s={str(k): float(v) for k, v in dict(data["op_overheads_s"] or {}).items()},
                matmul_depth_shares=tuple((float(d), float(sh)) for d, sh in data["matmul_depth_shares"] or ()),
                matmul_shares={str(k): tuple((float(f), float(sh)) for f, sh in v)
                               for k, v in dict(data["matmul_shares"] or {}).items()},
                attention_shares={str(k): tuple(tuple(map(float, point)) for point in v)
                                  for k, v in dict(data["attention_shares"] or {}).items()},
                pointwise_rates={str(d): {str(op): float(r) for op, r in dict(rates).items()}
                                 for d, rates in dict(data["pointwise_rates"] or {}).items()},
                loss_overheads_s={str(d): {str(op): float(c) for op, c in dict(costs).items()}
                                  for d, costs in dict(data["loss_overheads_s"] or {}).items()},
                all_to_all=data["all_to_all"],
            )
        except PolyshardError:
            raise
        except (TypeError, ValueError) as e:
            raise PolyshardError(f"cluster file {str(path)!r} has a bad value: {e}; fix it in the file") from e

    def to_yaml(self, path: str | Path) -> None:
        """Write the cluster so `from_yaml` reads back an equal one."""
        Path(path).write_text(yaml.safe_dump(asdict(self), sort_keys=False))

    @classmethod
    def load(cls, spec_or_path: str) -> Cluster:
        """A `.yaml`/`.yml` path is read as a file; anything else is a preset spec."""
        if spec_or_path.lower().endswith((".yaml", ".yml")):
            return cls.from_yaml(spec_or_path)
        return cls.preset(spec_or_path)


def _device_name(text: str, spec: str) -> str:
    """The canonical preset name for `text`, matched without regard to case."""
    by_lower = {name.lower(): name for name in _DEVICES}
    if text.lower() not in by_lower:
        raise PolyshardError(
            f"device type {text!r} in cluster spec {spec!r} is unknown; "
            f"use one of {', '.join(_DEVICES)}"
        )
    return by_lower[text.lower()]


def _device(name: str, per_node: int) -> _Device:
    """The table row for `name`; the cpu row's memory is this machine's, shared by the ``per_node`` ranks on it."""
    device = _DEVICES[name]
    if device.device_type == "cpu":
        return replace(device, memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // per_node)
    return device


def _detect_device(per_node: int) -> tuple[str, _Device]:
    """The preset closest to this machine's device, with its real memory size (on CPU, a share of ``per_node``)."""
    if not torch.cuda.is_available():
        return "cpu", _device("cpu", per_node)
    props = torch.cuda.get_device_properties(0)
    gpus = [name for name, d in _DEVICES.items() if d.device_type == "cuda"]
    same_family = [name for name in gpus if name.split("-")[0] in props.name]
    name = min(same_family or gpus, key=lambda n: abs(_DEVICES[n].memory_bytes - props.total_memory))
    return name, replace(_DEVICES[name], memory_bytes=props.total_memory)


def _cluster(nodes: int, per_node: int, name: str, device: _Device) -> Cluster:
    return Cluster(
        num_nodes=nodes,
        devices_per_node=per_node,
        device_type=device.device_type,
        device_name=name,
        memory_bytes=device.memory_bytes,
        intra_node=device.intra_node,
        inter_node=device.inter_node,
        flops_per_s=dict(device.flops_per_s),
        **dict(zip(_OVERHEAD_KEYS, device.overheads)),
        **dict(zip(_OFFLOAD_KEYS, device.offload)),
        memory_bandwidth_bytes_per_s=device.memory_bandwidth_bytes_per_s,
        matmul_efficiency=device.matmul_efficiency,
        attention_efficiency=device.attention_efficiency,
        matmul_depth_shares=device.matmul_depth_shares,
        overlap_slowdown=device.overlap_slowdown,
    )


def _interpolate_log(points: tuple[tuple[float, float], ...], x: float) -> float:
    """The value at ``x`` of (size, value) points: linear in log size between them, the nearest outside."""
    at = math.log(max(x, 1.0))
    logs = [math.log(f) for f, _ in points]
    if at <= logs[0] or at >= logs[-1]:
        return points[0][1] if at <= logs[0] else points[-1][1]
    i = next(k for k in range(1, len(logs)) if at <= logs[k])
    t = (at - logs[i - 1]) / (logs[i] - logs[i - 1])
    return points[i - 1][1] + t * (points[i][1] - points[i - 1][1])


@functools.lru_cache(maxsize=64)
def _rows(points: tuple[tuple[float, float, float], ...]) -> tuple[tuple[float, tuple[tuple[float, float], ...]], ...]:
    """(sequence length, head dim, share) points as (head dim, ((length, share), ...)) rows, ascending: once per
    table, as the cost model looks a share up for every attention it prices."""
    return tuple((dim, tuple((seq, share) for seq, d, share in points if d == dim))
            for dim in sorted({d for _, d, _ in points}))


def _env_int(key: str, default: int) -> int:
    text = os.environ.get(key)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise PolyshardError(f"{key}={text!r} is not an integer; launch with torchrun") from None


def _check_keys(data: Any, expected: set[str], where: str) -> dict[str, Any]:
    """`data` as a mapping with exactly the `expected` keys."""
    if not isinstance(data, dict):
        raise PolyshardError(f"{where} must be a mapping with keys {sorted(expected)}")
    missing, unknown = expected - data.keys(), data.keys() - expected
    if missing or unknown:
        raise PolyshardError(
            f"{where}: missing keys {sorted(missing)}, unknown keys {sorted(map(str, unknown))}; "
            f"expected exactly {sorted(expected)}"
        )
    return data


_BYTE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_BYTES = re.compile(r"\s*((?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """Parse a size such as "70GiB", "512MiB", "80GB" or "1e9" (plain numbers are bytes)."""
    m = _BYTES.fullmatch(text)
    if m is None or m[2].lower() not in _BYTE_UNITS:
        raise PolyshardError(
            f"size {text!r} is not understood; write a number with an optional unit "
            "such as '70GiB', '512MiB', '80GB' or '1e9'"
        )
    return round(float(m[1]) * _BYTE_UNITS[m[2].lower()])


def format_bytes(n: int) -> str:
    """A short human reading of a byte count, e.g. "1.5 GiB"."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n} B"
