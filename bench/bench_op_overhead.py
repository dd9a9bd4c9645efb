"""Whether the fixed cost per op that `polyshard calibrate` times on its tiny GPT holds for other models' graphs.

    torchrun --nproc-per-node 4 bench/bench_op_overhead.py          # 4 ranks sharing the cores, as in training
    torchrun --nproc-per-node 1 bench/bench_op_overhead.py --models gpt-tiny,hf:llama --repeats 30

On a CPU a small model's step is almost all fixed costs, which the planner prices as one calibrated figure per op
it charges. Every model here is timed as the calibration times gpt-tiny (forward and backward of one tiny batch,
every rank at once from a barrier, the models taking turns batch by batch; the slowest rank's median), and its
step time is divided by the ops of its captured graph, each of which the cost model charges that figure. Rank 0
prints each model's figure and its ratio to gpt-tiny's, the baseline measured in the same run: near 1, the
calibration transfers.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from polyshard import models
from polyshard.calibrate import measure_step_overheads
from polyshard.graph.capture import capture

BASELINE = "gpt-tiny"


def graph_ops(name: str) -> int:
    """Ops of ``name``'s captured graph: module calls (a Linear, a norm) and functions alike."""
    model = models.build(name, seed=0)
    return sum(n.op.startswith("call_") for n in capture(model, model.example_inputs(1)).graph.nodes)


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
        base = per_graph_op[0].item()
        print(f"{dist.get_world_size()} ranks, torch {torch.__version__}; fixed cost per op against {BASELINE}'s "
              "(the calibration's figure)")
        print("| model | graph ops | step ms | us per op | vs gpt-tiny |")
        print("|---|---:|---:|---:|---:|")
        for name, per_op in zip(names, per_graph_op.tolist()):
            ops = graph_ops(name)
            print(f"| {name} | {ops} | {per_op * ops * 1e3:.2f} | {per_op * 1e6:.1f} | {per_op / base:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
