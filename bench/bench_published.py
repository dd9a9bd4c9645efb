"""The planner against published hand-tuned runs: same model shape, devices and global batch.

    python bench/bench_published.py                 # every row (a few minutes on 2 cores)
    python bench/bench_published.py --rows 1.7B,GPT-3-175B@384 --json
    python bench/bench_published.py --rows 1T --repeats 3   # planning time: the fastest of three

Per row: the published configuration priced by polyshard's cost model (its dp / tp / pp, global
batch, its tensor parallel as Megatron-LM ran it before sequence parallel (the values between split
products whole on each rank, sums all-reduced), full recompute that issues a layer's collectives again
as Megatron-LM's does, its optimizer sharding, the gradient reduction after backward where DeepSpeed's
pipeline engine ran it; the micro-batch count and schedule left to the search, as the papers do not all
give them; a transformers row, and a Megatron-Core benchmark row, keep their dp / tp / pp in bf16, and what else
the source gives), the planner's own pick with nothing fixed, and the reported throughput. TFLOP/s per GPU are
counted each source's way (Narayanan et al. 2021, eq. 3: 96 B s l h^2 (1 + s/6h + V/16lh), the recomputed forward
included; Megatron-Core's 72 B s l h^2 (1 + s/6h + V/12lh); a transformers row's model FLOPs, as Llama 3's paper
and torchtitan count them), so a row's three figures compare step times. Goals: the pick costs no more
than the published configuration; the published configuration's prediction is within 15% of the reported
figure; each row plans in under 10 s. A published configuration is priced under the memory the planner leaves its
own picks, or where it needs more, under the whole GPU's (it ran). Then the runs a source reports out of memory: the memory the model gives
their configuration, which must exceed the GPU's.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from polyshard import models  # noqa: E402
from polyshard.cluster import Cluster  # noqa: E402
from polyshard.errors import PolyshardError  # noqa: E402
from polyshard.planner.config import Fixed  # noqa: E402
from polyshard.planner.report import chosen_row  # noqa: E402
from polyshard.planner.search import search  # noqa: E402

ERROR_GOAL, PLANNING_GOAL_S = 0.15, 10.0


@dataclass(frozen=True)
class Run:
    """One published run: model shape, GPU count (8 per node), global batch in sequences, its dp x tp x pp,
    micro-batch size when the source gives it, ZeRO level, reported TFLOP/s per GPU, and its dropout (0.1 on
    attention probabilities and residual branches, as Megatron-LM's defaults). ``hf``: a shipped transformers
    config trained instead of Megatron-LM's GPT (its TFLOP/s counted as its source counts them, PaLM's model
    FLOPs, no recompute; fixed: its dp x tp x pp in bf16, and its micro-batch size, ZeRO level and recompute where
    the source gives them)."""

    name: str
    source: str
    layers: int
    hidden: int
    heads: int
    gpus: int
    batch: int
    tp: int
    pp: int
    tflops: float
    vocab: int = 51200
    seq: int = 2048
    mbs: int | None = None
    zero: int = 0
    schedule: str | None = None  # the pipeline schedule where the source shows it; else the search's
    dropout: float = 0.1
    node_link_gbps: float = 0.0  # inter-node line rate per node where it is not one 200 Gb/s HDR NIC per GPU
    # gradients reduced after the last micro-batch's backward, not beside it: DeepSpeed's pipeline engine
    # (Megatron-DeepSpeed, which trained MT-NLG and BLOOM) runs its ReduceGrads step after the schedule
    reduce_after_backward: bool = False
    hf: str = ""
    recompute: str | None = None  # a transformers row's, where the source gives it (Megatron-LM's rows: full)
    gpu: str = "A100-80G"
    # Megatron-Core's own benchmark GPT (flash attention, an LM head of its own), its FLOPs counted as Megatron-Core
    # counts them; fixed: its dp x tp x pp in bf16, equal layers per stage (sequence parallel and recompute, which
    # the source does not give, left to the search)
    core: bool = False
    # a transformers model trained as the Megatron-LM rows were (Megatron-DeepSpeed's BLOOM): its FLOPs counted by
    # eq. 3 and its configuration fixed as theirs, the model as transformers writes it
    megatron: bool = False

    @property
    def dp(self) -> int:
        return self.gpus // self.tp // self.pp

    def model(self) -> str:
        """The GPT these runs trained: attention written out (scores, softmax, dropout), no flash attention;
        or the transformers model."""
        if self.hf:
            return f"hf:{self.hf}"
        shape = f"gpt:layers={self.layers},hidden={self.hidden},heads={self.heads},seq={self.seq},vocab={self.vocab}"
        return shape + (",tied=0" if self.core else ",attention=math") + f",dropout={self.dropout}"

    def flops_per_step(self) -> float:
        """Narayanan et al. 2021, eq. 3 (full recompute): 96 B s l h^2 (1 + s/6h + V/16lh); Megatron-Core's
        (`num_floating_point_operations`, no recompute, an LM head of its own): 72 B s l h^2 (1 + s/6h + V/12lh); a
        transformers model's: PaLM's 6N + 12 l h s per token (polyshard.models.flops_per_token)."""
        if self.hf and not self.megatron:
            return models.flops_per_token(models.config(self.model(), self.seq)) * self.batch * self.seq
        b, s, l, h, v = self.batch, self.seq, self.layers, self.hidden, self.vocab
        if self.core:
            return 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
        return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))

    @property
    def cuts(self) -> str | None:
        """Equal layers per pipeline stage (Megatron-LM; Megatron-DeepSpeed: partition_method type:transformer),
        where there is a pipeline."""
        return "even" if self.pp > 1 else None

    def published(self) -> Fixed:
        """The published configuration as the search must keep it."""
        if self.hf and not self.megatron:
            return Fixed(dp=self.dp, tp=self.tp, pp=self.pp, mbs=self.mbs, zero=self.zero or None,
                         recompute=self.recompute, precision="bf16")
        if self.core:
            return Fixed(dp=self.dp, tp=self.tp, pp=self.pp, precision="bf16", cuts=self.cuts)
        return Fixed(dp=self.dp, tp=self.tp, pp=self.pp, mbs=self.mbs, zero=self.zero,
                     # before sequence parallel (2022), Megatron-LM's layers kept every value between the split
                     # products whole on each rank and all-reduced the row-parallel products' sums
                     tp_comm="all_reduce" if self.tp > 1 else None,
                     recompute="full", recompute_comm="recompute",  # Megatron-LM reruns a layer's all-reduces
                     precision="bf16", schedule=self.schedule,
                     cuts=self.cuts,
                     overlap=0 if self.reduce_after_backward else None)


_SC21 = "Megatron-LM, Narayanan et al. SC'21, Table 1"
_SC21_T2 = "Megatron-LM, Narayanan et al. SC'21, Table 2 (PTD-P)"
_MTNLG = "MT-NLG 530B, Smith et al. 2022 (iteration 60.1 / 50.2 / 44.4 s)"
_LLAMA3 = "Llama 3 405B, Dubey et al. 2024, Table 4 (BF16 MFU 43% / 41% of 989 TFLOP/s)"
# FSDP2 (ZeRO 3) over 64 A100-80G, one 8192-token sequence per GPU: 2973 and 331 tokens/s per GPU, which times
# PaLM's FLOPs per token (all parameters, as torchtitan counts them) is its MFU, 58.2% and 51.7% of 312 TFLOP/s;
# 8B with selective layer checkpointing (every second layer): 2904 tokens/s, 56.8%
_TITAN = "torchtitan, docs/performance.md, Llama 3 on 64 A100 (2973 / 331 / 2904 tokens/s per GPU)"
# the same page's Llama 2 runs: 4096-token sequences, two a GPU; 2162, 1904 and 1914 tokens/s per GPU for 13B with
# no, selective op and selective layer checkpointing (MFU 61.1%, 53.8%, 54.1%), 353 for 70B with full (50.5%); one
# a GPU, selective op: 355 (50.8%)
_TITAN2 = "torchtitan, docs/performance.md, Llama 2 on 64 A100 (2162 / 1904 / 1914 / 353 / 355 tokens/s per GPU)"
# Megatron-Core r0.8.0 on H100s, its README's weak-scaling table (images/model_table.png): 131,072 tokens, sequences
# of 4096, dp=48; its data-parallel, tensor-parallel and pipeline traffic overlapped with compute
_MCORE = "Megatron-LM README, Megatron-Core r0.8.0 weak scaling on H100 (408.8-489.1 TFLOP/s per GPU)"
RUNS = (
    Run("1.7B", _SC21, 24, 2304, 24, 32, 512, 1, 1, 137),
    Run("3.6B", _SC21, 30, 3072, 32, 64, 512, 2, 1, 138),
    Run("7.5B", _SC21, 36, 4096, 32, 128, 512, 4, 1, 142),
    Run("18.4B", _SC21, 40, 6144, 48, 256, 1024, 8, 1, 135),
    Run("39.1B", _SC21, 48, 8192, 64, 512, 1536, 8, 2, 138),
    Run("76.1B", _SC21, 60, 10240, 80, 1024, 1792, 8, 4, 140),
    Run("145.6B", _SC21, 80, 12288, 96, 1536, 2304, 8, 8, 148),
    Run("310.1B", _SC21, 96, 16384, 128, 1920, 2160, 8, 16, 155),
    Run("529.6B", _SC21, 105, 20480, 128, 2520, 2520, 8, 35, 163),
    Run("1T", _SC21, 128, 25600, 160, 3072, 3072, 8, 64, 163),
    # 1F1B: from 384 to 1536 GPUs (384 to 96 micro-batches) throughput falls by 0.974 and 0.922, as
    # 1F1B's share of useful time m / (m + p - 1) does (0.973, 0.923); interleaving would lose 1-2%.
    Run("GPT-3-175B@384", _SC21_T2, 96, 12288, 96, 384, 1536, 8, 12, 153, mbs=1, schedule="1f1b"),
    Run("GPT-3-175B@768", _SC21_T2, 96, 12288, 96, 768, 1536, 8, 12, 149, mbs=1, schedule="1f1b"),
    Run("GPT-3-175B@1536", _SC21_T2, 96, 12288, 96, 1536, 1536, 8, 12, 141, mbs=1, schedule="1f1b"),
    Run("MT-NLG-530B@2240", _MTNLG, 105, 20480, 128, 2240, 1920, 8, 35, 126, mbs=1, zero=1,
        reduce_after_backward=True),
    Run("MT-NLG-530B@2800", _MTNLG, 105, 20480, 128, 2800, 1920, 8, 35, 121, mbs=1, zero=1,
        reduce_after_backward=True),
    Run("MT-NLG-530B@3360", _MTNLG, 105, 20480, 128, 3360, 1920, 8, 35, 113, mbs=1, zero=1,
        reduce_after_backward=True),
    # Jean Zay's A100 nodes: 4 Omni-Path links of 100 Gb/s per node of 8 GPUs (BLOOM paper, hardware section)
    Run("BLOOM-176B", "BLOOM, BigScience 2022 (about 150 TFLOP/s)", 70, 14336, 112, 384, 2048, 4, 12, 150,
        vocab=250880, mbs=2, zero=1, dropout=0.0, node_link_gbps=400, reduce_after_backward=True),
    # the same run on transformers' BLOOM (ALiBi, a norm after the embedding), from BigScience's published config
    Run("BLOOM-176B-hf", "BLOOM, BigScience 2022 (about 150 TFLOP/s)", 70, 14336, 112, 384, 2048, 4, 12, 150,
        vocab=250880, mbs=2, zero=1, dropout=0.0, node_link_gbps=400, reduce_after_backward=True, hf="bloom-176b",
        megatron=True),
    *(Run(f"MCore-{size}@{gpus}", _MCORE, layers, hidden, heads, gpus, batch, tp, pp, tflops, vocab=131072, seq=4096,
          gpu="H100-80G", core=True)
      for size, heads, hidden, layers, tp, pp, gpus, batch, tflops in (
          ("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8), ("7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9),
          ("16B", 48, 6144, 32, 4, 1, 192, 192, 489.1), ("32B", 56, 7168, 48, 8, 1, 384, 192, 459.6),
          ("70B", 64, 8192, 84, 8, 2, 768, 384, 419.7), ("119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5),
          ("177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8), ("314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4),
          ("462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9))),
    # Meta's H100 clusters, 8192 tokens a sequence, 16M tokens a step (the 128K-token stage splits the
    # sequence over 16 ranks, which polyshard does not, and is left out)
    Run("Llama-3-405B@8192", _LLAMA3, 126, 16384, 128, 8192, 2048, 8, 16, 430, vocab=128256, seq=8192,
        hf="llama-3.1-405b", gpu="H100-80G"),
    Run("Llama-3-405B@16384", _LLAMA3, 126, 16384, 128, 16384, 2048, 8, 16, 400, vocab=128256, seq=8192,
        hf="llama-3.1-405b", gpu="H100-80G"),
    # torchtitan's "selective op" checkpointing reruns the pointwise ops and every second product by a weight,
    # keeping the attention's output: polyshard's alternate
    Run("Llama-3-8B@64", _TITAN, 32, 4096, 32, 64, 64, 1, 1, 181.6, vocab=128256, seq=8192, mbs=1, zero=3,
        recompute="alternate", hf="llama-3-8b"),
    # its "selective layer" checkpointing reruns every second layer whole: polyshard's half
    Run("Llama-3-8B-layer@64", _TITAN, 32, 4096, 32, 64, 64, 1, 1, 177.2, vocab=128256, seq=8192, mbs=1, zero=3,
        recompute="half", hf="llama-3-8b"),
    Run("Llama-3-70B@64", _TITAN, 80, 8192, 64, 64, 64, 1, 1, 161.4, vocab=128256, seq=8192, mbs=1, zero=3,
        recompute="full", hf="llama-3-70b"),
    Run("Llama-2-13B@64", _TITAN2, 40, 5120, 40, 64, 128, 1, 1, 190.6, vocab=32000, seq=4096, mbs=2, zero=3,
        recompute="none", hf="llama-2-13b"),
    Run("Llama-2-13B-op@64", _TITAN2, 40, 5120, 40, 64, 128, 1, 1, 167.9, vocab=32000, seq=4096, mbs=2, zero=3,
        recompute="alternate", hf="llama-2-13b"),
    Run("Llama-2-13B-layer@64", _TITAN2, 40, 5120, 40, 64, 128, 1, 1, 168.8, vocab=32000, seq=4096, mbs=2, zero=3,
        recompute="half", hf="llama-2-13b"),
    Run("Llama-2-70B@64", _TITAN2, 80, 8192, 64, 64, 128, 1, 1, 157.5, vocab=32000, seq=4096, mbs=2, zero=3,
        recompute="full", hf="llama-2-70b"),
    Run("Llama-2-70B-op@64", _TITAN2, 80, 8192, 64, 64, 64, 1, 1, 158.5, vocab=32000, seq=4096, mbs=1, zero=3,
        recompute="alternate", hf="llama-2-70b"),
)
# runs the source reports out of memory (no throughput): torchtitan's Llama 2 70B with selective op and with
# selective layer checkpointing, two sequences a GPU ("OOM" in the same table, which then ran selective op with one)
OUT_OF_MEMORY = (
    Run("Llama-2-70B-op-mbs2@64", _TITAN2, 80, 8192, 64, 64, 128, 1, 1, 0.0, vocab=32000, seq=4096, mbs=2, zero=3,
        recompute="alternate", hf="llama-2-70b"),
    Run("Llama-2-70B-layer-mbs2@64", _TITAN2, 80, 8192, 64, 64, 128, 1, 1, 0.0, vocab=32000, seq=4096, mbs=2,
        zero=3, recompute="half", hf="llama-2-70b"),
)


def price(run: Run, fixed: Fixed, limit_bytes: float | None = None,
          reserve_bytes: float | None = None) -> tuple[dict, float]:
    """The search's best candidate under ``fixed`` (and ``limit_bytes`` per device, default the GPU's less
    ``reserve_bytes``, default the planner's reserve) as a report row, and the seconds the search took (from a clean
    heap: freeing the plan before is not this plan's time, and a ``polyshard plan`` run never pays it)."""
    gc.collect()
    start = time.perf_counter()
    model = models.build(run.model(), device="meta", seq_len=run.seq if run.hf else None)
    cluster = Cluster.preset(f"{run.gpus // 8}x8x{run.gpu}")
    if run.node_link_gbps:  # the preset's efficiency share and latency, this machine's line rate per GPU
        share = cluster.inter_node.bandwidth_bytes_per_s / 25e9
        cluster = dataclasses.replace(cluster, inter_node=dataclasses.replace(
            cluster.inter_node, bandwidth_bytes_per_s=share * run.node_link_gbps / 8 / 8 * 1e9))
    # a transformers model's stages may begin where its own pipeline plan allows (its embedding, final norm,
    # head): Llama 3's first chunk holds only the embedding, its last only the head and loss (Dubey et al., 3.3.2)
    plan, _ = search(model, model.example_inputs(1), cluster, run.batch, limit_bytes, fixed=fixed,
                     reserve_bytes=reserve_bytes, pp_plan=bool(run.hf) and not run.megatron)
    return chosen_row(plan.report), time.perf_counter() - start


def host_seconds(additions: int = 10**7) -> float:
    """Seconds this host takes for ``additions`` Python integer additions in a loop at module level (as
    ``python -c "s = 0\nfor i in range(10**7): s += i"`` runs it): planning is Python, so its times scale with this,
    and a row's planning time is read against it (on a shared machine it drifts within a run)."""
    start = time.perf_counter()
    exec("s = 0\nfor i in range(n): s += i", {"n": additions})  # names global, as at a module's top level
    return time.perf_counter() - start


def why_faster(pick: dict, published: dict) -> str:
    """The term that differs most between two candidates, in the published one's favour or not."""
    terms = ("compute_s", "op_comm_s", "dp_comm_s", "p2p_s", "bubble_s", "skew_s")
    gains = {t.removesuffix("_s"): published[t] - pick[t] for t in terms}
    term = max(gains, key=gains.get)
    return f"{term} -{gains[term]:.2f}s" if gains[term] > 0 else "same"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="", help="comma-separated row names (default: all)")
    p.add_argument("--json", action="store_true", help="also print one JSON line per row")
    p.add_argument("--repeats", type=int, default=1, help="plan each pick this many times; plan s is the fastest")
    args = p.parse_args(argv)
    names = set(filter(None, args.rows.split(",")))
    rows = [r for r in RUNS if not names or r.name in names]
    print(f"{'run':<20} {'GPUs':>5} {'published config':<26} {'reported':>8} {'pred':>6} {'err':>6}   "
          f"{'pick':<44} {'pred':>6} {'vs pub':>7} {'why':<18} {'plan s':>6}")
    results, host_before = [], host_seconds()
    for run in rows:
        try:
            published, _ = price(run, run.published())
            reserved = True
        except PolyshardError:  # it ran, so it held the GPU: priced without the reserve the planner keeps for itself
            published, _ = price(run, run.published(), reserve_bytes=0)
            reserved = False
        pick, seconds = price(run, Fixed())
        for _ in range(args.repeats - 1):  # on a shared machine the fastest is the least disturbed
            seconds = min(seconds, price(run, Fixed())[1])
        flops = run.flops_per_step() / run.gpus / 1e12
        pub_tflops, pick_tflops = flops / published["step_s"], flops / pick["step_s"]
        err = pub_tflops / run.tflops - 1
        row = {"run": run.name, "source": run.source, "gpus": run.gpus, "reported_tflops": run.tflops,
               "published_fixed": run.published().text(),  # `polyshard cost --config` prices the row from it
               "published_config": published["config"], "published_tflops": round(pub_tflops, 1),
               "published_error": round(err, 3), "pick_config": pick["config"], "pick_tflops": round(pick_tflops, 1),
               "pick_speedup": round(published["step_s"] / pick["step_s"], 3), "why": why_faster(pick, published),
               "planning_s": round(seconds, 2), "published_within_reserve": reserved}
        results.append(row)
        short = f"dp={run.dp},tp={run.tp},pp={run.pp}" + f",zero={run.zero}" * (run.zero > 0)
        print(f"{run.name:<20} {run.gpus:>5} {short:<26} {run.tflops:>8.0f} {pub_tflops:>6.0f} {err:>+6.0%}   "
              f"{pick['brief'][:44]:<44} {pick_tflops:>6.0f} {row['pick_speedup']:>6.2f}x {row['why']:<18} "
              f"{seconds:>6.1f}", flush=True)
        if not reserved:
            print(f"{'':<20} the published configuration needs more than the planner's limit: priced under the whole "
                  "GPU", flush=True)
        if args.json:
            print(json.dumps(row), flush=True)
    ok_pick = sum(r["pick_speedup"] >= 1 - 1e-9 for r in results)
    ok_err = sum(abs(r["published_error"]) <= ERROR_GOAL for r in results)
    ok_time = sum(r["planning_s"] < PLANNING_GOAL_S for r in results)
    n = len(results)
    if n:
        print(f"pick no slower than published: {ok_pick}/{n}; published predicted within {ERROR_GOAL:.0%} of reported: "
              f"{ok_err}/{n} (median |error| {sorted(abs(r['published_error']) for r in results)[n // 2]:.1%}); "
              f"planned in < {PLANNING_GOAL_S:.0f} s: {ok_time}/{n}")
        host_after = host_seconds()
        print(f"host: 10^7 Python additions in {host_before:.2f} s before the rows, {host_after:.2f} s after")
        if args.json:
            print(json.dumps({"host_additions_s": [round(host_before, 2), round(host_after, 2)]}), flush=True)
    for run in (r for r in OUT_OF_MEMORY if not names or r.name in names):
        needed = price(run, run.published(), math.inf)[0]["memory"]["total"]
        memory = Cluster.preset(f"1x8x{run.gpu}").memory_bytes
        row = {"run": run.name, "source": run.source, "out_of_memory": True, "published_fixed": run.published().text(),
               "needs_bytes": needed, "gpu_bytes": memory, "agrees": needed > memory}
        print(f"reported out of memory: {run.name}: the model needs {needed / 2**30:.1f} GiB a GPU of "
              f"{memory / 2**30:.0f} GiB: {'agrees' if row['agrees'] else 'DISAGREES'}", flush=True)
        if args.json:
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
