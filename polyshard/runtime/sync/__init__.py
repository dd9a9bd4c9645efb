"""Gradient sync: one bucketed engine for data parallel (level 0) and optimizer parallel (levels 1-3)."""

from polyshard.runtime.sync.bucket import Bucket
from polyshard.runtime.sync.engine import GradientSync, Pausable, data_parallel

__all__ = ["Bucket", "GradientSync", "Pausable", "data_parallel"]
