"""The GPU benchmark script runs end to end (here on CPU, in its smoke mode) and writes the
documented JSON, so it has not rotted when a GPU machine runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_decode_script_smoke_on_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    subprocess.run(
        [sys.executable, "benchmarks/gpu_decode.py", "--device", "cpu", "--preset", "smollm2-135m",
         "--batch-sizes", "1,2", "--steps", "2", "--context-len", "8", "--skip-throughput", "--output", str(out)],
        cwd=ROOT, check=True, timeout=600,
    )
    doc = json.loads(out.read_text())
    assert doc["schema"] == "fastgen.bench.gpu-decode/1"
    for mode in ("graphs", "eager"):
        rows = doc["decode"][mode]["steps"]
        assert [r["batch_size"] for r in rows] == [1, 2]
        assert all(r["median_ms"] > 0 for r in rows)
    assert set(doc["speedup_graphs_over_eager"]) == {"1", "2"}
