"""config.json of GPT-2 (`GPT2LMHeadModel`), as fastgen's GPT-2 reads it."""

from __future__ import annotations

from dataclasses import dataclass

from fastgen.models.config import ModelConfig
from fastgen.models.config_keys import ConfigKeys

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
    embedding_tensors = ("transformer.wte.weight", "wte.weight")

    layer_norm_eps: float
    scale_attn_weights: bool
    scale_attn_by_inverse_layer_idx: bool

    @classmethod
    def from_hf(cls, keys: ConfigKeys, architecture: str) -> GPT2ModelConfig:
        raw, where = keys.raw, keys.where
        for key, accepted in _REFUSED_SWITCHES.items():
            if raw.get(key, accepted) != accepted:
                raise ValueError(f"{key}={raw[key]!r} in {where} is not supported; fastgen serves {key}={accepted}")
        activation = raw.get("activation_function", "gelu_new")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation_function={activation!r} in {where} is not supported; "
                             f"supported: {list(_ACTIVATIONS)}")
        hidden, heads = keys.positive_int("n_embd"), keys.positive_int("n_head")
        if hidden % heads:
            raise ValueError(f"n_embd={hidden} in {where} is not a multiple of n_head={heads}")
        return cls(
            architecture=architecture,
            vocab_size=keys.positive_int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=keys.positive_int("n_inner", 4 * hidden),
            num_layers=keys.positive_int("n_layer"),
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=hidden // heads,
            max_position_embeddings=keys.positive_int("n_positions"),
            tie_word_embeddings=keys.flag("tie_word_embeddings", True),
            layer_norm_eps=keys.positive_number("layer_norm_epsilon", 1e-5),
            scale_attn_weights=keys.flag("scale_attn_weights", True),
            scale_attn_by_inverse_layer_idx=keys.flag("scale_attn_by_inverse_layer_idx", False),
            **cls.shared_fields(keys),
        )

    def num_parameters(self) -> int:
        h, inner = self.hidden_size, self.intermediate_size
        # c_attn and c_proj, the MLP's two projections, two LayerNorms: each with its bias.
        layer = (h * 3 * h + 3 * h) + (h * h + h) + (h * inner + inner) + (inner * h + h) + 4 * h
        embeddings = (self.vocab_size + self.max_position_embeddings) * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return embeddings + self.num_layers * layer + 2 * h + head

    def attention_scale(self, layer_idx: int) -> float:
        """The softmax scale of layer `layer_idx` (0-based), as transformers computes it."""
        scale = self.head_dim**-0.5 if self.scale_attn_weights else 1.0
        if self.scale_attn_by_inverse_layer_idx:
            scale /= float(layer_idx + 1)
        return scale
