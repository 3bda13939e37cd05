"""What a request must be before it is queued: its id, and its prompt's token ids checked
against the model (vocabulary, max_model_len) and its own sampling settings; `RequestFactory`
makes the prepared request the engine queues."""

from __future__ import annotations

import itertools
from collections.abc import Callable

from fastgen.checks import boolean
from fastgen.config import EngineConfig
from fastgen.engine.logprob_dicts import TokenTexts
from fastgen.engine.parallel_sampling import ChildId, ParentRequest, child_params
from fastgen.engine.prompts import Prompt, encode_text, tokenized_prompt
from fastgen.engine.request_state import RequestState, now
from fastgen.sampling_params import SamplingParams
from fastgen.sequence import Sequence
from fastgen.structured_outputs_params import StructuredOutputsParams


class EngineOverloaded(RuntimeError):
    """The engine refused a request because max_waiting_requests requests already wait; retry
    later (the server answers HTTP 503 with Retry-After)."""


def check_request_id(request_id: object) -> str:
    """Request ids are non-empty strings (an int 5 and the string "5" must never be two names
    for one request); ValueError for anything else."""
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id={request_id!r} must be a non-empty string, got {type(request_id).__name__}")
    return request_id


def prompt_token_ids(prompt: Prompt, params: SamplingParams, tokenizer,
                     config: EngineConfig) -> tuple[str | None, list[int]]:
    """The prompt's text (None for token ids) and token ids; ValueError naming what is wrong."""
    if isinstance(prompt, str) and tokenizer is None:
        raise ValueError("prompt is a string but the engine was started with skip_tokenizer_init=True")
    # Text ("" too: a tokenizer that adds BOS makes it a prompt) or ids, unless a caller's thread
    # made it ready already; ints either way (their range is checked below).
    ready = tokenized_prompt(tokenizer, prompt, config.max_model_len)
    text, token_ids = ready.text, list(ready.token_ids)
    if not token_ids:
        raise ValueError(f"prompt={token_ids if text is None else text!r} is empty: a request needs at least 1 token")
    if params.stop and tokenizer is None:  # stop strings are looked for in the text
        raise ValueError(f"stop={params.stop!r} needs the text, but the engine was started with "
                         "skip_tokenizer_init=True (use stop_token_ids)")
    vocab = config.model_config.vocab_size
    for t in params.stop_token_ids:
        if t >= vocab:
            raise ValueError(f"stop_token_ids holds {t}, outside the vocabulary [0, {vocab})")
    for t in params.logit_bias or ():
        if t >= vocab:
            raise ValueError(f"logit_bias names token {t}, outside the vocabulary [0, {vocab})")
    if token_ids and not (min(token_ids) >= 0 and max(token_ids) < vocab):  # (at C speed; then which one)
        i, t = next((i, t) for i, t in enumerate(token_ids) if not 0 <= t < vocab)
        raise ValueError(f"prompt token_ids[{i}]={t!r} is outside the vocabulary [0, {vocab})")
    total = len(token_ids) + params.max_tokens
    if total > config.max_model_len:
        raise ValueError(
            f"prompt length {len(token_ids)} + max_tokens {params.max_tokens} = {total} "
            f"exceeds max_model_len={config.max_model_len}"
        )
    return text, token_ids


class RequestFactory:
    """Turns a caller's prompt and settings into a prepared, not yet queued, request: one
    `RequestState`, or for n > 1 a `ParentRequest` of n children. Owns the counters of fresh
    request and sequence ids."""

    def __init__(self, config: EngineConfig, tokenizer, compile_grammar: Callable[[StructuredOutputsParams], object]):
        """compile_grammar: compiles (or finds cached) a request's structured-output grammar,
        which the request then holds (`RequestState.grammar`); ValueError when it cannot."""
        self.config = config
        self.tokenizer = tokenizer
        self.compile_grammar = compile_grammar
        self.token_texts = TokenTexts(tokenizer)  # shared: decoded logprob tokens are cached once
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()

    def make(self, prompt: Prompt, params: SamplingParams, request_id: str | None, final_only: bool,
             in_use: Callable[[str], bool]) -> RequestState | ParentRequest:
        """ValueError naming the field for bad input. request_id None: a fresh one, skipping ids
        `in_use` (a caller may have chosen them for requests of its own)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params = params.validated_copy()
        final_only = boolean("final_only", final_only)
        text, token_ids = prompt_token_ids(prompt, params, self.tokenizer, self.config)
        params.check_logprobs_limit(min(self.config.max_logprobs, self.config.model_config.vocab_size))
        grammar = None if params.structured_outputs is None else self.compile_grammar(params.structured_outputs)
        prediction = self._prediction_token_ids(params)
        if request_id is None:
            request_id = next(i for i in map(str, self._request_ids) if not in_use(i))
        elif in_use(check_request_id(request_id)):
            raise ValueError(f"request_id={request_id!r} is already in use (queued, running, or finished with its "
                             "final output not yet returned by step())")
        if params.n == 1:
            return self._state(request_id, token_ids, params, text, now(), final_only, grammar, prediction)
        arrival = now()
        children = [self._state(ChildId(request_id, i), list(token_ids), child_params(params, i), text, arrival,
                                final_only, grammar, prediction) for i in range(params.n)]
        return ParentRequest(request_id, children, final_only)

    def _prediction_token_ids(self, params: SamplingParams) -> list[int] | None:
        """The request's predicted output as token ids (None without one, or without speculative
        decoding, which is all it is for); ValueError for ids outside the vocabulary."""
        if params.prediction is None or self.config.speculative_config is None:
            return None
        if isinstance(params.prediction, str):
            if self.tokenizer is None:
                raise ValueError("prediction is a string but the engine was started with skip_tokenizer_init=True")
            return encode_text(self.tokenizer, params.prediction, "prediction", add_special_tokens=False)
        vocab = self.config.model_config.vocab_size
        for i, t in enumerate(params.prediction):
            if t >= vocab:
                raise ValueError(f"prediction[{i}]={t} is outside the vocabulary [0, {vocab})")
        return list(params.prediction)

    def _state(self, request_id: str | ChildId, token_ids: list[int], params: SamplingParams, text: str | None,
               arrival: float, final_only: bool, grammar, prediction: list[int] | None = None) -> RequestState:
        seq = Sequence(next(self._seq_ids), token_ids, params)
        state = RequestState(request_id, seq, text, self.tokenizer, arrival, final_only=final_only,
                             token_texts=self.token_texts)
        state.grammar = grammar
        state.prediction_token_ids = prediction
        return state
