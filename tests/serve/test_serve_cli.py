"""`fastgen serve` as a process: it serves on the port it prints (port 0: a free one), and
SIGTERM shuts it down cleanly with exit 0; a port it cannot bind is a clear error before the
model loads."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from fastgen.cli.main import main
from fastgen.serve.app import ServerSettings, bind
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


def test_port_0_binds_a_free_port_and_a_taken_one_is_a_value_error():
    with bind(ServerSettings(port=0)) as sock:
        port = sock.getsockname()[1]
        assert port > 0
        sock.listen()
        with pytest.raises(ValueError, match=rf"cannot listen on host='127.0.0.1' port={port}: "):
            bind(ServerSettings(port=port))


def test_serve_on_a_taken_port_exits_2_before_loading_the_model(chat_model, capsys, monkeypatch):
    from fastgen.cli import engine_args

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded for a port that cannot be bound")

    monkeypatch.setattr(engine_args, "build_llm", no_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", chat_model, "--port", str(port)]) == 2
    assert f"port={port}" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_answers_and_exits_0_on_a_signal(chat_model, sig):
    cmd = [sys.executable, "-m", "fastgen", "serve", "--model", chat_model, "--port", "0", "--dtype",
           "float32", "--block-size", "8", "--num-kv-blocks", "64", "--max-model-len", "128"]
    proc = subprocess.Popen(cmd, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        while "serving" not in line:
            assert line, "the server exited before saying where it serves"
            line = proc.stderr.readline()
        port = int(re.search(r"on http://127\.0\.0\.1:(\d+);", line).group(1))
        assert port != 0
        wait_until_serving(proc, f"http://127.0.0.1:{port}")
        body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0.0}
        assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30).status_code == 200
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            time.sleep(0.1)
