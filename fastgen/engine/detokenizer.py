"""Incremental detokenization: new text per new token, correct across multi-byte characters.

Decoding one token at a time breaks characters whose UTF-8 bytes span several byte-level tokens
(they decode to U+FFFD until complete) and drops the leading space some tokenizers attach to a
word. So each step decodes a short window of recent tokens twice, with and without the new ones,
and emits the difference once it no longer ends in an incomplete character.
"""

from __future__ import annotations

# Prompt tokens used as left context for the first output tokens (enough for any merge rule
# that looks back, small enough to stay cheap).
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Runs every step for every request: call the Rust tokenizer directly when transformers'
        # wrapper would add nothing (it costs ~3x the decode itself in argument conversion).
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            self._decode = lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.num_context_tokens = len(self.ids)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.ids) - self.num_context_tokens

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Append output tokens; return the text they complete (may be "" while a character is
        still incomplete)."""
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        new = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return new

    def flush(self) -> str:
        """At the end of a request: emit whatever is still held back, replacement chars included."""
        if self.read_offset == len(self.ids):
            return ""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new = self._decode(self.ids[self.prefix_offset :])[len(prefix) :]
        self.read_offset = len(self.ids)
        return new
