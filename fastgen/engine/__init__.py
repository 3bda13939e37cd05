"""The engine loop and everything it keeps per request: requests in (`llm_engine`), which
sequences run each step (`scheduler`, with `block_manager` owning the KV blocks), each request's
record (`fastgen.sequence`, below the worker that reads it too) and its life outside the scheduler (`request_state`, `detokenizer`), the one
run-to-completion loop (`run_loop`) and a thread that owns an engine (`background`)."""
