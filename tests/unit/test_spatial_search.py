"""The search weighs splitting images by height and width: whole images over data parallel while one fits, tiles
when it does not (MindSpore's dataset strategy over h and w axes, chosen by the cost model)."""

import math

from polyshard.cluster import Cluster
from polyshard.models.vision import build_vision, dataset_strategy, image_meshes
from polyshard.planner.config import Fixed
from polyshard.planner.search import search

CLUSTER = Cluster.load("1x8xA100-80G")


def _search(limit=None, whole_only=False, fixed=Fixed()):
    model = build_vision("unet-small", 256, "meta")
    meshes = [m for m in image_meshes("unet-small", 256, 4, 4) if not whole_only or _tiles(m) == 1]
    return search(model, model.example_inputs(1), CLUSTER, 4, limit, meshes=meshes, fixed=fixed,
                  dataset_strategy=dataset_strategy("unet-small"), reserve_bytes=0)


def _tiles(mesh) -> int:
    return math.prod(s for n, s in mesh if n in ("h", "w"))


def test_whole_images_while_one_fits_tiles_when_none_does():
    free, _ = _search()
    assert _tiles(free.mesh) == 1  # no halo to pay: data parallel over whole images
    _, whole = _search(whole_only=True, fixed=Fixed(recompute="full"))  # the leanest a whole image gets
    limit = 0.8 * min(c.memory.total_bytes for c in whole if not c.pruned)
    tight, ranked = _search(limit)
    assert _tiles(tight.mesh) > 1, tight.report["config"]
    pick = next(c for c in ranked if c.mesh == tight.mesh and not c.pruned and c.memory.total_bytes <= limit)
    fitting = [c for c in ranked if not c.pruned and c.memory.total_bytes <= limit]
    assert pick.step_s == min(c.step_s for c in fitting)
    assert tight.nodes["images"].output.describe() != ""  # the images come split, as the plan lays them out
