"""Models polyshard ships: a GPT family with named configs, and an MLP classifier."""

from __future__ import annotations

from dataclasses import replace

import torch

from polyshard.errors import PolyshardError
from polyshard.models.device import building_on
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


# `gpt:KEY=VALUE,...` keys and the GPTConfig field each sets
_SHAPE_KEYS = {"layers": "num_layers", "hidden": "hidden", "heads": "num_heads", "vocab": "vocab_size",
               "seq": "seq_len", "ffn": "ffn", "dropout": "dropout", "attention": "attention", "tied": "tied"}
_OPTIONAL_KEYS = ("ffn", "dropout", "attention", "tied")  # spelled out only where they differ from the default
_ATTENTIONS = ("fused", "math")


def config(name: str, seq_len: int | None = None) -> GPTConfig:
    """The GPT a name describes: one of CONFIGS, or a shape such as
    ``gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200`` (ffn defaults to 4 x hidden; tied=0 gives the
    LM head a weight of its own);
    ``seq_len`` overrides its sequence length."""
    _check_length(seq_len)
    if name.startswith("hf:"):
        return build(name, device="meta", seq_len=seq_len).cfg
    if name.startswith("gpt:"):
        cfg = _parse_shape(name)
    elif name in CONFIGS:
        cfg = CONFIGS[name]
    else:
        raise PolyshardError(f"unknown model {name!r}; known: {', '.join(CONFIGS)}, a transformers model as "
                             "hf:FAMILY or hf:CONFIG.json, or a shape such as "
                             "'gpt:layers=24,hidden=2048,heads=16,seq=2048,vocab=51200' (`polyshard models` lists "
                             "them all)")
    return cfg if seq_len is None else replace(cfg, seq_len=seq_len)


def _check_length(seq_len: int | None) -> None:
    """A sequence length to override a model's with: None (the model's own) or at least 1."""
    if seq_len is not None and seq_len < 1:
        raise PolyshardError(f"sequence length must be at least 1, got {seq_len}")


def shape_spec(cfg: GPTConfig) -> str:
    """``cfg`` in the ``gpt:KEY=VALUE,...`` spelling :func:`config` reads."""
    defaults = GPTConfig(1, 1, 1)
    values = {k: getattr(cfg, f) for k, f in _SHAPE_KEYS.items()
              if f not in _OPTIONAL_KEYS or getattr(cfg, f) != getattr(defaults, f)}
    return "gpt:" + ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in values.items())


def _parse_shape(name: str) -> GPTConfig:
    values: dict[str, object] = {}
    for part in filter(None, name[len("gpt:"):].split(",")):
        key, _, value = (x.strip() for x in part.partition("="))
        values[_SHAPE_KEYS.get(key, key)] = _shape_value(key, value, part, name)
    missing = [k for k, f in _SHAPE_KEYS.items() if f in ("num_layers", "hidden", "num_heads") and f not in values]
    if missing:
        raise PolyshardError(f"model shape {name!r} needs {', '.join(missing)}")
    if values["hidden"] % values["num_heads"]:
        raise PolyshardError(f"model shape {name!r}: hidden {values['hidden']} is not a multiple of heads "
                             f"{values['num_heads']}")
    return GPTConfig(**{"vocab_size": 51200, "seq_len": 2048, **values})


def _shape_value(key: str, value: str, part: str, name: str) -> object:
    """One ``KEY=VALUE`` of a shape, checked: sizes are positive integers, dropout a probability."""
    if key == "attention":
        if value not in _ATTENTIONS:
            raise PolyshardError(f"model shape {name!r}: attention must be one of {', '.join(_ATTENTIONS)}, got {value!r}")
        return value
    if key == "dropout":
        try:
            p = float(value)
        except ValueError:
            p = -1.0
        if not 0 <= p < 1:
            raise PolyshardError(f"model shape {name!r}: dropout must be in [0, 1), got {value!r}")
        return p
    if key == "tied":
        if value not in ("0", "1"):
            raise PolyshardError(f"model shape {name!r}: tied must be 1 (the LM head shares the token embedding) "
                                 f"or 0, got {value!r}")
        return value == "1"
    if key not in _SHAPE_KEYS or not value.isdigit() or int(value) < 1:
        raise PolyshardError(f"model shape entry {part!r} in {name!r} is not KEY=POSITIVE_INTEGER with KEY one "
                             f"of {', '.join(k for k in _SHAPE_KEYS if k not in ('dropout', 'attention', 'tied'))} "
                             "(or dropout=P, attention=fused|math, tied=0|1)")
    return int(value)


def build(name: str, device: str | torch.device = "cpu", seed: int = 0, seq_len: int | None = None) -> GPT:
    """The model a name describes: a GPT (see :func:`config`), or ``hf:<family, shipped config or
    config.json>`` for a transformers model (see :mod:`polyshard.models.hf`); on ``device="meta"`` no
    memory is used (for planning)."""
    _check_length(seq_len)
    if name.startswith("hf:"):
        from polyshard.models.hf import causal_lm

        return causal_lm(name[3:], device, seed, seq_len)
    cfg = config(name, seq_len)
    torch.manual_seed(seed)
    with building_on(device):
        return GPT(cfg)


__all__ = ["CONFIGS", "GPT", "GPTConfig", "MLPClassifier", "build", "config", "flops_per_token", "shape_spec"]
