"""`fastgen bench throughput` / `bench latency`: the real commands on tiny models, their JSON
checked against the schema and against the workload they were given."""

from __future__ import annotations

import copy
import json
import math
import subprocess
from pathlib import Path

import pytest

from fastgen.bench.workload import IntRange, WorkloadSpec, build_workload
from fastgen.cli.main import main
from tests.bench.report_schema import validate_report
from tests.cli.conftest import CPU_FLAGS
from tests.tiny_models import VOCAB_SIZE

ROOT = Path(__file__).resolve().parents[2]
WORKLOAD = ["--num-prompts", "8", "--input-len", "4:32", "--output-len", "4:16", "--seed", "3"]
WORKLOAD_SPEC = WorkloadSpec(8, IntRange(4, 32), IntRange(4, 16), prefix_len=32, seed=3)
# Four sequences at a time: the second four are admitted after the first four's prefix blocks
# are computed and keyed, so they hit the prefix cache.
ENGINE = [*CPU_FLAGS, "--block-size", "16", "--max-num-seqs", "4"]


def _bench(fastgen_cli, tmp_path, *args: str) -> dict:
    out = tmp_path / "report.json"
    result = fastgen_cli("bench", *args, "--quiet", "--output-json", str(out))
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    validate_report(doc)
    return doc


@pytest.fixture(scope="module")
def prefix_run(fastgen_cli, tiny_models, tmp_path_factory) -> dict:
    return _bench(fastgen_cli, tmp_path_factory.mktemp("prefix"), "throughput", "--model", tiny_models["qwen3"],
                  *WORKLOAD, "--prefix-len", "32", *ENGINE, "--per-request")


@pytest.fixture(scope="module")
def uncached_run(fastgen_cli, tiny_models, tmp_path_factory) -> dict:
    # 8 blocks of 16 tokens cannot hold four sequences of up to 80 tokens: forces preemptions.
    return _bench(fastgen_cli, tmp_path_factory.mktemp("uncached"), "throughput", "--model", tiny_models["llama"],
                  *WORKLOAD, "--prefix-len", "32", *ENGINE, "--no-enable-prefix-caching", "--num-kv-blocks", "8")


# ---- bench throughput ----------------------------------------------------------------------------
def test_throughput_totals_equal_the_workload_drawn_from_the_same_seed(prefix_run):
    workload = build_workload(WORKLOAD_SPEC, VOCAB_SIZE)
    results = prefix_run["results"]
    assert results["num_requests"] == 8
    assert results["prompt_tokens"] == workload.num_prompt_tokens
    assert results["output_tokens"] == workload.num_output_tokens
    assert prefix_run["workload"]["input_len"] == [4, 32]
    assert prefix_run["workload"]["prefix_len"] == 32


def test_throughput_rates_are_totals_over_elapsed_time(prefix_run):
    r = prefix_run["results"]
    assert r["elapsed_s"] > 0
    assert math.isclose(r["requests_per_s"], r["num_requests"] / r["elapsed_s"], rel_tol=1e-9)
    assert math.isclose(r["output_tokens_per_s"], r["output_tokens"] / r["elapsed_s"], rel_tol=1e-9)
    assert math.isclose(r["total_tokens_per_s"], (r["prompt_tokens"] + r["output_tokens"]) / r["elapsed_s"],
                        rel_tol=1e-9)


def test_throughput_latency_percentiles_are_ordered_and_within_the_run(prefix_run):
    r = prefix_run["results"]
    for key in ("ttft_ms", "tpot_ms", "e2e_latency_ms"):
        stats = r[key]
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"], key
    assert r["ttft_ms"]["count"] == r["e2e_latency_ms"]["count"] == 8
    # Every request arrived at t=0 and finished before the clock stopped.
    assert r["e2e_latency_ms"]["max"] <= r["elapsed_s"] * 1000
    assert r["ttft_ms"]["max"] <= r["e2e_latency_ms"]["max"]


def test_throughput_with_shared_prefix_hits_the_prefix_cache(prefix_run):
    r = prefix_run["results"]
    assert 0 < r["prefix_cache_hit_rate"] <= 1
    assert r["cached_prompt_tokens"] > 0 and r["cached_prompt_tokens"] % 16 == 0


def test_throughput_reports_the_engine_it_ran(prefix_run):
    engine, env = prefix_run["engine"], prefix_run["environment"]
    assert engine["architecture"] == "Qwen3ForCausalLM"
    assert (engine["block_size"], engine["max_num_seqs"], engine["dtype"]) == (16, 4, "float32")
    assert engine["max_model_len"] == 32 + 32 + 16  # prefix + max input + max output
    assert engine["enable_prefix_caching"] is True and engine["attention_backend"] == "torch"
    assert engine["kv_cache_bytes"] == 16 * 2**20
    assert env["device_type"] == "cpu" and env["torch_version"]
    assert prefix_run["command"][:3] == ["fastgen", "bench", "throughput"]
    assert prefix_run["results"]["peak_memory_bytes"] > 0


def test_throughput_records_each_request_with_per_request(prefix_run):
    records = prefix_run["results"]["requests"]
    workload = build_workload(WORKLOAD_SPEC, VOCAB_SIZE)
    assert [r["input_len"] for r in records] == [len(p) for p in workload.prompts]
    assert [r["output_len"] for r in records] == workload.output_lens
    assert all(0 < r["ttft_ms"] <= r["e2e_ms"] for r in records)


def test_throughput_report_names_the_revision_and_the_whole_config(prefix_run):
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    if head.returncode == 0:
        assert prefix_run["environment"]["git_revision"] == head.stdout.strip()
    config = prefix_run["engine"]["config"]
    assert (config["block_size"], config["max_num_seqs"], config["dtype"]) == (16, 4, "float32")
    assert config["model"] == prefix_run["engine"]["model"]


def test_uncached_run_has_no_request_records(uncached_run):
    assert "requests" not in uncached_run["results"]


def test_throughput_without_prefix_caching_has_no_hits_and_counts_preemptions(uncached_run):
    r = uncached_run["results"]
    assert uncached_run["engine"]["enable_prefix_caching"] is False
    assert r["prefix_cache_hit_rate"] == 0 and r["cached_prompt_tokens"] == 0
    assert r["num_preemptions"] > 0
    # Preempted requests are recomputed, never cut short.
    assert r["output_tokens"] == build_workload(WORKLOAD_SPEC, VOCAB_SIZE).num_output_tokens


def test_dummy_preset_runs_end_to_end(fastgen_cli, tmp_path):
    doc = _bench(fastgen_cli, tmp_path, "throughput", "--model-preset", "smollm2-135m", "--num-prompts", "2",
                 "--input-len", "4", "--output-len", "3", "--no-warmup", "--block-size", "16", *CPU_FLAGS)
    engine = doc["engine"]
    assert (engine["model_preset"], engine["load_format"]) == ("smollm2-135m", "dummy")
    assert engine["num_parameters"] == 134_515_008  # SmolLM2-135M's, embeddings tied
    assert doc["results"]["output_tokens"] == 6


# ---- bench latency -------------------------------------------------------------------------------
def test_latency_report_counts_steps_and_tokens(fastgen_cli, tiny_models, tmp_path):
    doc = _bench(fastgen_cli, tmp_path, "latency", "--model", tiny_models["llama"], "--batch-size", "4",
                 "--input-len", "8", "--output-len", "6", "--num-iters", "3", "--num-iters-warmup", "1", *ENGINE,
                 "--per-request")
    r = doc["results"]
    assert doc["workload"]["batch_size"] == 4
    assert r["output_tokens"] == 3 * 4 * 6
    # The whole batch prefills in one step (its first token), then decodes the other five.
    assert r["num_prefill_steps"] == 3 and r["num_decode_steps"] == 3 * 5
    assert r["decode_step_ms"]["count"] == 15 and r["ttft_ms"]["count"] == 12
    assert len(r["iteration_latencies_ms"]) == 3
    assert math.isclose(r["iteration_latency_ms"]["mean"], sum(r["iteration_latencies_ms"]) / 3)
    assert math.isclose(r["output_tokens_per_s"], 72 / (sum(r["iteration_latencies_ms"]) / 1000))
    for key in ("iteration_latency_ms", "ttft_ms", "tpot_ms", "prefill_step_ms", "decode_step_ms"):
        assert 0 < r[key]["p50"] <= r[key]["p90"] <= r[key]["p99"], key
    assert r["decode_step_ms"]["max"] <= r["iteration_latency_ms"]["max"]
    assert [rec["iteration"] for rec in r["requests"]] == [0] * 4 + [1] * 4 + [2] * 4
    assert all((rec["input_len"], rec["output_len"]) == (8, 6) for rec in r["requests"])


def test_a_long_workload_is_announced_before_it_starts(capsys, monkeypatch, tiny_models):
    monkeypatch.setattr("fastgen.bench.runner.LONG_RUN_NOTICE_S", 0.0)
    status = main(["bench", "throughput", "--model", tiny_models["qwen3"], *CPU_FLAGS, "--num-prompts", "2",
                   "--input-len", "4", "--output-len", "2", "--quiet"])
    assert status == 0
    assert "fastgen: note: this workload will take at least" in capsys.readouterr().err


# ---- flags ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, words", [
    ([], ["bench", "generate"]),
    (["bench"], ["throughput", "latency"]),
    (["bench", "throughput"], ["--num-prompts", "--input-len", "--prefix-len", "--output-json", "--model-preset",
                               "--no-enable-prefix-caching", "--kv-cache-memory-bytes", "(default: 256)", "examples:"]),
    (["bench", "latency"], ["--batch-size", "--num-iters", "--num-iters-warmup", "--output-json", "examples:"]),
])
def test_help_exits_0_and_names_the_key_flags(capsys, argv, words):
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for word in words:
        assert word in out


@pytest.mark.parametrize("argv, flag, value", [
    (["--input-len", "0"], "--input-len", "'0'"),
    (["--input-len", "9:3"], "--input-len", "'9:3'"),
    (["--output-len", "a:b"], "--output-len", "'a:b'"),
    (["--num-prompts", "-2"], "--num-prompts", "'-2'"),
    (["--block-size", "-1"], "--block-size", "'-1'"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization", "'1.5'"),
    (["--kv-cache-memory-bytes", "4XB"], "--kv-cache-memory-bytes", "'4XB'"),
    (["--device", "gpu"], "--device", "'gpu'"),
    (["--seed", str(2**64)], "--seed", f"'{2**64}'"),
    (["--kv-cache-memory-bytes", "1e400"], "--kv-cache-memory-bytes", "'1e400'"),
    (["--output-json", "."], "--output-json", "'.'"),
    (["--model-preset", "gpt-9"], "--model-preset", "'gpt-9'"),
    (["--load-format", "dummy"], "--load-format", "'dummy'"),
    (["--model-preset", "qwen3-0.6b", "--load-format", "safetensors"], "--load-format", "'safetensors'"),
])
def test_bad_flag_values_exit_2_naming_flag_and_value(capsys, private_cache, argv, flag, value):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "throughput", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert flag in err and value in err, err


def test_bad_latency_flag_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "latency", "--batch-size", "0"])
    assert exit_info.value.code == 2
    assert "--batch-size" in capsys.readouterr().err


def test_a_workload_the_engine_would_refuse_prints_one_line_and_exits_2(capsys, tiny_models):
    status = main(["bench", "throughput", "--model", tiny_models["qwen3"], *CPU_FLAGS, "--max-model-len", "8",
                   "--num-prompts", "2", "--input-len", "16", "--output-len", "4", "--quiet", "--no-warmup"])
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("fastgen: error: ") and "exceeds --max-model-len 8" in err and "Traceback" not in err


@pytest.mark.parametrize("family,limit", [("qwen3", "max_position_embeddings=1024"), ("gpt2", "n_positions=1024")])
def test_workload_longer_than_the_model_context_names_the_flags(capsys, tiny_models, family, limit):
    status = main(["bench", "throughput", "--model", tiny_models[family], *CPU_FLAGS, "--input-len", "2000",
                   "--output-len", "4", "--quiet"])
    err = capsys.readouterr().err
    assert status == 2 and "--input-len" in err and limit in err


def test_validate_report_names_the_bad_field(prefix_run):
    for path, value, message in [
        (("results", "output_tokens"), "12", "results.output_tokens"),
        (("results", "ttft_ms", "p90"), -1.0, "results.ttft_ms"),
        (("schema",), "fastgen.bench.throughput/0", "schema="),
        (("timestamp",), "yesterday", "timestamp="),
    ]:
        doc = copy.deepcopy(prefix_run)
        *parents, last = path
        section = doc
        for key in parents:
            section = section[key]
        section[last] = value
        with pytest.raises(ValueError, match=message.replace(".", r"\.")):
            validate_report(doc)
    doc = copy.deepcopy(prefix_run)
    del doc["engine"]["block_size"]
    with pytest.raises(ValueError, match=r"engine\.block_size is missing"):
        validate_report(doc)


def test_speculative_decoding_is_reported_and_changes_no_total(tiny_models, tmp_path):
    config = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    out = tmp_path / "report.json"
    main(["bench", "throughput", "--model", tiny_models["qwen3"], *WORKLOAD, *ENGINE, "--speculative-config", config,
          "--temperature", "0", "--quiet", "--output-json", str(out)])
    doc = json.loads(out.read_text())
    validate_report(doc)
    r = doc["results"]
    spec = r["speculative"]
    assert spec["draft_tokens"] == r["step_tokens"]["draft"] > 0
    assert 0 <= spec["accepted_tokens"] == sum(spec["accepted_per_position"]) <= spec["draft_tokens"]
    assert doc["engine"]["speculative_config"]["num_speculative_tokens"] == 3
    workload = build_workload(WorkloadSpec(8, IntRange(4, 32), IntRange(4, 16), seed=3), VOCAB_SIZE)
    assert r["output_tokens"] == sum(workload.output_lens)


def test_a_draft_model_is_warmed_up_and_reported(tiny_models, tmp_path):
    config = json.dumps({"method": "draft_model", "model": tiny_models["qwen3"], "num_speculative_tokens": 2})
    out = tmp_path / "report.json"
    main(["bench", "throughput", "--model", tiny_models["qwen3"], *WORKLOAD, *ENGINE, "--speculative-config", config,
          "--temperature", "0", "--quiet", "--output-json", str(out)])
    doc = json.loads(out.read_text())
    validate_report(doc)
    assert doc["engine"]["speculative_config"]["model"] == tiny_models["qwen3"]
    workload = build_workload(WorkloadSpec(8, IntRange(4, 32), IntRange(4, 16), seed=3), VOCAB_SIZE)
    assert doc["results"]["output_tokens"] == sum(workload.output_lens)


@pytest.mark.parametrize("value, words", [
    ('{"num_speculative_tokens": 0}', "speculative_config['num_speculative_tokens']=0 must be >= 1"),
    ("ngram", "invalid JSON 'ngram'"),
    ('{"method": "draft_model"}', "speculative_config['model']=None must name the draft model"),
])
def test_a_bad_speculative_config_exits_2_naming_it(capsys, value, words):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "throughput", "--speculative-config", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--speculative-config" in err and words in err, err
