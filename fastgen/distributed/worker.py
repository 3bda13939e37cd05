"""A tensor-parallel worker: ranks 1..N-1 run the model on rank 0's steps until told to stop.

A worker is started by the engine (`run_spawned`, the target of a spawned process) or by
torchrun (`serve`, which `LLM(...)` runs on a rank > 0). It joins the process groups, builds its
`ModelRunner` over its shard (start-up in step with the other ranks), passes a start-up barrier,
then loops: receive a step (`StepReceiver`), `execute` it. Logits are never read here; sampling
is rank 0's.

On any error the worker reports it in the store under its rank (rank 0 quotes it) and exits
non-zero; leaving closes its connections, so a collective rank 0 is waiting in fails at once.
A spawned worker also exits when its parent, rank 0, goes away, so none is ever orphaned.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import traceback

import torch

from fastgen.config import EngineConfig
from fastgen.distributed.launch import (
    bound_step_collectives,
    config_for_rank,
    connect_store,
    join_groups,
    leave_groups,
    mark_joined,
    report_failure,
)
from fastgen.distributed.step_protocol import StepReceiver


def serve(config: EngineConfig, load_format: str, store, rank: int) -> None:
    """Be rank `rank` until rank 0 sends STOP. Raises whatever fails (after reporting it)."""
    import torch.distributed as dist

    from fastgen.model_runner import ModelRunner

    try:
        groups = join_groups(config, store, rank)
        try:
            runner = ModelRunner(config_for_rank(config, rank), load_format, tp=groups.tp)
            receiver = StepReceiver(groups.step_group, runner.inputs)
            dist.barrier(group=groups.step_group)  # start-up done on every rank
            bound_step_collectives(config)
            with torch.inference_mode():
                while (layout := receiver.receive(runner.inputs)) is not None:
                    runner.execute(layout)
        finally:
            leave_groups()
    except BaseException:
        report_failure(store, rank, f"rank {rank}: {traceback.format_exc()}")
        raise


def run_spawned(config: EngineConfig, load_format: str, rank: int, store_port: int) -> None:
    """Entry point of a worker process spawned by rank 0 on this machine."""
    # Ctrl-C in a terminal reaches the whole process group: rank 0 alone decides what it means
    # (it ends a step first, and stops the workers when it exits); a worker it killed would take
    # the engine down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    if not config.device.startswith("cuda"):
        # The ranks share this machine's cores: one share each, not every core per rank.
        torch.set_num_threads(cpu_threads_per_rank(config.tensor_parallel_size))
    store = connect_store(config, "127.0.0.1", store_port, rank)
    mark_joined(store, rank)
    serve(config, load_format, store, rank)


def cpu_threads_per_rank(tp_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // tp_size)


def _exit_with_parent() -> None:
    """Exit this process as soon as the process that spawned it is gone (even killed)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def wait_then_exit():
        parent.join()
        os._exit(1)

    threading.Thread(target=wait_then_exit, name="fastgen-parent-watch", daemon=True).start()
