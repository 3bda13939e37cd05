"""Chat templates rendered with jinja2 the way transformers renders them, without importing it.

Same environment as transformers' `apply_chat_template`: a sandbox, `trim_blocks` and
`lstrip_blocks`, the loop-controls extension, `{% generation %}` blocks (transformers marks the
assistant's tokens with them; rendered as their content), a `tojson` that keeps non-ASCII text
and takes an indent, and the globals `raise_exception`, `strftime_now`, `dict` and `namespace`;
the template sees the messages (keys whose value is None dropped), `add_generation_prompt`, and
the tokenizer's named special tokens (`bos_token`, `eos_token`, ...) as strings.
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


class _GenerationBlocks(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers' marks of the assistant's part (for
    training masks), which a prompt renders as their content."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_content"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _content(caller):
        return caller()


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _GenerationBlocks])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=dict, namespace=_Namespace)
    return env.from_string(source)


def message_text(content, where: str):
    """A message's content as a template reads it: OpenAI's content parts (`[{"type": "text",
    "text": ...}, ...]`) joined into one string (`prompts.chat_token_ids` does it for every
    tokenizer); anything else as it is. ValueError naming `where` for a part that is not text."""
    if not isinstance(content, list):
        return content
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text":
            raise ValueError(f"{where} holds a {kind!r} part; fastgen serves text only")
    return "".join(str(part.get("text", "")) for part in content)


def render_chat(source: str, messages: list[dict], add_generation_prompt: bool, special_tokens: dict[str, str],
                tools: list[dict] | None = None) -> str:
    """The conversation as the template renders it (a string, not yet tokenized); tools: OpenAI
    tool definitions, which the template sees as `tools` (as transformers passes them). Raises
    ValueError for an empty conversation, a message that is not a dict, or a template that fails
    on the messages (whatever it raises)."""
    if not messages:
        raise ValueError("messages is empty: a conversation needs at least one message")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}]={message!r} must be a dict with 'role' and 'content'")
    messages = [{k: v for k, v in message.items() if v is not None} for message in messages]
    try:
        return compile_template(source).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                               tools=tools, **special_tokens)
    except (ValueError, ImportError):
        raise
    except Exception as exc:  # noqa: BLE001 - a template's own error (TypeError, ...) is the request's
        raise template_failed(exc) from exc


def template_failed(exc: Exception) -> ValueError:
    """A template's failure on the messages (a TypeError from `str + int` in it, its
    `raise_exception`, ...) as the request's fault: a ValueError saying what it raised. Callers
    let ValueErrors and ImportErrors (no jinja2 for transformers: the server's fault) through."""
    return ValueError(f"the model's chat template failed on these messages: {type(exc).__name__}: {exc}")
