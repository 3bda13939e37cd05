"""What fastgen needs to know about a Hugging Face model folder, read from its config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from fastgen.models.config_keys import ConfigKeys
from fastgen.models.registry import ARCHITECTURES

# Every dtype name fastgen accepts, from users (EngineConfig.dtype) and from config.json, with
# its canonical name. Names, not torch dtypes: reading a config must not import torch.
DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def torch_dtype(name: str):
    """The torch dtype of a name in DTYPE_NAMES."""
    import torch

    return getattr(torch, DTYPE_NAMES[name])


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of a decoder-only model (Llama, Qwen2, Qwen3)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    dtype: str  # canonical name of the checkpoint's dtype (float32 when config.json names none)
    eos_token_ids: tuple[int, ...] = field(default=())

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config") -> "ModelConfig":
        """Read and check every key fastgen uses; ValueError naming `where` and the key otherwise."""
        keys = ConfigKeys(raw, where)
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None) if isinstance(archs, list) else None
        if arch is None:
            raise ValueError(
                f"architectures={archs!r} in {where} is not supported; "
                f"supported: {sorted(ARCHITECTURES)}"
            )
        switches = ARCHITECTURES[arch]
        hidden_size = keys.positive_int("hidden_size")
        num_heads = keys.positive_int("num_attention_heads")
        num_kv_heads = keys.positive_int("num_key_value_heads", num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"{where}: num_attention_heads={num_heads} must be a multiple of "
                             f"num_key_value_heads={num_kv_heads}")
        rope, rope_type = keys.rope()
        rope_theta = keys.positive_number("rope_theta", rope.get("rope_theta", 10000.0))
        return cls(
            architecture=arch,
            vocab_size=keys.positive_int("vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=keys.positive_int("intermediate_size"),
            num_layers=keys.positive_int("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=keys.positive_int("head_dim", max(1, hidden_size // num_heads)),
            rms_norm_eps=keys.positive_number("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=dict(rope) if rope_type != "default" else None,
            max_position_embeddings=keys.positive_int("max_position_embeddings", 2048),
            tie_word_embeddings=keys.flag("tie_word_embeddings", False),
            attention_bias=switches.attention_bias or keys.flag("attention_bias", False),
            qk_norm=switches.qk_norm,
            dtype=DTYPE_NAMES[keys.string("torch_dtype" if raw.get("torch_dtype") else "dtype", DTYPE_NAMES,
                                          "float32")],
            eos_token_ids=keys.token_ids("eos_token_id"),
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        config_file = path / "config.json"
        if not path.is_dir():
            raise ValueError(f"model={str(path)!r} is not a directory")
        if not config_file.is_file():
            raise ValueError(f"model={str(path)!r} has no config.json")
        return cls.from_dict(read_json(config_file), where=str(config_file))

    def num_parameters(self) -> int:
        """Parameters of the model this config describes (embeddings, layers, final norm, head)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = h * (q + 2 * kv) + q * h + (q + 2 * kv) * self.attention_bias + 2 * self.head_dim * self.qk_norm
        layer = attention + 3 * h * self.intermediate_size + 2 * h
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * layer + h

    def kv_bytes_per_token(self, dtype: str) -> int:
        """Bytes of K and V one token occupies across all layers when the cache is `dtype` (a name)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[DTYPE_NAMES[dtype]]


def read_json(path: Path) -> object:
    """A JSON file's content; ValueError naming the file when it is not valid JSON."""
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc})") from None
