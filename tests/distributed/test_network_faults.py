"""A tensor-parallel engine with one rank on each of two hosts (network namespaces joined by a
veth pair; `network_namespaces.py`), started the documented way (torchrun, MASTER_ADDR on the
link's address, gloo). Greedy output equals transformers'; with the link slowed, still the same
tokens; a killed host, or the link set down mid-request or while the engine is idle, ends as the engine's
TensorParallelError (never one request's "error") within 60 s, and no process is left behind on
either host."""

from __future__ import annotations

import faulthandler
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.distributed.network_namespaces import Hosts, skip_reason
from tests.distributed.tp_rank_script import HANG_S, PROMPTS

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("tp_rank_script.py")
FAULT_DEADLINE_S = 60.0

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hosts_allowed():
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(autouse=True)
def no_hang():
    """The last resort, should the test itself hang: every thread's stack, then exit. (The ranks
    dump their own stacks after HANG_S, and `run_two_hosts` kills whatever is left shortly
    after, so a hung rank is a failing test with its stack in the message, not this.)"""
    faulthandler.dump_traceback_later(HANG_S + 150, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def run_two_hosts(model: str, max_tokens: int, fault=None, idle_s: float = 0.0) -> tuple[dict, float | None, int, dict]:
    """Start rank 0 on host a and rank 1 on host b; apply `fault(hosts)` half a second after
    rank 0 is ready, which is mid-request, or while the engine sits idle for `idle_s` first.
    Returns rank 0's RESULT, the seconds from the fault to that result, rank 0's torchrun exit
    code, and the processes left on each host 30 s after rank 0's torchrun ended. Whatever still
    runs HANG_S + 30 s after the start is killed (a hung rank's stack is then in its host's log)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    logs = {host: tempfile.TemporaryFile("w+") for host in ("a", "b")}
    with Hosts() as hosts:
        procs = {}
        for host, rank in (("a", 0), ("b", 1)):
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
                    "--nproc-per-node", "1", "--master-addr", hosts.addresses["a"], "--master-port", "29517",
                    str(SCRIPT), model, str(max_tokens), str(idle_s)]
            procs[host] = hosts.popen(host, argv, env={**env, "GLOO_SOCKET_IFNAME": hosts.links[host]},
                                      stdout=subprocess.PIPE, stderr=logs[host], text=True)
        watchdog = threading.Timer(HANG_S + 30, lambda: [hosts.kill_all(host) for host in ("a", "b")])
        watchdog.start()
        faulted_at, result = None, None
        for line in procs["a"].stdout:
            if line.startswith("READY") and fault is not None:
                time.sleep(0.5)  # a few steps in (or idle_s not yet over): the fault lands
                fault(hosts)
                faulted_at = time.monotonic()
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
                break
        seconds = None if faulted_at is None else time.monotonic() - faulted_at
        code = procs["a"].wait(timeout=60)
        left = {host: hosts.wait_empty(host, 30) for host in ("a", "b")}
        watchdog.cancel()
    tails = {}
    for host, log in logs.items():
        log.seek(0)
        tails[host] = log.read()[-4000:]
    log = f"host a (rank 0):\n{tails['a']}\nhost b (rank 1):\n{tails['b']}"
    assert result is not None, f"rank 0 printed no result (exit code {code}):\n{log}"
    if code != 0:
        result["log"] = log
    return result, seconds, code, left


def test_greedy_over_the_link_equals_transformers_and_a_slow_link_changes_nothing(tiny_models, reference,
                                                                                  hosts_allowed):
    model = tiny_models["qwen3"]
    expected = reference(model, PROMPTS, 12)
    result, _, code, left = run_two_hosts(model, 12)
    assert result["result"] == "finished" and result["tokens"] == expected and code == 0, (result, code)
    assert left == {"a": [], "b": []}
    applied = []
    result, _, code, left = run_two_hosts(model, 12, lambda hosts: applied.append(hosts.slow("b")))
    if applied == [None]:
        pytest.skip("this kernel has neither netem nor tbf to slow a link with")
    assert result["result"] == "finished" and result["tokens"] == expected, (applied, result)
    assert code == 0 and left == {"a": [], "b": []}, (code, left, result.get("log"))


@pytest.mark.parametrize("fault", ["host_killed", "link_down", "link_down_while_idle"])
def test_a_lost_host_is_the_engines_error_within_a_minute(tiny_models, hosts_allowed, fault):
    """While idle, the worker waits for a step on a group with no practical deadline: only its
    watch on rank 0's store can end it (on a dead link, that store request itself hangs)."""
    inject = {"host_killed": lambda hosts: hosts.kill_all("b"), "link_down": lambda hosts: hosts.link_down("b"),
              "link_down_while_idle": lambda hosts: hosts.link_down("b")}
    idle_s = 3.0 if fault == "link_down_while_idle" else 0.0
    result, seconds, code, left = run_two_hosts(tiny_models["qwen3"], 1000, inject[fault], idle_s)
    print(f"\n{fault}: {result['result']} after {seconds:.1f} s: {result.get('message', '')[:300]}")
    assert result["result"] == "TensorParallelError", result
    assert seconds < FAULT_DEADLINE_S
    assert code != 0 and left == {"a": [], "b": []}, (left, result.get("log"))
