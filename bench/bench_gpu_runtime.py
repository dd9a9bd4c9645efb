"""polyshard's runtime on one GPU against plain torch on the same GPU: step time, peak memory, and the
planner's memory estimate for the plan that ran.

    python bench/bench_gpu_runtime.py            # on a CUDA machine (about a minute)

Each case trains the same GPT on the same batch two ways, alternated over ``--rounds``:
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

# (name, config, rows, precision): fp32 where the whole step fits one 80 GB device
CASES = (
    ("gpt-125m", GPTConfig(num_layers=12, hidden=768, num_heads=12, vocab_size=50304, seq_len=1024), 16, "fp32"),
    ("gpt-125m", GPTConfig(num_layers=12, hidden=768, num_heads=12, vocab_size=50304, seq_len=1024), 16, "bf16"),
    ("gpt-1.3b", GPTConfig(num_layers=24, hidden=2048, num_heads=16, vocab_size=50304, seq_len=2048), 8, "bf16"),
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


def torch_step(cfg: GPTConfig, idx: torch.Tensor, precision: str, steps: int) -> tuple[float, int]:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = model(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return timed(step, steps)


def polyshard_step(cfg: GPTConfig, idx: torch.Tensor, precision: str, steps: int) -> tuple[float, int, int]:
    """Seconds, peak bytes and the planner's estimate for the plan ``parallelize`` made."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(cfg)
    pm = ps.parallelize(model, (idx, idx), settings={"precision": precision})
    with torch.device("meta"):
        meta = GPT(cfg)
    estimate = estimate_memory(capture(meta, (idx.cpu(), idx.cpu())), pm.plan).total_bytes
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
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu_runtime needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 in both ways
    ps.init()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| model | rows x seq | precision | torch ms | polyshard ms | ratio | torch peak | polyshard peak | "
          "estimate | estimate / peak |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, cfg, rows, precision in CASES:
        idx = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len), generator=torch.Generator().manual_seed(0)).cuda()
        plain, ours = [], []
        for _ in range(args.rounds):
            plain.append(torch_step(cfg, idx, precision, args.steps))
            _release()
            ours.append(polyshard_step(cfg, idx, precision, args.steps))
            _release()
        t_s, t_peak = min(s for s, _ in plain), max(b for _, b in plain)
        p_s, p_peak, estimate = min(s for s, _, _ in ours), max(b for _, b, _ in ours), ours[0][2]
        print(f"| {name} | {rows} x {cfg.seq_len} | {precision} | {t_s * 1e3:.1f} | {p_s * 1e3:.1f} | "
              f"{p_s / t_s:.3f} | {format_bytes(t_peak)} | {format_bytes(p_peak)} | {format_bytes(estimate)} | "
              f"{estimate / p_peak:.3f} |", flush=True)
        print(json.dumps({"bench": "gpu_runtime", "model": name, "rows": rows, "seq": cfg.seq_len,
                          "precision": precision, "torch_s": [s for s, _ in plain],
                          "polyshard_s": [s for s, _, _ in ours],
                          "torch_peak": t_peak, "polyshard_peak": p_peak, "estimate_bytes": estimate}), flush=True)


if __name__ == "__main__":
    main()
