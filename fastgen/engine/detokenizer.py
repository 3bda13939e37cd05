"""Incremental detokenization: new text per new token, correct across multi-byte characters.

Decoding one token at a time breaks characters whose UTF-8 bytes span several byte-level tokens
(they decode to U+FFFD until complete) and drops the leading space some tokenizers attach to a
word. So each step decodes a short window of recent tokens twice, with and without the new ones,
and emits the difference once it no longer ends in an incomplete character.

A streamed request pays this for every token, every step: where the tokenizer is a Rust one, its
own `DecodeStream` runs the same two decodes on the same window in one call (a third less time a
token), and the Python steps below remain for everything else.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from fastgen.engine.tokenizer import decoder_steps

# Prompt tokens used as left context for the first output tokens (enough for any merge rule
# that looks back, small enough to stay cheap).
_CONTEXT_TOKENS = 6
# More new tokens than this at once (a request's whole output decoded when it ends) take the
# two decodes over them all, which beats stepping through them one by one.
MOST_TOKENS_STREAMED = 8


class IncrementalDetokenizer:
    """streamed: the text is asked for as tokens come (False: once, at the end), so the Rust
    stream may pay for itself."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 streamed: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.num_context_tokens = len(self.ids)
        # The text is complete up to read_offset, and decoded from prefix_offset on.
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        # The Rust tokenizer a DecodeStream may step (None: the Python steps, for good once they
        # have run, since the stream's window would no longer follow the offsets), and the
        # stream, made at the first `add`.
        self._streams_with = None
        self._stream = None
        # Runs every step for every request: call the Rust tokenizer directly when transformers'
        # wrapper would add nothing (it costs ~3x the decode itself in argument conversion).
        backend = getattr(tokenizer, "backend_tokenizer", None)
        # Where byte tokens decode as runs (byte fallback), a whole output is decoded token by
        # token if it holds a U+FFFD (see `add`); no other tokenizer needs that.
        steps = None if backend is None else decoder_steps(backend)
        self._byte_fallback = steps is None or "ByteFallback" in steps  # (unreadable: the careful path)
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            self._decode = lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
            if streamed:
                self._streams_with = backend

    @property
    def num_output_tokens(self) -> int:
        return len(self.ids) - self.num_context_tokens

    @property
    def streaming(self) -> bool:
        """Whether the tokenizer's Rust stream detokenizes the tokens now."""
        return self._stream is not None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Append output tokens; return the text they complete (may be "" while a character is
        still incomplete)."""
        if self._streams_with is not None and len(token_ids) <= MOST_TOKENS_STREAMED:
            if self._stream is None:
                self._stream = _decode_stream(self._streams_with, self.ids, self.skip_special_tokens)
            if self._stream is not None:
                return self._add_streamed(token_ids)
        if (self._byte_fallback and len(token_ids) > 1
                and "\ufffd" in self._decode(self.ids[self.prefix_offset:] + list(token_ids))):
            # A byte-fallback tokenizer decodes a run of byte tokens as a whole: one invalid byte
            # in it turns the run's complete characters into U+FFFD too, which token by token
            # they are not. Stepping keeps the text what a stream of the same tokens gives.
            return "".join(self._add_decoded([token]) for token in token_ids)
        return self._add_decoded(token_ids)

    def _add_decoded(self, token_ids: list[int]) -> str:
        """`add` by the two decodes."""
        self._streams_with = self._stream = None
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        new = self._text_after(prefix, full)
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return new

    def _add_streamed(self, token_ids: list[int]) -> str:
        """`add` through the tokenizer's DecodeStream, which keeps the same window: a piece of
        text completes the tokens up to the one that gave it (None: a character still incomplete,
        or an id the tokenizer lacks, which decodes to nothing either way). The stream refuses a
        window whose text no longer begins with the text it gave (bytes of a byte-fallback
        tokenizer that a stray byte turns back into U+FFFD): the two decodes then take over from
        that token, as they would have run it."""
        pieces = []
        for i, token in enumerate(token_ids):
            try:
                piece = self._stream.step(self._streams_with, token)
            except Exception:  # noqa: BLE001 - tokenizers raises a bare Exception ("Invalid prefix")
                return "".join(pieces) + self._add_decoded(token_ids[i:])
            self.ids.append(token)
            if piece is not None:
                pieces.append(piece)
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return "".join(pieces)

    def flush(self) -> str:
        """At the end of a request: emit whatever is still held back, replacement chars included."""
        if self.read_offset == len(self.ids):
            return ""
        self._streams_with = self._stream = None
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new = self._text_after(prefix, self._decode(self.ids[self.prefix_offset :]))
        self.read_offset = len(self.ids)
        return new

    def _text_after(self, prefix: str, full: str) -> str:
        """The text of the tokens past read_offset: `full` (the window's) past `prefix` (its read
        part's), or, where decoding the window whole rewrote the read part (a byte-fallback run
        that a stray byte made invalid turns all its bytes into U+FFFD), those tokens alone."""
        if full.startswith(prefix):
            return full[len(prefix) :]
        return self._decode(self.ids[self.read_offset :])


def _decode_stream(backend, context: list[int], skip_special_tokens: bool) -> DecodeStream | None:
    """The tokenizer's DecodeStream in the state the two decodes start from: the left context
    read, its text the prefix. None where that context ends inside a character: the stream would
    hold its bytes and give them out with the first output, where the two decodes count them as
    read; and where this tokenizers' DecodeStream takes no context (before 0.22, which an
    environment not installed from this package may have)."""
    if backend.decode(context, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
        return None
    try:
        return DecodeStream(ids=list(context), skip_special_tokens=skip_special_tokens)
    except TypeError:
        return None
