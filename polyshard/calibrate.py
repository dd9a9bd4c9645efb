"""Measure this machine's matmul rate and collective latency/bandwidth, so the planner costs real figures.

Run on every rank under torchrun; :func:`calibrate` writes the cluster YAML that ``polyshard plan
--cluster`` reads. Links are fitted to the planner's own model: time = latency + wire bytes / bandwidth;
a world of one (one GPU) measures the device alone and keeps its preset's links.
"""

from __future__ import annotations

import functools
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from polyshard import models
from polyshard.cluster import Cluster, Link, format_bytes
from polyshard.compiler.ops import ShardedModule, vocab_parallel_cross_entropy
from polyshard.compiler.recompute import apply_recompute
from polyshard.graph.capture import capture
from polyshard.graph.ops import LOSS_DTYPE
from polyshard.graph.regions import recomputed
from polyshard.layout import Layout
from polyshard.mesh import Mesh
from polyshard.optim import build_optimizer
from polyshard.planner.workers import available_cores
from polyshard.errors import PolyshardError
from polyshard.transitions import wire_bytes

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
RAILS = "all_reduce, one rank a node"  # the sweep that times the inter-node link
MIN_BYTES = 4 * 2**10
# Small messages are timed in batches of calls moving this many bytes, so the mean outlasts timer and barrier skew.
_BATCH_BYTES = 256 * 2**10
# Large enough to run at full rate, small enough to take well under a second per product.
MATMUL_SIZE = {"cpu": 1024, "cuda": 8192}
# Pointwise ops with a transcendental function, timed on this many elements: on CPUs their arithmetic, not the
# bytes they move, bounds them (bf16 GELU at about a third of a billion elements per second per core).
POINTWISE_OPS = ("gelu", "silu", "tanh", "sigmoid", "exp", "erf")
_POINTWISE_ELEMENTS = {"cpu": 2**18, "cuda": 2**26}
# Cross-entropy timed as torch's and the runtime's vocabulary-parallel one run, in rows of this many classes, on as
# many logits as a pointwise op has elements and on a quarter of them: the rate from the difference, the rest the
# fixed cost of a call (the vocabulary-parallel loss runs thirty-odd ops: on a CPU half its time at 2^18 logits).
LOSS_OPS = ("cross_entropy", "vocab_parallel_cross_entropy")
_LOSS_CLASSES = {"cpu": 2**12, "cuda": 2**15}
# Arrival skew: products of this side run for each of these seconds before a small all-reduce, each timed
# this many times at least (ranks time-sliced on shared cores drift apart by a share of the work).
_SKEW_SIDE, _SKEW_WORK_S, _SKEW_REPEATS, _SKEW_PAYLOAD = 128, (0.01, 0.02, 0.04), 20, 64 * 2**10
# A product timed for a rate is no larger than one that takes about this long: a type the device only emulates
# (bfloat16 on a CPU without it) runs at a hundredth of float32's rate at every size, so a smaller one times it.
_MATMUL_BUDGET_S = 0.25
_SIZING_TIMINGS = 3
# On CPUs, products are also timed by contraction depth, the other two sides at _MATMUL_SIDE (a small model's
# tokens and width per rank), in calls of about _PRODUCT_CALL_FLOPS; GPUs keep their preset's depth table.
_MATMUL_DEPTHS = {"cpu": (32, 64, 128, 256, 512, 1024), "cuda": ()}
_MATMUL_SIDE = 256
_PRODUCT_CALL_FLOPS = 2e8
# Causal attention timed on a grid of (sequence, head dim) of one head's slice, from tiny test models to real
# heads: at equal FLOPs a CPU runs heads of 32 at twice the share of heads of 8, so neither dim stands for both.
_ATTENTION_GRID = {"cpu": ((16, 64, 256, 1024), (8, 32, 64)), "cuda": ((256, 1024, 4096), (64, 128))}
# Forward FLOPs per timed call (heads batched to reach it): on a GPU, milliseconds of work, so launches and the
# host's timer do not count (at 2e10 an H200's attention measured a fifth of its rate).
_ATTENTION_CALL_FLOPS = {"cpu": 2e7, "cuda": 2e11}
# Copies timed for memory bandwidth, as (bytes, copies per timing): on a GPU one 64 MiB copy lasts tens of
# microseconds, and timed alone an H200's ran at 0.58 of the rate bench_device's 512 MiB copies measure.
_STREAM = {"cpu": (64 * 2**20, 1), "cuda": (512 * 2**20, 10)}
# On a CPU a timing of compute lasts at least this long: a shorter one fits in the scheduler's time slice, so ranks
# sharing cores take turns, each timing a core of its own (four ranks on two cores: attention of 524 kFLOP a head
# came out at 0.67-0.88 of the product rate, against 0.47 for one rank alone and 0.36-0.44 timed so)
_CPU_TIMING_S = 0.05
# A sweep whose all_reduce times do not grow with message size (load on a shared machine) is timed again this many
# times, with twice the repeats each time, before calibration gives up.
_SWEEP_RETRIES = 2


class Sweep(NamedTuple):
    """One collective timed at every message size over a group; ``seconds`` is None where the backend lacks it."""

    kind: str
    group_size: int
    seconds: list[float] | None
    note: str


def message_sizes(max_bytes: int) -> list[int]:
    """4 KiB, 16 KiB, 64 KiB, ... up to ``max_bytes``: at least two, so a line can be fitted."""
    sizes = []
    while (size := MIN_BYTES * 4 ** len(sizes)) <= max_bytes:
        sizes.append(size)
    if len(sizes) < 2:
        raise PolyshardError(
            f"max message size {format_bytes(max_bytes)} leaves fewer than two sizes "
            f"({format_bytes(MIN_BYTES)}, {format_bytes(4 * MIN_BYTES)}, ...) to fit latency and bandwidth; "
            f"use at least {format_bytes(4 * MIN_BYTES)}"
        )
    return sizes


def measure_matmul(dtype: torch.dtype, size: int, repeats: int, depth: int | None = None) -> float:
    """FLOP/s of a (size x depth) @ (depth x size) product (depth: ``size``) on this rank's device: median after
    a warm-up; a small product is timed in calls of about _PRODUCT_CALL_FLOPS, every rank at once."""
    _check_repeats(repeats)
    depth = depth or size
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    a, b = torch.randn(size, depth, device=device).to(dtype), torch.randn(depth, size, device=device).to(dtype)
    flops = 2 * size * size * depth
    calls = max(1, round(_PRODUCT_CALL_FLOPS / flops))
    barrier = dist.barrier if calls > 1 else lambda: None
    return flops / statistics.median(_compute_times(lambda: torch.matmul(a, b), repeats, device, barrier, calls))


def slowest_matmul_rate(dtype: torch.dtype, size: int, repeats: int) -> float:
    """:func:`measure_matmul` on every rank at once, as in training: the slowest rank's FLOP/s."""
    return _all_reduce([measure_matmul(dtype, size, repeats)], dist.ReduceOp.MIN, None)[0]


def timeable_matmul_size(dtype: torch.dtype, size: int) -> int:
    """The largest n of ``size`` / 8, / 4, / 2 and ``size`` whose (n x n) @ (n x n) product on this rank's
    device takes no more than _MATMUL_BUDGET_S (each doubling costs eight times the last), by the quickest of
    _SIZING_TIMINGS timings: a process that shares its cores loses whole time slices in some, which says
    nothing of the device."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    n = max(1, size // 8)
    while n < size:
        a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
        if 8 * min(_times(lambda: torch.matmul(a, b), _SIZING_TIMINGS, device)) > _MATMUL_BUDGET_S:
            break
        n *= 2
    return n


def measure_attention_share(dtype: torch.dtype, seq: int, head_dim: int, peak: float, repeats: int) -> float:
    """Share of ``peak`` causal scaled_dot_product_attention reaches, forward and backward, on heads of
    ``seq`` x ``head_dim`` (as many batched as make one call's work timeable), counted as the cost model
    counts it: 4 x seq^2 x head_dim forward FLOPs per head, three times that for training."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    head_flops = 4 * seq * seq * head_dim
    heads = max(1, round(_ATTENTION_CALL_FLOPS[device.type] / head_flops))
    q, k, v = (torch.randn(1, heads, seq, head_dim, device=device).to(dtype).requires_grad_() for _ in range(3))
    grad = torch.randn(1, heads, seq, head_dim, device=device).to(dtype)

    def step():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    seconds = statistics.median(_compute_times(step, repeats, device))
    return min(1.0, 3 * head_flops * heads / seconds / peak)


def measure_pointwise_rate(dtype: torch.dtype, op: str, repeats: int) -> float:
    """Elements per second of ``op`` (a torch function by name, e.g. "gelu") in training, counted as the cost
    model counts it: forward and backward take three forward-equivalents, each one element per output element."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    n = _POINTWISE_ELEMENTS[device.type]
    x = torch.randn(n, device=device).to(dtype).requires_grad_()
    grad = torch.randn(n, device=device).to(dtype)
    fn = getattr(torch, op, None) or getattr(torch.nn.functional, op)
    return 3 * n / statistics.median(_compute_times(lambda: fn(x).backward(grad), repeats, device))


def measure_loss(dtype: torch.dtype, op: str, group: dist.ProcessGroup, repeats: int) -> tuple[float, float]:
    """Cross-entropy (``op``: one of LOSS_OPS) in training as the runtime runs it under ``dtype`` (over the logits
    cast up to ``LOSS_DTYPE``): (logits per second, counted as the cost model counts them: three forward-equivalents,
    each one element per logit; fixed seconds of a call). ``group`` holds this rank alone, so the
    vocabulary-parallel loss's collectives move nothing."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    classes = _LOSS_CLASSES[device.type]
    loss = F.cross_entropy if op == "cross_entropy" else functools.partial(vocab_parallel_cross_entropy,
                                                                           shard_index=0, group=group)

    def seconds(rows: int) -> float:
        logits = torch.randn(rows, classes, device=device).to(dtype).requires_grad_()
        target = torch.randint(0, classes, (rows,), device=device, generator=torch.Generator(device).manual_seed(0))
        return statistics.median(_compute_times(lambda: loss(logits.to(LOSS_DTYPE), target).backward(), repeats,
                                                device))

    rows = _POINTWISE_ELEMENTS[device.type] // classes
    few, many = seconds(rows // 4), seconds(rows)
    if many <= few:  # the difference lost in noise: the whole call's rate, no fixed cost apart
        return 3 * rows * classes / many, 0.0
    rate = 3 * (rows - rows // 4) * classes / (many - few)
    return rate, max(0.0, few - 3 * (rows // 4) * classes / rate)


def measure_op_overheads(repeats: int, dtypes: Sequence[str] = (), ops: int = 100) -> OpOverheads:
    """Fixed seconds per op of forward plus backward on tiny tensors: plain (in float32, and in each of
    ``dtypes`` where timed apart), and the extra of the runtime's split op (a product run on DTensors, no
    communication); and per tensor of an optimizer step. Every rank must call it."""
    _check_repeats(repeats)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def per_op(op: Callable[[torch.Tensor], torch.Tensor], shape: tuple[int, ...] = (8, 8)) -> float:
        x = torch.ones(shape, device=device, requires_grad=True)

        def chain():
            y = x
            for _ in range(ops):
                y = op(y)
            y.sum().backward()

        return statistics.median(_times(chain, repeats, device)) / ops

    plain = per_op(lambda y: y * 1.0)
    # A split op is a module call the runtime wraps (ShardedModule), nearly always a product: it wraps input and
    # weight as DTensors, dispatches view, t and mm and their backwards on them, and unwraps its output, about
    # 2.5 times what a split elementwise op pays on CPU. Layouts here are whole, so no rank waits on another.
    product = nn.Linear(8, 8, bias=False, device=device)
    axes = (("world", dist.get_world_size()),)
    mesh = Mesh(axes, (), device.type, dist.get_rank())
    act = Layout.replicated(axes, 3)
    split_product = ShardedModule(product, {"weight": Layout.replicated(axes, 2)}, [act], act, mesh)
    extra = per_op(split_product, (2, 4, 8)) - per_op(product, (2, 4, 8))
    # On CPU the host's time is the device's: a real micro-batch's fixed cost per op (autograd, dispatch, and
    # kernels that differ by dtype) is what the planner needs, and a chain of one op shows a fraction of it;
    # the optimizer's per-tensor work comes once per step. On GPUs the host runs ahead of the kernels, so the
    # chain's figure (launch costs) stays for every dtype, and the fused step's few launches are left out.
    timed = ("float32", *dtypes) if device.type == "cpu" else ()
    steps = measure_step_overheads(timed, repeats)
    update = measure_update_overhead(repeats) if device.type == "cpu" else 0.0
    # each a difference of two timings, which needs more of them to settle (at 5, the policy's figure moved from
    # 130 to 330 us between runs on 4 ranks sharing 2 cores; at 15, from 143 to 152)
    rerun, watched = measure_recompute_overheads(3 * repeats) if device.type == "cpu" else (0.0, 0.0)
    plain, extra, update, rerun, watched, *steps = _all_reduce([plain, extra, update, rerun, watched, *steps],
                                                               dist.ReduceOp.MAX, None)
    by_dtype = dict(zip(timed, steps))
    return OpOverheads(by_dtype.pop("float32", plain), by_dtype, max(extra, 0.0), update, rerun, watched)


class OpOverheads(NamedTuple):
    """Fixed seconds per op and micro-batch (float32, and other dtypes where timed apart), the extra of a split
    (DTensor) op, and per tensor of an optimizer step: the Cluster's fields of the same names."""

    op_overhead_s: float
    op_overheads_s: dict[str, float]
    split_op_overhead_s: float
    optimizer_overhead_s: float
    recompute_op_overhead_s: float = 0.0
    watched_op_overhead_s: float = 0.0


def measure_step_overheads(dtypes: Sequence[str], repeats: int, calls: int = 20,
                           names: Sequence[str] = ("gpt-tiny",)) -> list[float]:
    """Seconds per graph op of a forward and backward of each model in ``names`` (by default a GPT so small that
    its FLOPs are under 1% of the step on CPU) in each of ``dtypes``, every rank at once from a barrier, as
    training's collectives start them; one figure per (model, dtype), models outer. The runs take turns batch by
    batch, so a change in the machine's load falls on all of them alike."""
    runs = []
    for name in names:
        for dtype in dtypes:
            model = models.build(name, seed=0).to(getattr(torch, dtype))
            batch = model.example_inputs(1)
            ops = sum(n.op.startswith("call_") for n in capture(model, batch).graph.nodes)

            def forward_backward(model=model, batch=batch):
                model.zero_grad(set_to_none=True)
                model(*batch).backward()

            runs.append((forward_backward, ops))
    times = [[] for _ in runs]
    for _ in range(repeats):
        for (run, ops), mine in zip(runs, times):
            mine.append(_times(run, 1, torch.device("cpu"), dist.barrier, calls)[0] / ops)
    return [statistics.median(t) for t in times]


def measure_recompute_overheads(repeats: int, calls: int = 20) -> tuple[float, float]:
    """What checkpointing adds per op it reruns, beyond the rerun's own fixed cost (a third of a forward and
    backward's), and what a policy watching every op adds per op of its region: gpt-tiny's forward and backward
    with no recompute, with every block checkpointed plainly, and with every block under a policy, taking turns
    batch by batch, every rank at once from a barrier."""
    model = models.build("gpt-tiny", seed=0)
    batch = model.example_inputs(1)
    gm = capture(model, batch)
    ops = sum(n.op.startswith("call_") for n in gm.graph.nodes)
    region_ops = len(recomputed(gm, "full").rerun)
    programs = (gm, apply_recompute(gm, "full", "recompute", collectives=False),
                apply_recompute(gm, "full", "keep", collectives=True))

    def forward_backward(program):
        model.zero_grad(set_to_none=True)
        program(*batch).backward()

    times = [[] for _ in programs]
    for _ in range(repeats):
        for program, mine in zip(programs, times):
            mine.append(_times(functools.partial(forward_backward, program), 1, torch.device("cpu"), dist.barrier,
                               calls)[0])
    plain, rerun, watched = (statistics.median(t) for t in times)
    return max((rerun - plain) / region_ops - plain / ops / 3, 0.0), max((watched - rerun) / region_ops, 0.0)


def slowest_step_overhead(repeats: int) -> float:
    """A CPU's float32 fixed cost per op (:func:`measure_step_overheads`) on every rank at once: the slowest rank's,
    the figure :func:`calibrate` keeps as ``op_overhead_s``."""
    return _all_reduce(measure_step_overheads(("float32",), repeats), dist.ReduceOp.MAX, None)[0]


def measure_update_overhead(repeats: int) -> float:
    """Seconds per parameter tensor of the AdamW step training runs on that GPT, every rank at once from a barrier."""
    params = list(models.build("gpt-tiny", seed=0).parameters())
    for p in params:
        p.grad = torch.ones_like(p)
    opt = build_optimizer("adamw", params, lr=1e-3)  # as training builds it
    return statistics.median(_compute_times(opt.step, repeats, torch.device("cpu"), calls=5)) / len(params)


def measure_memory_bandwidth(repeats: int, host: bool = False) -> float:
    """Bytes per second one copy reads and writes in this rank's memory (all ranks copy at once, as in
    training): what bounds elementwise ops, norms and the optimizer step; ``host``: in host memory, where
    offload steps the optimizer."""
    _check_repeats(repeats)
    on_gpu = torch.cuda.is_available() and not host
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    nbytes, calls = _STREAM[device.type]
    src, dst = torch.ones(nbytes // 4, device=device), torch.empty(nbytes // 4, device=device)
    return 2 * nbytes / statistics.median(_compute_times(lambda: dst.copy_(src), repeats, device, calls=calls))


def measure_offload_bandwidths(nbytes: int = 64 * 2**20) -> tuple[float, float]:
    """Bytes per second of (device <-> host copies, host <-> disk round trips: write, fsync, read back)."""
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    src = torch.ones(nbytes // 4, device=device)
    host = torch.empty(nbytes // 4, pin_memory=on_gpu)
    copy = statistics.median(_times(lambda: host.copy_(src), 3, device))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "offload.bin"
        data = host.numpy().tobytes()

        def round_trip():
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            path.read_bytes()

        disk = statistics.median(_times(round_trip, 3, torch.device("cpu")))
    return nbytes / copy, 2 * nbytes / disk


def measure_collective(kind: str, nbytes: int, group: dist.ProcessGroup | None, repeats: int) -> float:
    """Seconds of one ``kind`` on ``nbytes`` of float32 per rank: median over repeats of the slowest rank's
    mean over a batch of calls.

    Raises NotImplementedError where the backend lacks the collective (every rank does, alike)."""
    _check_kind(kind)
    _check_repeats(repeats)
    n = dist.get_world_size(group)
    if nbytes < 4 * n or nbytes % (4 * n):
        raise PolyshardError(f"message of {nbytes} bytes does not split into float32 chunks for {n} ranks; "
                             f"use a multiple of {4 * n}")
    device = _comm_device(group)
    op = _collective(kind, torch.ones(nbytes // 4, device=device), group)
    try:
        times = _times(op, repeats, device, lambda: dist.barrier(group=group), max(1, _BATCH_BYTES // nbytes))
    except RuntimeError as e:
        if kind != "all_to_all":
            raise
        reason = str(e).splitlines()[0]
        raise NotImplementedError(f"{dist.get_backend(group)} has no all_to_all_single: {reason}") from e
    return statistics.median(_all_reduce(times, dist.ReduceOp.MAX, group))


def measure_arrival_skew(device: torch.device, repeats: int,
                         pairs: dist.ProcessGroup | None = None) -> tuple[float, float, float]:
    """(arrival_skew, node_call_skew_s, call_skew_s): how much longer the mean rank waits in a small all-reduce
    after ``_SKEW_WORK_S`` of products than after none, each rank running as many as it ran in that time while
    every rank ran them (as in a step). The node's all-reduce gives a share of that work and a wait per call
    (:func:`skew_fit`); where ``pairs`` (this rank's group of two, smaller than the node) is given, a pair's
    gives the seconds its call waits whatever the work before it."""
    a = torch.randn(_SKEW_SIDE, _SKEW_SIDE, device=device)
    payload = torch.ones(_SKEW_PAYLOAD // 4, device=device)
    dist.barrier()
    _sync(device)
    count, end = 0, time.perf_counter() + max(_SKEW_WORK_S)
    while time.perf_counter() < end:
        a @ a
        _sync(device)
        count += 1
    per_s = _all_reduce([count / max(_SKEW_WORK_S)], dist.ReduceOp.MIN, None)[0]

    def wait_after(work_s: float, group: dist.ProcessGroup | None) -> float:  # this rank's median wait after the work
        waits = []
        for _ in range(max(repeats, _SKEW_REPEATS)):
            dist.barrier()
            for _ in range(int(per_s * work_s)):
                a @ a
            _sync(device)
            start = time.perf_counter()
            dist.all_reduce(payload, group=group)
            _sync(device)
            waits.append(time.perf_counter() - start)
        return statistics.median(waits)

    def extra(group: dist.ProcessGroup | None) -> list[float]:  # the mean rank's, per span of work
        waits = np.array(_all_reduce([wait_after(w, group) for w in (0.0, *_SKEW_WORK_S)], dist.ReduceOp.SUM, None))
        return list((waits[1:] - waits[0]) / dist.get_world_size())

    return skew_fit(_SKEW_WORK_S, extra(None), extra(pairs) if pairs is not None else None)


def skew_fit(work_s: Sequence[float], node_extra: Sequence[float],
             pair_extra: Sequence[float] | None) -> tuple[float, float, float]:
    """(arrival_skew, node_call_skew_s, call_skew_s) from the mean rank's extra waits after each span of work.
    The node's least extra is what each of its calls waits once the work outlasts a time slice, and the slope
    through the origin of what the others add to it is the share of the work. The pairs' median: ranks
    time-sliced with the node's others reach a pair's call about a slice apart, however long the work before
    it. Each is kept at 0 or more."""
    work, node = np.asarray(work_s, dtype=float), np.asarray(node_extra, dtype=float)
    floor = max(0.0, float(node.min()))
    share = max(0.0, float((node - floor) @ work / (work @ work)))
    return share, floor, max(0.0, float(np.median(pair_extra))) if pair_extra is not None else 0.0


def fit_alpha_beta(sizes_bytes: Sequence[int], seconds: Sequence[float], kind: str, group_size: int) -> Link:
    """Least squares of time = latency + wire bytes / bandwidth, in relative error so the small messages
    that carry the latency count as much as the large ones; latency is kept at or above 0 and returned
    per ring step (the collective's latency / (group_size - 1))."""
    _check_kind(kind)
    if len(sizes_bytes) != len(seconds) or len(set(sizes_bytes)) < 2:
        raise PolyshardError(f"fitting {kind} needs one time per size and at least two distinct sizes; "
                             f"got sizes {list(sizes_bytes)} and {len(seconds)} times")
    if group_size < 2 or min(seconds) <= 0:
        raise PolyshardError(f"fitting {kind} needs a group of at least 2 ranks and positive times; "
                             f"got {group_size} ranks and times {list(seconds)}")
    t = np.asarray(seconds, dtype=float)
    u = np.array([_wire(kind, s, group_size) for s in sizes_bytes]) / t
    (latency, per_byte), *_ = np.linalg.lstsq(np.stack([1 / t, u], axis=1), np.ones_like(t), rcond=None)
    if latency < 0:
        latency, per_byte = 0.0, u.sum() / (u**2).sum()
    if per_byte <= 0:
        shown = ", ".join(_si(s, "s") for s in seconds)
        raise PolyshardError(f"{kind} times ({shown}) do not grow with message size, so no bandwidth fits; "
                             "time larger messages, more repeats, or on a quieter machine")
    # the planner charges latency per ring step (group_size - 1 steps per collective): store it so
    steps = 1 if kind == "send_recv" else group_size - 1
    return Link(bandwidth_bytes_per_s=float(1 / per_byte), latency_s=float(latency) / steps)


def calibrate(out_path: str | Path | None, sizes: Sequence[int], repeats: int) -> Cluster:
    """Measure on every rank (all must call it); rank 0 prints the figures and writes ``out_path`` (if given)."""
    base = Cluster.from_env()
    world = dist.get_world_size()
    if base.num_devices != world:
        raise PolyshardError(f"calibration needs every rank of the job; the world has {world} "
                             f"(WORLD_SIZE={base.num_devices})")
    _check_repeats(repeats)
    sizes = sorted({s - s % (4 * world) for s in sizes if s >= 4 * world})
    if world > 1 and len(sizes) < 2:
        raise PolyshardError(f"calibration needs at least two message sizes of {4 * world} bytes or more; "
                             f"got {len(sizes)}")
    say = _progress(dist.get_rank() == 0)
    say("matmul rate per dtype")
    flops, matmul_sizes, notes = _flops(base.device_type, repeats)
    say("matmul by contraction depth")
    products = _matmul_shares(base.device_type, flops, matmul_sizes, repeats)
    say("attention by sequence length and head dim")
    attention = _attention_shares(base.device_type, flops, repeats, notes)
    say("pointwise ops and cross-entropy")
    pointwise = {name: dict(zip(POINTWISE_OPS, _all_reduce([measure_pointwise_rate(getattr(torch, name), op, repeats)
                                                            for op in POINTWISE_OPS], dist.ReduceOp.MIN, None)))
                 for name in flops}
    alone, loss_overheads = dist.new_subgroups(group_size=1)[0], {}
    for name, rates in pointwise.items():
        measured = [measure_loss(getattr(torch, name), op, alone, repeats) for op in LOSS_OPS]
        rates |= zip(LOSS_OPS, _all_reduce([rate for rate, _ in measured], dist.ReduceOp.MIN, None))
        loss_overheads[name] = dict(zip(LOSS_OPS, _all_reduce([s for _, s in measured], dist.ReduceOp.MAX, None)))
    say("fixed costs per op, recompute and optimizer step")
    overheads = measure_op_overheads(repeats, [name for name in flops if name != "float32"])
    say("memory, host and disk bandwidths")
    memory_bw = _all_reduce([measure_memory_bandwidth(repeats)], dist.ReduceOp.MIN, None)[0]
    host_bw, disk_bw = _all_reduce(list(measure_offload_bandwidths()), dist.ReduceOp.MIN, None)
    cuda = base.device_type == "cuda"
    # where offload steps the optimizer: on a GPU node the host, timed as the device is; a CPU's host is the device
    host_memory_bw, host_update = memory_bw, overheads.optimizer_overhead_s
    if cuda:
        host_memory_bw = _all_reduce([measure_memory_bandwidth(repeats, host=True)], dist.ReduceOp.MIN, None)[0]
        host_update = _all_reduce([measure_update_overhead(repeats)], dist.ReduceOp.MAX, None)[0]
    if world > 1:
        say(f"collectives on {len(sizes)} message sizes, and how far apart ranks reach them")
    sweeps, fits = _fitted_sweeps(base, sizes, repeats, say)
    skew, node_skew, pair_skew = (measure_arrival_skew(_comm_device(None), repeats, _pairs(base)) if world > 1
                                  else (0.0, 0.0, 0.0))
    intra, inter = (fits["all_reduce"], fits.get(RAILS, fits["all_reduce"])) if sweeps else \
        (base.intra_node, base.inter_node)
    if world == 1:
        notes.append(f"one process: no collective to time; the links are the {base.device_name} preset's")
    elif base.num_nodes == 1:
        notes.append("one node: inter_node is a copy of intra_node (no link between nodes to time)")
    if world > 1 and base.devices_per_node == 1:
        notes.append("one device per node: intra_node is a copy of inter_node (no link inside a node to time)")
    if cuda:
        notes.append(f"compute beside a collective is taken as {base.overlap_slowdown:.1%} slower: the "
                     f"{base.device_name} preset's published figure, not timed here")
    shared = None if cuda else shared_cores_note(base.devices_per_node, torch.get_num_threads(), available_cores())
    if shared:
        notes.append(shared)
    efficiency, depths = measured_product_shares(base, matmul_sizes.get("float32", MATMUL_SIZE[base.device_type]))
    cluster = replace(
        base,
        device_name=torch.cuda.get_device_name() if cuda else "cpu",
        memory_bytes=torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory if cuda
        else base.memory_bytes,  # the machine's, shared by its ranks
        intra_node=intra,
        inter_node=inter,
        flops_per_s=flops,
        matmul_efficiency=efficiency,
        matmul_depth_shares=depths,
        matmul_shares=products,
        attention_shares=attention,
        pointwise_rates=pointwise,
        loss_overheads_s=loss_overheads,
        **overheads._asdict(),
        memory_bandwidth_bytes_per_s=memory_bw,
        host_bandwidth_bytes_per_s=host_bw,
        disk_bandwidth_bytes_per_s=disk_bw,
        host_memory_bandwidth_bytes_per_s=host_memory_bw,
        host_optimizer_overhead_s=host_update,
        arrival_skew=skew,
        node_call_skew_s=node_skew,
        call_skew_s=pair_skew,
    )
    if dist.get_rank() == 0:
        print(_report(cluster, sweeps, sizes, fits, notes))
        if out_path is not None:
            cluster.to_yaml(out_path)
            print(f"cluster: {out_path}")
    return cluster


def _progress(lead: bool) -> Callable[[str], None]:
    """``say(what)``: on the lead rank, a line on stderr that calibration now times ``what``, and how long it has
    run (it takes a minute or more; the figures print at the end)."""
    start = time.perf_counter()

    def say(what: str) -> None:
        if lead:
            print(f"calibrating ({time.perf_counter() - start:.0f} s): {what}", file=sys.stderr, flush=True)
    return say


def shared_cores_note(ranks: int, threads: int, cores: int) -> str | None:
    """Where a node's ranks run more threads than it has cores, a note that every figure is timed so shared."""
    if ranks * threads <= cores:
        return None
    return (f"{ranks} ranks of {threads} thread{'s' * (threads > 1)} share {cores} cores: every figure is timed as "
            "they share them, as training on this machine does")


def _sweeps(base: Cluster, sizes: list[int], repeats: int) -> dict[str, Sweep]:
    """Every collective timed inside one node, and where there are several nodes all_reduce across them, one
    rank a node, every rail at once (the inter-node link: one NIC per device, see cost.comm.axis_link); none in a
    world of one."""
    if base.num_devices == 1:
        return {}
    split = base.num_nodes > 1 and base.devices_per_node > 1
    local = dist.new_subgroups(base.devices_per_node)[0] if split else None
    sweeps = {kind: _sweep(kind, sizes, local, repeats) for kind in KINDS}
    if split:
        sweeps[RAILS] = _sweep("all_reduce", sizes, _rail(base), repeats)
    return sweeps


def _fitted_sweeps(base: Cluster, sizes: list[int], repeats: int,
                   say: Callable[[str], None]) -> tuple[dict[str, Sweep], dict[str, Link | str]]:
    """The sweeps and their fits; where all_reduce's times are too noisy to fit, the sweeps again with twice the
    repeats, _SWEEP_RETRIES times at most (every rank holds the same times, so all time again together)."""
    for _ in range(_SWEEP_RETRIES):
        sweeps = _sweeps(base, sizes, repeats)
        try:
            return sweeps, _fits(sweeps, sizes)
        except PolyshardError as e:
            repeats *= 2
            say(f"collectives again with {repeats} repeats ({str(e).split(', so ')[0]})")
    sweeps = _sweeps(base, sizes, repeats)
    return sweeps, _fits(sweeps, sizes)


def _rail(base: Cluster) -> dist.ProcessGroup:
    """This rank's group of one rank a node, the same local rank on each (every rank must call it)."""
    per_node = base.devices_per_node
    return dist.new_subgroups_by_enumeration([list(range(i, base.num_devices, per_node))
                                              for i in range(per_node)])[0]


def measured_product_shares(base: Cluster, depth: int) -> tuple[float, tuple[tuple[float, float], ...]]:
    """(matmul_efficiency, matmul_depth_shares) for rates measured on products ``depth`` deep: those
    products reach the measured rate (share 1), shallower ones ``base``'s shares relative to it, and
    deeper ones no more than it."""
    at_depth = base.matmul_share(depth, depth, depth) / base.matmul_efficiency
    return 1.0, tuple((d, min(1.0, share / at_depth)) for d, share in base.matmul_depth_shares)


def _flops(device_type: str, repeats: int) -> tuple[dict[str, float], dict[str, int], list[str]]:
    """Matmul FLOP/s per dtype, of the slowest rank (all ranks compute at once, as in training), and the
    size of the products timed (every rank times the same)."""
    flops, sizes, notes = {}, {}, []
    for name in ("float32", "bfloat16", "float16"):
        dtype = getattr(torch, name)
        try:
            size = int(_all_reduce([timeable_matmul_size(dtype, MATMUL_SIZE[device_type])], dist.ReduceOp.MIN,
                                   None)[0])
            flops[name] = slowest_matmul_rate(dtype, size, repeats)
        except RuntimeError as e:
            notes.append(f"{name}: skipped, this device cannot multiply it ({str(e).splitlines()[0]})")
            continue
        sizes[name] = size
        if size < MATMUL_SIZE[device_type]:
            notes.append(f"{name}: timed on {size} x {size} products (one of {MATMUL_SIZE[device_type]} would "
                         f"take over {_MATMUL_BUDGET_S} s)")
    return flops, sizes, notes


def _matmul_shares(device_type: str, flops: dict[str, float], sizes: dict[str, int],
                   repeats: int) -> dict[str, tuple[tuple[float, float], ...]]:
    """Each dtype's share of its matmul rate by contraction depth, of the slowest rank; not for a dtype whose
    rate was timed on smaller products (one the device emulates)."""
    out = {}
    for name, peak in flops.items():
        depths = _MATMUL_DEPTHS[device_type]
        if not depths or sizes[name] < MATMUL_SIZE[device_type]:
            continue
        rates = [measure_matmul(getattr(torch, name), _MATMUL_SIDE, repeats, depth) for depth in depths]
        shares = _all_reduce([min(1.0, rate / peak) for rate in rates], dist.ReduceOp.MIN, None)
        out[name] = tuple((float(depth), share) for depth, share in zip(depths, shares))
    return out


def _attention_shares(device_type: str, flops: dict[str, float], repeats: int,
                      notes: list[str]) -> dict[str, tuple[tuple[float, float, float], ...]]:
    """Attention's share of each dtype's matmul rate by head shape, of the slowest rank."""
    seqs, dims = _ATTENTION_GRID[device_type]
    shapes = [(seq, dim) for dim in dims for seq in seqs]
    out = {}
    for name, peak in flops.items():
        try:
            shares = [measure_attention_share(getattr(torch, name), seq, dim, peak, repeats) for seq, dim in shapes]
        except RuntimeError as e:
            notes.append(f"attention in {name}: not timed ({str(e).splitlines()[0]})")
            continue
        shares = _all_reduce(shares, dist.ReduceOp.MIN, None)
        out[name] = tuple((float(seq), float(dim), share) for (seq, dim), share in zip(shapes, shares))
    return out


def _pairs(base: Cluster) -> dist.ProcessGroup | None:
    """This rank's group of two, where a node holds more than two ranks in pairs (every rank must call it)."""
    if base.devices_per_node <= 2 or base.devices_per_node % 2:
        return None
    return dist.new_subgroups(2)[0]


def _sweep(kind: str, sizes: list[int], group: dist.ProcessGroup | None, repeats: int) -> Sweep:
    """Every size once per round, medians over rounds: load that drifts during the sweep falls on all sizes alike."""
    n = dist.get_world_size(group)
    try:
        rounds = [[measure_collective(kind, s, group, 1) for s in sizes] for _ in range(repeats)]
    except NotImplementedError as e:
        return Sweep(kind, n, None, str(e))
    return Sweep(kind, n, [statistics.median(times) for times in zip(*rounds)], "")


def _fits(sweeps: dict[str, Sweep], sizes: list[int]) -> dict[str, Link | str]:
    """A Link per measured sweep; the reason instead where none fits (all_reduce must fit: it is the link)."""
    fits: dict[str, Link | str] = {}
    for label, sweep in sweeps.items():
        if sweep.seconds is None:
            fits[label] = f"unsupported: {sweep.note}"
            continue
        try:
            fits[label] = fit_alpha_beta(sizes, sweep.seconds, sweep.kind, sweep.group_size)
        except PolyshardError as e:
            if sweep.kind == "all_reduce":
                raise
            fits[label] = f"no fit: {e}"
    return fits


def _report(cluster: Cluster, sweeps: dict[str, Sweep], sizes: list[int], fits: dict[str, Link | str],
            notes: list[str]) -> str:
    lines = [f"{'matmul':<24} {'FLOP/s':>12}"]
    lines += [f"{name:<24} {_si(rate, 'FLOP/s'):>12}" for name, rate in cluster.flops_per_s.items()]
    if cluster.matmul_shares:
        lines += ["", f"matmul by contraction depth ({_MATMUL_SIDE} x depth by depth x {_MATMUL_SIDE}): "
                  "share of the rate"]
        lines += [f"{name:<24} " + ", ".join(f"{depth:.0f}: {sh:.3f}" for depth, sh in points)
                  for name, points in cluster.matmul_shares.items()]
    lines += ["", "attention (causal, forward + backward): share of the matmul rate by head dim, then sequence"]
    lines += [f"{f'{name}, {dim:.0f}':<24} " + ", ".join(f"{seq:.0f}: {sh:.3f}" for seq, d, sh in points if d == dim)
              for name, points in cluster.attention_shares.items() for dim in sorted({d for _, d, _ in points})]
    lines += ["", "pointwise ops (forward + backward, as three forwards): elements per second (cross-entropy: logits,"
              " and the fixed cost of a call)"]
    lines += [f"{name:<24} " + ", ".join(f"{op} {_si(rate, '')}" for op, rate in rates.items())
              for name, rates in cluster.pointwise_rates.items()]
    lines += [f"{name + ', fixed':<24} " + ", ".join(f"{op} {_si(s, 's')}" for op, s in costs.items())
              for name, costs in cluster.loss_overheads_s.items()]
    lines += ["", "fixed cost per op (forward + backward)",
              f"{'plain':<24} {_si(cluster.op_overhead_s, 's'):>12}"]
    lines += [f"{'plain, ' + name:<24} {_si(s, 's'):>12}" for name, s in cluster.op_overheads_s.items()]
    lines += [f"{'split op (DTensor), extra':<24} {_si(cluster.split_op_overhead_s, 's'):>12}",
              f"{'recomputed, extra':<24} {_si(cluster.recompute_op_overhead_s, 's'):>12}  (checkpointing, per op "
              "run again)",
              f"{'watched, extra':<24} {_si(cluster.watched_op_overhead_s, 's'):>12}  (a checkpoint policy, per op "
              "of its region)",
              f"{'optimizer, per tensor':<24} {_si(cluster.optimizer_overhead_s, 's'):>12}",
              "", f"{'memory (read + write)':<24} {_si(cluster.memory_bandwidth_bytes_per_s, 'B/s'):>12}",
              "", "offload copies",
              f"{'device <-> host':<24} {_si(cluster.host_bandwidth_bytes_per_s, 'B/s'):>12}",
              f"{'host <-> disk':<24} {_si(cluster.disk_bandwidth_bytes_per_s, 'B/s'):>12}",
              f"{'host memory (step)':<24} {_si(cluster.host_memory_bandwidth_bytes_per_s, 'B/s'):>12}",
              f"{'host step, per tensor':<24} {_si(cluster.host_optimizer_overhead_s, 's'):>12}"]
    if not sweeps:
        return "\n".join(lines + [""] + [f"note: {n}" for n in notes])
    lines += ["", f"{'arrival skew':<24} {cluster.arrival_skew:>12.3f}  (the mean rank's extra wait in a collective, "
              "per second of compute before it)",
              f"{'call skew, node':<24} {_si(cluster.node_call_skew_s, 's'):>12}  (what a collective of the node's "
              "whole group waits for its ranks on top of that)",
              f"{'call skew, pairs':<24} {_si(cluster.call_skew_s, 's'):>12}  (what a collective of a group smaller "
              "than the node waits for its ranks, whatever the compute before it)"]
    lines += ["", f"{'collective':<24} {'ranks':>5} {'message':>10} {'seconds':>10} {'bus bandwidth':>14}"]
    for label, s in sweeps.items():
        for i, size in enumerate(sizes):
            timing = ("unsupported", "") if s.seconds is None else (
                _si(s.seconds[i], "s"), _si(_wire(s.kind, size, s.group_size) / s.seconds[i], "B/s"))
            lines.append(f"{label:<24} {s.group_size:>5} {format_bytes(size):>10} {timing[0]:>10} {timing[1]:>14}")
    lines += ["", "fit: time = (ranks - 1) x latency per step + bytes each rank sends / bandwidth"]
    for label, fit in fits.items():
        shown = f"latency {_si(fit.latency_s, 's')} per step, bandwidth {_si(fit.bandwidth_bytes_per_s, 'B/s')}" \
            if isinstance(fit, Link) else fit
        lines.append(f"{label:<24} {shown}")
    return "\n".join(lines + [""] + [f"note: {n}" for n in notes])


def _collective(kind: str, x: torch.Tensor, group: dist.ProcessGroup | None) -> Callable[[], object]:
    """One call of ``kind`` on ``x`` with its output buffer allocated once, outside the timing."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(x, group=group)
    if kind == "all_gather":
        gathered = x.new_empty(n * x.numel())
        return lambda: dist.all_gather_single(gathered, x, group=group)
    if kind == "reduce_scatter":
        chunk = x.new_empty(x.numel() // n)
        return lambda: dist.reduce_scatter_single(chunk, x, group=group)
    out = torch.empty_like(x)
    if kind == "all_to_all":
        return lambda: dist.all_to_all_single(out, x, group=group)
    peer = rank ^ 1  # pairs 0<->1, 2<->3, ...; the last rank of an odd group sits out
    if peer >= n:
        return lambda: None
    return lambda: [w.wait() for w in (dist.isend(x, group=group, group_dst=peer),
                                       dist.irecv(out, group=group, group_src=peer))]


def _compute_times(op: Callable[[], object], repeats: int, device: torch.device,
                   barrier: Callable[[], object] = dist.barrier, calls: int = 1) -> list[float]:
    """:func:`_times` of compute every rank runs at once; on a CPU each timing runs as many calls as last
    _CPU_TIMING_S (sized by the fastest of three, which load slows least), and starts from a barrier."""
    if device.type == "cpu":
        one = min(_times(op, 3, device))
        calls, barrier = max(calls, math.ceil(_CPU_TIMING_S / max(one, 1e-9))), dist.barrier
    return _times(op, repeats, device, barrier, calls)


def _times(op: Callable[[], object], repeats: int, device: torch.device,
           barrier: Callable[[], object] = lambda: None, calls: int = 1) -> list[float]:
    """Mean seconds per call of ``op`` in each of ``repeats`` batches of ``calls``, after a warm-up call;
    each batch starts after ``barrier``."""
    op()
    times = []
    for _ in range(repeats):
        barrier()
        _sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            op()
        _sync(device)
        times.append((time.perf_counter() - start) / calls)
    return times


def _all_reduce(values: list[float], op: dist.ReduceOp, group: dist.ProcessGroup | None) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=_comm_device(group))
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()


def _wire(kind: str, nbytes: int, group_size: int) -> float:
    """Bytes one rank sends: the message for send_recv, else the ring formula of the collective that ran."""
    if kind == "send_recv":
        return float(nbytes)
    # a real all_to_all_single ran, so not the all_gather that stands in for it under gloo's DTensor
    return wire_bytes(kind, nbytes, group_size, backend="nccl")


def _comm_device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise PolyshardError(f"collective {kind!r} is unknown; use one of {', '.join(KINDS)}")


def _check_repeats(repeats: int) -> None:
    if repeats < 1:
        raise PolyshardError(f"repeats must be at least 1, got {repeats}")


def _si(value: float, unit: str) -> str:
    """``value`` with an SI prefix, e.g. 41.2 us or 3.1 GB/s."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3), ("", 1.0), ("m", 1e-3), ("u", 1e-6)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value * 1e9:.3g} n{unit}"
