"""A UNet-style segmentation network (Ronneberger et al. 2015: two 3x3 convolutions per level, max pooling
down, 2x2 transposed convolutions up, skip connections by concatenation) with batch norm, small enough for
tests and spatial-parallel examples; ``forward(images, masks)`` returns the per-pixel mean cross-entropy."""

import torch
import torch.nn.functional as F
from torch import nn


def _double_conv(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, 1, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(),
                         nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())


class UNet(nn.Module):
    """``widths`` per level, top first; ``classes`` per pixel; ``up``: "transposed" (2x2 transposed
    convolutions), "nearest" or "bilinear" (upsampling so, then a 1x1 convolution)."""

    def __init__(self, widths: tuple[int, ...] = (8, 16, 32), classes: int = 3, image_size: int = 32,
                 channels: int = 3, up: str = "transposed"):
        super().__init__()
        self.image_size, self.channels = image_size, channels
        self.down = nn.ModuleList(_double_conv(a, b) for a, b in zip((channels,) + widths[:-1], widths))
        self.pool = nn.MaxPool2d(2)
        self.up = nn.ModuleList(nn.ConvTranspose2d(b, a, 2, 2) if up == "transposed" else
                                nn.Sequential(nn.Upsample(scale_factor=2, mode=up), nn.Conv2d(b, a, 1))
                                for a, b in zip(widths[-2::-1], widths[:0:-1]))
        self.merge = nn.ModuleList(_double_conv(2 * a, a) for a in widths[-2::-1])
        self.head = nn.Conv2d(widths[0], classes, 1)

    def forward(self, images: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        skips, x = [], images
        for i, level in enumerate(self.down):
            x = level(x if i == 0 else self.pool(x))
            skips.append(x)
        for up, merge, skip in zip(self.up, self.merge, reversed(skips[:-1])):
            x = merge(torch.cat([skip, up(x)], dim=1))
        return F.cross_entropy(self.head(x), masks)

    def example_inputs(self, batch_size: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
        size = (batch_size, self.image_size, self.image_size)
        return torch.zeros(batch_size, self.channels, *size[1:]), torch.zeros(size, dtype=torch.long)
