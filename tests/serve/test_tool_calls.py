"""Tool calls without a server: calls read back from an answer's text, the tools shown to a
template that renders them and to one that does not, and earlier calls written back in."""

from __future__ import annotations

import json

from fastgen.engine.tokenizer import FastTokenizer
from fastgen.serve.tool_calls import plan_tools, read_tool_calls, template_renders_tools, with_tools_in_system

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_auto_reads_tagged_calls_and_keeps_the_rest_as_content():
    plan = plan_tools(TOOLS, "auto", None)
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    content, calls = read_tool_calls(plan, text, "stop")
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    # An unknown function, broken JSON or no block at all: the answer is text.
    for text in ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "<tool_call>{oops</tool_call>",
                 "Sunny."):
        assert read_tool_calls(plan, text, "stop") == (text, [])
    # A block cut by max_tokens still counts when its JSON is whole.
    assert read_tool_calls(plan, '<tool_call>{"name": "get_weather", "arguments": {}}', "length")[1]


def test_a_constrained_answer_cut_by_max_tokens_is_not_a_call():
    plan = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None)
    assert read_tool_calls(plan, '{"city": "Pa', "length") == ('{"city": "Pa', [])
    assert read_tool_calls(plan, '{"city": "Paris"}', "stop")[1][0]["function"]["name"] == "get_weather"
    required = plan_tools(TOOLS, "required", False)
    assert required.constraint.json["maxItems"] == 1
    calls = read_tool_calls(required, '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]', "stop")[1]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}


def test_tools_reach_a_template_that_renders_them(tiny_models):
    from tokenizers import Tokenizer

    template = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    tokenizer = FastTokenizer(Tokenizer.from_file(f"{tiny_models['llama']}/tokenizer.json"),
                              {"chat_template": template})
    assert template_renders_tools(tokenizer)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, tools=TOOLS)
    assert text == "TOOLS:get_weather;user: hi\n"  # trim_blocks eats the newline after a tag


def test_a_template_without_tools_gets_them_in_the_system_message_with_earlier_calls_as_text():
    plan = plan_tools(TOOLS, "auto", None)
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}]
    messages = with_tools_in_system(history, plan.shown)
    assert messages[0]["content"].startswith("Be brief.\n\nYou can call these functions")
    assert '"name": "get_weather"' in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content":
                           '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'}
    assert with_tools_in_system(history[1:], plan.shown)[0]["role"] == "system"


def test_a_template_renders_the_tools_as_the_request_sent_them(tiny_models):
    """Key order and fields fastgen does not read (`strict`) reach the template as sent, as
    transformers' apply_chat_template(tools=...) hands them on."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now.",
                                               "parameters": TOOLS[0]["function"]["parameters"], "strict": True}}]
    template = ("{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    ours = FastTokenizer(Tokenizer.from_file(f"{tiny_models['llama']}/tokenizer.json"), {"chat_template": template})
    shown = [t.as_openai() for t in plan_tools(tools, "auto", None).shown]
    messages = [{"role": "user", "content": "hi"}]
    theirs = AutoTokenizer.from_pretrained(tiny_models["llama"])
    expected = theirs.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False)
    assert '"strict": true' in expected
    assert ours.apply_chat_template(messages, tokenize=False, tools=shown) == expected


def test_calls_read_from_an_answer_cut_by_max_tokens_finish_with_length():
    """Whole calls before the cut are sent, but the finish says "length", as OpenAI's does: a
    further call may have followed. An answer that ended on its own says "tool_calls"."""
    from fastgen.serve.responses import ResponseShape

    shape = ResponseShape("chat.completion", "m", tools=plan_tools(TOOLS, "auto", None))
    whole = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    message, finish = shape._chat_message(whole + "\n<tool_call>{\"name\": \"get_w", "length")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"] and finish == "length"
    message, finish = shape._chat_message(whole, "stop")
    assert message["tool_calls"] and finish == "tool_calls"
