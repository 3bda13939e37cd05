"""What the engine drives each step, whoever runs the model: the `StepRunner` interface and the
step's result (`ModelRunnerOutput`).

Two classes implement it: `fastgen.model_runner.ModelRunner` (one device) and
`fastgen.distributed.rank0_runner.TensorParallelRunner` (rank 0 of a tensor-parallel engine,
which hands each step to the other ranks too). Both sit above this module, the engine above both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from fastgen.scheduler_output import SchedulerOutput
from fastgen.worker.top_logprobs import TopLogprobs


@dataclass(frozen=True)
class ModelRunnerOutput:
    """What one step produced.

    sampled: the token of each sequence of the step (None where its chunk stopped short of its
    last token), then of each forked child (`SchedulerOutput.forked_seqs`). logprobs: aligned
    with `sampled`, for the tokens of requests that asked for logprobs (None elsewhere); None
    when none did. prompt_logprobs: seq_id -> (first prompt position covered, its logprobs).
    num_accepted: for a step with draft tokens, how many of each sequence's drafts its samples
    accepted (they precede `sampled[i]`, the sample after them); None in a step without drafts.
    """

    sampled: list[int | None]
    logprobs: list[TopLogprobs | None] | None = None
    prompt_logprobs: dict[int, tuple[int, list[TopLogprobs]]] = field(default_factory=dict)
    num_accepted: list[int] | None = None


@runtime_checkable
class StepRunner(Protocol):
    """A step in two halves, so the host can work while the device computes: `launch(out)` queues
    the step and returns a handle at once; `collect(handle)` waits for its tokens. `forget` and
    `recover` keep per-sequence state in step with the scheduler's facts; `shutdown` releases
    whatever the runner started; `check_alive` raises once it can run no step any more. The rest
    is what start-up built, read by reports and the bench: the device, the model (rank 0's shard
    under tensor parallelism), the KV cache and its block count, the attention backend, the CUDA
    graphs and the compiled CPU step (None when unused). steps_span_processes: a step runs
    collectives across processes that an interrupt must not cut (tensor parallelism)."""

    steps_span_processes: bool
    device: torch.device
    model: torch.nn.Module
    kv_cache: Any
    backend: Any
    graphs: Any
    compiled_decode: Any

    @property
    def num_kv_blocks(self) -> int: ...

    def launch(self, out: SchedulerOutput) -> Any: ...

    def collect(self, step: Any) -> ModelRunnerOutput: ...

    def forget(self, preempted_seq_ids, finished_seq_ids) -> None: ...

    def recover(self, out: SchedulerOutput | None) -> None: ...

    def shutdown(self) -> None: ...

    def check_alive(self) -> None:
        """Raise EngineDeadError when no step can run any more (a tensor-parallel rank died while
        the engine was idle); a no-op on one device."""
        ...
