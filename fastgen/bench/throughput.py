"""Offline throughput: a workload submitted all at once and run to completion, in rounds.

This is what `fastgen bench throughput` measures, apart from its command line, so the
measurement reads as one sequence: build each round's workload, warm up, load the peers, run
every round (fastgen, then each peer on the same prompts), and report the median round. Every
request arrives at t=0 and the engine runs them with continuous batching as fast as it can; the
clock covers submitting, scheduling, the model, sampling and detokenization (when the engine
has a tokenizer). Per-request timings (TTFT, TPOT, end-to-end) come from the engine's own
request metrics, so TTFT includes the time a request waited for a batch slot.
"""

from __future__ import annotations

import time

from fastgen.bench.environment import peak_memory_bytes, reset_peak_memory, synchronize
from fastgen.bench.peers import load_peers
from fastgen.bench.runner import (
    EngineCounters,
    HostTime,
    announce_if_long,
    request_records,
    run_requests,
    warm_up,
)
from fastgen.bench.stats import median_index, summarize_ms
from fastgen.bench.workload import Workload, WorkloadSpec, build_workload, with_fresh_tokens


def measure_throughput(llm, spec: WorkloadSpec, *, rounds: int, temperature: float, warmup: bool,
                       peers: list[str], hf_batch_size: int, per_request: bool, progress: bool) -> dict:
    """The `results` section of a throughput report: the median round's numbers (by fastgen's
    ratio to the first peer where there is one, else by output tokens/s), with every round's
    rates under `rounds`. Every round runs the requests drawn with seed spec.seed (their
    lengths), round r with token ids drawn with spec.seed + r: rounds differ in nothing that
    sets their work, so the median round is not the one with the least of it."""
    engine, device = llm.engine, llm.engine.runner.device
    vocab = llm.config.model_config.vocab_size
    first = build_workload(spec, vocab)
    workloads = [first] + [with_fresh_tokens(first, spec.seed + r, vocab) for r in range(1, rounds)]
    if warmup:
        warm = warm_up(engine, llm.config.max_model_len)
        announce_if_long(rounds * warm.estimate_seconds(workloads[0], llm.config.max_num_seqs), device.type)
    loaded = load_peers(peers, llm, gguf=None, context_len=spec.max_seq_len)
    synchronize(device)
    reset_peak_memory(device)
    measured = []
    for r, workload in enumerate(workloads):
        desc = "bench" if rounds == 1 else f"bench {r + 1}/{rounds}"
        measured.append(measure_round(engine, device, workload, temperature, loaded, hf_batch_size,
                                      per_request=per_request, progress=progress, desc=desc))
    # The round reported is the median one: by fastgen's ratio to the (first) peer where there is
    # one, so the ratio quoted is one real round's; else by fastgen's output tokens/s.
    reported = median_index([runs[0]["fastgen_speedup"] if runs else res["output_tokens_per_s"]
                             for res, runs in measured])
    results, peer_runs = measured[reported]
    results["peak_memory_bytes"] = peak_memory_bytes(device)
    results["reported_round"] = reported
    results["rounds"] = [{"seed": spec.seed + r, "elapsed_s": res["elapsed_s"],
                          "output_tokens_per_s": res["output_tokens_per_s"],
                          "peers": [{"backend": p["backend"], "output_tokens_per_s": p["output_tokens_per_s"],
                                     "fastgen_speedup": p["fastgen_speedup"]} for p in runs]}
                         for r, (res, runs) in enumerate(measured)]
    if peer_runs:
        results["peers"] = peer_runs
    return results


def measure_round(engine, device, workload: Workload, temperature: float, peers: list, hf_batch_size: int, *,
                  per_request: bool, progress: bool, desc: str) -> tuple[dict, list]:
    """One round: the workload through fastgen (its results), then through each peer (each
    result with fastgen's output rate over the peer's, both from this round)."""
    before = EngineCounters.read(engine)
    host_time = HostTime(engine)
    start = time.perf_counter()
    outputs = run_requests(engine, workload, temperature, progress=progress, desc=desc)
    synchronize(device)
    elapsed = time.perf_counter() - start
    counters = EngineCounters.read(engine).since(before)
    host = host_time.report()
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(o.token_ids) for o in outputs)
    results = {
        "elapsed_s": elapsed,
        "num_requests": len(outputs),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "requests_per_s": len(outputs) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "ttft_ms": summarize_ms(o.metrics.time_to_first_token for o in outputs),
        "tpot_ms": summarize_ms(o.metrics.time_per_output_token for o in outputs),
        "e2e_latency_ms": summarize_ms(o.metrics.e2e_latency for o in outputs),
        "prefix_cache_hit_rate": counters.hit_rate,
        "cached_prompt_tokens": sum(o.metrics.num_cached_tokens for o in outputs),
        "num_preemptions": counters.preemptions,
        "step_tokens": counters.step_tokens(),
    }
    if (speculative := counters.speculative()) is not None:
        results["speculative"] = speculative
    if host is not None:
        results["host_time"] = host
    if per_request:
        results["requests"] = request_records(outputs)
    peer_runs = []
    for peer in peers:
        result = peer.throughput(workload.prompts, workload.output_lens, hf_batch_size)
        peer_runs.append({**result, "fastgen_speedup": results["output_tokens_per_s"] / result["output_tokens_per_s"]})
    return results, peer_runs
