"""On a GPU (`make gpu-check`): the whole CUDA path — Triton kernels, CUDA graphs with the LM head
and argmax inside, the measured KV budget — against transformers and against its own promises.
Skipped without a GPU; the CPU suite proves the same path under the Triton interpreter."""

from __future__ import annotations

import importlib

import pytest
import torch

from fastgen import LLM, SamplingParams
from tests.conftest import FAMILIES, random_prompts
from tests.kernels.paged_cases import record_decode_launches
from tests.tiny_models import hf_greedy

pytestmark = pytest.mark.cuda
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_graphs_chunks_and_prefix_hits_match_transformers(tiny_models, reference, family):
    model = tiny_models[family]
    system = random_prompts([48], seed=31)[0]
    shared = random_prompts([5, 20, 33], seed=32, prefix=system)
    prompts = shared + random_prompts([1, 7, 100, 257], seed=33)
    # 7 sequences decode in the graph of size 8, 3 of them after a prefix hit; 257 tokens take
    # five 64-token chunks, each later one over the cached history.
    llm = LLM(model, device="cuda", dtype="float32", block_size=16, num_kv_blocks=256, max_num_seqs=8,
              max_num_batched_tokens=64, cuda_graph_batch_sizes=[1, 2, 4, 8], enforce_eager=False)
    assert llm.engine.runner.backend.name == "triton" and llm.engine.runner.graphs is not None
    first = llm.generate(shared[:1], GREEDY)
    rest = llm.generate(prompts[1:], GREEDY)
    assert llm.engine.block_manager.num_hit_tokens > 0
    assert [o.token_ids for o in first + rest] == reference(model, prompts, GREEDY.max_tokens)


@pytest.mark.parametrize("min_tokens", [32, 64])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_early_cache_reads_under_programmatic_launch_match_transformers(tiny_models, reference, monkeypatch,
                                                                        family, min_tokens):
    """Decode attention's split programs reading their first keys and values before the wait for
    q|k|v (`EARLY_CACHE_READS`) in CUDA graphs of programmatic launches, where that order is real:
    the cache rows they read early were written by earlier steps, the new token's by this one,
    after the wait. Splits of 32 and 64 tokens give every context here several splits, and every
    batch reads early (the default stops at launches of 2 rows)."""
    if not importlib.import_module("fastgen.kernels.programmatic_launch").programmatic_launch(torch.device("cuda")):
        pytest.skip("no programmatic launch on this GPU (Hopper or newer, and a Triton that has it)")
    decode_attention = importlib.import_module("fastgen.kernels.paged_decode_attention")
    monkeypatch.setattr(decode_attention, "EARLY_CACHE_READS", True)
    monkeypatch.setattr(decode_attention, "EARLY_CACHE_READS_MAX_BATCH", None)
    monkeypatch.setattr(importlib.import_module("fastgen.kernels.decode_split_policy"), "MIN_TOKENS_PER_SPLIT",
                        min_tokens)
    early = record_decode_launches(monkeypatch, "EARLY_CACHE_READS")
    model = tiny_models[family]
    prompts = random_prompts([70, 131, 200, 257], seed=34)
    llm = LLM(model, device="cuda", dtype="float32", block_size=16, num_kv_blocks=256, max_num_seqs=4,
              cuda_graph_batch_sizes=[1, 2, 4], enforce_eager=False)
    assert llm.engine.runner.graphs is not None
    outputs = llm.generate(prompts[:1], GREEDY) + llm.generate(prompts[1:], GREEDY)
    assert [o.token_ids for o in outputs] == reference(model, prompts, GREEDY.max_tokens)
    assert True in early  # the graphs captured the early form (programmatic launches on this GPU)


def test_four_row_products_in_the_triton_kernels_match_transformers(tiny_models, reference, monkeypatch):
    """Decode batches of three and four rows (graphs of both sizes: three rows leave the kernels'
    fourth masked) through the skinny products and their fused norms (`SKINNY_MAX_ROWS_ON_CUDA` =
    4, which `gpu_decode.py --skinny-max-rows` times) instead of cuBLAS and the norms apart."""
    from fastgen.layers import quantizable

    kernel, rows = quantizable._normed_skinny_matmul(), []

    def counted(x, *args, **kwargs):
        rows.append(x.reshape(-1, x.shape[-1]).shape[0])
        return kernel(x, *args, **kwargs)

    monkeypatch.setattr(quantizable, "SKINNY_MAX_ROWS_ON_CUDA", 4)
    monkeypatch.setattr(quantizable, "_normed_skinny_matmul", lambda: counted)
    model = tiny_models["qwen3"]
    prompts = random_prompts([9, 30, 64, 100], seed=35)
    llm = LLM(model, device="cuda", dtype="float32", block_size=16, num_kv_blocks=128, max_num_seqs=4,
              cuda_graph_batch_sizes=[1, 2, 3, 4], enforce_eager=False)
    outputs = llm.generate(prompts[:3], GREEDY) + llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == reference(model, prompts[:3] + prompts, GREEDY.max_tokens)
    assert {3, 4} <= set(rows)  # the graphs of three and four rows, replayed above, hold the fused kernels


# Tiny models' logits reach 4-8 in magnitude, where a bf16 ulp is 0.03: two implementations that
# round in different places land a few ulps apart (seen on an H100: up to 0.059). A wrong model
# (RoPE, a norm, a cache slot) moves log-probabilities by tenths.
BF16_LOGPROB_TOL = 0.1


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_tracks_transformers_on_the_same_gpu(tiny_models, family):
    """bf16 with graphs on, against transformers in bf16 on the same GPU.

    Two bf16 implementations round differently, so greedy may take either of two tokens whose
    logits tie within bf16's resolution (the qwen2 model's first token here: 0.007 apart in
    float32). So the test asks what bf16 allows, at every generated position, with transformers
    fed our tokens: our top-5 log-probabilities equal its own within the tolerance, and our
    greedy token is within the tolerance of its best (so wherever its best leads by more, the
    tokens are equal)."""
    model = tiny_models[family]
    prompts = random_prompts([5, 30, 64], seed=3)
    llm = LLM(model, device="cuda", dtype="bfloat16", block_size=16, num_kv_blocks=64, max_num_seqs=4,
              cuda_graph_batch_sizes=[1, 2, 4], enforce_eager=False)
    assert llm.engine.runner.graphs is not None
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5))
    hf = _hf_on_cuda(model)
    for prompt, out in zip(prompts, outputs):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out.token_ids], device="cuda")).logits[0]
        reference = logits[len(prompt) - 1 : -1].float().log_softmax(-1)
        assert len(out.outputs[0].logprobs) == len(out.token_ids) == 8
        for step, (token, top) in enumerate(zip(out.token_ids, out.outputs[0].logprobs)):
            row = reference[step]
            assert row.max().item() - row[token].item() <= BF16_LOGPROB_TOL, (family, len(prompt), step)
            for token_id, logprob in top.items():
                assert abs(logprob.logprob - row[token_id].item()) <= BF16_LOGPROB_TOL, (family, step, token_id)


def _hf_on_cuda(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()


def test_sampled_rows_read_the_graph_logits(tiny_models):
    """A batch mixing greedy and sampled requests leaves the graph's argmax for the sampler;
    a seeded request reproduces whatever shares its batch."""
    model = tiny_models["llama"]
    prompts = random_prompts([6, 9, 12], seed=4)
    seeded = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    llm = LLM(model, device="cuda", dtype="float32", block_size=16, num_kv_blocks=64, max_num_seqs=4,
              cuda_graph_batch_sizes=[1, 2, 4], enforce_eager=False)
    assert llm.engine.runner.graphs is not None
    mixed = llm.generate(prompts, [GREEDY, seeded, GREEDY])
    alone = llm.generate(prompts[1:2], seeded)
    assert mixed[1].token_ids == alone[0].token_ids
    assert [mixed[0].token_ids, mixed[2].token_ids] == hf_greedy(model, [prompts[0], prompts[2]], GREEDY.max_tokens)


def test_measured_budget_covers_the_worst_steps(tmp_path):
    """With the budget measured at start-up, a run of the steps the profile stands for — later
    chunks of a long prompt over its cached history, a full token budget of sampled prompts,
    a full decode batch — never allocates past total * gpu_memory_utilization."""
    import json

    from fastgen.models.presets import preset_config

    (tmp_path / "config.json").write_text(json.dumps(preset_config("qwen3-0.6b")))
    utilization = 0.5
    llm = LLM(str(tmp_path), load_format="dummy", skip_tokenizer_init=True, device="cuda", dtype="bfloat16",
              gpu_memory_utilization=utilization, max_model_len=16384, max_num_batched_tokens=4096,
              max_num_seqs=64, cuda_graph_batch_sizes=[1, 8, 64], enforce_eager=False)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    sampled = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=4, ignore_eos=True)
    llm.generate([[7] * 16000], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    llm.generate(random_prompts([60] * 64, seed=5), sampled)
    torch.cuda.synchronize()
    _, total = torch.cuda.mem_get_info()
    assert torch.cuda.max_memory_allocated() <= total * utilization
