"""The GPU benchmark script runs end to end (here on CPU, in its smoke mode, as the offline GPU
machine would run it: no network, no gguf) and writes its JSON after every section."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_decode_script_smoke_on_cpu(tmp_path):
    subprocess.run(
        [sys.executable, "tests/offline_python.py", "benchmarks/gpu_decode.py", "--device", "cpu",
         "--preset", "smollm2-135m", "--batch-sizes", "1,3", "--long-context", "40", "--long-batch-sizes", "1",
         "--steps", "2", "--context-len", "8", "--num-prompts", "2", "--input-len", "4:6", "--output-len", "2",
         "--block-size", "16", "--hf-batch-size", "2", "--output-dir", str(tmp_path)],
        cwd=ROOT, check=True, timeout=900,
    )
    (path,) = tmp_path.glob("gpu-decode-*.json")
    assert path.name == "gpu-decode-cpu.json"
    doc = json.loads(path.read_text())
    assert doc["schema"] == "fastgen.bench.gpu-decode/2"
    assert set(doc["section_seconds"]) == {"bandwidth", "graphs", "eager", "throughput", "transformers"}
    for mode in ("graphs", "eager"):
        rows = doc[mode]["steps"]
        assert [(r["batch_size"], r["context_len"]) for r in rows] == [(1, 8), (3, 8), (1, 40)]
        assert all(r["wall_ms"]["median"] > 0 for r in rows)
        assert doc[mode]["startup"]["seconds"] > 0
    assert set(doc["speedup_graphs_over_eager"]) == {"bs1-ctx8", "bs3-ctx8", "bs1-ctx40"}
    assert doc["throughput"]["output_tokens"] == 4
    assert doc["transformers"]["output_tokens"] == 4 and doc["transformers"]["output_tokens_per_s"] > 0
    assert "fastgen_over_transformers" in doc
