// Paged decode attention for the CPU: one query token per sequence attends to its context, read
// in place from the paged cache through the block table.
//
// The torch path gathers every sequence's K and V into a [batch, longest context] copy and runs
// two bmm's over it: each step writes and re-reads the whole context, padded to the longest
// sequence. Here each task (a sequence, or one KV head of it when sequences are few) walks its
// own tokens once for K and once for V, shares each loaded K/V row across the query heads of its
// group (GQA), and keeps scores, softmax and the output sum in float32.
//
// Arithmetic, as torch's CPU flash attention (what transformers' SDPA runs) does it: q.k summed
// in float32 and scaled; exp(score - max) in float32, summed in float32 and rounded to the cache
// dtype for P.V; P.V summed in float32, divided by the sum and rounded once to the output dtype.
//
// Written with GCC/Clang vector extensions (16 float32 lanes, `simd16.h`): the compiler maps them
// onto AVX-512, AVX2 or SSE, whichever the machine has (built with -march=native). The one ISA
// intrinsic is AVX512-BF16's dot product, for bf16 q.k and P.V where the CPU has it
// (`decode_attention_passes.h`). This file splits the work into tasks and runs the softmax.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "decode_attention_passes.h"
#include "simd16.h"

namespace fastgen {
namespace {

struct Args {
  const void* q; int64_t q_stride_seq, q_stride_head;
  const void* k_cache; const void* v_cache;  // [blocks, block_size, kv_heads, head_dim], contiguous
  const int32_t* block_tables; int64_t table_stride;
  const int32_t* context_lens;
  void* out;  // [batch, heads, head_dim], contiguous
  int64_t batch, heads, kv_heads, block_size;
  float scale;
};

// One sequence, KV heads [kv_first, kv_first + kv_count) and their query heads. Each token's
// rows of those heads lie side by side in the cache, so a task that takes every KV head reads
// whole contiguous rows, which streams from memory far better than one head's slice of each.
template <typename T, int D>
void attend_one(const Args& a, int64_t seq, int64_t kv_first, int64_t kv_count, Scratch<T, D>& s) {
  const int64_t group = a.heads / a.kv_heads;
  const int64_t nq = kv_count * group;  // query heads of this task, kv-head major
  const int64_t first_head = kv_first * group;
  T* out = static_cast<T*>(a.out) + (seq * a.heads + first_head) * D;
  const int64_t len = a.context_lens[seq];
  if (len <= 0) {  // a padding row: its output is defined as zero
    for (int64_t i = 0; i < nq * D; ++i) store(0.f, out + i);
    return;
  }
  const int64_t padded = (len + 15) / 16 * 16;
  s.rows.resize(len);
  s.scores.resize(nq * padded);
  s.q.resize(nq);
  if constexpr (kPairedValues<T, D>) s.probs.resize(nq * padded);
  s.partial.resize(nq * 16);
  s.inv_total.resize(nq);
  const int64_t token_stride = a.kv_heads * D;
  const int32_t* table = a.block_tables + seq * a.table_stride;
  for (int64_t t = 0, block = 0; t < len; ++block) {
    const int64_t base = int64_t(table[block]) * a.block_size * token_stride + kv_first * D;
    for (int64_t i = 0; i < a.block_size && t < len; ++i, ++t) s.rows[t] = base + i * token_stride;
  }

  const T* q_base = static_cast<const T*>(a.q) + seq * a.q_stride_seq;
  for (int64_t h = 0; h < nq; ++h) s.q[h].load(q_base + (first_head + h) * a.q_stride_head);

  // Scores, sixteen tokens at a time: each KV head's K row feeds every query head of its group.
  const T* k_cache = static_cast<const T*>(a.k_cache);
  const T* v_cache = static_cast<const T*>(a.v_cache);
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, len - t0);
    for (int64_t i = 0; i < 16; ++i) {
      if (i >= n) {
        for (int64_t h = 0; h < nq; ++h) s.partial[h * 16 + i] = vf{};
        continue;
      }
      const T* row = k_cache + s.rows[t0 + i];
      if (t0 + i + kAhead < len) {  // V too: the V pass then finds its rows in cache
        prefetch_row(k_cache + s.rows[t0 + i + kAhead], kv_count * D);
        prefetch_row(v_cache + s.rows[t0 + i + kAhead], kv_count * D);
      }
      for (int64_t g = 0; g < kv_count; ++g)
        for (int64_t h = g * group; h < (g + 1) * group; ++h) s.partial[h * 16 + i] = s.q[h].dot(row + g * D);
    }
    for (int64_t h = 0; h < nq; ++h) {
      vf sums = lane_sums(s.partial.data() + h * 16) * a.scale;
      std::memcpy(s.scores.data() + h * padded + t0, &sums, sizeof sums);
    }
  }

  // Softmax over whole 16-lane chunks: the tail past the context is -inf, so it adds nothing.
  for (int64_t h = 0; h < nq; ++h) {
    float* p = s.scores.data() + h * padded;
    std::fill(p + len, p + padded, -INFINITY);
    vf top = load16(p);
    for (int64_t t = 16; t < padded; t += 16) {
      const vf x = load16(p + t);
      top = x > top ? x : top;
    }
    float m = top[0];
    for (int l = 1; l < 16; ++l) m = std::max(m, top[l]);
    vf total = vf{};
    for (int64_t t = 0; t < padded; t += 16) {
      const vf e = exp16_nonpositive(load16(p + t) - m);
      total += e;
      const vf rounded = round16<T>(e);
      std::memcpy(p + t, &rounded, sizeof rounded);
      if constexpr (kPairedValues<T, D>) {  // the bf16 bits are the float's top half
        vu bits;
        std::memcpy(&bits, &rounded, sizeof bits);
        const vh top = __builtin_convertvector(bits >> 16, vh);
        std::memcpy(s.probs.data() + h * padded + t, &top, sizeof top);
      }
    }
    float sum = 0.f;
    for (int l = 0; l < 16; ++l) sum += total[l];
    s.inv_total[h] = 1.f / sum;
  }

  for (int64_t g = 0; g < kv_count; ++g)
    for (int64_t h = g * group; h < (g + 1) * group; h += kHeadsPerPass<D>)
      weigh_values<T, D>(std::min<int64_t>(kHeadsPerPass<D>, (g + 1) * group - h), v_cache, g * D, len, padded, s,
                         h, out + h * D);
}

template <typename T, int D>
void attend(const Args& a, int num_threads) {
  // A task per sequence while there are enough to keep every thread busy; else a task per
  // (sequence, KV head).
  const int64_t split = a.batch >= 4 * num_threads ? 1 : a.kv_heads;
  const int64_t per_task = a.kv_heads / split;
#pragma omp parallel num_threads(num_threads)
  {
    Scratch<T, D> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < a.batch * split; ++task)
      attend_one<T, D>(a, task / split, (task % split) * per_task, per_task, scratch);
  }
}

template <typename T>
int dispatch_head_dim(const Args& a, int64_t head_dim, int num_threads) {
  switch (head_dim) {
    case 16: attend<T, 16>(a, num_threads); return 0;
    case 32: attend<T, 32>(a, num_threads); return 0;
    case 64: attend<T, 64>(a, num_threads); return 0;
    case 128: attend<T, 128>(a, num_threads); return 0;
    case 256: attend<T, 256>(a, num_threads); return 0;
    default: return -1;
  }
}

}  // namespace
}  // namespace fastgen

extern "C" {

// dtype: 0 float32, 1 bfloat16. Returns 0, or -1 for a head_dim without a compiled kernel.
int fastgen_paged_decode_attention(int dtype, const void* q, int64_t q_stride_seq, int64_t q_stride_head,
                                   const void* k_cache, const void* v_cache, const int32_t* block_tables,
                                   int64_t table_stride, const int32_t* context_lens, void* out, int64_t batch,
                                   int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                                   float scale, int num_threads) {
  if (kv_heads <= 0 || heads % kv_heads != 0) return -1;
  const fastgen::Args a{q, q_stride_seq, q_stride_head, k_cache, v_cache, block_tables, table_stride, context_lens,
               out, batch, heads, kv_heads, block_size, scale};
  if (dtype == 0) return fastgen::dispatch_head_dim<float>(a, head_dim, num_threads);
  if (dtype == 1) return fastgen::dispatch_head_dim<uint16_t>(a, head_dim, num_threads);
  return -1;
}

}  // extern "C"
