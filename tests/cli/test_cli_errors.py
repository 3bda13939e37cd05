"""Values the engine finds too large, or a broken config.json, end the command with one line and
exit status 2 — never a traceback."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from fastgen.cli.main import main

FLAGS = ["--device", "cpu", "--dtype", "float32"]


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("flag, value, name", [
    ("--kv-cache-memory-bytes", "1e30", "kv_cache_memory_bytes="),
    ("--num-kv-blocks", str(10**12), "num_kv_blocks="),
    ("--max-num-seqs", str(10**12), "max_num_seqs="),
    ("--max-num-batched-tokens", str(10**12), "max_num_batched_tokens="),
])
def test_more_memory_than_the_machine_has_exits_2_in_one_line(capsys, tiny_models, flag, value, name):
    assert main(["generate", "--model", tiny_models["qwen3"], *FLAGS, flag, value, "--max-tokens", "2", "hi"]) == 2
    err = one_line_error(capsys)
    assert err.startswith("fastgen: error: ") and name in err and "available" in err


def test_a_config_json_without_a_key_exits_2_naming_file_and_key(capsys, tiny_models, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_models["qwen3"], folder)
    config = json.loads((folder / "config.json").read_text())
    del config["num_attention_heads"]
    (folder / "config.json").write_text(json.dumps(config))
    assert main(["generate", "--model", str(folder), *FLAGS, "hi"]) == 2
    err = one_line_error(capsys)
    assert "config.json has no 'num_attention_heads'" in err


@pytest.mark.parametrize("bench, workload, flags", [
    ("throughput", ["--input-len", "4:60", "--output-len", "4:20"], "--prefix-len \\+ max --input-len \\+ max --output-len"),
    ("latency", ["--input-len", "60", "--output-len", "20"], "--input-len \\+ --output-len"),
])
def test_a_bench_workload_longer_than_max_model_len_exits_2_before_the_model_loads(capsys, tiny_models, monkeypatch,
                                                                                  bench, workload, flags):
    """Named by the flags it came from before anything loads, not by a request a round later."""
    import fastgen.llm

    monkeypatch.setattr(fastgen.llm, "LLM", lambda *a, **k: pytest.fail("the model loaded"))
    assert main(["bench", bench, "--model", tiny_models["qwen3"], *FLAGS, "--max-model-len", "75", *workload]) == 2
    assert re.search(f"{flags} = 80 tokens exceeds --max-model-len 75", one_line_error(capsys))


def test_a_temperature_beyond_float32_exits_2(capsys, tiny_models):
    assert main(["generate", "--model", tiny_models["qwen3"], *FLAGS, "--kv-cache-memory-bytes", "16MiB",
                 "--temperature", "1e39", "hi"]) == 2
    assert "temperature=1e+39 must be a finite number" in one_line_error(capsys)


@pytest.mark.parametrize("flags, says", [
    (["--request-rate", "0"], "argument --request-rate: invalid value '0': must be a number > 0, or inf"),
    (["--timeout", "0"], "argument --timeout: invalid value '0'"),
    (["--no-stream", "--slo", "ttft=500"], "argument --slo: ['ttft'] are not measured by plain requests"),
])
def test_bench_serve_refuses_what_it_cannot_measure_before_contacting_the_server(capsys, flags, says):
    with pytest.raises(SystemExit) as exited:
        main(["bench", "serve", "--base-url", "http://127.0.0.1:1", *flags])
    assert exited.value.code == 2
    assert says in capsys.readouterr().err


def test_bench_serve_takes_inf_as_all_at_once():
    from fastgen.cli.main import build_parser

    assert build_parser().parse_args(["bench", "serve", "--request-rate", "inf"]).request_rate == float("inf")
