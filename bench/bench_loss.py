"""The loss's price against its measured time: cross-entropy's forward and backward over logits of a few shapes.

    polyshard calibrate --nproc 1 --out cluster.yaml          # this device's rates, once
    python bench/bench_loss.py --cluster cluster.yaml         # under a minute on a CPU

For each (rows, classes) and each implementation the runtime runs (torch's `F.cross_entropy`; the
vocabulary-parallel loss, here on a group of this process alone) the cost model prices the captured node as the
planner does (its training compute and fixed cost on the calibrated cluster); the same loss is then timed forward
and backward on real logits (one thread, the quickest of --repeats after a warm-up), beside a copy of the logits
timed in the same run as the baseline. Printed per shape: predicted and measured ms, measured over predicted (near
1: the loss is priced as it runs), and the measured time in copies of the logits.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from polyshard.calibrate import _times
from polyshard.cluster import Cluster
from polyshard.compiler.ops import vocab_parallel_cross_entropy
from polyshard.graph.capture import capture
from polyshard.planner.cost.overlap import op_costs
from polyshard.planner.propagate import propagate

SHAPES = ((2048, 256), (2048, 32000), (1024, 131072))
IMPLS = ("torch", "vocab_ce")


class Loss(nn.Module):
    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, target)


def predicted_s(rows: int, classes: int, impl: str, cluster: Cluster) -> float:
    """The planner's training seconds of the loss on one device in fp32 (compute and fixed cost), run by ``impl``."""
    gm = capture(Loss(), (torch.empty(rows, classes, device="meta"), torch.zeros(rows, dtype=torch.long,
                                                                               device="meta")))
    plan = propagate(gm, (), lambda msg: None)
    if impl == "vocab_ce":
        loss = next(n.name for n in gm.graph.nodes if n.op == "call_function")
        plan = dataclasses.replace(plan, nodes={**plan.nodes, loss: dataclasses.replace(plan.nodes[loss], impl=impl)})
    return sum(c.compute_s + c.overhead_s for c in op_costs(gm, plan, cluster))


def quickest_s(run, repeats: int) -> float:
    """Seconds of ``run`` timed as the calibration times its probes (a warm-up, then ``repeats``): the quickest."""
    return min(_times(run, repeats, torch.device("cpu")))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cluster", default="cluster.yaml", help="a cluster file `polyshard calibrate --nproc 1` wrote")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per shape after one warm-up; the quickest counts")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cluster = Cluster.from_yaml(args.cluster)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    losses = {"torch": F.cross_entropy,
              "vocab_ce": functools.partial(vocab_parallel_cross_entropy, shard_index=0, group=dist.group.WORLD)}
    print(f"{'loss':>8} {'rows':>6} {'classes':>8} {'predicted ms':>13} {'measured ms':>12} "
          f"{'measured / predicted':>21} {'copies':>7}")
    for rows, classes in SHAPES:
        logits = torch.randn(rows, classes, requires_grad=True)
        target = torch.randint(0, classes, (rows,), generator=torch.Generator().manual_seed(0))
        copy = torch.empty_like(logits)
        copied = quickest_s(lambda: copy.copy_(logits.detach()), args.repeats)
        for impl in IMPLS:
            measured = quickest_s(lambda: losses[impl](logits, target).backward(), args.repeats)
            predicted = predicted_s(rows, classes, impl, cluster)
            print(f"{impl:>8} {rows:>6} {classes:>8} {predicted * 1e3:>13.1f} {measured * 1e3:>12.1f} "
                  f"{measured / predicted:>21.1f} {measured / copied:>7.1f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
