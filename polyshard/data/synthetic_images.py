"""Images generated on the fly, so an image model trains with nothing downloaded: discs of a few classes on
a textured background. Every image is a function of a few seeded numbers, so a rank computes only its rows
and, of each image, its tile (a dataset strategy splitting height and width), never the whole image."""

from __future__ import annotations

import math

import torch

from polyshard.data.draws import SeededDraws
from polyshard.errors import PolyshardError

DISCS = 3


class SyntheticImages(SeededDraws):
    """Endless (images, labels) batches of ``batch_size`` square RGB images of ``image_size`` pixels drawn with
    ``seed`` (the same on every rank). ``per_pixel``: labels are masks, each pixel the class of the disc on
    top there (0: background, discs 1 .. classes-1); else one class per image, its largest disc's. A rank
    gets its ``rows`` of each batch and, of each image, the ``tile`` (height, width slices)."""

    def __init__(self, image_size: int, classes: int, batch_size: int, seed: int, per_pixel: bool,
                 rows: slice = slice(None), tile: tuple[slice, slice] = (slice(None), slice(None))) -> None:
        if batch_size < 1 or image_size < 1 or classes < 2:
            raise PolyshardError(f"synthetic images need a batch, a size and two classes or more; got batch_size="
                                 f"{batch_size}, image_size={image_size}, classes={classes}")
        self.size, self.classes, self.batch_size, self.per_pixel = image_size, classes, batch_size, per_pixel
        self.rows, self.tile = rows, tile
        # a colour per class, the same in every run: what the model learns to tell apart
        self.palette = torch.rand(classes, 3, generator=torch.Generator().manual_seed(12345)) * 2 - 1
        super().__init__(seed)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        g, n, size = self._generator, self.batch_size, self.size
        centers = torch.rand(n, DISCS, 2, generator=g) * size
        radii = (0.1 + 0.2 * torch.rand(n, DISCS, generator=g)) * size
        first = 1 if self.per_pixel else 0  # masks keep class 0 for the background
        kinds = torch.randint(first, self.classes, (n, DISCS), generator=g)
        phase = torch.rand(n, generator=g) * 2 * math.pi
        centers, radii, kinds, phase = centers[self.rows], radii[self.rows], kinds[self.rows], phase[self.rows]
        dtype = torch.get_default_dtype()  # the model's, as its parameters are
        ys = torch.arange(size, dtype=dtype)[self.tile[0]].view(1, 1, -1, 1)
        xs = torch.arange(size, dtype=dtype)[self.tile[1]].view(1, 1, 1, -1)
        inside = (ys - centers[..., 0, None, None]) ** 2 + (xs - centers[..., 1, None, None]) ** 2 \
            <= radii[..., None, None] ** 2                                    # (rows, discs, height, width)
        on_top = torch.where(inside, kinds[..., None, None] + 1, 0).amax(1)  # where discs overlap, the higher class
        label_map = on_top - 1                                                # -1: background
        palette = self.palette.to(dtype)[label_map.clamp(min=0)].permute(0, 3, 1, 2)
        colour = torch.where(label_map[:, None] >= 0, palette, 0.0)
        texture = 0.3 * torch.sin(0.37 * ys[:, 0] + 0.23 * xs[:, 0] + phase[:, None, None])
        images = (colour + texture[:, None]).contiguous()
        if self.per_pixel:
            return images, label_map.clamp(min=0)
        return images, kinds.gather(1, radii.argmax(1, keepdim=True)).squeeze(1)
