"""config.json: every key the engine reads is checked, and a bad one is a ValueError naming the
file and the key (never a KeyError, a TypeError, or a string "false" read as true)."""

from __future__ import annotations

import json
import shutil

import pytest

from fastgen import LLM
from fastgen.config import EngineConfig
from fastgen.models.config import ModelConfig


@pytest.fixture
def folder(tiny_models, tmp_path):
    """A copy of the tiny Qwen3 folder whose config.json the test may edit."""
    path = tmp_path / "model"
    shutil.copytree(tiny_models["qwen3"], path)
    return path


def edit(folder, **changes):
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    for key, value in changes.items():
        if value is ...:
            config.pop(key, None)
        else:
            config[key] = value
    config_file.write_text(json.dumps(config))


@pytest.mark.parametrize("key", ["num_attention_heads", "hidden_size", "intermediate_size", "num_hidden_layers",
                                 "vocab_size"])
def test_a_missing_required_key_is_named(folder, key):
    edit(folder, **{key: ...})
    with pytest.raises(ValueError, match=rf"config.json has no '{key}', which the engine needs"):
        EngineConfig(model=str(folder))


@pytest.mark.parametrize("changes, message", [
    (dict(hidden_size="64"), r"hidden_size='64' must be an integer >= 1"),
    (dict(num_attention_heads=0), r"num_attention_heads=0 must be >= 1"),
    (dict(num_key_value_heads=3), r"num_attention_heads=4 must be a multiple of num_key_value_heads=3"),
    (dict(head_dim=-1), r"head_dim=-1 must be >= 1"),
    (dict(max_position_embeddings=1.5), r"max_position_embeddings=1.5 must be an integer"),
    (dict(tie_word_embeddings="false"), r"tie_word_embeddings='false' must be True or False"),
    (dict(attention_bias=1), r"attention_bias=1 must be True or False"),
    (dict(rms_norm_eps=-1e-6), r"rms_norm_eps=-1e-06 must be a finite number > 0"),
    (dict(rope_theta="big"), r"rope_theta='big' must be a finite number > 0"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), r"rope type 'yarn' \(rope_scaling / rope_parameters\)"
                                                                   r" is not supported"),
    # transformers' linear RoPE rotates half of each head, then fails; fastgen ran whole heads
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0}, partial_rotary_factor=0.5),
     r"partial_rotary_factor=0.5 is not supported with 'linear' RoPE"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.25}),
     r"partial_rotary_factor=0.25 is not supported"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0}), r"'llama3' RoPE scaling has no 'low_freq_factor'"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 64}), r"high_freq_factor=4.0 must be > low_freq_factor"),
    (dict(rope_parameters=[1]), r"rope_parameters / rope_scaling=\[1\] must be an object"),
    (dict(eos_token_id="</s>"), r"eos_token_id='</s>' must be an integer"),
    (dict(eos_token_id=[0, -1]), r"eos_token_id=-1 must be >= 0"),
    (dict(dtype="float8"), r"dtype='float8' is not one of"),
    (dict(architectures="Qwen3ForCausalLM"), r"architectures='Qwen3ForCausalLM' in .*config.json is not supported"),
])
def test_a_malformed_key_is_named_with_the_file(folder, changes, message):
    edit(folder, **changes)
    with pytest.raises(ValueError, match=message) as info:
        EngineConfig(model=str(folder))
    assert "config.json" in str(info.value)


def test_config_json_that_is_not_an_object(folder):
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config.json must hold a JSON object, got list"):
        EngineConfig(model=str(folder))
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json is not valid JSON"):
        EngineConfig(model=str(folder))


def test_generation_config_eos_is_checked_too(folder):
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": "eos"}))
    with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id='eos' must be an integer"):
        LLM(str(folder), dtype="float32", num_kv_blocks=64)


def test_nulls_fall_back_to_the_defaults(folder):
    edit(folder, num_key_value_heads=None, head_dim=None, rope_parameters=None, eos_token_id=None)
    config = ModelConfig.from_folder(folder)
    # Qwen3's head_dim defaults to 128, as in transformers' Qwen3Config (not hidden_size / heads).
    assert (config.num_kv_heads, config.head_dim, config.rope_scaling, config.eos_token_ids) == (4, 128, None, ())


def test_parameter_count_matches_transformers(tiny_models):
    from transformers import AutoModelForCausalLM

    for family, path in tiny_models.items():
        model = AutoModelForCausalLM.from_pretrained(path)
        assert ModelConfig.from_folder(path).num_parameters() == sum(p.numel() for p in model.parameters()), family


@pytest.mark.parametrize("changes", [
    dict(rope_parameters={"rope_type": "linear", "factor": 2.0}, partial_rotary_factor=1),
    dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 1.0}),
    dict(partial_rotary_factor=0.5),  # plain RoPE: transformers' Llama family ignores it too
], ids=["int-1", "inside-1.0", "default-rope"])
def test_a_partial_rotary_factor_these_families_honour_as_whole_heads_is_accepted(folder, changes):
    edit(folder, **changes)
    ModelConfig.from_folder(folder)
