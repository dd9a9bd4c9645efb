"""The image models ``polyshard train --model`` builds by name, at the image size given."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from polyshard.errors import PolyshardError
from polyshard.models.device import building_on
from polyshard.models.resnet import ResNet
from polyshard.models.unet import UNet


@dataclass(frozen=True)
class VisionModel:
    """build: the model at an image size; classes: its labels' count; per_pixel: labels are masks (a class
    per pixel), not one class per image; halvings: how often it halves an image, which each tile must survive."""

    build: type
    options: dict
    classes: int
    per_pixel: bool
    halvings: int


VISION = {
    "unet-small": VisionModel(UNet, dict(widths=(16, 32, 64)), 3, True, 2),
    "resnet-small": VisionModel(ResNet, dict(widths=(16, 32)), 10, False, 2),
}
DEFAULT_IMAGE_SIZE = 64


def build_vision(name: str, image_size: int, device: str | torch.device = "cpu", seed: int = 0) -> nn.Module:
    """The image model ``name`` (see VISION) for square images of ``image_size`` pixels."""
    spec = VISION[name]
    labels = {"classes": spec.classes} if spec.per_pixel else {"num_classes": spec.classes}
    torch.manual_seed(seed)
    with building_on(device):
        return spec.build(image_size=image_size, **spec.options, **labels)


def dataset_strategy(name: str) -> tuple:
    """How the image model ``name``'s inputs split, by axis names (MindSpore's dataset strategy): images by
    height and width over the mesh's h and w axes, and masks (a class per pixel) alike."""
    return (None, None, "h", "w"), ((None, "h", "w") if VISION[name].per_pixel else None)


def image_meshes(name: str, image_size: int, world: int, batch: int) -> list[tuple[tuple[str, int], ...]]:
    """Every dp x h x w split of ``world`` devices the model can train on: dp divides the ``batch``, and every
    tile is one the model can halve as often as it halves the image."""
    out = []
    for h in (n for n in range(1, world + 1) if world % n == 0):
        for w in (n for n in range(1, world // h + 1) if world // h % n == 0):
            dp = world // h // w
            try:
                check_image_size(name, image_size, {"h": h, "w": w})
            except PolyshardError:
                continue
            if batch % dp == 0:
                out.append((("dp", dp), ("h", h), ("w", w)))
    return out


def check_image_size(name: str, image_size: int, splits: dict[str, int]) -> None:
    """Refuse an image size the model or the mesh's height and width splits (``{"h": 2}``) cannot take: each
    tile must be whole pixels the model can halve as often as it halves the image."""
    factor = 2 ** VISION[name].halvings
    if image_size < factor or image_size % factor:
        raise PolyshardError(f"--image-size {image_size}: {name} halves an image {VISION[name].halvings} times; "
                             f"use a multiple of {factor}")
    for axis, n in splits.items():
        if image_size % (n * factor):
            raise PolyshardError(f"--image-size {image_size} splits over {axis}={n} into tiles of "
                                 f"{image_size / n:g} pixels, which {name} cannot halve "
                                 f"{VISION[name].halvings} times; use a multiple of {n * factor}")
