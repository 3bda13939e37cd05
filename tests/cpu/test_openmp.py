"""A thread's OpenMP workers handed back (`release_openmp_threads`), and the background loop
handing back those of the thread that starts it."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

from fastgen.cpu.native.openmp import loaded_libgomps

needs_libgomp_and_two_threads = pytest.mark.skipif(
    not loaded_libgomps() or torch.get_num_threads() < 2,
    reason="needs torch on GNU OpenMP (libgomp) with two or more threads")

# A fresh process, so that no other thread's pool or stray thread muddles the count: a parallel
# op starts the main thread's workers, the release ends them, and the next parallel op starts
# them again.
PROBE = """
import os, torch
from fastgen.cpu.native.openmp import release_openmp_threads

def threads():
    return len(os.listdir("/proc/self/task"))

def parallel_op():
    torch.ones(1 << 22).exp_()  # far past at::parallel_for's grain: every thread takes a part

parallel_op()
with_pool = threads()
released = release_openmp_threads()
after_release = threads()
parallel_op()
print(torch.get_num_threads(), with_pool, released, after_release, threads())
"""


@needs_libgomp_and_two_threads
def test_a_released_threads_openmp_workers_end_and_its_next_parallel_op_starts_them_again():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    num_threads, with_pool, released, after_release, again = done.stdout.split()
    workers = int(num_threads) - 1  # the main thread is the pool's first member
    assert released == "True"
    assert int(after_release) == int(with_pool) - workers
    assert int(again) == int(with_pool)


def test_the_background_loop_releases_the_starting_threads_workers_before_it_runs(tiny_models, monkeypatch):
    """The release happens in the thread that starts the loop (where the engine was built and
    its workers live), before the loop thread runs a step."""
    from fastgen import LLM
    from fastgen.engine import background

    calls = []

    def record():
        loop_threads = [t for t in threading.enumerate() if t.name == "fastgen-engine-loop"]
        calls.append((threading.current_thread(), loop_threads))
        return True

    monkeypatch.setattr(background, "release_openmp_threads", record)
    llm = LLM(tiny_models["qwen3"], dtype="float32", num_kv_blocks=32)
    with llm.background():
        pass
    assert calls == [(threading.current_thread(), [])]
