"""Rank 0's hold on the other ranks: start them, watch them, explain a failure, stop them.

Spawned workers are watched by a thread waiting on their process sentinels: a worker that
exits while the engine runs is recorded as the failure (its reported error, or how it died),
the others are terminated, and on CUDA the device group is aborted so that no NCCL wait on rank
0 outlives it. Rank 0's own collectives fail at once when a peer's connections close (gloo), so
the engine raises a `TensorParallelError` naming the rank within seconds; an idle engine raises
it at its next step, or when its background loop next asks (`check_alive`). Under torchrun there are no processes to watch (torchrun's agent stops the
job when one dies); a worker's reported error is still quoted.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait

from fastgen.config import EngineConfig
from fastgen.distributed.launch import (
    TorchrunEnv,
    connect_store,
    failure_report,
    has_joined,
    host_store,
    leave_groups,
)
from fastgen.errors import EngineDeadError

logger = logging.getLogger(__name__)

EXPLAIN_WAIT_S = 5.0  # how long a failed collective waits for the cause to surface
STOP_WAIT_S = 10.0  # how long a worker gets to leave after STOP before it is terminated
_POLL_S = 0.05


class TensorParallelError(EngineDeadError):
    """A tensor-parallel rank failed or could not start; the engine is down (build a new one)."""


def describe_exit(rank: int, exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            how = f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            how = f"killed by signal {-exitcode}"
        return f"tensor-parallel rank {rank} died ({how})"
    return f"tensor-parallel rank {rank} exited with code {exitcode}"


class WorkerSupervisor:
    """procs: rank -> its process (spawned ranks; empty under torchrun)."""

    def __init__(self, config: EngineConfig, store, procs: dict):
        self.store = store
        self.procs = procs
        self.ranks = range(1, config.tensor_parallel_size)
        self.failure: str | None = None  # the first failure seen; the engine is down once set
        self.send_stop: Callable[[], None] | None = None  # set once rank 0's runner exists
        self.abort_device_group: Callable[[], None] | None = None
        self._stopping = threading.Event()
        self._stopped = False
        self._lock = threading.Lock()
        self._thread = None
        if procs:
            self._thread = threading.Thread(target=self._watch, name="fastgen-tp-watchdog", daemon=True)
            self._thread.start()

    @classmethod
    def spawn(cls, config: EngineConfig, load_format: str) -> WorkerSupervisor:
        """Start ranks 1..N-1 on this machine and wait until each is up."""
        import torch.multiprocessing as mp

        from fastgen.distributed.worker import run_spawned

        store = host_store(config)
        context = mp.get_context("spawn")
        procs = {}
        for rank in range(1, config.tensor_parallel_size):
            procs[rank] = context.Process(target=run_spawned, args=(config, load_format, rank, store.port),
                                          name=f"fastgen-tp-rank{rank}", daemon=True)
            procs[rank].start()
        supervisor = cls(config, store, procs)
        supervisor._wait_until_joined(config.distributed_timeout_s)
        return supervisor

    @classmethod
    def join_torchrun(cls, config: EngineConfig, env: TorchrunEnv) -> WorkerSupervisor:
        return cls(config, connect_store(config, env.master_addr, env.master_port, 0), {})

    def _wait_until_joined(self, timeout_s: float) -> None:
        # Before the rendezvous, which would wait its whole timeout for a rank that already died.
        deadline = time.monotonic() + timeout_s
        for rank in self.ranks:
            while not has_joined(self.store, rank):
                if self.failure is not None or time.monotonic() > deadline:
                    self.stop()
                    raise TensorParallelError(self.failure or f"tensor-parallel rank {rank} did not start "
                                              f"within distributed_timeout_s={timeout_s}")
                time.sleep(_POLL_S)

    # ---- watching ------------------------------------------------------------------------
    def _watch(self) -> None:
        alive = dict(self.procs)
        while alive and not self._stopping.is_set():
            ready = set(wait([p.sentinel for p in alive.values()], timeout=0.5))
            exited = [rank for rank, p in alive.items() if p.sentinel in ready]
            if not exited or self._stopping.is_set():
                continue
            for rank in exited:
                del alive[rank]
            # A rank that died without a word comes first: the others' reports are consequences.
            exited.sort(key=lambda r: failure_report(self.store, r) is not None)
            self.record(self._describe(exited[0]))
            self._bring_down()

    def _describe(self, rank: int) -> str:
        report = failure_report(self.store, rank)
        if report is not None:
            return f"tensor-parallel rank {rank} failed:\n{report}"
        proc = self.procs[rank]
        # The sentinel fires when the process's end of the pipe closes, which can be a moment
        # before the process can be reaped: until then its exit code reads None.
        proc.join(timeout=2.0)
        return describe_exit(rank, proc.exitcode)

    def record(self, failure: str) -> None:
        with self._lock:
            if self.failure is None:
                self.failure = failure
                logger.error("%s", failure)

    def _bring_down(self) -> None:
        if self.abort_device_group is not None:
            try:
                self.abort_device_group()
            except Exception:
                logger.exception("aborting the device group failed")
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()

    def explain(self, wait_s: float = EXPLAIN_WAIT_S) -> str | None:
        """The failure of another rank, waiting up to wait_s for it to surface (a collective
        fails a moment before the watchdog sees the process exit); None if none did."""
        deadline = time.monotonic() + wait_s
        while self.failure is None and time.monotonic() < deadline:
            if not self.procs:  # torchrun: only the store can tell
                for rank in self.ranks:
                    report = failure_report(self.store, rank)
                    if report is not None:
                        self.record(f"tensor-parallel rank {rank} failed:\n{report}")
                        break
            time.sleep(_POLL_S)
        return self.failure

    # ---- stopping ------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop every worker (STOP when the engine is healthy, then terminate, then kill) and
        leave the process groups. Safe to call more than once and from a finalizer."""
        if self._stopped:
            return
        self._stopped = True
        self._stopping.set()
        told = False
        if self.send_stop is not None and self.failure is None and all(p.is_alive() for p in self.procs.values()):
            try:
                self.send_stop()
                told = True
            except Exception:
                logger.exception("sending STOP to the tensor-parallel workers failed")
        # A worker that was not told to stop has no reason to leave: terminate it at once.
        deadline = time.monotonic() + (STOP_WAIT_S if told else 0.0)
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join()
        if self._thread is not None:
            self._thread.join()
        leave_groups()
