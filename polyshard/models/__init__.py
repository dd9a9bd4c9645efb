"""Models polyshard ships: a GPT family with named configs, and an MLP classifier."""

from __future__ import annotations

import torch

from polyshard.errors import PolyshardError
from polyshard.models.gpt import GPT, GPTConfig, flops_per_token
from polyshard.models.mlp import MLPClassifier

CONFIGS: dict[str, GPTConfig] = {
    "gpt-tiny": GPTConfig(num_layers=2, hidden=32, num_heads=4, vocab_size=256, seq_len=16),
    "gpt-small": GPTConfig(num_layers=4, hidden=128, num_heads=4, vocab_size=256, seq_len=64),
    "gpt-125m": GPTConfig(num_layers=12, hidden=768, num_heads=12, vocab_size=50304, seq_len=1024),
    # PanGu-alpha (Zeng et al. 2021, table 1): layers / hidden / heads, FFN 4x.
    "pangu-alpha-2.6b": GPTConfig(num_layers=32, hidden=2560, num_heads=40, vocab_size=40000, seq_len=1024),
    "pangu-alpha-13b": GPTConfig(num_layers=40, hidden=5120, num_heads=40, vocab_size=40000, seq_len=1024),
    "pangu-alpha-200b": GPTConfig(num_layers=64, hidden=16384, num_heads=128, vocab_size=40000, seq_len=1024),
    # GPT-3 175B (Brown et al. 2020, table 2.1).
    "gpt3-175b": GPTConfig(num_layers=96, hidden=12288, num_heads=96, vocab_size=50257, seq_len=2048),
}


def build(name: str, device: str | torch.device = "cpu", seed: int = 0) -> GPT:
    """The named GPT; on ``device="meta"`` no memory is used (for planning)."""
    if name not in CONFIGS:
        raise PolyshardError(f"unknown model {name!r}; known: {', '.join(CONFIGS)}")
    torch.manual_seed(seed)
    with torch.device(device):
        return GPT(CONFIGS[name])


__all__ = ["CONFIGS", "GPT", "GPTConfig", "MLPClassifier", "build", "flops_per_token"]
