"""A decode step on CUDA with and without CUDA graphs (group `cuda-decode`; needs a GPU).

Only the public path: LLM(device="cuda", enforce_eager=...) and LLMEngine.step(), timed to a
torch.cuda.synchronize(). Two models: the tiny Qwen3 (the step is all launch overhead, which
graphs remove) and a Qwen3-0.6B-shaped model with random weights (load_format="dummy").
"""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.decoding import DecodingRequests
from fastgen import LLM
from fastgen.models.presets import preset_config

pytestmark = pytest.mark.cuda

BLOCK_SIZE = 256  # flash-attn's paged layout needs a multiple of 256; the Triton kernels take any
WARM_STEPS = 8
LAP_STEPS = 64
ROUNDS = 128


@pytest.fixture(scope="module")
def qwen3_0_6b_dummy(tmp_path_factory) -> str:
    """Qwen3-0.6B's config.json alone (fastgen.models.presets), for random weights."""
    folder = tmp_path_factory.mktemp("qwen3-0.6b-dummy")
    (folder / "config.json").write_text(json.dumps(preset_config("qwen3-0.6b")))
    return str(folder)


def make_llm(model_dir: str, dummy: bool, graphs: bool) -> LLM:
    kwargs = dict(
        device="cuda", dtype="bfloat16", block_size=BLOCK_SIZE, enforce_eager=not graphs,
        num_kv_blocks=256, max_num_seqs=64, max_model_len=2048 if dummy else 1024,
    )
    if dummy:
        return LLM(model_dir, load_format="dummy", skip_tokenizer_init=True, **kwargs)
    return LLM(model_dir, **kwargs)


@pytest.mark.benchmark(group="cuda-decode")
@pytest.mark.parametrize("mode", ["graphs", "eager"])
@pytest.mark.parametrize("batch", [1, 64], ids=lambda b: f"batch{b}")
@pytest.mark.parametrize("model", ["tiny-qwen3", "qwen3-0.6b-dummy"])
def test_decode_step(benchmark, request, model, batch, mode):
    dummy = model == "qwen3-0.6b-dummy"
    model_dir = request.getfixturevalue("qwen3_0_6b_dummy" if dummy else "tiny_qwen3")
    llm = make_llm(model_dir, dummy, graphs=mode == "graphs")
    graphs = llm.engine.runner.graphs
    assert (graphs is not None and graphs.can_run(batch)) == (mode == "graphs")
    decoding = DecodingRequests(llm, batch, (64, 512), WARM_STEPS, LAP_STEPS, sync=torch.cuda.synchronize)
    benchmark.extra_info.update(batch=batch, mode=mode, model=model, block_size=BLOCK_SIZE, dtype="bfloat16")
    outputs = benchmark.pedantic(decoding.step, setup=decoding.before_round, rounds=ROUNDS, warmup_rounds=8)
    assert outputs == batch
