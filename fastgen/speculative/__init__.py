"""Speculative decoding: draft tokens proposed for a running sequence and verified by the target
model in the same forward as the rest of the batch.

Layers: `config.py` (the `speculative_config` knob, checked), `ngram.py` (prompt lookup: the
tokens that followed an earlier occurrence of the sequence's last n tokens, in its own prompt,
output or predicted output: near where its last draft would have gone on, else the latest
followed by a whole draft), `draft_model.py` (a smaller model's greedy proposals over its own
paged KV), `drafts.py` (per sequence: how many tokens to propose this step, its acceptance counters, and
the back-off that stops proposing where drafts keep failing),
`verify.py` (which of a sequence's drafted tokens the target's samples accept).

The engine's scheduler asks `Drafter.propose` for every decoding sequence; the runner samples
every verified position with the request's own settings and `accepted_prefix` keeps the drafted
tokens up to the first that the sample differs from, plus that sample. For a drafted token
proposed with certainty (lookup drafts are), this is rejection sampling: the draft d is kept
with probability p(d), and otherwise the sample is distributed as p without d, renormalized, so
the output has the target's distribution exactly; under greedy sampling it is the greedy output.
"""
