"""Compiling the CPU step graphs in a child process while the engine serves eagerly.

Compiling a 30-layer step takes minutes on two cores; an engine that waited for it would answer
nothing meanwhile. In background mode (`EngineConfig.compile_mode`) the engine starts at once:
a step whose graph is not in the cache runs eagerly, and a child process
(`python -m fastgen.engine.compile_worker`) builds the same engine on random weights and
compiles every graph into the cache. Between two steps the engine looks for each graph's file
and, once it is there, loads it (seconds) and runs that graph from the next step on.

A child, not a thread: Inductor's compile is mostly Python, and in this process it would hold
the GIL against the steps being served. The child lowers its own priority (nice 10), so the
steps it competes with for the cores come first. It is stopped when the engine shuts down or
its process exits; whatever it saved by then stays in the cache for the next engine.
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from fastgen.config import EngineConfig
from fastgen.paths import cache_dir

logger = logging.getLogger(__name__)

LOG_DAYS = 7  # a child's log is kept this long (a failure's message points at it)
_engines = itertools.count()  # several engines of one process get logs of their own


class BackgroundCompile:
    """spec: what the child builds (`fastgen.engine.compile_worker`: model folder, engine fields,
    thread count); log_path: where its output goes (kept for a failure's message)."""

    def __init__(self, spec: dict, log_path: Path):
        self.spec = spec
        self.log_path = log_path
        self.process: subprocess.Popen | None = None
        self.started_at: float | None = None
        self.stopped = False  # stopped by this process (its exit is then no failure)

    def start(self) -> None:
        """Start the child, once (later calls do nothing)."""
        if self.process is not None:
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        prune_logs(self.log_path.parent)
        self.started_at = time.perf_counter()
        with open(self.log_path, "w") as log:
            # A session of its own: Ctrl-C at the terminal interrupts the engine's caller, not the
            # compile (which would otherwise end, and leave the engine eager for good).
            self.process = subprocess.Popen(
                [sys.executable, "-m", "fastgen.engine.compile_worker", json.dumps(self.spec)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=child_environment(),
                start_new_session=True,
            )
        atexit.register(self.stop)
        logger.info("compiling the CPU step graphs in the background (process %d, log %s); steps run eagerly "
                    "until each is ready", self.process.pid, self.log_path)

    @property
    def seconds(self) -> float:
        """Since the child started (0 before)."""
        return 0.0 if self.started_at is None else time.perf_counter() - self.started_at

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def exit_code(self) -> int | None:
        """The child's exit status, or None while it runs (or before it started)."""
        return None if self.process is None else self.process.poll()

    def describe_exit(self, code: int) -> str:
        """The exit status and the last lines of the child's log, for a warning."""
        try:
            tail = self.log_path.read_text().strip().splitlines()[-5:]
        except OSError:
            tail = []
        return f"exit status {code}; {self.log_path}: " + " | ".join(tail)

    def stop(self) -> None:
        """Stop the child if it still runs (what it saved stays in the cache)."""
        if self.process is not None and self.process.poll() is None:
            self.stopped = True
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        atexit.unregister(self.stop)


def prune_logs(folder: Path) -> None:
    """Delete the children's logs older than LOG_DAYS."""
    now = time.time()
    for log in folder.glob("background-*.log"):
        try:
            if now - log.stat().st_mtime > LOG_DAYS * 86400:
                log.unlink()
        except OSError:  # removed meanwhile by another process
            pass


def background_compile(config: EngineConfig, num_kv_blocks: int) -> BackgroundCompile:
    """The child for an engine of `config` whose cache has `num_kv_blocks` blocks: the same
    engine fields (the cache's size given as its block count, so its shape is the same), the
    same thread count (written into the compiled code, so part of every graph's key)."""
    engine = {**config.init_values(), "num_kv_blocks": num_kv_blocks}
    del engine["model"]
    spec = {"model": str(config.model), "engine": engine, "threads": torch.get_num_threads()}
    return BackgroundCompile(spec, cache_dir() / "compiled" / f"background-{os.getpid()}-{next(_engines)}.log")


def child_environment() -> dict[str, str]:
    """This process's environment, with the import path it runs from (so the child imports the
    same fastgen) and the test suite's eager switch removed (the child's one job is compiling)."""
    import fastgen

    env = dict(os.environ)
    env.pop("FASTGEN_ENFORCE_EAGER", None)
    home = str(Path(fastgen.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (home, env.get("PYTHONPATH", "")) if p)
    return env
