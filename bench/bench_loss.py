"""The loss's price against its measured time: cross-entropy's forward and backward over logits of a few shapes.

    polyshard calibrate --nproc 1 --out cluster.yaml          # this device's rates, once
    python bench/bench_loss.py --cluster cluster.yaml         # under a minute on a CPU

For each (rows, classes) the cost model prices the captured `F.cross_entropy` node as the planner does (its
training compute and fixed cost on the calibrated cluster); the same loss is then timed forward and backward
on real logits (one thread, the quickest of --repeats after a warm-up), beside a copy of the logits timed in
the same run as the baseline. Printed per shape: predicted and measured ms, measured over predicted (near 1:
the loss is priced as it runs), and the measured time in copies of the logits.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from polyshard.calibrate import _times
from polyshard.cluster import Cluster
from polyshard.graph.capture import capture
from polyshard.planner.cost.overlap import op_costs
from polyshard.planner.propagate import propagate

SHAPES = ((2048, 256), (2048, 32000), (1024, 131072))


class Loss(nn.Module):
    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, target)


def predicted_s(rows: int, classes: int, cluster: Cluster) -> float:
    """The planner's training seconds of the loss on one device in fp32: compute and fixed cost."""
    gm = capture(Loss(), (torch.empty(rows, classes, device="meta"), torch.zeros(rows, dtype=torch.long,
                                                                               device="meta")))
    plan = propagate(gm, (), lambda msg: None)
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
    print(f"{'rows':>6} {'classes':>8} {'predicted ms':>13} {'measured ms':>12} {'measured / predicted':>21} "
          f"{'copies':>7}")
    for rows, classes in SHAPES:
        logits = torch.randn(rows, classes, requires_grad=True)
        target = torch.randint(0, classes, (rows,), generator=torch.Generator().manual_seed(0))
        copy = torch.empty_like(logits)
        measured = quickest_s(lambda: F.cross_entropy(logits, target).backward(), args.repeats)
        copied = quickest_s(lambda: copy.copy_(logits.detach()), args.repeats)
        predicted = predicted_s(rows, classes, cluster)
        print(f"{rows:>6} {classes:>8} {predicted * 1e3:>13.1f} {measured * 1e3:>12.1f} {measured / predicted:>21.1f} "
              f"{measured / copied:>7.1f}", flush=True)


if __name__ == "__main__":
    main()
