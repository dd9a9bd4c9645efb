"""A ResNet-style image classifier (He et al. 2016's basic blocks, batch norm, a strided stage), small
enough for tests and spatial-parallel examples: images split by height and width keep their split through
every layer up to the global pooling."""

import torch
import torch.nn.functional as F
from torch import nn


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm, added to the input (through a strided 1x1 convolution where
    the block halves the image or changes the width)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU()
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet(nn.Module):
    """Stem (3x3 convolution, batch norm, 3x3 max pooling by 2), one block per width (each after the first
    halving the image), global average pooling, a linear head; ``forward(images, labels)`` returns the
    mean cross-entropy."""

    def __init__(self, widths: tuple[int, ...] = (8, 16), num_classes: int = 10, image_size: int = 32,
                 channels: int = 3):
        super().__init__()
        self.image_size, self.channels = image_size, channels
        self.stem = nn.Sequential(nn.Conv2d(channels, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        self.blocks = nn.Sequential(*(BasicBlock(a, b, 1 if i == 0 else 2)
                                      for i, (a, b) in enumerate(zip((widths[0],) + widths[:-1], widths))))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(widths[-1], num_classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        features = torch.flatten(self.pool(self.blocks(self.stem(images))), 1)
        return F.cross_entropy(self.fc(features), labels)

    def example_inputs(self, batch_size: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.zeros(batch_size, self.channels, self.image_size, self.image_size),
                torch.zeros(batch_size, dtype=torch.long))
