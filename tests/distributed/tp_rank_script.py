"""One rank of a two-host tensor-parallel engine, as an application would run it under torchrun:
`torchrun --nnodes 2 --node-rank R ... tp_rank_script.py MODEL MAX_TOKENS [IDLE_S]`. Rank 0 prints
READY, sits idle for IDLE_S seconds (0 unless given; the workers wait for a step meanwhile),
generates, then prints one RESULT line (JSON: the tokens, or the error and how long it took),
and exits 1 when the engine failed, as an application would (torchrun's agent then leaves at once
instead of waiting for the lost host's agent at its exit barrier). A rank that is still running
after HANG_S prints every thread's stack on its stderr and exits 1, so that the test reports
where it hung instead of waiting for it."""

import faulthandler
import json
import sys
import time

from fastgen import LLM, SamplingParams

PROMPTS = [[5, 9, 14, 2, 77], [31, 8, 120]]
HANG_S = 150


if __name__ == "__main__":
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    model, max_tokens = sys.argv[1], int(sys.argv[2])
    idle_s = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    llm = LLM(model, tensor_parallel_size=2, dtype="float32", block_size=8, max_model_len=1024, num_kv_blocks=512)
    print("READY", flush=True)  # ranks > 0 never get here: they serve as workers
    time.sleep(idle_s)
    started = time.monotonic()
    try:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        result = {"result": "finished", "tokens": [o.token_ids for o in outputs]}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result = {"result": type(exc).__name__, "message": str(exc)}
    result["seconds"] = time.monotonic() - started
    print("RESULT " + json.dumps(result), flush=True)
    sys.exit(0 if result["result"] == "finished" else 1)
