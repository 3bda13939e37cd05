"""Which drafted tokens a verification keeps."""

from __future__ import annotations

from collections.abc import Sequence


def accepted_prefix(draft: Sequence[int], samples: Sequence[int]) -> int:
    """How many of `draft` are kept: samples[i] is the token sampled at the position of draft[i]
    (and samples[len(draft)] the one after the last). Drafted tokens are kept up to the first
    the sample differs from; the sample there (or after the last) is the step's next token."""
    assert len(samples) == len(draft) + 1, (len(draft), len(samples))
    accepted = 0
    for proposed, sampled in zip(draft, samples):
        if proposed != sampled:
            break
        accepted += 1
    return accepted
