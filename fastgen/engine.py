"""LLMEngine: the request loop an application or a server drives.

    add_request(prompt, params) -> request_id     validate, tokenize, queue
    step() -> [RequestOutput]                     schedule, run the model, post-process
    abort(request_id)                             finish now, free its blocks
    has_unfinished_requests()

An engine is not thread-safe: one thread drives it (see `fastgen.background` for a wrapper that
lets many threads submit and stream while one loop runs).
"""

from __future__ import annotations

import itertools
import json
import logging
import numbers
from collections.abc import Sequence as SequenceABC
from pathlib import Path

import numpy as np

from transformers import AutoTokenizer

from fastgen.block_manager import BlockManager
from fastgen.config import EngineConfig
from fastgen.model_runner import ModelRunner
from fastgen.outputs import RequestOutput
from fastgen.request import RequestState, now
from fastgen.sampling_params import SamplingParams
from fastgen.scheduler import Scheduler, SchedulerOutput
from fastgen.sequence import FinishReason, Sequence

logger = logging.getLogger(__name__)

Prompt = str | list[int]


def is_token_ids(prompt: object) -> bool:
    """Whether a prompt is one request's token ids: a list, tuple or 1-D array of integers."""
    if isinstance(prompt, np.ndarray):
        return prompt.ndim == 1 and np.issubdtype(prompt.dtype, np.integer)
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0 and isinstance(prompt[0], numbers.Integral)
            and not isinstance(prompt[0], bool))


def token_ids_of(prompt: object) -> list[int]:
    """A non-string prompt as a list of ints; ValueError naming the type for anything else."""
    if isinstance(prompt, np.ndarray) and prompt.ndim != 1:
        raise ValueError(f"prompt must be a string or a 1-D sequence of token ids, got an array of shape {prompt.shape}")
    if not isinstance(prompt, (SequenceABC, np.ndarray)) or isinstance(prompt, (bytes, bytearray)):
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    token_ids = []
    for i, t in enumerate(prompt):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise ValueError(f"prompt token_ids[{i}]={t!r} must be an integer, got {type(t).__name__}")
        token_ids.append(int(t))
    return token_ids


# Files that carry a vocabulary; without one, transformers 5 silently builds an empty tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model: str):
    if not any((Path(model) / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(
            f"model={model!r}: could not load its tokenizer (none of {list(_TOKENIZER_FILES)} found; "
            "pass skip_tokenizer_init=True to serve token ids only)"
        )
    try:
        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"model={model!r}: could not load its tokenizer ({exc})") from exc


def eos_token_ids(config: EngineConfig, tokenizer) -> set[int]:
    """The ids that end generation, as transformers' generate() reads them: generation_config's
    eos_token_id when the folder has one, else config.json's, else the tokenizer's."""
    gen_file = Path(config.model) / "generation_config.json"
    if gen_file.is_file():
        eos = json.loads(gen_file.read_text()).get("eos_token_id")
        if eos is not None:
            return set(eos) if isinstance(eos, list) else {eos}
    if config.model_config.eos_token_ids:
        return set(config.model_config.eos_token_ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    return {eos} if eos is not None else set()


class LLMEngine:
    def __init__(self, config: EngineConfig, load_format: str = "safetensors", skip_tokenizer_init: bool = False):
        """skip_tokenizer_init: serve token-id prompts only and return no text (for benchmarks
        on dummy weights, whose folders hold only a config.json)."""
        self.config = config
        self.tokenizer = None if skip_tokenizer_init else load_tokenizer(config.model)
        self.runner = ModelRunner(config, load_format=load_format)
        self.block_manager = BlockManager(
            self.runner.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_model_len,
            eos_token_ids(config, self.tokenizer),
        )
        self.requests: dict[str, RequestState] = {}
        self._by_seq: dict[int, RequestState] = {}
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self.num_steps = 0
        self.last_scheduler_output: SchedulerOutput | None = None  # the latest step's decision

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
        if request_id is None:
            request_id = str(next(self._request_ids))
            while request_id in self.requests:  # a caller chose this id for a request of its own
                request_id = str(next(self._request_ids))
        elif request_id in self.requests:
            raise ValueError(f"request_id={request_id!r} is already in use")
        seq = Sequence(next(self._seq_ids), token_ids, params)
        return RequestState(request_id, seq, text, self.tokenizer, now(), final_only=final_only)

    def enqueue(self, state: RequestState) -> str:
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
        """Finish a request now and free its blocks; False if it is unknown or already done."""
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
        out = self.scheduler.schedule()
        self.last_scheduler_output = out
        if out is None:
            return []
        t = now()
        states = [self._by_seq[seq.seq_id] for seq in out.seqs]
        for state in states:
            state.on_scheduled(t)
        sampled = self.runner.run(out)
        self.scheduler.postprocess(out, sampled)
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
        return outputs
