"""transformers models under polyshard: capture and planning time at real size, tp throughput vs torch.

    python bench/bench_hf.py plan [--repeats 3]              # Llama-3-70B (meta) vs polyshard's GPT of its size
    torchrun --nproc-per-node 2 bench/bench_hf.py tp         # a small HF Llama: polyshard tp=2 vs parallelize_module

``plan``: seconds to capture hf:llama-3-70b on the meta device (torch.export) and to plan the captured graph
on 64 and 1024 A100s, beside the same for polyshard's own GPT of its size (Llama-3-70B's layers, width, heads
and vocabulary, captured by torch.fx); the ratio is HF / GPT planning time, measured in one run. With
``--repeats N`` each model is built, captured and planned N times, the two alternating, and the fastest
first search of each is kept (a shared machine's stalls only ever add time).

``tp``: the same small Llama (same seed and weights, same batches, AdamW) trained with polyshard
(``ps.parallelize`` on tp=N, the model called as written) and with torch's ``parallelize_module``
driven by the model's own tensor-parallel plan, ``_tp_plan`` (q/k/v, gate and up colwise, o and
down rowwise, the embedding split over the vocabulary, lm_head colwise with its output gathered).
Timed in alternating blocks (ABBA) over rounds; the figure per system is the median tokens/s,
ratio = polyshard / torch, paired = median of per-round ratios.
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

from polyshard.cluster import Cluster  # noqa: E402
from polyshard.graph.capture import capture  # noqa: E402
from polyshard import models  # noqa: E402
from polyshard.models import hf  # noqa: E402
from polyshard.planner.search import search  # noqa: E402

# Llama-3-70B's layers, width, heads and vocabulary; its gated MLP has three matrices to the GPT's two, so the
# GPT's FFN is widened to give the same size: 69.5 B parameters against 70.6 B (the GPT ties its embedding)
GPT_OF_LLAMA_70B = "gpt:layers=80,hidden=8192,heads=64,ffn=35840,vocab=128256,seq=2048"
SMALL_LLAMA = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=4, max_position_embeddings=128)
LR = 1e-3


def plan_times(devices: list[int], repeats: int) -> None:
    rows = {}  # (model, devices) -> the row of its fastest first search
    for _ in range(repeats):  # the models alternate, each built and captured afresh, so every search is a first
        for name in ("hf:llama-3-70b", GPT_OF_LLAMA_70B):
            t0 = time.perf_counter()
            model = models.build(name, device="meta", seq_len=2048)
            example = model.example_inputs(1)
            built = time.perf_counter()
            graph = capture(model, example)
            captured = time.perf_counter()
            for n in devices:
                start = time.perf_counter()
                plan, _ = search(model, example, Cluster.load(f"{n // 8}x8xA100-80G"), n, graph=graph)
                row = {"model": name, "devices": n,
                       "params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 1),
                       "nodes": len(graph.graph.nodes), "build_s": round(built - t0, 2),
                       "capture_s": round(captured - built, 2), "plan_s": round(time.perf_counter() - start, 2),
                       "pick": plan.report["config"]}
                if (name, n) not in rows or row["plan_s"] < rows[name, n]["plan_s"]:
                    rows[name, n] = row
    for r in rows.values():
        print(f"| {r['model']} | {r['devices']} | {r['capture_s']:.1f} s | {r['plan_s']:.1f} s | {r['pick']} |")
    for n in devices:
        a, b = rows["hf:llama-3-70b", n], rows[GPT_OF_LLAMA_70B, n]
        print(json.dumps({"bench": "hf-plan", "devices": n, "repeats": repeats, "hf": a, "gpt": b,
                          "plan_ratio": round(a["plan_s"] / b["plan_s"], 3)}))


def tp_throughput(args) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import polyshard as ps

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    ps.init(f"tp={world}")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": (ids := torch.randint(0, 256, (args.batch, args.seq), generator=g)), "labels": ids}
               for _ in range(4)]

    def fresh():
        torch.manual_seed(0)
        return hf.build("llama", **SMALL_LLAMA)

    ours = ps.parallelize(fresh(), example_inputs=batches[0], search=args.search)
    theirs = fresh()
    styles = {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel(),
              "colwise_gather_output": ColwiseParallel(output_layouts=Replicate()),
              "embedding_rowwise": RowwiseParallel(input_layouts=Replicate())}
    plan = {k: styles[v] for k, v in theirs._tp_plan.items()}  # the model's own plan, base and head
    theirs = parallelize_module(theirs, init_device_mesh("cpu", (world,)), plan)
    systems = {"polyshard": (ours, torch.optim.AdamW(ours.parameters(), lr=LR)),
               "torch parallelize_module": (theirs, torch.optim.AdamW(theirs.parameters(), lr=LR))}

    def step(name: str, i: int) -> float:
        model, opt = systems[name]
        loss = model(**batches[i % len(batches)]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    first = {name: [step(name, i) for i in range(args.warmup)] for name in systems}
    times = {name: [] for name in systems}
    for r in range(args.rounds):
        order = list(systems) if r % 2 == 0 else list(systems)[::-1]
        spent = dict.fromkeys(systems, 0.0)
        for k in range(0, args.steps, args.block):
            for name in order:
                dist.barrier()
                t0 = time.perf_counter()
                for i in range(k, min(k + args.block, args.steps)):
                    step(name, i)
                dist.barrier()
                spent[name] += time.perf_counter() - t0
            order = order[::-1]
        for name in systems:
            times[name].append(args.steps * args.batch * args.seq / spent[name])
    med = {n: statistics.median(v) for n, v in times.items()}
    a, b = list(systems)
    paired = statistics.median(x / y for x, y in zip(times[a], times[b]))
    if rank == 0:
        print(f"warm-up losses: polyshard {first[a][0]:.6f} / {first[a][-1]:.6f}, "
              f"torch {first[b][0]:.6f} / {first[b][-1]:.6f}")
        print(f"| tiny HF Llama | tp={world} | {med[a]:,.0f} | {med[b]:,.0f} | {med[a] / med[b]:.3f} | "
              f"paired {paired:.3f} |")
        print(json.dumps({"bench": "hf-tp", "ranks": world, "batch": args.batch, "seq": args.seq,
                          "polyshard_tok_s": round(med[a], 1), "baseline_tok_s": round(med[b], 1),
                          "ratio": round(med[a] / med[b], 4), "paired_ratio": round(paired, 4),
                          "first_loss": {"polyshard": first[a][0], "baseline": first[b][0]}}))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=("plan", "tp"), help="plan: capture and planning time; tp: throughput")
    p.add_argument("--devices", default="64,1024", help="cluster sizes to plan for (plan; default 64,1024)")
    p.add_argument("--repeats", type=int, default=1,
                   help="first searches per model and size, the fastest kept (plan; default 1)")
    p.add_argument("--batch", type=int, default=8, help="rows per step (tp; default 8)")
    p.add_argument("--seq", type=int, default=128, help="tokens per row (tp; default 128)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per system (tp; default 3)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per system per round (tp; default 8)")
    p.add_argument("--block", type=int, default=2, help="steps per turn within a round (tp; default 2)")
    p.add_argument("--rounds", type=int, default=5, help="rounds (tp; default 5)")
    p.add_argument("--search", action="store_true", help="polyshard plans by its cost model instead of its rules (tp)")
    args = p.parse_args()
    if args.part == "plan":
        plan_times([int(n) for n in args.devices.split(",")], args.repeats)
    else:
        tp_throughput(args)


if __name__ == "__main__":
    main()
