"""`fastgen serve`: the OpenAI-compatible HTTP server (see `fastgen.serve`)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from fastgen.cli import arg_types, engine_args

DESCRIPTION = """\
Serve a model over HTTP: OpenAI's /v1/completions, /v1/chat/completions (streaming with SSE;
structured outputs, tool calls, logit_bias, echo) and /v1/models, plus POST /generate + GET
/result/{seq_id}, POST /tokenize and /detokenize, /health and Prometheus /metrics. Without
--model the default model, SmolLM2-135M-Instruct, is served. SIGINT / SIGTERM stop admitting,
let in-flight requests finish for --shutdown-timeout seconds, abort the rest and exit 0. Before
--host 0.0.0.0, set an API key (--api-key or FASTGEN_API_KEY)."""

EPILOG = """\
examples:
  fastgen serve --port 8000
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
      -d '{"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}'
  fastgen serve --model ./Qwen3-0.6B --max-num-seqs 64 --max-waiting-requests 256
  FASTGEN_API_KEY=secret fastgen serve --host 0.0.0.0 --max-connections 256"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on")
    group.add_argument("--port", type=arg_types.int_at_least(0, below=65536), default=8000,
                       help="port to listen on (0: any free port)")
    group.add_argument("--served-model-name", metavar="NAME", default=None,
                       help="the model name requests use and /v1/models lists (default: the folder's name)")
    group.add_argument("--max-results", metavar="N", type=arg_types.positive_int, default=1024,
                       help="finished /generate results kept for GET /result")
    group.add_argument("--result-ttl", metavar="S", type=arg_types.non_negative_float, default=600.0,
                       help="seconds a finished /generate result is kept")
    group.add_argument("--retry-after", metavar="S", type=arg_types.positive_int, default=1,
                       help="Retry-After seconds of a 503 (beyond --max-waiting-requests)")
    group.add_argument("--shutdown-timeout", metavar="S", type=arg_types.non_negative_float, default=5.0,
                       help="seconds in-flight requests may finish after SIGINT / SIGTERM")
    door = parser.add_argument_group("access and limits")
    door.add_argument("--api-key", metavar="KEY", default=None,
                      help="require `Authorization: Bearer KEY` on every route but /health and /metrics "
                           "(default: $FASTGEN_API_KEY; unset: no key)")
    door.add_argument("--metrics-require-key", action="store_true", help="/metrics needs the key too")
    door.add_argument("--max-request-bytes", metavar="BYTES", type=arg_types.byte_size, default=32 << 20,
                      help="larger request bodies get 413 before they are parsed (e.g. 32MiB)")
    door.add_argument("--max-connections", metavar="N", type=arg_types.positive_int, default=1024,
                      help="beyond this many open connections, answer 503 at once")
    door.add_argument("--stream-idle-timeout", metavar="S", type=arg_types.positive_float, default=60.0,
                      help="abort a stream whose client has read nothing for S seconds")
    engine_args.add_engine_args(parser, max_model_len_default="the model's max_position_embeddings",
                                dummy_weights=False)


def run(args: argparse.Namespace) -> int:
    from fastgen.serve.app import ServerSettings, bind, serve

    choice = engine_args.resolve_model(args, args.parser, need_tokenizer=True)
    settings = ServerSettings(host=args.host, port=args.port, model_name=args.served_model_name,
                              max_results=args.max_results, result_ttl_s=args.result_ttl,
                              retry_after_s=args.retry_after, shutdown_timeout_s=args.shutdown_timeout,
                              api_key=args.api_key if args.api_key is not None else os.environ.get("FASTGEN_API_KEY"),
                              metrics_require_key=args.metrics_require_key, max_request_bytes=args.max_request_bytes,
                              max_connections=args.max_connections, stream_idle_timeout_s=args.stream_idle_timeout)
    # Bound before the model loads, so that a taken port fails at once and port 0 is resolved to
    # the port printed; held through the load, then handed back for uvicorn to bind its own
    # listener (one it creates itself: a socket passed in instead made some 413s reach the client
    # as a reset connection under load).
    sock = bind(settings)
    settings = dataclasses.replace(settings, port=sock.getsockname()[1])
    try:
        llm = engine_args.build_llm(choice, args, need_tokenizer=True)
        compiled = llm.engine.runner.compiled_decode
        background = getattr(compiled, "background", None)
        if compiled is not None and not (background is not None and background.running):
            # Load (or, in blocking mode, compile) the CPU step graphs now: otherwise the first
            # requests to need each would wait for it (a few seconds when saved, tens of seconds or more
            # without). While a background compile runs there is nothing to load yet: the server
            # answers at once, eagerly, and loads the graphs at the first step after the child has ended.
            from fastgen.bench.runner import warm_up

            print("fastgen: loading or compiling the CPU decode step", file=sys.stderr, flush=True)
            warm_up(llm.engine, llm.config.max_model_len)
        access = "an API key is required" if settings.api_key is not None else "no API key (anyone who can connect)"
        host = f"[{args.host}]" if ":" in args.host else args.host
        print(f"fastgen: serving {llm.config.model} on http://{host}:{settings.port}; {access}",
              file=sys.stderr, flush=True)
    finally:
        sock.close()
    serve(llm, settings)
    return 0
