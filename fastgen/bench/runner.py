"""Driving the engine for a benchmark: the warm-up (and the run time it predicts), running a
workload through the one run-to-completion loop, and the engine counters a run reports."""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass, field, replace

from tqdm.auto import tqdm

from fastgen.bench.environment import synchronize
from fastgen.bench.stats import ms, summarize_ms
from fastgen.bench.workload import IntRange, Workload, WorkloadSpec, build_workload
from fastgen.engine.block_manager import hit_rate
from fastgen.engine.run_loop import run_to_completion
from fastgen.outputs import RequestOutput

# Distinct from any seed a user passes with --seed, so warm-up prompts never share a prefix with
# the measured workload (which would turn measured prefills into prefix-cache hits).
_WARMUP_SEED = 2**32 + 7


class HostTime:
    """Exposed host time over a measurement: how long the device sat idle before each step,
    waiting for the host (`fastgen.worker.step_clock`), with each step's own device time. Steps
    are counted from each `restart` (the pauses between iterations, where peers run, are not)."""

    def __init__(self, engine):
        self.engine = engine
        runner = engine.runner
        self.clock = None
        if hasattr(runner, "step_clock"):  # the tensor-parallel runner has none
            from fastgen.worker.step_clock import StepClock

            runner.step_clock = self.clock = StepClock(runner.device)

    def restart(self) -> None:
        """Keep what was measured so far; the next step's wait is not counted."""
        if self.clock is not None:
            self.clock.pause()

    def report(self) -> dict | None:
        """The bench JSON's `host_time` (None without a clock); stops measuring."""
        if self.clock is None:
            return None
        times = self.clock.take()
        self.engine.runner.step_clock = None
        return {"overlap_scheduling": self.engine.overlap,
                "measured_with": "cuda events" if self.clock.on_cuda else "host clock",
                "exposed_host_ms": summarize_ms(times.idle), "device_step_ms": summarize_ms(times.busy)}


@dataclass
class EngineCounters:
    """Engine-lifetime counters, read before and after a measurement to take differences."""

    hit_tokens: int
    queried_tokens: int
    preemptions: int
    decode_tokens: int = 0
    prompt_tokens: int = 0
    mixed_steps: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()

    @classmethod
    def read(cls, engine) -> "EngineCounters":
        stats = engine.stats()
        return cls(stats.prefix_hit_tokens, stats.prefix_queried_tokens, stats.num_preemptions, stats.decode_tokens,
                   stats.prompt_tokens, stats.mixed_steps, stats.draft_tokens, stats.accepted_draft_tokens,
                   stats.accepted_per_position)

    def since(self, earlier: "EngineCounters") -> "EngineCounters":
        now, then = dataclasses.astuple(self)[:-1], dataclasses.astuple(earlier)[:-1]
        counts = [a - b for a, b in zip(now, then)]
        before = earlier.accepted_per_position
        positions = tuple(n - (before[i] if i < len(before) else 0) for i, n in enumerate(self.accepted_per_position))
        return EngineCounters(*counts, positions)

    def step_tokens(self) -> dict[str, int]:
        """The scheduler's choices over the measurement (the bench JSON's `step_tokens`)."""
        return {"decode": self.decode_tokens, "prompt": self.prompt_tokens, "mixed_steps": self.mixed_steps,
                "draft": self.draft_tokens}

    def speculative(self) -> dict | None:
        """Speculative decoding over the measurement (the bench JSON's `speculative`); None
        without drafts."""
        if not self.draft_tokens:
            return None
        return {"draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_draft_tokens,
                "acceptance_rate": self.accepted_draft_tokens / self.draft_tokens,
                "accepted_per_position": list(self.accepted_per_position)}

    @property
    def hit_rate(self) -> float:
        return hit_rate(self.hit_tokens, self.queried_tokens)


@dataclass
class WarmUpTimes:
    """What the warm-up's steps took: seconds per prompt token in prefill, seconds a decode step."""

    prefill_s_per_token: float
    decode_step_s: float

    def estimate_seconds(self, workload: Workload, max_num_seqs: int) -> float:
        """A rough lower bound on a workload's run time: its prompt tokens at the warm-up's
        prefill rate, and its decode steps (output tokens over the widest batch) at the warm-up's
        step time. Larger batches only make steps slower, so the truth is longer."""
        batch = min(max_num_seqs, len(workload.prompts))
        decode_steps = -(-workload.num_output_tokens // batch)
        return workload.num_prompt_tokens * self.prefill_s_per_token + decode_steps * self.decode_step_s


# A workload estimated to run longer than this (from the warm-up) is announced before it starts.
LONG_RUN_NOTICE_S = 600.0


def announce_if_long(estimate_s: float, device_type: str) -> None:
    """Say so before starting a run that will plainly take long (a CPU with the default workload)."""
    if estimate_s > LONG_RUN_NOTICE_S:
        print(f"fastgen: note: this workload will take at least ~{estimate_s / 60:.0f} minutes on {device_type} "
              f"(estimated from the warm-up); --num-prompts, --input-len and --output-len make it smaller",
              file=sys.stderr, flush=True)


def warm_up(engine, max_model_len: int) -> WarmUpTimes:
    """Run a short request alone, then two together (and a draft model's proposal, with one), so
    one-time costs (allocator growth, lazy kernel compilation, torch.compile: the compiled CPU
    step graph) land outside the measurement; return what their steps
    took (the last of each kind: the first pays those one-time costs)."""
    input_len = max(1, min(16, max_model_len // 2))
    output_len = max(1, min(4, max_model_len - input_len))
    spec = WorkloadSpec(2, IntRange(input_len, input_len), IntRange(output_len, output_len), seed=_WARMUP_SEED)
    warmup = build_workload(spec, engine.config.model_config.vocab_size)
    prefill, decode = [0.0], [0.0]

    def record(step) -> None:
        if step.is_prefill:
            prefill.append((time.perf_counter() - step.started_at) / max(step.num_prompt_tokens, 1))
        elif step.is_prefill is not None:
            decode.append(time.perf_counter() - step.started_at)

    drafter = engine.drafter
    if drafter is not None and drafter.model is not None:
        # Whether the requests below draft is the drafter's call: its model is warmed anyway.
        drafter.model.warm_up(input_len)
    alone = build_workload(replace(spec, num_prompts=1), engine.config.model_config.vocab_size)
    run_requests(engine, alone, temperature=0.0, on_step=record)
    run_requests(engine, warmup, temperature=0.0, on_step=record)
    return WarmUpTimes(prefill[-1], decode[-1])


def request_records(outputs: list[RequestOutput]) -> list[dict]:
    """One record a request, in workload order: its lengths and latencies (ms; None if unset)."""
    return [{"input_len": len(o.prompt_token_ids), "output_len": len(o.token_ids),
             "ttft_ms": ms(o.metrics.time_to_first_token), "tpot_ms": ms(o.metrics.time_per_output_token),
             "e2e_ms": ms(o.metrics.e2e_latency)} for o in outputs]


def run_requests(engine, workload: Workload, temperature: float, progress: bool = False,
                 desc: str = "requests", on_step=None) -> list[RequestOutput]:
    """Submit every request of the workload at once and step the engine until all finish.

    Returns the final output of each request, in workload order. All requests are validated
    before any is queued (ValueError, nothing queued, on a bad one). `on_step` sees each step.
    """
    params = workload.sampling_params(temperature)
    states = [engine.prepare(p, sp, final_only=True) for p, sp in zip(workload.prompts, params)]
    mine = {state.request_id for state in states}
    # Advances per output token (its rate is the live decode speed); finished requests and
    # prompt tokens computed so far ride along in the postfix.
    with tqdm(total=workload.num_output_tokens, desc=desc, unit="tok", disable=not progress) as bar:
        done, prompt_tokens = 0, 0

        def each_step(step):
            nonlocal done, prompt_tokens
            done += sum(1 for o in step.outputs if o.finished and o.request_id in mine)
            prompt_tokens += step.num_prompt_tokens
            bar.set_postfix_str(f"{done}/{len(states)} requests, {prompt_tokens} prompt tokens", refresh=False)
            bar.update(step.num_sampled)
            if on_step is not None:
                on_step(step)

        return run_to_completion(engine, states, on_step=each_step)


@dataclass
class IterationTimes:
    """Seconds, host clock, GPU synchronized after each step (with overlap scheduling not: a step
    then ends when the next one is queued); `outputs` are the batch's final
    outputs (their metrics hold each request's TTFT, TPOT and end-to-end latency)."""

    total: float = 0.0
    prefill_steps: list[float] = field(default_factory=list)
    decode_steps: list[float] = field(default_factory=list)
    outputs: list[RequestOutput] = field(default_factory=list)
    decode_step_tokens: list[int] = field(default_factory=list)  # tokens each decode step makes

    @property
    def output_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


def run_iteration(engine, workload, temperature: float, device) -> IterationTimes:
    times = IterationTimes()

    def time_step(step) -> None:
        if not engine.overlap:  # with overlap a sync would stop the next step from queuing behind this one
            synchronize(device)
        if step.is_prefill is not None:
            # A mixed step counts as a prefill step (it computes prompt tokens); a step that
            # verifies drafts and computes no prompt token is a decode step.
            if step.num_prompt_tokens > 0:
                times.prefill_steps.append(time.perf_counter() - step.started_at)
            else:
                times.decode_steps.append(time.perf_counter() - step.started_at)
                # The tokens this step makes: its decodes (each makes one, every request ignoring
                # EOS), or with drafts the tokens read, which a verify step reads at once.
                # (num_sampled alone, under overlap scheduling, counts the step before's.)
                times.decode_step_tokens.append(step.num_sampled if step.num_draft_tokens else step.num_decodes)

    synchronize(device)
    start = time.perf_counter()
    times.outputs = run_requests(engine, workload, temperature, on_step=time_step)
    times.total = time.perf_counter() - start
    return times
