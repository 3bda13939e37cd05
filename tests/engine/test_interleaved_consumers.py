"""Random programs of consumers sharing one engine in one thread — streams opened, read
interleaved, closed or dropped unread; requests added and stepped by hand; generate() batches in
between; aborts anywhere; greedy and odd sampling settings — and after every program each request
had exactly one final output, greedy tokens equal transformers', and no block or state is left."""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

import pytest

pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fastgen import LLM, SamplingParams  # noqa: E402
from tests.conftest import random_prompts  # noqa: E402
from tests.engine.conftest import step_limit  # noqa: E402

MAX_TOKENS = 10
PROMPTS = random_prompts([3, 9, 14, 20, 6], seed=71)

greedy = st.builds(SamplingParams, temperature=st.just(0.0), max_tokens=st.integers(1, MAX_TOKENS),
                   ignore_eos=st.just(True))
odd = st.builds(SamplingParams, temperature=st.sampled_from([1e-6, 0.8, 3.0e38]),
                top_k=st.sampled_from([-1, 1, 2, 2**63]), top_p=st.sampled_from([1.0, 0.3, 1e-46]),
                max_tokens=st.integers(1, MAX_TOKENS), seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
                stop=st.sampled_from([[], ["e"], ["the", " "]]))
params = st.one_of(greedy, odd)
pick = st.integers(0, 10**6)
ops = st.lists(st.one_of(
    st.tuples(st.just("stream"), st.integers(0, 4), params),
    st.tuples(st.just("next"), pick),
    st.tuples(st.just("close"), pick),
    st.tuples(st.just("drop"), pick),
    st.tuples(st.just("add"), st.integers(0, 4), params),
    st.tuples(st.just("step")),
    st.tuples(st.just("generate"), st.lists(st.integers(0, 4), min_size=1, max_size=3), params),
    st.tuples(st.just("abort"), pick),
), min_size=1, max_size=40)


@dataclass
class Seen:
    """What one request's consumer received."""

    prompt: int
    params: SamplingParams
    outputs: list = field(default_factory=list)
    aborted: bool = False
    read_to_end: bool = True  # False for a stream closed or dropped by its reader


@pytest.fixture(scope="module")
def llm(tiny_models):
    # Few blocks and a small token budget: preemption and chunked prefill happen too.
    return LLM(tiny_models["qwen3"], dtype="float32", block_size=4, num_kv_blocks=24, max_model_len=64,
               max_num_seqs=4, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def expected(reference, tiny_models):
    return reference(tiny_models["qwen3"], PROMPTS, MAX_TOKENS)


def check(seen: Seen, expected_tokens: list[int]) -> None:
    outs = seen.outputs
    if not seen.read_to_end:
        assert not any(o.finished for o in outs[:-1])
        return
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True], "exactly one final output, last"
    final = outs[-1]
    assert sum((o.new_token_ids for o in outs), []) == final.token_ids
    assert len(final.token_ids) <= seen.params.max_tokens
    assert final.finish_reason in (("abort", "stop", "length") if seen.aborted else ("stop", "length"))
    if final.finish_reason == "length":
        assert len(final.token_ids) == seen.params.max_tokens
    if seen.params.greedy:  # cut short by a stop string or an abort, but never other tokens
        assert final.token_ids == expected_tokens[: len(final.token_ids)]


def run_program(llm: LLM, program, seen: dict[str, Seen]) -> None:
    """Apply the operations, then read every stream still open to its end."""
    engine = llm.engine
    streams: list = []

    def record(outputs):
        for o in outputs:
            seen[o.request_id].outputs.append(o)

    for op in program:
        kind = op[0]
        if kind == "stream":
            stream = llm.stream(PROMPTS[op[1]], op[2])
            seen[stream.request_id] = Seen(op[1], op[2])
            streams.append(stream)
        elif kind in ("next", "close", "drop") and streams:
            stream = streams[op[1] % len(streams)]
            if kind == "next":
                record([o for o in [next(stream, None)] if o is not None])
                continue
            streams.remove(stream)
            seen[stream.request_id].read_to_end = False
            if kind == "close":
                stream.close()
            del stream
            gc.collect()
        elif kind == "add":
            seen[engine.add_request(PROMPTS[op[1]], op[2])] = Seen(op[1], op[2])
        elif kind == "step":
            record(engine.step())
        elif kind == "generate":
            for i, o in zip(op[1], llm.generate([PROMPTS[i] for i in op[1]], op[2])):
                seen[o.request_id] = Seen(i, op[2], [o])
        elif kind == "abort" and seen:
            request_id = list(seen)[op[1] % len(seen)]
            if engine.abort(request_id):
                seen[request_id].aborted = True
    for stream in streams:
        record(list(stream))
    while engine.has_unfinished_requests():
        record(engine.step())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(program=ops)
def test_random_consumers_each_get_exactly_their_own_outputs(llm, expected, program):
    engine = llm.engine
    seen: dict[str, Seen] = {}
    with step_limit(engine):
        run_program(llm, program, seen)
    for s in seen.values():
        check(s, expected[s.prompt])
    assert not engine.requests and not engine.outbox.mailboxes and not engine.outbox.for_step
    engine.check_invariants()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
