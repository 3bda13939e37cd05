"""What a prompt may be: text, one request's token ids (list, tuple or 1-D integer array), or
either made ready for the engine ahead of time (`TokenizedPrompt`)."""

from __future__ import annotations

import numbers
import weakref
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass

import numpy as np

from fastgen.engine.chat_template import message_text, template_failed


@dataclass(frozen=True)
class TokenizedPrompt:
    """A prompt made ready before it reaches the thread that runs the steps, by `tokenized_prompt`
    alone (the engine trusts it to hold ints): a text encoded by the engine's tokenizer (`text` is
    the request's prompt text), or a caller's token ids checked to be integers (text None); their
    range is checked when it is queued."""

    text: str | None
    token_ids: list[int]


Prompt = str | list[int] | TokenizedPrompt


def prompt_size(prompt: object) -> int:
    """A prompt's characters or token ids (0 for anything else): what making it ready costs."""
    if isinstance(prompt, np.ndarray):
        return prompt.size
    return len(prompt) if isinstance(prompt, (str, list, tuple)) else 0


def is_token_ids(prompt: object) -> bool:
    """Whether a prompt is one request's token ids: a list, tuple or 1-D array of integers."""
    if isinstance(prompt, np.ndarray):
        return prompt.ndim == 1 and np.issubdtype(prompt.dtype, np.integer)
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0 and isinstance(prompt[0], numbers.Integral)
            and not isinstance(prompt[0], bool))


def token_ids_of(prompt: object) -> list[int]:
    """A non-string prompt as a list of ints; ValueError naming the type for anything else."""
    if isinstance(prompt, np.ndarray) and prompt.ndim != 1:
        raise ValueError(f"prompt must be a string or a 1-D sequence of token ids, got an array of shape {prompt.shape}")
    if not isinstance(prompt, (SequenceABC, np.ndarray)) or isinstance(prompt, (bytes, bytearray)):
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    # Plain ints (or an integer array) are copied at C speed: a long prompt is checked one by one
    # only when something in it is not (to name the first that is wrong, or to convert it).
    if isinstance(prompt, (list, tuple)) and set(map(type, prompt)) <= {int}:
        return list(prompt)
    if isinstance(prompt, np.ndarray) and np.issubdtype(prompt.dtype, np.integer):
        return prompt.tolist()
    token_ids = []
    for i, t in enumerate(prompt):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise ValueError(f"prompt token_ids[{i}]={t!r} must be an integer, got {type(t).__name__}")
        token_ids.append(int(t))
    return token_ids


# How far a tokenizer's normalizer may shrink a text (NFKC composing characters, say) when a
# prompt's length is bounded by its tokens': far beyond any real one.
_NORMALIZED_SHRINK = 4
# A text longer than this many characters a token of max_tokens is first tokenized in a prefix
# of that length: where the prefix alone holds more tokens than fit (give or take the few a cut
# through a word adds), so does the whole text, which is then never tokenized.
_PROBE_CHARS_PER_TOKEN = 8
_PROBE_SLACK_TOKENS = 64
_LONGEST_TOKEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def longest_token_chars(tokenizer) -> int:
    """The most characters one vocabulary entry holds (byte-level pieces hold a character per
    byte, byte-fallback ones six for a byte), so the most a token stands for; once per tokenizer."""
    try:
        return _LONGEST_TOKEN[tokenizer]
    except (KeyError, TypeError):
        pass
    longest = max(map(len, tokenizer.get_vocab()), default=1)
    try:
        _LONGEST_TOKEN[tokenizer] = longest
    except TypeError:  # a tokenizer that takes no weak reference: measured each time
        pass
    return longest


def encode_text(tokenizer, text: str, field: str, max_tokens: int | None = None, **kwargs) -> list[int]:
    """`tokenizer.encode(text, **kwargs)`; ValueError naming `field` for text that is not Unicode
    (a lone UTF-16 surrogate, which JSON can carry and tokenizers refuse with a TypeError), or,
    given max_tokens, for text too long to fit in that many tokens, refused before it is encoded
    (tokenizing megabytes holds the GIL for seconds: a server's every stream would wait)."""
    check_unicode(text, field)
    if max_tokens is not None and len(text) > _PROBE_CHARS_PER_TOKEN * max_tokens:
        longest = longest_token_chars(tokenizer)
        limit = _NORMALIZED_SHRINK * max_tokens * longest
        if len(text) > limit:
            raise ValueError(f"{field} has {len(text):,} characters: it cannot fit in max_model_len={max_tokens} "
                             f"tokens (at most {limit:,} characters: no token stands for more than {longest})")
        probe = _PROBE_CHARS_PER_TOKEN * max_tokens
        count = len(tokenizer.encode(text[:probe], add_special_tokens=False))
        if count > max_tokens + _PROBE_SLACK_TOKENS:
            raise ValueError(f"{field} has {len(text):,} characters: it cannot fit in max_model_len={max_tokens} "
                             f"tokens (its first {probe:,} characters alone are {count:,} tokens)")
    return tokenizer.encode(text, **kwargs)


def tokenized_prompt(tokenizer, prompt: Prompt, max_model_len: int) -> Prompt:
    """A prompt as a TokenizedPrompt: a text encoded as the engine would encode it
    (`encode_text`'s ValueErrors), token ids checked to be integers (`token_ids_of`'s). A text
    without a tokenizer, or a TokenizedPrompt, is returned as it is (the engine says what is
    wrong with the first)."""
    if isinstance(prompt, TokenizedPrompt) or (isinstance(prompt, str) and tokenizer is None):
        return prompt
    if isinstance(prompt, str):
        return TokenizedPrompt(prompt, encode_text(tokenizer, prompt, "prompt", max_tokens=max_model_len))
    return TokenizedPrompt(None, token_ids_of(prompt))


def check_unicode(text: str, field: str) -> None:
    """ValueError naming `field` for text that is not Unicode (a lone UTF-16 surrogate, which
    JSON can carry and tokenizers refuse with a TypeError)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{field} holds {text[exc.start]!r} at index {exc.start}, a lone surrogate: not "
                         "Unicode text") from None


def is_conversation(messages: object) -> bool:
    """Whether `messages` is one conversation (a list of message dicts), not a list of them."""
    return isinstance(messages, (list, tuple)) and len(messages) > 0 and isinstance(messages[0], dict)


def chat_token_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                   tools: list[dict] | None = None, max_tokens: int | None = None) -> list[int]:
    """Token ids of a conversation as the tokenizer's chat template renders it (rendered to text,
    then encoded without special tokens: the template writes any BOS itself, and encode() would
    double it). ValueError for a tokenizer without a template, a malformed conversation, or
    (given max_tokens) one too long to fit, found before the whole is tokenized."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the model's tokenizer has no chat template")
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"a conversation must be a non-empty list of messages, got {messages!r}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}]={message!r} must be a dict with a 'role' string and a 'content'")
    # OpenAI's text parts joined here, for every tokenizer: fastgen's renderer and transformers'
    # (a folder that needs it) both see one string.
    messages = [{**message, "content": message_text(message["content"], f"messages[{i}].content")}
                if "content" in message else message for i, message in enumerate(messages)]
    for i, message in enumerate(messages):
        if isinstance(message.get("content"), str):
            check_unicode(message["content"], f"messages[{i}].content")
    extra = {} if tools is None else {"tools": tools}  # tools: OpenAI tool definitions, for the template
    try:
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 tokenize=False, **extra)
    except (ValueError, ImportError):
        raise
    except Exception as exc:  # noqa: BLE001 - transformers' renderer lets a template's own errors through
        raise template_failed(exc) from exc
    return encode_text(tokenizer, rendered, "messages", max_tokens=max_tokens, add_special_tokens=False)
