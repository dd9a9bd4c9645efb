"""A checkpoint's weights as a transformers model directory (``model.safetensors`` and ``config.json``), which
``transformers`` loads and ``polyshard train --model hf:DIR`` starts from. A transformers model keeps its own
names; polyshard's GPT is written in GPT-2's layout (fused q/k/v, Conv1D weights stored input-major)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from polyshard import models
from polyshard.models.gpt import GPTConfig
from polyshard.runtime import checkpoint
from polyshard.runtime.training_state import MODEL


def export_hf(path: str | Path, out: str | Path) -> Path:
    """Write the weights of the checkpoint at ``path`` (or the newest under a save directory) into ``out``."""
    from safetensors.torch import save_file

    path = Path(path)
    if not (path / checkpoint.MANIFEST).exists() and checkpoint.committed(path):
        path = checkpoint.committed(path)[-1]
    name = checkpoint.read_manifest(path).get("model", "")
    weights = {k[len(MODEL):]: v for k, v in checkpoint.read_full(path, MODEL).items()}
    if name.startswith("hf:"):
        config = models.build(name, device="meta").model.config.to_dict()
        tensors = {k.removeprefix("model."): v for k, v in weights.items()}
    else:
        cfg = models.config(name)
        config, tensors = gpt2_config(cfg), gpt2_weights(cfg, weights)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=1, default=str))
    return out


def gpt2_config(cfg: GPTConfig) -> dict:
    """transformers' GPT-2 config of the same network (exact GELU, as polyshard's GPT computes it)."""
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": cfg.vocab_size,
            "n_positions": cfg.seq_len, "n_embd": cfg.hidden, "n_layer": cfg.num_layers, "n_head": cfg.num_heads,
            "n_inner": cfg.ffn_hidden, "activation_function": "gelu", "layer_norm_epsilon": 1e-5,
            "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
            "tie_word_embeddings": cfg.tied, "bos_token_id": 0, "eos_token_id": 0}


def gpt2_weights(cfg: GPTConfig, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """polyshard GPT parameters renamed and laid out as GPT2LMHeadModel's."""
    out = {"transformer.wte.weight": w["wte.weight"], "transformer.wpe.weight": w["wpe.weight"],
           "transformer.ln_f.weight": w["ln_f.weight"], "transformer.ln_f.bias": w["ln_f.bias"]}
    for i in range(cfg.num_layers):
        src, dst = f"blocks.{i}.", f"transformer.h.{i}."
        for a, b in (("ln1", "ln_1"), ("ln2", "ln_2")):
            out |= {f"{dst}{b}.{p}": w[f"{src}{a}.{p}"] for p in ("weight", "bias")}
        qkv = [f"{src}attn.{m}" for m in "qkv"]
        out[f"{dst}attn.c_attn.weight"] = torch.cat([w[f"{m}.weight"] for m in qkv]).t()
        out[f"{dst}attn.c_attn.bias"] = torch.cat([w[f"{m}.bias"] for m in qkv])
        for a, b in (("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            out[f"{dst}{b}.weight"] = w[f"{src}{a}.weight"].t()
            out[f"{dst}{b}.bias"] = w[f"{src}{a}.bias"]
    if not cfg.tied:
        out["lm_head.weight"] = w["lm_head.weight"]
    return out
