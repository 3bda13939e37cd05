"""The performance check (benchmarks/perf_check.py) fails on a real 2x slowdown and passes an
unchanged rerun.

The slowdown is injected through FASTGEN_BENCH_INJECT_SLOWDOWN, a hook of the benchmark harness
(benchmarks/conftest.py) that stretches each timed call; engine code is untouched. The end-to-end
tests run two quick benchmarks, not the whole suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.conftest import SLOWDOWN_ENV, stretched
from benchmarks.perf_check import DEFAULT_FAIL_ON, parse_fail_on, regressed

REPO_ROOT = Path(__file__).resolve().parents[2]
PERF_CHECK = REPO_ROOT / "benchmarks" / "perf_check.py"
# Two quick, pure-host benchmarks (about 0.3 ms a round): a few seconds each.
SUBSET = "no-prefix-hit or greedy-batch1"
SUBSET_NAMES = {
    "bench_block_manager.py::test_allocate_and_free_2048_token_prompt[no-prefix-hit]",
    "bench_sampler.py::test_sampler[greedy-batch1]",
}


def perf_check(command: str, results_dir: Path, slowdown: float | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != SLOWDOWN_ENV}
    if slowdown is not None:
        env[SLOWDOWN_ENV] = str(slowdown)
    return subprocess.run(
        [sys.executable, str(PERF_CHECK), command, "--results-dir", str(results_dir), "--", "-k", SUBSET],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600,
    )


# ---- the pieces, fast ------------------------------------------------------------------------
def test_stretched_call_takes_factor_times_as_long():
    def work():
        deadline = time.perf_counter() + 0.002
        while time.perf_counter() < deadline:
            pass
        return "done"

    slowed = stretched(work, 2.0)
    start = time.perf_counter()
    assert slowed() == "done"
    assert time.perf_counter() - start >= 0.004


def test_regressed_flags_only_growth_over_the_threshold():
    baseline = {"a": {"min": 1.0}, "b": {"min": 1.0}, "c": {"min": 1.0}}
    current = {"a": {"min": 1.59}, "b": {"min": 1.61}, "c": {"min": 0.5}, "new": {"min": 9.0}}
    assert regressed(baseline, current, "min", 60) == ["b"]


def test_default_threshold_sits_between_noise_and_a_2x_slowdown():
    stat, pct = parse_fail_on(DEFAULT_FAIL_ON)
    assert stat == "min" and 30 <= pct < 100


# ---- end to end: save a baseline, then check against it ------------------------------------
@pytest.fixture(scope="module")
def results_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("perf-check")
    saved = perf_check("save", folder)
    assert saved.returncode == 0, saved.stdout + saved.stderr
    names = {b["fullname"] for b in json.loads((folder / "baseline.json").read_text())["benchmarks"]}
    assert names == SUBSET_NAMES
    return folder


@pytest.mark.slow
def test_check_passes_an_unchanged_rerun(results_dir):
    result = perf_check("check", results_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no regression" in result.stdout


@pytest.mark.slow
def test_check_fails_an_injected_2x_slowdown(results_dir):
    result = perf_check("check", results_dir, slowdown=2.0)
    assert result.returncode != 0, result.stdout + result.stderr
    assert "PERFORMANCE REGRESSION" in result.stdout
    for name in SUBSET_NAMES:
        assert name in result.stdout.split("PERFORMANCE REGRESSION")[1]
