"""A fastgen server on 127.0.0.1 on a free port, run in a thread of the test process (one per
test module), and the tiny chat model it serves."""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from contextlib import contextmanager

import pytest

# The GPU machine's python3 has none of the server stack, and `make gpu-test` says so
# (FASTGEN_NO_SERVER_STACK=1): there these tests skip rather than stop the collection of every
# other test. Anywhere else a missing package is a broken install, and the import fails loudly.
if os.environ.get("FASTGEN_NO_SERVER_STACK") == "1":
    for _package in ("fastapi", "uvicorn", "pydantic", "httpx"):
        pytest.importorskip(_package)

import httpx  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from fastgen import LLM  # noqa: E402
from fastgen.serve.app import Server, ServerSettings, build_app  # noqa: E402

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
ENGINE_ARGS = dict(dtype="float32", block_size=8, num_kv_blocks=512, max_model_len=256)
MODEL_NAME = "tiny-chat"


@pytest.fixture(scope="session")
def chat_model(tiny_models, tmp_path_factory) -> str:
    """The tiny llama model with a chat template."""
    folder = tmp_path_factory.mktemp("serve") / "chat-model"
    shutil.copytree(tiny_models["llama"], folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def server(chat_model):
    """A server for the test module, on the tiny chat model with ENGINE_ARGS (a module may
    override it); yields its base URL."""
    with running_server(LLM(chat_model, **ENGINE_ARGS)) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def client(server):
    """The `openai` client of the module's server."""
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@contextmanager
def running_server(llm: LLM, send_buffer_bytes: int | None = None, **settings):
    """Serve `llm` on a free port until the block ends; yields the base URL. send_buffer_bytes:
    the kernel's send buffer of every accepted connection (small: a client that stops reading
    holds the server's sends back at once)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if send_buffer_bytes is not None:  # accepted sockets inherit it on Linux
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    settings = ServerSettings(port=port, model_name=MODEL_NAME, **settings)
    server = Server(build_app(llm, settings), settings)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.02):
    """Poll until predicate() is truthy; return its value (AssertionError on timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(interval)


def metric_values(base_url: str) -> dict[str, float]:
    """The /metrics samples, parsed by prometheus-client's parser: by name, and by
    `name{label=value}` for labelled ones."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base_url}/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            values[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return values
