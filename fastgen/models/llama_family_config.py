"""config.json of the Llama family (Llama, Mistral, Qwen2, Qwen3), as `LlamaFamilyForCausalLM` reads it."""

from __future__ import annotations

from dataclasses import dataclass

from fastgen.models.config import ModelConfig


@dataclass(frozen=True, kw_only=True)
class LlamaFamilyConfig(ModelConfig):
    """attention_bias: the q/k/v projections carry a bias (Qwen2). qk_norm: q and k are
    RMS-normalised per head before RoPE (Qwen3). rope_scaling: None for plain RoPE, else the
    config's scaling dict (linear, llama3)."""

    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    attention_bias: bool
    qk_norm: bool

    @classmethod
    def from_hf(cls, raw: dict, architecture: str, where: str, *, attention_bias: bool = False,
                qk_norm: bool = False) -> LlamaFamilyConfig:
        """attention_bias / qk_norm: the architecture's switches (from the registry)."""
        num_heads = raw["num_attention_heads"]
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        return cls(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=dict(rope) if rope_type not in ("default", None) else None,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attention_bias or bool(raw.get("attention_bias", False)),
            qk_norm=qk_norm,
            **cls.shared_fields(raw),
        )
