"""Spatial parallel rules: which windows keep an image's height/width split, and the halo each needs."""

import pytest
import torch
from torch import nn

from polyshard.errors import PolyshardError
from polyshard.graph.capture import capture
from polyshard.halo import halo, lines_up
from polyshard.layout import Layout
from polyshard.models.resnet import ResNet
from polyshard.planner.cost.comm import node_comm_bytes, own_collectives
from polyshard.planner.cost.compute import forward_flops
from polyshard.planner.propagate import propagate
from polyshard.planner.dataset import input_layouts

AXES = (("h", 2), ("w", 2))


@pytest.mark.parametrize("window,expected", [
    ((3, 1, 1), (1, 1, 8)),   # 3x3 "same": a row from each neighbour
    ((3, 2, 1), (1, 0, 4)),   # 3x3 stride 2: a row before only
    ((1, 2, 0), (0, -1, 4)),  # 1x1 stride 2 (a ResNet shortcut): no halo
    ((7, 2, 3), (3, 2, 4)),   # a ResNet stem
    ((2, 2, 0), (0, 0, 4)),   # 2x2 pooling
])
def test_halo_of_common_windows_on_tiles_of_8(window, expected):
    assert lines_up(16, 2, *window) and halo(16, 2, *window) == expected


@pytest.mark.parametrize("size,shards,window", [(16, 2, (5, 2, 1)), (15, 3, (3, 2, 1)), (16, 8, (7, 1, 3)),
                                                (16, 2, (3, 1, 1, 2))])
def test_windows_that_do_not_line_up_with_the_tiles(size, shards, window):
    assert not lines_up(size, shards, *window)  # output not input / stride, odd tiles, halo past a tile, dilation


def _plan(model, strategy, warned, image: int = 32):
    x = torch.zeros(2, 3, image, image)
    gm = capture(model, (x, torch.zeros(2, dtype=torch.long)))
    return propagate(gm, AXES, warned.append, inputs=input_layouts(gm, strategy, AXES))


def test_a_resnet_keeps_its_images_split_to_the_pooling():
    warned = []
    plan = _plan(ResNet(), ((1, 1, 2, 2), None), warned)
    split = Layout(AXES, ((), (), ("h",), ("w",)))
    spatial = {n for n, e in plan.nodes.items() if e.impl == "spatial"}
    assert len(spatial) == 14 and not warned
    assert plan.nodes["blocks_1_conv1"].output == split and plan.nodes["stem_2"].output == split
    assert plan.nodes["pool"].output.is_replicated and plan.params["fc.weight"].is_replicated


def test_a_window_that_does_not_line_up_gathers_the_image_and_says_so():
    model = ResNet()
    model.stem[0] = nn.Conv2d(3, 8, 5, 2, 1, bias=False)  # 32 rows -> 15: not 32 / 2
    warned = []
    plan = _plan(model, ((1, 1, 2, 2), None), warned)
    assert plan.nodes["stem_0"].inputs["images"].is_replicated and plan.nodes["stem_0"].impl == "local"
    assert any("`stem.0` (Conv2d, kernel 5, stride 2, padding 1) does not line up" in w for w in warned)


def test_a_kernel_larger_than_a_tile_is_refused_with_the_fix():
    model = ResNet(image_size=8)
    model.stem[0] = nn.Conv2d(3, 8, 7, 1, 3, bias=False)  # reaches 3 rows past a tile of 2
    with pytest.raises(PolyshardError, match=r"`stem.0` \(Conv2d, kernel 7\) reaches 3 rows past a tile of dim 2, and "
                       r"the input images of shape \(2, 3, 8, 8\) in 4 tiles gives each 2; split dim 2 into fewer "
                       r"tiles \(at most 2\) or use larger images"):
        _plan(model, ((1, 1, 4, 1), None), [], 8)


@pytest.mark.parametrize("strategy,image,message", [
    (((1, 1, 2),), 32,
     r"dataset_strategy\[0\] \(1, 1, 2\) has 3 entries, but input `images` has shape \(2, 3, 32, 32\)"),
    ("h", 32, "one entry per input"),
    (((1, 3, 1, 1),), 32, "uses 3 devices, which does not divide the 4 devices of the op axes"),
    (((1, 1, 4, 1),), 30, "does not divide dim 2 of size 30 .* use a count that divides 30"),
])
def test_bad_dataset_strategies_are_refused_before_anything_runs(strategy, image, message):
    with pytest.raises(PolyshardError, match=message):
        _plan(ResNet(image_size=image), strategy, [], image)


def test_the_cost_model_counts_a_tile_s_products_and_its_halo():
    """The stem's 3x3 convolution on a 16x16 tile of a 2-row batch: a row from each neighbour by height
    (2 x 3 channels x 16 columns), then a column from each by width on the 18-row tile."""
    plan = _plan(ResNet(), ((1, 1, 2, 2), None), [])
    gm = capture(ResNet(), (torch.zeros(2, 3, 32, 32), torch.zeros(2, dtype=torch.long)))
    modules, stem = dict(gm.named_modules()), next(n for n in gm.graph.nodes if n.name == "stem_0")
    assert node_comm_bytes(stem, plan, modules, 4, "gloo") == [{"h": 2 * 2 * 3 * 16 * 4, "w": 2 * 2 * 3 * 18 * 4}]
    assert forward_flops(stem, plan.nodes[stem.name], modules) == 2 * (2 * 8 * 16 * 16) * (3 * 3 * 3)


@pytest.mark.parametrize("mode,kept", [("nearest", True), ("bilinear", True), ("bicubic", False)])
def test_upsampling_keeps_the_split_by_nearest_neighbours_or_bilinear(mode, kept):
    from polyshard.models.unet import UNet

    model = UNet(up="nearest")
    for up in model.up:
        up[0].mode = mode
    x = torch.zeros(2, 3, 32, 32)
    gm = capture(model, (x, torch.zeros(2, 32, 32, dtype=torch.long)))
    plan = propagate(gm, AXES, lambda _: None, inputs=input_layouts(gm, ((1, 1, 2, 2), (1, 2, 2)), AXES))
    assert (not plan.nodes["up_0_0"].output.is_replicated) == kept
    assert plan.nodes["up_0_0"].impl == ("spatial" if mode == "bilinear" else "local")
    up = next(n for n in gm.graph.nodes if n.name == "up_0_0")  # (2, 32, 8, 8) in tiles of 4 x 4
    forward, backward = own_collectives(up, plan.nodes[up.name], dict(gm.named_modules()), 4, "gloo")  # moves aside
    halo = [{"h": 2 * (2 * 32 * 4) * 4, "w": 2 * (2 * 32 * 6) * 4}] if mode == "bilinear" else []
    assert forward == backward == halo  # the gradient's halo goes back the way the values came


def test_the_search_enumerates_each_layer_of_a_sequential_by_its_own_kind():
    """stem.1 (BatchNorm2d) and stem.2 (ReLU) are blocks of one node with alike names: not twins."""
    from polyshard.planner.candidates import candidates
    from polyshard.planner.rules.base import INPUT_LAYOUTS

    gm = capture(ResNet(), (torch.zeros(1, 3, 32, 32), torch.zeros(1, dtype=torch.long)))
    gm.meta[INPUT_LAYOUTS] = {"images": Layout(AXES, ((), (), ("h",), ("w",)))}
    options, copied = candidates(gm, AXES)
    assert "stem_2" not in copied and all(not o.params for o in options["stem_2"])
    assert [o.impl for o in options["stem_1"]] == ["spatial"]


class _Interpolating(nn.Module):
    def __init__(self, **how):
        super().__init__()
        self.how, self.conv = how, nn.Conv2d(3, 3, 3, 1, 1)

    def forward(self, x, y):
        return torch.nn.functional.interpolate(self.conv(x), **self.how).mean()


@pytest.mark.parametrize("how,kept", [(dict(scale_factor=2), True), (dict(scale_factor=2, mode="nearest"), True),
                                      (dict(size=(64, 64)), False), (dict(scale_factor=2, mode="bilinear"), True),
                                      (dict(scale_factor=2, mode="bilinear", align_corners=True), False),
                                      (dict(scale_factor=2, mode="bicubic"), False)])
def test_interpolate_keeps_the_split_by_a_whole_factor(how, kept):
    x = torch.randn(2, 3, 32, 32)
    gm = capture(_Interpolating(**how), (x, torch.zeros(2)))
    plan = propagate(gm, AXES, lambda _: None,
                     inputs=input_layouts(gm, ((1, 1, 2, 2), None), AXES))
    node = next(n for n in gm.graph.nodes if n.target is torch.nn.functional.interpolate)
    assert (not plan.nodes[node.name].output.is_replicated) == kept
    whole = torch.nn.functional.interpolate(x, **how)
    if kept and how.get("mode") == "bilinear":  # a tile grown by a row each side (at the image's edge, its own
        below = torch.cat([x[:, :, 15:16], x[:, :, 16:], x[:, :, 31:32]], 2)  # edge again), upsampled, cut back
        grown = torch.cat([below[..., :1], below[..., :16], below[..., 16:17]], 3)
        tile = torch.nn.functional.interpolate(grown, **how)[:, :, 2:-2, 2:-2]
        torch.testing.assert_close(tile, whole[:, :, 32:, :32], rtol=1e-6, atol=1e-6)  # the kernel's own rounding
    elif kept:  # each tile upsampled alone is its block of the whole image upsampled
        assert torch.equal(torch.nn.functional.interpolate(x[:, :, 16:, :16], **how), whole[:, :, 32:, :32])
