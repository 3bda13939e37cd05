"""Summary statistics of latency samples, in the shape the bench reports use."""

from __future__ import annotations

import statistics
from collections.abc import Iterable

import numpy as np

PERCENTILES = (50, 90, 99)


def summarize_ms(seconds: Iterable[float | None]) -> dict:
    """{p50, p90, p99, mean, min, max} in milliseconds, plus count, of the samples given in
    seconds (None samples are skipped; with no samples every statistic is None).

    Percentiles interpolate linearly between samples (numpy's default), so p50 <= p90 <= p99.
    """
    values = np.array([s for s in seconds if s is not None], dtype=np.float64) * 1000.0
    if values.size == 0:
        return {**{f"p{p}": None for p in PERCENTILES}, "mean": None, "min": None, "max": None, "count": 0}
    stats = {f"p{p}": float(v) for p, v in zip(PERCENTILES, np.percentile(values, PERCENTILES))}
    stats.update(mean=float(values.mean()), min=float(values.min()), max=float(values.max()), count=int(values.size))
    return stats


def ms(seconds: float | None) -> float | None:
    """Seconds in milliseconds (None stays None: unmeasured)."""
    return None if seconds is None else seconds * 1000.0


def median(values: list[float]) -> float:
    """The median (the mean of the two middle values of an even count)."""
    return statistics.median(values)


def median_index(values: list[float]) -> int:
    """The index of the median sample: of an even count, the lower of the two middle ones (a
    report that must name one real sample takes the less flattering one)."""
    return sorted(range(len(values)), key=values.__getitem__)[(len(values) - 1) // 2]
