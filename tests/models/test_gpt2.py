"""GPT-2's own edges: checkpoints with and without the `transformer.` prefix, the n_positions
limit, its attention-scale switches, and the config switches fastgen refuses. (Greedy parity on
the shared matrix — block sizes, prefix hits, preemption, chunked prefill — lives with the
other families in tests/test_greedy_matches_transformers.py and tests/engine/.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fastgen import LLM, EngineConfig, SamplingParams
from tests.conftest import random_prompts
from tests.tiny_models import build_tiny_model, hf_greedy

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = random_prompts([3, 17, 40], seed=14)


def read_tensors(folder) -> dict[str, torch.Tensor]:
    with safe_open(str(Path(folder) / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def copy_with_tensors(src, dst: Path, tensors: dict[str, torch.Tensor]) -> str:
    """A copy of the model folder `src` whose checkpoint holds `tensors` instead."""
    shutil.copytree(src, dst)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return str(dst)


def greedy(model: str) -> list[list[int]]:
    llm = LLM(model, dtype="float32", block_size=16, num_kv_blocks=64)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_checkpoint_with_transformer_prefix_matches_transformers(tiny_models, reference):
    model = tiny_models["gpt2"]
    assert all(name.startswith("transformer.") for name in read_tensors(model))  # as transformers saves it
    assert greedy(model) == reference(model, PROMPTS, MAX_TOKENS)


def test_old_checkpoint_without_prefix_with_mask_buffers_and_lm_head_matches_transformers(tiny_models, reference,
                                                                                            tmp_path):
    """The layout of the original GPT-2 checkpoints: names without `transformer.`, each layer's
    causal-mask buffers (attn.bias, attn.masked_bias) saved as tensors, and an lm_head saved
    beside the embeddings it is tied to."""
    model = tiny_models["gpt2"]
    tensors = {name.removeprefix("transformer."): t for name, t in read_tensors(model).items()}
    positions = json.loads((Path(model) / "config.json").read_text())["n_positions"]
    for layer in (0, 1):
        tensors[f"h.{layer}.attn.bias"] = torch.tril(torch.ones(positions, positions)).view(1, 1, positions, positions)
        tensors[f"h.{layer}.attn.masked_bias"] = torch.tensor(-1e4)
    tensors["lm_head.weight"] = tensors["wte.weight"].clone()
    old = copy_with_tensors(model, tmp_path / "old-gpt2", tensors)
    assert greedy(old) == reference(model, PROMPTS, MAX_TOKENS)


def test_checkpoint_missing_a_tensor_is_refused(tiny_models, tmp_path):
    tensors = read_tensors(tiny_models["gpt2"])
    del tensors["transformer.h.1.mlp.c_fc.weight"]
    folder = copy_with_tensors(tiny_models["gpt2"], tmp_path / "incomplete", tensors)
    with pytest.raises(ValueError, match=r"checkpoint lacks 1 tensors, e.g. \['h.1.mlp.c_fc.weight'\]"):
        LLM(folder, dtype="float32", num_kv_blocks=8)


def test_max_model_len_defaults_to_and_is_bounded_by_n_positions(tiny_models):
    model = tiny_models["gpt2"]
    assert EngineConfig(model=model).max_model_len == 1024
    with pytest.raises(ValueError, match=r"max_model_len=1025 exceeds the model's n_positions=1024"):
        LLM(model, max_model_len=1025)


def test_attention_scale_switches_match_transformers(tmp_path):
    """Unscaled scores, divided by layer index + 1 instead (scale_attn_weights=False,
    scale_attn_by_inverse_layer_idx=True), as some GPT-2 checkpoints are trained."""
    model = str(build_tiny_model("gpt2", tmp_path / "gpt2-scaled", seed=3, scale_attn_weights=False,
                                 scale_attn_by_inverse_layer_idx=True))
    assert greedy(model) == hf_greedy(model, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(reorder_and_upcast_attn=True), r"reorder_and_upcast_attn=True in .*config.json is not supported"),
        (dict(add_cross_attention=True), r"add_cross_attention=True in .*config.json is not supported"),
        (dict(activation_function="relu"), r"activation_function='relu' in .* supported: \['gelu_new'\]"),
        (dict(n_embd=65), r"n_embd=65 in .* is not a multiple of n_head=4"),
        (dict(n_positions=None), r"config.json has no 'n_positions', which the engine needs"),
    ],
)
def test_unsupported_or_broken_config_is_refused(tiny_models, tmp_path, change, message):
    folder = tmp_path / "changed"
    shutil.copytree(tiny_models["gpt2"], folder)
    raw = json.loads((folder / "config.json").read_text())
    raw.update(change)
    raw = {k: v for k, v in raw.items() if v is not None}
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=str(folder))


def test_gpt2_preset_builds_gpt2_small(private_cache):
    from fastgen.models.presets import preset_model_dir

    llm = LLM(str(preset_model_dir("gpt2")), load_format="dummy", skip_tokenizer_init=True, dtype="float32",
              device="cpu", num_kv_blocks=4)
    model = llm.engine.runner.model
    assert sum(p.numel() for p in model.parameters()) == 124_439_808  # GPT-2 small's, lm_head tied to wte
    assert model.lm_head.weight is model.wte.weight
