"""`fastgen bench --backend PEER`: the same workload through transformers (or llama.cpp) in the
same run, both recorded with their ratio; peers that cannot run are refused before any load."""

from __future__ import annotations

import json
import math

import pytest

from fastgen.bench.workload import IntRange, WorkloadSpec, build_workload
from fastgen.cli.main import main
from tests.bench.report_schema import validate_report
from tests.cli.conftest import CPU_FLAGS
from tests.tiny_models import VOCAB_SIZE

ENGINE = [*CPU_FLAGS, "--block-size", "16", "--max-num-seqs", "4"]


def test_throughput_with_transformers_records_its_run_and_the_ratio(fastgen_cli, tiny_models, tmp_path):
    out = tmp_path / "report.json"
    result = fastgen_cli("bench", "throughput", "--model", tiny_models["llama"], "--num-prompts", "5",
                         "--input-len", "4:12", "--output-len", "3:6", "--backend", "transformers",
                         "--hf-batch-size", "2", *ENGINE, "--quiet", "--output-json", str(out))
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    validate_report(doc)
    r = doc["results"]
    (peer,) = r["peers"]
    assert (peer["backend"], peer["batch_size"]) == ("transformers", 2)
    assert peer["output_tokens"] == r["output_tokens"]  # the same workload, only the asked tokens counted
    assert math.isclose(peer["output_tokens_per_s"], peer["output_tokens"] / peer["elapsed_s"])
    assert math.isclose(peer["fastgen_speedup"], r["output_tokens_per_s"] / peer["output_tokens_per_s"])
    assert "transformers" in result.stdout


@pytest.mark.slow  # a subprocess of several rounds of both engines
def test_throughput_rounds_alternate_with_the_peer_and_report_the_median_round(fastgen_cli, tiny_models, tmp_path):
    """Three rounds of the same requests with fresh token ids each, fastgen then transformers in
    each: the report is the round with the median ratio, and its ratio is that round's own."""
    out = tmp_path / "report.json"
    result = fastgen_cli("bench", "throughput", "--model", tiny_models["llama"], "--num-prompts", "4",
                         "--input-len", "4:12", "--output-len", "3:6", "--backend", "transformers", "--rounds", "3",
                         "--hf-batch-size", "2", *ENGINE, "--quiet", "--output-json", str(out))
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    validate_report(doc)
    r = doc["results"]
    rounds, reported = r["rounds"], r["reported_round"]
    assert [one["seed"] for one in rounds] == [0, 1, 2] and doc["workload"]["seed"] == 0
    # Every round ran the same requests (the lengths drawn with the seed): whichever is reported,
    # the report's work is the same, so reports of one command compare.
    made = sum(build_workload(WorkloadSpec(4, IntRange(4, 12), IntRange(3, 6), seed=0), VOCAB_SIZE).output_lens)
    assert r["output_tokens"] == made
    assert all(round(one["output_tokens_per_s"] * one["elapsed_s"]) == made for one in rounds)
    ratios = [one["peers"][0]["fastgen_speedup"] for one in rounds]
    assert ratios[reported] == sorted(ratios)[1]  # the median of three
    (peer,) = r["peers"]
    assert peer["fastgen_speedup"] == ratios[reported]
    assert math.isclose(peer["fastgen_speedup"], r["output_tokens_per_s"] / peer["output_tokens_per_s"])
    assert r["output_tokens_per_s"] == rounds[reported]["output_tokens_per_s"]
    assert f"the report is round {reported + 1}" in result.stdout


@pytest.mark.slow  # a subprocess of both engines' latency runs
def test_latency_runs_the_peer_after_each_iteration_and_reports_the_median_ratio(fastgen_cli, tiny_models, tmp_path):
    out = tmp_path / "report.json"
    result = fastgen_cli("bench", "latency", "--model", tiny_models["llama"], "--batch-size", "2", "--input-len", "6",
                         "--output-len", "5", "--num-iters", "3", "--num-iters-warmup", "1", "--backend",
                         "transformers", *ENGINE, "--quiet", "--output-json", str(out))
    assert result.returncode == 0, result.stderr
    doc = json.loads(out.read_text())
    validate_report(doc)
    (peer,) = doc["results"]["peers"]
    per_iteration = peer["fastgen_speedup_per_iteration"]
    assert len(per_iteration) == 3 and peer["fastgen_speedup"] == sorted(per_iteration)[1]  # the median of three
    assert peer["backend"] == "transformers" and peer["decode_tokens_per_s"] > 0


@pytest.mark.parametrize(("extra", "message"), [
    ([], "--backend llama.cpp needs --gguf PATH"),
    (["--gguf", "model.gguf", "--batch-size", "2"], "runs one sequence"),
])
def test_latency_refuses_a_llama_cpp_peer_it_cannot_run(capsys, monkeypatch, tiny_models, extra, message):
    monkeypatch.setattr("fastgen.bench.peers.llama_cpp_available", lambda: True)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "latency", "--model", tiny_models["llama"], "--backend", "llama.cpp", *extra, *CPU_FLAGS])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_llama_cpp_peer_is_refused_when_the_package_is_missing(capsys, monkeypatch, tiny_models):
    monkeypatch.setattr("fastgen.bench.peers.llama_cpp_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "latency", "--model", tiny_models["llama"], "--batch-size", "1", "--backend", "llama.cpp",
              "--gguf", "model.gguf", *CPU_FLAGS])
    assert exit_info.value.code == 2
    assert "llama-cpp-python" in capsys.readouterr().err


def test_a_peer_needs_real_weights(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "throughput", "--model-preset", "smollm2-135m", "--backend", "transformers", *CPU_FLAGS])
    assert exit_info.value.code == 2
    assert "--backend needs real weights" in capsys.readouterr().err
