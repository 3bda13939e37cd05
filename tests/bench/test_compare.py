"""`fastgen bench compare`: deltas signed so that + is better, and a gate on regressions."""

from __future__ import annotations

import copy
import json

import pytest

from fastgen.bench.compare import compare_reports, setup_differences
from fastgen.cli.main import main


def report(output_tps: float, ttft_p50: float, kind: str = "throughput") -> dict:
    stats = {"p50": ttft_p50, "p99": ttft_p50 * 2}
    return {"schema": f"fastgen.bench.{kind}/1", "schema_version": 1,
            "environment": {"device_name": "cpu"}, "engine": {"model": "m", "dtype": "float32"},
            "workload": {"num_prompts": 8},
            "results": {"output_tokens_per_s": output_tps, "total_tokens_per_s": output_tps * 2,
                        "requests_per_s": 1.0, "ttft_ms": stats, "tpot_ms": stats, "e2e_latency_ms": stats}}


def test_throughput_down_and_latency_up_are_both_worse():
    deltas = {d.metric: d for d in compare_reports(report(100.0, 10.0), report(80.0, 15.0))}
    assert deltas["output_tokens_per_s"].worse_pct == pytest.approx(20.0)
    assert deltas["ttft_ms.p50"].worse_pct == pytest.approx(50.0)
    assert deltas["requests_per_s"].worse_pct == 0.0
    better = {d.metric: d for d in compare_reports(report(100.0, 10.0), report(125.0, 5.0))}
    assert better["output_tokens_per_s"].worse_pct == pytest.approx(-25.0)
    assert better["ttft_ms.p50"].worse_pct == pytest.approx(-50.0)


def test_reports_of_different_kinds_are_refused():
    with pytest.raises(ValueError, match="cannot compare"):
        compare_reports(report(1.0, 1.0), report(1.0, 1.0, kind="latency"))


def test_setup_differences_are_named():
    new = copy.deepcopy(report(1.0, 1.0))
    new["engine"]["dtype"] = "bfloat16"
    new["workload"]["num_prompts"] = 16
    assert setup_differences(report(1.0, 1.0), new) == ["engine.dtype: 'float32' -> 'bfloat16'", "the workload"]
    # what changes the work an engine does per token, or its batches
    changed = copy.deepcopy(report(1.0, 1.0))
    changed["engine"] |= {"quantization": "int4", "enable_prefix_caching": False, "max_num_batched_tokens": 64,
                          "speculative_config": {"method": "ngram"}}
    assert [note.split(":")[0] for note in setup_differences(report(1.0, 1.0), changed)] == [
        "engine.quantization", "engine.max_num_batched_tokens", "engine.enable_prefix_caching",
        "engine.speculative_config"]


def test_a_serve_report_from_before_stream_was_recorded_counts_as_streamed():
    old, new = report(1.0, 1.0, kind="serve"), report(1.0, 1.0, kind="serve")
    new["workload"]["stream"] = True
    assert setup_differences(old, new) == []
    new["workload"]["stream"] = False
    assert setup_differences(old, new) == ["the workload"]


def write(tmp_path, name: str, doc: dict) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


def test_compare_exits_1_beyond_the_threshold_and_0_within(tmp_path, capsys):
    old, new = write(tmp_path, "old.json", report(100.0, 10.0)), write(tmp_path, "new.json", report(90.0, 10.5))
    assert main(["bench", "compare", old, new]) == 0
    assert main(["bench", "compare", old, new, "--fail-above", "15"]) == 0
    assert main(["bench", "compare", old, new, "--fail-above", "5"]) == 1
    captured = capsys.readouterr()
    assert "REGRESSION" in captured.out and "output_tokens_per_s (+10.0% worse)" in captured.err
    assert "-10.0%" in captured.out


def test_compare_of_a_file_that_is_no_report_exits_2(tmp_path, capsys):
    old = write(tmp_path, "old.json", report(100.0, 10.0))
    bad = write(tmp_path, "bad.json", {"hello": 1})
    assert main(["bench", "compare", old, bad]) == 2
    assert "bad.json: not a fastgen bench report" in capsys.readouterr().err
    assert main(["bench", "compare", old, str(tmp_path / "missing.json")]) == 2


@pytest.mark.parametrize("kind", ["throughput", "latency", "serve"])
def test_every_report_kind_compares(kind, tmp_path, capsys):
    from fastgen.bench.compare import METRICS
    from fastgen.bench.report import SCHEMAS

    assert set(METRICS) == set(SCHEMAS)
    path = write(tmp_path, "run.json", report(100.0, 10.0, kind=kind))
    assert main(["bench", "compare", path, path, "--fail-above", "0"]) == 0
    assert "-0.0%" not in capsys.readouterr().out


def test_a_metric_the_new_run_lost_fails_the_gate(tmp_path, capsys):
    old, new = report(100.0, 10.0), report(100.0, 10.0)
    del new["results"]["ttft_ms"]
    old, new = write(tmp_path, "old.json", old), write(tmp_path, "new.json", new)
    assert main(["bench", "compare", old, new]) == 0
    assert main(["bench", "compare", old, new, "--fail-above", "50"]) == 1
    assert "ttft_ms.p50 (missing from the new run)" in capsys.readouterr().err


def test_goodput_is_compared_only_under_the_same_latency_bounds(tmp_path):
    old, new = report(100.0, 10.0, kind="serve"), report(100.0, 10.0, kind="serve")
    old["results"].update(slo_ms={"e2e": 500.0}, goodput_requests_per_s=2.0)
    new["results"].update(slo_ms=None, goodput_requests_per_s=None)
    assert "goodput_requests_per_s" not in {d.metric for d in compare_reports(old, new)}
    assert setup_differences(old, new)[-1].startswith("the latency bounds of goodput")
    new["results"].update(slo_ms={"e2e": 500.0}, goodput_requests_per_s=1.0)
    goodput = {d.metric: d for d in compare_reports(old, new)}["goodput_requests_per_s"]
    assert goodput.worse_pct == pytest.approx(50.0) and setup_differences(old, new) == []
