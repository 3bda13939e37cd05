"""Shared set-up of the benchmark suites (their own pytest rootdir, see pytest.ini).

- CUDA-marked benchmarks are skipped on a machine without a GPU, as in tests/.
- Torch runs single-threaded unless FASTGEN_BENCH_THREADS says otherwise: on a 2-core machine
  shared with other jobs, a 2-thread op waits for whichever thread was descheduled, which makes
  timings far noisier than the single-thread cost they measure.
- FASTGEN_BENCH_INJECT_SLOWDOWN=F (a test hook, never set in real runs) makes every benchmarked
  callable F times slower by spinning after it returns, so the regression check can be shown to
  fire (tests/benchmarks/test_perf_check.py). It wraps the benchmark fixture only; engine code
  never sees it.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch
from pytest_benchmark.fixture import BenchmarkFixture

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # for `tests.tiny_models` however pytest was started
    sys.path.insert(0, str(REPO_ROOT))

from tests.markers import skip_cuda_tests_without_gpu  # noqa: E402
from tests.tiny_models import build_tiny_model  # noqa: E402

SLOWDOWN_ENV = "FASTGEN_BENCH_INJECT_SLOWDOWN"
THREADS_ENV = "FASTGEN_BENCH_THREADS"

def pytest_configure(config):
    torch.set_num_threads(int(os.environ.get(THREADS_ENV, "1")))


def pytest_collection_modifyitems(config, items):
    skip_cuda_tests_without_gpu(items)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    """A tiny random-weight Qwen3 folder (2 layers, hidden 64, vocab 384) with its tokenizer."""
    return str(build_tiny_model("qwen3", tmp_path_factory.mktemp("models") / "qwen3"))


# ---- the injected-slowdown test hook -------------------------------------------------------
def injected_slowdown() -> float:
    raw = os.environ.get(SLOWDOWN_ENV, "").strip()
    if not raw:
        return 1.0
    factor = float(raw)
    if factor < 1.0:
        raise ValueError(f"{SLOWDOWN_ENV}={raw!r} must be >= 1.0")
    return factor


def stretched(fn, factor: float):
    """fn, but each call then busy-waits (factor - 1) times as long as the call took.

    A busy wait, not time.sleep: sleep overshoots by tens of microseconds, which would turn a
    2x request into 3x on the sub-millisecond benchmarks.
    """

    def slowed(*args, **kwargs):
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        end = time.perf_counter()
        deadline = end + (end - start) * (factor - 1.0)
        while time.perf_counter() < deadline:
            pass
        return result

    return slowed


class SlowedBenchmarkFixture(BenchmarkFixture):
    """pytest-benchmark's fixture, stretching whatever it times by `slowdown`.

    A subclass (swapped onto the fixture instance) rather than a wrapper, because pytest-benchmark
    checks that the `benchmark` argument is a BenchmarkFixture.
    """

    slowdown = 1.0

    def __call__(self, function_to_benchmark, *args, **kwargs):
        return super().__call__(stretched(function_to_benchmark, self.slowdown), *args, **kwargs)

    def pedantic(self, target, *args, **kwargs):
        return super().pedantic(stretched(target, self.slowdown), *args, **kwargs)


@pytest.fixture
def benchmark(benchmark):  # overrides pytest-benchmark's fixture, slowing it when asked to
    factor = injected_slowdown()
    if factor != 1.0:
        benchmark.__class__ = SlowedBenchmarkFixture
        benchmark.slowdown = factor
        benchmark.extra_info["injected_slowdown"] = factor
    return benchmark
