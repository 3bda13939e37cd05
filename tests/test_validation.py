"""Bad input is refused at the boundary with a ValueError naming the field, the value and the
limit; a rejected request leaves the engine usable and runs nothing."""

from __future__ import annotations

import json
import shutil

import pytest

from fastgen import LLM, SamplingParams
from fastgen.config import EngineConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["qwen3"], dtype="float32", block_size=16, num_kv_blocks=64, max_model_len=128)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(temperature=-0.5), r"temperature=-0.5 must be a finite number in \[0, 3.4e38\]"),
        (dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p=1.5 must be in \(0, 1\]"),
        (dict(top_k=0), r"top_k=0 must be -1 \(disabled\) or an integer >= 1"),
        (dict(top_k=-2), r"top_k=-2 must be -1 \(disabled\) or an integer >= 1"),
        (dict(max_tokens=0), r"max_tokens=0 must be >= 1"),
        (dict(seed=-1), r"seed=-1 must be >= 0"),
        (dict(seed=2**64), r"seed=18446744073709551616 must be < 2\*\*64"),
        (dict(stop=[""]), r"stop must hold non-empty strings"),
        (dict(stop_token_ids=5), r"stop_token_ids=5 must be a list"),
        (dict(temperature=float("nan")), r"temperature=nan must be a finite number"),
        (dict(temperature=float("inf")), r"temperature=inf must be a finite number"),
        (dict(temperature=True), r"temperature=True must be a finite number"),
        (dict(n=0), r"n=0 must be >= 1"),
        (dict(n=2.0), r"n=2.0 must be an integer >= 1"),
        (dict(logprobs=-1), r"logprobs=-1 must be >= 0"),
        (dict(prompt_logprobs=True), r"prompt_logprobs=True must be an integer >= 0"),
        (dict(presence_penalty=2.5), r"presence_penalty=2.5 must be in \[-2, 2\]"),
        (dict(frequency_penalty=-2.01), r"frequency_penalty=-2.01 must be in \[-2, 2\]"),
        (dict(frequency_penalty=float("nan")), r"frequency_penalty=nan must be in \[-2, 2\]"),
        (dict(repetition_penalty=0.0), r"repetition_penalty=0.0 must be in \(0, 2\]"),
        (dict(repetition_penalty=3), r"repetition_penalty=3 must be in \(0, 2\]"),
        (dict(min_p=1.5), r"min_p=1.5 must be in \[0, 1\]"),
        (dict(min_p="0.1"), r"min_p='0.1' must be in \[0, 1\]"),
        (dict(min_tokens=-1), r"min_tokens=-1 must be >= 0"),
        (dict(min_tokens=17, max_tokens=16), r"min_tokens=17 must be <= max_tokens=16"),
    ],
)
def test_sampling_params_bounds(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_empty_prompt(llm):
    with pytest.raises(ValueError, match=r"prompt=''.*is empty.*at least 1 token"):
        llm.generate([""], GREEDY)
    with pytest.raises(ValueError, match=r"prompt=\[\] is empty"):
        llm.generate([[]], GREEDY)


def test_an_empty_text_prompt_is_the_bos_a_tokenizer_adds(tmp_path):
    """transformers' tokenizer("") is [BOS] where the tokenizer adds one: a 1-token prompt."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    from tests.tiny_models import build_tiny_model, build_tokenizer, hf_greedy

    folder = build_tiny_model("llama", tmp_path / "llama", vocab_size=400)
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"bos_token": "<s>"})
    bos = tokenizer.convert_tokens_to_ids("<s>")
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)])
    tokenizer.save_pretrained(folder)
    assert AutoTokenizer.from_pretrained(folder)("").input_ids == [bos]
    (out,) = LLM(str(folder), dtype="float32", num_kv_blocks=16).generate("", GREEDY)
    assert out.prompt_token_ids == [bos] and out.token_ids == hf_greedy(folder, [[bos]], GREEDY.max_tokens)[0]


def test_text_that_is_not_unicode_is_named(llm):
    """A lone UTF-16 surrogate (JSON can carry one): tokenizers refuse it with a TypeError."""
    with pytest.raises(ValueError, match=r"prompt holds '\\ud800' at index 3, a lone surrogate: not Unicode text"):
        llm.generate(["hi \ud800"], GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_a_text_prompt_too_long_to_fit_is_refused_before_it_is_tokenized(llm, monkeypatch):
    """Tokenizing megabytes takes seconds (and a server's loop thread with it); no token of the
    vocabulary stands for more characters than its longest entry, so a longer text cannot fit."""
    tokenizer = llm.engine.tokenizer
    max_model_len = llm.config.max_model_len
    longest = max(map(len, tokenizer.get_vocab()))
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: pytest.fail("the prompt was tokenized"))
    text = "ab" * (2 * max_model_len * longest + 1)
    with pytest.raises(ValueError, match=rf"prompt has {len(text):,} characters: it cannot fit in "
                                         rf"max_model_len={max_model_len} tokens"):
        llm.generate([text], GREEDY)
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"exceeds max_model_len"):  # shorter: tokenized, then refused
        llm.generate(["ab" * max_model_len], GREEDY)


def test_token_outside_vocabulary(llm):
    vocab = llm.config.model_config.vocab_size
    with pytest.raises(ValueError, match=rf"token_ids\[1\]={vocab} is outside the vocabulary \[0, {vocab}\)"):
        llm.generate([[1, vocab, 2]], GREEDY)
    with pytest.raises(ValueError, match=r"token_ids\[0\]=-3 is outside"):
        llm.generate([[-3]], GREEDY)


def test_prompt_plus_max_tokens_over_max_model_len(llm):
    with pytest.raises(ValueError, match=r"prompt length 120 \+ max_tokens 10 = 130 exceeds max_model_len=128"):
        llm.generate([[5] * 120], SamplingParams(max_tokens=10))


def test_one_bad_request_rejects_batch_before_anything_runs(llm, reference, tiny_models):
    good = [[5, 6, 7], [8, 9]]
    steps_before = llm.engine.num_steps
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate(good + [[1] * 200], GREEDY)
    assert llm.engine.num_steps == steps_before
    assert not llm.engine.has_unfinished_requests()
    # ... and the engine still serves.
    outputs = llm.generate(good, GREEDY)
    assert [o.token_ids for o in outputs] == reference(tiny_models["qwen3"], good, 4)


def test_mismatched_params_list(llm):
    with pytest.raises(ValueError, match="sampling_params has 1 entries but there are 2 prompts"):
        llm.generate([[1], [2]], [GREEDY])
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams or a list of them, got dict"):
        llm.generate([1, 2], {"max_tokens": 3})


def test_stop_strings_without_a_tokenizer_are_refused(tiny_models):
    """They are looked for in the text, which an engine without a tokenizer never has."""
    no_tokenizer = LLM(tiny_models["qwen3"], dtype="float32", num_kv_blocks=8, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match=r"stop=\['a'\] needs the text, .*skip_tokenizer_init=True"):
        no_tokenizer.generate([1, 2], SamplingParams(stop=["a"]))
    assert len(no_tokenizer.generate([1, 2], SamplingParams(max_tokens=2, stop_token_ids=[5]))[0].token_ids) <= 2


def test_kv_budget_too_small_for_one_sequence(tiny_models):
    with pytest.raises(ValueError, match=r"holds 3 blocks of 16 tokens .* max_model_len=128 sequence needs 8 blocks"):
        LLM(tiny_models["qwen3"], dtype="float32", block_size=16, num_kv_blocks=3, max_model_len=128)
    with pytest.raises(ValueError, match=r"KV cache budget holds 0 blocks"):
        LLM(tiny_models["qwen3"], dtype="float32", kv_cache_memory_bytes=1000)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(block_size=0), r"block_size=0 must be >= 1"),
        (dict(max_num_seqs=0), r"max_num_seqs=0 must be >= 1"),
        (dict(max_num_batched_tokens=-1), r"max_num_batched_tokens=-1 must be >= 1"),
        (dict(max_model_len=100000), r"max_model_len=100000 exceeds the model's max_position_embeddings=1024"),
        (dict(dtype="int8"), r"dtype='int8' is not one of"),
        (dict(device="tpu"), r"device='tpu' must be"),
        (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization=1.5 must be in \(0, 1\]"),
        (dict(num_kv_blocks=0), r"num_kv_blocks=0 must be >= 1"),
        (dict(block_size=2.5), r"block_size=2.5 must be an integer"),
        (dict(device="cuda:abc"), r"device='cuda:abc' must be"),
        (dict(gpu_memory_utilization="0.5"), r"gpu_memory_utilization='0.5' must be in \(0, 1\]"),
        (dict(cuda_graph_batch_sizes=8), r"cuda_graph_batch_sizes=8 must list at least one size"),
        (dict(seed=2**64), r"seed=18446744073709551616 must be < 2\*\*64"),
    ],
)
def test_engine_config_bounds(tiny_models, kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=tiny_models["qwen3"], **kwargs)


def test_unknown_engine_argument(tiny_models):
    with pytest.raises(ValueError, match=r"unknown engine argument\(s\) \['max_num_sequences'\]"):
        LLM(tiny_models["qwen3"], max_num_sequences=4)


@pytest.mark.parametrize("family, key, value, message", [
    ("llama", "hidden_act", "gelu", r"hidden_act='gelu' is not one of \['silu', 'swish'\]"),
    ("llama", "mlp_bias", True, "mlp_bias=true is not supported"),
])
def test_a_config_switch_the_layers_do_not_implement_is_refused(tiny_models, tmp_path, family, key, value,
                                                                message):
    """Such a model would run, and be silently wrong."""
    from fastgen.models.config import ModelConfig

    folder = tmp_path / family
    shutil.copytree(tiny_models[family], folder)
    config = json.loads((folder / "config.json").read_text())
    ModelConfig.from_folder(folder)  # as written: accepted
    (folder / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_folder(folder)


@pytest.mark.parametrize("family, settings, window", [
    ("qwen2", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1}, 64),
    ("qwen2", {"use_sliding_window": False, "sliding_window": 64}, None),  # Qwen2.5's: no window
    ("qwen2", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2}, None),  # no layer slides
    ("qwen3", {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 64}, 64),
    ("qwen3", {"sliding_window": 4096}, None),  # longer than any sequence
])
def test_a_sliding_attention_window_holds_sequences_to_it(tiny_models, tmp_path, family, settings, window):
    """Up to its window, sliding attention is attention over the whole context (what the layers
    compute): a model whose layers slide serves sequences of at most the window."""
    folder = tmp_path / family
    shutil.copytree(tiny_models[family], folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("layer_types", None)  # (transformers writes it; where present it decides, as here)
    (folder / "config.json").write_text(json.dumps({**config, **settings}))
    if window is None:
        assert EngineConfig(model=str(folder), max_model_len=128).max_model_len == 128
        return
    assert EngineConfig(model=str(folder)).max_model_len == window
    with pytest.raises(ValueError, match=rf"max_model_len=128 exceeds the model's sliding_window={window} "):
        EngineConfig(model=str(folder), max_model_len=128)


def test_unknown_architecture(tiny_models, tmp_path):
    folder = tmp_path / "mambaish"
    shutil.copytree(tiny_models["qwen3"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["MambaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"architectures=\['MambaForCausalLM'\].*not supported; supported: \["):
        LLM(str(folder))


def test_model_folder_with_missing_files(tiny_models, tmp_path):
    with pytest.raises(ValueError, match=r"is not a directory"):
        LLM(str(tmp_path / "nowhere"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"has no config.json"):
        LLM(str(empty))
    no_weights = tmp_path / "no_weights"
    shutil.copytree(tiny_models["qwen3"], no_weights)
    for f in no_weights.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ValueError, match=r"has no \*.safetensors weight files"):
        LLM(str(no_weights), dtype="float32", num_kv_blocks=64)
    no_tokenizer = tmp_path / "no_tokenizer"
    shutil.copytree(tiny_models["qwen3"], no_tokenizer)
    for f in no_tokenizer.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(ValueError, match=r"could not load its tokenizer"):
        LLM(str(no_tokenizer), dtype="float32", num_kv_blocks=64)


def test_config_takes_a_torch_device(tiny_models):
    import torch

    assert EngineConfig(model=tiny_models["qwen3"], device=torch.device("cpu")).device == "cpu"


@pytest.mark.parametrize(
    "prompt,message",
    [
        (b"ab", r"prompt must be a string or a list of token ids, got bytes"),
        ({1: 2}, r"prompt must be a string or a list of token ids, got dict"),
        ([1, "a"], r"prompt token_ids\[1\]='a' must be an integer, got str"),
        ([1, 2.0], r"prompt token_ids\[1\]=2.0 must be an integer, got float"),
    ],
)
def test_prompts_of_the_wrong_type(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_prompts_that_are_not_a_batch(llm):
    with pytest.raises(ValueError, match=r"prompts must be a string, a list of token ids or a list of those, got NoneType"):
        llm.generate(None, GREEDY)


def test_token_ids_as_tuple_or_numpy_are_one_prompt(llm):
    import numpy as np

    want = llm.generate([[5, 6, 7]], GREEDY)[0].token_ids
    assert llm.generate((5, 6, 7), GREEDY)[0].token_ids == want
    assert llm.generate(np.array([5, 6, 7]), GREEDY)[0].token_ids == want
    assert llm.generate([[np.int64(5), np.int32(6), 7]], GREEDY)[0].token_ids == want


def test_stop_token_ids_outside_the_vocabulary(llm):
    vocab = llm.config.model_config.vocab_size
    with pytest.raises(ValueError, match=rf"stop_token_ids holds {vocab}, outside the vocabulary \[0, {vocab}\)"):
        llm.generate([[1, 2]], SamplingParams(stop_token_ids=[vocab]))


def test_fields_changed_after_construction_are_checked_when_added(llm):
    params = SamplingParams(max_tokens=4)
    params.temperature = -1.0
    with pytest.raises(ValueError, match=r"temperature=-1.0 must be a finite number in \[0, 3.4e38\]"):
        llm.generate([[1, 2]], params)
    params = SamplingParams(max_tokens=4)
    params.stop = "ab"  # one stop string, not two one-letter ones
    params.validate()
    assert params.stop == ["ab"]


def test_a_tiny_temperature_is_greedy(llm):
    want = llm.generate([[5, 6, 7]], GREEDY)[0].token_ids
    tiny = SamplingParams(temperature=1e-40, max_tokens=4, ignore_eos=True)
    assert tiny.greedy
    assert llm.generate([[5, 6, 7]], tiny)[0].token_ids == want


def test_a_caller_chosen_request_id_never_collides_with_generated_ones(llm):
    engine = llm.engine
    taken = str(int(engine.add_request([1, 2], GREEDY)) + 1)  # the next id the engine would pick
    engine.add_request([3, 4], GREEDY, request_id=taken)
    other = engine.add_request([5, 6], GREEDY)
    assert other != taken
    while engine.has_unfinished_requests():
        engine.step()


def test_stream_validates_when_called_not_when_iterated(llm):
    with pytest.raises(ValueError, match=r"is empty"):
        llm.stream([], GREEDY)


def test_logprobs_above_the_engines_limit(llm, tiny_models):
    with pytest.raises(ValueError, match=r"logprobs=21 must be <= 20 \(the engine's max_logprobs"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2, logprobs=21))
    with pytest.raises(ValueError, match=r"prompt_logprobs=50 must be <= 20 "):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2, prompt_logprobs=50))
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match=r"max_logprobs=-1 must be >= 0"):
        EngineConfig(model=tiny_models["qwen3"], max_logprobs=-1)


def test_a_request_id_in_use_by_an_n_request(llm):
    engine = llm.engine
    request_id = engine.add_request([1, 2, 3], SamplingParams(n=2, max_tokens=2), request_id="twins")
    with pytest.raises(ValueError, match=r"request_id='twins' is already in use"):
        engine.add_request([1, 2, 3], GREEDY, request_id="twins")
    assert engine.abort(request_id)
    with pytest.raises(ValueError, match=r"request_id='twins' is already in use \(.*final output not yet returned by step"):
        engine.add_request([1, 2, 3], GREEDY, request_id="twins")
    (final,) = engine.step()
    assert final.request_id == "twins" and [c.finish_reason for c in final.outputs] == ["abort"] * 2
    assert not engine.has_unfinished_requests()
    # Once step() has returned it, the id is free again.
    assert engine.add_request([1, 2, 3], GREEDY, request_id="twins") == "twins"
    assert engine.abort("twins") and [o.finish_reason for o in engine.step()] == ["abort"]


def test_a_finished_request_id_is_not_reused_before_step_returns_its_final_output(llm):
    engine = llm.engine
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=1), request_id="once")
    llm.generate([[4, 5, 6]], SamplingParams(max_tokens=3))  # drives the engine: "once" finishes
    with pytest.raises(ValueError, match=r"request_id='once' is already in use"):
        engine.add_request([1, 2, 3], GREEDY, request_id="once")
    # Nor is it handed out as a fresh id: the engine counts its own ids up ("7", "8", ...).
    counted = engine.add_request([1, 2, 3], SamplingParams(max_tokens=1))
    chosen = str(int(counted) + 1)  # the id the engine would count next
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=1), request_id=chosen)
    llm.generate([[4, 5, 6]], SamplingParams(max_tokens=3))  # both finish; their final outputs wait
    fresh = engine.add_request([7, 8, 9], SamplingParams(max_tokens=1))
    assert fresh not in ("once", counted, chosen)
    finals = set()
    while engine.has_unfinished_requests():
        finals |= {o.request_id for o in engine.step() if o.finished}
    assert finals == {"once", counted, chosen, fresh}
