"""Overlap scheduling: each step is launched before the previous one's tokens are read, the
pending tokens fed to it on the device. Greedy output equals transformers' with the overlap on
and off, through mixed steps, preemptions, aborts, stop tokens and strings that a late token
completes, n > 1 forks and logprobs, and interrupts (Ctrl-C) at any point of a step; sampled
output (seeds, penalties, min_tokens) is the same both ways."""

from __future__ import annotations

import pytest

from fastgen import LLM, SamplingParams
from tests.conftest import random_prompts


@pytest.fixture
def python_sigint_handler():
    """SIGINT under Python's own handler, as in a terminal: a test run started in a shell's
    background inherits SIGINT ignored, and then no Ctrl-C reaches Python at all."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)

OVERLAP = [pytest.param(True, id="overlap"), pytest.param(False, id="in-turn")]


def engine_for(model: str, overlap: bool, **kwargs):
    options = dict(dtype="float32", block_size=4, num_kv_blocks=256, max_num_seqs=8, max_model_len=128)
    options.update(kwargs)
    llm = LLM(model, overlap_scheduling=overlap, **options)
    engine = llm.engine
    assert engine.overlap is overlap
    return llm, engine


class LaunchCounter:
    """Wraps a runner's launch/collect: the most steps launched and not yet read at once."""

    def __init__(self, runner):
        self.outstanding = self.most = 0
        launch, collect = runner.launch, runner.collect

        def counted_launch(out):
            handle = launch(out)
            self.outstanding += 1
            self.most = max(self.most, self.outstanding)
            return handle

        def counted_collect(handle):
            self.outstanding -= 1
            return collect(handle)

        runner.launch, runner.collect = counted_launch, counted_collect


def drain(engine, ids, finals: dict, max_steps: int = 1000) -> dict:
    """Step until nothing is left; `finals` (request id -> final output) completed. A request
    that never ends (books left wrong) fails after max_steps."""
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert not engine.has_unfinished_requests(), f"requests still unfinished after {max_steps} steps"
    assert set(ids) <= set(finals)
    return finals


def check_books(engine):
    """Once no request is left, the engine holds nothing of the finished ones: no step in flight
    (one whose sequences a late token ended is read at once), no block-table row or sampling
    state in the runner, every block free, nothing waiting to be read."""
    while engine.has_unfinished_requests():
        assert not [o for o in engine.step() if not o.finished]
    assert engine.in_flight is None
    runner = engine.runner
    assert not runner.inputs.block_table.row_of
    assert not runner.sampler.request_generators and not runner.sampler.token_counts.slot_of
    assert not runner.sampler.logit_biases
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.runner.readbacks[0].pending == engine.runner.readbacks[1].pending == 0


@pytest.mark.parametrize("overlap", OVERLAP)
def test_requests_arriving_while_others_decode_equal_transformers(tiny_models, reference, overlap):
    """Mixed steps (budget 8, chunks of at most 2 while streams run), forks of the previous step's
    decodes into prompt chunks and back: every output equals transformers' greedy one."""
    model = tiny_models["qwen3"]
    _, engine = engine_for(model, overlap, max_num_batched_tokens=8, long_prefill_token_threshold=2)
    counter = LaunchCounter(engine.runner)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = random_prompts([7, 20, 3, 11, 1], seed=5)
    ids = []
    finals = {}
    for p in prompts:
        ids.append(engine.add_request(p, params))
        for _ in range(2):
            finals.update({o.request_id: o for o in engine.step() if o.finished})
    drain(engine, ids, finals)
    for request_id, p in zip(ids, prompts):
        assert finals[request_id].token_ids == reference(model, [p], 10)[0]
        assert finals[request_id].finish_reason == "length"
    assert counter.most == (2 if overlap else 1)
    check_books(engine)


@pytest.mark.parametrize("overlap", OVERLAP)
def test_preemptions_while_a_step_is_in_flight_equal_transformers(tiny_models, reference, overlap):
    """Few blocks: sequences are preempted while the step before carries their pending token,
    keep that token and are recomputed with it."""
    model = tiny_models["llama"]
    llm, engine = engine_for(model, overlap, num_kv_blocks=10, max_model_len=32)
    prompts = random_prompts([9, 14, 6, 11], seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0
    for out, p in zip(outputs, prompts):
        assert out.token_ids == reference(model, [p], 16)[0]
    check_books(engine)


@pytest.mark.parametrize("overlap", OVERLAP)
def test_a_stop_token_read_late_drops_the_token_computed_after_it(tiny_models, reference, overlap):
    """The step after the one that samples a stop token is already launched when the host sees
    it: its token is dropped, the output ends at the stop token, and the blocks (and the prefix
    cache, which never keys the surplus slot) stay exact for the request that runs next."""
    model = tiny_models["qwen2"]
    llm, engine = engine_for(model, overlap)
    prompts = random_prompts([10, 5, 13], seed=2)
    expected = [reference(model, [p], 12)[0] for p in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[ref[k]])
              for ref, k in zip(expected, (3, 0, 7))]
    outputs = llm.generate(prompts, params)
    for out, ref in zip(outputs, expected):
        stop = out.token_ids[-1]
        assert out.finish_reason == "stop" and out.token_ids == ref[: ref.index(stop) + 1]
    check_books(engine)
    # The same prompts again, now through the prefix cache: still transformers' output.
    again = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in again] == expected
    assert engine.block_manager.num_hit_tokens > 0


@pytest.mark.parametrize("overlap", OVERLAP)
def test_a_stop_string_completed_by_a_late_token_ends_the_output_there(tiny_models, reference, overlap):
    model = tiny_models["qwen3"]
    llm, engine = engine_for(model, overlap)
    prompt = random_prompts([8], seed=4)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    assert free.token_ids == reference(model, [prompt], 12)[0]
    stop = free.text[len(free.text) // 2:][:3]
    assert stop
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == free.text[: free.text.index(stop)]
    assert free.token_ids[: len(out.token_ids)] == out.token_ids
    check_books(engine)


@pytest.mark.parametrize("overlap", OVERLAP)
def test_an_abort_while_its_step_is_in_flight_harms_nobody(tiny_models, reference, overlap):
    model = tiny_models["qwen3"]
    _, engine = engine_for(model, overlap)
    prompts = random_prompts([6, 9, 4], seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    finals = {}
    for _ in range(4):
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.abort(ids[1])
    drain(engine, ids, finals)
    assert finals[ids[1]].finish_reason == "abort"
    assert finals[ids[1]].token_ids == reference(model, [prompts[1]], 10)[0][: len(finals[ids[1]].token_ids)]
    for i in (0, 2):
        assert finals[ids[i]].token_ids == reference(model, [prompts[i]], 10)[0]
    check_books(engine)


@pytest.mark.parametrize("overlap", OVERLAP)
def test_forks_and_logprobs_equal_transformers(tiny_models, reference, overlap):
    """n = 3 greedy completions fork from their first sample (their first decode's input is
    pending on the device) and report logprobs read a step late; all equal transformers'."""
    model = tiny_models["gpt2"]
    llm, engine = engine_for(model, overlap)
    prompts = random_prompts([5, 12], seed=9)
    out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, n=3, logprobs=2))
    for request, p in zip(out, prompts):
        ref = reference(model, [p], 8)[0]
        assert [c.token_ids for c in request.outputs] == [ref] * 3
        for c in request.outputs:
            assert [next(iter(step)) for step in c.logprobs] == ref
    check_books(engine)


@pytest.mark.parametrize("overlap", OVERLAP)
def test_forks_deltas_add_up_when_two_steps_are_read_in_one_call(tiny_models, reference, overlap):
    """A grammar request arriving mid-stream makes its step one that cannot stay in flight, so
    the step before it and it are read in one call: each completion's output of that call adds
    both steps' tokens, text and logprobs, and the deltas add up to the final completion."""
    model = tiny_models["qwen3"]
    _, engine = engine_for(model, overlap)
    prompt = random_prompts([17], seed=31)[0]
    request = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=2,
                                                        logprobs=1))
    deltas = {index: ([], "", []) for index in range(2)}
    final, steps = None, 0
    while engine.has_unfinished_requests():
        steps += 1
        if steps == 4:
            engine.add_request("x", SamplingParams(temperature=0.0, max_tokens=4,
                                                   structured_outputs={"choice": ["yes", "no"]}))
        for output in engine.step():
            if output.request_id != request:
                continue
            for c in output.outputs:
                tokens, text, logprobs = deltas[c.index]
                deltas[c.index] = (tokens + c.new_token_ids, text + c.new_text, logprobs + c.new_logprobs)
            if output.finished:
                final = output
    ref = reference(model, [prompt], 12)[0]
    for c in final.outputs:
        assert c.token_ids == ref
        assert deltas[c.index] == (c.token_ids, c.text, c.logprobs)
    check_books(engine)


def test_sampled_outputs_are_the_same_with_and_without_overlap(tiny_models):
    """Seeds draw per output position, penalties count on the device and min_tokens bans by the
    position being sampled: none of them may see the pending token as missing."""
    model = tiny_models["qwen3"]
    prompts = random_prompts([6, 10, 3, 8], seed=21)
    params = [
        SamplingParams(temperature=0.9, seed=7, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=14, repetition_penalty=1.3,
                       frequency_penalty=0.5, presence_penalty=0.2),
        SamplingParams(temperature=0.0, min_tokens=6, max_tokens=10, stop_token_ids=[1, 2, 3]),
        SamplingParams(temperature=1.1, top_k=5, seed=11, max_tokens=14, min_tokens=4),
    ]
    results = []
    for overlap in (True, False):
        llm, engine = engine_for(model, overlap)
        results.append([(o.token_ids, o.finish_reason) for o in llm.generate(prompts, params)])
        check_books(engine)
    assert results[0] == results[1]


def test_cpu_defaults_to_steps_in_turn(tiny_models):
    assert not LLM(tiny_models["qwen3"], dtype="float32", num_kv_blocks=16).engine.overlap


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.mark.parametrize("threshold", [1.0, 0.0], ids=["no-draft-pays", "every-draft-pays"])
def test_speculation_overlaps_the_steps_after_which_no_sequence_could_draft(tiny_models, reference, threshold):
    """Where no draft pays, steps overlap, the back-off's tries still come (each read in turn, so
    the try looks up from the last token); where drafts pay, every step is read before the next
    is scheduled. Greedy output equals transformers' both ways. The last prompt predicts its
    output (what transformers makes of it, half of it right), so some drafts are kept whatever a
    random model's lookups find."""
    model = tiny_models["qwen3"]
    prompts = random_prompts([9, 20], seed=16) + [random_prompts([4], seed=2)[0] * 4]
    want = reference(model, prompts, 32)
    llm, engine = engine_for(model, True, speculative_config=SPEC)
    engine.drafter.threshold = lambda batch_size: threshold
    counter = LaunchCounter(engine.runner)
    params = [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True) for _ in prompts]
    params[-1] = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True,
                                prediction=want[-1][:16] + [0] * 16)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    if threshold == 1.0:
        assert counter.most == 2 and drafted > 0  # overlapped, and tried (one token at a time)
    else:
        assert counter.most == 1 and sum(o.metrics.num_accepted_draft_tokens for o in outs) > 0
    check_books(engine)


def test_with_speculation_only_steps_launched_and_read_in_one_call_time_the_drafts(tiny_models):
    """The drafter compares step times: a step left in flight timed none of its device work, and
    the one read after it timed two steps'; neither is reported."""
    llm, engine = engine_for(tiny_models["qwen3"], True, speculative_config=SPEC)
    engine.drafter.threshold = lambda batch_size: 1.0  # nothing pays: steps overlap, tries now and then
    in_flight_before, observed = [], []
    advance, observe = engine._advance, engine.drafter.observe_step

    def spied_advance(*args):
        in_flight_before.append(engine.in_flight is not None)
        return advance(*args)

    def spied_observe(*args):
        observed.append((in_flight_before[-1], engine.in_flight is not None))
        return observe(*args)

    engine._advance, engine.drafter.observe_step = spied_advance, spied_observe
    llm.generate(random_prompts([9, 20], seed=16), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert True in in_flight_before  # steps did overlap
    assert observed and set(observed) == {(False, False)}


def test_with_speculation_a_stop_token_read_late_ends_its_request_and_harms_nobody(tiny_models, reference):
    """A step in flight holds a sequence that the step before it just ended on a stop token: the
    drafter asked whether that step's sequences could draft next must skip the finished one."""
    model = tiny_models["qwen2"]
    llm, engine = engine_for(model, True, speculative_config=SPEC)
    engine.drafter.threshold = lambda batch_size: 1.0  # nothing pays: steps overlap
    prompts = random_prompts([10, 5, 13], seed=2)
    expected = [reference(model, [p], 12)[0] for p in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[ref[k]])
              for ref, k in zip(expected, (3, 0, 7))]
    counter = LaunchCounter(engine.runner)
    outputs = llm.generate(prompts, params)
    assert counter.most == 2
    for out, ref in zip(outputs, expected):
        stop = out.token_ids[-1]
        assert out.finish_reason == "stop" and out.token_ids == ref[: ref.index(stop) + 1]
    check_books(engine)


@pytest.mark.parametrize("where", ["before the launch", "while reading the previous step"])
def test_an_interrupt_with_a_step_in_flight_leaves_nothing_behind(tiny_models, reference, where):
    """A KeyboardInterrupt after the next step was scheduled (before its launch), or in the host's
    post-processing of step N while step N+1 is launched: it reaches the caller, the launched and
    scheduled steps are given up (their sequences' counts restored, forks sent back to compute
    their prompt), and the engine carries on to transformers' output with balanced books."""
    model = tiny_models["qwen3"]
    _, engine = engine_for(model, True)
    prompts = random_prompts([6, 9], seed=13)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    ids.append(engine.add_request(prompts[0], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, n=2)))
    finals: dict = {}
    for _ in range(1 if where == "before the launch" else 3):
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    owner, name = (engine.structured, "step_bitmask") if where == "before the launch" else (engine.live, "advance")
    original = getattr(owner, name)

    def interrupted(*args):
        setattr(owner, name, original)
        raise KeyboardInterrupt

    setattr(owner, name, interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert engine.in_flight is None
    assert not any(state.seq.in_launched_step for state in engine.requests.values())
    drain(engine, ids, finals)
    expected = [reference(model, [p], 10)[0] for p in prompts]
    assert [finals[i].token_ids for i in ids[:2]] == expected
    assert [c.token_ids for c in finals[ids[2]].outputs] == [expected[0]] * 2
    check_books(engine)


@pytest.mark.cuda
@pytest.mark.parametrize("overlap", OVERLAP)
def test_on_cuda_graphs_with_a_step_in_flight_equal_transformers(tiny_models, reference, overlap):
    """The CUDA path with overlap: decode graphs whose greedy ids feed the next replay's inputs on
    the device, the double token readback, logprobs taken before the next replay overwrites the
    graph's logits, stop tokens read a step late, preemptions under few blocks."""
    model = tiny_models["qwen3"]
    llm = LLM(model, device="cuda", dtype="float32", block_size=4, num_kv_blocks=24, max_num_seqs=4,
              max_model_len=64, cuda_graph_batch_sizes=[1, 2, 4], enforce_eager=False, overlap_scheduling=overlap)
    engine = llm.engine
    assert engine.overlap is overlap and engine.runner.graphs is not None
    prompts = random_prompts([9, 14, 6, 11, 3], seed=8)
    expected = [reference(model, [p], 16)[0] for p in prompts]
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1))
    assert [o.token_ids for o in greedy] == expected
    assert all([next(iter(step)) for step in o.outputs[0].logprobs] == o.token_ids for o in greedy)
    assert engine.scheduler.num_preemptions > 0
    stops = [SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[ref[k]]) for ref, k in
             zip(expected, (2, 5, 0, 9, 4))]
    for out, ref in zip(llm.generate(prompts, stops), expected):
        assert out.token_ids == ref[: ref.index(out.token_ids[-1]) + 1]
    check_books(engine)


@pytest.mark.parametrize("overlap", OVERLAP)
def test_ctrl_c_while_a_step_is_formed_is_raised_once_it_is_formed(tiny_models, reference, overlap,
                                                                    python_sigint_handler):
    """SIGINT (Ctrl-C) arriving while the scheduler forms a step (blocks taken, tokens marked in
    flight) is held back until the step is formed, so the engine can give the step up: the
    requests open across the interrupt still equal transformers'."""
    import signal

    model = tiny_models["qwen3"]
    _, engine = engine_for(model, overlap)
    prompts = random_prompts([6, 9], seed=13)
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)) for p in prompts]
    finals: dict = {}
    for _ in range(3):
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    scheduler = engine.scheduler
    take_up = scheduler._take_up

    def interrupted(out):
        take_up(out)
        scheduler._take_up = take_up
        signal.raise_signal(signal.SIGINT)

    scheduler._take_up = interrupted
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    drain(engine, ids, finals)
    assert [finals[i].token_ids for i in ids] == [reference(model, [p], 10)[0] for p in prompts]
    check_books(engine)


def test_a_second_ctrl_c_inside_a_held_back_block_is_raised_at_once(python_sigint_handler):
    """One Ctrl-C waits for the block's end; a second leaves it at once (a step that hangs, say)."""
    import signal

    from fastgen.engine.interrupts import interrupts_held_back

    reached = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_held_back():
            signal.raise_signal(signal.SIGINT)
            reached.append("after the first")
            signal.raise_signal(signal.SIGINT)
            reached.append("after the second")
    assert reached == ["after the first"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
