"""The engine loop and everything it keeps per request: requests in (`llm_engine`), which
sequences run each step (`scheduler`, with `block_manager` owning the KV blocks), each request's
life outside the scheduler (`request_state`, `detokenizer`; its record is `fastgen.sequence`,
below the worker that reads it too), the one run-to-completion loop (`run_loop`) and a thread
that owns an engine (`background`)."""
