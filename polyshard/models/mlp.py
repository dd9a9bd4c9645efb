"""An MLP classifier (Flatten, Linear, ReLU, Linear) for data-parallel examples and tests."""

import torch
import torch.nn.functional as F
from torch import nn


class MLPClassifier(nn.Module):
    """``forward(x, labels)`` returns the mean cross-entropy of ``x`` (any shape after the batch)."""

    def __init__(self, in_features: int = 64, hidden: int = 128, num_classes: int = 10):
        super().__init__()
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.fc2(F.relu(self.fc1(self.flatten(x)))), labels)

    def example_inputs(self, batch_size: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(batch_size, self.fc1.in_features), torch.zeros(batch_size, dtype=torch.long)
