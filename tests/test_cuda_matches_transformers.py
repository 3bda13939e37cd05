"""On a GPU (`make gpu-check`): the whole CUDA path — Triton kernels, CUDA graphs with the LM head
and argmax inside, the measured KV budget — against transformers and against its own promises.
Skipped without a GPU; the CPU suite proves the same path under the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from fastgen import LLM, SamplingParams
from tests.conftest import FAMILIES, random_prompts
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


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_tracks_transformers_on_the_same_gpu(tiny_models, family):
    model = tiny_models[family]
    prompts = random_prompts([5, 30, 64], seed=3)
    llm = LLM(model, device="cuda", dtype="bfloat16", block_size=16, num_kv_blocks=64)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    expected = _hf_greedy_on_cuda(model, prompts, 3)
    assert [o.token_ids[:2] for o in outputs] == [e[:2] for e in expected]


def _hf_greedy_on_cuda(model_dir: str, prompts, n: int):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        return [hf.generate(torch.tensor([p], device="cuda"), do_sample=False, max_new_tokens=n,
                            min_new_tokens=0)[0, len(p):].tolist() for p in prompts]


def test_sampled_rows_read_the_graph_logits(tiny_models):
    """A batch mixing greedy and sampled requests leaves the graph's argmax for the sampler;
    a seeded request reproduces whatever shares its batch."""
    model = tiny_models["llama"]
    prompts = random_prompts([6, 9, 12], seed=4)
    seeded = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    llm = LLM(model, device="cuda", dtype="float32", block_size=16, num_kv_blocks=64, max_num_seqs=4)
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
