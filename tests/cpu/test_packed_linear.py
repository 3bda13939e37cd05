"""Linear layers over packed weights (`fastgen.cpu.native.packed_linear`, `fastgen.cpu.native.gemm`):
oneDNN's twins bit for bit what F.linear gives, fastgen's within one rounding of it; only for the
weights that were packed, and never for a freed weight's address."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fastgen.cpu.native import gemm as cpu_gemm
from fastgen.cpu.native import packed_linear as pl
from fastgen.cpu.native.features import has_native_bf16

native_bf16 = pytest.mark.skipif(not has_native_bf16(), reason="packs only where the CPU computes bf16 natively")
fastgen_gemm = pytest.mark.skipif(not cpu_gemm.gemm_available(), reason="fastgen's GEMM needs AVX-512 BF16")


@pytest.fixture
def product_calls(monkeypatch):
    """How many products went through a packed twin: in Python, or in the C++ kernel."""

    class Calls:
        python = 0
        native_before = pl.products_served_natively()

        def __len__(self):
            return self.python + pl.products_served_natively() - self.native_before

    calls = Calls()
    real = pl._packed_product

    def counting(*args):
        calls.python += 1
        return real(*args)

    monkeypatch.setattr(pl, "_packed_product", counting)
    return calls


@native_bf16
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 64, 700])
def test_onednn_twins_give_f_linear_bit_for_bit(rows, bias, product_calls):
    """At SmolLM2's gate|up shape (K = 576, past oneDNN's K blocking)."""
    torch.manual_seed(0)
    layer = nn.Linear(576, 1536, bias=bias).bfloat16()
    assert pl.pack_linear_weights(layer, kernel="onednn") == 1
    x = torch.randn(rows, 576).bfloat16()
    got = pl.packed_linear(x, layer.weight, layer.bias)
    assert torch.equal(got, F.linear(x, layer.weight, layer.bias))
    assert len(product_calls) == 1


def _bf16_ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at each element's magnitude."""
    exponent = torch.floor(torch.log2(t.float().abs().clamp_min(2.0 ** -120)))
    return torch.pow(2.0, exponent - 7)


@fastgen_gemm
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 64, 700])
def test_fastgen_twins_match_f_linear_within_one_rounding(rows, bias, product_calls):
    """The same products summed in the same order: nearly every output equal to F.linear's, the
    rest one bf16 step away, and no further from the exact product than F.linear is."""
    torch.manual_seed(0)
    layer = nn.Linear(576, 1536, bias=bias).bfloat16()
    assert pl.pack_linear_weights(layer, kernel="fastgen") == 1
    x = torch.randn(rows, 576).bfloat16()
    got = pl.packed_linear(x, layer.weight, layer.bias)
    want = F.linear(x, layer.weight, layer.bias)
    assert len(product_calls) == 1 and got.dtype == torch.bfloat16 and got.shape == want.shape
    assert (got == want).float().mean() > 0.99
    # One bf16 step apart at most, plus fp32 summing's own error where the sum cancels to near 0.
    magnitude = x.double().abs() @ layer.weight.double().abs().T
    assert torch.all((got.double() - want.double()).abs() <= _bf16_ulp(want) + 2.0 ** -20 * magnitude)
    exact = x.double() @ layer.weight.double().T + (layer.bias.double() if bias else 0)
    ours, theirs = (got.double() - exact).abs().mean(), (want.double() - exact).abs().mean()
    assert ours <= theirs * 1.01


@fastgen_gemm
@pytest.mark.parametrize(("rows", "out_features", "in_features"),
                         [(1, 1, 1), (3, 50, 7), (9, 47, 33), (17, 97, 64), (8, 48, 2), (33, 200, 129),
                          (300, 100, 1024)])  # the last: three chunks of A (128 rows at K = 1024)
def test_fastgen_gemm_covers_ragged_shapes(rows, out_features, in_features):
    """Rows past a register tile, columns past a panel (masked stores), an odd K (a last pair
    with one real element): against the exact product, within bf16's rounding."""
    torch.manual_seed(rows)
    weight = torch.randn(out_features, in_features).bfloat16()
    bias = torch.randn(out_features).bfloat16()
    x = torch.randn(rows, in_features).bfloat16()
    got = cpu_gemm.packed_gemm(x, cpu_gemm.pack_weight(weight), out_features, bias)
    exact = x.double() @ weight.double().T + bias.double()
    assert torch.all((got.double() - exact).abs() <= _bf16_ulp(exact) + 1e-6 * in_features)
    batched = cpu_gemm.packed_gemm(x.view(1, rows, in_features), cpu_gemm.pack_weight(weight), out_features, None)
    assert batched.shape == (1, rows, out_features)
    assert torch.equal(batched[0], cpu_gemm.packed_gemm(x, cpu_gemm.pack_weight(weight), out_features, None))


@native_bf16
def test_a_view_at_a_packed_weights_address_with_another_shape_finds_no_twin(product_calls):
    layer = nn.Linear(64, 32, bias=False).bfloat16()
    pl.pack_linear_weights(layer)
    x = torch.randn(3, 64).bfloat16()
    first_rows = layer.weight[:16]  # same address, other shape
    assert torch.equal(pl.packed_linear(x, first_rows, None), F.linear(x, first_rows))
    square = layer.weight.detach().reshape(64, 32).t()  # other strides
    y = torch.randn(3, 64).bfloat16()
    assert torch.equal(pl.packed_linear(y, square, None), F.linear(y, square))
    assert len(product_calls) == 0
    pl.packed_linear(x, layer.weight, None)
    assert len(product_calls) == 1


@native_bf16
def test_a_mismatched_input_width_raises_as_f_linear_does():
    layer = nn.Linear(64, 32, bias=False).bfloat16()
    pl.pack_linear_weights(layer)
    with pytest.raises(RuntimeError):
        pl.packed_linear(torch.randn(3, 65).bfloat16(), layer.weight, None)


def test_the_packing_kernel_is_fastgens_only_where_it_runs_and_the_cpu_lacks_amx(monkeypatch):
    monkeypatch.setattr(pl.cpu_gemm, "gemm_available", lambda: True)
    monkeypatch.setattr(pl, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    assert pl.packing_kernel() == "fastgen"
    monkeypatch.setattr(pl, "cpu_flags", lambda: frozenset({"avx512_bf16", "amx_bf16"}))
    assert pl.packing_kernel() == "onednn"
    monkeypatch.setattr(pl.cpu_gemm, "gemm_available", lambda: False)
    monkeypatch.setattr(pl, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    assert pl.packing_kernel() == "onednn"


def test_float32_weights_stay_plain(product_calls):
    layer = nn.Linear(16, 8)
    assert pl.pack_linear_weights(layer) == 0
    x = torch.randn(3, 16)
    assert torch.equal(pl.packed_linear(x, layer.weight, layer.bias), F.linear(x, layer.weight, layer.bias))
    assert len(product_calls) == 0


def test_an_unpacked_weight_goes_through_f_linear(product_calls):
    layer = nn.Linear(16, 8, bias=False).bfloat16()
    x = torch.randn(3, 16).bfloat16()
    assert torch.equal(pl.packed_linear(x, layer.weight, None), F.linear(x, layer.weight))
    assert len(product_calls) == 0


@native_bf16
def test_a_freed_weight_takes_its_twin_with_it():
    layer = nn.Linear(32, 24, bias=False).bfloat16()
    pl.pack_linear_weights(layer)
    key = layer.weight.data_ptr()
    assert key in pl._twins
    del layer
    gc.collect()
    assert key not in pl._twins


@native_bf16
def test_linears_as_packed_rewrites_every_linear_call(product_calls):
    def two_layers(x, w1, w2, b2):
        return F.linear(torch.relu(F.linear(x, w1)), w2, bias=b2)

    gm = torch.fx.symbolic_trace(two_layers)
    torch.manual_seed(1)
    first, second = nn.Linear(8, 16, bias=False).bfloat16(), nn.Linear(16, 4).bfloat16()
    pl.pack_linear_weights(nn.Sequential(first, second), kernel="onednn")  # bit for bit: see above
    args = (torch.randn(5, 8).bfloat16(), first.weight, second.weight, second.bias)
    want = gm(*args)
    assert pl.linears_as_packed(gm) == 2
    assert not any(node.target is F.linear for node in gm.graph.nodes)
    assert torch.equal(gm(*args), want)
    assert len(product_calls) == 2


def test_nothing_is_packed_where_the_cpu_lacks_native_bf16(monkeypatch, product_calls):
    monkeypatch.setattr(pl, "has_native_bf16", lambda: False)
    layer = nn.Linear(16, 8, bias=False).bfloat16()
    assert pl.pack_linear_weights(layer) == 0
    x = torch.randn(3, 16).bfloat16()
    assert torch.equal(pl.packed_linear(x, layer.weight, None), F.linear(x, layer.weight))
    assert len(product_calls) == 0


def test_dynamo_graphs_keep_float32_linears_as_inductor_gemms():
    """Only bf16 linears become the op (a float32 weight never has a twin); the others stay
    Inductor's own GEMMs."""
    counts = []

    def backend(gm, example_inputs):
        counts.append(pl.linears_as_packed(gm))
        return gm.forward

    f32, bf16 = nn.Linear(8, 4), nn.Linear(8, 4).bfloat16()
    both = torch.compile(lambda x, y: (f32(x), bf16(y)), backend=backend, fullgraph=True)
    x, y = torch.randn(2, 8), torch.randn(2, 8).bfloat16()
    out = both(x, y)
    assert counts == [1]
    assert torch.equal(out[0], f32(x)) and torch.equal(out[1], bf16(y))


@pytest.fixture
def native_kernel():
    """The op's C++ kernel, loaded (it serves every later call of the op in this process). It
    must build wherever fastgen's GEMM runs on a torch whose stable ABI it is written for."""
    if not cpu_gemm.gemm_available():
        pytest.skip("fastgen's GEMM needs AVX-512 BF16")
    if pl._native_kernel() is None:
        major, minor = (int(part) for part in torch.__version__.split(".")[:2])
        assert (major, minor) < (2, 13), "packed_linear_op.cpp did not build on this torch"
        pytest.skip(f"packed_linear_op.cpp does not build on torch {torch.__version__}")
    return pl._native_kernel()


@pytest.mark.parametrize("bias", [False, True])
def test_the_cpp_kernel_computes_what_the_python_kernel_does(native_kernel, bias):
    """Bit for bit (the same GEMM over the same twin), for 2-d and 3-d inputs, and it counts."""
    torch.manual_seed(0)
    layer = nn.Linear(576, 960, bias=bias).bfloat16()
    pl.pack_linear_weights(layer, kernel="fastgen")
    for x in (torch.randn(32, 576).bfloat16(), torch.randn(2, 5, 576).bfloat16()):
        before = pl.products_served_natively()
        got = pl.packed_linear(x, layer.weight, layer.bias)
        assert pl.products_served_natively() == before + 1
        assert torch.equal(got, pl._through_twin(x, layer.weight, layer.bias))
        torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-2, atol=1e-2)


def test_the_cpp_kernel_hands_what_it_cannot_serve_to_the_python_kernel(native_kernel, product_calls):
    """A oneDNN twin (bit for bit F.linear), a strided input, a float32 bias, a wrong width: each
    as the Python kernel does it."""
    torch.manual_seed(0)
    onednn = nn.Linear(576, 192).bfloat16()
    pl.pack_linear_weights(onednn, kernel="onednn")
    x = torch.randn(8, 576).bfloat16()
    before = pl.products_served_natively()
    assert torch.equal(pl.packed_linear(x, onednn.weight, onednn.bias), F.linear(x, onednn.weight, onednn.bias))
    assert product_calls.python == 1 and pl.products_served_natively() == before

    ours = nn.Linear(576, 192, bias=False).bfloat16()
    pl.pack_linear_weights(ours, kernel="fastgen")
    strided = torch.randn(8, 1152).bfloat16()[:, ::2]
    want = pl._through_twin(strided.contiguous(), ours.weight, None)
    assert torch.equal(pl.packed_linear(strided, ours.weight, None), want)
    bias32 = torch.randn(192)
    assert torch.equal(pl.packed_linear(x, ours.weight, bias32), pl._through_twin(x, ours.weight, bias32))
    # Each of those went to the Python kernel (twice each: the op's call, then the reference).
    assert product_calls.python == 1 + 4 and pl.products_served_natively() == before
    with pytest.raises(RuntimeError):  # as F.linear raises it
        pl.packed_linear(torch.randn(3, 575).bfloat16(), ours.weight, None)
