"""polyshard's runtime on one GPU against plain torch on the same GPU: step time, peak memory, and the
planner's memory estimate for the plan that ran.

    python bench/bench_gpu_runtime.py            # on a CUDA machine (about two minutes)

Each case trains the same model (polyshard's GPT, or a Llama as transformers builds it) on the same batch two
ways, alternated over ``--rounds``:
- torch: the model as written, AdamW (fused), bf16 autocast for bf16 (fp32 weights), plain fp32 otherwise;
- polyshard: ``ps.parallelize`` on a world of one (NCCL), its plan's precision, and the optimizer
  ``polyshard train`` builds for it (bf16: half-precision weights stepped through fp32 masters).
Times are CUDA-event medians of ``--steps`` steps after two warm-ups; peaks are
``torch.cuda.max_memory_allocated`` over those steps. ratio = polyshard / torch.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile

import torch

import polyshard as ps
from polyshard.cluster import format_bytes
from polyshard.graph.capture import capture
from polyshard.models.gpt import GPT, GPTConfig
from polyshard.planner.cost.memory import estimate_memory
from polyshard.train.trainer import make_optimizer, train_step

GPT_125M = GPTConfig(num_layers=12, hidden=768, num_heads=12, vocab_size=50304, seq_len=1024)
GPT_1_3B = GPTConfig(num_layers=24, hidden=2048, num_heads=16, vocab_size=50304, seq_len=2048)
# TinyLlama-1.1B's shape (grouped-query attention, 4 key/value heads), as transformers builds a Llama
LLAMA_1_1B = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
              "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048}


def gpt(cfg: GPTConfig):
    def build(device):
        with torch.device(device):
            return GPT(cfg)
    return build


def llama(overrides: dict, seq: int):
    from polyshard.models import hf

    return lambda device: hf.CausalLM(hf.build("llama", device=device, **overrides), seq)


# (name, build(device) -> (ids, next ids) -> loss, rows, seq, precision): fp32 where the step fits 80 GB
CASES = (
    ("gpt-125m", gpt(GPT_125M), 16, 1024, "fp32"),
    ("gpt-125m", gpt(GPT_125M), 16, 1024, "bf16"),
    ("gpt-1.3b", gpt(GPT_1_3B), 8, 2048, "bf16"),
    ("hf llama-1.1b", llama(LLAMA_1_1B, 2048), 8, 2048, "bf16"),
)


def timed(step, steps: int) -> tuple[float, int]:
    """Median seconds of ``step`` after two warm-ups, and the peak bytes allocated while it ran."""
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times), torch.cuda.max_memory_allocated()


def torch_step(build, idx: torch.Tensor, precision: str, steps: int) -> tuple[float, int]:
    torch.manual_seed(0)
    model = build("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = model(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return timed(step, steps)


def polyshard_step(build, idx: torch.Tensor, precision: str, steps: int) -> tuple[float, int, int]:
    """Seconds, peak bytes and the planner's estimate for the plan ``parallelize`` made."""
    torch.manual_seed(0)
    pm = ps.parallelize(build("cuda"), (idx, idx), settings={"precision": precision})
    meta = build("meta")
    estimate = estimate_memory(capture(meta, (idx.to("meta"), idx.to("meta"))), pm.plan).total_bytes
    with tempfile.TemporaryDirectory() as scratch:
        opt = make_optimizer(pm, 1e-4, scratch)
        seconds, peak = timed(lambda: train_step(pm, opt, idx, idx), steps)
    return seconds, peak, estimate


def _release() -> None:
    """Free the last way's model before the next is measured: its hooks hold it in reference cycles."""
    gc.collect()
    torch.cuda.empty_cache()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="timed steps per case, way and round")
    p.add_argument("--rounds", type=int, default=2, help="rounds, the two ways alternated in each")
    p.add_argument("--cases", default="", help="comma-separated case names to run (default: all)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu_runtime needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 in both ways
    ps.init()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| model | rows x seq | precision | torch ms | polyshard ms | ratio | torch peak | polyshard peak | "
          "estimate | estimate / peak |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, build, rows, seq, precision in CASES:
        if args.cases and name not in args.cases.split(","):
            continue
        vocab = build("meta").cfg.vocab_size
        idx = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(0)).cuda()
        plain, ours = [], []
        for _ in range(args.rounds):
            plain.append(torch_step(build, idx, precision, args.steps))
            _release()
            ours.append(polyshard_step(build, idx, precision, args.steps))
            _release()
        t_s, t_peak = min(s for s, _ in plain), max(b for _, b in plain)
        p_s, p_peak, estimate = min(s for s, _, _ in ours), max(b for _, b, _ in ours), ours[0][2]
        print(f"| {name} | {rows} x {seq} | {precision} | {t_s * 1e3:.1f} | {p_s * 1e3:.1f} | "
              f"{p_s / t_s:.3f} | {format_bytes(t_peak)} | {format_bytes(p_peak)} | {format_bytes(estimate)} | "
              f"{estimate / p_peak:.3f} |", flush=True)
        print(json.dumps({"bench": "gpu_runtime", "model": name, "rows": rows, "seq": seq,
                          "precision": precision, "torch_s": [s for s, _ in plain],
                          "polyshard_s": [s for s, _, _ in ours],
                          "torch_peak": t_peak, "polyshard_peak": p_peak, "estimate_bytes": estimate}), flush=True)


if __name__ == "__main__":
    main()
