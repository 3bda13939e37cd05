// The two passes of CPU decode attention over one task's context (`decode_attention.cpp`): the
// K pass's q.k product of a query head and a K row (`QueryRow`), and the V pass's probability-
// weighted sum of V rows for a few query heads at a time (`weigh_values`). Each has a generic
// float32 form and, on CPUs with AVX512-BF16, a bf16 form built on `vdpbf16ps`.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "simd16.h"

namespace fastgen {

// q.k for one query head and one K row, as 16 float32 partial sums (to be summed by lane_sums).
// The query is prepared once per task (`QueryRow::load`). Generic: widen both to float32 and
// multiply-add; bf16 on CPUs with AVX512-BF16: `vdpbf16ps` multiplies bf16 pairs exactly and adds
// them in float32, with no widening of K at all (the K pass is bound by arithmetic, not memory).
template <typename T, int D>
struct QueryRow {
  vf v[D / 16];
  void load(const T* q) { for (int c = 0; c < D / 16; ++c) v[c] = load16(q + c * 16); }
  vf dot(const T* k) const {
    vf sum = v[0] * load16(k);
    for (int c = 1; c < D / 16; ++c) sum += v[c] * load16(k + c * 16);
    return sum;
  }
};

#if defined(__AVX512BF16__)
template <int D>
struct QueryRow<uint16_t, D> {
  static_assert(D % 16 == 0);
  static constexpr int P = (D + 31) / 32;  // 32-lane bf16 vectors; D = 16 fills half of one
  __m512bh v[P];
  void load(const uint16_t* q) {
    for (int c = 0; c < P; ++c) v[c] = (__m512bh)chunk(q, c);
  }
  vf dot(const uint16_t* k) const {
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < P; ++c) sum = _mm512_dpbf16_ps(sum, v[c], (__m512bh)chunk(k, c));
    vf out; std::memcpy(&out, &sum, sizeof out); return out;
  }
  static __m512i chunk(const uint16_t* p, int c) {
    if (D - 32 * c >= 32) return _mm512_loadu_si512(p + 32 * c);
    return _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * c)));
  }
};
#endif

// Per-thread scratch, grown to the longest context and the most heads seen.
template <typename T, int D>
struct Scratch {
  std::vector<int64_t> rows;  // element offset of each context token's row in the cache
  std::vector<float> scores;  // [query heads of the task, padded context]
  std::vector<vf> partial;    // [query heads of the task, 16 tokens]
  std::vector<float> inv_total;
  std::vector<QueryRow<T, D>> q;  // [query heads of the task]
  std::vector<uint16_t> probs;     // kPairedValues: P's bf16 bits, [query heads of the task, padded context]
  std::vector<uint16_t> zero_row = std::vector<uint16_t>(D);
};

// The V pass walks one KV head's rows once for several of its query heads, their running sums
// held in registers: this many heads at a time, so the sums fill at most 16 vector registers.
// (Sums kept in memory, every head's updated for every token, cost more than the K pass.)
template <int D> constexpr int64_t kHeadsPerPass = D >= 256 ? 1 : 256 / D;

// Whether the V pass adds token pairs with vdpbf16ps (weigh_values_bf16), from P's bf16 bits.
#if defined(__AVX512BF16__)
template <typename T, int D> constexpr bool kPairedValues = std::is_same_v<T, uint16_t> && D % 32 == 0;
#else
template <typename T, int D> constexpr bool kPairedValues = false;
#endif

// out[h] = sum_t p[h][t] * V[t] / total[h] for the N query heads h0.. sharing the KV head whose
// rows start `v_offset` into each token's; float32 products and sums.
template <typename T, int D, int N>
void weigh_values_f32(const T* v_cache, int64_t v_offset, int64_t len, int64_t padded, Scratch<T, D>& s, int64_t h0,
                      T* out) {
  constexpr int C = D / 16;
  vf acc[N][C] = {};
  const float* p = s.scores.data() + h0 * padded;
  for (int64_t t = 0; t < len; ++t) {
    const T* row = v_cache + s.rows[t] + v_offset;
    if (t + kAhead < len) prefetch_row(v_cache + s.rows[t + kAhead] + v_offset, D);
    vf v[C];
    for (int c = 0; c < C; ++c) v[c] = load16(row + c * 16);
    for (int n = 0; n < N; ++n)
      for (int c = 0; c < C; ++c) acc[n][c] += p[n * padded + t] * v[c];
  }
  for (int n = 0; n < N; ++n)
    for (int c = 0; c < C; ++c) {
      float lanes[16];
      const vf normalised = acc[n][c] * s.inv_total[h0 + n];
      std::memcpy(lanes, &normalised, sizeof lanes);
      for (int l = 0; l < 16; ++l) store(lanes[l], out + n * D + c * 16 + l);
    }
}

#if defined(__AVX512BF16__)
// The same for bf16 on CPUs with AVX512-BF16, two tokens at a time: their V rows are interleaved
// into (token t, token t + 1) pairs, and `vdpbf16ps` adds p[t] v[t] and p[t + 1] v[t + 1] into each
// float32 lane. The products are exact (P is already rounded to bf16) and summed in float32, as in
// the float32 path, at a third of its instructions. An odd context's last pair takes a zero row.
// The interleave works within 128-bit lanes, so sum c holds dim 32 (c / 2) + 8 k + 4 (c % 2) + j in
// lane 4 k + j.
template <int D, int N>
void weigh_values_bf16(const uint16_t* v_cache, int64_t v_offset, int64_t len, int64_t padded,
                       Scratch<uint16_t, D>& s, int64_t h0, uint16_t* out) {
  static_assert(D % 32 == 0);
  constexpr int C = D / 16;
  __m512 acc[N][C];
  for (int n = 0; n < N; ++n)
    for (int c = 0; c < C; ++c) acc[n][c] = _mm512_setzero_ps();
  const uint16_t* p = s.probs.data() + h0 * padded;  // bf16, a zero past the context
  for (int64_t t = 0; t < len; t += 2) {
    const uint16_t* row0 = v_cache + s.rows[t] + v_offset;
    const uint16_t* row1 = t + 1 < len ? v_cache + s.rows[t + 1] + v_offset : s.zero_row.data();
    if (t + kAhead + 1 < len) {
      prefetch_row(v_cache + s.rows[t + kAhead] + v_offset, D);
      prefetch_row(v_cache + s.rows[t + kAhead + 1] + v_offset, D);
    }
    __m512i pairs[C];
    for (int c = 0; c < C / 2; ++c) {
      const __m512i a = _mm512_loadu_si512(row0 + 32 * c), b = _mm512_loadu_si512(row1 + 32 * c);
      pairs[2 * c] = _mm512_unpacklo_epi16(a, b);
      pairs[2 * c + 1] = _mm512_unpackhi_epi16(a, b);
    }
    for (int n = 0; n < N; ++n) {
      uint32_t pair;
      std::memcpy(&pair, p + n * padded + t, 4);
      const __m512bh weights = (__m512bh)_mm512_set1_epi32(int(pair));
      for (int c = 0; c < C; ++c) acc[n][c] = _mm512_dpbf16_ps(acc[n][c], weights, (__m512bh)pairs[c]);
    }
  }
  for (int n = 0; n < N; ++n)
    for (int c = 0; c < C; ++c) {
      float lanes[16];
      _mm512_storeu_ps(lanes, _mm512_mul_ps(acc[n][c], _mm512_set1_ps(s.inv_total[h0 + n])));
      for (int l = 0; l < 16; ++l)
        store(lanes[l], out + n * D + 32 * (c / 2) + 8 * (l / 4) + 4 * (c % 2) + l % 4);
    }
}
#endif

template <typename T, int D, int N>
void weigh_values_n(const T* v_cache, int64_t v_offset, int64_t len, int64_t padded, Scratch<T, D>& s, int64_t h0,
                    T* out) {
#if defined(__AVX512BF16__)
  if constexpr (kPairedValues<T, D>) {
    weigh_values_bf16<D, N>(v_cache, v_offset, len, padded, s, h0, out);
    return;
  }
#endif
  weigh_values_f32<T, D, N>(v_cache, v_offset, len, padded, s, h0, out);
}

// weigh_values_n for a count of heads known at run time (at most kHeadsPerPass<D>).
template <typename T, int D>
void weigh_values(int64_t n, const T* v_cache, int64_t v_offset, int64_t len, int64_t padded, Scratch<T, D>& s,
                  int64_t h0, T* out) {
  static_assert(kHeadsPerPass<D> <= 16);
  switch (n) {
#define FASTGEN_CASE(k) \
    case k: if constexpr (k <= kHeadsPerPass<D>) weigh_values_n<T, D, k>(v_cache, v_offset, len, padded, s, h0, out); return;
    FASTGEN_CASE(1) FASTGEN_CASE(2) FASTGEN_CASE(3) FASTGEN_CASE(4) FASTGEN_CASE(5) FASTGEN_CASE(6)
    FASTGEN_CASE(7) FASTGEN_CASE(8) FASTGEN_CASE(9) FASTGEN_CASE(10) FASTGEN_CASE(11) FASTGEN_CASE(12)
    FASTGEN_CASE(13) FASTGEN_CASE(14) FASTGEN_CASE(15) FASTGEN_CASE(16)
#undef FASTGEN_CASE
    default: std::abort();  // callers pass 1..kHeadsPerPass<D>
  }
}

}  // namespace fastgen
