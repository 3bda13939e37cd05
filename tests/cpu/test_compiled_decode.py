"""The compiled CPU steps: greedy parity with transformers through both graphs (decode, of one
row and of several, and prefill)."""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch

from fastgen import LLM, SamplingParams
from fastgen.cpu.native.features import has_native_bf16
from fastgen.cpu.saved_graphs import UNUSED_DAYS, graph_key
from tests.conftest import random_prompts
from tests.tiny_models import hf_greedy

# The graphs a model whose layers are alike compiles: one group of layers, and the head.
GROUPED = {"layers", "head"}


def assert_each_equals_transformers(reference, model: str, prompts, max_tokens, outputs) -> None:
    """Each output is transformers' greedy continuation of its prompt, max_tokens[i] long."""
    for prompt, m, out in zip(prompts, max_tokens, outputs, strict=True):
        assert out.outputs[0].token_ids == reference(model, [prompt], m)[0]


def failing(calls: list, message: str):
    """A stand-in that records each call's arguments in `calls` and raises RuntimeError(message)."""

    def fail(*args, **kwargs):
        calls.append(args)
        raise RuntimeError(message)

    return fail


def compiled_llm(model: str) -> LLM:
    """Every graph compiled in this process (no helpers), so each test sees what it built or loaded."""
    return LLM(model, enforce_eager=False, compile_mode="blocking", compile_processes=1, dtype="float32",
               block_size=4, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=64)


def check_family(model, reference):
    """One request alone (the decode graph traced with one row), then a ragged batch with a shared
    prefix and a chunked prompt (the same graph over several rows, its batch size changing as
    requests finish). Every
    prompt goes through the prefill graph: alone (one sampled row), the batch's (a one-token
    prompt among them), a prefix-cached remainder and the 100-token prompt's chunks (64 tokens
    a step: later chunks attend to the earlier ones in the cache)."""
    llm = compiled_llm(model)
    runner = llm.engine.runner
    assert runner.compiled_decode is not None and runner.graphs is None
    assert runner.compiled_decode.runs_prefill
    alone = random_prompts([11], seed=61)
    prefix = random_prompts([9], seed=62)[0]
    batch = random_prompts([3, 30], seed=63, prefix=prefix) + random_prompts([1, 100, 6], seed=64)
    max_tokens = [12, 5, 20, 9, 16]
    outputs = llm.generate(alone, SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True))
    assert outputs[0].outputs[0].token_ids == reference(model, alone, 14)[0]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    assert_each_equals_transformers(reference, model, batch, max_tokens, llm.generate(batch, params))
    assert set(runner.compiled_decode.first_call_seconds) == GROUPED
    return runner.compiled_decode


def test_compiled_decode_matches_transformers(tiny_models, reference, private_cache):
    """The first engine compiles its graphs (a group of layers and the head) and saves them; a
    second engine loads them, and both match transformers."""
    first = check_family(tiny_models["qwen3"], reference)
    paths = [first.paths[name] for name in sorted(GROUPED)]
    assert first.needed == ("layers", "head") and first.loaded == set() and all(p.is_file() for p in paths)
    assert first.grouped.size == 1 and len(first.grouped.groups) == 2  # the tiny model's two layers
    week_ago = time.time() - 7 * 86400
    for path in paths:
        os.utime(path, (week_ago, week_ago))
    second = check_family(tiny_models["qwen3"], reference)
    assert second.loaded == GROUPED and second.paths == first.paths
    assert all(path.stat().st_mtime > week_ago + 86400 for path in paths)  # loading marks use


def test_compiled_steps_in_bfloat16_track_transformers_in_bfloat16(tiny_models, private_cache, monkeypatch):
    """The graphs in bf16 (the CPU default where it is native): Inductor's fused loops round each
    intermediate where eager torch does (`emulate_precision_casts`), the GEMMs over packed weights
    give F.linear's results (oneDNN's exactly, fastgen's within one rounding), and attention
    follows torch's flash kernel, so the first tokens equal transformers' own bf16 run (later
    ones may part after a near-tie, as in eager bf16).
    A second engine loads the saved graphs: they find the new model's packed weights too (in the
    op's Python kernel or its C++ one)."""
    from fastgen.cpu.native import packed_linear

    packed_products = []
    real = packed_linear._packed_product
    monkeypatch.setattr(packed_linear, "_packed_product",
                        lambda *args: packed_products.append(args[0].shape[0]) or real(*args))
    model = tiny_models["qwen3"]
    prompts = random_prompts([5, 30, 64], seed=3)
    expected = hf_greedy(model, prompts, 3, dtype=torch.bfloat16)
    for loaded in (set(), GROUPED):
        packed_products.clear()
        native_before = packed_linear.products_served_natively()
        llm = LLM(model, enforce_eager=False, compile_mode="blocking", compile_processes=1, dtype="bfloat16",
                  block_size=16, num_kv_blocks=64)
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        assert [o.outputs[0].token_ids[:2] for o in outputs] == [e[:2] for e in expected]
        compiled = llm.engine.runner.compiled_decode
        assert set(compiled.first_call_seconds) == GROUPED and compiled.loaded == loaded
        if has_native_bf16():  # every linear of a forward found its packed twin
            linears = sum(isinstance(m, torch.nn.Linear) for m in llm.engine.runner.model.modules())
            through_twins = len(packed_products) + packed_linear.products_served_natively() - native_before
            assert compiled.packed_weights == linears and through_twins >= linears


def test_a_step_with_a_token_it_must_not_store_never_writes_the_cache(tiny_models, reference, private_cache):
    """A prompt whose blocks are all in the prefix cache recomputes its last token without storing
    it (slot -1). A compiled store has no -1 filter (-1 would index the cache's last slot), so
    that step runs eagerly: outputs equal transformers and the last slot, which no sequence owns
    here (blocks are handed out lowest first), keeps what it held."""
    model = tiny_models["qwen3"]
    llm = compiled_llm(model)  # block_size 4, 256 blocks
    prompt, other = random_prompts([8], seed=69), random_prompts([5], seed=70)  # 8 tokens: two whole blocks
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate(prompt, params)  # its two blocks stay in the prefix cache
    k_cache, v_cache = llm.engine.runner.kv_cache.layers[0]
    before = k_cache[-1, -1].clone(), v_cache[-1, -1].clone()
    outputs = llm.generate(prompt + other, params)
    assert_each_equals_transformers(reference, model, prompt + other, [4, 4], outputs)
    assert torch.equal(k_cache[-1, -1], before[0]) and torch.equal(v_cache[-1, -1], before[1])


@pytest.mark.slow  # a compile of its own for one shape's guard
def test_decode_graph_traced_with_rows_equal_to_context(tiny_models, reference, private_cache):
    """The first decode step has 3 rows attending to at most 3 tokens: the graph must keep rows
    and context length apart, or every later step (other sizes, no guards) would go wrong; the
    same graph then runs the last request's steps alone, one row."""
    model = tiny_models["qwen3"]
    llm = compiled_llm(model)
    prompts = random_prompts([2, 1, 1], seed=66) + random_prompts([5, 13], seed=67)
    max_tokens = [9, 4, 12, 7, 10]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    assert_each_equals_transformers(reference, model, prompts[:3], max_tokens[:3],
                                    llm.generate(prompts[:3], params[:3]))
    assert_each_equals_transformers(reference, model, prompts, max_tokens, llm.generate(prompts, params))


@pytest.mark.slow  # two compiles: a fault's recovery
def test_an_unreadable_saved_graph_is_compiled_again(tiny_models, reference, private_cache, caplog):
    model = tiny_models["qwen3"]
    prompt = random_prompts([7], seed=65)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = compiled_llm(model)
    first.generate(prompt, params)
    path = first.engine.runner.compiled_decode.paths["layers"]
    path.write_bytes(b"not a compiled graph")
    # Packages beside it: one left unused for longer than UNUSED_DAYS, one used more recently.
    day = 86400
    stale, recent = path.parent / "decode-stale.pt", path.parent / "decode-recent.pt"
    for package, age in ((stale, UNUSED_DAYS + 1), (recent, UNUSED_DAYS - 1)):
        package.write_bytes(b"an older package")
        os.utime(package, (time.time() - age * day,) * 2)
    llm = compiled_llm(model)
    with caplog.at_level(logging.WARNING, logger="fastgen.cpu.saved_graphs"):
        out = llm.generate(prompt, params)
    assert out[0].outputs[0].token_ids == reference(model, prompt, 6)[0]
    assert llm.engine.runner.compiled_decode.loaded == {"head"}  # the layers' graph compiled anew
    assert "could not load the compiled graph" in caplog.text
    assert path.stat().st_size > 1000  # saved anew
    assert not stale.exists() and recent.exists()


def test_a_graph_that_cannot_be_built_decodes_eagerly(tiny_models, reference, private_cache, monkeypatch,
                                                     caplog):
    """A compile that raises (a compiler bug, no C++ toolchain) is logged once, never retried,
    and its steps run eagerly: outputs still equal transformers."""
    calls = []
    monkeypatch.setattr("fastgen.cpu.compiled_decode.load_or_compile", failing(calls, "no C++ compiler"))
    model = tiny_models["qwen3"]
    llm = compiled_llm(model)
    prompts = random_prompts([7, 12], seed=68)
    with caplog.at_level(logging.ERROR, logger="fastgen.cpu.compiled_decode"):
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert_each_equals_transformers(reference, model, prompts, [8, 8], outputs)
    assert llm.engine.runner.compiled_decode.failed == {"layers"} and len(calls) == 1
    assert "could not build the CPU step graph layers" in caplog.text
    out = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert out[0].outputs[0].token_ids == reference(model, prompts[:1], 5)[0]
    assert len(calls) == 1  # never tried again


def test_graphs_that_raise_at_their_first_run_are_dropped_once(tiny_models, reference, private_cache,
                                                               monkeypatch, caplog):
    """Graphs that build but raise when first run (a broken package, say) are logged once and
    dropped: every step after runs eagerly, none calls them again, outputs equal transformers."""
    from fastgen.cpu import compiled_decode

    calls = []
    raising = failing(calls, "a graph that cannot run")
    monkeypatch.setattr(compiled_decode, "load_or_compile", lambda *args, **kwargs: (raising, False))
    model = tiny_models["qwen3"]
    llm = compiled_llm(model)
    prompts = random_prompts([7, 12], seed=69)
    with caplog.at_level(logging.ERROR, logger="fastgen.cpu.compiled_decode"):
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert_each_equals_transformers(reference, model, prompts, [8, 8], outputs)
    compiled = llm.engine.runner.compiled_decode
    assert len(calls) == 1 and caplog.text.count("failed at their first run") == 1
    assert compiled.failed == GROUPED and compiled.first_call_seconds == {} and compiled.loaded == set()


@pytest.mark.slow  # a compile of the fallback's graph
def test_layers_that_cannot_be_grouped_run_as_one_graph(tiny_models, reference, private_cache, monkeypatch):
    """Where the layers' weights cannot be cut into groups, the whole step is the rows graph."""
    from fastgen.cpu.compiled_decode import CompiledDecodeStep

    monkeypatch.setattr(CompiledDecodeStep, "_group_layers", lambda self: None)
    model = tiny_models["llama"]
    llm = compiled_llm(model)
    prompts = random_prompts([9], seed=70) + random_prompts([4, 25], seed=71)
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    alone = llm.generate(prompts[:1], params)
    assert_each_equals_transformers(reference, model, prompts[:1], [7], alone)
    assert_each_equals_transformers(reference, model, prompts[1:], [7, 7], llm.generate(prompts[1:], params))
    compiled = llm.engine.runner.compiled_decode
    assert compiled.needed == ("rows",) and set(compiled.first_call_seconds) == {"rows"} and not compiled.failed


def test_where_the_kernel_runs_no_prefill_decode_steps_run_the_decode_graph(tiny_models, reference, private_cache,
                                                                           monkeypatch):
    """A model whose prefill the C++ kernel does not cover: prompts run eagerly and decode steps
    through the decode graph (the whole step in one graph, attention in torch)."""
    from fastgen.cpu import compiled_decode

    monkeypatch.setattr(compiled_decode, "kernel_runs_prefill", lambda model, kv_caches: False)
    model = tiny_models["qwen3"]
    llm = compiled_llm(model)
    prompts = random_prompts([8], seed=72) + random_prompts([5, 19], seed=73)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    assert_each_equals_transformers(reference, model, prompts[:1], [6], llm.generate(prompts[:1], params))
    assert_each_equals_transformers(reference, model, prompts[1:], [6, 6], llm.generate(prompts[1:], params))
    compiled = llm.engine.runner.compiled_decode
    assert compiled.needed == ("decode",) and set(compiled.first_call_seconds) == {"decode"} and not compiled.failed


def test_graph_key_follows_shapes_and_configuration():
    model = torch.nn.Linear(8, 4)
    cache = [torch.zeros(16, 4, 2, 8)]
    key = graph_key("decode", model, "config-a", cache)
    assert key == graph_key("decode", model, "config-a", [torch.zeros(16, 4, 2, 8)])
    assert key != graph_key("rows", model, "config-a", cache)
    assert key != graph_key("decode", model, "config-b", cache)
    assert key != graph_key("decode", model, "config-a", [torch.zeros(32, 4, 2, 8)])
    assert key != graph_key("decode", model, "config-a", [torch.zeros(16, 4, 2, 8, dtype=torch.bfloat16)])
    assert key != graph_key("decode", torch.nn.Linear(8, 5), "config-a", cache)


@pytest.mark.parametrize("family", [pytest.param("qwen2", marks=pytest.mark.slow),
                                    pytest.param("llama", marks=pytest.mark.slow), "gpt2"])
def test_compiled_decode_matches_transformers_every_family(tiny_models, reference, family, private_cache):
    """GPT-2 in the quick suite: its K/V are views of one projection's output, whose strides a
    decode graph traced from a single row once got wrong for every later batch."""
    check_family(tiny_models[family], reference)


def test_triton_backend_engines_decode_eagerly(tiny_models):
    """The compiled step is the torch backend's: an engine on another backend never builds it."""
    llm = LLM(tiny_models["qwen3"], enforce_eager=False, attention_backend="triton", block_size=16,
              num_kv_blocks=16, max_num_seqs=2, max_model_len=128)
    assert llm.engine.runner.compiled_decode is None
