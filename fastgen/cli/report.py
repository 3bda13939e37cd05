"""Bench reports: the JSON document (built, checked, written) and its text summary.

The document's schema is described for people in docs/bench-json.md and for machines in the
field tables below, which `validate_report` applies; the two must change together. Versioning:
adding a field keeps the version; renaming, removing or changing the meaning or unit of a field
bumps it (and the `schema` string's `/N` suffix with it).
"""

from __future__ import annotations

import json
import math
import sys
from datetime import datetime, timezone
from pathlib import Path

SCHEMA_VERSION = 1
SCHEMAS = {
    "throughput": f"fastgen.bench.throughput/{SCHEMA_VERSION}",
    "latency": f"fastgen.bench.latency/{SCHEMA_VERSION}",
}

# Field kinds: "str", "int", "number", "bool", "stats" ({p50, p90, p99, mean, min, max, count}),
# "numbers" (list of numbers), "strs" (list of strings), "ints2" ([low, high]); a trailing "?"
# allows null. Fields not listed are allowed: additions do not break readers.
_TOP = {"schema": "str", "schema_version": "int", "command": "strs", "timestamp": "str",
        "environment": "dict", "engine": "dict", "workload": "dict", "results": "dict"}
_ENVIRONMENT = {
    "device_type": "str", "device_name": "str", "num_cpus": "int?", "cuda_version": "str?",
    "python_version": "str", "platform": "str", "torch_version": "str", "triton_version": "str?",
    "transformers_version": "str?", "fastgen_version": "str",
}
_ENGINE = {
    "model": "str", "model_preset": "str?", "load_format": "str", "architecture": "str",
    "num_parameters": "int", "dtype": "str", "device": "str", "block_size": "int", "max_num_seqs": "int",
    "max_num_batched_tokens": "int", "max_model_len": "int", "num_kv_blocks": "int", "kv_cache_bytes": "int",
    "enable_prefix_caching": "bool", "enforce_eager": "bool", "cuda_graphs": "bool", "torch_compile": "bool",
    "attention_backend": "str", "seed": "int",
}
_WORKLOAD = {
    "throughput": {"num_prompts": "int", "input_len": "ints2", "output_len": "ints2", "prefix_len": "int",
                   "seed": "int", "temperature": "number", "warmup": "bool", "detokenize": "bool"},
    "latency": {"batch_size": "int", "input_len": "int", "output_len": "int", "num_iters": "int",
                "num_iters_warmup": "int", "seed": "int", "temperature": "number"},
}
_RESULTS = {
    "throughput": {
        "elapsed_s": "number", "num_requests": "int", "prompt_tokens": "int", "output_tokens": "int",
        "requests_per_s": "number", "output_tokens_per_s": "number", "total_tokens_per_s": "number",
        "ttft_ms": "stats", "tpot_ms": "stats", "e2e_latency_ms": "stats",
        "prefix_cache_hit_rate": "number", "cached_prompt_tokens": "int", "num_preemptions": "int",
        "peak_memory_bytes": "int",
    },
    "latency": {
        "iteration_latency_ms": "stats", "iteration_latencies_ms": "numbers", "ttft_ms": "stats",
        "tpot_ms": "stats", "prefill_step_ms": "stats", "decode_step_ms": "stats",
        "num_prefill_steps": "int", "num_decode_steps": "int", "output_tokens": "int",
        "output_tokens_per_s": "number", "num_preemptions": "int", "peak_memory_bytes": "int",
    },
}
_STATS = {"p50": "number?", "p90": "number?", "p99": "number?", "mean": "number?",
          "min": "number?", "max": "number?", "count": "int"}


def make_report(kind: str, argv: list[str], environment: dict, engine: dict, workload: dict, results: dict) -> dict:
    """Assemble (and validate) the report of a `bench <kind>` run; kind: throughput or latency."""
    doc = {
        "schema": SCHEMAS[kind],
        "schema_version": SCHEMA_VERSION,
        "command": list(argv),
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "environment": environment,
        "engine": engine,
        "workload": workload,
        "results": results,
    }
    validate_report(doc)
    return doc


def write_report(doc: dict, path: str | Path) -> None:
    """Write the document as JSON (the parent folder is created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")


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
    _check_fields(doc["engine"], _ENGINE, "engine.")
    _check_fields(doc["workload"], _WORKLOAD[kind], "workload.")
    _check_fields(doc["results"], _RESULTS[kind], "results.")


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
    }[kind](value)
    if not ok:
        raise ValueError(f"{path}={value!r} is not of kind {kind!r}")
    if kind == "stats":
        _check_fields(value, _STATS, path + ".")
        p50, p90, p99 = value["p50"], value["p90"], value["p99"]
        if (p50 is None) != (value["count"] == 0):
            raise ValueError(f"{path}: count={value['count']} but p50={p50!r}")
        if p50 is not None and not (value["min"] <= p50 <= p90 <= p99 <= value["max"]):
            raise ValueError(f"{path}: percentiles out of order (min {value['min']}, p50 {p50}, "
                             f"p90 {p90}, p99 {p99}, max {value['max']})")


# ---- text summary ------------------------------------------------------------------------------
def _fmt_stats(stats: dict) -> str:
    if stats["p50"] is None:
        return "n/a"
    return f"p50 {stats['p50']:9.2f}   p90 {stats['p90']:9.2f}   p99 {stats['p99']:9.2f}   mean {stats['mean']:9.2f}"


def _header(doc: dict) -> list[str]:
    env, eng = doc["environment"], doc["engine"]
    model = eng["model_preset"] and f"preset {eng['model_preset']} (dummy weights)" or eng["model"]
    graphs = "CUDA graphs" if eng["cuda_graphs"] else "eager"
    compiled = "compiled" if eng["torch_compile"] else "not compiled"
    return [
        f"model      {model}  [{eng['architecture']}, {eng['num_parameters'] / 1e6:.1f}M params, {eng['dtype']}]",
        f"device     {eng['device']} ({env['device_name']}); attention {eng['attention_backend']}, {graphs}, "
        f"{compiled}",
        f"engine     block_size {eng['block_size']}, max_num_seqs {eng['max_num_seqs']}, max_num_batched_tokens "
        f"{eng['max_num_batched_tokens']}, max_model_len {eng['max_model_len']}, {eng['num_kv_blocks']} KV blocks "
        f"({eng['kv_cache_bytes'] / 2**20:.0f} MiB), prefix caching {'on' if eng['enable_prefix_caching'] else 'off'}",
        f"versions   fastgen {env['fastgen_version']}, torch {env['torch_version']}, triton {env['triton_version']}",
    ]


def format_summary(doc: dict) -> str:
    """The report as a few aligned lines for a terminal."""
    r = doc["results"]
    lines = _header(doc)
    if doc["schema"] == SCHEMAS["throughput"]:
        w = doc["workload"]
        lines += [
            f"workload   {r['num_requests']} requests, input {w['input_len'][0]}:{w['input_len'][1]} "
            f"+ prefix {w['prefix_len']}, output {w['output_len'][0]}:{w['output_len'][1]} tokens",
            "",
            f"elapsed             {r['elapsed_s']:10.2f} s",
            f"requests/s          {r['requests_per_s']:10.2f}",
            f"output tokens/s     {r['output_tokens_per_s']:10.1f}   ({r['output_tokens']} tokens)",
            f"total tokens/s      {r['total_tokens_per_s']:10.1f}   ({r['prompt_tokens']} prompt tokens)",
            f"TTFT ms             {_fmt_stats(r['ttft_ms'])}",
            f"TPOT ms             {_fmt_stats(r['tpot_ms'])}",
            f"e2e latency ms      {_fmt_stats(r['e2e_latency_ms'])}",
            f"prefix cache hits   {r['prefix_cache_hit_rate'] * 100:10.1f} %  ({r['cached_prompt_tokens']} tokens)",
            f"preemptions         {r['num_preemptions']:10d}",
            f"peak memory         {r['peak_memory_bytes'] / 2**30:10.2f} GiB",
        ]
    else:
        w = doc["workload"]
        lines += [
            f"workload   batch {w['batch_size']}, input {w['input_len']}, output {w['output_len']} tokens, "
            f"{w['num_iters']} iterations after {w['num_iters_warmup']} warm-up",
            "",
            f"iteration ms        {_fmt_stats(r['iteration_latency_ms'])}",
            f"TTFT ms             {_fmt_stats(r['ttft_ms'])}",
            f"TPOT ms             {_fmt_stats(r['tpot_ms'])}",
            f"prefill step ms     {_fmt_stats(r['prefill_step_ms'])}",
            f"decode step ms      {_fmt_stats(r['decode_step_ms'])}",
            f"output tokens/s     {r['output_tokens_per_s']:10.1f}",
            f"preemptions         {r['num_preemptions']:10d}",
            f"peak memory         {r['peak_memory_bytes'] / 2**30:10.2f} GiB",
        ]
    return "\n".join(lines)


def emit(doc: dict, output_json: str | None) -> None:
    """Print the summary; write the JSON when a path was given. With `-` the JSON goes to
    stdout and the summary to stderr, so the output can be piped into a JSON tool."""
    if output_json == "-":
        print(format_summary(doc), file=sys.stderr)
        json.dump(doc, sys.stdout, indent=2)
        print()
        return
    print(format_summary(doc))
    if output_json:
        write_report(doc, output_json)
        print(f"\nwrote {output_json}")
