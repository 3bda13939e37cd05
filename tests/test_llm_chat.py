"""LLM.chat: conversations rendered by the model's chat template, as transformers renders and
tokenizes them, then generated like any prompt."""

from __future__ import annotations

import shutil

import pytest
from transformers import AutoTokenizer

from fastgen import LLM, SamplingParams

# Writes its own BOS (the tokenizer's end-of-text token here), so a second one from encode() would show.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sky colour?"},
     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Grüße, and at night?"}],
]


@pytest.fixture(scope="module")
def chat_model(tiny_models, tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(tiny_models["qwen3"], folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.bos_token = "<|endoftext|>"
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def llm(chat_model):
    return LLM(chat_model, dtype="float32", block_size=16, num_kv_blocks=64)


def transformers_ids(model: str, conversation, add_generation_prompt: bool) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_chat_renders_like_transformers_and_generates_like_generate(llm, chat_model):
    outputs = llm.chat(CONVERSATIONS, GREEDY)
    assert len(outputs) == 2
    for conversation, out in zip(CONVERSATIONS, outputs):
        ids = transformers_ids(chat_model, conversation, True)
        assert out.prompt_token_ids == ids
        assert out.token_ids == llm.generate([ids], GREEDY)[0].token_ids
    (single,) = llm.chat(CONVERSATIONS[0], GREEDY)  # one conversation: a list of message dicts
    assert single.token_ids == outputs[0].token_ids
    (open_turn,) = llm.chat(CONVERSATIONS[1], GREEDY, add_generation_prompt=False)
    assert open_turn.prompt_token_ids == transformers_ids(chat_model, CONVERSATIONS[1], False)


def test_chat_takes_the_sampling_fields(llm):
    (out,) = llm.chat(CONVERSATIONS[0], SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=6, logprobs=1))
    assert len(out.outputs) == 2 and all(len(c.logprobs) == len(c.token_ids) for c in out.outputs)


@pytest.mark.parametrize("messages,match", [
    ([], r"messages must be a conversation"),
    ("hello", r"messages must be a conversation"),
    ([[]], r"a conversation must be a non-empty list of messages"),
    ([{"content": "no role"}], r"messages\[0\]=.* must be a dict with a 'role'"),
    ([[{"role": "user", "content": "ok"}], ["not a dict"]], r"messages\[0\]='not a dict' must be a dict"),
])
def test_malformed_conversations_are_refused(llm, messages, match):
    with pytest.raises(ValueError, match=match):
        llm.chat(messages, GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_chat_without_a_template_or_tokenizer_is_refused(tiny_models):
    with pytest.raises(ValueError, match="no chat template"):
        LLM(tiny_models["qwen3"], dtype="float32", num_kv_blocks=8).chat(CONVERSATIONS[0], GREEDY)
    no_tokenizer = LLM(tiny_models["qwen3"], dtype="float32", num_kv_blocks=8, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        no_tokenizer.chat(CONVERSATIONS[0], GREEDY)
