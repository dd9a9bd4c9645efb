"""transformers models built from a config: random weights, or local safetensors; nothing is downloaded.

A spec is a tiny family name (``llama``, ``gpt2``, ...: a few layers of the family's real code, for tests
and examples), a shipped config (``llama-3-8b``, ...: real sizes, for planning), or a path to a
``config.json`` or to a directory holding one (with ``*.safetensors`` weights, which are loaded).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from polyshard.errors import PolyshardError
from polyshard.models.device import building_on

# The fields of a tiny decoder that most families share.
_DECODER = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=32)
# Tiny members of each family: the family's own modules at test sizes (dropout off, so runs compare).
TINY: dict[str, dict] = {
    "gpt2": dict(model_type="gpt2", vocab_size=256, bos_token_id=0, eos_token_id=0, n_embd=32, n_layer=2, n_head=4,
                 n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "llama": dict(model_type="llama", **_DECODER),
    "qwen2": dict(model_type="qwen2", **_DECODER),
    "mistral": dict(model_type="mistral", **_DECODER, head_dim=8),
    "gpt_neox": dict(model_type="gpt_neox", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0),
    # Gemma: its embedding scales the rows it looks up in its own forward, and the head is tied to that table
    "gemma": dict(model_type="gemma", **_DECODER, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # Phi-3: q, k and v in one fused product, and gate and up in another
    "phi3": dict(model_type="phi3", **_DECODER, pad_token_id=0, bos_token_id=1, eos_token_id=2, resid_pdrop=0.0,
                 embd_pdrop=0.0, attention_dropout=0.0),
    # GLM-4: rotary on half of each head, its pairs interleaved; gate and up in one fused product
    "glm4": dict(model_type="glm4", **_DECODER, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # Falcon (its newer layout): attention and MLP side by side on one input, q, k and v fused by kv group, products
    # written out as `input @ weight.T`
    "falcon": dict(model_type="falcon", vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   num_kv_heads=2, new_decoder_architecture=True, max_position_embeddings=32, bos_token_id=0,
                   eos_token_id=0, hidden_dropout=0.0, attention_dropout=0.0),
    # Qwen3: each head's q and k RMS-normed before rotary
    "qwen3": dict(model_type="qwen3", **_DECODER, head_dim=8),
    # Gemma 2: attention scores and logits soft-capped (tanh), a norm after each sublayer as well as before
    "gemma2": dict(model_type="gemma2", **_DECODER, head_dim=8, query_pre_attn_scalar=8, pad_token_id=0,
                   bos_token_id=1, eos_token_id=2),
    # GPT-BigCode (StarCoder): one k and v head for all query heads, fused with q in one product
    "gpt_bigcode": dict(model_type="gpt_bigcode", vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    # GPT-J: rotary on the first dims of each head, pairs interleaved; attention and MLP side by side
    "gptj": dict(model_type="gptj", vocab_size=256, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=32,
                 bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    # BLOOM: ALiBi (a bias per head on the scores) instead of positions, q/k/v fused head by head
    "bloom": dict(model_type="bloom", vocab_size=256, hidden_size=32, n_layer=2, n_head=4, bos_token_id=0,
                  eos_token_id=0, hidden_dropout=0.0, attention_dropout=0.0),
    "opt": dict(model_type="opt", vocab_size=256, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=32, word_embed_proj_dim=32, dropout=0.0,
                attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0),
    # Gemma 3: sliding-window layers between global ones, each head's q and k RMS-normed, its scaled embedding
    "gemma3": dict(model_type="gemma3_text", **_DECODER, head_dim=8, query_pre_attn_scalar=8, sliding_window=4,
                   pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # OLMo: LayerNorms without weights, written as calls
    "olmo": dict(model_type="olmo", **_DECODER),
    # OLMo 2: q and k each RMS-normed over all heads at once, before they split into heads
    "olmo2": dict(model_type="olmo2", **_DECODER),
    # Nemotron: a squared-ReLU MLP; LayerNorms that scale by weight + 1, written as calls
    "nemotron": dict(model_type="nemotron", **_DECODER, head_dim=8),
    # Qwen2-MoE: a router's top 2 of 4 experts and a gated shared expert per layer (the experts as batched products:
    # the grouped ones take no float64)
    "qwen2_moe": dict(model_type="qwen2_moe", **_DECODER, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16, shared_expert_intermediate_size=32,
                      experts_implementation="batched_mm"),
}
CONFIG_DIR = Path(__file__).parent / "configs"


def _transformers():
    try:
        import transformers
    except ImportError as exc:
        raise PolyshardError("hf: models need transformers; install polyshard with `pip install -e .[hf]`") from exc
    return transformers


def shipped() -> list[str]:
    """Names of the real-size configs shipped with polyshard."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def config_dict(spec: str) -> tuple[dict, Path | None]:
    """The config a spec names, and the directory its weights lie in (None: random init)."""
    if spec in TINY:
        return dict(TINY[spec]), None
    if (CONFIG_DIR / f"{spec}.json").exists():
        return json.loads((CONFIG_DIR / f"{spec}.json").read_text()), None
    path = Path(spec)
    folder = path if path.is_dir() else None
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise PolyshardError(f"unknown hf model {spec!r}: not a family ({', '.join(TINY)}), a shipped config "
                             f"({', '.join(shipped())}), a config.json or a directory holding one")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise PolyshardError(f"{path} is not JSON: {exc}") from exc
    if "model_type" not in raw:
        raise PolyshardError(f"{path} names no model_type; transformers configs carry one (e.g. \"llama\")")
    return raw, folder if folder is not None and any(folder.glob("*.safetensors")) else None


def build(spec: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
          **overrides) -> nn.Module:
    """The causal language model ``spec`` names, in ``dtype`` on ``device`` ("meta": shapes only)."""
    transformers = _transformers()
    raw, weights = config_dict(spec)
    raw = raw | overrides
    model_type = raw.pop("model_type")
    try:
        cfg = transformers.AutoConfig.for_model(model_type, **raw)
    except (ValueError, KeyError) as exc:
        raise PolyshardError(f"transformers has no model type {model_type!r}: {exc}") from exc
    cfg.use_cache = False
    try:
        with building_on(device):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    except Exception as exc:  # the config's values, which transformers checks as it builds (e.g. pad_token_id)
        raise PolyshardError(f"transformers could not build a {model_type} model from {spec}: "
                             f"{type(exc).__name__}: {exc}") from exc
    model.loss_type = "ForCausalLM"  # what from_config leaves unset, and transformers warns about on first use
    if weights is not None and str(device) != "meta":
        from safetensors.torch import load_file

        state = {}
        for f in sorted(weights.glob("*.safetensors")):
            state |= load_file(str(f))
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or [m for m in missing if "lm_head" not in m or not cfg.tie_word_embeddings]:
            raise PolyshardError(f"weights in {weights} do not fit the config: missing {missing[:5]}, "
                                 f"unexpected {unexpected[:5]}")
    return model.train()


def batch(model: nn.Module, rows: int, seq: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random batch in the model's own keywords: ``input_ids`` and ``labels`` (shifted inside the model)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (rows, seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


class Shape:
    """A transformers model's size in the terms polyshard's reports use (those of GPTConfig)."""

    def __init__(self, model: nn.Module, seq_len: int):
        c = model.config
        self.num_layers, self.hidden = c.num_hidden_layers, c.hidden_size
        self.num_heads, self.vocab_size, self.seq_len = c.num_attention_heads, c.vocab_size, seq_len
        self._params = sum(p.numel() for p in model.parameters())
        # a mixture of experts' token meets top-k of each layer's experts: the rest of their weights it passes by
        experts = [m for m in model.modules() if isinstance(getattr(m, "num_experts", None), int)
                   and type(m).__name__.endswith("Experts")]
        share = 1 - getattr(c, "num_experts_per_tok", 0) / experts[0].num_experts if experts else 0
        self._active = self._params - round(share * sum(p.numel() for m in experts for p in m.parameters()))

    def num_params(self) -> int:
        return self._params

    def active_params(self) -> int:
        """Parameters each token passes through."""
        return self._active


class CausalLM(nn.Module):
    """A transformers causal LM in the interface polyshard's trainer drives, ``(ids, next ids) -> loss``:
    the model shifts its labels itself, so it is called as its users call it, ``model(input_ids=ids,
    labels=ids).loss``, and the next ids only stand for that shift."""

    def __init__(self, model: nn.Module, seq_len: int):
        super().__init__()
        self.model = model
        self.cfg = Shape(model, seq_len)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids).loss

    def example_inputs(self, batch_size: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
        device = next(self.model.parameters()).device
        idx = torch.zeros(batch_size, self.cfg.seq_len, dtype=torch.long, device=device)
        return idx, idx


def causal_lm(spec: str, device: str | torch.device = "cpu", seed: int = 0, seq_len: int | None = None) -> CausalLM:
    """The model ``hf:<spec>`` names, for the trainer and planner; ``seq_len`` defaults to the config's
    longest sequence, at most 2048."""
    torch.manual_seed(seed)
    model = build(spec, device=device)
    longest = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", 2048)
    seq = min(longest, 2048) if seq_len is None else seq_len
    if seq > longest:
        raise PolyshardError(f"hf:{spec} takes sequences of at most {longest} tokens, not {seq}")
    return CausalLM(model, seq)
