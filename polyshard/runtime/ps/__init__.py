"""Parameter-server training: servers hold the parameters (embedding tables split by rows), workers push
gradients and pull parameters, synchronously or not, and the run survives roles that die."""

from polyshard.runtime.ps.launch import PSResult, train_ps

__all__ = ["PSResult", "train_ps"]
