"""LLMEngine: the request loop an application or a server drives.

    add_request(prompt, params) -> request_id     validate, tokenize, queue
    step() -> [RequestOutput]                     schedule, run the model, post-process
    abort(request_id)                             finish now, free its blocks
    has_unfinished_requests()

A request with n > 1 completions is n sequences inside, one child request each, forked from the
first once its prompt is computed; step() folds their outputs into one (`parallel_sampling`).

An engine is not thread-safe: one thread drives it (see `fastgen.engine.background` for a wrapper that
lets many threads submit and stream while one loop runs).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

from fastgen.config import EngineConfig
from fastgen.engine.block_manager import BlockManager
from fastgen.engine.logprobs import TokenTexts
from fastgen.engine.parallel_sampling import ChildId, ParentRequest, child_params, merge_outputs
from fastgen.engine.prompts import Prompt, token_ids_of
from fastgen.engine.request_state import RequestState, now
from fastgen.engine.scheduler import Scheduler
from fastgen.engine.sequence import FinishReason, Sequence
from fastgen.engine.tokenizer import eos_token_ids, load_tokenizer
from fastgen.outputs import RequestOutput
from fastgen.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepResult:
    """What one `run_step` did. outputs: one per request that progressed. is_prefill: the kind of
    step (None when there was nothing to run). num_seqs / num_tokens: the batch it computed.
    num_sampled: output tokens it produced. started_at: perf_counter time the step began."""

    outputs: list[RequestOutput]
    is_prefill: bool | None
    num_seqs: int
    num_tokens: int
    num_sampled: int
    started_at: float


class LLMEngine:
    def __init__(self, config: EngineConfig, load_format: str = "safetensors", skip_tokenizer_init: bool = False):
        """skip_tokenizer_init: serve token-id prompts only and return no text (for benchmarks
        on dummy weights, whose folders hold only a config.json)."""
        self.config = config
        from fastgen.worker.model_runner import ModelRunner  # torch and the model: not for `import fastgen`

        self.tokenizer = None if skip_tokenizer_init else load_tokenizer(config.model)
        eos = eos_token_ids(config.model, config.model_config, self.tokenizer)
        self.runner = ModelRunner(config, load_format=load_format, eos_token_ids=eos)
        self.block_manager = BlockManager(
            self.runner.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_model_len,
            eos,
        )
        self.requests: dict[str | ChildId, RequestState] = {}
        self._by_seq: dict[int, RequestState] = {}
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self.num_steps = 0
        self.parents: dict[str, ParentRequest] = {}  # requests with n > 1, by id (their children are in `requests`)
        self.token_texts = TokenTexts(self.tokenizer)

    # ---- requests in -----------------------------------------------------------------------
    def prepare(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
                final_only: bool = False) -> RequestState:
        """Validate and tokenize a request without queueing it (raises ValueError).

        final_only: step() reports this request once, when it finishes, instead of every step.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is a string but the engine was started with skip_tokenizer_init=True")
            text = prompt
            token_ids = self.tokenizer.encode(prompt) if prompt else []
        else:
            text = None
            token_ids = token_ids_of(prompt)
        if not token_ids:
            raise ValueError(f"prompt={prompt!r} is empty: a request needs at least 1 token")
        vocab = self.config.model_config.vocab_size
        for t in params.stop_token_ids:
            if t >= vocab:
                raise ValueError(f"stop_token_ids holds {t}, outside the vocabulary [0, {vocab})")
        for i, t in enumerate(token_ids):
            if not 0 <= t < vocab:
                raise ValueError(f"prompt token_ids[{i}]={t!r} is outside the vocabulary [0, {vocab})")
        total = len(token_ids) + params.max_tokens
        if total > self.config.max_model_len:
            raise ValueError(
                f"prompt length {len(token_ids)} + max_tokens {params.max_tokens} = {total} "
                f"exceeds max_model_len={self.config.max_model_len}"
            )
        params.check_logprobs_limit(min(self.config.max_logprobs, vocab))
        if request_id is None:
            request_id = str(next(self._request_ids))
            while self._in_use(request_id):  # a caller chose this id for a request of its own
                request_id = str(next(self._request_ids))
        elif self._in_use(request_id):
            raise ValueError(f"request_id={request_id!r} is already in use")
        if params.n > 1:
            return self._prepare_parent(request_id, text, token_ids, params, final_only)
        seq = Sequence(next(self._seq_ids), token_ids, params)
        return RequestState(request_id, seq, text, self.tokenizer, now(), final_only=final_only,
                            token_texts=self.token_texts)

    def _prepare_parent(self, request_id: str, text: str | None, token_ids: list[int], params: SamplingParams,
                        final_only: bool) -> ParentRequest:
        arrival = now()
        children = [
            RequestState(ChildId(request_id, i), Sequence(next(self._seq_ids), list(token_ids), child_params(params, i)),
                         text, self.tokenizer, arrival, final_only=final_only, token_texts=self.token_texts)
            for i in range(params.n)
        ]
        return ParentRequest(request_id, children, final_only)

    def _in_use(self, request_id) -> bool:
        return request_id in self.requests or request_id in self.parents

    def _enqueue_parent(self, parent: ParentRequest) -> str:
        """Queue the first child; the others wait to fork from it once its prompt is computed."""
        if self._in_use(parent.request_id):
            raise ValueError(f"request_id={parent.request_id!r} is already in use")
        self.parents[parent.request_id] = parent
        for child in parent.children:
            self.requests[child.request_id] = child
            self._by_seq[child.seq.seq_id] = child
        first, *others = parent.children
        self.scheduler.add(first.seq)
        self.scheduler.add_forks(first.seq, [child.seq for child in others])
        return parent.request_id

    def enqueue(self, state: RequestState | ParentRequest) -> str:
        if isinstance(state, ParentRequest):
            return self._enqueue_parent(state)
        if state.request_id in self.requests:
            raise ValueError(f"request_id={state.request_id!r} is already in use")
        self.requests[state.request_id] = state
        self._by_seq[state.seq.seq_id] = state
        self.scheduler.add(state.seq)
        return state.request_id

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a request; return its id. Raises ValueError for bad input, queueing nothing."""
        return self.enqueue(self.prepare(prompt, params or SamplingParams(), request_id))

    def abort(self, request_id: str) -> bool:
        """Finish a request (every completion of an n > 1 one) now and free its blocks; False if
        it is unknown or already done."""
        parent = self.parents.pop(request_id, None)
        if parent is not None:  # the waiting children first, so none is left to start on its own
            return any([self.abort(child.request_id) for child in reversed(parent.children)])
        state = self.requests.get(request_id)
        if state is None or state.seq.is_finished:
            return False
        self.scheduler.finish(state.seq, FinishReason.ABORT)
        self._forget(state)
        return True

    def _forget(self, state: RequestState) -> None:
        del self.requests[state.request_id]
        del self._by_seq[state.seq.seq_id]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def check_invariants(self) -> None:
        """Assert the block manager's books balance against the running sequences."""
        self.block_manager.check_invariants(self.scheduler.running)

    # ---- one step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return an output for each request that progressed."""
        return self.run_step().outputs

    def run_step(self) -> StepResult:
        """`step`, reporting what kind of step ran and how large it was."""
        started = now()
        out = self.scheduler.schedule()
        if out is None:
            return StepResult([], None, 0, 0, 0, started)
        launched = self.runner.launch(out)
        # Host work that needs no token runs while the GPU computes the step.
        states = [self._by_seq[seq.seq_id] for seq in (*out.seqs, *out.forked_seqs)]
        for state in states:
            state.on_scheduled(started)
        result = self.runner.collect(launched)
        sampled = result.sampled
        self.scheduler.postprocess(out, sampled)
        self._take_logprobs(states, result)
        self.num_steps += 1
        t = now()
        outputs = []
        for state, token in zip(states, sampled):
            if token is None:
                continue
            if state.on_new_tokens(t) and not state.seq.is_finished:
                self.scheduler.finish(state.seq, FinishReason.STOP)
            output = state.make_output(t)
            if output is not None:
                outputs.append(output)
            if state.seq.is_finished:
                self._forget(state)
        if self.parents:
            outputs = merge_outputs(outputs, self.parents)
        num_sampled = sum(token is not None for token in sampled)
        return StepResult(outputs, out.is_prefill, len(out.seqs), out.num_tokens, num_sampled, started)

    def _take_logprobs(self, states: list[RequestState], result) -> None:
        """Hand the step's logprobs (a ModelRunnerOutput's) to their requests."""
        if result.logprobs is not None:
            for state, top in zip(states, result.logprobs):
                if top is not None:
                    state.add_logprobs(top)
        for seq_id, (start, tops) in result.prompt_logprobs.items():
            self._by_seq[seq_id].add_prompt_logprobs(start, tops)
