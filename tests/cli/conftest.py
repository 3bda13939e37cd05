"""Running the real `fastgen` command in a subprocess, with its cache kept inside the test."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Every subprocess pays for importing torch and transformers (seconds on 2 cores), so tests
# start as few as they can and check several things on each run's output.
SUBPROCESS_TIMEOUT_S = 300

# What the tests pass to every engine they start: small, fast, deterministic on any machine.
CPU_FLAGS = ["--device", "cpu", "--dtype", "float32", "--kv-cache-memory-bytes", "16MiB"]


@pytest.fixture(scope="session")
def cli_env(tmp_path_factory) -> dict[str, str]:
    """The environment of the subprocesses: a private FASTGEN_CACHE (presets are written
    there), and TRITON_INTERPRET as the test session has it."""
    env = dict(os.environ)
    env["FASTGEN_CACHE"] = str(tmp_path_factory.mktemp("fastgen-cache"))
    env["PYTHONIOENCODING"] = "utf-8"  # tiny models emit any bytes; decode them the same way here
    return env


@pytest.fixture(scope="session")
def fastgen_cli(cli_env):
    """fastgen_cli(*args) -> CompletedProcess of `python -m fastgen args...` (text output)."""

    def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "fastgen", *args], input=stdin, capture_output=True, encoding="utf-8",
            env=cli_env, timeout=SUBPROCESS_TIMEOUT_S,
        )

    return run
