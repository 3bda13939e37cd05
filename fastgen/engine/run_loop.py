"""The one run-to-completion loop: step the engine until given requests finish.

`LLM.generate` and both benchmarks run through it; what each needs per step (a progress bar,
per-step timings) comes in through `on_step`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from fastgen.engine.llm_engine import LLMEngine, StepResult
from fastgen.outputs import RequestOutput


def run_to_completion(engine: LLMEngine, request_ids: Iterable[str],
                      on_step: Callable[[StepResult], None] | None = None) -> dict[str, RequestOutput]:
    """Step `engine` until every request in `request_ids` has finished; return each one's final
    output. Other queued requests progress alongside. `on_step` sees every step's result.

    If anything raises (a failed step, KeyboardInterrupt), the requests still unfinished are
    aborted, so their blocks come back, and the exception propagates.
    """
    pending = set(request_ids)
    finished: dict[str, RequestOutput] = {}
    try:
        while pending:
            result = engine.run_step()
            if on_step is not None:
                on_step(result)
            for output in result.outputs:
                if output.finished and output.request_id in pending:
                    finished[output.request_id] = output
                    pending.discard(output.request_id)
            if pending and result.is_prefill is None and not engine.has_unfinished_requests():
                raise RuntimeError(f"requests {sorted(pending)} ended without a final output (aborted elsewhere?)")
    except BaseException:
        for request_id in pending:
            engine.abort(request_id)
        raise
    return finished
