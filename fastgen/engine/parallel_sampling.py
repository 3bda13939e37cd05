"""Parallel sampling: one request (`n > 1`), n completions, reported as one RequestOutput.

Each completion is a sequence followed by its own `RequestState` (text, stop strings, logprobs,
metrics), registered in the engine under a `ChildId`, which no caller's request id can equal.
The first child computes the prompt and the others fork from it (`Scheduler.add_forks`).
`ParentRequest.merge` folds a step's child outputs into one RequestOutput whose `outputs` holds
every completion, as vLLM's ParentRequest does.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from fastgen.engine.request_state import RequestState
from fastgen.outputs import CompletionOutput, RequestMetrics, RequestOutput
from fastgen.sampling_params import SEED_LIMIT, SamplingParams


@dataclass(frozen=True)
class ChildId:
    """The engine-internal id of completion `index` of request `parent_id`."""

    parent_id: str
    index: int


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Completion `index`'s own settings: one completion; seed + index when seeded (vLLM's rule,
    so each completion is reproducible on its own); prompt logprobs on the first only (the
    prompt is computed once)."""
    seed = None if params.seed is None else (params.seed + index) % SEED_LIMIT
    return dataclasses.replace(params, n=1, seed=seed, prompt_logprobs=params.prompt_logprobs if index == 0 else None)


class ParentRequest:
    """The n child states of one request and the latest completion of each."""

    def __init__(self, request_id: str, children: list[RequestState], final_only: bool):
        self.request_id = request_id
        self.children = children
        self.final_only = final_only
        self.latest = [CompletionOutput(i, "", [], logprobs=None if child.logprobs is None else [])
                       for i, child in enumerate(children)]
        self.prompt_logprobs = None

    @property
    def finished(self) -> bool:
        return all(completion.finished for completion in self.latest)

    def merge(self, child_outputs: Seq[RequestOutput]) -> RequestOutput | None:
        """This step's outputs of the children, as one output of the request: every completion,
        with empty deltas for those that did not progress. None for a final-only request that
        has not finished every completion."""
        progressed = set()
        for output in child_outputs:
            index = output.request_id.index
            completion = dataclasses.replace(output.outputs[0], index=index)
            if index in progressed:
                # Two steps of this child read in one call (overlap scheduling reads the step in
                # flight and the one after it together): one output adds both steps' deltas.
                completion = _joined_deltas(self.latest[index], completion)
            self.latest[index] = completion
            progressed.add(index)
            if index == 0:
                self.prompt_logprobs = output.prompt_logprobs
        if self.final_only and not self.finished:
            return None
        # A final-only request's one output is every completion's first: each delta is all of it.
        completions = [c if i in progressed or self.final_only else _without_delta(c)
                       for i, c in enumerate(self.latest)]
        first, leader = completions[0], self.children[0]
        return RequestOutput(
            request_id=self.request_id,
            prompt=leader.prompt,
            prompt_token_ids=leader.prompt_token_ids,
            text=first.text,
            token_ids=first.token_ids,
            new_text=first.new_text,
            new_token_ids=first.new_token_ids,
            finished=self.finished,
            finish_reason=first.finish_reason,
            metrics=merged_metrics([child.metrics for child in self.children]),
            outputs=completions,
            prompt_logprobs=self.prompt_logprobs,
            error=next((output.error for output in child_outputs if output.error is not None), None),
        )


def merge_outputs(outputs: list[RequestOutput], parents: dict[str, ParentRequest]) -> list[RequestOutput]:
    """A step's outputs with each parent's child outputs folded into one output of the parent
    (at the place of its first child's); a parent whose completions have all finished leaves
    `parents`."""
    by_parent: dict[str, list[RequestOutput]] = {}
    order: list[RequestOutput | str] = []
    for output in outputs:
        if not isinstance(output.request_id, ChildId):
            order.append(output)
            continue
        parent_id = output.request_id.parent_id
        if parent_id not in by_parent:
            by_parent[parent_id] = []
            order.append(parent_id)
        by_parent[parent_id].append(output)
    merged = []
    for item in order:
        if isinstance(item, RequestOutput):
            merged.append(item)
            continue
        parent = parents[item]
        output = parent.merge(by_parent[item])
        if parent.finished:
            del parents[item]
        if output is not None:
            merged.append(output)
    return merged


def merged_metrics(metrics: list[RequestMetrics]) -> RequestMetrics:
    """One request's metrics over its completions: first token and first scheduling at the
    earliest, last token and finish at the latest (finish once all have), output tokens and
    speculative decoding's draft counts summed (per draft position too), cached prompt tokens as
    the first completion found them."""

    def times(name: str) -> list[float]:
        return [getattr(m, name) for m in metrics if getattr(m, name) is not None]

    finished = times("finished_time")
    return RequestMetrics(
        arrival_time=metrics[0].arrival_time,
        first_scheduled_time=min(times("first_scheduled_time"), default=None),
        first_token_time=min(times("first_token_time"), default=None),
        last_token_time=max(times("last_token_time"), default=None),
        finished_time=max(finished) if len(finished) == len(metrics) else None,
        num_output_tokens=sum(m.num_output_tokens for m in metrics),
        num_cached_tokens=metrics[0].num_cached_tokens,
        num_draft_tokens=sum(m.num_draft_tokens for m in metrics),
        num_accepted_draft_tokens=sum(m.num_accepted_draft_tokens for m in metrics),
        accepted_per_position=[sum(counts) for counts in itertools.zip_longest(
            *(m.accepted_per_position for m in metrics), fillvalue=0)],
    )


def _without_delta(completion: CompletionOutput) -> CompletionOutput:
    return dataclasses.replace(completion, new_text="", new_token_ids=[],
                               new_logprobs=None if completion.logprobs is None else [])


def _joined_deltas(earlier: CompletionOutput, later: CompletionOutput) -> CompletionOutput:
    """`later` (the child's state after its second output of a call) with the deltas of both."""
    new_logprobs = None if later.new_logprobs is None else (earlier.new_logprobs or []) + later.new_logprobs
    return dataclasses.replace(later, new_text=earlier.new_text + later.new_text,
                               new_token_ids=earlier.new_token_ids + later.new_token_ids,
                               new_logprobs=new_logprobs)
