"""Compiling the CPU step graphs in a child process while the engine serves eagerly.

Compiling a 30-layer step takes minutes on two cores; an engine that waited for it would answer
nothing meanwhile. In background mode (`EngineConfig.compile_mode`) the engine starts at once:
a step whose graph is not in the cache runs eagerly, and a child process
(`python -m fastgen.engine.compile_worker`) builds the same engine on random weights and
compiles every graph into the cache, ending once the last is saved. The first step after the
child has ended loads each graph's file (seconds) and runs that graph from then on. Until then
the steps use a thread fewer (`fastgen.cpu.step_threads`), and no compiled graph, whose
parallel regions take every core.

A child, not a thread: Inductor's compile is mostly Python, and in this process it would hold
the GIL against the steps being served. The child lowers its own priority (nice 10), so the
steps it competes with for the cores come first. It is stopped when the engine shuts down or
its process exits; whatever it saved by then stays in the cache for the next engine.

In blocking mode the same children are helpers (`CompileHelpers`): while the engine compiles the
graph its first step needs, each helper compiles other missing graphs at normal priority, and
the engine waits for them before it goes on. Compiling a graph is one core's work for most of its
time (Python, then one C++ compiler process), so by default there is one process a core: on two
cores the engine compiles the layer group's graph while a helper compiles the head's
(`fastgen.cpu.layer_groups`). A background child compiles its graphs one after the other, with
no helper of its own: one process beside the engine it serves.
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
from collections.abc import Callable
from pathlib import Path

from fastgen.config import EngineConfig
from fastgen.cpu.step_threads import STEP_THREADS
from fastgen.paths import cache_dir

logger = logging.getLogger(__name__)

LOG_DAYS = 7  # a child's log is kept this long (a failure's message points at it)
_engines = itertools.count()  # several engines of one process get logs of their own


class BackgroundCompile:
    """spec: what the child builds (`fastgen.engine.compile_worker`: model folder, engine fields,
    thread count, optionally which graphs and whether at low priority); log_path: where its
    output goes (kept for a failure's message)."""

    def __init__(self, spec: dict, log_path: Path):
        self.spec = spec
        self.log_path = log_path
        self.process: subprocess.Popen | None = None
        self.started_at: float | None = None
        self.ended_at: float | None = None  # when `wait` saw it end
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
        if graphs := self.spec.get("graphs"):
            logger.info("compiling the CPU step graph %s in a helper process (%d, log %s)", " and ".join(graphs),
                        self.process.pid, self.log_path)
        else:
            logger.info("compiling the CPU step graphs in the background (process %d, log %s); steps run eagerly "
                        "until it has ended", self.process.pid, self.log_path)

    @property
    def seconds(self) -> float:
        """Since the child started (0 before), until it ended where `wait` saw that."""
        if self.started_at is None:
            return 0.0
        return (self.ended_at or time.perf_counter()) - self.started_at

    def wait(self) -> int:
        """Wait for the child (started) to end; its exit status."""
        code = self.process.wait()
        self.ended_at = self.ended_at or time.perf_counter()
        atexit.unregister(self.stop)
        return code

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


class CompileHelpers:
    """Blocking mode's helper processes: `start(graphs)` spreads the graphs over at most
    `processes` - 1 helpers (`make_child(graphs)` makes one), `wait` waits until all have ended. A graph a helper
    did not save is compiled by the engine itself when a step first needs it."""

    def __init__(self, make_child: Callable[[list[str]], BackgroundCompile], processes: int | None):
        self.make_child = make_child
        self.processes = processes  # the engine's process and its helpers, at most (None: one a core)
        self.children: list[BackgroundCompile] = []
        self.started = False
        self.wait_seconds = 0.0  # the engine's wait for them, after its own compile
        self.seconds: dict[str, float] = {}  # graph -> its helper's time from start to end

    def start(self, graphs: list[str]) -> None:
        """Start helpers for `graphs` (once; later calls do nothing)."""
        if self.started:
            return
        self.started = True
        # One process a core by default: three compiles on two cores took longer than two (each
        # compile's Python, its C++ compiler and Inductor's worker pool then fight for them).
        processes = self.processes if self.processes is not None else max(1, os.cpu_count() or 1)
        count = min(len(graphs), processes - 1)
        shares = [graphs[i::count] for i in range(count)]
        for share in shares:
            child = self.make_child(share)
            child.start()
            self.children.append(child)

    def wait(self) -> None:
        """Wait for every helper to end (a failed one's warning names its log)."""
        begin = time.perf_counter()
        for child in self.children:
            if (code := child.wait()) != 0 and not child.stopped:
                logger.warning("a helper compiling %s ended (%s); this process compiles what it left",
                               " and ".join(child.spec["graphs"]), child.describe_exit(code))
            for graph in child.spec["graphs"]:
                self.seconds[graph] = child.seconds
        self.wait_seconds += time.perf_counter() - begin
        self.children = []

    def stop(self) -> None:
        for child in self.children:
            child.stop()


def background_compile(config: EngineConfig, num_kv_blocks: int, graphs: list[str] | None = None,
                       ) -> BackgroundCompile:
    """The child for an engine of `config` whose cache has `num_kv_blocks` blocks: the same
    engine fields (the cache's size given as its block count, so its shape is the same), the
    same thread count (written into the compiled code, so part of every graph's key). `graphs`:
    a blocking engine's helper, which builds those graphs only, at normal priority."""
    engine = {**config.init_values(), "num_kv_blocks": num_kv_blocks}
    del engine["model"]
    spec = {"model": str(config.model), "engine": engine, "threads": STEP_THREADS.full_threads()}
    if graphs is not None:
        spec.update(graphs=graphs, nice=False)
    else:
        engine["compile_processes"] = 1  # no helpers of its own (see the module's docstring)
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
