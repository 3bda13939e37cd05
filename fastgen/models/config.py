"""What fastgen needs to know about a Hugging Face model folder, read from its config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

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
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"architectures={archs!r} in {where} is not supported; "
                f"supported: {sorted(ARCHITECTURES)}"
            )
        switches = ARCHITECTURES[arch]
        num_heads = raw["num_attention_heads"]
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        dtype_name = raw.get("torch_dtype") or raw.get("dtype") or "float32"
        return cls(
            architecture=arch,
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
            attention_bias=switches.attention_bias or bool(raw.get("attention_bias", False)),
            qk_norm=switches.qk_norm,
            dtype=DTYPE_NAMES.get(str(dtype_name).replace("torch.", ""), "float32"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        config_file = path / "config.json"
        if not path.is_dir():
            raise ValueError(f"model={str(path)!r} is not a directory")
        if not config_file.is_file():
            raise ValueError(f"model={str(path)!r} has no config.json")
        return cls.from_dict(json.loads(config_file.read_text()), where=str(config_file))

    def kv_bytes_per_token(self, dtype: str) -> int:
        """Bytes of K and V one token occupies across all layers when the cache is `dtype` (a name)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[DTYPE_NAMES[dtype]]
