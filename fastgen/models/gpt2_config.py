"""config.json of GPT-2 (`GPT2LMHeadModel`), as fastgen's GPT-2 reads it."""

from __future__ import annotations

from dataclasses import dataclass

from fastgen.models.config import ModelConfig

# Switches of transformers' GPT2Config that fastgen does not implement, with the value that is
# safe to accept. reorder_and_upcast_attn asks for a float32 q·k computed by baddbmm, which no
# attention backend here reproduces; cross-attention needs an encoder.
_REFUSED_SWITCHES = {"reorder_and_upcast_attn": False, "add_cross_attention": False}
_ACTIVATIONS = ("gelu_new",)  # GELU with the tanh approximation, in transformers' arithmetic


@dataclass(frozen=True, kw_only=True)
class GPT2ModelConfig(ModelConfig):
    """GPT-2: plain multi-head attention (num_kv_heads == num_heads), learned positions for
    n_positions tokens, LayerNorm with bias, a GELU-tanh MLP of intermediate_size.

    scale_attn_weights: scores are divided by sqrt(head_dim) (else not scaled at all).
    scale_attn_by_inverse_layer_idx: layer i's scores are further divided by i + 1.
    """

    max_len_key = "n_positions"

    intermediate_size: int
    layer_norm_eps: float
    scale_attn_weights: bool
    scale_attn_by_inverse_layer_idx: bool

    @classmethod
    def from_hf(cls, raw: dict, architecture: str, where: str) -> GPT2ModelConfig:
        for key, accepted in _REFUSED_SWITCHES.items():
            if raw.get(key, accepted) != accepted:
                raise ValueError(f"{key}={raw[key]!r} in {where} is not supported; fastgen serves {key}={accepted}")
        activation = raw.get("activation_function", "gelu_new")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation_function={activation!r} in {where} is not supported; "
                             f"supported: {list(_ACTIVATIONS)}")
        hidden, heads = raw["n_embd"], raw["n_head"]
        if hidden % heads:
            raise ValueError(f"n_embd={hidden} in {where} is not a multiple of n_head={heads}")
        return cls(
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw.get("n_inner") or 4 * hidden,
            num_layers=raw["n_layer"],
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=hidden // heads,
            max_position_embeddings=raw["n_positions"],
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
            layer_norm_eps=raw.get("layer_norm_epsilon", 1e-5),
            scale_attn_weights=bool(raw.get("scale_attn_weights", True)),
            scale_attn_by_inverse_layer_idx=bool(raw.get("scale_attn_by_inverse_layer_idx", False)),
            **cls.shared_fields(raw),
        )

    def attention_scale(self, layer_idx: int) -> float:
        """The softmax scale of layer `layer_idx` (0-based), as transformers computes it."""
        scale = self.head_dim**-0.5 if self.scale_attn_weights else 1.0
        if self.scale_attn_by_inverse_layer_idx:
            scale /= float(layer_idx + 1)
        return scale
