"""Structured outputs, tool calls, logit_bias, echo and the token routes, driven through the real
`openai` client (httpx for vLLM's own routes), against the Python API on the same model.

The schemas here have finite languages (enums, bounded lists), so even the random tiny model's
constrained answers end on their own within max_tokens, and can be parsed.
"""

from __future__ import annotations

import json
from typing import Literal

import httpx
import pydantic
import pytest

from fastgen import LLM, SamplingParams
from tests.serve.conftest import ENGINE_ARGS, MODEL_NAME, running_server

pytest.importorskip("xgrammar")

UNIT = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                         "days": {"enum": [1, 2, 3]}},
        "required": ["unit", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The forecast", "parameters": UNIT}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What will the weather be in Paris?"}]


class Forecast(pydantic.BaseModel):
    unit: Literal["celsius", "fahrenheit"]
    days: Literal[1, 2, 3]


# Room for the tools' description in the prompt (the tiny tokenizer spends a token on every few
# characters).
ARGS = {**ENGINE_ARGS, "max_model_len": 1024}


@pytest.fixture(scope="module")
def server(chat_model):
    with running_server(LLM(chat_model, **ARGS)) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def local(chat_model):
    """The same model through the Python API, for the answers the server must match."""
    return LLM(chat_model, **ARGS)


def test_parse_with_a_pydantic_model(client):
    completion = client.chat.completions.parse(model=MODEL_NAME, messages=ASK, response_format=Forecast,
                                               max_tokens=120, temperature=0)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Forecast)


def test_response_format_and_structured_outputs_equal_the_python_api(client, local):
    prompt = "The quick brown fox"
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "unit", "schema": UNIT}}}, {"json": UNIT}),
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        ({"extra_body": {"structured_outputs": {"choice": ["red", "green", "blue"]}}}, {"choice": ["red", "green",
                                                                                                   "blue"]}),
        ({"extra_body": {"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}}}, {"regex": "[a-z]{3}-[0-9]{2}"}),
    ]
    for fields, spec in cases:
        extra = fields.pop("extra_body", None)
        response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=60, temperature=0,
                                             extra_body={**(extra or {}), **fields})
        expected = local.generate(prompt, SamplingParams(temperature=0, max_tokens=60, structured_outputs=spec))[0]
        assert response.choices[0].text == expected.outputs[0].text, spec
        assert response.choices[0].finish_reason == expected.finish_reason
    assert response.choices[0].finish_reason == "stop"


def test_a_named_tool_is_called_with_arguments_valid_against_its_schema(client):
    completion = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=[WEATHER, TIME], max_tokens=400, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    Forecast.model_validate(json.loads(call.function.arguments))


def test_required_tool_calls_name_known_tools_sampled_and_streamed(client):
    for temperature in (0.0, 1.0):
        completion = client.chat.completions.create(
            model=MODEL_NAME, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
            max_tokens=380, temperature=temperature, seed=3)
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name in ("get_weather", "get_time")
        assert isinstance(json.loads(call.function.arguments), dict)
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=[WEATHER], max_tokens=400, temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    chunks = list(stream)
    calls = [c for chunk in chunks for choice in chunk.choices for c in (choice.delta.tool_calls or ())]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    Forecast.model_validate(json.loads(calls[0].function.arguments))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_forced_call_cut_by_the_requests_own_stop_string_is_text(client):
    completion = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=[WEATHER], max_tokens=400, temperature=0, stop=["celsius", "fahrenheit"],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert "".join(choice.message.content.split()).startswith('{"unit":"')


def test_tool_choice_none_and_auto_answer_in_text(client):
    for tool_choice in ("none", "auto"):
        completion = client.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=[WEATHER], max_tokens=8,
                                                    temperature=0, tool_choice=tool_choice)
        choice = completion.choices[0]
        # The random model writes no <tool_call> block: its answer is text.
        assert choice.message.tool_calls is None and choice.finish_reason == "length"


def test_logit_bias_equals_the_python_api(client, local):
    prompt = "Paged attention keeps"
    plain = local.generate(prompt, SamplingParams(temperature=0, max_tokens=6))[0].token_ids
    bias = {plain[0]: -100.0, plain[1]: 30.0}
    response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0,
                                         logit_bias={str(t): b for t, b in bias.items()})
    expected = local.generate(prompt, SamplingParams(temperature=0, max_tokens=6, logit_bias=bias))[0]
    assert response.choices[0].text == expected.outputs[0].text != local.tokenizer.decode(plain)


def test_echo_with_logprobs_and_no_tokens_is_lm_evals_loglikelihood_request(client, local):
    prompt_ids = local.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    expected = local.generate(prompt_ids, SamplingParams(max_tokens=1, prompt_logprobs=1))[0].prompt_logprobs
    for max_tokens in (0, 1):
        response = client.completions.create(model=MODEL_NAME, prompt=[prompt_ids], echo=True, logprobs=1,
                                             max_tokens=max_tokens, temperature=0)
        choice = response.choices[0]
        logprobs = choice.logprobs
        assert len(logprobs.token_logprobs) == len(prompt_ids) + max_tokens
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        for position, token in enumerate(prompt_ids[1:], start=1):
            assert logprobs.token_logprobs[position] == pytest.approx(expected[position][token].logprob, abs=1e-5)
        assert choice.text.startswith(local.tokenizer.decode(prompt_ids))
        assert response.usage.completion_tokens == max_tokens
        if max_tokens == 0:
            assert choice.text == local.tokenizer.decode(prompt_ids) and choice.finish_reason == "length"


def test_echo_streams_the_prompt_first(client):
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="The quick", echo=True, max_tokens=3,
                                            temperature=0, stream=True))
    assert chunks[0].choices[0].text.startswith("The quick")
    assert sum("The quick" in c.choices[0].text for c in chunks if c.choices) == 1


def test_tokenize_and_detokenize(server, local):
    text = "The quick brown fox"
    answer = httpx.post(f"{server}/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert answer["tokens"] == local.tokenizer.encode(text) and answer["count"] == len(answer["tokens"])
    assert answer["max_model_len"] == ARGS["max_model_len"] and "".join(answer["token_strs"]) == text
    chat = httpx.post(f"{server}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["tokens"] == local.tokenizer.encode("<|user|>Hi\n<|assistant|>", add_special_tokens=False)
    assert httpx.post(f"{server}/detokenize", json={"tokens": answer["tokens"]}).json() == {"prompt": text}
    bad = httpx.post(f"{server}/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


CHAT = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 4}
BAD = [
    ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format", "cannot be compiled"),
    ({**CHAT, "response_format": {"type": "yaml"}}, "response_format", "'text', 'json_object' or 'json_schema'"),
    ({**CHAT, "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "send one"),
    ({**CHAT, "structured_outputs": {"regex": "(("}}, "structured_outputs", "cannot be compiled"),
    ({**CHAT, "structured_outputs": {"schema": {}}}, "structured_outputs", "unknown field"),
    ({**CHAT, "tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools",
     "tools[0].function.name=None"),
    ({**CHAT, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({**CHAT, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"if": {}}}}],
      "tool_choice": "required"}, "tools", "is not supported"),
    ({**CHAT, "response_format": {"type": "text"}, "structured_outputs": {"regex": "(("}}, "structured_outputs",
     "cannot be compiled"),
    ({**CHAT, "tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "send one"),
    ({**CHAT, "logit_bias": {"abc": 1}}, "logit_bias", "keys must be token ids"),
    ({**CHAT, "logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
]


@pytest.mark.parametrize(("body", "param", "says"), BAD, ids=[f"{b[1]}:{b[2][:20]}" for b in BAD])
def test_bad_constraints_are_400s_naming_the_field(server, body, param, says):
    response = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error
