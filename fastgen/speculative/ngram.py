"""Prompt-lookup proposals: continue the sequence the way it went on after the latest earlier
occurrence of its last n tokens (n from prompt_lookup_max down to prompt_lookup_min) that is
followed by a whole draft, else after the latest one.

Why not simply the latest: in a loop shorter than a draft (text repeating a short phrase, a
model stuck on a token) the latest occurrence sits right before the end, so what follows it is
cut short by the end of the sequence; an occurrence one period earlier continues the loop as
well and has a whole draft after it."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def lookup_draft(tokens: np.ndarray, extra: np.ndarray | None, num_tokens: int, n_max: int, n_min: int
                 ) -> list[int]:
    """Up to `num_tokens` tokens that followed the latest earlier match of the sequence's last n
    tokens with `num_tokens` tokens after it (else the latest match), trying n = n_max .. n_min;
    [] when none matches.

    tokens: the sequence so far (prompt and output), int64. extra: other text to search first
    (a request's predicted output), or None. A match in `extra` is preferred: it is what the
    caller said the output will be."""
    length = tokens.shape[0]
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        pattern = tokens[length - n:]
        if extra is not None and extra.shape[0] > n:
            found = _last_match(extra[:-1], pattern, n, extra.shape[0] - n - num_tokens)
            if found is not None:
                return extra[found + n: found + n + num_tokens].tolist()
        # Earlier occurrences only: a match must end before the last token.
        found = _last_match(tokens[: length - 1], pattern, n, length - n - num_tokens)
        if found is not None:
            return tokens[found + n: found + n + num_tokens].tolist()
    return []


def _last_match(haystack: np.ndarray, pattern: np.ndarray, n: int, whole_draft_by: int) -> int | None:
    """Start of the latest window of `haystack` equal to `pattern` (n tokens) that starts at or
    before `whole_draft_by` (a whole draft follows it), else of the latest one; None if none."""
    if haystack.shape[0] < n:
        return None
    # Candidates by the first token, then the rest compared only there.
    starts = np.flatnonzero(haystack[: haystack.shape[0] - n + 1] == pattern[0])
    if n > 1 and starts.size:
        windows = sliding_window_view(haystack, n)[starts]
        starts = starts[(windows == pattern).all(axis=1)]
    if not starts.size:
        return None
    with_whole_draft = starts[starts <= whole_draft_by]
    return int(with_whole_draft[-1] if with_whole_draft.size else starts[-1])
