"""Spatial parallel: activation memory per rank and step time of images split by height and width,
against one rank training the same model on the same whole images.

    torchrun --nproc-per-node 4 bench/bench_spatial.py                      # UNet, 256 x 256, h=2 x w=2
    torchrun --nproc-per-node 4 bench/bench_spatial.py --model resnet --image-size 512

Every rank trains its tile (``ps.parallelize(..., dataset_strategy=...)``); rank 0 also trains the plain
model on the whole images, alone, while the others wait. Memory is torch's MemTracker over one step after
a warm-up step (polyshard.runtime.memory_probe): the activations at the peak. The goal is a rank's
activations within 10% of a quarter of one rank's plus the halo, here the share of a tile the halos add
to the convolutions' inputs. Step times are medians over ``--steps`` steps (fp32, AdamW).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import polyshard as ps  # noqa: E402
from polyshard.halo import pair  # noqa: E402
from polyshard.models.resnet import ResNet  # noqa: E402
from polyshard.models.unet import UNet  # noqa: E402
from polyshard.runtime.memory_probe import step_peak_bytes  # noqa: E402


def _batch(args, seed: int):
    g = torch.Generator().manual_seed(seed)
    labels = (args.batch,) if args.model == "resnet" else (args.batch, args.image_size, args.image_size)
    return (torch.randn(args.batch, 3, args.image_size, args.image_size, generator=g),
            torch.randint(0, 3, labels, generator=g))


def _step_seconds(model, opt, batch, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        model(*batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _halo_share(pm) -> float:
    """How much larger the convolutions' inputs are with their halos than the tiles, weighted by size."""
    grown = plain = 0.0
    for module in pm._single_copy.modules():
        for s in getattr(module, "splits", ()):
            tile = s.out * pair(module.module.stride)[s.dim - 2]
            plain += tile
            grown += tile + max(s.lo, 0) + max(s.hi, 0)
    return grown / plain - 1 if plain else 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("unet", "resnet"), default="unet", help="network (default unet)")
    p.add_argument("--image-size", type=int, default=256, help="image height and width (default 256)")
    p.add_argument("--batch", type=int, default=2, help="images per step (default 2)")
    p.add_argument("--mesh", default="h=2,w=2", help="mesh of the spatial run (default h=2,w=2)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per run (default 5)")
    args = p.parse_args()
    ps.init(args.mesh)
    mesh = ps.current_mesh()
    strategy = tuple(1 if d < 2 else dict(mesh.axes).get("hw"[d - 2], 1) for d in range(4))
    build = lambda: (ResNet if args.model == "resnet" else UNet)(image_size=args.image_size)  # noqa: E731
    torch.manual_seed(0)
    model = build()
    batch = _batch(args, 0)
    masks = None if args.model == "resnet" else strategy[:1] + strategy[2:]
    rows = args.batch // mesh.num_data_shards
    pm = ps.parallelize(model, example_inputs=tuple(t[:rows] for t in batch), dataset_strategy=(strategy, masks))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    local = pm.local_batch(*batch)
    split_peak = step_peak_bytes(pm, opt, local)
    split_s = _step_seconds(pm, opt, local, args.steps)
    dist.barrier()
    row = None
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        whole = build()
        whole_opt = torch.optim.AdamW(whole.parameters(), lr=1e-3)
        whole_peak = step_peak_bytes(whole, whole_opt, batch)
        whole_s = _step_seconds(whole, whole_opt, batch, args.steps)
        ranks, halo = mesh.world_size, _halo_share(pm)
        share = split_peak["activation"] / whole_peak["activation"]
        row = {"bench": "spatial", "model": args.model, "image": args.image_size, "batch": args.batch,
               "mesh": args.mesh, "activation_bytes_one_rank": whole_peak["activation"],
               "activation_bytes_per_rank": split_peak["activation"], "share": round(share, 4),
               "goal_share": round((1 + halo) / ranks, 4), "within_goal": share <= 1.1 * (1 + halo) / ranks,
               "peak_bytes_one_rank": whole_peak["total"], "peak_bytes_per_rank": split_peak["total"],
               "step_s_one_rank": round(whole_s, 4), "step_s_split": round(split_s, 4),
               "speedup": round(whole_s / split_s, 3), "torch": torch.__version__}
        print(f"| {args.model} | {args.image_size} x {args.image_size} x {args.batch} | {args.mesh} | "
              f"{whole_peak['activation'] / 2**20:.1f} MiB | {split_peak['activation'] / 2**20:.1f} MiB | "
              f"{share:.3f} (goal <= {1.1 * (1 + halo) / ranks:.3f}) | {whole_s * 1e3:.0f} ms | "
              f"{split_s * 1e3:.0f} ms | "
              f"{whole_s / split_s:.2f}x |")
        print(json.dumps(row))
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
