"""The child process that compiles an engine's CPU step graphs into the cache while its parent
serves (`EngineConfig.compile_mode = "background"`, `fastgen.cpu.background_compile`).

    python -m fastgen.engine.compile_worker SPEC_JSON

SPEC_JSON: {"model": folder, "engine": {EngineConfig field: value}, "threads": n, and for a
blocking engine's helper "graphs": [names], "nice": false}. The child builds the same engine on
random weights (a graph depends on the weights' shapes, never their
values, and its cache key says so), compiling in this process (`compile_mode="blocking"`), and
runs requests that reach each graph: a prompt alone (the prefill graph, then the decode graph)
and two together, until every graph is saved. Each graph is saved to the cache as it is built;
the parent loads them once this process has ended. Exit status 0 when every
graph was built, 1 when one could not be (the child's log says why). A helper builds only
the graphs it was given (the others' steps run eagerly here) and keeps its priority: its engine
waits for it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time

from fastgen.config import EngineConfig
from fastgen.engine.llm_engine import LLMEngine
from fastgen.sampling_params import SamplingParams

logger = logging.getLogger("fastgen.compile_worker")

NICENESS = 10
PROMPT_TOKENS = 8  # enough tokens for the prefill graph (two or more a step)


def build_every_graph(engine: LLMEngine) -> set[str]:
    """Run requests that use every compiled graph; return the graphs that are not in the cache
    after (failed to build, or built but not saved: the parent finds only what is saved)."""
    vocab, max_model_len = engine.config.model_config.vocab_size, engine.config.max_model_len
    # Within the engine's max_model_len (a short one refused these requests, and no graph was
    # built): a prompt of two tokens or more for the prefill graph, and at least two tokens out
    # for the decode graph where the length allows.
    prompt_tokens = max(2, min(PROMPT_TOKENS, max_model_len - 2))
    # Distinct token ids, so no prompt is a prefix-cache hit (a hit's step runs eagerly).
    prompts = [[(100 * i + t) % vocab for t in range(prompt_tokens)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=max(1, min(3, max_model_len - prompt_tokens)),
                            ignore_eos=True)
    compiled = engine.runner.compiled_decode
    wanted = compiled.needed if compiled.only is None else compiled.only

    def missing() -> set[str]:
        return {name for name in wanted if not compiled.paths[name].exists()}

    # Ends as soon as every graph is saved: the parent loads them only once this process has
    # ended (`CompiledDecodeStep._ready_to_build`), and its steps leave this process a core
    # until then.
    for batch in (prompts[:1], prompts[1:]):
        for prompt in batch:
            engine.add_request(prompt, params)
        while engine.has_unfinished_requests() and missing():
            engine.step()
    return missing()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(argv[0])
    if spec.get("nice", True):
        # Below the parent, whose steps it competes with for the cores (`fastgen.cpu.background_compile`).
        os.nice(NICENESS)
    exit_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch

    # The thread count is part of every graph's key: the parent's, so the parent finds them.
    torch.set_num_threads(spec["threads"])
    engine_args = {**spec["engine"], "compile_mode": "blocking", "enforce_eager": False,
                   "enable_prefix_caching": False}
    config = EngineConfig(model=spec["model"], **engine_args)
    engine = LLMEngine(config, load_format="dummy", skip_tokenizer_init=True)
    if spec.get("graphs") is not None:
        engine.runner.compiled_decode.only = set(spec["graphs"])
    try:
        failed = build_every_graph(engine)
    finally:
        engine.shutdown()
    if failed:
        logger.error("the graphs %s are not in the cache", sorted(failed))
        return 1
    logger.info("every graph built")
    return 0


def exit_with_parent() -> None:
    """End this process when its parent is gone, however it went (a killed parent runs no exit
    handler to stop the child): a thread that watches the parent's pid."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(3)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
