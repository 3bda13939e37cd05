"""A decoder layer's decode step in one launch (`kernels/decode_layer.py`) equals the six
launches it replaces (`normed_skinny_matmul`, `paged_decode_attention` preparing the new token,
`skinny_matmul`, the SwiGLU `normed_skinny_matmul`, `skinny_matmul`), each of which its own
tests hold to the torch ops; the layer as a whole is held to transformers' in
`tests/models/test_one_launch_layer.py`. Run by the Triton interpreter on a CPU (whose programs
run one after another, so no phase ever waits), bit for bit there; compiled on a GPU by `make
gpu-test` (where the phases overlap and wait on each other), within the last bits, since the
one launch's 8 warps may sum in another order than the separate kernels' 4."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fastgen.kernels.decode_layer import (
    PREFETCH_LINES,
    DecodeLayerWeights,
    LayerCounters,
    LayerTrace,
    decode_layer,
    decode_layer_in_six_launches,
    default_layer_tiling,
    persistent_register_limit,
)
from tests.kernels.paged_cases import DEVICE
from tests.kernels.test_decode_new_token import HEADS, KV_HEADS, step

pytestmark = pytest.mark.triton

EPS, QK_EPS = 1e-6, 1e-5


def assert_same(got, want, what):
    if DEVICE == "cpu":
        assert torch.equal(got, want), f"{what}: {(got.float() - want.float()).abs().max()}"
    else:
        tolerance = dict(rtol=1e-5, atol=1e-5) if got.dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(got, want, **tolerance, equal_nan=True, msg=what)


def layer_weights(dtype, head_dim, hidden, intermediate, qk_norm, qkv_bias, gen, device):
    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    n_qkv = (HEADS + 2 * KV_HEADS) * head_dim
    return DecodeLayerWeights(
        input_norm=(1 + 0.1 * rand(hidden)), qkv=rand(n_qkv, hidden, scale=hidden**-0.5),
        qkv_bias=rand(n_qkv) if qkv_bias else None,
        q_norm=(1 + 0.1 * rand(head_dim)) if qk_norm else None, k_norm=(1 + 0.1 * rand(head_dim)) if qk_norm else None,
        o=rand(hidden, HEADS * head_dim, scale=(HEADS * head_dim) ** -0.5), post_norm=(1 + 0.1 * rand(hidden)),
        gate_up=rand(2 * intermediate, hidden, scale=hidden**-0.5), down=rand(hidden, intermediate,
                                                                            scale=intermediate**-0.5),
        num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=head_dim, eps=EPS, qk_eps=QK_EPS)


# Persistent: five programs take every ticket in turn (under the interpreter the first takes
# them all, and the others find none left).
STEPS = {  # id: (lens, first_layer, persistent_programs)
    "one-token-first-layer": ([1], True, 0), "one-split": ([40], False, 0), "three-splits": ([300], False, 0),
    "padding-row": ([300, 0], False, 0), "two-rows-first-layer": ([1, 200], True, 0),
    "three-splits-persistent": ([300], False, 5), "two-rows-first-layer-persistent": ([1, 200], True, 5)}
LAYERS = {  # id: (dtype, head_dim, hidden, intermediate, qk_norm, qkv_bias)
    "fp32-qwen3": (torch.float32, 64, 100, 164, True, False),  # Qwen3's kind; widths that leave programs part-full
    "bf16-qwen2": (torch.bfloat16, 32, 64, 128, False, True),  # Qwen2's (a q|k|v bias, no per-head norm)
}
# The one launch is off by default (measured slower than six launches): its steps run in test-slow
# and `make gpu-test` (seconds each under the interpreter); `make test` keeps its waits' reports
# and what it refuses.
@pytest.mark.slow
@pytest.mark.parametrize("dtype,head_dim,hidden,intermediate,qk_norm,qkv_bias,lens,first_layer,persistent_programs", [
    pytest.param(*layer, *step_case, id=f"{layer_id}-{step_id}")
    for layer_id, layer in LAYERS.items() for step_id, step_case in STEPS.items()])
def test_one_launch_equals_the_six_launches(dtype, head_dim, hidden, intermediate, qk_norm, qkv_bias, first_layer,
                                            lens, persistent_programs):
    _, _, _, k_cache, v_cache, tables, lens_t, positions, cos_sin, _, slots = step(dtype, head_dim, lens, seed=7)
    gen = torch.Generator().manual_seed(11)
    device = k_cache.device
    w = layer_weights(dtype, head_dim, hidden, intermediate, qk_norm, qkv_bias, gen, device)
    x = torch.randn(len(lens), hidden, generator=gen).to(dtype).to(device)
    residual = None if first_layer else torch.randn(len(lens), hidden, generator=gen).to(dtype).to(device)
    scale = head_dim**-0.5
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    want, want_residual = decode_layer_in_six_launches(x, residual, w, positions, cos_sin, k_ref, v_ref, tables,
                                                       lens_t, slots, scale)

    counters = LayerCounters(device)
    tiling = replace(default_layer_tiling(hidden), persistent_programs=persistent_programs)
    # Back to back, without a sync: the third launch takes the first one's counters again.
    launches = [decode_layer(x, residual, w, positions, cos_sin, k_cache, v_cache, tables, lens_t, slots, scale,
                             counters, tiling) for _ in range(3)]
    for launch, (got, got_residual) in enumerate(launches):
        assert_same(got, want, f"launch {launch}")
        assert_same(got_residual, want_residual, f"launch {launch}'s residual")
    assert_same(k_cache.nan_to_num(7.0), k_ref.nan_to_num(7.0), "the K cache")
    assert_same(v_cache.nan_to_num(7.0), v_ref.nan_to_num(7.0), "the V cache")
    assert not counters.sets.any(), counters.sets
    counters.raise_if_stalled()


@pytest.mark.parametrize("lens,l2_prefetch,traced,persistent_programs", [
    ([300], 1, False, 0), ([1, 200], 4, True, 0), ([1, 200], 4, True, 3)],
    ids=["three-splits-o", "two-rows-all-traced", "two-rows-all-traced-persistent"])
@pytest.mark.slow  # as above
def test_programs_that_ask_the_l2_for_weights_leave_the_step_as_it_was(lens, l2_prefetch, traced,
                                                                       persistent_programs):
    """With the products after attention asked into the L2 by programs of their own (which, with
    no L2 under the interpreter, only take their tickets), every other phase's work is where it
    was and the counters come back to zero (with the next layer's q|k|v asked for too, at 4); so
    too when the launch is traced (`LayerTrace`), whose record names each ticket's phase and, on
    a GPU, shows each phase's waiting tickets beginning their work only after every ticket of
    the phase they wait for has started; and so too with persistent programs (three, taking
    ticket after ticket)."""
    dtype, head_dim, hidden, intermediate = torch.float32, 64, 100, 164
    _, _, _, k_cache, v_cache, tables, lens_t, positions, cos_sin, _, slots = step(dtype, head_dim, lens, seed=3)
    gen = torch.Generator().manual_seed(5)
    device = k_cache.device
    w = layer_weights(dtype, head_dim, hidden, intermediate, True, False, gen, device)
    w = replace(w, next_qkv=torch.randn(w.qkv.shape, generator=gen).to(device))
    x, residual = (torch.randn(len(lens), hidden, generator=gen).to(device) for _ in range(2))
    args = (positions, cos_sin, k_cache, v_cache, tables, lens_t, slots, head_dim**-0.5)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    want, want_residual = decode_layer_in_six_launches(x, residual, w, *args[:2], k_ref, v_ref, *args[4:])
    counters = LayerCounters(device)
    tiling = replace(default_layer_tiling(hidden), l2_prefetch=l2_prefetch, persistent_programs=persistent_programs)
    trace = LayerTrace() if traced else None
    for launch in range(2):
        got, got_residual = decode_layer(x, residual, w, *args, counters, tiling, trace)
        assert_same(got, want, f"launch {launch}")
        assert_same(got_residual, want_residual, f"launch {launch}'s residual")
    assert_same(k_cache.nan_to_num(7.0), k_ref.nan_to_num(7.0), "the K cache")
    assert not counters.sets.any(), counters.sets
    counters.raise_if_stalled()
    if traced:
        check_trace(trace, lens, hidden, intermediate, head_dim, splits=3, l2_prefetch=l2_prefetch)


def test_a_wait_that_cannot_end_gives_up_and_is_reported():
    """Counters that are not at zero when a launch begins (here q|k|v's, 1,000 short) would leave
    the split programs waiting for ever: each gives up (after WAIT_LIMIT_NS on a GPU, a few reads
    under the interpreter) and records what it saw, the launch ends, its last program still
    zeroes the counters, and `raise_if_stalled` names the phase waited for and the counts (the
    first counter that a wait gave up on)."""
    _, _, _, k_cache, v_cache, tables, lens, positions, cos_sin, _, slots = step(torch.float32, 32, [40], seed=1)
    gen = torch.Generator().manual_seed(2)
    w = layer_weights(torch.float32, 32, 64, 128, True, False, gen, k_cache.device)
    x = torch.randn(1, 64, generator=gen).to(k_cache.device)
    counters = LayerCounters(k_cache.device)
    counters.sets[0, 1] = -1000  # the q|k|v programs' count
    decode_layer(x, None, w, positions, cos_sin, k_cache, v_cache, tables, lens, slots, 0.1, counters)
    qkv_programs = -(-(HEADS + 2 * KV_HEADS) * 32 // default_layer_tiling(64).normed_block_n)
    with pytest.raises(RuntimeError, match=f"waiting for q\\|k\\|v gave up .* having seen {qkv_programs - 1000} "
                                           f"of its {qkv_programs} programs done"):
        counters.raise_if_stalled()
    if not k_cache.is_cuda:
        # The interpreter's programs run in ticket order, so every later wait (for split
        # attention, the combine, o_proj, gate|up) finds its phase done. On a GPU the later
        # phases' programs wait at the same time as the split programs, and their waits may run
        # out too: only the first is checked there.
        assert counters.stalls[2:].eq(-1).all(), counters.stalls
    assert not counters.sets.any(), counters.sets


def test_a_persistent_program_sent_back_by_zeroed_counters_stops_and_is_reported():
    """Counters zeroed in the middle of a launch (here the count of finished tickets starts 10
    ahead, so that its last count comes early) would send persistent programs round the tickets
    again for ever: a program whose next draw is not past the ticket it holds records it and
    stops, and `raise_if_stalled` says so."""
    _, _, _, k_cache, v_cache, tables, lens, positions, cos_sin, _, slots = step(torch.float32, 32, [40], seed=1)
    gen = torch.Generator().manual_seed(2)
    w = layer_weights(torch.float32, 32, 64, 128, True, False, gen, k_cache.device)
    x = torch.randn(1, 64, generator=gen).to(k_cache.device)
    counters = LayerCounters(k_cache.device)
    counters.sets[0, 6] = 10  # the finished tickets' count
    decode_layer(x, None, w, positions, cos_sin, k_cache, v_cache, tables, lens, slots, 0.1, counters,
                 replace(default_layer_tiling(64), persistent_programs=5))
    with pytest.raises(RuntimeError, match=r"a persistent program drew ticket \d+ after ticket \d+: the counters "
                                           r"were zeroed while its launch ran"):
        counters.raise_if_stalled()


@pytest.mark.slow  # as above
def test_shorter_splits_attend_as_the_six_launches_do():
    """Splits of at least 64 context tokens instead of 128 (`LayerTiling.min_tokens_per_split`):
    row 0 takes 3 splits where the six launches take 2, so the two sum in another order and
    agree within rounding."""
    dtype, head_dim, hidden, intermediate, lens = torch.float32, 64, 100, 164, [150, 40]
    _, _, _, k_cache, v_cache, tables, lens_t, positions, cos_sin, _, slots = step(dtype, head_dim, lens, seed=9)
    gen = torch.Generator().manual_seed(13)
    device = k_cache.device
    w = layer_weights(dtype, head_dim, hidden, intermediate, True, False, gen, device)
    x, residual = (torch.randn(len(lens), hidden, generator=gen).to(device) for _ in range(2))
    args = (positions, cos_sin, k_cache, v_cache, tables, lens_t, slots, head_dim**-0.5)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    want, want_residual = decode_layer_in_six_launches(x, residual, w, *args[:2], k_ref, v_ref, *args[4:])
    tiling = replace(default_layer_tiling(hidden), min_tokens_per_split=64)
    trace = LayerTrace()
    got, got_residual = decode_layer(x, residual, w, *args, LayerCounters(device), tiling, trace)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_residual, want_residual, rtol=1e-5, atol=1e-5)  # it adds attention's output
    assert trace.summary()["split"]["programs"] == (3 + 1) * KV_HEADS


def check_trace(trace, lens, hidden, intermediate, head_dim, splits, l2_prefetch):
    """The trace's phases have the launch's program counts (splits: the grid's, which the
    cases' 24-block tables cap at 3), and its times respect the waits."""
    rows_per = default_layer_tiling(hidden)
    used = [min(max(-(-n // 128), 1), splits) for n in lens]  # 128 tokens a split
    weight_bytes = [hidden * HEADS * head_dim * 4, 2 * intermediate * hidden * 4, hidden * intermediate * 4,
                    (HEADS + 2 * KV_HEADS) * head_dim * hidden * 4]  # o, gate|up, down, the next q|k|v (fp32)
    want = {"q|k|v": -(-(HEADS + 2 * KV_HEADS) * head_dim // rows_per.normed_block_n),
            "split": sum(used) * KV_HEADS, "idle split": (len(lens) * splits - sum(used)) * KV_HEADS,
            "prefetch": sum(-(-b // (PREFETCH_LINES * 128)) for b in weight_bytes[:l2_prefetch]),
            "combine": len(lens) * HEADS, "o_proj": -(-hidden // rows_per.skinny_block_n),
            "gate|up": -(-intermediate // rows_per.normed_block_n), "down": -(-hidden // rows_per.skinny_block_n)}
    assert {name: phase["programs"] for name, phase in trace.summary().items()} == want
    times, phases = trace.times.cpu(), trace.phases
    assert (times[:, 0] <= times[:, 1]).all() and (times[:, 1] <= times[:, 2]).all()
    waits = {"split": ["q|k|v"], "combine": ["split", "idle split"], "o_proj": ["combine"], "gate|up": ["o_proj"],
             "down": ["gate|up"]}
    for waiting, waited_for in waits.items():
        began = times[phases == LayerTrace.PHASES.index(waiting), 1].min()
        for name in waited_for:
            assert began >= times[phases == LayerTrace.PHASES.index(name), 0].max(), (waiting, name)


def test_what_the_layer_kernel_does_not_take_is_refused():
    _, _, _, k_cache, v_cache, tables, lens, positions, cos_sin, _, slots = step(torch.float32, 32, [5])
    gen = torch.Generator().manual_seed(0)
    w = layer_weights(torch.float32, 32, 64, 128, True, False, gen, k_cache.device)
    x = torch.randn(1, 64).to(k_cache.device)
    counters = LayerCounters(k_cache.device)
    args = (positions, cos_sin, k_cache, v_cache, tables, lens, slots, 0.1, counters)
    with pytest.raises(ValueError, match="x must be"):
        decode_layer(x.expand(9, 64), None, w, *args)
    with pytest.raises(ValueError, match="residual has shape"):
        decode_layer(x, torch.zeros(1, 32, device=x.device), w, *args)
    with pytest.raises(ValueError, match="dtypes"):
        decode_layer(x.double(), None, w, *args)
    with pytest.raises(ValueError, match="counters must be"):
        decode_layer(x, None, w, *args[:-1], counters.sets[0])
    with pytest.raises(ValueError, match="min_tokens_per_split is 0, at least 1"):
        decode_layer(x, None, w, *args, replace(default_layer_tiling(64), min_tokens_per_split=0))
    with pytest.raises(ValueError, match="persistent_programs is -1, at least 0"):
        decode_layer(x, None, w, *args, replace(default_layer_tiling(64), persistent_programs=-1))
    with pytest.raises(ValueError, match="l2_prefetch is 5, at most 4"):
        decode_layer(x, None, w, *args, replace(default_layer_tiling(64), l2_prefetch=5))
    with pytest.raises(ValueError, match="next_qkv has shape"):
        decode_layer(x, None, replace(w, next_qkv=w.qkv[:, :32]), *args)
    with pytest.raises(ValueError, match="next_qkv must be contiguous"):
        decode_layer(x, None, replace(w, next_qkv=w.qkv.t().contiguous().t()), *args)


def test_persistent_programs_get_their_registers_limited_so_that_all_fit_the_gpu_at_once():
    """64K registers an SM shared by the programs asked to run on it, in multiples of 8 a thread
    and whole fours of warps; no limit for one an SM; refused where a thread would get fewer than
    64."""
    assert persistent_register_limit(132, 132, 8) == 0
    assert persistent_register_limit(100, 132, 8) == 0
    assert persistent_register_limit(264, 132, 8) == 128
    assert persistent_register_limit(133, 132, 8) == 128  # one SM gets two
    assert persistent_register_limit(3 * 132, 132, 8) == 80
    assert persistent_register_limit(4 * 132, 132, 8) == 64
    assert persistent_register_limit(2 * 132, 132, 4) == 255  # the most a thread can address
    assert persistent_register_limit(5 * 132, 132, 2) == 96  # 2 warps counted as 4 (else 200)
    with pytest.raises(ValueError, match=r"660 persistent programs of 8 warps on 132 SMs \(5 an SM\) leave 48 "
                                         r"registers a thread, at least 64"):
        persistent_register_limit(5 * 132, 132, 8)
