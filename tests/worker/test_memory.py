"""Settings that ask for more memory than the machine has are refused before anything is
allocated, with a ValueError naming the setting, its value and the limit."""

from __future__ import annotations

import json
import shutil

import pytest

from fastgen import LLM


@pytest.mark.parametrize("kwargs, names", [
    (dict(num_kv_blocks=10**12), ["num_kv_blocks=1000000000000"]),
    (dict(kv_cache_memory_bytes=10**30), ["kv_cache_memory_bytes=10000000000000000000000000000"]),
    (dict(max_num_batched_tokens=10**12), ["max_num_batched_tokens=1000000000000"]),
    (dict(max_num_seqs=10**12), ["max_num_seqs=1000000000000"]),
])
def test_more_than_the_machine_has_is_a_value_error(tiny_models, kwargs, names):
    limit = r"needs \d+ bytes .* more than the \d+ bytes .* of host memory available"
    with pytest.raises(ValueError, match=limit) as info:
        LLM(tiny_models["qwen3"], dtype="float32", device="cpu", skip_tokenizer_init=True, **kwargs)
    for name in names:
        assert name in str(info.value)


def test_a_model_larger_than_memory_is_refused_before_it_is_built(tiny_models, tmp_path):
    folder = tmp_path / "huge"
    shutil.copytree(tiny_models["qwen3"], folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(hidden_size=65536, intermediate_size=262144, num_hidden_layers=1000)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"the model in .*config.json \(hidden_size=65536, num_hidden_layers=1000"):
        LLM(str(folder), dtype="float32", device="cpu", load_format="dummy", skip_tokenizer_init=True,
            num_kv_blocks=64)


def test_available_host_memory_is_positive_and_at_most_the_total():
    import psutil

    from fastgen.worker.memory import available_host_bytes

    assert 0 < available_host_bytes() <= psutil.virtual_memory().total
