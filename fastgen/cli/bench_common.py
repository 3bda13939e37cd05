"""What both bench commands share: their output flags, the warm-up, and driving the engine."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from tqdm.auto import tqdm

from fastgen.cli import arg_types
from fastgen.bench.workload import IntRange, Workload, WorkloadSpec, build_workload
from fastgen.engine.block_manager import hit_rate
from fastgen.engine.run_loop import run_to_completion
from fastgen.outputs import RequestOutput

# Distinct from any seed a user passes with --seed, so warm-up prompts never share a prefix with
# the measured workload (which would turn measured prefills into prefix-cache hits).
_WARMUP_SEED = 2**32 + 7


def add_output_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("output")
    group.add_argument("--output-json", metavar="PATH", default=None, type=arg_types.output_path,
                       help="also write the results as one JSON document (schema: docs/bench-json.md); "
                       "'-' prints it to stdout and the summary to stderr")
    group.add_argument("--quiet", action="store_true", help="no progress reports on stderr")


@dataclass
class EngineCounters:
    """Engine-lifetime counters, read before and after a measurement to take differences."""

    hit_tokens: int
    queried_tokens: int
    preemptions: int

    @classmethod
    def read(cls, engine) -> "EngineCounters":
        bm = engine.block_manager
        return cls(bm.num_hit_tokens, bm.num_queried_tokens, engine.scheduler.num_preemptions)

    def since(self, earlier: "EngineCounters") -> "EngineCounters":
        return EngineCounters(self.hit_tokens - earlier.hit_tokens, self.queried_tokens - earlier.queried_tokens,
                              self.preemptions - earlier.preemptions)

    @property
    def hit_rate(self) -> float:
        return hit_rate(self.hit_tokens, self.queried_tokens)


def warm_up(engine, max_model_len: int) -> None:
    """Run two short requests, so one-time costs (allocator growth, lazy kernel compilation,
    torch.compile) land outside the measurement."""
    input_len = max(1, min(16, max_model_len // 2))
    output_len = max(1, min(4, max_model_len - input_len))
    spec = WorkloadSpec(2, IntRange(input_len, input_len), IntRange(output_len, output_len), seed=_WARMUP_SEED)
    warmup = build_workload(spec, engine.config.model_config.vocab_size)
    run_requests(engine, warmup, temperature=0.0)


def run_requests(engine, workload: Workload, temperature: float, progress: bool = False,
                 desc: str = "requests", on_step=None) -> list[RequestOutput]:
    """Submit every request of the workload at once and step the engine until all finish.

    Returns the final output of each request, in workload order. All requests are validated
    before any is queued (ValueError, nothing queued, on a bad one). `on_step` sees each step.
    """
    params = workload.sampling_params(temperature)
    states = [engine.prepare(p, sp, final_only=True) for p, sp in zip(workload.prompts, params)]
    with tqdm(total=len(states), desc=desc, unit="req", disable=not progress) as bar:
        def each_step(step):
            bar.update(sum(1 for o in step.outputs if o.finished))
            if on_step is not None:
                on_step(step)

        return run_to_completion(engine, states, on_step=each_step)
