"""Whether the fixed cost per op that `polyshard calibrate` times on its tiny GPT holds for other models' graphs.

    torchrun --nproc-per-node 4 bench/bench_op_overhead.py          # 4 ranks sharing the cores, as in training
    torchrun --nproc-per-node 1 bench/bench_op_overhead.py --models gpt-tiny,hf:llama --repeats 30

On a CPU a small model's step is almost all fixed costs, which the planner prices as one calibrated figure per op
it charges. Every model here is timed as the calibration times gpt-tiny (forward and backward of one tiny batch,
every rank at once from a barrier, the models taking turns batch by batch; the slowest rank's median), and its
step time is divided by the ops the cost model charges for its captured graph. Rank 0 prints each model's figure
and its ratio to gpt-tiny's, the baseline measured in the same run: near 1, the calibration transfers.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from polyshard import models
from polyshard.calibrate import measure_step_overheads
from polyshard.graph.capture import capture
from polyshard.graph.ops import calls_of

BASELINE = "gpt-tiny"


def charged_ops(name: str) -> tuple[int, int]:
    """(graph ops, ops the cost model charges a fixed cost for) of ``name``'s captured graph."""
    model = models.build(name, seed=0)
    calls = [n for n in capture(model, model.example_inputs(1)).graph.nodes if n.op.startswith("call_")]
    return len(calls), sum(calls_of(n) for n in calls)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="hf:gpt2,hf:llama,hf:qwen2,hf:mistral,hf:opt,hf:gpt_neox",
                   help=f"comma-separated models compared with {BASELINE} (polyshard's names, hf:FAMILY)")
    p.add_argument("--repeats", type=int, default=15, help="timed batches of 20 steps per model (median kept)")
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    names = [BASELINE] + [m for m in args.models.split(",") if m and m != BASELINE]
    per_graph_op = torch.tensor(measure_step_overheads(("float32",), args.repeats, names=names), dtype=torch.float64)
    dist.all_reduce(per_graph_op, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        rows = []
        for name, per_op in zip(names, per_graph_op.tolist()):
            graph_ops, charged = charged_ops(name)
            rows.append((name, graph_ops, charged, per_op * graph_ops, per_op * graph_ops / charged))
        base_graph, base = rows[0][3] / rows[0][1], rows[0][4]
        print(f"{dist.get_world_size()} ranks, torch {torch.__version__}; fixed cost per charged op against "
              f"{BASELINE}'s (the calibration's figure)")
        print("| model | graph ops | ops charged | step ms | us per graph op | vs gpt-tiny | us per charged op | "
              "vs gpt-tiny |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for name, graph_ops, charged, step, per_charged in rows:
            per_graph = step / graph_ops
            print(f"| {name} | {graph_ops} | {charged} | {step * 1e3:.2f} | {per_graph * 1e6:.1f} | "
                  f"{per_graph / base_graph:.2f} | {per_charged * 1e6:.1f} | {per_charged / base:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
