"""Checkpoints laid out otherwise than the tiny models: greedy output still equals transformers'
(a bias on every attention projection where config.json says attention_bias, a head saved apart
from the embeddings config.json ties it to, RoPE settings given in two places, Qwen3 without
head_dim), and a tensor fastgen has no place for is refused by name, never dropped.

The models here have every bias and norm weight moved away from 0 and 1 (transformers builds
them so), or a dropped bias would change nothing."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, MistralConfig

from fastgen import LLM, SamplingParams
from fastgen.models.config import ModelConfig
from tests.conftest import random_prompts
from tests.models.test_config import edit as edit_config
from tests.tiny_models import _SHAPES, build_tokenizer, hf_greedy, model_config

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = random_prompts([5, 70], seed=3)  # the llama preset's RoPE scaling starts at 64 positions


def build(config, path: Path) -> Path:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def family(name: str, **overrides):
    config = model_config(name)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def copy_folder(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def assert_matches_transformers(path: Path) -> None:
    llm = LLM(str(path), dtype="float32", block_size=16, num_kv_blocks=64)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == hf_greedy(path, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_attention_bias_puts_a_bias_on_all_four_projections(name, tmp_path):
    """transformers' Llama and Qwen3 give q, k, v and o a bias under attention_bias; Qwen2's
    q/k/v have one always and its o never (its own tests cover that)."""
    path = build(family(name, attention_bias=True), tmp_path / name)
    assert any(k.endswith("self_attn.o_proj.bias") for k in load_file(path / "model.safetensors"))
    assert_matches_transformers(path)


def test_mistral_reads_no_attention_bias(tmp_path):
    """transformers' Mistral has no biases, whatever config.json says of attention_bias."""
    config = MistralConfig(**_SHAPES, sliding_window=None, eos_token_id=0)
    path = build(config, tmp_path / "mistral")
    edit_config(path, attention_bias=True)
    assert_matches_transformers(path)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_head_saved_apart_from_the_embeddings_it_is_tied_to_is_used(name, tmp_path, caplog):
    """config.json ties the head, but the checkpoint holds a head of other values:
    transformers uses that head, and so does fastgen (with a warning)."""
    path = build(family(name, tie_word_embeddings=False), tmp_path / name)
    edit_config(path, tie_word_embeddings=True)
    with caplog.at_level(logging.WARNING, logger="fastgen.models.config"):
        assert ModelConfig.from_folder(path).tie_word_embeddings is False
    assert "holds other values; using the checkpoint's head" in caplog.text
    assert_matches_transformers(path)


def test_a_head_saved_with_the_embeddings_values_stays_tied(tiny_models, tmp_path):
    path = copy_folder(tiny_models["llama"], tmp_path / "llama")
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(path / "model.safetensors"))
    assert ModelConfig.from_folder(path).tie_word_embeddings is True
    assert_matches_transformers(path)


@pytest.mark.parametrize("name, embedding", [("llama", "model.embed_tokens.weight"), ("gpt2", "transformer.wte.weight")])
def test_a_tied_checkpoint_that_stores_only_the_head_fills_the_embeddings(name, embedding, tmp_path):
    """transformers ties the other way round when a tied checkpoint holds the head and not the
    embeddings; the model is the same one, and fastgen's must be too."""
    path = build(family(name, tie_word_embeddings=True), tmp_path / name)
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = tensors.pop(embedding)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    assert ModelConfig.from_folder(path).tie_word_embeddings is True
    assert_matches_transformers(path)


def test_a_checkpoint_tensor_with_no_place_in_the_model_is_refused(tiny_models, tmp_path):
    path = copy_folder(tiny_models["qwen3"], tmp_path / "qwen3")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.bias"] = torch.ones(_SHAPES["hidden_size"])
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"checkpoint tensor 'model.layers.0.mlp.down_proj.bias' \(model.safetensors\) "
                                         r"matches no parameter of LlamaFamilyForCausalLM"):
        LLM(str(path), dtype="float32", num_kv_blocks=16)


@pytest.mark.parametrize("changes", [
    # rope_parameters' own rope_theta over the top-level one
    dict(rope_parameters={"rope_type": "default", "rope_theta": 100.0}, rope_theta=1e6),
    # the older rope_scaling over rope_parameters where both are given
    dict(rope_scaling={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4},
         rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
    # a top-level original_max_position_embeddings over the one inside (Phi-3's placement)
    dict(original_max_position_embeddings=16),
], ids=["theta-inside-wins", "rope-scaling-wins", "top-level-original-max"])
def test_rope_settings_given_twice_are_read_as_transformers_reads_them(changes, tmp_path):
    path = build(family("llama"), tmp_path / "llama")
    edit_config(path, **changes)
    assert_matches_transformers(path)


def test_qwen3_without_head_dim_takes_transformers_default_of_128(tmp_path):
    path = build(family("qwen3", head_dim=128), tmp_path / "qwen3")
    edit_config(path, head_dim=...)
    assert ModelConfig.from_folder(path).head_dim == 128
    assert_matches_transformers(path)


def test_a_rope_type_that_is_not_a_string_is_named(tiny_models, tmp_path):
    path = copy_folder(tiny_models["llama"], tmp_path / "llama")
    edit_config(path, rope_parameters={"rope_type": ["llama3"], "factor": 8.0})
    with pytest.raises(ValueError, match=r"rope type \['llama3'\] \(rope_scaling / rope_parameters\) is not supported"):
        ModelConfig.from_folder(path)


def test_the_files_an_index_names_are_the_checkpoint(tmp_path):
    """Mistral's repositories ship their own consolidated.safetensors beside the indexed shards:
    transformers reads the shards the index names, and so does fastgen."""
    config = MistralConfig(**_SHAPES, sliding_window=None, eos_token_id=0)
    torch.manual_seed(0)
    path = tmp_path / "mistral"
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path, max_shard_size="100KB")
    build_tokenizer().save_pretrained(path)
    assert (path / "model.safetensors.index.json").is_file()
    save_file({"tok_embeddings.weight": torch.zeros(4, 4), "layers.0.attention.wq.weight": torch.zeros(4, 4)},
              str(path / "consolidated.safetensors"))
    assert_matches_transformers(path)


def test_a_weights_file_that_is_not_safetensors_is_named(tiny_models, tmp_path):
    """A git-lfs pointer left in place of the weights: reading the config still works, loading
    is a ValueError naming the file."""
    path = copy_folder(tiny_models["llama"], tmp_path / "llama")
    (path / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64
                                            + "\nsize 269060552\n")
    assert ModelConfig.from_folder(path).tie_word_embeddings is True
    with pytest.raises(ValueError, match=r"model.safetensors is not a safetensors file \(its header's length"):
        LLM(str(path), dtype="float32", num_kv_blocks=16)


def test_model_safetensors_wins_over_a_stale_index(tiny_models, tmp_path):
    """A folder saved sharded and then whole keeps the old index (save_pretrained deletes the
    shards, not it): transformers reads model.safetensors, and so does fastgen."""
    path = copy_folder(tiny_models["qwen2"], tmp_path / "qwen2")
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))
    assert_matches_transformers(path)


def test_a_weights_file_cut_short_is_named(tiny_models, tmp_path):
    path = copy_folder(tiny_models["llama"], tmp_path / "llama")
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(ValueError, match=r"model.safetensors is cut short: its tensors end at byte"):
        LLM(str(path), dtype="float32", num_kv_blocks=16)
