"""The engine's side of structured outputs: compiled grammars, one matcher per sequence, the
step's token masks, and the sampled tokens fed back.

Life of a constrained request: `compile` when it is added (a bad spec is a ValueError before it
is queued; a spec seen before is a cache hit; the request keeps its grammar), `step_bitmask`
each step it samples in (its
matcher is made on its first sampled token, so forked children of an n > 1 request get their
own), `accept` with each token it receives, `release` when it ends. Preemption changes nothing
here: a preempted sequence keeps its tokens, so its matcher stays where it was.

Compiling may run on any thread (a server compiles in a worker thread, so a slow schema never
holds the engine's loop); the matchers belong to the thread that drives the engine.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from fastgen.scheduler_output import GrammarBitmask, SchedulerOutput
from fastgen.sequence import Sequence
from fastgen.structured.backend import CompiledGrammar, GrammarBackend, GrammarMatcher
from fastgen.structured_outputs_params import StructuredOutputsParams

CACHE_SIZE = 256  # distinct specs whose compiled grammars are kept


class Verdict(enum.Enum):
    CONTINUE = "continue"  # the token was allowed; the grammar goes on
    COMPLETE = "complete"  # the token ended the grammar: the output is complete
    REJECTED = "rejected"  # the grammar does not allow the token (a bug, or a conflicting setting)


@dataclass
class GrammarStats:
    compiles: int = 0
    cache_hits: int = 0
    compile_seconds: float = 0.0  # total spent compiling


class StructuredOutputManager:
    """backend_factory: builds the backend on the first structured request (the library's import
    and the vocabulary's scan are paid only by engines that use it)."""

    def __init__(self, backend_factory: Callable[[], GrammarBackend] | None):
        self._backend_factory = backend_factory
        self._backend: GrammarBackend | None = None
        self._grammars: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()  # compiles may come from several threads
        self._backend_lock = threading.Lock()  # built once, whichever thread asks first
        self._compiling: dict[tuple[str, str], Future] = {}  # specs being compiled, by key
        self._matchers: dict[int, GrammarMatcher] = {}
        self.stats = GrammarStats()

    @property
    def backend(self) -> GrammarBackend:
        with self._backend_lock:
            return self._make_backend()

    def _make_backend(self) -> GrammarBackend:
        if self._backend is None:
            if self._backend_factory is None:
                raise ValueError("structured_outputs needs the model's tokenizer; this engine was started with "
                                 "skip_tokenizer_init=True")
            self._backend = self._backend_factory()
        return self._backend

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """The spec's compiled grammar, from the cache when seen before; ValueError when it
        cannot be compiled. The lock covers the cache only: one thread compiling a slow schema
        holds back no other thread (a second request for the same spec waits for that compile)."""
        key = spec.key
        with self._lock:
            grammar = self._grammars.get(key)
            if grammar is not None:
                self._grammars.move_to_end(key)
                self.stats.cache_hits += 1
                return grammar
            pending = self._compiling.get(key)
            owner = pending is None
            if owner:
                pending = self._compiling[key] = Future()
        if not owner:
            return pending.result()  # the other thread's grammar, or its ValueError
        try:
            started = time.perf_counter()
            grammar = self.backend.compile(spec)
            seconds = time.perf_counter() - started
        except BaseException as exc:
            with self._lock:
                del self._compiling[key]
            pending.set_exception(exc)
            raise
        with self._lock:
            self.stats.compile_seconds += seconds
            self.stats.compiles += 1
            self._grammars[key] = grammar
            while len(self._grammars) > CACHE_SIZE:
                self._grammars.popitem(last=False)
            del self._compiling[key]
        pending.set_result(grammar)
        return grammar

    def step_bitmask(self, out: SchedulerOutput, grammar_of: Callable[[Sequence], CompiledGrammar]
                     ) -> GrammarBitmask | None:
        """The masks of the step's sampling sequences that follow a grammar (None when none does).
        grammar_of(seq): the grammar compiled when the sequence's request was added (held by the
        request, so an evicted cache entry never means a compile here)."""
        seqs = [seq for seq in out.sampling_seqs if seq.params.structured_outputs is not None]
        if not seqs:
            return None
        matchers = [self._matcher(seq, grammar_of) for seq in seqs]
        backend = self.backend

        def fill():
            bitmask = backend.allocate_bitmask(len(matchers))
            for row, matcher in enumerate(matchers):
                matcher.fill_bitmask(bitmask, row)
            return bitmask

        return GrammarBitmask(tuple(seq.seq_id for seq in seqs), fill)

    def _matcher(self, seq: Sequence, grammar_of: Callable[[Sequence], CompiledGrammar]) -> GrammarMatcher:
        matcher = self._matchers.get(seq.seq_id)
        if matcher is None:
            matcher = grammar_of(seq).matcher()
            for token in seq.output_token_ids:  # none, unless the sequence sampled before (a fork's parent)
                matcher.accept(token)
            self._matchers[seq.seq_id] = matcher
        return matcher

    def accept(self, seq: Sequence, token: int) -> Verdict | None:
        """Feed a sampled token to the sequence's matcher (None: it follows no grammar)."""
        matcher = self._matchers.get(seq.seq_id)
        if matcher is None:
            return None
        if not matcher.accept(token):
            return Verdict.REJECTED
        return Verdict.COMPLETE if matcher.is_terminated() else Verdict.CONTINUE

    @property
    def has_matchers(self) -> bool:
        """Whether any sequence follows a grammar now (else `accept` has nothing to do)."""
        return bool(self._matchers)

    def release(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            self._matchers.pop(seq_id, None)

    @property
    def num_matchers(self) -> int:
        return len(self._matchers)
