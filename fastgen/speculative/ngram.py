"""Prompt-lookup proposals: continue the sequence the way it went on after an earlier occurrence
of its last n tokens (n from prompt_lookup_max down to prompt_lookup_min): of those followed by a
whole draft, the one nearest the sequence's copy cursor where one lies near it, else the latest;
else the latest of all.

Why near the cursor: a sequence that copies its prompt with edits (a corrected word, a renamed
variable) leaves the text at each edit and comes back to it just after; the tokens it comes back
on (" the", "(") often occur all over the text, and the latest occurrence is seldom the one it
was copying. The cursor is where the sequence's last draft would have gone on (the drafter keeps
it: the draft's start plus its tokens kept, plus the one the model wrote instead), so a match
ending near it continues the text being copied.

Why not simply the latest otherwise: in a loop shorter than a draft (text repeating a short
phrase, a model stuck on a token) the latest occurrence sits right before the end, so what
follows it is cut short by the end of the sequence; an occurrence one period earlier continues
the loop as well and has a whole draft after it."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

# A match is near the cursor where the draft after it starts this many tokens before the cursor
# at most (the model went back a token or two), or this many after it (the model skipped text,
# or wrote tokens of its own since the last draft).
NEAR_BEHIND, NEAR_AHEAD = 2, 32


def lookup_draft(tokens: np.ndarray, extra: np.ndarray | None, num_tokens: int, n_max: int, n_min: int,
                 cursor: int | None = None) -> tuple[list[int], int | None]:
    """Up to `num_tokens` tokens that followed an earlier match of the sequence's last n tokens,
    trying n = n_max .. n_min: the match nearest `cursor` (an index into `tokens`) among those
    near it with `num_tokens` tokens after them, else the latest with `num_tokens` tokens after
    it, else the latest; and the index in `tokens` where the draft starts (None for a draft from
    `extra`). ([], None) when none matches.

    tokens: the sequence so far (prompt and output), int64. extra: other text to search first
    (a request's predicted output), or None. A match in `extra` is preferred: it is what the
    caller said the output will be."""
    length = tokens.shape[0]
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        pattern = tokens[length - n:]
        if extra is not None and extra.shape[0] > n:
            found = _match(extra[:-1], pattern, n, extra.shape[0] - n - num_tokens, None)
            if found is not None:
                return extra[found + n: found + n + num_tokens].tolist(), None
        # Earlier occurrences only: a match must end before the last token.
        found = _match(tokens[: length - 1], pattern, n, length - n - num_tokens, cursor)
        if found is not None:
            return tokens[found + n: found + n + num_tokens].tolist(), found + n
    return [], None


def _match(haystack: np.ndarray, pattern: np.ndarray, n: int, whole_draft_by: int, cursor: int | None) -> int | None:
    """Start of the window of `haystack` equal to `pattern` (n tokens) whose end is nearest
    `cursor`, among those that end near it and start at or before `whole_draft_by` (a whole draft
    follows them); else of the latest that starts at or before `whole_draft_by`, else of the
    latest; None if none."""
    if haystack.shape[0] < n:
        return None
    # Candidates by the first token, then the rest compared only there.
    starts = np.flatnonzero(haystack[: haystack.shape[0] - n + 1] == pattern[0])
    if n > 1 and starts.size:
        windows = sliding_window_view(haystack, n)[starts]
        starts = starts[(windows == pattern).all(axis=1)]
    if not starts.size:
        return None
    if cursor is not None:
        # Only matches with a whole draft after them: in a loop shorter than a draft the one
        # nearest the cursor is the one just before the end, whose draft the end cuts short.
        offsets = starts + n - cursor
        near = (offsets >= -NEAR_BEHIND) & (offsets <= NEAR_AHEAD) & (starts <= whole_draft_by)
        if near.any():
            # The nearest, ahead of the cursor rather than behind it at the same distance.
            close = offsets[near]
            return int(starts[near][np.argmin(2 * np.abs(close) + (close < 0))])
    with_whole_draft = starts[starts <= whole_draft_by]
    return int(with_whole_draft[-1] if with_whole_draft.size else starts[-1])
