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


def test_an_llm_hands_workers_back_after_building_and_after_each_drive_from_another_thread(
        tiny_models, monkeypatch, caplog):
    """The building thread hands its workers back once built, and keeps those of its own later
    drives; any other thread hands back at the end of each `generate` and stream it drives.
    A thread that drives after the building one did is warned that this cannot help it."""
    from fastgen import LLM, SamplingParams
    from fastgen.cpu.native import openmp

    released_in = []
    monkeypatch.setattr(openmp, "release_openmp_threads", lambda: released_in.append(threading.current_thread()))
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm = LLM(tiny_models["qwen3"], dtype="float32", num_kv_blocks=32)
    home = threading.current_thread()
    assert released_in == [home]

    def in_another_thread(work):
        results = []
        worker = threading.Thread(target=lambda: results.append((work(), threading.current_thread())))
        worker.start()
        worker.join()
        return results[0]

    released_in.clear()
    expected = llm.generate([[1, 2, 3]], params)[0].token_ids
    assert released_in == []  # the building thread keeps its workers between its own drives

    outputs, worker = in_another_thread(lambda: llm.generate([[1, 2, 3]], params))
    assert outputs[0].token_ids == expected and released_in == [worker]
    assert "runs in thread" in caplog.text  # the building thread drove first: its workers are back

    released_in.clear()
    tokens, worker = in_another_thread(lambda: [t for o in llm.stream([1, 2, 3], params) for t in o.new_token_ids])
    assert tokens == expected and released_in == [worker]
    assert caplog.text.count("runs in thread") == 1  # once

    def read_one_then_close():
        with llm.stream([1, 2, 3], params) as stream:
            return next(stream).new_token_ids

    released_in.clear()
    first, worker = in_another_thread(read_one_then_close)  # closed early: handed back all the same
    assert first == expected[:1] and released_in == [worker]


def test_a_stream_made_in_the_building_thread_and_read_in_another_is_that_threads_drive(tiny_models, monkeypatch,
                                                                                          caplog):
    """Who drives is who reads: a stream the building thread makes but another thread reads
    hands that thread's workers back, and warns of nothing (the building thread never ran)."""
    from fastgen import LLM, SamplingParams
    from fastgen.cpu.native import openmp

    released_in = []
    monkeypatch.setattr(openmp, "release_openmp_threads", lambda: released_in.append(threading.current_thread()))
    llm = LLM(tiny_models["qwen3"], dtype="float32", num_kv_blocks=32)
    stream = llm.stream([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    released_in.clear()
    readers = []
    reader = threading.Thread(target=lambda: readers.append((stream.result(), threading.current_thread())))
    reader.start()
    reader.join()
    (final, thread), = readers
    assert len(final.token_ids) == 3 and released_in == [thread]
    later = threading.Thread(target=lambda: llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2)))
    later.start()
    later.join()
    assert "runs in thread" not in caplog.text
