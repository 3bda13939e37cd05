"""Rank 0 of a tensor-parallel engine, in the seat the engine gives its runner.

`TensorParallelRunner` starts (or joins) the other ranks, builds rank 0's `ModelRunner` over its
shard with a `StepSender`, and then behaves as a ModelRunner does: `launch(out)` hands the step
to every rank and runs rank 0's part, `collect(step)` returns the sampled tokens (sampling is
rank 0's). Anything that fails inside a step's collectives takes the whole engine down: the
workers are stopped and a `TensorParallelError` names the failed rank (a rank's collectives can
no longer be matched after a step broke off half way, so no later step could be trusted); rank
0's own failure before or after them is the step's, isolated to its request as on one device. `shutdown()`, the
engine's garbage collection and interpreter exit all stop the workers; none is left behind.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable
from contextlib import contextmanager

import torch

from fastgen.config import EngineConfig
from fastgen.distributed.launch import (
    bound_step_collectives,
    check_no_process_group,
    config_for_rank,
    join_groups,
    torchrun_env,
)
from fastgen.distributed.step_protocol import StepSender
from fastgen.distributed.supervisor import (
    EXPLAIN_WAIT_S,
    TensorParallelError,
    WorkerSupervisor,
)
from fastgen.distributed.worker import cpu_threads_per_rank
from fastgen.scheduler_output import SchedulerOutput


def start_tensor_parallel(config: EngineConfig, load_format: str, eos_token_ids: Iterable[int] = ()
                          ) -> TensorParallelRunner:
    """Rank 0's runner. On a rank > 0 of a torchrun job, serve as that rank's worker until rank
    0's engine stops, then exit the process (SystemExit(0)): only rank 0 runs the application."""
    env = torchrun_env()
    if env is not None and env.rank > 0:
        from fastgen.distributed.launch import connect_store, watch_rank0
        from fastgen.distributed.worker import serve

        store = connect_store(config, env.master_addr, env.master_port, env.rank)
        watch_rank0(config, env.master_addr, env.master_port, env.rank)  # rank 0 is on another host, maybe
        serve(config, load_format, store, env.rank)
        raise SystemExit(0)
    return TensorParallelRunner(config, load_format, eos_token_ids)


def _abort_default_group() -> None:
    """Make pending NCCL work on rank 0 fail instead of waiting for a dead peer (CUDA)."""
    import torch.distributed.distributed_c10d as c10d

    abort = getattr(c10d, "_abort_process_group", None)  # torch's own abort; absent in old releases
    if abort is not None:
        abort()


def _stop(supervisor: WorkerSupervisor, threads: int | None) -> None:
    supervisor.stop()
    if threads is not None:
        torch.set_num_threads(threads)


class TensorParallelRunner:  # implements fastgen.step_runner.StepRunner
    """Rank 0's runner: steps go to every rank (`launch` / `collect`), and what start-up built
    (model, KV cache, graphs, ...) is rank 0's `ModelRunner`'s, its shard of the model."""

    # The engine holds Ctrl-C back until a step has ended on every rank (`LLMEngine.run_step`).
    steps_span_processes = True

    def __init__(self, config: EngineConfig, load_format: str = "safetensors", eos_token_ids: Iterable[int] = ()):
        from fastgen.model_runner import ModelRunner

        check_no_process_group()  # before a worker starts: a refusal leaves the other group alone
        env = torchrun_env()
        self._step_timeout_s = config.distributed_step_timeout_s
        saved_threads = None
        if not config.device.startswith("cuda") and env is None:
            # The spawned ranks share this machine's cores with rank 0: one share each.
            saved_threads = torch.get_num_threads()
            torch.set_num_threads(cpu_threads_per_rank(config.tensor_parallel_size))
        try:
            self.supervisor = (WorkerSupervisor.spawn(config, load_format) if env is None
                               else WorkerSupervisor.join_torchrun(config, env))
        except BaseException:
            if saved_threads is not None:
                torch.set_num_threads(saved_threads)
            raise
        self._finalizer = weakref.finalize(self, _stop, self.supervisor, saved_threads)
        with self._failing_takes_all_down(in_step=False):
            groups = join_groups(config, self.supervisor.store, 0)
            if config.device.startswith("cuda"):
                self.supervisor.abort_device_group = _abort_default_group
            self.runner = ModelRunner(config_for_rank(config, 0), load_format, eos_token_ids, tp=groups.tp,
                                      make_step_sender=functools.partial(StepSender, groups.step_group))
            self.supervisor.send_stop = self.runner.step_sender.stop
            torch.distributed.barrier(group=groups.step_group)  # every rank has started
            bound_step_collectives(config, groups.step_group)

    @property
    def num_kv_blocks(self) -> int:
        return self.runner.num_kv_blocks

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    @property
    def kv_cache(self):
        return self.runner.kv_cache

    @property
    def backend(self):
        return self.runner.backend

    @property
    def graphs(self):
        return self.runner.graphs

    @property
    def compiled_decode(self):
        return self.runner.compiled_decode

    def forget(self, preempted_seq_ids, finished_seq_ids) -> None:
        self.runner.forget(preempted_seq_ids, finished_seq_ids)

    def recover(self, out: SchedulerOutput | None) -> None:
        self.runner.recover(out)

    def launch(self, out: SchedulerOutput):
        self._check_up()
        with self._failing_takes_all_down():
            return self.runner.launch(out)

    def collect(self, step):
        with self._failing_takes_all_down():
            sampled = self.runner.collect(step)
        self._check_up()  # a worker that died during the step may have cut its collectives short
        return sampled

    def check_alive(self) -> None:
        """TensorParallelError (an EngineDeadError) once a rank has failed, steps or not."""
        self._check_up()

    def _check_up(self) -> None:
        if self.supervisor.failure is not None:
            self._finalizer()
            raise TensorParallelError(f"the tensor-parallel engine is down: {self.supervisor.failure}")

    @contextmanager
    def _failing_takes_all_down(self, in_step: bool = True):
        """What breaks off a step's collectives (or start-up) stops every rank, as no later step
        could be matched across the ranks: it raises a TensorParallelError naming the rank that
        failed or, in a step, rank 0's own failure (its error, or a collective that timed out: a
        partition, a lost host, a stuck peer), so it is never one request's failure. Rank 0's own
        error outside the collectives (filling inputs, sampling, logprobs) leaves the ranks in
        step: it is re-raised as it is, and the engine isolates it to its request. At start-up
        rank 0's own error (a ValueError for a bad setting, say) and, anywhere, an interrupt
        (KeyboardInterrupt, ...) are re-raised as they are, after the workers are stopped."""
        try:
            yield
        except Exception as exc:
            if in_step and not self.runner.in_collectives and self.supervisor.failure is None:
                raise
            self._take_all_down(exc, in_step)
        except BaseException as exc:
            self._take_all_down(exc, in_step)

    def _take_all_down(self, exc: BaseException, in_step: bool) -> None:
        cause = self.supervisor.explain(EXPLAIN_WAIT_S if isinstance(exc, RuntimeError) else 0.2)
        if cause is None:
            self.supervisor.record(f"rank 0 failed: {exc!r}")
        self._finalizer()
        if cause is None and (not in_step or not isinstance(exc, Exception)):
            raise exc  # start-up's own error (a ValueError stays one), or an interrupt
        raise TensorParallelError(cause or (
            "the tensor-parallel engine is down: a step failed on rank 0 and no other rank said why (rank "
            "0's own error, or a collective that waited distributed_step_timeout_s="
            f"{self._step_timeout_s:g}: a lost host, a network partition, a stuck rank): {exc!r}")) from exc

    def shutdown(self) -> None:
        """Stop the workers and leave the process groups (idempotent)."""
        self._finalizer()
