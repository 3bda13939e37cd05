"""Two bench reports of one kind, side by side: each headline metric's change, and whether it
got worse by more than a threshold (what `fastgen bench compare --fail-above` gates CI on)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from fastgen.bench.report import SCHEMAS

# (metric path in `results`, +1 when higher is better / -1 when lower is better)
METRICS = {
    "throughput": [
        ("output_tokens_per_s", +1), ("total_tokens_per_s", +1), ("requests_per_s", +1),
        ("ttft_ms.p50", -1), ("ttft_ms.p99", -1), ("tpot_ms.p50", -1), ("tpot_ms.p99", -1),
        ("e2e_latency_ms.p50", -1), ("e2e_latency_ms.p99", -1),
    ],
    "latency": [
        ("output_tokens_per_s", +1), ("iteration_latency_ms.p50", -1), ("iteration_latency_ms.p99", -1),
        ("decode_step_ms.p50", -1), ("decode_step_ms.p99", -1), ("prefill_step_ms.p50", -1),
        ("ttft_ms.p50", -1), ("tpot_ms.p50", -1),
    ],
    "serve": [
        ("output_tokens_per_s", +1), ("total_tokens_per_s", +1), ("requests_per_s", +1),
        ("ttft_ms.p50", -1), ("ttft_ms.p99", -1), ("tpot_ms.p50", -1), ("tpot_ms.p99", -1),
        ("itl_ms.p50", -1), ("itl_ms.p99", -1), ("e2e_latency_ms.p50", -1), ("e2e_latency_ms.p99", -1),
        ("goodput_requests_per_s", +1),
    ],
}
# Settings that make two runs measure different things when they differ.
_SETUP = [("environment", "device_name"), ("engine", "model"), ("engine", "model_preset"), ("engine", "dtype"),
          ("engine", "quantization"), ("engine", "device"), ("engine", "block_size"), ("engine", "max_num_seqs"),
          ("engine", "max_num_batched_tokens"), ("engine", "max_model_len"),
          ("engine", "enable_prefix_caching"), ("engine", "speculative_config"), ("engine", "enforce_eager"),
          ("engine", "cuda_graphs"), ("engine", "compiled_decode"), ("engine", "torch_compile"),
          ("engine", "attention_backend")]


@dataclass(frozen=True)
class Delta:
    """One metric in both runs. worse_pct: how much worse the new run is, in percent of the old
    value (negative when it improved); None when either value is missing or zero."""

    metric: str
    old: float | None
    new: float | None
    worse_pct: float | None

    @property
    def missing(self) -> bool:
        """The baseline has the metric and the new run does not (it failed to measure it)."""
        return self.old is not None and self.new is None

    def worse_than(self, pct: float | None) -> bool:
        """Whether the new run is worse by more than pct percent, or lost the metric (never when
        pct is None)."""
        return pct is not None and (self.missing or (self.worse_pct is not None and self.worse_pct > pct))


def load_report(path: str | Path) -> dict:
    """A bench report from a file; ValueError naming the file when it is not one."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable JSON file ({exc})") from exc
    if not isinstance(doc, dict) or report_kind(doc) is None or not isinstance(doc.get("results"), dict):
        raise ValueError(f"{path}: not a fastgen bench report (schema {doc.get('schema') if isinstance(doc, dict) else None!r})")
    return doc


def report_kind(doc: dict) -> str | None:
    return next((kind for kind, schema in SCHEMAS.items() if schema == doc.get("schema")), None)


def _value(results: dict, path: str) -> float | None:
    value = results
    for key in path.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def compare_reports(old: dict, new: dict) -> list[Delta]:
    """Every headline metric of the reports' kind (ValueError when the kinds differ)."""
    kind = report_kind(old)
    if kind != report_kind(new):
        raise ValueError(f"cannot compare a {old.get('schema')!r} report with a {new.get('schema')!r} report")
    deltas = []
    for metric, better in METRICS[kind]:
        if metric == "goodput_requests_per_s" and old["results"].get("slo_ms") != new["results"].get("slo_ms"):
            continue  # goodput against other bounds measures something else (a setup difference)
        a, b = _value(old["results"], metric), _value(new["results"], metric)
        worse = None
        if a is not None and b is not None and a != 0 and math.isfinite(a) and math.isfinite(b):
            worse = (a - b) / a * 100.0 if better > 0 else (b - a) / a * 100.0
        deltas.append(Delta(metric, a, b, worse))
    return deltas


def setup_differences(old: dict, new: dict) -> list[str]:
    """The settings that differ between the runs (their numbers may not be comparable)."""
    notes = [f"{section}.{key}: {old[section].get(key)!r} -> {new[section].get(key)!r}"
             for section, key in _SETUP
             if isinstance(old.get(section), dict) and isinstance(new.get(section), dict)
             and old[section].get(key) != new[section].get(key)]
    # A report from before `bench serve` recorded `stream` sent streamed requests.
    if _workload(old) != _workload(new):
        notes.append("the workload")
    old_slo, new_slo = old["results"].get("slo_ms"), new["results"].get("slo_ms")
    if old_slo != new_slo:
        notes.append(f"the latency bounds of goodput (slo_ms: {old_slo!r} -> {new_slo!r}; goodput not compared)")
    return notes


def _workload(doc: dict) -> dict | None:
    workload = doc.get("workload")
    if isinstance(workload, dict) and doc.get("schema", "").startswith("fastgen.bench.serve/"):
        return {"stream": True, **workload}
    return workload


def format_comparison(deltas: list[Delta], fail_above: float | None) -> str:
    def number(x: float | None) -> str:
        return f"{'n/a':>12s}" if x is None else f"{x:12.2f}"

    lines = [f"{'metric':26s} {'old':>12s} {'new':>12s} {'change':>9s}"]
    for d in deltas:
        change = "n/a" if d.worse_pct is None else f"{0.0 - d.worse_pct:+8.1f}%"  # (0.0 -: no "-0.0%")
        flag = "  REGRESSION" if d.worse_than(fail_above) else ""
        lines.append(f"{d.metric:26s} {number(d.old)} {number(d.new)} {change:>9s}{flag}")
    return "\n".join(lines)
