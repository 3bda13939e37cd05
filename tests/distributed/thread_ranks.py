"""Tensor-parallel ranks as threads of the test process: every rank's ModelRunner over its own
shard, the collectives meeting at a barrier. It checks the sharded model (layers, loading, KV
heads per rank, replicated KV heads) quickly and for any rank count, without processes; the
real processes, gloo and the step protocol are tested in test_tensor_parallel_engine.py."""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from fastgen import LLM
from fastgen.model_runner import ModelRunner


class ThreadCollectives:
    """What `TensorParallelGroup` does over torch.distributed, done over threads."""

    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=60)  # a failing rank breaks it: no hang
        self.slots: list[torch.Tensor | None] = [None] * size

    def _exchange(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = x.clone()
        self.barrier.wait()
        pieces = list(self.slots)
        self.barrier.wait()  # everyone has read before anyone writes the next collective's slot
        return pieces

    def rank(self, rank: int) -> "ThreadRank":
        return ThreadRank(rank, self.size, self)


@dataclasses.dataclass(frozen=True)
class ThreadRank:
    rank: int
    size: int
    collectives: ThreadCollectives

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x.copy_(torch.stack(self.collectives._exchange(self.rank, x)).sum(0))

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.collectives._exchange(self.rank, x), dim=-1)

    def min_across_ranks(self, value: int, device) -> int:
        return value


class ThreadRanksRunner:
    """Stands in for the engine's runner: rank 0 launches (and samples) as a single-device
    runner would, ranks 1.. fill the same step from the same scheduler output and execute it."""

    steps_span_processes = False  # one process: the ranks are its threads

    def __init__(self, config, size: int):
        tp_config = dataclasses.replace(config, tensor_parallel_size=size)
        collectives = ThreadCollectives(size)
        self.runners = [ModelRunner(tp_config, tp=collectives.rank(r)) for r in range(size)]
        self.pool = ThreadPoolExecutor(size - 1)

    @property
    def num_kv_blocks(self) -> int:
        return self.runners[0].num_kv_blocks

    def launch(self, out):
        others = [self.pool.submit(lambda r=r: r.execute(r._fill(out))) for r in self.runners[1:]]
        launched = self.runners[0].launch(out)
        for future in others:
            future.result()
        return launched

    def collect(self, step):
        return self.runners[0].collect(step)

    def forget(self, preempted_seq_ids, finished_seq_ids):
        # Rank 0's alone, as `Rank0Runner.forget` does.
        self.runners[0].forget(preempted_seq_ids, finished_seq_ids)

    def shutdown(self):
        self.pool.shutdown()


def llm_on_thread_ranks(model: str, size: int, **engine_args) -> LLM:
    """An LLM whose model runs split over `size` thread ranks (num_kv_blocks must be given, so
    the block manager the LLM built matches every rank's cache)."""
    llm = LLM(model, dtype="float32", **engine_args)
    llm.engine.runner = ThreadRanksRunner(llm.config, size)
    return llm
