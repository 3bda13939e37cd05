"""The latency of one batch, end to end and step by step.

This is what `fastgen bench latency` measures, apart from its command line. Like `vllm bench
latency`: a batch of `batch_size` requests of fixed input and output length runs to completion,
`num_iters_warmup` times unmeasured and then `num_iters` times measured. Each iteration draws
fresh random prompts, so its prefill is computed rather than served from the prefix cache filled
by the previous iteration. Every `engine.step()` is timed on its own (synchronizing the GPU) and
classified as prefill or decode from the scheduler's decision. With peers, each runs every
measured iteration's batch right after fastgen, and the report gives the median ratio.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

from fastgen.bench.environment import peak_memory_bytes, reset_peak_memory
from fastgen.bench.peers import decode_summary, load_peers
from fastgen.bench.runner import (
    EngineCounters,
    HostTime,
    IterationTimes,
    announce_if_long,
    request_records,
    run_iteration,
    warm_up,
)
from fastgen.bench.stats import median, summarize_ms
from fastgen.bench.workload import IntRange, Workload, WorkloadSpec, build_workload


@dataclass(frozen=True)
class LatencySpec:
    """The batch and how often it runs; iteration i draws its prompts with seed + i."""

    batch_size: int
    input_len: int
    output_len: int
    num_iters: int
    num_iters_warmup: int
    seed: int
    temperature: float

    def batch(self, iteration: int, vocab_size: int) -> Workload:
        spec = WorkloadSpec(self.batch_size, IntRange(self.input_len, self.input_len),
                            IntRange(self.output_len, self.output_len), seed=self.seed + iteration)
        return build_workload(spec, vocab_size)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def measure_latency(llm, spec: LatencySpec, *, peers: list[str], gguf: str | None, per_request: bool,
                    progress: bool) -> dict:
    """The `results` section of a latency report (progress: a line on stderr per iteration)."""
    engine, device = llm.engine, llm.engine.runner.device
    vocab = llm.config.model_config.vocab_size

    def batch(iteration: int) -> Workload:
        return spec.batch(iteration, vocab)

    measured: list[IterationTimes] = []
    warm = warm_up(engine, llm.config.max_model_len)
    iterations = spec.num_iters_warmup + spec.num_iters
    announce_if_long(iterations * warm.estimate_seconds(batch(0), llm.config.max_num_seqs), device.type)
    for i in range(spec.num_iters_warmup):
        run_iteration(engine, batch(i), spec.temperature, device)
    loaded = load_peers(peers, llm, gguf, context_len=spec.input_len + spec.output_len)
    for peer in loaded:
        peer.warm_up(batch(0).prompts)
    peer_runs: list[list[tuple[float, float]]] = [[] for _ in loaded]
    reset_peak_memory(device)
    before = EngineCounters.read(engine)
    host_time = HostTime(engine)
    for i in range(spec.num_iters_warmup, iterations):
        host_time.restart()
        measured.append(run_iteration(engine, batch(i), spec.temperature, device))
        # Each peer runs the same batch right after: a slow stretch of a shared machine then
        # slows both sides of an iteration's ratio, not one side of the whole comparison.
        for peer, runs in zip(loaded, peer_runs):
            runs.append(peer.decode_once(batch(i).prompts, spec.output_len))
        if progress:
            print(f"iteration {len(measured)}/{spec.num_iters}: {measured[-1].total * 1000:.1f} ms",
                  file=sys.stderr, flush=True)
    counters = EngineCounters.read(engine).since(before)
    host = host_time.report()

    total_seconds = sum(t.total for t in measured)
    output_tokens = sum(t.output_tokens for t in measured)
    results = {
        "iteration_latency_ms": summarize_ms(t.total for t in measured),
        "iteration_latencies_ms": [t.total * 1000.0 for t in measured],
        "ttft_ms": summarize_ms(o.metrics.time_to_first_token for t in measured for o in t.outputs),
        "tpot_ms": summarize_ms(o.metrics.time_per_output_token for t in measured for o in t.outputs),
        "prefill_step_ms": summarize_ms(x for t in measured for x in t.prefill_steps),
        "decode_step_ms": summarize_ms(x for t in measured for x in t.decode_steps),
        "num_prefill_steps": sum(len(t.prefill_steps) for t in measured),
        "num_decode_steps": sum(len(t.decode_steps) for t in measured),
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / total_seconds,
        "decode_tokens_per_s": _decode_rate(spec.batch_size, measured),
        "decode_rate_basis": "batch / median decode step" if _whole_batch_steps(spec.batch_size, measured)
        else "decode tokens / decode time",
        "num_preemptions": counters.preemptions,
        "peak_memory_bytes": peak_memory_bytes(device),
    }
    if (speculative := counters.speculative()) is not None:
        results["speculative"] = speculative
    if host is not None:
        results["host_time"] = host
    if per_request:
        results["requests"] = [{"iteration": i, **record} for i, t in enumerate(measured)
                               for record in request_records(t.outputs)]
    if loaded:
        results["peers"] = peer_results(spec, loaded, peer_runs, measured)
    return results


def _decode_rate(batch_size: int, measured: list[IterationTimes]) -> float | None:
    """The batch over the median decode step; where steps made another number of tokens than
    the batch (speculative decoding; a batch larger than max_num_seqs or the KV cache holds at
    once, or whose prompts took several steps, so that its sequences started and finish
    decoding apart), the decode steps' tokens over their time."""
    steps = [x for t in measured for x in t.decode_steps]
    tokens = [n for t in measured for n in t.decode_step_tokens]
    if not _whole_batch_steps(batch_size, measured):
        return sum(tokens) / sum(steps)
    return batch_size / median(steps) if steps else None  # the median decode_step_ms.p50 reports


def _whole_batch_steps(batch_size: int, measured: list[IterationTimes]) -> bool:
    """Whether every decode step advanced the whole batch by a token (true of no step)."""
    return all(n == batch_size for t in measured for n in t.decode_step_tokens)


def peer_results(spec: LatencySpec, peers: list, peer_runs: list, measured: list[IterationTimes]) -> list[dict]:
    """Each peer's decode tokens/s and prefill ms (medians over its runs of the measured
    iterations' batches), and fastgen's speedup: the median over iterations of fastgen's decode
    rate in that iteration over the peer's on the same batch right after, each side's rate its
    decode tokens over their total time (the peer decodes the whole batch in each of its
    output_len - 1 steps; fastgen's steps may each advance part of it, or more than a token)."""
    results = []
    for peer, runs in zip(peers, peer_runs):
        ratios = []
        for times, (_, peer_decode_s) in zip(measured, runs):
            if times.decode_steps:
                ratios.append((sum(times.decode_step_tokens) / sum(times.decode_steps)) /
                              (spec.batch_size * (spec.output_len - 1) / peer_decode_s))
        results.append({**decode_summary(peer, runs, spec.batch_size, spec.output_len),
                        "fastgen_speedup": median(ratios) if ratios else None,
                        "fastgen_speedup_per_iteration": ratios})
    return results
