"""Logprobs over HTTP, driven by the real `openai` client: the served logprobs of a greedy request
equal LLM.generate's (completions and chat, plain and streaming), in OpenAI's two shapes; a count
beyond the limits, or chat's top_logprobs without logprobs, is a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest

from fastgen import LLM, SamplingParams
from fastgen.engine.prompts import chat_token_ids
from tests.serve.conftest import ENGINE_ARGS, MODEL_NAME

PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "Prefix caching shares"}]
MAX_TOKENS = 10
TOP = 4
GREEDY = dict(model=MODEL_NAME, max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def expected(chat_model):
    """LLM.generate's completions (greedy, ignore_eos, TOP logprobs) on a separate engine: for
    the completion prompt and for the chat conversation."""
    llm = LLM(chat_model, **ENGINE_ARGS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    completion, chat = llm.generate([PROMPT, chat_token_ids(llm.tokenizer, CHAT)], params)
    return completion.outputs[0], chat.outputs[0]


def _sampled(want) -> list:
    """The generated tokens' own Logprobs, in order."""
    return [position[token] for token, position in zip(want.token_ids, want.logprobs)]


def _check_completion_logprobs(tokens, token_logprobs, top_logprobs, text_offset, want):
    sampled = _sampled(want)
    assert tokens == [lp.decoded_token for lp in sampled]  # the same tokens, as text
    assert token_logprobs == pytest.approx([lp.logprob for lp in sampled], abs=1e-5)
    for served, position, own in zip(top_logprobs, want.logprobs, sampled):
        assert len(position) == TOP  # greedy: the sampled token is the top one, listed once
        # Keyed by text: tokens that read alike (byte pieces) share one entry.
        assert set(served) == {lp.decoded_token for lp in position.values()}
        for text, logprob in served.items():
            assert any(abs(lp.logprob - logprob) < 1e-5 for lp in position.values() if lp.decoded_token == text)
        assert served[own.decoded_token] == pytest.approx(own.logprob, abs=1e-5)
    assert text_offset == [sum(map(len, tokens[:i])) for i in range(len(tokens))]


def test_completion_logprobs_equal_generate(client, expected):
    response = client.completions.create(prompt=PROMPT, logprobs=TOP, **GREEDY)
    choice = response.choices[0]
    assert choice.text == expected[0].text
    lp = choice.logprobs
    _check_completion_logprobs(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset, expected[0])


def test_streamed_completion_logprobs_equal_generate(client, expected):
    chunks = [c for c in client.completions.create(prompt=PROMPT, logprobs=TOP, stream=True, **GREEDY)
              if c.choices and c.choices[0].logprobs is not None]
    assert len(chunks) > 1  # each chunk carries its own delta's logprobs
    fields = {name: [x for c in chunks for x in getattr(c.choices[0].logprobs, name)]
              for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    _check_completion_logprobs(**fields, want=expected[0])


def test_completion_logprobs_zero_gives_the_sampled_token_alone(client, expected):
    lp = client.completions.create(prompt=PROMPT, logprobs=0, **GREEDY).choices[0].logprobs
    assert [list(top) for top in lp.top_logprobs] == [[token] for token in lp.tokens]


def _check_chat_logprobs(content, want):
    sampled = _sampled(want)
    assert [entry.token for entry in content] == [lp.decoded_token for lp in sampled]
    assert [entry.logprob for entry in content] == pytest.approx([lp.logprob for lp in sampled], abs=1e-5)
    # Each token's bytes are its own, not its text's: the bytes of pieces of one character (each
    # shown as U+FFFD) join back into that character.
    assert any("\ufffd" in entry.token for entry in content)
    assert bytes(b for entry in content for b in entry.bytes).decode("utf-8", errors="replace") == want.text
    for entry, position in zip(content, want.logprobs):
        if "\ufffd" not in entry.token:
            assert entry.bytes == list(entry.token.encode("utf-8"))
        best = sorted(position.values(), key=lambda lp: -lp.logprob)
        assert len(entry.top_logprobs) == TOP
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([lp.logprob for lp in best], abs=1e-5)
        assert [t.token for t in entry.top_logprobs] == [lp.decoded_token for lp in best]
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)  # greedy: the best


def test_chat_logprobs_equal_generate(client, expected):
    response = client.chat.completions.create(messages=CHAT, logprobs=True, top_logprobs=TOP, **GREEDY)
    choice = response.choices[0]
    assert choice.message.content == expected[1].text
    _check_chat_logprobs(choice.logprobs.content, expected[1])


def test_streamed_chat_logprobs_equal_generate(client, expected):
    chunks = list(client.chat.completions.create(messages=CHAT, logprobs=True, top_logprobs=TOP, stream=True,
                                                 **GREEDY))
    carrying = [c for c in chunks if c.choices and c.choices[0].logprobs is not None]
    assert len(carrying) > 1
    _check_chat_logprobs([entry for c in carrying for entry in c.choices[0].logprobs.content], expected[1])


def test_chat_without_logprobs_has_none(client):
    response = client.chat.completions.create(messages=CHAT, **GREEDY)
    assert response.choices[0].logprobs is None


BAD = [
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs", ["21", "20"]),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": -1}, "logprobs", ["-1"]),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs",
     ["21", "20"]),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs", ["-1"]),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs", ["logprobs=true"]),
]


@pytest.mark.parametrize(("path", "body", "param", "says"), BAD, ids=[f"{b[0]}:{b[2]}={b[1][b[2]]}" for b in BAD])
def test_a_bad_logprobs_count_is_a_400_naming_the_field_value_and_limit(server, path, body, param, says):
    response = httpx.post(f"{server}{path}", json={"model": MODEL_NAME, "max_tokens": 2, **body}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert all(word in error["message"] for word in says), error["message"]
