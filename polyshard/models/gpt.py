"""A GPT family written for one device (nanoGPT's shape), with separate q/k/v projections.

Model code holds no parallelism; polyshard applies it from outside. Every config can be
built on the meta device, so the planner can read 175B-parameter models without memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """num_layers: blocks; hidden: model width; num_heads: attention heads; ffn: MLP width
    (4x hidden when 0); vocab_size: tokens; seq_len: longest sequence; tied: LM head shares
    the token embedding; dropout: of attention probabilities and of each block's two residual
    branches (kept 0 for exact parity); attention: "fused" (scaled_dot_product_attention) or
    "math" (scores, softmax and dropout written out, as GPT-2 and Megatron-LM 2021 ran it)."""

    num_layers: int
    hidden: int
    num_heads: int
    vocab_size: int = 256
    seq_len: int = 64
    ffn: int = 0
    tied: bool = True
    dropout: float = 0.0
    attention: str = "fused"

    @property
    def ffn_hidden(self) -> int:
        return self.ffn or 4 * self.hidden

    def num_params(self) -> int:
        """Parameter count: embeddings + per block (attention 4h^2+4h, MLP 2*h*f+f+h, 2 LayerNorms) + final LN + head."""
        h, f = self.hidden, self.ffn_hidden
        block = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
        head = 0 if self.tied else self.vocab_size * h
        return self.vocab_size * h + self.seq_len * h + self.num_layers * block + 2 * h + head

    def active_params(self) -> int:
        """Parameters each token passes through: all of them (no experts to choose among)."""
        return self.num_params()


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.hidden // cfg.num_heads
        self.dropout = cfg.dropout
        self.q = nn.Linear(cfg.hidden, cfg.hidden)
        self.k = nn.Linear(cfg.hidden, cfg.hidden)
        self.v = nn.Linear(cfg.hidden, cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.math = cfg.attention == "math"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.size()
        q, k, v = (m(x).view(b, t, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        if self.math:
            causal = torch.full((t, t), float("-inf"), device=x.device).triu(1)  # -inf above the diagonal
            scores = (q * self.head_dim**-0.5) @ k.transpose(-2, -1) + causal
            probs = F.softmax(scores, dim=-1)
            if self.dropout:
                probs = F.dropout(probs, self.dropout, self.training)
            y = probs @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)
        return _dropout(self.proj(y.transpose(1, 2).reshape(b, t, -1)), self.dropout, self.training)


def _dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout when asked for; at p=0 no op at all, so captured graphs stay as without it."""
    return F.dropout(x, p, training) if p else x


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.dropout = cfg.dropout
        self.fc = nn.Linear(cfg.hidden, cfg.ffn_hidden)
        self.proj = nn.Linear(cfg.ffn_hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _dropout(self.proj(F.gelu(self.fc(x))), self.dropout, self.training)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(idx, targets)`` returns the mean cross-entropy loss."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        if cfg.tied:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)) and module.weight.device.type != "meta":
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.normal_(module.bias, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def example_inputs(self, batch_size: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch of the right shapes and dtypes (for capture and planning)."""
        idx = torch.zeros(batch_size, self.cfg.seq_len, dtype=torch.long)
        return idx, idx


def flops_per_token(cfg: GPTConfig) -> float:
    """Training FLOPs per token: 6 * params + 12 * layers * hidden * seq (attention), as in PaLM's appendix B; the
    params those a token passes through (a mixture of experts': its top-k experts only)."""
    return 6 * cfg.active_params() + 12 * cfg.num_layers * cfg.hidden * cfg.seq_len

