"""Bench reports: the JSON document (built and written) and its text summary.

The document's schema is described for people in docs/bench-json.md and for machines in
tests/bench/report_schema.py, which every bench test applies to the real command's output; the
two must change together. Versioning: adding a field keeps the version; renaming, removing or
changing the meaning or unit of a field bumps it (and the `schema` string's `/N` suffix).
"""

from __future__ import annotations

import json
import sys
from datetime import datetime, timezone
from pathlib import Path

SCHEMA_VERSION = 1
SCHEMAS = {
    "throughput": f"fastgen.bench.throughput/{SCHEMA_VERSION}",
    "latency": f"fastgen.bench.latency/{SCHEMA_VERSION}",
    "serve": f"fastgen.bench.serve/{SCHEMA_VERSION}",
}


def make_report(kind: str, argv: list[str], environment: dict, engine: dict, workload: dict, results: dict) -> dict:
    """Assemble the report of a `bench <kind>` run; kind: throughput, latency or serve (whose
    `engine` section names the endpoint measured: base_url, model, vocab_size)."""
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
    return doc


# The machine is described by `environment`, which loads torch: imported in the two functions
# below, not at the top, so that `bench compare` (which reads SCHEMAS) does not pay for it.
def engine_report(kind: str, argv: list[str], llm, choice, workload: dict, results: dict) -> dict:
    """The report of a run of fastgen's own engine (throughput, latency): the machine it ran on
    and the engine's settings; llm: a `fastgen.LLM`, choice: the `ModelChoice` it was built from."""
    from fastgen.bench.environment import engine_settings, environment_info

    return make_report(kind, argv, environment_info(llm.engine.runner.device), engine_settings(llm, choice),
                       workload, results)


def endpoint_report(argv: list[str], endpoint: dict, workload: dict, results: dict) -> dict:
    """The report of `bench serve`: the client's machine (the server may run on another) and the
    endpoint measured ({base_url, model, vocab_size}) in place of an engine's settings."""
    import torch

    from fastgen.bench.environment import environment_info

    return make_report("serve", argv, environment_info(torch.device("cpu")), endpoint, workload, results)


def write_report(doc: dict, path: str | Path) -> None:
    """Write the document as JSON (the parent folder is created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")


# ---- text summary ------------------------------------------------------------------------------
def _fmt_stats(stats: dict) -> str:
    if stats["p50"] is None:
        return "n/a"
    return f"p50 {stats['p50']:9.2f}   p90 {stats['p90']:9.2f}   p99 {stats['p99']:9.2f}   mean {stats['mean']:9.2f}"


def _header(doc: dict) -> list[str]:
    env, eng = doc["environment"], doc["engine"]
    model = eng["model_preset"] and f"preset {eng['model_preset']} (dummy weights)" or eng["model"]
    decode = ("CUDA graphs" if eng["cuda_graphs"] else
              "compiled decode step" if eng.get("compiled_decode") else "eager decode")
    compiled = "ops compiled" if eng["torch_compile"] else "ops eager"
    return [
        f"model      {model}  [{eng['architecture']}, {eng['num_parameters'] / 1e6:.1f}M params, {eng['dtype']}]",
        f"device     {eng['device']} ({env['device_name']}); attention {eng['attention_backend']}, {decode}, "
        f"{compiled}",
        f"engine     block_size {eng['block_size']}, max_num_seqs {eng['max_num_seqs']}, max_num_batched_tokens "
        f"{eng['max_num_batched_tokens']}, max_model_len {eng['max_model_len']}, {eng['num_kv_blocks']} KV blocks "
        f"({eng['kv_cache_bytes'] / 2**20:.0f} MiB), prefix caching {'on' if eng['enable_prefix_caching'] else 'off'}",
        f"versions   fastgen {env['fastgen_version']}, torch {env['torch_version']}, triton {env['triton_version']}",
    ]


def format_summary(doc: dict) -> str:
    """The report as a few aligned lines for a terminal."""
    r = doc["results"]
    if doc["schema"] == SCHEMAS["serve"]:
        return _serve_summary(doc)
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
        lines += _round_lines(r.get("rounds", []), r.get("reported_round"))
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
            f"decode tokens/s     {r.get('decode_tokens_per_s') or 0:10.1f}   "
            f"({r.get('decode_rate_basis', 'batch / median decode step')})",
            f"preemptions         {r['num_preemptions']:10d}",
            f"peak memory         {r['peak_memory_bytes'] / 2**30:10.2f} GiB",
        ]
    lines += _peer_lines(r.get("peers", []))
    return "\n".join(lines)


def _round_lines(rounds: list[dict], reported: int | None) -> list[str]:
    """With --rounds: every round's output tokens/s and ratios; the reported one marked."""
    if len(rounds) < 2:
        return []
    lines = [f"rounds              {len(rounds):10d}   (the report is round {reported + 1}, the median)"]
    for i, one in enumerate(rounds):
        peers = "".join(f", {p['backend']} {p['output_tokens_per_s']:.1f} (fastgen {p['fastgen_speedup']:.2f}x)"
                        for p in one["peers"])
        mark = "*" if i == reported else " "
        lines.append(f"  round {i + 1:<3}{mark}       {one['output_tokens_per_s']:10.1f} output tokens/s{peers}")
    return lines


def _peer_lines(peers: list[dict]) -> list[str]:
    lines = []
    for peer in peers:
        rate = peer.get("output_tokens_per_s") or peer.get("decode_tokens_per_s")
        kind = "output" if "output_tokens_per_s" in peer else "decode"
        speedup = peer["fastgen_speedup"]
        lines.append(f"{peer['backend']:<19} {rate:10.1f} {kind} tokens/s   (fastgen {speedup:.2f}x, "
                     f"{peer['backend']} {peer['version']})" if speedup else f"{peer['backend']:<19} {rate:10.1f}")
    return [""] + lines if lines else []


def _serve_summary(doc: dict) -> str:
    r, w, e = doc["results"], doc["workload"], doc["engine"]
    rate = "all at once" if w["request_rate"] is None else f"{w['request_rate']} req/s (Poisson)"
    goodput = "n/a (no --slo)" if r["goodput_requests_per_s"] is None else \
        f"{r['goodput_requests_per_s']:10.2f} req/s under {r['slo_ms']} ms"
    return "\n".join([
        f"endpoint   {e['base_url']} ({e['model']})",
        f"workload   {r['num_requests']} {'streamed' if w.get('stream', True) else 'plain'} requests at {rate}, "
        f"concurrency {w['max_concurrency'] or 'unlimited'}, "
        f"input {w['input_len'][0]}:{w['input_len'][1]} + prefix {w['prefix_len']}, "
        f"output {w['output_len'][0]}:{w['output_len'][1]} tokens",
        "",
        f"completed           {r['num_completed']:10d}   ({r['num_failed']} failed)",
        f"elapsed             {r['elapsed_s']:10.2f} s",
        f"requests/s          {r['requests_per_s']:10.2f}",
        f"output tokens/s     {r['output_tokens_per_s']:10.1f}",
        f"total tokens/s      {r['total_tokens_per_s']:10.1f}",
        f"goodput             {goodput}",
        f"TTFT ms             {_fmt_stats(r['ttft_ms'])}",
        f"TPOT ms             {_fmt_stats(r['tpot_ms'])}",
        f"ITL ms              {_fmt_stats(r['itl_ms'])}",
        f"e2e latency ms      {_fmt_stats(r['e2e_latency_ms'])}",
    ])


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
