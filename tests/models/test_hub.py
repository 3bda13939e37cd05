"""A Hugging Face model id resolves to its snapshot in the local cache, offline."""

from __future__ import annotations

import shutil

import pytest
from huggingface_hub import constants

from fastgen import LLM, SamplingParams
from fastgen.models.hub import resolve_model_path


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, tiny_models):
    """A cache laid out as huggingface_hub writes it, holding the tiny Qwen3 as `org/tiny-qwen3`."""
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny-qwen3"
    revision = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny_models["qwen3"], repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return repo / "snapshots" / revision


def test_a_folder_is_itself(tiny_models):
    assert resolve_model_path(tiny_models["qwen3"]) == tiny_models["qwen3"]


def test_a_cached_id_is_its_snapshot_and_runs(hub_cache, tiny_models):
    assert resolve_model_path("org/tiny-qwen3") == str(hub_cache)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    by_id = LLM("org/tiny-qwen3", dtype="float32", num_kv_blocks=16, block_size=16, max_model_len=64)
    by_path = LLM(tiny_models["qwen3"], dtype="float32", num_kv_blocks=16, block_size=16, max_model_len=64)
    assert by_id.generate([1, 2, 3], greedy)[0].token_ids == by_path.generate([1, 2, 3], greedy)[0].token_ids


@pytest.mark.parametrize("name", ["org/not-downloaded", "just-a-name"])
def test_an_id_missing_from_the_cache_is_a_value_error_naming_it(hub_cache, name):
    with pytest.raises(ValueError, match=f"model='{name}' is neither a directory nor a model id"):
        resolve_model_path(name)


@pytest.mark.parametrize("name", ["/no/such/folder", "./relative/missing", "a/b/c"])
def test_a_missing_path_is_not_looked_up_as_an_id(name):
    with pytest.raises(ValueError, match=f"model='{name}' is not a directory"):
        resolve_model_path(name)
