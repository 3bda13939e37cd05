// Sixteen-lane float32 vector helpers for fastgen's CPU kernels, written with GCC/Clang vector
// extensions: the compiler maps them onto AVX-512, AVX2 or SSE, whichever the machine has (the
// kernels are built with -march=native).

#pragma once

#include <cstdint>
#include <cstring>

namespace fastgen {

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

}  // namespace fastgen
