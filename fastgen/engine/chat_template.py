"""Chat templates rendered with jinja2 the way transformers renders them, without importing it.

Same environment as transformers' `apply_chat_template`: a sandbox, `trim_blocks` and
`lstrip_blocks`, the loop-controls extension, a `tojson` that keeps non-ASCII text and takes an
indent, and the globals `raise_exception`, `strftime_now`, `dict` and `namespace`; the template
sees the messages (keys whose value is None dropped), `add_generation_prompt`, and the
tokenizer's named special tokens (`bos_token`, `eos_token`, ...) as strings.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace, refusing underscore names so a template cannot reach internals."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore names, got {name!r}")


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=dict, namespace=_Namespace)
    return env.from_string(source)


def render_chat(source: str, messages: list[dict], add_generation_prompt: bool, special_tokens: dict[str, str],
                tools: list[dict] | None = None) -> str:
    """The conversation as the template renders it (a string, not yet tokenized); tools: OpenAI
    tool definitions, which the template sees as `tools` (as transformers passes them). Raises
    ValueError for an empty conversation, a message that is not a dict, or a template error."""
    if not messages:
        raise ValueError("messages is empty: a conversation needs at least one message")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}]={message!r} must be a dict with 'role' and 'content'")
    messages = [{k: v for k, v in message.items() if v is not None} for message in messages]
    try:
        return compile_template(source).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                               tools=tools, **special_tokens)
    except jinja2.exceptions.TemplateError as exc:
        raise ValueError(f"the model's chat template failed on these messages: {exc}") from exc
