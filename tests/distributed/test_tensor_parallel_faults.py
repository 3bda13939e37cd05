"""A tensor-parallel engine fails whole and fast, and never leaves a process behind: a worker that
is killed or raises makes the next (or current) step raise a TensorParallelError naming the rank
within seconds, never a hang; shutdown, leaving a `with` block, deleting the LLM and exiting the
interpreter all stop the workers."""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from fastgen import LLM, SamplingParams
from fastgen.distributed import rank0_runner
from fastgen.distributed.supervisor import TensorParallelError

ENGINE_ARGS = dict(dtype="float32", block_size=8, max_model_len=512, num_kv_blocks=256, tensor_parallel_size=2)
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_hang():
    """A hang fails the test run loudly (all threads' stacks) instead of stalling it."""
    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def worker(llm: LLM):
    return llm.engine.runner.supervisor.procs[1]


def test_killed_worker_fails_the_running_step_within_seconds(tiny_models):
    llm = LLM(tiny_models["qwen3"], **ENGINE_ARGS)
    proc = worker(llm)
    killed_at = []

    def kill_after_a_few_steps():
        while llm.engine.num_steps < 3:
            time.sleep(0.005)
        killed_at.append(time.monotonic())
        os.kill(proc.pid, signal.SIGKILL)

    threading.Thread(target=kill_after_a_few_steps, daemon=True).start()
    with pytest.raises(TensorParallelError, match=r"tensor-parallel rank 1 died \(killed by SIGKILL\)"):
        llm.generate([[1, 2, 3]] * 4, LONG)
    assert time.monotonic() - killed_at[0] < 10
    assert not proc.is_alive()
    assert not dist.is_initialized()  # rank 0 left the process group
    with pytest.raises(TensorParallelError, match=r"engine is down: tensor-parallel rank 1 died"):
        llm.generate([[1, 2, 3]], LONG)  # at once: no step is attempted


def test_a_worker_killed_while_the_loop_idles_ends_the_loop_within_a_second_or_two(tiny_models):
    """No request runs, yet the loop (a server's) learns that the engine is down, so /health
    stops answering ready before a request finds out."""
    from tests.serve.conftest import wait_for

    llm = LLM(tiny_models["qwen3"], **ENGINE_ARGS)
    bg = llm.background()
    try:
        assert bg.submit([1, 2, 3], SamplingParams(max_tokens=2)).result().finished
        os.kill(worker(llm).pid, signal.SIGKILL)
        killed_at = time.monotonic()
        wait_for(lambda: not bg.running, timeout=20)
        assert time.monotonic() - killed_at < 5
        with pytest.raises(RuntimeError, match="shut down|down"):
            bg.submit([1, 2, 3], SamplingParams(max_tokens=2)).result()
    finally:
        bg.shutdown()
        llm.shutdown()


def test_stuck_worker_fails_the_step_within_the_step_timeout(tiny_models, monkeypatch):
    """A worker that stops answering (SIGSTOP: alive, its sockets open, nothing read) while it
    waits for the next step. Rank 0's header goes out (the worker had asked for it), but the
    step's payload waits for the worker to ask again, which it never does: rank 0's own wait on
    the step group must end after distributed_step_timeout_s as the engine's error, as a lost
    host's or a downed link's does (a wait without end here was a hung engine)."""
    # A stopped worker never says why, so the wait for a cause after the timeout runs out: a
    # second here instead of the engine's five.
    monkeypatch.setattr(rank0_runner, "EXPLAIN_WAIT_S", 1.0)
    llm = LLM(tiny_models["qwen3"], **ENGINE_ARGS, distributed_step_timeout_s=2.0)
    proc = worker(llm)
    time.sleep(0.5)  # the worker is back in its loop, waiting for a step's header
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"distributed_step_timeout_s=2"):
            llm.generate([[1, 2, 3]] * 2, LONG)
        assert time.monotonic() - started < 2.0 + 10.0  # the timeout, then the wait for a cause
        assert not dist.is_initialized()
    finally:
        with contextlib.suppress(ProcessLookupError):  # killed and reaped by the engine already
            os.kill(proc.pid, signal.SIGCONT)
        proc.join(10)
    assert not proc.is_alive()


@pytest.mark.slow
def test_worker_that_raises_fails_the_engine_with_its_error(tiny_models):
    llm = LLM(tiny_models["qwen3"], **ENGINE_ARGS)
    # A header no sender writes: the worker raises ValueError in its loop, reports it and exits.
    sender = llm.engine.runner.runner.step_sender
    sender.header.zero_()
    sender.header[0] = 7
    sender._broadcast(sender.header)
    with pytest.raises(TensorParallelError, match=r"(?s)rank 1 failed:.*ValueError: step header command=7"):
        llm.generate([[1, 2, 3]], LONG)
    worker(llm).join(5)
    assert worker(llm).exitcode == 1


@pytest.mark.slow
def test_leaving_the_with_block_stops_the_worker(tiny_models):
    with LLM(tiny_models["qwen3"], **ENGINE_ARGS) as llm:
        proc = worker(llm)
        llm.generate([[4, 5]], SamplingParams(max_tokens=2))
    assert proc.exitcode == 0  # left its loop on STOP, not terminated
    assert not dist.is_initialized()


@pytest.mark.slow
def test_deleting_the_llm_stops_the_worker(tiny_models):
    llm = LLM(tiny_models["qwen3"], **ENGINE_ARGS)
    proc = worker(llm)
    del llm
    gc.collect()
    proc.join(15)
    assert proc.exitcode == 0
    assert not dist.is_initialized()


@pytest.mark.slow
def test_interpreter_exit_without_shutdown_leaves_no_worker(tiny_models, tmp_path):
    script = tmp_path / "leave.py"
    script.write_text(textwrap.dedent(f"""
        from fastgen import LLM
        if __name__ == "__main__":
            llm = LLM({tiny_models["qwen3"]!r}, **{ENGINE_ARGS!r})
            print(llm.engine.runner.supervisor.procs[1].pid, flush=True)
    """))
    # The script's own folder leads sys.path: point the import at this checkout.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_a_server_whose_engine_died_says_so(tiny_models):
    """In-flight requests end with an error (a 503 body, or a stream's last event), /health is not
    ready, and new requests get 503 at once."""
    import httpx

    from tests.serve.conftest import MODEL_NAME, running_server, wait_for

    llm = LLM(tiny_models["qwen3"], **ENGINE_ARGS)
    proc = worker(llm)
    body = {"model": MODEL_NAME, "prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True, "temperature": 0.0}
    with running_server(llm) as url:
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: {"))  # it is running
            os.kill(proc.pid, signal.SIGKILL)
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert "tensor-parallel rank 1 died" in events[-1]["error"]["message"]
        wait_for(lambda: httpx.get(f"{url}/health").status_code == 503, timeout=30)
        refused = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert refused.status_code == 503


def test_rank_0s_own_failure_outside_the_collectives_is_one_requests(tiny_models):
    """A request whose sampling fails on rank 0 (after the forward every rank ran) ends alone with
    "error"; the ranks are still in step, so the engine and its worker carry on, and the other
    requests get the tokens they get without it."""
    llm = LLM(tiny_models["qwen3"], **ENGINE_ARGS)
    sampler = llm.engine.runner.runner.sampler
    original = sampler._sample

    def poisoned(logits, seqs, greedy_tokens, *rest):
        if any(seq.params.max_tokens == 13 for seq in seqs):
            raise RuntimeError("poisoned sampling")
        return original(logits, seqs, greedy_tokens, *rest)

    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(prompts, plain)]
    sampler._sample = poisoned
    outs = llm.generate([*prompts, [10, 11]], [plain] * 3 + [SamplingParams(max_tokens=13, ignore_eos=True)])
    assert [o.token_ids for o in outs[:3]] == expected
    assert outs[3].finish_reason == "error" and "poisoned sampling" in outs[3].error
    assert worker(llm).is_alive() and llm.engine.runner.supervisor.failure is None
    sampler._sample = original
    assert [o.token_ids for o in llm.generate(prompts, plain)] == expected


WATCH_SCRIPT = """
import sys, threading, time, types
import torch.distributed as dist
from fastgen.distributed import launch

mode, timeout = sys.argv[1], float(sys.argv[2])

class Store:  # answers twice, then as `mode` says: hangs (a dead link), fails, or keeps answering
    answers = 2
    def __init__(self, *args, **kwargs):
        pass
    def check(self, keys):
        Store.answers -= 1
        if Store.answers >= 0 or mode == "answers":
            time.sleep(0.05)
            return False
        if mode == "hangs":
            threading.Event().wait()
        raise ConnectionError("connection refused")

dist.TCPStore = Store
launch._prefixed = lambda store, name="": store
launch.watch_rank0(types.SimpleNamespace(distributed_step_timeout_s=timeout), "10.0.0.1", 1, rank=1)
time.sleep(float(sys.argv[3]))
print("still running", flush=True)
"""


@pytest.mark.parametrize("mode", ["hangs", "fails", "answers"])
def test_a_worker_exits_once_rank0s_store_has_not_answered_for_the_step_timeout(tmp_path, mode):
    """A link that goes down under an open connection leaves a store request blocked far beyond
    the store's own timeout ("hangs"); the watch still ends the worker once a request has waited
    distributed_step_timeout_s, as it does once requests have failed for that long ("fails"): the
    deadline is kept by a thread that never asks the store. A store that answers, even with a
    timeout shorter than the watch's usual interval, never ends the worker ("answers")."""
    script = tmp_path / "watch.py"
    script.write_text(WATCH_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    timeout, runs = (0.5, 2.5) if mode == "answers" else (1.0, 60.0)
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(script), mode, str(timeout), str(runs)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=90)
    seconds = time.monotonic() - started
    if mode == "answers":
        assert done.returncode == 0 and "still running" in done.stdout, (done.stdout, done.stderr)
        return
    reason = "a request has had no answer" if mode == "hangs" else "the requests fail: connection refused"
    assert done.returncode == 1 and "still running" not in done.stdout, (done.stdout, done.stderr)
    assert re.search(rf"has had no answer from rank 0's store at 10\.0\.0\.1:1 for [123] s \({reason}\)",
                     done.stderr), done.stderr
    assert seconds < 30, seconds  # the interpreter's start, 1 s after the answers stopped


@pytest.mark.slow
def test_ctrl_c_in_a_step_interrupts_the_call_and_the_engine_serves_on(tiny_models, tmp_path):
    """Ctrl-C reaches the terminal's whole process group, workers too, in the middle of a step:
    the caller gets its KeyboardInterrupt once the step has ended on every rank, and the engine
    then still generates transformers' greedy tokens (before, the worker died of it and rank 0
    took the engine down)."""
    from tests.tiny_models import hf_greedy

    prompts, max_tokens = [[1, 2, 3, 4, 5], [7, 8, 9]], 16
    script = tmp_path / "interrupt.py"
    script.write_text(textwrap.dedent(f"""
        import json, os, signal
        from fastgen import LLM, SamplingParams
        if __name__ == "__main__":
            # As in a terminal (a run started in a shell's background inherits SIGINT ignored).
            signal.signal(signal.SIGINT, signal.default_int_handler)
            llm = LLM({tiny_models["qwen3"]!r}, **{ENGINE_ARGS!r})
            local = llm.engine.runner.runner  # rank 0's own ModelRunner
            launch, calls = local.launch, []

            def launch_then_interrupt(out):
                calls.append(out)
                if len(calls) == 3:  # the group's Ctrl-C, as a terminal sends it, inside a step
                    os.killpg(os.getpgrp(), signal.SIGINT)
                return launch(out)

            local.launch = launch_then_interrupt
            try:
                llm.generate([[1, 2, 3]] * 3, {LONG!r})
                interrupted = False
            except KeyboardInterrupt:
                interrupted = True
            local.launch = launch
            params = SamplingParams(temperature=0.0, max_tokens={max_tokens}, ignore_eos=True)
            tokens = [o.token_ids for o in llm.generate({prompts!r}, params)]
            print(json.dumps({{"interrupted": interrupted, "tokens": tokens}}), flush=True)
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=180, start_new_session=True)  # its own group: the SIGINT stays there
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["interrupted"]
    assert result["tokens"] == hf_greedy(tiny_models["qwen3"], prompts, max_tokens)
