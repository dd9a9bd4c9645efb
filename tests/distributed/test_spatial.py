"""Spatial parallel parity: a ResNet-style classifier (batch norm, strided convolutions, max pooling, a
strided shortcut) on images split by height and width, alone and with data parallel, equals one device;
AdamW in float64."""

import pytest

from tests.distributed import spatial_cases as cases

TOL = 1e-10


@pytest.mark.parametrize("mesh,strategy,tile", [("h=2,w=2", (1, 1, 2, 2), (8, 3, 16, 16)),
                                               ("dp=2,h=2", (1, 1, 2, 1), (4, 3, 16, 32))])
def test_resnet_on_split_images_trains_as_one_device(pools, mesh, strategy, tile):
    results = pools(4).run(cases.resnet_parity, mesh, strategy)
    for r in results:
        assert r["loss_err"] < TOL and r["param_err"] < TOL and r["buffer_err"] < TOL, r
        assert r["tile"] == tile
    # every convolution, batch norm and pooling ran on its tile: the stem, both blocks, the strided shortcut
    assert len(results[0]["spatial"]) == 14 and "blocks_1_shortcut_0" in results[0]["spatial"]
