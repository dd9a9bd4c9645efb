"""Spatial parallel parity: a ResNet-style classifier (batch norm, strided convolutions, max pooling, a
strided shortcut) and a UNet-style segmenter (transposed convolutions, skips by concatenation, a per-pixel
loss) on images split by height and width, alone and with data parallel, equal one device; AdamW in float64."""

import functools

import pytest

from polyshard.cli.main import main
from tests.distributed import spatial_cases as cases

TOL = 1e-10


@pytest.mark.parametrize("mesh,strategy,tile,search", [("h=2,w=2", (1, 1, 2, 2), (8, 3, 16, 16), False),
                                                      ("dp=2,h=2", (1, 1, 2, 1), (4, 3, 16, 32), False),
                                                      ("h=2,w=2", (1, 1, 2, 2), (8, 3, 16, 16), True)])
def test_resnet_on_split_images_trains_as_one_device(pools, mesh, strategy, tile, search):
    """The rules' plan, and the cost model's (``search=True``), which keeps the split the strategy gave."""
    results = pools(4).run(functools.partial(cases.image_parity, search=search), "resnet", mesh, strategy)
    for r in results:
        assert r["loss_err"] < TOL and r["param_err"] < TOL and r["buffer_err"] < TOL, r
        assert r["tile"] == tile
    # every convolution, batch norm and pooling ran on its tile: the stem, both blocks, the strided shortcut
    assert len(results[0]["spatial"]) == 14 and "blocks_1_shortcut_0" in results[0]["spatial"]


@pytest.mark.parametrize("mesh,strategy", [("h=2,w=2", (1, 1, 2, 2)), ("dp=2,h=2", (1, 1, 2, 1))])
def test_unet_on_split_images_trains_as_one_device(pools, mesh, strategy):
    results = pools(4).run(cases.image_parity, "unet", mesh, strategy)
    for r in results:
        assert r["loss_err"] < TOL and r["param_err"] < TOL and r["buffer_err"] < TOL, r
    spatial = results[0]["spatial"]  # 11 convolutions (the 1x1 head too), 10 norms, 2 poolings, 2 up, the loss
    assert len(spatial) == 26 and {"up_0", "up_1", "cross_entropy"} <= set(spatial), spatial


@pytest.mark.parametrize("up", ["nearest", "bilinear"])
def test_unet_upsampling_by_a_whole_factor_keeps_the_split(pools, up):
    """Nearest neighbours make each tile's block alone; bilinear takes a row from each neighbour (at the image's
    edges, its own edge again)."""
    results = pools(4).run(cases.image_parity, f"unet-{up}", "h=2,w=2", (1, 1, 2, 2))
    for r in results:
        assert r["loss_err"] < TOL and r["param_err"] < TOL and r["buffer_err"] < TOL, r
    spatial = set(results[0]["spatial"])
    assert {"up_0_1", "up_1_1"} <= spatial  # the 1x1 convolutions after upsampling: on tiles
    assert ({"up_0_0", "up_1_0"} <= spatial) == (up == "bilinear")  # the upsampling's own halo


@pytest.mark.parametrize("model,mesh", [("unet-small", "dp=2,h=2"), ("resnet-small", "h=2,w=2")])
def test_polyshard_train_on_split_images_matches_one_process(pools, tmp_path, model, mesh):
    """The command's own run: generated images, each rank making only its rows and tile, against one process."""
    one = pools(1).run(cases.train_images, str(tmp_path / "one"), "", model)[0]
    split = pools(4).run(cases.train_images, str(tmp_path / "split"), mesh, model)
    assert all(s == pytest.approx(one, rel=1e-6) for s in split), (one, split)
    assert one[-1] < one[0]


def test_a_plan_file_of_split_images_trains_as_one_process(pools, tmp_path):
    """`polyshard plan` of an image model with its split kept, then `polyshard train --plan` with no --model."""
    path = str(tmp_path / "p.json")
    assert main(["plan", "--model", "unet-small", "--image-size", "32", "--cluster", "cpu-gloo:4", "--global-batch",
                 "4", "--config", "dp=1,h=2,w=2", "--out", path]) == 0
    one = pools(1).run(cases.train_images, str(tmp_path / "one"), "", "unet-small")[0]
    split = pools(4).run(cases.train_images, str(tmp_path / "split"), "", "", path)
    assert all(s == pytest.approx(one, rel=1e-6) for s in split), (one, split)
