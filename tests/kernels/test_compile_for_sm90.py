"""Every Triton kernel compiles for an H100 (sm_90) with the installed Triton, through fastgen's
own launchers, without a GPU (`compile_for_sm90.py`): what the interpreter cannot show —
constexpr and dtype errors of the compiled path, tl.dot shapes, register spills, shared memory
— shows here before a GPU run does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("compile_for_sm90.py")
H100_SHARED_BYTES = 227 * 1024  # the most shared memory one block may take on sm_90
SPILL_UNDER_A_LIMIT = 64  # bytes of stack a thread, where registers are limited


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=1200,
                          cwd=SCRIPT.parents[2])
    if done.returncode == 3:
        pytest.skip(done.stderr.strip())
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    errors = [r for r in rows if "error" in r]
    assert done.returncode == 0 and not errors, (errors or done.stderr)[:3]
    return rows


@pytest.mark.slow
def test_every_kernel_compiles_within_h100_limits(compiled):
    names = {r["kernel"] for r in compiled}
    assert names == {"decode_split_kernel", "decode_combine_kernel", "prefill_kernel",
                     "qk_norm_rope_store_kernel", "_store_kvcache_kernel", "_skinny_matmul_kernel",
                     "_normed_skinny_matmul_kernel", "decode_layer_kernel"}
    for row in compiled:
        assert row["shared_bytes"] <= H100_SHARED_BYTES, row
        if row["config"]["dtype"] != "float32" and "stack" in row:
            # Held to a register limit, a few may spill (Triton 3.6: 8 and 48 bytes at one and
            # two rows of Qwen3-0.6B's persistent layer); none elsewhere.
            assert row["stack"] <= (SPILL_UNDER_A_LIMIT if row["register_limit"] else 0), f"register spills: {row}"


@pytest.mark.slow
def test_half_precision_attention_runs_on_tensor_cores_for_every_group(compiled):
    groups = set()
    for row in compiled:
        if row["kernel"] in ("decode_split_kernel", "prefill_kernel") and row["config"]["dtype"] != "float32":
            assert row["tensor_core_ops"] > 0, row
            groups.add(row["config"]["group"])
    assert groups == {1, 2, 4, 8}


@pytest.mark.slow
def test_decode_kernels_wait_on_the_kernel_in_front_only_when_launched_as_its_dependents(compiled):
    """With programmatic launch (Hopper) each decode-path kernel signals its dependents and
    waits for its predecessor (griddepcontrol); without it, neither instruction is compiled in."""
    variants = [r for r in compiled if "pdl" in r["config"]]
    assert {r["kernel"] for r in variants} == {"decode_split_kernel", "decode_combine_kernel",
                                               "qk_norm_rope_store_kernel", "_skinny_matmul_kernel",
                                               "_normed_skinny_matmul_kernel", "decode_layer_kernel"}
    for row in variants:
        assert (row["grid_dependency_ops"] >= 2) == row["config"]["pdl"], row


@pytest.mark.slow
def test_decode_attention_reads_the_cache_before_its_wait_only_when_asked(compiled):
    """With `EARLY_CACHE_READS` and programmatic launch, the split kernel's first tile (and the
    block table, the new token's position and slot) and the combine's lengths are loaded ahead
    of `griddepcontrol.wait`, so the compiler kept the order the source gives; without it,
    nothing is."""
    early_rows = 0
    for row in compiled:
        config = row["config"]
        if row["kernel"] not in ("decode_split_kernel", "decode_combine_kernel") or not config.get("pdl"):
            continue
        early = bool(config.get("early_cache_reads")) and config["max_splits"] > 1  # (one split: as before)
        splitting = row["kernel"] == "decode_split_kernel" or config["max_splits"] > 1
        assert (row["loads_before_wait"] > 0) == (early and splitting), row
        early_rows += early and row["kernel"] == "decode_split_kernel"
    assert early_rows == 2 * 4 * 3  # q/k-norm or not, 4 shapes, 3 dtypes (at 8 splits)


@pytest.mark.slow
def test_only_the_kernels_that_count_on_the_device_use_atomics(compiled):
    """The decode path's atomics are the split counters, only where asked for, and the phase
    counters of the one-launch layer (`kernels/decode_layer.py`)."""
    for row in compiled:
        combining = row["kernel"] == "decode_split_kernel" and row["config"].get("combine_in_split", False)
        assert (row["atomic_ops"] > 0) == (combining or row["kernel"] == "decode_layer_kernel"), row
    assert any(row["config"].get("combine_in_split") for row in compiled)
    # Beside them, the plain new-token variants at one split and at several.
    assert {row["config"]["max_splits"] for row in compiled if row["kernel"] == "decode_split_kernel"
            and row["config"].get("new_token") and not row["config"].get("combine_in_split")} == {1, 8}


@pytest.mark.slow
def test_the_one_launch_layer_waits_in_one_thread_a_program_between_its_phases(compiled):
    """Five waits (one a phase after the first), each thread 0's loop in PTX (`_SPIN`), as the
    GPU runs it; the interpreter's loop is not the one compiled."""
    rows = [r for r in compiled if r["kernel"] == "decode_layer_kernel"]
    assert rows and all(r["spin_waits"] == 5 for r in rows), [r["spin_waits"] for r in rows]


@pytest.mark.slow
def test_only_the_one_launch_layer_asks_the_l2_for_weights_ahead(compiled):
    """Its prefetching programs ask for PREFETCH_LINES lines of whichever weight is theirs, one
    instruction a line a thread (`_ask_l2_for`), compiled whether a launch has such programs or
    not (how many is a launch argument); no other kernel prefetches."""
    from fastgen.kernels.decode_layer import PREFETCH_LINES

    for row in compiled:
        if row["kernel"] == "decode_layer_kernel":
            assert row["l2_prefetches"] == PREFETCH_LINES // (32 * row["num_warps"]), row
        else:
            assert row["l2_prefetches"] == 0, row


@pytest.mark.slow
def test_only_the_one_launch_layer_reads_the_clock_to_give_up_a_wait_and_only_traced_besides(compiled):
    """Each of its waits reads the GPU's global clock as it begins and after each pause, to give
    up one that cannot end (`WAIT_LIMIT_NS`); `LayerTrace`'s launches read it besides (at a
    program's start, after its wait, at its end); no other kernel reads it."""
    for row in compiled:
        if row["kernel"] != "decode_layer_kernel":
            assert row["clock_reads"] == 0, row
        elif row["config"].get("traced"):
            assert row["clock_reads"] > 2 * row["spin_waits"], row
        else:
            assert row["clock_reads"] == 2 * row["spin_waits"] == 10, row


@pytest.mark.slow
def test_persistent_layers_are_compiled_to_fit_two_programs_an_sm(compiled):
    """Two persistent 8-warp programs an SM get 128 registers a thread (`persistent_register_limit`),
    which the compiler keeps to; every other kernel is compiled without a limit."""
    rows = [r for r in compiled if r["kernel"] == "decode_layer_kernel" and r["config"].get("persistent")]
    assert rows
    for row in compiled:
        persistent = row in rows
        assert row["register_limit"] == (128 if persistent else 0), row
        if persistent and "reg" in row:
            assert row["reg"] <= 128, row
