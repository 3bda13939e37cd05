"""OpenAI tool calls on /v1/chat/completions: the tools checked and shown to the model, the
output constrained when a call is required, and parsed back into `message.tool_calls`.

    tool_choice "none"        tools are not shown; the answer is text
    tool_choice "auto"        tools shown; the answer is text, or calls the model writes as
                              <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Hermes's
                              format, Qwen's templates' own), parsed out of the text
    tool_choice "required"    the output is constrained to a JSON list of calls, each naming one of
                              the tools with arguments valid against its parameters' schema
    {"type": "function", "function": {"name": N}}
                              the output is constrained to N's arguments (its schema)

Tools are shown through the model's chat template when it renders `tools` (transformers' `tools`
argument). A template that ignores them gets a system message that lists them with the format
above, so any chat model can be asked.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastgen.serve.errors import RequestError
from fastgen.structured_outputs_params import StructuredOutputsParams

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
MAX_TOOLS = 128  # OpenAI's limit


@dataclass(frozen=True)
class Tool:
    """A checked tool. sent: the request's entry as it came (its keys in their order, `strict`
    and all), which is what a template renders, as transformers hands the request's tools on."""

    name: str
    description: str | None
    parameters: dict
    sent: dict = field(compare=False, repr=False)

    def as_openai(self) -> dict:
        return self.sent


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for its prompt, its constraint and its answer.

    shown: the tools the model is told about (none for tool_choice "none"). constraint: the
    output's grammar (required or named), None otherwise. mode: how the output is read back:
    "text", "parse" (auto: calls found in the text), "list" (required) or "named"."""

    shown: tuple[Tool, ...]
    constraint: StructuredOutputsParams | None
    mode: str
    named: str | None = None


def check_tools(tools: list[Any] | None) -> tuple[Tool, ...]:
    """The request's tools; a 400 naming the entry and the field for a malformed one."""
    if tools is not None and len(tools) > MAX_TOOLS:
        raise RequestError(f"tools holds {len(tools)} tools, more than {MAX_TOOLS}", param="tools")
    checked, seen = [], set()
    for i, entry in enumerate(tools or ()):
        where = f"tools[{i}]"
        if not isinstance(entry, dict) or entry.get("type") != "function":
            raise RequestError(f"{where} must be {{'type': 'function', 'function': {{...}}}}", param="tools")
        function = entry.get("function")
        if not isinstance(function, dict):
            raise RequestError(f"{where}.function must be an object with a 'name'", param="tools")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise RequestError(f"{where}.function.name={name!r} must be 1-64 letters, digits, '_' or '-'",
                               param="tools")
        if name in seen:
            raise RequestError(f"{where}.function.name={name!r} names a second tool of that name", param="tools")
        seen.add(name)
        parameters = function.get("parameters", _EMPTY_PARAMETERS)
        if not isinstance(parameters, dict):
            raise RequestError(f"{where}.function.parameters must be a JSON schema object", param="tools")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise RequestError(f"{where}.function.description must be a string", param="tools")
        checked.append(Tool(name, description, parameters, entry))
    return tuple(checked)


def plan_tools(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolPlan:
    checked = check_tools(tools)
    if not checked:
        if tool_choice not in (None, "none"):
            raise RequestError(f"tool_choice={tool_choice!r} needs tools", param="tool_choice")
        return ToolPlan((), None, "text")
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan((), None, "text")
    if choice == "auto":
        return ToolPlan(checked, None, "parse")
    if choice == "required":
        call = {"anyOf": [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                           "required": ["name", "arguments"]} for t in checked]}
        schema = {"type": "array", "items": call, "minItems": 1}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan(checked, StructuredOutputsParams(json=schema), "list")
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise RequestError(f"tool_choice={choice!r} must be 'none', 'auto', 'required' or "
                           "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
    tool = next((t for t in checked if t.name == name), None)
    if tool is None:
        raise RequestError(f"tool_choice names {name!r}, which is not among the tools "
                           f"{[t.name for t in checked]}", param="tool_choice")
    return ToolPlan((tool,), StructuredOutputsParams(json=tool.parameters), "named", name)


def template_renders_tools(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def tools_system_prompt(tools: tuple[Tool, ...]) -> str:
    """The system message for templates that do not render tools themselves."""
    listed = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in tools)
    return ("You can call these functions (JSON schemas of their arguments):\n" + listed + "\n"
            "To call one, answer with <tool_call>{\"name\": <function name>, \"arguments\": <arguments object>}"
            "</tool_call> (one such block per call); otherwise answer in plain text.")


def with_tools_in_system(messages: list[dict], tools: tuple[Tool, ...]) -> list[dict]:
    """The conversation with the tools' description in its system message (made if absent), and
    earlier assistant calls written into their content in the same format, so the model sees them."""
    messages = [_calls_as_text(m) for m in messages]
    prompt = tools_system_prompt(tools)
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0].get('content') or ''}\n\n{prompt}".strip()}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def _calls_as_text(message: dict) -> dict:
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not calls:
        return message
    blocks = []
    for call in calls:
        function = call.get("function", {}) if isinstance(call, dict) else {}
        arguments = function.get("arguments")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            pass
        blocks.append("<tool_call>" + json.dumps({"name": function.get("name"), "arguments": arguments},
                                                 ensure_ascii=False) + "</tool_call>")
    text = "\n".join(filter(None, [message.get("content") or "", *blocks]))
    return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": text}


def _call(name: str, arguments: Any) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def read_tool_calls(plan: ToolPlan, text: str, finish_reason: str | None) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of an answer. A constrained answer cut short (by max_tokens, or by a
    stop string or stop token of the request's own) is not a call: its text stays the content, as
    is, with its finish_reason."""
    if plan.mode == "text" or finish_reason != "stop" and plan.mode != "parse":
        return text, []
    if plan.mode in ("named", "list"):
        try:
            value = json.loads(text)
            if plan.mode == "named":
                return None, [_call(plan.named, value)]
            return None, [_call(c["name"], c["arguments"]) for c in value]
        except (json.JSONDecodeError, KeyError, TypeError):
            return text, []
    names = {t.name for t in plan.shown}
    calls = []
    for block in _TAGGED.findall(text):
        try:
            call = json.loads(block)
        except json.JSONDecodeError:
            continue
        if isinstance(call, dict) and call.get("name") in names:
            calls.append(_call(call["name"], call.get("arguments", call.get("parameters", {}))))
    if not calls:
        return text, []
    content = _TAGGED.sub("", text).strip()
    return content or None, calls
