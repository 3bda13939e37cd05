"""The server's Prometheus metrics (prometheus-client), in a registry of its own.

Request latencies are observed from each request's final output (`RequestMetrics`: seconds);
tokens are counted as their outputs are read: a streamed request's as they stream out, a
non-streamed one's (made final-only) at its end, so the tokens of one whose client left first
are not counted there (`fastgen_step_tokens_total` counts every token the engine computed); the
engine's load (running / waiting requests, KV blocks,
prefix-cache hit rate, preemptions) is read at scrape time from the loop's latest `EngineStats`.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from fastgen.engine.stats import EngineStats
from fastgen.outputs import RequestOutput
from fastgen.serve.responses import choices_of

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds; the wide range covers a GPU's milliseconds and a CPU's seconds.
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0)
_TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class _EngineCollector:
    """Reads the engine's snapshot when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], EngineStats]):
        self._stats = stats

    def collect(self):
        s = self._stats()
        yield GaugeMetricFamily("fastgen_num_requests_running", "Requests scheduled in the engine.", s.num_running)
        yield GaugeMetricFamily("fastgen_num_requests_waiting", "Requests queued for a first schedule.",
                                s.num_waiting)
        yield GaugeMetricFamily("fastgen_kv_cache_blocks_used", "KV-cache blocks held by sequences.",
                                s.num_used_kv_blocks)
        yield GaugeMetricFamily("fastgen_kv_cache_blocks_total", "KV-cache blocks.", s.num_kv_blocks)
        yield GaugeMetricFamily("fastgen_prefix_cache_hit_rate",
                                "Share of prompt tokens served from the prefix cache since start.", s.prefix_hit_rate)
        yield CounterMetricFamily("fastgen_num_preemptions", "Sequences preempted since start.",
                                  s.num_preemptions)
        tokens = CounterMetricFamily("fastgen_step_tokens", "Tokens computed since start, by kind.", labels=["kind"])
        tokens.add_metric(["decode"], s.decode_tokens)
        tokens.add_metric(["prompt"], s.prompt_tokens)
        tokens.add_metric(["draft"], s.draft_tokens)
        yield tokens
        yield CounterMetricFamily("fastgen_mixed_steps", "Steps that decoded and computed prompt chunks together.",
                                  s.mixed_steps)
        yield CounterMetricFamily("fastgen_spec_decode_num_draft_tokens",
                                  "Speculative decoding: draft tokens verified since start.", s.draft_tokens)
        yield CounterMetricFamily("fastgen_spec_decode_num_accepted_tokens",
                                  "Speculative decoding: draft tokens accepted since start.", s.accepted_draft_tokens)
        by_position = CounterMetricFamily("fastgen_spec_decode_num_accepted_tokens_per_pos",
                                          "Speculative decoding: accepted draft tokens by draft position (0: first).",
                                          labels=["position"])
        for position, count in enumerate(s.accepted_per_position):
            by_position.add_metric([str(position)], count)
        yield by_position


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats]):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats))
        r = self.registry
        self.ttft = Histogram("fastgen_time_to_first_token_seconds", "Arrival to first output token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("fastgen_time_per_output_token_seconds", "Mean gap between output tokens.",
                              buckets=_TOKEN_GAP_BUCKETS, registry=r)
        self.e2e = Histogram("fastgen_e2e_request_latency_seconds", "Arrival to final output.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("fastgen_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("fastgen_generation_tokens",
                                         "Tokens generated, counted as requests' outputs are read.", registry=r)
        self.finished = Counter("fastgen_requests_finished", "Requests finished, by finish reason.",
                                ["finish_reason"], registry=r)
        self.rejected = Counter("fastgen_requests_rejected", "Requests refused, by HTTP status.", ["status"],
                                registry=r)

    def observe(self, output: RequestOutput) -> None:
        """Count one output's new tokens; observe the request's latencies at its final output."""
        self.generation_tokens.inc(sum(len(c.new_token_ids) for c in choices_of(output)))
        if not output.finished:
            return
        m = output.metrics
        for histogram, seconds in ((self.ttft, m.time_to_first_token), (self.tpot, m.time_per_output_token),
                                   (self.e2e, m.e2e_latency)):
            if seconds is not None:
                histogram.observe(seconds)
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.finished.labels(output.finish_reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
