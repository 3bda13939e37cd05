"""`fastgen serve` as a process: it serves, and SIGTERM shuts it down cleanly with exit 0."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.serve.conftest import wait_for


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_serving(proc: subprocess.Popen, base_url: str) -> None:
    """Wait until a `fastgen serve` process answers /health (its stderr in the failure, if it exits)."""
    def healthy():
        assert proc.poll() is None, proc.stderr.read()
        try:
            return httpx.get(f"{base_url}/health").status_code == 200
        except httpx.TransportError:
            return False

    wait_for(healthy, timeout=120, interval=0.2)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_answers_and_exits_0_on_a_signal(chat_model, sig):
    port = free_port()
    cmd = [sys.executable, "-m", "fastgen", "serve", "--model", chat_model, "--port", str(port), "--dtype",
           "float32", "--block-size", "8", "--num-kv-blocks", "64", "--max-model-len", "128"]
    proc = subprocess.Popen(cmd, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_serving(proc, f"http://127.0.0.1:{port}")
        body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0.0}
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30).status_code == 200
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            time.sleep(0.1)
