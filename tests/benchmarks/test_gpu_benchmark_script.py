"""The GPU benchmark script runs end to end (here on CPU, in its smoke mode, as the offline GPU
machine would run it: no network, no gguf, no server stack), writes its JSON after every
section, and a second command's sections merge into the first's file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _caches_outside_the_tree(tmp_path) -> dict:
    """The script keeps compile caches in the tree's .gpu-cache/ unless told otherwise: here,
    Inductor's usual cache (so earlier tests' kernels are reused) and a scratch Triton cache."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()),
            "TRITON_CACHE_DIR": str(tmp_path / "triton")}


@pytest.mark.slow
def test_gpu_decode_script_smoke_on_cpu(tmp_path):
    common = [sys.executable, "tests/offline_python.py", "benchmarks/gpu_decode.py", "--device", "cpu",
              "--preset", "smollm2-135m", "--batch-sizes", "1,3", "--long-context", "40", "--long-batch-sizes", "1",
              "--steps", "2", "--context-len", "8", "--num-prompts", "2", "--input-len", "4:6", "--output-len", "2",
              "--block-size", "16", "--hf-batch-size", "2", "--spec-max-tokens", "6", "--output-dir", str(tmp_path)]
    env = _caches_outside_the_tree(tmp_path)
    subprocess.run([*common, "--sections", "bandwidth,graphs,logits,eager"], cwd=ROOT, env=env, check=True, timeout=900)
    subprocess.run([*common, "--sections", "speculative,throughput,transformers"], cwd=ROOT, env=env, check=True,
                   timeout=900)
    (path,) = tmp_path.glob("gpu-decode-*.json")
    assert path.name == "gpu-decode-cpu.json"
    doc = json.loads(path.read_text())
    assert doc["schema"] == "fastgen.bench.gpu-decode/3"
    assert doc["settings"]["one_launch_layers"] == "off" and doc["settings"]["packed_uploads"] == "on"
    assert set(doc["section_seconds"]) == {"bandwidth", "graphs", "eager", "speculative", "throughput", "transformers"}
    assert [run["sections"] for run in doc["runs"]] == [["bandwidth", "graphs", "logits", "eager"],
                                                        ["speculative", "throughput", "transformers"]]
    # Both prompts decode with and without drafts, to the same tokens (whether a random model's
    # output drafts at all in 6 tokens is its own affair).
    spec = doc["speculative"]["batch_1"]
    assert set(spec) == {"random", "repeated"} and all(row["identical_output"] for row in spec.values())
    assert all(row["speedup"] > 0 and "draft_tokens" in row["acceptance"] for row in spec.values())
    assert doc["speculative"]["speculative_config"]["method"] == "ngram"
    # On CPU the compiled decode step stands where a CUDA graph would: its logits against eager.
    assert [(r["batch_size"], r["context_len"]) for r in doc["logits"]] == [(1, 40), (3, 40)]
    assert all(r["greedy_agreement"] == 1.0 for r in doc["logits"])
    assert doc["host_profile"]["eager_bs1"]["top_own_time"]
    for mode in ("graphs", "eager"):
        rows = doc[mode]["steps"]
        assert [(r["batch_size"], r["context_len"]) for r in rows] == [(1, 8), (3, 8), (1, 40)]
        assert all(r["wall_ms"]["median"] > 0 for r in rows)
        assert doc[mode]["startup"]["seconds"] > 0
    assert set(doc["speedup_graphs_over_eager"]) == {"bs1-ctx8", "bs3-ctx8", "bs1-ctx40"}
    assert doc["throughput"]["output_tokens"] == 4
    assert doc["transformers"]["output_tokens"] == 4 and doc["transformers"]["output_tokens_per_s"] > 0
    assert doc["fastgen_over_transformers"] > 0  # both sides in the second command


def test_sections_past_the_time_budget_are_skipped_and_earlier_sections_stay(tmp_path):
    path = tmp_path / "gpu-decode-cpu.json"
    earlier = {"schema": "fastgen.bench.gpu-decode/3", "graphs": {"steps": ["kept"]}, "throughput": {"old": 1}}
    path.write_text(json.dumps(earlier))
    subprocess.run(
        [sys.executable, "tests/offline_python.py", "benchmarks/gpu_decode.py", "--device", "cpu",
         "--preset", "smollm2-135m", "--sections", "bandwidth,throughput", "--time-budget-s", "0",
         "--output-dir", str(tmp_path)],
        cwd=ROOT, env=_caches_outside_the_tree(tmp_path), check=True, timeout=300,
    )
    doc = json.loads(path.read_text())
    assert doc["graphs"] == {"steps": ["kept"]}  # not run this time: the earlier run's stays
    assert doc["bandwidth"]["skipped"] and doc["throughput"]["skipped"]  # run again: replaced
    assert doc["runs"][-1]["sections"] == ["bandwidth", "throughput"]


def test_logits_and_kernels_need_an_engine_section():
    done = subprocess.run([sys.executable, "tests/offline_python.py", "benchmarks/gpu_decode.py", "--device", "cpu",
                           "--sections", "logits"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "add graphs or eager" in done.stderr


def test_a_batch_larger_than_the_engine_takes_is_refused_not_waited_for(tiny_models):
    """`start_decoding` waits until the whole batch decodes. Asked for more sequences than the
    engine runs at once, it would decode the first ones to max_model_len before the rest were
    admitted (the kernel timings at batch 8 and 64 once did so, in a run of batch 1 and 2)."""
    from benchmarks.gpu_measure import start_decoding
    from fastgen import LLM

    llm = LLM(tiny_models["qwen3"], dtype="float32", block_size=8, num_kv_blocks=64, max_model_len=128, max_num_seqs=2)
    with pytest.raises(ValueError, match="batch 3 is more than the engine's max_num_seqs 2"):
        start_decoding(llm, 3, 16)
    ids = start_decoding(llm, 2, 16)
    running = llm.engine.scheduler.running
    assert len(ids) == 2 and len(running) == 2 and all(s.num_uncomputed_tokens == 1 for s in running)


def test_the_timeline_is_split_between_kernels_without_counting_a_wait_twice():
    """Three kernels a step as programmatic dependents: each starts while the one in front runs
    and ends after it. Their own durations add up to 16 us where kernels ran for 10; the split
    gives each only what it added, and the 2 us with nothing running to the kernel after them."""
    from benchmarks.gpu_measure import timeline_shares

    spans = [("qkv", 0.0, 5.0), ("attention", 1.0, 8.0), ("o_proj", 6.0, 10.0),  # overlapping
             ("qkv", 12.0, 14.0)]  # after 2 us idle
    extends, idle_before = timeline_shares(list(reversed(spans)))  # (any order in, start order used)
    assert extends == {"qkv": 7.0, "attention": 3.0, "o_proj": 2.0}
    assert idle_before == {"qkv": 2.0, "attention": 0.0, "o_proj": 0.0}
    assert sum(extends.values()) + sum(idle_before.values()) == 14.0  # first start to last end
    # A kernel wholly inside another's span adds nothing.
    assert timeline_shares([("a", 0.0, 10.0), ("b", 2.0, 3.0)])[0] == {"a": 10.0, "b": 0.0}
