"""On a machine with two or more GPUs: tensor_parallel_size=2 over NCCL, with the Triton kernels
and a decode CUDA graph captured on each rank, gives transformers' greedy tokens (fp32) through
chunked prefill and prefix hits, and a killed worker fails the engine instead of hanging it.
Skipped with fewer than two GPUs."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from fastgen import LLM, SamplingParams
from fastgen.distributed.supervisor import TensorParallelError
from tests.conftest import random_prompts

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two or more CUDA GPUs"),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
ENGINE_ARGS = dict(device="cuda:0", dtype="float32", block_size=16, num_kv_blocks=128, max_num_seqs=8,
                   max_num_batched_tokens=64, cuda_graph_batch_sizes=[1, 2, 4, 8], tensor_parallel_size=2,
                   enforce_eager=False)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_tp2_on_two_gpus_matches_transformers(tiny_models, reference, family):
    model = tiny_models[family]
    system = random_prompts([40], seed=51)[0]
    prompts = random_prompts([3, 17], seed=52, prefix=system) + random_prompts([1, 9, 150], seed=53)
    with LLM(model, **ENGINE_ARGS) as llm:
        assert llm.engine.runner.graphs is not None
        first = llm.generate(prompts[:1], GREEDY)
        rest = llm.generate(prompts[1:], GREEDY)
        assert llm.engine.block_manager.num_hit_tokens > 0
    assert [o.token_ids for o in first + rest] == reference(model, prompts, GREEDY.max_tokens)


def test_tp2_on_two_gpus_fails_when_a_worker_is_killed(tiny_models):
    llm = LLM(tiny_models["qwen3"], **ENGINE_ARGS)
    llm.generate([[1, 2, 3]], GREEDY)
    os.kill(llm.engine.runner.supervisor.procs[1].pid, signal.SIGKILL)
    with pytest.raises(TensorParallelError, match="tensor-parallel rank 1"):
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
