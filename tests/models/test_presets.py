"""Dummy-weight presets: each one a readable config.json of the real model's shapes."""

from __future__ import annotations

import pytest

from fastgen.models.config import ModelConfig
from fastgen.models.presets import PRESETS, preset_model_dir


def test_presets_are_readable_model_configs(private_cache):
    qwen3 = ModelConfig.from_folder(preset_model_dir("qwen3-0.6b"))
    assert (qwen3.architecture, qwen3.hidden_size, qwen3.num_layers, qwen3.num_heads, qwen3.num_kv_heads,
            qwen3.head_dim, qwen3.intermediate_size, qwen3.vocab_size) == \
        ("Qwen3ForCausalLM", 1024, 28, 16, 8, 128, 3072, 151936)
    assert (qwen3.rope_theta, qwen3.tie_word_embeddings, qwen3.max_position_embeddings, qwen3.rms_norm_eps) == \
        (1e6, True, 40960, 1e-6)
    gpt2 = ModelConfig.from_folder(preset_model_dir("gpt2"))  # GPT-2 small's config.json leaves defaults out
    assert (gpt2.architecture, gpt2.hidden_size, gpt2.num_layers, gpt2.num_heads, gpt2.num_kv_heads, gpt2.head_dim,
            gpt2.intermediate_size, gpt2.vocab_size, gpt2.max_position_embeddings, gpt2.tie_word_embeddings,
            gpt2.dtype) == ("GPT2LMHeadModel", 768, 12, 12, 12, 64, 3072, 50257, 1024, True, "float32")
    for name in PRESETS:
        assert ModelConfig.from_folder(preset_model_dir(name)).architecture == PRESETS[name]["architectures"][0]
    assert (private_cache / "presets" / "qwen3-0.6b" / "config.json").is_file()
    with pytest.raises(ValueError, match="qwen3-0.6b"):
        preset_model_dir("gpt-9")
