"""GGUF blocks read as they are: Q8_0 / Q4_0 / Q4_1 into fastgen's layout, checked against the
gguf package's own dequantization, and the default model served from its shipped Q4_1 file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from fastgen import LLM, SamplingParams
from fastgen.quantization.gguf_blocks import BLOCK_TYPES, read_blocks
from fastgen.quantization.quantize import dequantize

# The GPU machine has no gguf package (make gpu-check collects every test module there).
gguf = pytest.importorskip("gguf", reason="the gguf package reads GGUF files")
GGMLQuantizationType, quants = gguf.GGMLQuantizationType, gguf.quants


@pytest.mark.parametrize("type_name", list(BLOCK_TYPES))
def test_blocks_dequantize_to_what_llama_cpp_reads(type_name):
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((6, 96)).astype(np.float32)
    kind = GGMLQuantizationType[type_name]
    data = quants.quantize(weights, kind)
    fmt, tensors = read_blocks("blk.0.ffn_up.weight", type_name, data, 6, 96)
    want = torch.from_numpy(np.asarray(quants.dequantize(data, kind), dtype=np.float32).reshape(6, 96))
    assert torch.equal(dequantize(*tensors, fmt, torch.float32), want)


def test_other_block_types_are_refused_by_name():
    with pytest.raises(ValueError, match=r"GGUF tensor blk\.3\.ffn_down\.weight is Q6_K; fastgen reads Q8_0, Q4_0, "
                                         r"Q4_1 blocks"):
        read_blocks("blk.3.ffn_down.weight", "Q6_K", np.zeros((1, 210), np.uint8), 1, 256)


def test_a_file_mixing_block_types_within_a_merged_matrix_is_served_from_its_converted_weights(monkeypatch):
    """fastgen serves q|k|v and gate|up as one matrix of one block type: a file quantized with
    per-tensor overrides (llama-quantize's) that mixes them there is not read as blocks by
    default, rather than refused (a float part is taken from the converted folder, as before)."""
    from types import SimpleNamespace

    from fastgen.models import gguf_weights

    def file_of(**types):
        tensors = [SimpleNamespace(name=name, tensor_type=SimpleNamespace(name=kind))
                   for name, kind in {"token_embd.weight": "Q4_1", "output_norm.weight": "F32",
                                      "blk.0.attn_q.weight": "Q4_1", "blk.0.attn_k.weight": "Q4_1",
                                      "blk.0.attn_v.weight": "Q4_1", "blk.0.ffn_gate.weight": "Q4_1",
                                      "blk.0.ffn_up.weight": "Q4_1", "blk.1.attn_v.weight": "Q8_0", **types}.items()]
        monkeypatch.setattr(gguf_weights, "read_tensors", lambda path: tensors)
        return gguf_weights.reads_every_matrix("model.gguf")

    assert file_of()  # blk.1's v alone of its kind in blk.1: one type per merged matrix
    assert file_of(**{"blk.0.attn_v.weight": "F16"})
    assert not file_of(**{"blk.0.attn_v.weight": "Q8_0"})
    assert not file_of(**{"blk.0.ffn_up.weight": "Q4_0"})
    assert not file_of(**{"blk.0.attn_k.weight": "Q5_0"})  # a block type fastgen does not read


def test_gguf_needs_a_model_converted_from_one(tiny_models):
    with pytest.raises(ValueError, match=r"quantization='gguf' needs a model converted from a GGUF file .* is not one"):
        LLM(tiny_models["llama"], quantization="gguf")


@pytest.mark.slow
def test_a_gguf_model_is_served_from_its_own_blocks(tmp_path, private_cache):
    """The default model's shipped Q4_1 file given as the model: converted once into the cache,
    served from its blocks by default; its greedy tokens in float32 equal transformers' on the
    same file dequantized to float32 (the weights the blocks stand for)."""
    from safetensors.torch import save_file

    from fastgen.models.default_model import find_default_gguf
    from fastgen.models.gguf_tensors import read_llama_gguf_tensors
    from tests.tiny_models import hf_greedy

    gguf_file = find_default_gguf()
    llm = LLM(str(gguf_file), dtype="float32", max_model_len=256, num_kv_blocks=8, block_size=32)
    assert llm.config.quantization == "gguf" and llm.config.gguf_file == str(gguf_file.resolve())
    folder = Path(llm.config.model)
    assert folder.parent == private_cache / "gguf"
    model = llm.engine.runner.model
    assert model.layers[0].self_attn.qkv_proj.quant_format.has_mins  # Q4_1
    assert model.lm_head.weight_codes is model.embed_tokens.weight_codes  # tied, Q8_0
    reference = tmp_path / "f32"
    reference.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (reference / name).write_bytes((folder / name).read_bytes())
    config = llm.engine.config.model_config
    save_file(read_llama_gguf_tensors(gguf_file, config.num_heads, config.num_kv_heads, torch.float32),
              str(reference / "model.safetensors"))
    prompts = [llm.tokenizer.encode(text) for text in ("The capital of France is", "def fibonacci(n):")]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = [out.token_ids for out in llm.generate(prompts, greedy)]
    assert got == hf_greedy(reference, prompts, 12)
