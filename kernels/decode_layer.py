"""A Llama-family decoder layer's decode step for a few rows in one launch.

A decode step of a small model at batch 1 or 2 is six short kernels a layer (norm + q|k|v,
split attention, its combine, o_proj, norm + gate|up + SwiGLU, down), each a few microseconds
of weight streaming behind its own launch, ramp and tail: a step of Qwen3-0.6B on an H100
spends more time between and at the edges of its kernels than at the memory's rate. Here the
six are phases of one grid, and a program of a later phase waits, on the device, for the
phase before it instead of for a kernel boundary: its weight tile is loaded before it waits,
so one phase's weights stream in while the phase in front finishes. Programs of their own may
also ask the L2 for the weights of the products after attention, which then stream in during
attention's latency-bound steps (`LayerTiling.l2_prefetch`).

Programs do not take their work from `program_id`: each draws a ticket (an atomic counter),
and tickets are handed out phase by phase in order. A program waits only for phases whose
tickets are all lower than its own, and a lower ticket was drawn by a program that has
started, so as long as started programs keep running (as GPUs run them), every wait ends
whatever order the GPU starts programs in and however few fit on it at once (the Triton
interpreter, which runs programs one after another, never waits at all). A phase counts its
finished programs on a counter of its own: a program's stores, a barrier, then a release add;
one thread of a waiting program reads it with acquire, pausing between reads, and a barrier
then lets the program's other threads on. The last program to finish zeroes the counters.

Where the launch is persistent (`LayerTiling.persistent_programs`), a few programs take ticket
after ticket instead, each drawing its next while the one it holds loads its first weight tile,
so that none starts late and waits for its ticket before it can load anything. The argument
holds: a program holds at most its current ticket and the next, finishes the current first,
and waits only for lower tickets. Each program's last draw, which finds nothing left, is
counted with the finished tickets, so that the last count still zeroes the counters.

A wait that has not ended after `WAIT_LIMIT_NS` (a quarter of a second, where a whole launch
takes microseconds) cannot end: a fault of the kernel or its launcher. The program then records
what it saw (`LayerCounters.stalls`) and goes on, so the launch ends, with wrong outputs, instead
of hanging the GPU; `LayerCounters.raise_if_stalled` reports it, naming the phase waited for.

A launch's counters must be at zero when its first program draws a ticket. Each layer
(`LayerCounters`) keeps two sets and its launches take them in turn; a program lets the next
launch start (programmatic dependent launch) only once the kernel in front has finished, so the
launch two ahead, the next on the same set, starts after this one has finished and zeroed it.
(The programs that ask the L2 for weights, which read nothing a kernel writes, end without
waiting for the kernel in front; a program that ends counts as letting the next launch start,
but every launch has q|k|v programs, which wait first, so the rule holds for the launch as a
whole.) Launches of different layers use
different counters. (In the engine a step's launches of a layer are further apart: kernels
launched without programmatic dependence, which wait for everything before them, sit between
them; each captured graph keeps the set it was captured with, and its replays never overlap.)

The phases run the separate kernels' code (`normed_program`, `decode_split_program`,
`combine_program`, `skinny_program`), so under the interpreter the outputs equal the six
launches' bit for bit; compiled, a launch of 8 warps may sum in another order than the
separate kernels' 4 and differ in the last bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from . import decode_split_policy
from .decode_split_policy import MAX_SPLITS, grid_splits, num_sms, splits_for_lengths
from .normed_skinny_matmul import MAX_NORMED_K, normed_program, normed_skinny_matmul, normed_weight_tiles
from .paged_decode_attention import NewToken, check_decode_args, paged_decode_attention, split_tiles
from .paged_decode_kernels import combine_program, decode_split_program, splits_for
from .programmatic_launch import gdc_launch_dependents, gdc_wait, launch_options, programmatic_launch
from .qk_norm_rope_store import check_qk_norm_rope_args
from .skinny_matmul import SKINNY_ROWS, default_skinny_tiling, skinny_first_tile, skinny_matmul, skinny_program
from .triton_types import TL_DTYPES

# The counters of one layer's launches: [ticket, q|k|v done, splits done, combines done, o_proj
# done, gate|up done, programs finished, unused].
COUNTERS_PER_LAYER = 8
_TICKET, _QKV_DONE, _SPLITS_DONE, _COMBINES_DONE, _O_DONE, _GATE_UP_DONE, _FINISHED = (
    tl.constexpr(i) for i in range(7))
_COUNTERS = tl.constexpr(COUNTERS_PER_LAYER)


# What the programs of a phase wait for, by the counter they wait on.
_WAITED_FOR = {_QKV_DONE.value: "q|k|v", _SPLITS_DONE.value: "split attention", _COMBINES_DONE.value: "the combine",
               _O_DONE.value: "o_proj", _GATE_UP_DONE.value: "gate|up"}
# A wait that lasts longer cannot end (the module's docstring).
WAIT_LIMIT_NS = 250_000_000
# Reads of a counter the interpreter's wait makes before it gives up: its programs run one after
# another in ticket order, so every wait it meets is over before it starts.
INTERPRETER_WAIT_READS = 100
_INTERPRETER_WAIT_READS = tl.constexpr(INTERPRETER_WAIT_READS)


class LayerCounters:
    """One layer's two sets of counters, at zero, which its launches take in turn (the
    module's docstring), and the record of waits that gave up (`stalls`). Make them before any
    CUDA-graph capture that launches the layer."""

    def __init__(self, device: torch.device):
        self.sets = torch.zeros(2, COUNTERS_PER_LAYER, dtype=torch.int32, device=device)
        # For each counter: what the last wait on it that gave up saw, and its target; -1, -1
        # while none has (for the ticket counter: a persistent program's next draw that was not
        # past the ticket it held). Never cleared by the kernel.
        self.stalls = torch.full((COUNTERS_PER_LAYER, 2), -1, dtype=torch.int32, device=device)
        self._next = 0

    def take(self) -> torch.Tensor:
        """The set the next launch uses."""
        counters = self.sets[self._next]
        self._next ^= 1
        return counters

    def raise_if_stalled(self) -> None:
        """RuntimeError if a launch's wait ever gave up (the launch's outputs are wrong); waits
        for the launches before it (a sync)."""
        for counter, (seen, target) in enumerate(self.stalls.tolist()):
            if target >= 0 and counter == _TICKET.value:
                raise RuntimeError(f"decode_layer: a persistent program drew ticket {seen} after ticket {target - 1}: "
                                   f"the counters were zeroed while its launch ran, whose outputs are wrong")
            if target >= 0:
                phase = _WAITED_FOR.get(counter, f"counter {counter}")
                raise RuntimeError(
                    f"decode_layer: programs waiting for {phase} gave up waiting ({WAIT_LIMIT_NS / 1e9:g} s on a "
                    f"GPU), having seen {seen} of its {target} programs done: that launch's outputs are wrong (a "
                    f"fault of the kernel or of its counters)")


@triton.jit
def _count_done(counter_ptr):
    """Count this program's phase work done: every thread's stores come before the count."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release")


@triton.jit
def _draw_next(counters_ptr, total, PERSISTENT: tl.constexpr):
    """The ticket a program takes after the one it holds: a new one where PERSISTENT, else
    `total` (none)."""
    if PERSISTENT:
        return tl.atomic_add(counters_ptr + _TICKET, 1, sem="relaxed")
    else:
        return total


@triton.jit
def _count_finished(counters_ptr, finish_count):
    """Count a ticket finished (or a persistent program's last, empty, draw). The last count
    (every other program has stopped reading the counters) zeroes them for the layer's next
    launch."""
    finished = tl.atomic_add(counters_ptr + _FINISHED, 1, sem="acq_rel")
    if finished == finish_count - 1:
        tl.store(counters_ptr + tl.arange(0, _COUNTERS), tl.zeros([_COUNTERS], tl.int32))


@triton.jit
def _after_the_kernel_in_front(PDL: tl.constexpr):
    """Wait until the kernel in front has finished, then let the next launch start (both only
    with programmatic dependent launch, where this launch may start before that kernel ends)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


# The wait's loop in PTX, for one thread of the program (thread 0; the others go on to the
# barrier after it): hundreds of programs may wait on one counter at once, and their threads'
# reads would crowd the cache line that the counting programs add to. Thread 0 reads with
# acquire, and pauses between reads; every 256th read (a read takes hundreds of nanoseconds, so
# the clock costs nothing on the way of a wait that ends) it reads the GPU's global clock, and
# past WAIT_LIMIT_NS it stores what it saw and the target at $3 (the counter's place in
# `LayerCounters.stalls`) and gives up. Labels are local to the braces, so the loop may be
# inlined at every wait.
_SPIN = tl.constexpr("""{
    .reg .pred not_first, waiting, not_yet, in_time;
    .reg .u32 thread, reads, every;
    .reg .s32 seen;
    .reg .s64 began, waited;
    mov.u32 thread, %tid.x;
    setp.ne.u32 not_first, thread, 0;
    mov.s32 $0, 0;
    @not_first bra DONE;
    mov.u64 began, %globaltimer;
    mov.u32 reads, 0;
    SPIN:
    ld.acquire.gpu.global.s32 seen, [$1];
    setp.lt.s32 waiting, seen, $2;
    @!waiting bra DONE;
    nanosleep.u32 64;
    add.u32 reads, reads, 1;
    and.b32 every, reads, 255;
    setp.ne.u32 not_yet, every, 0;
    @not_yet bra SPIN;
    mov.u64 waited, %globaltimer;
    sub.s64 waited, waited, began;
    setp.lt.s64 in_time, waited, """ + str(WAIT_LIMIT_NS) + """;
    @in_time bra SPIN;
    st.global.s32 [$3], seen;
    st.global.s32 [$3+4], $2;
    DONE:
}""")


@triton.jit
def _wait_until(counter_ptr, target, stall_ptr, INLINE_PTX: tl.constexpr):
    """Wait for `target` programs to have counted on counter_ptr; then what they stored before
    counting is visible to all of this program's threads. A wait that cannot end (the module's
    docstring) stores what it saw and the target at stall_ptr and gives up. Without INLINE_PTX
    (under the interpreter, whose waits are over before they start) the loop is Triton's."""
    if INLINE_PTX:
        tl.inline_asm_elementwise(_SPIN, "=r,l,r,l", [counter_ptr, target, stall_ptr], dtype=tl.int32,
                                  is_pure=False, pack=1)
    else:
        seen = tl.load(counter_ptr, volatile=True)
        reads = target * 0
        while (seen < target) & (reads < _INTERPRETER_WAIT_READS):
            seen = tl.load(counter_ptr, volatile=True)
            reads += 1
        if seen < target:
            tl.store(stall_ptr, seen)
            tl.store(stall_ptr + 1, target)
        tl.atomic_add(counter_ptr, 0, sem="acquire")
    tl.debug_barrier()


# The L2 asked for one 128-byte line of a weight (`_ask_l2_for`): nothing comes back, and nothing
# waits for it.
_PREFETCH_L2 = tl.constexpr("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;")
L2_LINE_BYTES = 128
# Lines a prefetching program asks for (256 KiB): eight a thread at 8 warps.
PREFETCH_LINES = 2048


@triton.jit
def _ask_l2_for(w_ptr, numel, part, LINES: tl.constexpr, LINE_ELEMENTS: tl.constexpr):
    """Ask the L2 for lines part * LINES .. of the weight at w_ptr (numel elements; a part past
    its end asks for its last line again)."""
    offs = (part * LINES + tl.arange(0, LINES)).to(tl.int64) * LINE_ELEMENTS
    tl.inline_asm_elementwise(_PREFETCH_L2, "=r,l", [w_ptr + tl.minimum(offs, numel - 1)], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _clock_ns(ticket, TRACE: tl.constexpr, INLINE_PTX: tl.constexpr):
    """The GPU's global clock in nanoseconds where the launch is traced (`LayerTrace`); 0 where
    it is not, and under the interpreter."""
    if TRACE and INLINE_PTX:
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [ticket], dtype=tl.int64,
                                         is_pure=False, pack=1)
    else:
        return ticket.to(tl.int64) * 0


# Not inlined: in the loop of a persistent program, the compiler would hoist what every phase
# computes from its constants out of the loop and hold it all in registers at once (Triton 3.9
# for sm_90, 173-238 registers a thread against 91-116 apart: one 8-warp program an SM, not
# two). Triton 3.6 inlines it all the same (150-157), hence `persistent_register_limit`.
@triton.jit(noinline=True)
def _take_ticket(
    ticket, total, finish_count,
    x_ptr, res_ptr, positions_ptr, cos_sin_ptr, slot_mapping_ptr, block_tables_ptr, context_lens_ptr,
    k_cache_ptr, v_cache_ptr,
    in_norm_ptr, qkv_w_ptr, qkv_b_ptr, q_norm_ptr, k_norm_ptr, o_w_ptr, post_norm_ptr, gate_up_w_ptr, down_w_ptr,
    next_qkv_w_ptr,
    qkv_ptr, attn_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, o_ptr, res1_ptr, act_ptr, out_ptr, res2_ptr,
    counters_ptr, stalls_ptr, trace_ptr,
    M, hidden, intermediate, num_heads, num_kv_heads, eps, qk_eps, scale, grid_splits,
    n_qkv_programs, n_split_programs,
    n_o_prefetch_programs, n_gate_up_prefetch_programs, n_down_prefetch_programs, n_next_qkv_prefetch_programs,
    n_combine_programs, n_o_programs, n_gate_up_programs, n_down_programs,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt, stride_cs,
    ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
    NORMED_BLOCK_N: tl.constexpr, NORMED_BLOCK_K: tl.constexpr,
    SKINNY_BLOCK_N: tl.constexpr, O_BLOCK_K: tl.constexpr, O_EVEN_K: tl.constexpr,
    DOWN_BLOCK_K: tl.constexpr, DOWN_EVEN_K: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, HAS_QKV_BIAS: tl.constexpr, QK_NORM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, ONE_SPLIT: tl.constexpr, MIN_TOKENS: tl.constexpr,
    BLOCK_G: tl.constexpr, ATTN_BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr,
    BLOCK_S: tl.constexpr, LINES_A_PROGRAM: tl.constexpr, LINE_ELEMENTS: tl.constexpr,
    PERSISTENT: tl.constexpr,
    PDL: tl.constexpr, INLINE_PTX: tl.constexpr, TRACE: tl.constexpr,
):
    """One ticket's work (`decode_layer_kernel`); the ticket the program takes next (where
    PERSISTENT, else `total`)."""
    q_size = num_heads * HEAD_DIM
    kv_size = num_kv_heads * HEAD_DIM
    n_qkv = q_size + 2 * kv_size
    end_qkv = n_qkv_programs
    end_split = end_qkv + n_split_programs
    end_prefetch = (end_split + n_o_prefetch_programs + n_gate_up_prefetch_programs + n_down_prefetch_programs
                    + n_next_qkv_prefetch_programs)
    end_combine = end_prefetch + n_combine_programs
    end_o = end_combine + n_o_programs
    end_gate_up = end_o + n_gate_up_programs
    started = _clock_ns(ticket, TRACE, INLINE_PTX)
    released = started  # when the ticket's phase work begins: after its wait
    if ticket < end_qkv:
        # Input norm (with the residual add) and q|k|v; program 0 writes the new residual.
        pid = ticket
        qkv_tile, qkv_tile_again, in_norm = normed_weight_tiles(pid, qkv_w_ptr, in_norm_ptr, n_qkv, hidden,
                                                                hidden, NORMED_BLOCK_N, NORMED_BLOCK_K, False)
        # The next ticket is drawn while this one's first weight tile loads.
        next_ticket = _draw_next(counters_ptr, total, PERSISTENT)
        _after_the_kernel_in_front(PDL)  # x and the residual come from it
        released = _clock_ns(ticket, TRACE, INLINE_PTX)
        normed_program(pid, qkv_tile, qkv_tile_again, in_norm, x_ptr, res_ptr, qkv_b_ptr, qkv_ptr, res1_ptr,
                       M, n_qkv, hidden, eps,
                       hidden, hidden, n_qkv, hidden, ROWS, NORMED_BLOCK_N, NORMED_BLOCK_K,
                       HAS_RESIDUAL, HAS_QKV_BIAS, False)
        _count_done(counters_ptr + _QKV_DONE)
    elif ticket < end_split:
        # Split attention; it prepares (q/k norm, RoPE) and stores the new token itself.
        item = ticket - end_qkv
        seq = (item // (num_kv_heads * grid_splits)).to(tl.int64)
        kv_head = (item // grid_splits) % num_kv_heads
        split = item % grid_splits
        next_ticket = _draw_next(counters_ptr, total, PERSISTENT)
        _after_the_kernel_in_front(PDL)  # the context lengths may come from it
        # A split past what its sequence uses (most of the grid's at batch 1 over a short
        # context) counts itself done without waiting for q|k|v: its place on the SM goes to a
        # later phase's program, which starts streaming its weights.
        if split < splits_for(tl.load(context_lens_ptr + seq), grid_splits, MIN_TOKENS):
            _wait_until(counters_ptr + _QKV_DONE, n_qkv_programs, stalls_ptr + 2 * _QKV_DONE, INLINE_PTX)
            released = _clock_ns(ticket, TRACE, INLINE_PTX)
            decode_split_program(
                seq, kv_head, split,
                qkv_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                attn_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
                scale,
                n_qkv, HEAD_DIM,
                stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                q_size, HEAD_DIM, stride_bt,
                num_heads, num_kv_heads, grid_splits,
                qkv_ptr + q_size, qkv_ptr + q_size + kv_size, positions_ptr, cos_sin_ptr, q_norm_ptr,
                k_norm_ptr,
                slot_mapping_ptr, qk_eps,
                n_qkv, HEAD_DIM, n_qkv, HEAD_DIM, stride_cs,
                counters_ptr,
                BLOCK_SIZE, GROUP, HEAD_DIM, ONE_SPLIT, MIN_TOKENS, BLOCK_G, ATTN_BLOCK_N, BLOCK_D, DOT_DTYPE,
                True, QK_NORM, False, 0, False,  # no early tile: it waited for q|k|v above
            )
        _count_done(counters_ptr + _SPLITS_DONE)
    elif ticket < end_prefetch:
        next_ticket = _draw_next(counters_ptr, total, PERSISTENT)
        # Ask the L2 for the weights of the products after attention, and of the next layer's
        # q|k|v (`LayerTiling.l2_prefetch`), so that they stream in while attention's chain of
        # short steps, then the kernel boundary, leave the memory idle.
        # Weights are never written, so there is nothing to wait for (the interpreter has no L2).
        if INLINE_PTX:
            # o_proj's parts first, then gate|up's, down's and the next layer's q|k|v.
            part = ticket - end_split
            weight, numel = o_w_ptr, hidden * q_size
            if part >= n_o_prefetch_programs:
                part -= n_o_prefetch_programs
                weight, numel = gate_up_w_ptr, 2 * intermediate * hidden
                if part >= n_gate_up_prefetch_programs:
                    part -= n_gate_up_prefetch_programs
                    weight, numel = down_w_ptr, hidden * intermediate
                    if part >= n_down_prefetch_programs:
                        part -= n_down_prefetch_programs
                        weight, numel = next_qkv_w_ptr, n_qkv * hidden
            _ask_l2_for(weight, numel, part, LINES_A_PROGRAM, LINE_ELEMENTS)
    elif ticket < end_combine:
        next_ticket = _draw_next(counters_ptr, total, PERSISTENT)
        # The splits' combine, per (sequence, query head); nothing for a one-split sequence.
        _after_the_kernel_in_front(PDL)
        _wait_until(counters_ptr + _SPLITS_DONE, n_split_programs, stalls_ptr + 2 * _SPLITS_DONE, INLINE_PTX)
        released = _clock_ns(ticket, TRACE, INLINE_PTX)
        item = ticket - end_prefetch
        combine_program((item // num_heads).to(tl.int64), item % num_heads, part_acc_ptr, part_max_ptr,
                        part_sum_ptr, tl.load(context_lens_ptr + item // num_heads), attn_ptr, q_size, HEAD_DIM,
                        num_heads, grid_splits,
                        HEAD_DIM, MIN_TOKENS, BLOCK_S, BLOCK_D)
        _count_done(counters_ptr + _COMBINES_DONE)
    elif ticket < end_o:
        # o_proj.
        pid = ticket - end_combine
        o_tile = skinny_first_tile(pid, o_w_ptr, hidden, q_size, q_size, SKINNY_BLOCK_N, O_BLOCK_K, O_EVEN_K)
        # The next ticket is drawn while this one's first weight tile loads.
        next_ticket = _draw_next(counters_ptr, total, PERSISTENT)
        _after_the_kernel_in_front(PDL)
        _wait_until(counters_ptr + _COMBINES_DONE, n_combine_programs, stalls_ptr + 2 * _COMBINES_DONE,
                    INLINE_PTX)
        released = _clock_ns(ticket, TRACE, INLINE_PTX)
        skinny_program(pid, o_tile, attn_ptr, o_w_ptr, o_w_ptr, o_ptr, M, hidden, q_size, q_size, q_size,
                       hidden, ROWS, SKINNY_BLOCK_N, O_BLOCK_K, O_EVEN_K, False)
        _count_done(counters_ptr + _O_DONE)
    elif ticket < end_gate_up:
        # Post-attention norm (with the residual add), gate|up and SwiGLU; program 0 writes the
        # layer's new residual.
        pid = ticket - end_o
        gate_tile, up_tile, post_norm = normed_weight_tiles(pid, gate_up_w_ptr, post_norm_ptr, intermediate,
                                                            hidden, hidden, NORMED_BLOCK_N, NORMED_BLOCK_K, True)
        # The next ticket is drawn while this one's first weight tile loads.
        next_ticket = _draw_next(counters_ptr, total, PERSISTENT)
        _after_the_kernel_in_front(PDL)
        _wait_until(counters_ptr + _O_DONE, n_o_programs, stalls_ptr + 2 * _O_DONE, INLINE_PTX)
        released = _clock_ns(ticket, TRACE, INLINE_PTX)
        normed_program(pid, gate_tile, up_tile, post_norm, o_ptr, res1_ptr, o_ptr, act_ptr, res2_ptr,
                       M, intermediate, hidden,
                       eps, hidden, hidden, intermediate, hidden, ROWS, NORMED_BLOCK_N, NORMED_BLOCK_K,
                       True, False, True)
        _count_done(counters_ptr + _GATE_UP_DONE)
    else:
        # down_proj: the layer's output.
        pid = ticket - end_gate_up
        down_tile = skinny_first_tile(pid, down_w_ptr, hidden, intermediate, intermediate, SKINNY_BLOCK_N,
                                      DOWN_BLOCK_K, DOWN_EVEN_K)
        # The next ticket is drawn while this one's first weight tile loads.
        next_ticket = _draw_next(counters_ptr, total, PERSISTENT)
        _after_the_kernel_in_front(PDL)
        _wait_until(counters_ptr + _GATE_UP_DONE, n_gate_up_programs, stalls_ptr + 2 * _GATE_UP_DONE,
                    INLINE_PTX)
        released = _clock_ns(ticket, TRACE, INLINE_PTX)
        skinny_program(pid, down_tile, act_ptr, down_w_ptr, down_w_ptr, out_ptr, M, hidden, intermediate,
                       intermediate, intermediate, hidden, ROWS, SKINNY_BLOCK_N, DOWN_BLOCK_K, DOWN_EVEN_K, False)
    if TRACE:
        times = tl.arange(0, 4)
        ended = _clock_ns(ticket, TRACE, INLINE_PTX)
        when = tl.where(times == 0, started, tl.where(times == 1, released, ended))
        tl.store(trace_ptr + ticket.to(tl.int64) * 3 + times, when, mask=times < 3)
    _count_finished(counters_ptr, finish_count)
    # A ticket drawn is past the one held, unless the counters were zeroed under the launch (a
    # fault): then the program records it and stops, rather than take the work round again.
    if next_ticket <= ticket:
        tl.store(stalls_ptr + 2 * _TICKET, next_ticket)
        tl.store(stalls_ptr + 2 * _TICKET + 1, ticket + 1)
        next_ticket = total
    return next_ticket


@triton.jit
def decode_layer_kernel(
    x_ptr, res_ptr, positions_ptr, cos_sin_ptr, slot_mapping_ptr, block_tables_ptr, context_lens_ptr,
    k_cache_ptr, v_cache_ptr,
    in_norm_ptr, qkv_w_ptr, qkv_b_ptr, q_norm_ptr, k_norm_ptr, o_w_ptr, post_norm_ptr, gate_up_w_ptr, down_w_ptr,
    next_qkv_w_ptr,
    qkv_ptr, attn_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, o_ptr, res1_ptr, act_ptr, out_ptr, res2_ptr,
    counters_ptr, stalls_ptr, trace_ptr,
    M, hidden, intermediate, num_heads, num_kv_heads, eps, qk_eps, scale, grid_splits,
    n_qkv_programs, n_split_programs,
    n_o_prefetch_programs, n_gate_up_prefetch_programs, n_down_prefetch_programs, n_next_qkv_prefetch_programs,
    n_combine_programs, n_o_programs, n_gate_up_programs, n_down_programs,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt, stride_cs,
    ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
    NORMED_BLOCK_N: tl.constexpr, NORMED_BLOCK_K: tl.constexpr,
    SKINNY_BLOCK_N: tl.constexpr, O_BLOCK_K: tl.constexpr, O_EVEN_K: tl.constexpr,
    DOWN_BLOCK_K: tl.constexpr, DOWN_EVEN_K: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, HAS_QKV_BIAS: tl.constexpr, QK_NORM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, ONE_SPLIT: tl.constexpr, MIN_TOKENS: tl.constexpr,
    BLOCK_G: tl.constexpr, ATTN_BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_DTYPE: tl.constexpr,
    BLOCK_S: tl.constexpr, LINES_A_PROGRAM: tl.constexpr, LINE_ELEMENTS: tl.constexpr,
    n_programs, PERSISTENT: tl.constexpr,
    PDL: tl.constexpr, INLINE_PTX: tl.constexpr, TRACE: tl.constexpr,
):
    """One program of the layer's grid: phase and work item from its ticket (the module's
    docstring); where PERSISTENT, ticket after ticket until none is left (`LayerTiling.
    persistent_programs`). Rows of x are sequences; all buffers but the cache and weights are
    contiguous."""
    total = (n_qkv_programs + n_split_programs + n_o_prefetch_programs + n_gate_up_prefetch_programs
             + n_down_prefetch_programs + n_next_qkv_prefetch_programs + n_combine_programs + n_o_programs
             + n_gate_up_programs + n_down_programs)
    # Where PERSISTENT, each program's last draw finds no work left: it counts as finished too.
    finish_count = total + n_programs if PERSISTENT else total
    ticket = tl.atomic_add(counters_ptr + _TICKET, 1, sem="relaxed")
    # One pass for a program of each ticket (the next it takes is `total`).
    while ticket < total:
        ticket = _take_ticket(
            ticket, total, finish_count, x_ptr, res_ptr, positions_ptr, cos_sin_ptr, slot_mapping_ptr,
            block_tables_ptr, context_lens_ptr, k_cache_ptr, v_cache_ptr, in_norm_ptr, qkv_w_ptr, qkv_b_ptr,
            q_norm_ptr, k_norm_ptr, o_w_ptr, post_norm_ptr, gate_up_w_ptr, down_w_ptr, next_qkv_w_ptr, qkv_ptr,
            attn_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, o_ptr, res1_ptr, act_ptr, out_ptr, res2_ptr,
            counters_ptr, stalls_ptr, trace_ptr, M, hidden, intermediate, num_heads, num_kv_heads, eps, qk_eps,
            scale, grid_splits, n_qkv_programs, n_split_programs, n_o_prefetch_programs, n_gate_up_prefetch_programs,
            n_down_prefetch_programs, n_next_qkv_prefetch_programs, n_combine_programs, n_o_programs,
            n_gate_up_programs, n_down_programs, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            stride_bt, stride_cs, ROWS, HEAD_DIM, NORMED_BLOCK_N, NORMED_BLOCK_K, SKINNY_BLOCK_N, O_BLOCK_K,
            O_EVEN_K, DOWN_BLOCK_K, DOWN_EVEN_K, HAS_RESIDUAL, HAS_QKV_BIAS, QK_NORM, BLOCK_SIZE, GROUP, ONE_SPLIT,
            MIN_TOKENS, BLOCK_G, ATTN_BLOCK_N, BLOCK_D, DOT_DTYPE, BLOCK_S, LINES_A_PROGRAM, LINE_ELEMENTS,
            PERSISTENT, PDL, INLINE_PTX, TRACE,
        )
    if PERSISTENT:
        _count_finished(counters_ptr, finish_count)


def _interpreting() -> bool:
    """Whether Triton's interpreter runs the kernel (decided when Triton decorated it)."""
    return not isinstance(decode_layer_kernel, triton.runtime.JITFunction)


# How many of the products after attention (o_proj, gate|up, down, then the next layer's q|k|v)
# have their weights asked into the L2 as attention begins (`LayerTiling.l2_prefetch`). Off (0):
# on an H200 each product prefetched made the launch slower, since the prefetching programs take
# SM places from the products' (`benchmarks/gpu_decode_layer_sweep.py`, `gpu_decode.py
# --layer-l2-prefetch`).
L2_PREFETCH_PRODUCTS = 0
# Persistent programs an SM (`LayerTiling.persistent_programs`; 0: a program for each ticket).
# Off: slower on an H200 (the sweep, `gpu_decode.py --layer-persistent-per-sm`).
PERSISTENT_PROGRAMS_PER_SM = 0


@dataclass(frozen=True)
class LayerTiling:
    """One launch's shape, shared by its phases: weight rows a program of the normed products
    (q|k|v, gate|up) and of the plain ones (o_proj, down) owns, and warps a program; and how many
    of the products after attention (0-4: o_proj, then gate|up, down, and the next layer's q|k|v
    where `DecodeLayerWeights.next_qkv` names it) programs of their own ask the L2 to fetch ahead
    (their tickets follow the split programs': they start once every q|k|v program has). At
    batch 1 or 2 attention is a chain of short dependent steps (the new token, a few KV tiles,
    the combine) during which the memory would idle but for the few weight tiles the waiting
    programs of later phases hold; asked ahead, those products' weights stream in meanwhile and
    are read from the L2, and the next layer's q|k|v, asked too, streams in while this layer
    ends and the next begins (a kernel boundary, where the memory idles again)."""

    normed_block_n: int
    skinny_block_n: int
    num_warps: int
    l2_prefetch: int = 0
    # Context tokens a split takes at least: fewer make attention's chain shorter (fewer KV tiles
    # a program walks, in turn) and its combine wider. By default the separate kernel's, as it is
    # when the tiling is made.
    min_tokens_per_split: int = field(default_factory=lambda: decode_split_policy.MIN_TOKENS_PER_SPLIT)
    # 0: a program for each ticket, as many as the phases have work items. n: n programs (at
    # most the tickets; their registers limited so that all fit the GPU at once,
    # `persistent_register_limit`) that each take ticket after ticket, drawing the next while the
    # one they hold loads its first weight tile: no program starts late and waits for its ticket
    # (an atomic's round trip) before it knows what to load.
    persistent_programs: int = 0


# Every NVIDIA GPU since Kepler has 64K 32-bit registers an SM, allotted a warp at a time in
# multiples of 8 a thread; since Maxwell an SM's four schedulers each hold a quarter of them,
# for the warps dealt to it.
REGISTERS_AN_SM = 65536
SCHEDULERS_AN_SM = 4
# A thread's registers below which a layer's tiles would mostly spill: persistent programs that
# need fewer to fit are refused.
LEAST_REGISTERS_A_THREAD = 64


def persistent_register_limit(programs: int, sms: int, num_warps: int) -> int:
    """The registers a thread may take for `programs` persistent programs of `num_warps` warps to
    run on `sms` SMs at once (0: no limit, as at most one program an SM is asked for). A
    persistent program that does not fit starts only when a program that did ends, which is
    when the tickets have run out: it does no work and adds a program's start and end to the
    launch's tail. The ticket loop needs the limit: Triton 3.6 (the GPU image's) inlines
    `_take_ticket` into it and takes 150-157 registers a thread at Qwen3-0.6B's shapes, so two
    8-warp programs would not fit an SM, while at 128 the compiler keeps the one-row layer
    without spills. A program's warps are counted in whole fours, as if each scheduler had one
    of every four, so that a quarter of the registers is never outgrown however the warps of
    programs of 1-3 warps are dealt. ValueError where the limit would be below
    `LEAST_REGISTERS_A_THREAD`."""
    per_sm = triton.cdiv(programs, sms)
    if per_sm <= 1:
        return 0
    warps = triton.cdiv(num_warps, SCHEDULERS_AN_SM) * SCHEDULERS_AN_SM
    limit = min(255, REGISTERS_AN_SM // (per_sm * warps * 32) // 8 * 8)
    if limit < LEAST_REGISTERS_A_THREAD:
        raise ValueError(f"decode_layer: {programs} persistent programs of {num_warps} warps on {sms} SMs "
                         f"({per_sm} an SM) leave {limit} registers a thread, at least "
                         f"{LEAST_REGISTERS_A_THREAD}: ask for fewer programs or warps")
    return limit


def default_layer_tiling(hidden: int, sms: int = 0) -> LayerTiling:
    """Eight warps; eight weight rows a program for the plain products, and for the normed ones
    up to 1,024 inputs (two beyond, whose tiles hold all of K). One launch's registers are its
    most demanding phase's, for all of its programs: compiled for sm_90 at Qwen3-0.6B's shapes,
    4 warps take 178-187 registers a thread and 8 warps 92-118 (Triton 3.9 and 3.6), so two
    programs fit an SM either way and 8 warps bring twice the threads; at Llama-3.2-1B's (2,048
    inputs) two normed rows take 64-92 and four spill at one row. With two programs an SM, the
    plain products' tiles of two weight rows (the separate kernel's, which runs 16 programs an SM)
    would keep too few bytes in flight; eight rows keep 16 KB a program. Chosen from registers,
    not yet timed. L2 prefetch: `L2_PREFETCH_PRODUCTS`; persistent programs:
    `PERSISTENT_PROGRAMS_PER_SM` for each of the GPU's `sms`."""
    return LayerTiling(8 if hidden <= 1024 else 2, 8, 8, L2_PREFETCH_PRODUCTS,
                       persistent_programs=PERSISTENT_PROGRAMS_PER_SM * sms)


class LayerTrace:
    """Where one launch's time went (`decode_layer(..., trace=)`), for benchmarks: for each
    ticket (a program's, or a persistent program's turn), in ticket order, when it started, began
    its phase's work (after its wait) and ended, on the GPU's global clock (zeros under the
    interpreter), and its phase (`PHASES`; a split past its sequence's splits is an idle split)."""

    PHASES = ("q|k|v", "split", "idle split", "prefetch", "combine", "o_proj", "gate|up", "down")

    def __init__(self):
        self.times: torch.Tensor | None = None  # int64 [tickets, 3]: started, began, ended (ns)
        self.phases: torch.Tensor | None = None  # int64 [programs], an index into PHASES

    def start(self, programs, splits_used: torch.Tensor, num_kv_heads: int, grid_splits: int,
              device: torch.device) -> None:
        """Ready for a launch of `programs` (its phases' program counts, in ticket order);
        splits_used: the splits each sequence uses."""
        qkv, split, *prefetch, combine, o, gate_up, down = programs
        counts = (qkv, split, sum(prefetch), combine, o, gate_up, down)
        in_ticket_order = ("q|k|v", "split", "prefetch", "combine", "o_proj", "gate|up", "down")
        phases = torch.repeat_interleave(torch.tensor([self.PHASES.index(name) for name in in_ticket_order]),
                                         torch.tensor(counts))
        item = torch.arange(split)
        idle = item % grid_splits >= splits_used.long()[item // (num_kv_heads * grid_splits)]
        phases[qkv:qkv + split][idle] = self.PHASES.index("idle split")
        self.phases = phases
        self.times = torch.zeros(sum(counts), 3, dtype=torch.int64, device=device)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per phase: programs, and in microseconds from the launch's first start: its first and
        last start, its last program's beginning of work and its last end (waits for the GPU)."""
        times = self.times.cpu()
        times = times - times[:, 0].min()
        out = {}
        for index, name in enumerate(self.PHASES):
            phase = times[self.phases == index]
            if len(phase):
                out[name] = {"programs": len(phase), "first_start_us": phase[:, 0].min().item() / 1e3,
                             "last_start_us": phase[:, 0].max().item() / 1e3,
                             "last_began_us": phase[:, 1].max().item() / 1e3,
                             "last_end_us": phase[:, 2].max().item() / 1e3}
        return out


@dataclass(frozen=True)
class DecodeLayerWeights:
    """One layer's weights as the kernel reads them, all in the activations' dtype:
    input_norm [hidden]; qkv [(heads + 2 kv_heads) head_dim, hidden] (q|k|v rows) and its
    optional bias; q_norm / k_norm [head_dim] (Qwen3) or None; o [hidden, heads head_dim];
    post_norm [hidden]; gate_up [2 intermediate, hidden] (gate rows, then up); down
    [hidden, intermediate]. eps: both RMSNorms'; qk_eps: the per-head norms'. next_qkv: the
    q|k|v weight of the layer after this one, contiguous, or None: only ever asked into the L2
    (`LayerTiling.l2_prefetch` 4)."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    qk_eps: float
    next_qkv: torch.Tensor | None = None


def check_decode_layer_args(x: torch.Tensor, residual: torch.Tensor | None, w: DecodeLayerWeights) -> None:
    """ValueError naming what does not fit the kernel (cheap: shapes and dtypes only)."""
    if x.dim() != 2 or not 0 < x.shape[0] <= SKINNY_ROWS:
        raise ValueError(f"decode_layer: x must be [rows, hidden] with 1 to {SKINNY_ROWS} rows, got {tuple(x.shape)}")
    rows, hidden = x.shape
    q_size, kv_size = w.num_heads * w.head_dim, w.num_kv_heads * w.head_dim
    intermediate = w.down.shape[-1]
    expected = {
        "residual": (None if residual is None else tuple(residual.shape), (rows, hidden)),
        "input_norm": (tuple(w.input_norm.shape), (hidden,)),
        "qkv": (tuple(w.qkv.shape), (q_size + 2 * kv_size, hidden)),
        "o": (tuple(w.o.shape), (hidden, q_size)),
        "post_norm": (tuple(w.post_norm.shape), (hidden,)),
        "gate_up": (tuple(w.gate_up.shape), (2 * intermediate, hidden)),
        "down": (tuple(w.down.shape), (hidden, intermediate)),
        "qkv_bias": (None if w.qkv_bias is None else tuple(w.qkv_bias.shape), (q_size + 2 * kv_size,)),
        "next_qkv": (None if w.next_qkv is None else tuple(w.next_qkv.shape), (q_size + 2 * kv_size, hidden)),
    }
    for name, (got, want) in expected.items():
        if got is not None and got != want:
            raise ValueError(f"decode_layer: {name} has shape {got}, the layer needs {want}")
    if hidden > MAX_NORMED_K:
        raise ValueError(f"decode_layer: hidden size {hidden}, at most {MAX_NORMED_K}")
    tensors = [x, residual, w.input_norm, w.qkv, w.qkv_bias, w.q_norm, w.k_norm, w.o, w.post_norm, w.gate_up, w.down,
               w.next_qkv]
    dtypes = {t.dtype for t in tensors if t is not None}
    if x.dtype not in TL_DTYPES or len(dtypes) != 1:
        raise ValueError(f"decode_layer: dtypes {sorted(map(str, dtypes))} must be one of {list(TL_DTYPES)}")
    if w.next_qkv is not None and (not w.next_qkv.is_contiguous() or w.next_qkv.device != x.device):
        raise ValueError(f"decode_layer: next_qkv must be contiguous on {x.device}")
    if w.num_heads % w.num_kv_heads:
        raise ValueError(f"decode_layer: {w.num_heads} heads are not a multiple of {w.num_kv_heads} KV heads")


def decode_layer(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weights: DecodeLayerWeights,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: float,
    counters: LayerCounters,
    tiling: LayerTiling | None = None,
    trace: LayerTrace | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step of one Llama-family layer in one launch: (down_proj's output, the new
    residual), as the layer computes them from x and residual (None for the first layer, whose
    residual is then x) with `normed_skinny_matmul`, `paged_decode_attention` (new token
    prepared and stored: positions [rows] int64, cos_sin float32 [max_positions, head_dim],
    slot_mapping [rows], -1 stores nothing), `skinny_matmul`, the SwiGLU `normed_skinny_matmul`
    and `skinny_matmul` again. Row i is sequence i (block_tables [rows, width] int32,
    context_lens [rows] int32, the new token included). counters: this layer's, used by no
    other layer. trace: filled with when each program started, began its phase's work and
    ended (for benchmarks: it reads the context lengths back, a sync). ValueError for what it
    does not take."""
    w = weights
    check_decode_layer_args(x, residual, w)
    rows, hidden = x.shape
    q_size, kv_size = w.num_heads * w.head_dim, w.num_kv_heads * w.head_dim
    n_qkv, intermediate = q_size + 2 * kv_size, w.down.shape[-1]
    qkv = torch.empty(rows, n_qkv, dtype=x.dtype, device=x.device)
    q, k, v = qkv.view(rows, -1, w.head_dim).split([w.num_heads, w.num_kv_heads, w.num_kv_heads], dim=1)
    check_decode_args(q, k_cache, v_cache, block_tables, context_lens, None)
    check_qk_norm_rope_args(q, k, v, positions, cos_sin, w.q_norm, w.k_norm, k_cache, v_cache, slot_mapping)
    if not isinstance(counters, LayerCounters) or counters.sets.device != x.device:
        raise ValueError(f"decode_layer: counters must be the layer's LayerCounters on {x.device}")
    x = x.contiguous()
    residual = None if residual is None else residual.contiguous()
    block_tables, context_lens = block_tables.contiguous(), context_lens.contiguous()
    weights_in_order = [t.contiguous() for t in (w.input_norm, w.qkv, w.o, w.post_norm, w.gate_up, w.down)]
    input_norm, qkv_w, o_w, post_norm, gate_up_w, down_w = weights_in_order

    _, block_size, num_kv_heads, head_dim = k_cache.shape
    splits = grid_splits(rows, num_kv_heads, block_tables.shape[1] * block_size, num_sms(x.device))
    attn = torch.empty(rows, q_size, dtype=x.dtype, device=x.device)
    part_acc = torch.empty(rows, w.num_heads, splits, head_dim, dtype=torch.float32, device=x.device)
    part_max = torch.empty(rows, w.num_heads, splits, dtype=torch.float32, device=x.device)
    part_sum = torch.empty_like(part_max)
    o_out = torch.empty_like(x)
    new_residual = x if residual is None else torch.empty_like(x)
    act = torch.empty(rows, intermediate, dtype=x.dtype, device=x.device)
    out = torch.empty_like(x)
    layer_residual = torch.empty_like(x)

    tiling = tiling or default_layer_tiling(hidden, num_sms(x.device))
    if tiling.min_tokens_per_split < 1:
        raise ValueError(f"decode_layer: min_tokens_per_split is {tiling.min_tokens_per_split}, at least 1")
    if tiling.persistent_programs < 0:
        raise ValueError(f"decode_layer: persistent_programs is {tiling.persistent_programs}, at least 0 (0: a "
                         f"program for each ticket)")
    if tiling.l2_prefetch not in range(5):
        raise ValueError(f"decode_layer: l2_prefetch is {tiling.l2_prefetch}, at most 4 (the 3 products after "
                         f"attention and the next layer's q|k|v)")
    normed_n, skinny_n = tiling.normed_block_n, tiling.skinny_block_n
    # The plain products step through K as the separate kernel does by default, at most 1,024
    # inputs a step whatever `SKINNY_MAX_BLOCK_K` says: the steps the sm_90 compile checks within
    # the layer's register limit.
    o_block_k, down_block_k = (default_skinny_tiling(k, max_block_k=1024).block_k for k in (q_size, intermediate))
    line_elements = L2_LINE_BYTES // x.element_size()
    prefetch_programs = [triton.cdiv(weight.numel(), PREFETCH_LINES * line_elements)
                         if i < tiling.l2_prefetch and weight is not None else 0
                         for i, weight in enumerate((o_w, gate_up_w, down_w, w.next_qkv))]
    programs = (triton.cdiv(n_qkv, normed_n), rows * num_kv_heads * splits, *prefetch_programs, rows * w.num_heads,
                triton.cdiv(hidden, skinny_n), triton.cdiv(intermediate, normed_n), triton.cdiv(hidden, skinny_n))
    if trace is not None:
        trace.start(programs, splits_for_lengths(context_lens, splits, tiling.min_tokens_per_split).cpu(),
                    num_kv_heads, splits, x.device)
    group = w.num_heads // num_kv_heads
    block_g, attn_block_n, block_d, dot = split_tiles(group, head_dim, k_cache.dtype)
    pdl = programmatic_launch(x.device)
    tickets = sum(programs)
    persistent = tiling.persistent_programs > 0
    launched = min(tickets, tiling.persistent_programs) if persistent else tickets
    register_limit = persistent_register_limit(launched, num_sms(x.device), tiling.num_warps) if persistent else 0
    limits = {"maxnreg": register_limit} if register_limit else {}
    decode_layer_kernel[(launched,)](
        x, x if residual is None else residual, positions, cos_sin, slot_mapping, block_tables, context_lens,
        k_cache, v_cache,
        input_norm, qkv_w, qkv_w if w.qkv_bias is None else w.qkv_bias.contiguous(),
        x if w.q_norm is None else w.q_norm, x if w.k_norm is None else w.k_norm,
        o_w, post_norm, gate_up_w, down_w, qkv_w if w.next_qkv is None else w.next_qkv,
        qkv, attn, part_acc, part_max, part_sum, o_out, new_residual, act, out, layer_residual,
        counters.take(), counters.stalls, trace.times if trace is not None else counters.sets,
        rows, hidden, intermediate, w.num_heads, num_kv_heads, w.eps, w.qk_eps, scale, splits,
        *programs,
        *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0), cos_sin.stride(0),
        ROWS=triton.next_power_of_2(rows), HEAD_DIM=head_dim,
        NORMED_BLOCK_N=normed_n, NORMED_BLOCK_K=triton.next_power_of_2(hidden),
        SKINNY_BLOCK_N=skinny_n, O_BLOCK_K=o_block_k, O_EVEN_K=q_size % o_block_k == 0,
        DOWN_BLOCK_K=down_block_k, DOWN_EVEN_K=intermediate % down_block_k == 0,
        HAS_RESIDUAL=residual is not None, HAS_QKV_BIAS=w.qkv_bias is not None, QK_NORM=w.q_norm is not None,
        BLOCK_SIZE=block_size, GROUP=group, ONE_SPLIT=splits == 1, MIN_TOKENS=tiling.min_tokens_per_split,
        BLOCK_G=block_g, ATTN_BLOCK_N=attn_block_n, BLOCK_D=block_d, DOT_DTYPE=dot,
        BLOCK_S=triton.next_power_of_2(MAX_SPLITS), LINES_A_PROGRAM=PREFETCH_LINES, LINE_ELEMENTS=line_elements,
        n_programs=launched, PERSISTENT=persistent,
        PDL=pdl, INLINE_PTX=not _interpreting(), TRACE=trace is not None,
        num_warps=tiling.num_warps, **launch_options(pdl), **limits,
    )
    return out, layer_residual


def decode_layer_in_six_launches(x, residual, weights: DecodeLayerWeights, positions, cos_sin, k_cache, v_cache,
                                 block_tables, context_lens, slot_mapping, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode_layer`'s twin: the same step as the separate kernels run it, launch by launch (the
    reference its tests and benchmark hold it to)."""
    w = weights
    qkv, res1 = normed_skinny_matmul(x, residual, w.input_norm, w.eps, w.qkv, w.qkv_bias)
    q, k, v = qkv.view(x.shape[0], -1, w.head_dim).split([w.num_heads, w.num_kv_heads, w.num_kv_heads], dim=1)
    attn = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                  new_token=NewToken(k, v, positions, cos_sin, w.q_norm, w.k_norm, w.qk_eps,
                                                     slot_mapping))
    o = skinny_matmul(attn.flatten(1), w.o)
    act, res2 = normed_skinny_matmul(o, res1, w.post_norm, w.eps, w.gate_up, swiglu=True)
    return skinny_matmul(act, w.down), res2
