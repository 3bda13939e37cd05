"""config.json of the Llama family (Llama, Mistral, Qwen2, Qwen3), as `LlamaFamilyForCausalLM` reads it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fastgen.models.config import ModelConfig
from fastgen.models.config_keys import ConfigKeys


@dataclass(frozen=True, kw_only=True)
class LlamaFamilyConfig(ModelConfig):
    """qkv_bias / o_proj_bias: the q/k/v projections / the output projection carry a bias (Qwen2:
    q/k/v always; Llama and Qwen3: all four where config.json says attention_bias). qk_norm: q
    and k are RMS-normalised per head before RoPE (Qwen3). rope_scaling: None for plain RoPE,
    else the config's scaling dict (linear, llama3)."""

    embedding_tensors: ClassVar[tuple[str, ...]] = ("model.embed_tokens.weight", "embed_tokens.weight")

    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    qkv_bias: bool
    o_proj_bias: bool
    qk_norm: bool
    # The window of a model whose attention slides over a longer context (Mistral-7B-v0.1's
    # 4,096 tokens; Qwen2's when use_sliding_window): up to it, sliding attention is attention
    # over the whole context, which is what the layers compute, so sequences are held to it
    # (max_position_embeddings is the window then). None: no window, or one no sequence outgrows.
    sliding_window: int | None = None

    @property
    def max_len_limit(self) -> str:
        if self.sliding_window is None:
            return super().max_len_limit
        return (f"sliding_window={self.sliding_window} (its attention slides past that many tokens, which fastgen "
                "does not implement)")

    @classmethod
    def from_hf(cls, keys: ConfigKeys, architecture: str, *, bias: str = "attention_bias", qk_norm: bool = False,
                head_dim: int | None = None) -> LlamaFamilyConfig:
        """The architecture's switches (from the registry), as transformers' classes hard-code
        them: bias, which projections carry one ("attention_bias": all four where that key says
        so, as Llama and Qwen3 read it; "qkv": q/k/v always, Qwen2; "none": Mistral, which reads
        no such key); qk_norm (Qwen3); head_dim, the default where config.json names none
        (Qwen3: 128; others: hidden_size / num_attention_heads)."""
        hidden_size = keys.positive_int("hidden_size")
        num_heads = keys.positive_int("num_attention_heads")
        num_kv_heads = keys.positive_int("num_key_value_heads", num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"{keys.where}: num_attention_heads={num_heads} must be a multiple of "
                             f"num_key_value_heads={num_kv_heads}")
        # Switches the layers do not implement: a model that sets them would run, silently wrong.
        keys.string("hidden_act", ("silu", "swish"), "silu")  # (transformers' two names of one function)
        if keys.flag("mlp_bias", False):
            raise ValueError(f"{keys.where}: mlp_bias=true is not supported (the MLP has no biases here)")
        num_layers = keys.positive_int("num_hidden_layers")
        positions = keys.positive_int("max_position_embeddings", 2048)
        window = _sliding_window(keys, architecture, num_layers)
        if window is not None and window >= positions:
            window = None  # a window no sequence can outgrow: attention over the whole context
        rope, rope_type = keys.rope()
        every_bias = bias == "attention_bias" and keys.flag("attention_bias", False)
        return cls(
            architecture=architecture,
            vocab_size=keys.positive_int("vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=keys.positive_int("intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=keys.positive_int("head_dim", head_dim or max(1, hidden_size // num_heads)),
            rms_norm_eps=keys.positive_number("rms_norm_eps", 1e-6),
            rope_theta=float(rope["rope_theta"]),
            rope_scaling=dict(rope) if rope_type != "default" else None,
            max_position_embeddings=positions if window is None else window,
            sliding_window=window,
            tie_word_embeddings=keys.flag("tie_word_embeddings", False),
            qkv_bias=bias == "qkv" or every_bias,
            o_proj_bias=every_bias,
            qk_norm=qk_norm,
            **cls.shared_fields(keys),
        )

    def num_parameters(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = (h * (q + 2 * kv) + q * h + (q + 2 * kv) * self.qkv_bias + h * self.o_proj_bias
                     + 2 * self.head_dim * self.qk_norm)
        layer = attention + 3 * h * self.intermediate_size + 2 * h
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * layer + h


def _sliding_window(keys: ConfigKeys, architecture: str, num_layers: int) -> int | None:
    """The attention window of some layers, as transformers reads the config: `layer_types`
    naming sliding layers; Qwen2/Qwen3's `use_sliding_window` with layers from
    `max_window_layers` on; Mistral's `sliding_window` (4,096 where the key is absent)."""
    raw = keys.raw
    if "sliding_window" in raw and raw["sliding_window"] is None:
        return None
    default = 4096 if architecture == "MistralForCausalLM" else None
    if "sliding_window" not in raw and default is None:
        return None
    window = keys.positive_int("sliding_window", default)
    layer_types = raw.get("layer_types")
    if isinstance(layer_types, list):
        return window if "sliding_attention" in layer_types else None
    if architecture.startswith("Qwen"):
        if not keys.flag("use_sliding_window", False):
            return None
        return window if keys.positive_int("max_window_layers", num_layers) < num_layers else None
    return window
