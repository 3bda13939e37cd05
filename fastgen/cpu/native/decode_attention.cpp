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
// Written with GCC/Clang vector extensions (16 float32 lanes): the compiler maps them onto
// AVX-512, AVX2 or SSE, whichever the machine has (built with -march=native). The one ISA
// intrinsic is AVX512-BF16's dot product for bf16 q.k, where the CPU has it.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

typedef float vf __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(64)));

inline vf load16(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline vf load16(const uint16_t* p) {  // 16 bf16 -> float32: the bf16 bits are the float's top half
  vh h; std::memcpy(&h, p, sizeof h);
  vu u = __builtin_convertvector(h, vu) << 16;
  vf v; std::memcpy(&v, &u, sizeof v); return v;
}
inline void store(float x, float* out) { *out = x; }
inline void store(float x, uint16_t* out) {  // float32 -> bf16, round to nearest even (as torch)
  uint32_t b; std::memcpy(&b, &x, 4);
  if ((b & 0x7fffffffu) > 0x7f800000u) { *out = 0x7fc0; return; }  // NaN stays NaN
  b += 0x7fffu + ((b >> 16) & 1u);
  *out = uint16_t(b >> 16);
}
// Sixteen finite floats rounded to T's precision (nearest even), kept as float32.
template <typename T> inline vf round16(vf x);
template <> inline vf round16<float>(vf x) { return x; }
template <> inline vf round16<uint16_t>(vf x) {
  vu b; std::memcpy(&b, &x, sizeof b);
  b = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
  vf r; std::memcpy(&r, &b, sizeof r); return r;
}

// Sixteen vectors, one per token, into one vector of their lane sums (token i in lane i): four
// rounds of pairwise shuffles and adds instead of sixteen separate horizontal sums.
inline vf halve16(vf a, vf b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
inline vf halve8(vf a, vf b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
         __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}
inline vf halve4(vf a, vf b) {
  return __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
         __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
}
inline vf halve2(vf a, vf b) {
  return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
inline vf lane_sums(const vf* x) {
  vf a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) a[i] = halve16(x[2 * i], x[2 * i + 1]);
  for (int i = 0; i < 4; ++i) b[i] = halve8(a[2 * i], a[2 * i + 1]);
  for (int i = 0; i < 2; ++i) c[i] = halve4(b[2 * i], b[2 * i + 1]);
  return halve2(c[0], c[1]);
}

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

// exp(x) for x <= 0 (a softmax's score minus its maximum), sixteen at a time: Cephes' expf
// (2^n times a degree-7 polynomial on |f| <= ln2 / 2, about 1 ulp); below -87.3 (and -inf) it
// gives exactly 0. glibc's scalar expf call per element cost more than the whole K pass.
typedef int32_t vi __attribute__((vector_size(64)));
inline vf exp16_nonpositive(vf x) {
  const vf y = x * 1.44269504088896341f - 0.5f;
  const vi n = __builtin_convertvector(y < -126.f ? vf{} - 126.f : y, vi);  // rounds x * log2(e)
  const vf nf = __builtin_convertvector(n, vf);
  vf f = x - nf * 0.693359375f;
  f = f + nf * 2.12194440e-4f;
  vf p = 1.9875691500e-4f * f + 1.3981999507e-3f;
  p = p * f + 8.3334519073e-3f;
  p = p * f + 4.1665795894e-2f;
  p = p * f + 1.6666665459e-1f;
  p = p * f + 5.0000001201e-1f;
  p = p * f * f + f + 1.f;
  const vi bits = (n + 127) << 23;
  vf scale; std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.3f ? vf{} : p * scale;
}

// Rows are read token by token from blocks scattered over the cache: each one is asked for this
// many tokens ahead, so its cache lines are on their way when it is reached.
constexpr int64_t kAhead = 8;
template <typename T> inline void prefetch_row(const T* row, int64_t elements) {
  for (int64_t i = 0; i < elements; i += 64 / int64_t(sizeof(T))) __builtin_prefetch(row + i);
}

struct Args {
  const void* q; int64_t q_stride_seq, q_stride_head;
  const void* k_cache; const void* v_cache;  // [blocks, block_size, kv_heads, head_dim], contiguous
  const int32_t* block_tables; int64_t table_stride;
  const int32_t* context_lens;
  void* out;  // [batch, heads, head_dim], contiguous
  int64_t batch, heads, kv_heads, block_size;
  float scale;
};

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

extern "C" {

// dtype: 0 float32, 1 bfloat16. Returns 0, or -1 for a head_dim without a compiled kernel.
int fastgen_paged_decode_attention(int dtype, const void* q, int64_t q_stride_seq, int64_t q_stride_head,
                                   const void* k_cache, const void* v_cache, const int32_t* block_tables,
                                   int64_t table_stride, const int32_t* context_lens, void* out, int64_t batch,
                                   int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                                   float scale, int num_threads) {
  if (kv_heads <= 0 || heads % kv_heads != 0) return -1;
  const Args a{q, q_stride_seq, q_stride_head, k_cache, v_cache, block_tables, table_stride, context_lens,
               out, batch, heads, kv_heads, block_size, scale};
  if (dtype == 0) return dispatch_head_dim<float>(a, head_dim, num_threads);
  if (dtype == 1) return dispatch_head_dim<uint16_t>(a, head_dim, num_threads);
  return -1;
}

}  // extern "C"
