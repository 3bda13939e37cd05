"""LLMEngine: the request loop an application or a server drives.

    add_request(prompt, params) -> request_id     validate, tokenize, queue
    step() -> [RequestOutput]                     schedule, run the model, post-process
    abort(request_id) -> bool                     finish now, free its blocks
    has_unfinished_requests()

Every request ends with exactly one final output (`finished=True`): "stop", "length", "abort",
or "error" when a step failed on that request alone. Outputs wait in the `Outbox` until their
consumer takes them: `step()` returns those of requests added with `add_request`, whoever drove
the engine when they were made; `LLM.generate` and `LLM.stream` claim their requests and read
their own. A failed step never escapes `step()`: its batch is retried one sequence at a time
(`Scheduler.isolate`), so only the requests that fail alone end with "error". Only an
`EngineDeadError` (a tensor-parallel rank died) does, since no retry could succeed.

A request with n > 1 completions is n sequences inside, one child request each, forked from the
first once its prompt is computed; their outputs are folded into one output of the request
before they reach the outbox (`parallel_sampling`).

Overlap scheduling (`EngineConfig.overlap_scheduling`): `run_step` schedules and launches the
next step before it reads the tokens of the one launched by the previous call (`InFlightStep`),
so the host's post-processing runs while the device computes; outputs come one call later. A
step whose next one needs its tokens on the host (speculative drafts, grammar masks) is read at
once, as every step is without overlap.

An engine is not thread-safe: one thread drives it (see `fastgen.engine.background` for the loop
that lets many threads submit and stream; while it runs, other threads are refused).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastgen.checks import boolean
from fastgen.config import EngineConfig
from fastgen.engine.block_manager import BlockManager
from fastgen.engine.driving_thread import Driver
from fastgen.engine.interrupts import interrupts_held_back
from fastgen.engine.live_requests import LiveRequests
from fastgen.engine.outbox import Outbox
from fastgen.engine.parallel_sampling import ParentRequest
from fastgen.engine.prompts import Prompt
from fastgen.engine.request_state import RequestState, now
from fastgen.engine.requests import EngineOverloaded, RequestFactory, check_request_id
from fastgen.engine.scheduler import Scheduler
from fastgen.engine.stats import EngineStats
from fastgen.engine.tokenizer import eos_token_ids, load_tokenizer
from fastgen.errors import EngineDeadError
from fastgen.outputs import RequestOutput, StepResult
from fastgen.sampling_params import SamplingParams
from fastgen.scheduler_output import SchedulerOutput
from fastgen.sequence import FinishReason, SequenceStatus
from fastgen.structured.manager import StructuredOutputManager, Verdict

if TYPE_CHECKING:  # torch: not for `import fastgen`
    from fastgen.step_runner import StepRunner

logger = logging.getLogger(__name__)


@dataclass
class InFlightStep:
    """A launched step whose tokens are not read yet: the scheduler's output, the runner's
    handle and the requests of its rows (sequences, then forked children). settled: the
    scheduler has taken its results (or given it up), so its sequences' in-flight counts are
    back (`Scheduler.postprocess` / `abandon`)."""

    out: SchedulerOutput
    launched: Any
    states: list[RequestState]
    started: float
    settled: bool = False


class LLMEngine:
    def __init__(self, config: EngineConfig, load_format: str = "safetensors", skip_tokenizer_init: bool = False):
        """skip_tokenizer_init: serve token-id prompts only and return no text (for benchmarks
        on dummy weights, whose folders hold only a config.json)."""
        self.config = config
        skip_tokenizer_init = boolean("skip_tokenizer_init", skip_tokenizer_init)
        self.tokenizer = None if skip_tokenizer_init else load_tokenizer(config.model)
        eos = eos_token_ids(config.model, config.model_config, self.tokenizer)
        self.runner: StepRunner
        if config.tensor_parallel_size > 1:
            from fastgen.distributed.rank0_runner import start_tensor_parallel

            # On a torchrun rank > 0 this serves as a worker and never returns.
            self.runner = start_tensor_parallel(config, load_format, eos)
        else:
            from fastgen.model_runner import ModelRunner  # torch and the model: not for `import fastgen`

            self.runner = ModelRunner(config, load_format=load_format, eos_token_ids=eos)
        self.block_manager = BlockManager(
            self.runner.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.drafter = None
        if config.speculative_config is not None:
            from fastgen.engine.drafting import build_drafter

            self.drafter = build_drafter(config, self.runner, load_format,
                                         lambda seq: self.live.by_seq[seq.seq_id].prediction_token_ids)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_model_len,
            eos,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            drafter=self.drafter,
        )
        self.structured = StructuredOutputManager(self._grammar_backend_factory(eos))
        self.outbox = Outbox()
        self.live = LiveRequests(self.scheduler, self.outbox, on_forget=self.structured.release)
        self.requests, self.parents = self.live.states, self.live.parents  # read-only views, by id
        self.num_steps = 0
        # Since start, by kind (draft: speculative tokens verified; accepted: those kept).
        self.step_tokens = {"decode": 0, "prompt": 0, "mixed_steps": 0, "draft": 0, "accepted": 0}
        self.accepted_per_position: list[int] = []
        self.factory = RequestFactory(config, self.tokenizer, self.structured.compile)
        self.driver = Driver()  # which thread may drive the engine
        # A tensor-parallel engine's other ranks get their input ids from rank 0's host rows, and
        # drafts need each step's tokens on the host: a step stays in flight only where no
        # sequence of it could draft in the next (`Drafter.may_draft`).
        self.overlap = bool(config.overlap_scheduling) and config.tensor_parallel_size == 1
        self.in_flight: InFlightStep | None = None
        self._graphs_loaded = 0  # compiled graphs loaded as of the last step (`_count_graphs_loaded`)

    def _grammar_backend_factory(self, eos: set[int]):
        """What builds the structured-output backend on first use (None without a tokenizer)."""
        if self.tokenizer is None:
            return None
        tokenizer, vocab_size = self.tokenizer, self.config.model_config.vocab_size

        def build():
            from fastgen.structured.xgrammar_backend import XGrammarBackend

            return XGrammarBackend(tokenizer, vocab_size, sorted(eos))

        return build

    # ---- requests in -----------------------------------------------------------------------
    def prepare(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
                final_only: bool = False) -> RequestState | ParentRequest:
        """Validate and tokenize a request without queueing it (raises ValueError).

        The request keeps its own validated copy of `params`. request_id: a non-empty string,
        or None for a fresh one. final_only: the request is reported once, when it finishes,
        instead of every step. A request with n > 1 is prepared as a `ParentRequest`.
        """
        self.driver.check()
        return self.factory.make(prompt, params, request_id, final_only, in_use=self._id_taken)

    def has_request(self, request_id: str) -> bool:
        """Whether a request (of any n) with this id is queued or running."""
        return request_id in self.live

    def _id_taken(self, request_id: str) -> bool:
        """Queued, running, or finished with its final output not yet returned by `step()` (its
        consumer would take that output for a new request's of the same id)."""
        return self.has_request(request_id) or self.outbox.final_waits(request_id)

    def enqueue(self, state: RequestState | ParentRequest, claimed: bool = False) -> str:
        """Queue a prepared request. claimed: its outputs go to its own mailbox (`take_output`),
        not to `step()`."""
        self.driver.check()
        self._release_abandoned()
        if self._id_taken(state.request_id):
            raise ValueError(f"request_id={state.request_id!r} is already in use")
        if boolean("claimed", claimed):
            self.outbox.open(state.request_id)
        self.live.add(state)
        return state.request_id

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    final_only: bool = False) -> str:
        """Queue a request whose outputs `step()` returns; return its id (a string). final_only:
        `step()` returns one output for it, its final one, instead of one every step. Raises
        ValueError for bad input and EngineOverloaded when max_waiting_requests requests already
        wait; either way nothing is queued."""
        state = self.prepare(prompt, SamplingParams() if params is None else params, request_id, final_only)
        waiting, cap = self.scheduler.num_new_waiting, self.config.max_waiting_requests
        if waiting >= cap:
            raise EngineOverloaded(f"{waiting} requests are waiting, the engine's max_waiting_requests={cap}")
        return self.enqueue(state)

    def abort(self, request_id: str) -> bool:
        """Finish a request (every completion of an n > 1 one) now and free its blocks; its
        consumer gets one final output with finish_reason "abort". False when no unfinished
        request has this id; ValueError when the id is not a string."""
        self.driver.check()
        outputs = self.live.abort(check_request_id(request_id))
        if outputs is None:
            return False
        self.outbox.between_steps += outputs
        return True

    def take_output(self, request_id: str) -> RequestOutput | None:
        """The next output of a claimed request, or None when none waits yet."""
        return self.outbox.take(request_id)

    def release(self, request_id: str) -> None:
        """A claimed request's reader leaves: drop its outputs, abort it if unfinished."""
        self.driver.check()  # before the outbox changes: another thread's call changes nothing
        self.outbox.close(request_id)
        self.abort(request_id)

    def abandon(self, request_id: str) -> None:
        """Any thread (a finalizer): `release` the request on the engine's next call."""
        self.outbox.abandon(request_id)

    def _release_abandoned(self) -> None:
        if self.driver.is_current():
            for request_id in self.outbox.take_abandoned():
                self.release(request_id)

    def has_unfinished_requests(self) -> bool:
        """Whether requests are queued or running, or outputs wait for `step()` to return them
        (the final output of an aborted request, say)."""
        self._release_abandoned()
        # A step in flight counts even when its sequences all finished (a late token ended them):
        # their final outputs went out with the step before, and the next call reads it, so that
        # an idle engine holds nothing of the requests it served.
        return self.scheduler.has_unfinished() or bool(self.outbox.for_step) or self.in_flight is not None

    def shutdown(self) -> None:
        """Release the runner's processes (a tensor-parallel engine's workers, a draft model's
        background compile); idempotent."""
        self.runner.shutdown()
        if self.drafter is not None and self.drafter.model is not None:
            self.drafter.model.shutdown()

    def stats(self) -> EngineStats:
        """A snapshot of the engine's load and lifetime counters (for metrics)."""
        bm, scheduler = self.block_manager, self.scheduler
        return EngineStats(
            num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
            num_kv_blocks=bm.num_blocks, num_used_kv_blocks=bm.num_blocks - bm.num_free_blocks,
            prefix_hit_tokens=bm.num_hit_tokens, prefix_queried_tokens=bm.num_queried_tokens,
            num_preemptions=scheduler.num_preemptions, num_steps=self.num_steps,
            decode_tokens=self.step_tokens["decode"], prompt_tokens=self.step_tokens["prompt"],
            mixed_steps=self.step_tokens["mixed_steps"], draft_tokens=self.step_tokens["draft"],
            accepted_draft_tokens=self.step_tokens["accepted"], accepted_per_position=tuple(self.accepted_per_position),
        )

    def check_invariants(self) -> None:
        """Assert the block manager's books balance against the running sequences."""
        self.block_manager.check_invariants(self.scheduler.running)

    # ---- who drives ------------------------------------------------------------------------
    def attach_loop(self, thread: threading.Thread) -> None:
        """From now on only `thread` (a background loop) may drive the engine; see `Driver`."""
        self._release_abandoned()
        self.driver.attach(thread, len(self.requests) + len(self.outbox.mailboxes) + len(self.outbox.for_step))

    def check_alive(self) -> None:
        """EngineDeadError when the engine can run no step any more (a tensor-parallel rank died,
        even while no request ran): what an idle loop asks between commands."""
        self.runner.check_alive()

    def detach_loop(self, thread: threading.Thread) -> None:
        self.driver.detach(thread)

    # ---- one step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return the outputs waiting for `step()`'s caller: those of
        requests added with `add_request` (deltas in new_text / new_token_ids), including ones
        made while `LLM.generate` or a stream drove the engine."""
        self.run_step()
        return self.outbox.take_for_step()

    def run_step(self) -> StepResult:
        """Run one step and deliver its outputs to their consumers; report what it did (see
        `_run_step`). Where a step spans processes (tensor parallelism), Ctrl-C is held back
        until the step has ended on every rank and its outputs are delivered: an interrupt in
        the middle of its collectives would leave the ranks out of step for good."""
        if not self.runner.steps_span_processes:
            return self._run_step()
        with interrupts_held_back():
            return self._run_step()

    def _run_step(self) -> StepResult:
        """Run one step and deliver its outputs to their consumers; report what it did.

        With overlap scheduling the step launched here is read by the next call, and the
        outputs delivered are those of the step the previous call launched.
        Never raises for a failed step: see `_finish` and `_fail_all`."""
        self.driver.check()
        self._release_abandoned()
        started = now()
        outputs = self.outbox.take_between_steps()
        out, handed_over, after_a_step_in_flight = None, False, False
        try:
            with interrupts_held_back():
                out = self.scheduler.schedule()
            if out is None:
                if self.in_flight is None:
                    self.runner.forget(*self.scheduler.pop_facts())
                    return StepResult(outputs, None, 0, 0, 0, started)
            else:
                grammar = self.structured.step_bitmask(out, lambda seq: self.live.by_seq[seq.seq_id].grammar)
                if grammar is not None:
                    out = dataclasses.replace(out, grammar=grammar)
            handed_over = True  # from here `_advance` owns `out`, launched or not
            after_a_step_in_flight = self.in_flight is not None
            made, num_sampled = self._advance(out, started, outputs)
        except EngineDeadError:
            raise
        except BaseException as exc:  # noqa: BLE001 - outside the model: the engine's own books failed
            if out is not None and not handed_over:  # scheduled, never launched
                self._give_up(out)
            if not isinstance(exc, Exception):
                raise
            logger.exception("engine step failed outside the model run; failing every request")
            self.in_flight = None
            outputs += self.live.deliver(self._fail_all(exc))
            return StepResult(outputs, None, 0, 0, 0, started)
        outputs += self.live.deliver(made)
        if self.in_flight is None and not self.scheduler.has_unfinished():
            self._forget_finished()
        if out is None:  # only the step in flight was read
            return StepResult(outputs, None, 0, 0, num_sampled, started)
        self.num_steps += 1
        self.step_tokens["decode"] += out.num_decodes
        self.step_tokens["prompt"] += out.num_prompt_tokens
        self.step_tokens["mixed_steps"] += int(out.num_prompt_tokens > 0 and out.num_decodes > 0)
        self.step_tokens["draft"] += out.num_draft_tokens
        if self.drafter is not None:
            before, self._graphs_loaded = self._graphs_loaded, self._count_graphs_loaded()
            # A step that loaded or compiled a graph (the engine's or the draft model's) timed
            # that, not drafting: it would make drafts look dear (or cheap) for many steps.
            # Only steps launched and read within this call time one step, as a verify step
            # always is: one left in flight timed none of its device work, one read after a step
            # in flight timed that step's too.
            alone = not after_a_step_in_flight and self.in_flight is None
            if out.num_prompt_tokens == 0 and before == self._graphs_loaded and alone:
                self.drafter.observe_step(out.num_decodes, out.num_draft_tokens, now() - started)
        return StepResult(outputs, out.is_prefill, len(out.seqs), out.num_tokens, num_sampled, started, out.num_decodes,
                          out.num_draft_tokens)

    def _forget_finished(self) -> None:
        """The engine went idle: the finished sequences' rows leave the runner (and their sampling
        state the sampler) now, not at a next step that may not come for a long time. Their
        outputs are delivered already; should the runner fail here, it trusts no row instead."""
        try:
            self.runner.forget(*self.scheduler.pop_facts())
        except Exception:  # noqa: BLE001 - nothing runs now: no request to fail for it
            logger.exception("forgetting finished sequences failed; the runner will rewrite every row")
            self.runner.recover(None)

    def _count_graphs_loaded(self) -> int:
        """Compiled CPU graphs the engine's runner and the draft model's have loaded so far."""
        runners = [self.runner]
        if self.drafter is not None and self.drafter.model is not None:
            runners.append(self.drafter.model.runner)
        compiled = [getattr(r, "compiled_decode", None) for r in runners]
        return sum(len(c.first_call_seconds) for c in compiled if c is not None)

    def _give_up(self, out: SchedulerOutput) -> None:
        """A scheduled step will not be launched (an interrupt, a failure before the launch): it
        and the step in flight are given up, and the runner trusts none of its per-sequence rows
        (the step's block appends and facts never reach it)."""
        self._abandon(self.in_flight)
        self.in_flight = None
        self.scheduler.abandon(out)
        self.runner.recover(out)

    def _abandon(self, *steps: InFlightStep | None) -> None:
        """Give up launched steps whose results the scheduler has not taken (nothing of them is
        applied; see `Scheduler.abandon`)."""
        for step in steps:
            if step is not None and not step.settled:
                self.scheduler.abandon(step.out)
                step.settled = True

    def _advance(self, out: SchedulerOutput | None, started: float, delivered: list[RequestOutput]
                 ) -> tuple[list[RequestOutput], int]:
        """Launch `out` (if any), then read the step in flight before it, then `out` itself
        unless it may stay in flight; the outputs made (not yet delivered) and the tokens read.

        Whatever escapes (an interrupt, an error in the engine's own books): the outputs already
        made are delivered (and added to `delivered`), and no launched or scheduled step is left
        that nobody will read or settle."""
        previous, self.in_flight = self.in_flight, None
        current, made = None, []
        unlaunched = out  # scheduled, its counts taken up, neither launched nor given up yet
        try:
            if out is not None:
                states = self.live.of((*out.seqs, *out.forked_seqs))
                try:
                    current = InFlightStep(out, self.runner.launch(out), states, started)
                    unlaunched = None
                except BaseException as exc:
                    self.scheduler.abandon(out)
                    unlaunched = None
                    if previous is not None:  # its tokens are on their way, whatever failed here
                        made += self._finish(previous)[0]
                        previous = None
                    self.runner.recover(out)
                    # KeyboardInterrupt and friends are the caller's; a dead engine has nothing to retry on.
                    if not isinstance(exc, Exception) or isinstance(exc, EngineDeadError):
                        raise
                    return made + self._on_failed_run(out, states, exc), 0
                # Host work that needs no token runs while the device computes the step. (Decodes
                # come first and were scheduled before: their prompts were computed.)
                for state in states[out.num_decodes:]:
                    state.on_scheduled(started)
            num_sampled = 0
            if previous is not None:
                more, num_sampled = self._finish(previous, also_lost=current)
                made += more
                if current is not None and current.settled:  # lost with the step before it
                    current = None
            if current is not None:
                if self._may_stay_in_flight(current.out):
                    self.in_flight = current
                else:
                    more, n = self._finish(current)
                    made += more
                    num_sampled += n
            return made, num_sampled
        except BaseException as exc:
            if not isinstance(exc, EngineDeadError):
                self.in_flight = None
                self._abandon(previous, current)
                if unlaunched is not None:
                    self.scheduler.abandon(unlaunched)
                self.runner.recover(unlaunched)
                delivered += self.live.deliver(made)
            raise

    def _may_stay_in_flight(self, out: SchedulerOutput) -> bool:
        """Whether a launched step's tokens may be read after the next step is launched: with
        overlap scheduling, unless the step verifies drafts or follows a grammar (the next step
        needs its tokens on the host either way) or one of its sequences could draft next."""
        if not self.overlap or out.draft_tokens or out.grammar is not None:
            return False
        if self.drafter is None:
            return True
        sampling = [seq for i, seq in enumerate(out.seqs) if out.samples(i)]  # the next step's decodes
        return not self.drafter.may_draft(sampling, len(sampling))

    def _finish(self, step: InFlightStep, also_lost: InFlightStep | None = None) -> tuple[list[RequestOutput], int]:
        """Read a launched step's tokens and post-process them; its requests' outputs (not yet
        delivered) and the number of tokens its sequences grew by. also_lost: the step launched
        after it, whose inputs came from its tokens: if reading them fails, that one is lost too
        (marked settled)."""
        try:
            result = self.runner.collect(step.launched)
        except BaseException as exc:
            lost = [step] if also_lost is None else [step, also_lost]
            self._abandon(*lost)
            self.runner.recover(step.out)
            if not isinstance(exc, Exception) or isinstance(exc, EngineDeadError):
                raise
            states = [state for failed in lost for state in failed.states]
            return self._on_failed_run(step.out, list(dict.fromkeys(states)), exc), 0
        return self._postprocess(step, result)

    def _postprocess(self, step: InFlightStep, result) -> tuple[list[RequestOutput], int]:
        """Apply a step's tokens to its sequences and requests: stop checks, drafts' counters,
        logprobs, grammars, text; the outputs made and the tokens the sequences grew by. A
        sequence finished since the step was launched (overlap scheduling) drops its token."""
        out, states = step.out, step.states
        sampled = result.sampled
        finished = SequenceStatus.FINISHED
        live = [state.seq.status is not finished for state in states]
        drafts = result.num_accepted is not None
        lengths = [len(state.seq) for state in states] if drafts else None
        step.settled = True  # before: whatever happens inside, it must not be given up as well
        self.scheduler.postprocess(out, sampled, result.num_accepted)
        grown = 0
        self.live.take_logprobs(states, result, live)
        t = now()
        outputs = []
        grammars = self.structured.has_matchers
        for state, token, alive in zip(states, sampled, live):
            if token is None or not alive:
                continue
            if not drafts:
                grown += 1
            if grammars:
                verdict = self.structured.accept(state.seq, token)
                if verdict is Verdict.REJECTED:
                    outputs.append(self.live.finish_now(state, FinishReason.ERROR, f"token {token} breaks the "
                                                        "request's structured_outputs grammar"))
                    continue
                if verdict is Verdict.COMPLETE and not state.seq.is_finished:
                    self.scheduler.finish(state.seq, FinishReason.STOP)
                elif verdict is Verdict.COMPLETE and state.seq.finish_reason is FinishReason.LENGTH:
                    # The last allowed token completed the grammar (EOS under ignore_eos): the
                    # output is whole, as a stop string completed by that token is.
                    state.seq.finish_reason = FinishReason.STOP
            if state.quiet and state.seq.status is not finished:
                state.note_token(t)
                continue
            try:
                output = self.live.advance(state, t)
            except Exception as exc:  # noqa: BLE001 - this request's text or stop strings: its own failure
                logger.exception("post-processing request %r failed", state.request_id)
                output = self.live.finish_now(state, FinishReason.ERROR, _describe(exc))
            if output is not None:
                outputs.append(output)
        if drafts:
            # Tokens the step added: a sequence that ended inside its kept drafts (at a stop
            # token, or a stop string its text matched just now) dropped the rest.
            per_seq = [len(state.seq) - n for state, n in zip(states, lengths)]
            self._record_drafts(out, states, result.num_accepted, per_seq)
            grown = sum(per_seq)
        return outputs, grown

    def _record_drafts(self, out: SchedulerOutput, states: list[RequestState], num_accepted: list[int],
                       grown: list[int]) -> None:
        """Speculative decoding's counters: the drafter's (what the samples accepted: its rate),
        each request's metrics and the engine's (the drafted tokens the output kept: fewer where
        the sequence ended inside them)."""
        for i, draft in enumerate(out.draft_tokens):
            if not draft:
                continue
            self.drafter.record(out.seqs[i], len(draft), num_accepted[i])
            accepted = min(num_accepted[i], grown[i])
            m = states[i].metrics
            m.num_draft_tokens += len(draft)
            m.num_accepted_draft_tokens += accepted
            for counts in (m.accepted_per_position, self.accepted_per_position):
                if len(counts) < len(draft):
                    counts += [0] * (len(draft) - len(counts))
                for position in range(accepted):
                    counts[position] += 1
            self.step_tokens["accepted"] += accepted

    def _on_failed_run(self, out: SchedulerOutput, states: list[RequestState], exc: Exception) -> list[RequestOutput]:
        """A step failed in the model or the sampler: it is one request's failure when that request
        ran alone; otherwise the batch is retried one sequence at a time. `states`: every sequence
        of the failed step (and of the step lost with it), also those that finished since (an
        abort): a survivor of a shared step is no culprit until it fails alone."""
        alive = [state for state in states if not state.seq.is_finished]
        if not alive:
            return []
        if len(states) == 1:
            logger.warning("step of request %r failed: %s", alive[0].request_id, _describe(exc))
            return [self.live.finish_now(alive[0], FinishReason.ERROR, _describe(exc))]
        logger.warning("step of %d sequences failed (%s); retrying the %d unfinished one at a time", len(states),
                       _describe(exc), len(alive))
        self.scheduler.isolate([state.seq for state in alive])
        return []

    def _fail_all(self, exc: Exception) -> list[RequestOutput]:
        """Nothing can be attributed: every request ends with "error"; the engine stays usable."""
        self.runner.recover(None)
        outputs = []
        for state in list(self.requests.values()):
            try:
                outputs.append(self.live.finish_now(state, FinishReason.ERROR, _describe(exc)))
            except Exception:  # noqa: BLE001 - the books themselves are broken: drop it without them
                self.scheduler.drop(state.seq)
                self.live.forget(state)
        return outputs


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
