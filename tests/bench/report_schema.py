"""The bench report schema, as a checker the bench tests apply to the real command's output
(docs/bench-json.md describes the same fields for people; the two change together)."""

from __future__ import annotations

import math
from datetime import datetime

from fastgen.bench.report import SCHEMA_VERSION, SCHEMAS

# Field kinds: "str", "int", "number", "bool", "stats" ({p50, p90, p99, mean, min, max, count}),
# "numbers" (list of numbers), "strs" (list of strings), "ints2" ([low, high]); a trailing "?"
# allows null. Fields not listed are allowed: additions do not break readers.
_TOP = {"schema": "str", "schema_version": "int", "command": "strs", "timestamp": "str",
        "environment": "dict", "engine": "dict", "workload": "dict", "results": "dict"}
_ENVIRONMENT = {
    "device_type": "str", "device_name": "str", "num_cpus": "int?", "cuda_version": "str?",
    "python_version": "str", "platform": "str", "torch_version": "str", "triton_version": "str?",
    "transformers_version": "str?", "fastgen_version": "str", "git_revision": "str?", "git_dirty": "bool?",
}
_ENGINE = {
    "model": "str", "model_preset": "str?", "load_format": "str", "architecture": "str",
    "num_parameters": "int", "dtype": "str", "quantization": "str?", "weight_bytes": "int", "device": "str",
    "block_size": "int", "max_num_seqs": "int",
    "max_num_batched_tokens": "int", "max_model_len": "int", "num_kv_blocks": "int", "kv_cache_bytes": "int",
    "enable_prefix_caching": "bool", "speculative_config": "dict?", "enforce_eager": "bool", "cuda_graphs": "bool", "compiled_decode": "bool", "torch_compile": "bool",
    "compile_mode": "str", "compile_s": "number", "compiled_graphs": "dict",
    "attention_backend": "str", "seed": "int", "config": "dict",
}
# `bench serve` measures an endpoint, not an engine of its own.
_ENDPOINT = {"base_url": "str", "model": "str", "vocab_size": "int"}
_WORKLOAD = {
    "throughput": {"num_prompts": "int", "input_len": "ints2", "output_len": "ints2", "prefix_len": "int",
                   "seed": "int", "rounds": "int", "temperature": "number", "warmup": "bool", "detokenize": "bool"},
    "latency": {"batch_size": "int", "input_len": "int", "output_len": "int", "num_iters": "int",
                "num_iters_warmup": "int", "seed": "int", "temperature": "number"},
    "serve": {"num_prompts": "int", "input_len": "ints2", "output_len": "ints2", "prefix_len": "int",
              "seed": "int", "request_rate": "number?", "max_concurrency": "int?", "temperature": "number",
              "stream": "bool"},
}
_RESULTS = {
    "throughput": {
        "elapsed_s": "number", "num_requests": "int", "prompt_tokens": "int", "output_tokens": "int",
        "requests_per_s": "number", "output_tokens_per_s": "number", "total_tokens_per_s": "number",
        "ttft_ms": "stats", "tpot_ms": "stats", "e2e_latency_ms": "stats",
        "prefix_cache_hit_rate": "number", "cached_prompt_tokens": "int", "num_preemptions": "int", "step_tokens": "dict",
        "peak_memory_bytes": "int", "reported_round": "int",
    },
    "latency": {
        "iteration_latency_ms": "stats", "iteration_latencies_ms": "numbers", "ttft_ms": "stats",
        "tpot_ms": "stats", "prefill_step_ms": "stats", "decode_step_ms": "stats",
        "num_prefill_steps": "int", "num_decode_steps": "int", "output_tokens": "int", "decode_rate_basis": "str",
        "output_tokens_per_s": "number", "num_preemptions": "int", "peak_memory_bytes": "int",
    },
    "serve": {
        "elapsed_s": "number", "num_requests": "int", "num_completed": "int", "num_failed": "int",
        "errors": "strs", "prompt_tokens": "int", "output_tokens": "int", "requests_per_s": "number",
        "output_tokens_per_s": "number", "total_tokens_per_s": "number", "ttft_ms": "stats", "tpot_ms": "stats",
        "itl_ms": "stats", "e2e_latency_ms": "stats", "slo_ms": "dict?", "goodput_requests_per_s": "number?",
    },
}
# requests: only with --per-request (one record per request); host_time: not under tensor parallelism.
_OPTIONAL_RESULTS = {"requests": "records", "host_time": "dict"}
_RECORD = {"input_len": "int", "output_len": "int", "ttft_ms": "number?", "tpot_ms": "number?", "e2e_ms": "number?"}
_STATS = {"p50": "number?", "p90": "number?", "p99": "number?", "mean": "number?",
          "min": "number?", "max": "number?", "count": "int"}


def validate_report(doc: object) -> None:
    """Raise ValueError, naming the field's path, unless `doc` is a well-formed bench report:
    a known schema, every required field present with its type, percentiles ordered."""
    if not isinstance(doc, dict):
        raise ValueError(f"report must be a JSON object, got {type(doc).__name__}")
    _check_fields(doc, _TOP, "")
    kind = next((k for k, s in SCHEMAS.items() if s == doc["schema"]), None)
    if kind is None:
        raise ValueError(f"schema={doc['schema']!r} is not one of {sorted(SCHEMAS.values())}")
    if doc["schema_version"] != SCHEMA_VERSION:
        raise ValueError(f"schema_version={doc['schema_version']} does not match schema {doc['schema']!r}")
    try:
        datetime.fromisoformat(doc["timestamp"])
    except ValueError:
        raise ValueError(f"timestamp={doc['timestamp']!r} is not an ISO 8601 date-time") from None
    _check_fields(doc["environment"], _ENVIRONMENT, "environment.")
    _check_fields(doc["engine"], _ENDPOINT if kind == "serve" else _ENGINE, "engine.")
    _check_fields(doc["workload"], _WORKLOAD[kind], "workload.")
    _check_fields(doc["results"], _RESULTS[kind], "results.")
    optional = {k: v for k, v in _OPTIONAL_RESULTS.items() if k in doc["results"]}
    _check_fields(doc["results"], optional, "results.")


def _check_fields(section: dict, fields: dict[str, str], prefix: str) -> None:
    for name, kind in fields.items():
        path = prefix + name
        if name not in section:
            raise ValueError(f"{path} is missing")
        _check_value(section[name], kind, path)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_value(value: object, kind: str, path: str) -> None:
    if kind.endswith("?"):
        if value is None:
            return
        kind = kind[:-1]
    ok = {
        "str": lambda v: isinstance(v, str),
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": _is_number,
        "bool": lambda v: isinstance(v, bool),
        "dict": lambda v: isinstance(v, dict),
        "strs": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
        "numbers": lambda v: isinstance(v, list) and all(_is_number(x) for x in v),
        "ints2": lambda v: isinstance(v, list) and len(v) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) for x in v) and v[0] <= v[1],
        "stats": lambda v: isinstance(v, dict),
        "records": lambda v: isinstance(v, list) and all(isinstance(x, dict) for x in v),
    }[kind](value)
    if not ok:
        raise ValueError(f"{path}={value!r} is not of kind {kind!r}")
    if kind == "records":
        for i, record in enumerate(value):
            _check_fields(record, _RECORD, f"{path}[{i}].")
    if kind == "stats":
        _check_fields(value, _STATS, path + ".")
        p50, p90, p99 = value["p50"], value["p90"], value["p99"]
        if (p50 is None) != (value["count"] == 0):
            raise ValueError(f"{path}: count={value['count']} but p50={p50!r}")
        if p50 is not None and not (value["min"] <= p50 <= p90 <= p99 <= value["max"]):
            raise ValueError(f"{path}: percentiles out of order (min {value['min']}, p50 {p50}, "
                             f"p90 {p90}, p99 {p99}, max {value['max']})")
