"""What one accelerator really achieves: matmul FLOP/s by shape and dtype, memory bandwidth, and
the measured training step of GPT configs on one device (to check the planner's prediction).

    python bench/bench_device.py --out device.json          # on a CUDA machine (about 2 minutes)
    python bench/bench_device.py --quick                     # a smaller sweep (CPU works too)

The matmul sweep times ``(m x k) @ (k x n)`` for every m, n, k in the grid; the planner's
achievable-rate model (``polyshard.planner.cost.compute.matmul_efficiency``) is fitted to it by
``bench/fit_device.py``. The step rows time forward + backward + AdamW of a polyshard GPT under
bf16 autocast (fp32 master weights), the way ``precision="bf16"`` trains. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from polyshard import models  # noqa: E402
from polyshard.models.gpt import GPT, GPTConfig  # noqa: E402

GRID = (256, 512, 1024, 2048, 4096, 8192, 16384)
QUICK_GRID = (256, 1024, 4096)
# (name, config, batch rows): a small and a mid-sized GPT whose step fits one 80 GB device
STEP_CASES = (
    ("gpt-125m", models.CONFIGS["gpt-125m"], 16),
    ("gpt-1.3b", GPTConfig(num_layers=24, hidden=2048, num_heads=16, vocab_size=50304, seq_len=2048), 8),
)


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_sweep(device: torch.device, grid, dtypes, repeats: int) -> list[dict]:
    rows = []
    for dtype in dtypes:
        for m in grid:
            for n in grid:
                for k in grid:
                    if m * n * k > (2**40 if device.type == "cuda" else 2**27):
                        continue
                    a = torch.randn(m, k, device=device, dtype=dtype)
                    b = torch.randn(k, n, device=device, dtype=dtype)
                    seconds = timed(lambda: torch.matmul(a, b), device, repeats)
                    rows.append({"dtype": str(dtype).removeprefix("torch."), "m": m, "n": n, "k": k,
                                 "flops_per_s": 2 * m * n * k / seconds})
    return rows


def attention_rates(device: torch.device, repeats: int) -> list[dict]:
    """FLOP/s of causal scaled_dot_product_attention, forward and forward + backward, counting the
    full 4*B*H*T*T*D of forward (as the planner counts it) and 3x that for training."""
    rows = []
    for heads, head_dim, seq, batch in ((16, 128, 2048, 8), (32, 128, 2048, 4), (8, 128, 4096, 2), (12, 64, 1024, 16)):
        q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        flops = 4 * batch * heads * seq * seq * head_dim
        fwd = timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), device, repeats)
        train = timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward(),
                      device, repeats)
        rows.append({"heads": heads, "head_dim": head_dim, "seq": seq, "batch": batch,
                     "forward_flops_per_s": flops / fwd, "train_flops_per_s": 3 * flops / train})
    return rows


def profile_step(device: torch.device) -> list[dict]:
    """Device time per op kind in one training step of the larger GPT (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    name, cfg, batch = STEP_CASES[-1]
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), device=device)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.self_device_time_total)
    return [{"op": e.key[:60], "calls": e.count, "device_ms": e.self_device_time_total / 1e3} for e in events[:40]]


def bandwidth(device: torch.device, repeats: int) -> dict:
    """Bytes per second read plus written by a copy, an add and a LayerNorm of a 512 MiB bf16 tensor."""
    n = 2**28
    x = torch.randn(n, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ln = torch.nn.LayerNorm(4096, device=device, dtype=torch.bfloat16)
    out = {}
    out["copy"] = 2 * x.nbytes / timed(lambda: y.copy_(x), device, repeats)
    out["add"] = 3 * x.nbytes / timed(lambda: torch.add(x, x, out=y), device, repeats)
    with torch.no_grad():
        out["layer_norm"] = 2 * x.nbytes / timed(lambda: ln(x.view(-1, 4096)), device, repeats)
    return out


def step_times(device: torch.device, repeats: int) -> list[dict]:
    """Seconds per training step (forward, backward, AdamW) of each GPT case under bf16 autocast."""
    rows = []
    for name, cfg, batch in STEP_CASES:
        rows.append(_step_time(name, cfg, batch, device, repeats))
        if device.type == "cuda":  # the case's model and optimizer state are gone with its frame
            torch.cuda.empty_cache()
    return rows


def _step_time(name: str, cfg, batch: int, device: torch.device, repeats: int) -> dict:
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), device=device)

    def fwd_bwd():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(idx, idx)
        loss.backward()

    def step():
        fwd_bwd()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = timed(step, device, repeats)
    return {"model": name, "layers": cfg.num_layers, "hidden": cfg.hidden, "heads": cfg.num_heads,
            "vocab": cfg.vocab_size, "seq": cfg.seq_len, "batch": batch, "step_s": seconds,
            "fwd_bwd_s": timed(fwd_bwd, device, repeats),
            "peak_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="", help="also write the JSON here")
    p.add_argument("--quick", action="store_true", help="a 3-value grid and no step rows")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32: tf32 is a precision of its own
    grid = QUICK_GRID if args.quick else GRID
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__,
              "matmul": matmul_sweep(device, grid, (torch.bfloat16, torch.float32), args.repeats),
              "bandwidth_bytes_per_s": bandwidth(device, args.repeats),
              "attention": attention_rates(device, args.repeats) if device.type == "cuda" else [],
              "steps": [] if args.quick else step_times(device, args.repeats),
              "profile": profile_step(device) if device.type == "cuda" and not args.quick else []}
    text = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(json.dumps({k: v for k, v in result.items() if k != "matmul"}, indent=1))
    peak = max((r for r in result["matmul"] if r["dtype"] == "bfloat16"), key=lambda r: r["flops_per_s"])
    print(f"best bf16 matmul: {peak['flops_per_s'] / 1e12:.0f} TFLOP/s at m=n=k={peak['m']},{peak['n']},{peak['k']}")


if __name__ == "__main__":
    main()
