"""A quantized engine's greedy output equals transformers' on the same model with every weight
fastgen quantizes replaced by its dequantized value (`fake_quantized_copy`), token for token in
float32: eagerly for every family and method, and through the compiled CPU graphs."""

from __future__ import annotations

import pytest

from fastgen import LLM, SamplingParams
from fastgen.bench.environment import weight_sizes
from fastgen.config import EngineConfig
from fastgen.cpu.native.quantized_linear import kernel_available, products_served_natively
from fastgen.quantization.formats import check_group_size_fits
from tests.conftest import FAMILIES, random_prompts
from tests.quantization.fake_quantized import fake_quantized_copy
from tests.tiny_models import hf_greedy

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def fake_quantized(tiny_models, tmp_path_factory):
    """(family, method) -> the reference folder, built on first use."""
    made: dict[tuple[str, str], str] = {}

    def get(family: str, method: str) -> str:
        if (family, method) not in made:
            out = tmp_path_factory.mktemp(f"{family}-{method}")
            made[family, method] = str(fake_quantized_copy(tiny_models[family], out, method))
        return made[family, method]

    return get


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_greedy_equals_transformers_on_the_dequantized_weights(tiny_models, fake_quantized, family, method):
    prompts = random_prompts([5, 17, 40], seed=11)
    llm = LLM(tiny_models[family], dtype="float32", quantization=method, block_size=16, num_kv_blocks=64)
    served = products_served_natively()
    got = [out.token_ids for out in llm.generate(prompts, GREEDY)]
    assert got == hf_greedy(fake_quantized(family, method), prompts, MAX_TOKENS)
    assert got != hf_greedy(tiny_models[family], prompts, MAX_TOKENS), "the quantization changed nothing"
    if kernel_available():
        assert products_served_natively() > served  # the C++ kernel computed them


def test_quantized_weights_take_a_half_and_about_a_third(tiny_models):
    """Tiny models have a large vocabulary for their size, so the int8 LM head keeps int4 above
    a quarter here (SmolLM2-135M's figures are in docs/performance.md)."""
    sizes = {method: weight_sizes(LLM(tiny_models["llama"], dtype="bfloat16", quantization=method,
                                      num_kv_blocks=8, block_size=16, max_model_len=128).engine.runner.model)[1]
             for method in (None, "int8", "int4")}
    assert 0.5 <= sizes["int8"] / sizes[None] <= 0.53
    assert sizes["int4"] < 0.4 * sizes[None]


def test_quantization_settings_are_checked(tiny_models):
    with pytest.raises(ValueError, match=r"quantization='fp8' is not one of \['int8', 'int4', 'gguf'\]"):
        LLM(tiny_models["llama"], quantization="fp8")
    with pytest.raises(ValueError, match=r"quantization_group_size=32 needs a quantization method"):
        LLM(tiny_models["llama"], quantization_group_size=32)
    # Named by EngineConfig, before any weight loads: the size, where it came from, and the
    # width it must divide (under tensor parallelism one rank's share).
    with pytest.raises(ValueError, match=r"quantization_group_size=48 does not fit the model: it must divide the "
                                         r"layers fed the hidden state of 64 inputs"):
        EngineConfig(model=tiny_models["llama"], quantization="int4", quantization_group_size=48)
    EngineConfig(model=tiny_models["llama"], quantization="int4", quantization_group_size=64)
    with pytest.raises(ValueError, match=r"quantization_group_size=64 does not fit the model: it must divide the "
                                         r"attention output projection \(its share on each of 2 ranks\) of 32 inputs"):
        EngineConfig(model=tiny_models["llama"], quantization="int4", quantization_group_size=64, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"quantization='int4' groups 32 inputs by default \(quantization_group_size\)"
                                         r" does not fit the model: it must divide the MLP's down projection of 48"):
        check_group_size_fits("int4", None, {"the MLP's down projection": 48})


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_compiled_cpu_graphs_run_the_quantized_kernel(tiny_models, fake_quantized, private_cache, method):
    """One request alone (the graphs over one row) and a batch (over many rows, prompts and
    decodes); then a second engine loads the saved graphs (a quantized layer's dtype attribute
    once made their saved guards unloadable) and gives the same tokens."""
    prompts = random_prompts([11], seed=61) + random_prompts([3, 30, 100, 6], seed=64)
    expected = hf_greedy(fake_quantized("llama", method), prompts, MAX_TOKENS)
    for loaded in (set(), {"layers", "head"}):
        llm = LLM(tiny_models["llama"], dtype="float32", quantization=method, enforce_eager=False,
                  compile_mode="blocking", compile_processes=1, block_size=4, num_kv_blocks=256, max_num_seqs=8,
                  max_num_batched_tokens=64)
        alone = llm.generate(prompts[:1], GREEDY)[0].token_ids
        batch = [out.token_ids for out in llm.generate(prompts[1:], GREEDY)]
        assert [alone, *batch] == expected
        compiled = llm.engine.runner.compiled_decode
        assert set(compiled.first_call_seconds) == {"layers", "head"} and not compiled.failed
        assert compiled.loaded == loaded


@pytest.mark.slow
def test_compiled_bf16_batches_use_the_gemm_over_packed_twins(tiny_models, private_cache):
    """In bf16 the compiled graphs' quantized products go through the twins packed with the
    engine's weights (the GEMM, or for 4-bit codes where rows are rounded the GEMV over the twin;
    their products are checked against the reference in test_quantized_products)."""
    from fastgen.cpu.native.gemm import gemm_available

    if not gemm_available() or not kernel_available():
        pytest.skip("fastgen's bf16 GEMM needs AVX-512 BF16")
    llm = LLM(tiny_models["llama"], dtype="bfloat16", quantization="int4", enforce_eager=False,
              compile_mode="blocking", compile_processes=1, block_size=16, num_kv_blocks=64, max_num_seqs=8,
              max_model_len=256)
    prompts = random_prompts([7, 12, 20, 33], seed=5)
    def by_twin() -> int:
        return products_served_natively(by_gemm=True) + products_served_natively(by_twin_gemv=True)

    before = by_twin()
    batch = [out.token_ids for out in llm.generate(prompts, GREEDY)]
    assert by_twin() > before
    assert llm.engine.runner.compiled_decode.packed_weights > 0
    assert all(len(tokens) == MAX_TOKENS for tokens in batch)


@pytest.mark.cuda
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_greedy_on_cuda_equals_transformers(tiny_models, fake_quantized, method):
    """On CUDA the products run the Triton kernel, inside the decode CUDA graphs."""
    prompts = random_prompts([5, 17, 40], seed=11)
    llm = LLM(tiny_models["llama"], dtype="float32", quantization=method, block_size=16, num_kv_blocks=64,
              device="cuda", enforce_eager=False)
    assert llm.engine.runner.graphs is not None
    got = [out.token_ids for out in llm.generate(prompts, GREEDY)]
    assert got == hf_greedy(fake_quantized("llama", method), prompts, MAX_TOKENS)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_int4_over_two_ranks_equals_transformers(tiny_models, fake_quantized, family):
    """Each rank quantizes its own slice; int4's groups of 32 fall where they fall on one rank, so
    the sharded engine equals transformers on the same dequantized weights."""
    from tests.distributed.thread_ranks import llm_on_thread_ranks

    prompts = random_prompts([3, 21, 50], seed=12)
    llm = llm_on_thread_ranks(tiny_models[family], 2, quantization="int4", block_size=8, max_model_len=128,
                              num_kv_blocks=64)
    got = [out.token_ids for out in llm.generate(prompts, GREEDY)]
    assert got == hf_greedy(fake_quantized(family, "int4"), prompts, MAX_TOKENS)
