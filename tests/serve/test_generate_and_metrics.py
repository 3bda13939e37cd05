"""POST /generate + GET /result round trip (token ids equal transformers' greedy ones), 404 for
an unknown id, and /metrics in Prometheus text that prometheus-client's parser reads."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.conftest import ENGINE_ARGS, metric_values, wait_for

PROMPT = [5, 17, 42, 99, 7]
MAX_TOKENS = 10


def finished_result(server: str, body: dict) -> dict:
    seq_id = httpx.post(f"{server}/generate", json=body, timeout=30).json()["seq_id"]

    def finished():
        doc = httpx.get(f"{server}/result/{seq_id}").json()
        assert doc["status"] in ("waiting", "running", "finished")
        return doc if doc["status"] == "finished" else None

    return wait_for(finished)


def test_generate_returns_an_id_and_result_gives_the_greedy_tokens(server, chat_model, reference):
    doc = finished_result(server, {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                                   "ignore_eos": True})
    assert doc["token_ids"] == reference(chat_model, [PROMPT], MAX_TOKENS)[0]
    assert doc["finish_reason"] == "length" and doc["prompt_token_ids"] == PROMPT
    assert doc["metrics"]["e2e_latency_s"] > 0 and isinstance(doc["text"], str)


def test_a_result_of_n_completions_holds_every_one(server, chat_model, reference):
    doc = finished_result(server, {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                                   "ignore_eos": True, "n": 3})
    greedy = reference(chat_model, [PROMPT], MAX_TOKENS)[0]
    assert [c["index"] for c in doc["outputs"]] == [0, 1, 2]
    assert [c["token_ids"] for c in doc["outputs"]] == [greedy] * 3
    assert [c["finish_reason"] for c in doc["outputs"]] == ["length"] * 3
    assert doc["token_ids"] == greedy and doc["num_output_tokens"] == 3 * MAX_TOKENS


def test_an_unknown_result_id_is_a_404(server):
    response = httpx.get(f"{server}/result/no-such-id")
    assert response.status_code == 404 and response.json()["error"]["param"] == "seq_id"


def test_metrics_parse_and_count_finished_requests(server):
    body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    seq_id = httpx.post(f"{server}/generate", json=body).json()["seq_id"]
    wait_for(lambda: httpx.get(f"{server}/result/{seq_id}").json()["status"] == "finished")
    text = httpx.get(f"{server}/metrics").text
    families = {f.name for f in text_string_to_metric_families(text)}
    assert {"fastgen_time_to_first_token_seconds", "fastgen_time_per_output_token_seconds",
            "fastgen_e2e_request_latency_seconds", "fastgen_num_requests_running", "fastgen_num_requests_waiting",
            "fastgen_kv_cache_blocks_used", "fastgen_kv_cache_blocks_total", "fastgen_prefix_cache_hit_rate",
            "fastgen_num_preemptions", "fastgen_prompt_tokens", "fastgen_generation_tokens"} <= families
    values = metric_values(server)
    assert values["fastgen_time_to_first_token_seconds_count"] >= 1
    assert values["fastgen_generation_tokens_total"] >= 3
    assert values["fastgen_kv_cache_blocks_total"] == ENGINE_ARGS["num_kv_blocks"]
    # The scheduler's choices by kind: this request's prompt, then its decodes (two after the first token).
    assert values['fastgen_step_tokens_total{kind=prompt}'] >= 1
    assert values['fastgen_step_tokens_total{kind=decode}'] >= 2
    assert "fastgen_mixed_steps_total" in values


def test_bench_serve_measures_the_server_and_writes_a_valid_report(server, tmp_path):
    from fastgen.cli.main import main
    from tests.bench.report_schema import validate_report

    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--base-url", server, "--num-prompts", "6", "--input-len", "4:12",
                 "--output-len", "3:6", "--prefix-len", "8", "--request-rate", "50", "--max-concurrency", "4",
                 "--slo", "ttft=60000,tpot=60000", "--per-request", "--quiet", "--output-json", str(out)]) == 0
    doc = json.loads(out.read_text())
    validate_report(doc)
    r = doc["results"]
    assert r["num_completed"] == 6 and r["num_failed"] == 0
    assert 6 * 3 <= r["output_tokens"] <= 6 * 6 and r["ttft_ms"]["count"] == 6
    records = r["requests"]  # --per-request: each request's own numbers, which the summary's are of
    assert len(records) == 6 and sum(x["output_len"] for x in records) == r["output_tokens"]
    assert sum(x["input_len"] for x in records) == r["prompt_tokens"]
    assert sorted(x["ttft_ms"] for x in records)[-1] == pytest.approx(r["ttft_ms"]["max"])
    assert all(x["error"] is None and x["e2e_ms"] >= x["ttft_ms"] for x in records)
    assert r["goodput_requests_per_s"] == pytest.approx(r["requests_per_s"])  # generous SLO: all meet it


def test_bench_serve_sends_plain_requests_with_no_stream(server, tmp_path, capsys):
    """--no-stream: plain completions, timed to their whole answers (no TTFT, TPOT or gaps), and
    an SLO on what it does not measure refused."""
    from fastgen.cli.main import main
    from tests.bench.report_schema import validate_report

    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--base-url", server, "--num-prompts", "5", "--input-len", "4:12",
                 "--output-len", "3:6", "--max-concurrency", "3", "--no-stream", "--slo", "e2e=60000", "--quiet",
                 "--output-json", str(out)]) == 0
    doc = json.loads(out.read_text())
    validate_report(doc)
    r = doc["results"]
    assert doc["workload"]["stream"] is False and r["num_completed"] == 5 and r["num_failed"] == 0
    assert 5 * 3 <= r["output_tokens"] <= 5 * 6 and r["e2e_latency_ms"]["count"] == 5
    assert r["ttft_ms"]["count"] == r["tpot_ms"]["count"] == r["itl_ms"]["count"] == 0
    assert r["goodput_requests_per_s"] == pytest.approx(r["requests_per_s"])
    assert "5 plain requests" in capsys.readouterr().out
    with pytest.raises(SystemExit) as refused:  # argparse's refusal, before the server is asked anything
        main(["bench", "serve", "--base-url", server, "--no-stream", "--slo", "ttft=100", "--quiet"])
    assert refused.value.code == 2
    assert "argument --slo: ['ttft'] are not measured by plain requests (--no-stream)" in capsys.readouterr().err


def test_bench_serve_goodput_counts_only_requests_within_the_slo(server):
    from fastgen.bench.serve_client import RequestTiming
    from fastgen.bench.serve_load import results_of

    fast = RequestTiming(prompt_len=4, sent_at=0.0, chunk_times=[0.01, 0.02, 0.03], done_at=0.03, output_tokens=3)
    slow = RequestTiming(prompt_len=4, sent_at=0.0, chunk_times=[2.0, 2.01], done_at=2.01, output_tokens=2)
    results = results_of([fast, slow], elapsed=2.0, slo={"ttft": 100.0})
    assert results["goodput_requests_per_s"] == pytest.approx(0.5) and results["requests_per_s"] == pytest.approx(1.0)
