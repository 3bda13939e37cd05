"""OpenAI's `prediction` on a server whose engine runs speculative decoding: the same answer as
without it, the drafts it saved counted in `usage` and in /metrics; a malformed prediction is a
400 naming the field."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fastgen import LLM
from tests.serve.conftest import ENGINE_ARGS, MODEL_NAME, running_server

SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4}


@pytest.fixture(scope="module")
def server(chat_model):
    llm = LLM(chat_model, speculative_config=SPECULATIVE, **ENGINE_ARGS)
    # Drafts every step whatever the engine measures of their cost (which depends on what ran
    # before, a compiled graph or not): these tests are about the API's answers and counts.
    llm.engine.drafter.threshold = lambda batch_size: 0.0
    with running_server(llm) as base_url:
        yield base_url


def test_a_prediction_changes_nothing_but_the_drafts(client, server):
    messages = [{"role": "user", "content": "Copy this: the quick brown fox"}]
    common = dict(model=MODEL_NAME, messages=messages, max_tokens=32, temperature=0.0)
    plain = client.chat.completions.create(**common)
    text = plain.choices[0].message.content
    predicted = client.chat.completions.create(**common, prediction={"type": "content", "content": text})
    assert predicted.choices[0].message.content == text
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0
    parts = client.chat.completions.create(
        **common, prediction={"type": "content", "content": [{"type": "text", "text": text[:10]},
                                                             {"type": "text", "text": text[10:]}]})
    assert parts.choices[0].message.content == text
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{server}/metrics").text)}
    accepted = families["fastgen_spec_decode_num_accepted_tokens"].samples[0].value
    assert accepted >= details.accepted_prediction_tokens
    positions = families["fastgen_spec_decode_num_accepted_tokens_per_pos"].samples
    assert sum(s.value for s in positions) == accepted


@pytest.mark.parametrize("prediction, message", [
    ({"type": "text", "content": "x"}, "prediction.type='text' must be 'content'"),
    ({"type": "content", "content": [{"type": "image"}]}, "prediction.content must be a string or a list"),
])
def test_a_malformed_prediction_is_a_400_naming_it(client, prediction, message):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, prediction=prediction)
    assert message in str(caught.value) and caught.value.body.get("param") == "prediction"
