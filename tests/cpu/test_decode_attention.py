"""The C++ CPU decode attention kernel against float64 attention over the same paged cache.

Unused slots of the caches hold NaN (`paged_cases`), so reading one wrong token shows as NaN."""

from __future__ import annotations

import logging
import subprocess

import pytest
import torch
from fastgen.kernels import paged_decode_attention_torch

from fastgen.cpu.native import decode_attention as cpu_decode_kernel
from fastgen.cpu.native import library as native_library
from fastgen.cpu.native.decode_attention import (calls_served_in_cpp, kernel_supports, paged_decode_attention_cpu,
                                                 paged_decode_attention_cpu_reference)
from tests.kernels.paged_cases import TOLERANCE, int32, paged_cache

LENGTHS = [0, 1, 15, 16, 17, 40, 130]  # a padding row, block edges, more than one 16-token tile


def run_case(dtype, head_dim, heads, kv_heads, block_size, lengths=LENGTHS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = -(-max(lengths) // block_size) + 1  # wider than needed, -1 padded, as in the engine
    k_cache, v_cache, tables = paged_cache(lengths, kv_heads, head_dim, block_size, width, dtype, gen)
    q = torch.randn(len(lengths), heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    expected = paged_decode_attention_torch(q.double(), k_cache.double(), v_cache.double(), tables,
                                            int32(lengths), scale)
    return q, k_cache, v_cache, tables, int32(lengths), scale, expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 256])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3), (16, 2), (32, 1)], ids=["mha", "gqa3", "gqa8", "mqa"])
@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_kernel_equals_float64_attention_over_a_paged_cache(dtype, head_dim, heads, kv_heads, block_size):
    q, k_cache, v_cache, tables, lens, scale, expected = run_case(dtype, head_dim, heads, kv_heads, block_size)
    assert kernel_supports(q, k_cache, v_cache)
    out = paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # the padding row
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [16, 64, 256])
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (16, 2)], ids=["gqa3", "gqa8"])
def test_a_task_per_sequence_attends_with_every_kv_head(dtype, head_dim, heads, kv_heads):
    """With at least four sequences a thread, each task takes a whole sequence, every KV head
    of it in turn (with fewer, a task is one KV head): one thread makes seven sequences enough."""
    q, k_cache, v_cache, tables, lens, scale, expected = run_case(dtype, head_dim, heads, kv_heads, 16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens, scale)
    finally:
        torch.set_num_threads(threads)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("head_dim", [32, 256])
def test_kernel_reads_queries_through_their_strides(head_dim):
    """The model hands q as a view of the fused q|k|v projection: rows are not contiguous."""
    q, k_cache, v_cache, tables, lens, scale, expected = run_case(torch.float32, head_dim, 8, 2, 16)
    wide = torch.randn(q.shape[0], q.shape[1] * head_dim + 96)
    view = wide[:, : q.shape[1] * head_dim].view(q.shape)
    view.copy_(q)
    assert not view.is_contiguous()
    out = paged_decode_attention_cpu(view, k_cache, v_cache, tables, lens, scale)
    torch.testing.assert_close(out.double(), expected, rtol=2e-3, atol=2e-3)


def test_without_the_library_the_op_runs_the_torch_path(monkeypatch):
    """The Python implementation (where the library is not built, its C++ kernel is not either)."""
    q, k_cache, v_cache, tables, lens, scale, expected = run_case(torch.bfloat16, 64, 9, 3, 16)
    monkeypatch.setattr(cpu_decode_kernel, "_entry_point", lambda: None)
    out = paged_decode_attention_cpu_reference(q, k_cache, v_cache, tables, lens, scale)
    torch.testing.assert_close(out.double(), expected, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_ops_cpu_calls_run_the_kernel_from_cpp(dtype):
    """Once the library is loaded the op's CPU kernel is C++ (no way through Python for a compiled
    step's call): the same kernel's result; int64 tables and lengths go to the Python
    implementation, which converts them."""
    q, k_cache, v_cache, tables, lens, scale, expected = run_case(dtype, 64, 9, 3, 16)
    assert cpu_decode_kernel.kernel_built()
    served = calls_served_in_cpp()
    out = paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens, scale)
    assert calls_served_in_cpp() == served + 1
    assert torch.equal(out, paged_decode_attention_cpu_reference(q, k_cache, v_cache, tables, lens, scale))
    wide = paged_decode_attention_cpu(q, k_cache, v_cache, tables.long(), lens.long(), scale)
    assert calls_served_in_cpp() == served + 1 and torch.equal(wide, out)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


def test_caches_that_do_not_fit_the_queries_are_refused():
    """Not read with the wrong dtype or width: the Python implementation says why (through the
    op's C++ kernel, which hands such calls to it, the error comes back as a RuntimeError)."""
    q, k_cache, v_cache, tables, lens, scale, _ = run_case(torch.bfloat16, 64, 9, 3, 16, lengths=[3])
    for args in ((q, k_cache.float(), v_cache.float()), (q[..., :32], k_cache, v_cache),
                 (q, k_cache, v_cache[..., :32].contiguous())):
        with pytest.raises(ValueError, match="does not fit the caches"):
            paged_decode_attention_cpu_reference(*args, tables, lens, scale)
        with pytest.raises((ValueError, RuntimeError)):
            paged_decode_attention_cpu(*args, tables, lens, scale)


def test_kernel_supports_only_what_it_was_compiled_for():
    q, k_cache, v_cache, *_ = run_case(torch.float32, 64, 8, 2, 16, lengths=[3])
    assert kernel_supports(q, k_cache, v_cache)
    assert not kernel_supports(q.half(), k_cache.half(), v_cache.half())  # no fp16 instance
    assert not kernel_supports(q.bfloat16(), k_cache, v_cache)  # mixed dtypes
    assert not kernel_supports(q[..., :48], k_cache[..., :48].contiguous(), v_cache[..., :48].contiguous())
    three = torch.zeros(*k_cache.shape[:2], 3, 64)
    assert not kernel_supports(q, three, three)  # 8 query heads do not split over 3 KV heads
    assert not kernel_supports(q, k_cache.transpose(0, 1), v_cache)  # a cache that is not contiguous


def test_a_head_dim_without_a_kernel_decodes_through_the_torch_path():
    from fastgen.attention import AttentionMetadata
    from fastgen.attention.torch_paged import TorchPagedBackend
    from fastgen.compile import build_op_set

    lengths = [5, 0, 33]
    q, k_cache, v_cache, tables, lens, scale, expected = run_case(torch.float32, 48, 6, 2, 4, lengths=lengths)
    k_cache, v_cache = k_cache.nan_to_num(), v_cache.nan_to_num()  # the torch path reads masked slots
    meta = AttentionMetadata(False, torch.full((3,), -1), tables, lens, None, 1, max(lengths), None)
    backend = TorchPagedBackend(build_op_set(False), 4)
    out = backend.decode(q, k_cache, v_cache, backend.prepare(meta), scale)
    torch.testing.assert_close(out.double(), expected, rtol=2e-3, atol=2e-3)


@pytest.fixture(scope="module")
def built_library_cache(tmp_path_factory):
    """A cache folder in which the decode library has been built, once for this module's tests
    that only load it (a build is a few seconds of compiler)."""
    folder = tmp_path_factory.mktemp("native-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FASTGEN_CACHE", str(folder))
        assert native_library.load_native_library.__wrapped__(cpu_decode_kernel.SOURCE) is not None
        # and the op's, which the decode library's first use loads too
        assert native_library.load_native_library.__wrapped__(cpu_decode_kernel.OP_SOURCE,
                                                              native_library.torch_abi_flags()) is not None
    return folder


def test_native_library_is_built_once_and_reused(monkeypatch, built_library_cache):
    monkeypatch.setenv("FASTGEN_CACHE", str(built_library_cache))
    assert len(list((built_library_cache / "native").glob("decode_attention-*.so"))) == 1
    built = sorted((built_library_cache / "native").glob("*.so"))
    real_run = subprocess.run

    def run_without_compiling(cmd, *args, **kwargs):
        assert "--version" in cmd, f"the library was built again: {cmd}"
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(native_library.subprocess, "run", run_without_compiling)
    assert native_library.load_native_library.__wrapped__(cpu_decode_kernel.SOURCE) is not None
    assert sorted((built_library_cache / "native").glob("*.so")) == built


def test_a_background_build_and_a_first_use_compile_the_library_once(monkeypatch, private_cache):
    """A build started in the background (`build_in_background`, as engines do at start) and a
    load asked for meanwhile share one compile: the load waits for it and loads its file."""
    import threading

    source = cpu_decode_kernel.SOURCE
    real_run, compiles, release = subprocess.run, [], threading.Event()

    def slow_compile(cmd, *args, **kwargs):
        if str(source) in cmd:
            compiles.append(cmd)
            release.wait(timeout=60)  # the load below asks while this compile is under way
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(native_library.subprocess, "run", slow_compile)
    builder = native_library.build_in_background(source)
    loaded = []
    try:
        while not compiles and builder.is_alive():
            builder.join(timeout=0.01)
        assert compiles, "the background build started compiling"
        loader = threading.Thread(target=lambda: loaded.append(native_library.load_native_library.__wrapped__(source)))
        loader.start()
        loader.join(timeout=0.5)
        assert loader.is_alive(), "the load waits for the build under way"
    finally:
        release.set()
    builder.join(timeout=300)
    loader.join(timeout=300)
    assert len(compiles) == 1 and loaded[0] is not None
    assert len(list((private_cache / "native").glob("decode_attention-*.so"))) == 1


def test_cpu_kernels_are_built_in_the_background_only_for_cpu_engines(monkeypatch, private_cache, tmp_path):
    """Into the cache folder of the moment the build started, even if it changes meanwhile."""
    from fastgen.cpu.native import prebuild

    monkeypatch.setattr(prebuild, "ENABLED", True)
    monkeypatch.setattr(prebuild.torch.cuda, "is_available", lambda: True)
    assert prebuild.build_cpu_kernels_in_background("auto") is None
    assert prebuild.build_cpu_kernels_in_background("cuda:1") is None
    monkeypatch.setattr(prebuild.torch.cuda, "is_available", lambda: False)
    assert prebuild.engine_runs_on_cpu(None) and prebuild.engine_runs_on_cpu("auto")
    thread = prebuild.build_cpu_kernels_in_background("cpu")
    monkeypatch.setenv("FASTGEN_CACHE", str(tmp_path / "another"))
    thread.join(timeout=300)
    built = {path.name.split("-")[0] for path in (private_cache / "native").glob("*.so")}
    assert built == {"decode_attention", "decode_attention_op", "gemm", "packed_linear_op"}
    assert not (tmp_path / "another").exists()


def test_native_library_without_a_compiler_is_none_and_says_why(monkeypatch, private_cache, caplog):
    monkeypatch.setenv("CXX", str(private_cache / "no-such-compiler"))
    with caplog.at_level(logging.WARNING):
        assert native_library.load_native_library.__wrapped__(cpu_decode_kernel.SOURCE) is None
    assert "decode_attention.cpp" in caplog.text and "torch fallback" in caplog.text


def test_native_library_that_fails_to_compile_is_none_and_shows_the_error(tmp_path, private_cache, caplog):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    with caplog.at_level(logging.WARNING):
        assert native_library.load_native_library.__wrapped__(broken) is None
    assert "could not build broken.cpp" in caplog.text
    assert not list((private_cache / "native").glob("*.so")), "no library, and no half-written file, is left"


def test_loading_the_library_leaves_the_process_float_mode_alone(built_library_cache):
    """No flush-to-zero or denormals-are-zero: a denormal stays nonzero after the library loads
    (a -ffast-math build would switch both on for the whole process)."""
    import sys

    probe = (
        "import torch\n"
        "from fastgen.cpu.native.decode_attention import _entry_point\n"
        "assert _entry_point() is not None\n"
        "tiny = float('5e-324')\n"
        "assert tiny > 0.0 and tiny * 1.0 != 0.0, 'denormals flushed'\n"
        "assert torch.tensor([1e-40]).mul(1.0).item() != 0.0, 'torch denormals flushed'\n"
    )
    env = {**__import__("os").environ, "FASTGEN_CACHE": str(built_library_cache)}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
