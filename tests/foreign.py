"""A transformer written the way another code base would: its own module names, fused q/k/v, a
hand-written attention and loss. polyshard must capture, plan and split it as it does its own GPT."""

import math

import torch
import torch.nn.functional as F
from torch import nn


class SelfAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = (nn.Linear(width, width) for _ in range(3))
        self.out = nn.Linear(width, width)

    def forward(self, h):
        b, t, c = h.shape
        q, k, v = (f(h).view(b, t, self.heads, c // self.heads).transpose(1, 2) for f in (self.query, self.key, self.value))
        scores = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(c // self.heads), dim=-1)
        return self.out((scores @ v).transpose(1, 2).reshape(b, t, c))


class Layer(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.norm_a, self.norm_b = nn.LayerNorm(width), nn.LayerNorm(width)
        self.mix = SelfAttention(width, heads)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, h):
        h = h + self.mix(self.norm_a(h))
        return h + self.down(F.gelu(self.up(self.norm_b(h))))


class TinyLM(nn.Module):
    """Token ids in, mean next-token loss out."""

    def __init__(self, vocab: int = 64, width: int = 32, heads: int = 4, depth: int = 2, seq: int = 8):
        super().__init__()
        self.seq, self.vocab = seq, vocab
        self.tokens = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Layer(width, heads) for _ in range(depth))
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids, targets):
        h = self.tokens(ids)
        for layer in self.layers:
            h = layer(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())

    def batch(self, rows: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        return tuple(torch.randint(0, self.vocab, (rows, self.seq), generator=g) for _ in range(2))
