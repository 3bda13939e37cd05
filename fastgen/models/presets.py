"""Named model shapes for benchmarking on random weights (`--load-format dummy --model-preset`).

gpt-fast style: a preset is the config.json of a real model, so a benchmark on dummy weights
runs exactly the shapes (layers, heads, GQA ratio, head_dim, vocabulary) of the real thing
without downloading it. Only what the family's config class (`fastgen.models.config`) reads
matters; the rest (eos ids, model_type) is kept so the folder also reads as a normal Hugging Face
config.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def _qwen3(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, tie: bool) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": 128,
        "intermediate_size": intermediate,
        "vocab_size": 151936,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tie,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    }


def _llama3(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, tie: bool,
            rope_factor: float) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "intermediate_size": intermediate,
        "vocab_size": 128256,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": rope_factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": tie,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    }


PRESETS: dict[str, dict] = {
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_size": 1536,
        "vocab_size": 49152,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 151936,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    # GPT-2 small (124M), as its config.json has it: no n_inner (4 * n_embd), no
    # tie_word_embeddings (tied), no dtype (float32; pass --dtype to run it in half precision).
    "gpt2": {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
        "n_positions": 1024,
        "n_ctx": 1024,
        "vocab_size": 50257,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "bos_token_id": 50256,
        "eos_token_id": 50256,
    },
    "qwen3-0.6b": _qwen3(hidden=1024, layers=28, heads=16, kv_heads=8, intermediate=3072, tie=True),
    "qwen3-1.7b": _qwen3(hidden=2048, layers=28, heads=16, kv_heads=8, intermediate=6144, tie=True),
    "qwen3-8b": _qwen3(hidden=4096, layers=36, heads=32, kv_heads=8, intermediate=12288, tie=False),
    "llama3.2-1b": _llama3(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, tie=True,
                           rope_factor=32.0),
    "llama3.1-8b": _llama3(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, tie=False,
                           rope_factor=8.0),
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def preset_config(name: str) -> dict:
    """A copy of the preset's config.json dict. Raises ValueError naming the known presets."""
    if name not in PRESETS:
        raise ValueError(f"model preset {name!r} is unknown; known presets: {', '.join(preset_names())}")
    return json.loads(json.dumps(PRESETS[name]))


def preset_model_dir(name: str) -> Path:
    """Folder holding only the preset's config.json, under `<cache>/presets/<name>`.

    The file is (re)written when missing or different, by an atomic rename, so concurrent runs
    and edited presets are both safe. Load it with load_format="dummy", skip_tokenizer_init=True.
    """
    text = json.dumps(preset_config(name), indent=2, sort_keys=True) + "\n"
    folder = _cache_root() / "presets" / name
    config_file = folder / "config.json"
    if config_file.is_file() and config_file.read_text() == text:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".config.json.", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; a shared cache must stay readable
        os.replace(tmp, config_file)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return folder


def _cache_root() -> Path:
    # The same root as the default model, so one $FASTGEN_CACHE moves everything.
    from fastgen.paths import cache_dir

    return cache_dir()
