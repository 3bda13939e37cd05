// `fastgen::quantized_linear` for CPU tensors in C++: a product over int8 / 4-bit codes that
// converts each code to float32 in registers and never writes a dequantized weight anywhere.
//
// Layout (fastgen.quantization.formats): codes int8 [N, K] or uint8 [N, K / 2] (in a group of G
// inputs, byte j holds input j in its low nibble and input j + G/2 in its high one); scales and
// minimums float16 [N, K / G]. w = code * scale (8 bits), (code - 8) * scale or code * scale + min
// (4 bits).
//
// Each output is a sum over groups: the group's code-times-input products in float32 vectors,
// times the group's scale; a 4-bit group's offset (-8 * scale, or its minimum) times the sum of
// its inputs is added once per group instead of once per weight. Output channels are shared out
// between threads; a channel's codes are read once and used for every row (at a few rows they
// stay in L1 between rows), so at one row the kernel streams the codes at the memory bandwidth.
// Codes with a twin in the lanes order (fastgen.cpu.native.quantized_linear) go to
// panel_dot_vnni instead, which sums 16 output channels in the lanes of one vector.
//
// The op's schema and Python kernel are `fastgen.quantization.ops`'; loading this library adds
// a kernel for the CPU dispatch key. Any call it cannot serve (no AVX-512, an input that is not
// float32 / bf16, strided tensors, a group size that is not a multiple of 32) goes to the
// Python kernel, registered a second time as `fastgen::quantized_linear_reference`. Built
// against torch's stable C ABI only, so it compiles in about a second.

#include <algorithm>
#include <cmath>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <optional>
#include <vector>

#include <omp.h>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define FASTGEN_HAVE_AVX512 1
#else
#define FASTGEN_HAVE_AVX512 0
#endif

namespace {

using torch::stable::Tensor;

std::atomic<int64_t> served_count{0}, gemm_count{0}, twin_gemv_count{0};
// Whether bf16 rows are rounded to int8 for the integer dot-product kernels (where the CPU has
// them); off, they are multiplied as they are (fastgen_quantized_linear_set_rounded_inputs).
std::atomic<int> rounded_inputs{1};

// fastgen_gemm_quantized of gemm.cpp (handed over by fastgen_quantized_linear_set_gemm), and the
// quantized twins it reads (fastgen_quantized_linear_add_twin), by the address of the codes.
using QuantizedGemmFn = int (*)(const uint16_t*, const uint8_t*, const uint16_t*, const uint16_t*, const float*,
                                uint16_t*, int64_t, int64_t, int64_t, int, int64_t, int);
std::atomic<QuantizedGemmFn> gemm{nullptr};

struct Twin {
    const uint8_t* codes;
    const uint16_t* scales;
    const uint16_t* offsets;
    int64_t n, k, bits, group_size;
};

std::mutex twins_mutex;
std::unordered_map<const void*, Twin> twins;

bool lookup(const void* codes, Twin* out) {
    std::lock_guard<std::mutex> lock(twins_mutex);
    auto it = twins.find(codes);
    if (it == twins.end()) return false;
    *out = it->second;
    return true;
}

// From this many rows a product goes through the GEMM over the weight's twin, where it has one:
// the GEMV below converts every code once per row, the GEMM once per call.
constexpr int64_t kGemmRows = 4;
// Where the GEMV rounds its rows to int8, its integer products (each chunk of codes loaded once
// for four rows; over a twin, 16 columns a vector) beat the GEMM over dequantized panels at every
// batch measured (over the twin, SmolLM2-135M's products at 64-512 rows: 1.1-1.4x for 4-bit
// codes, int8 likewise); but each block of channels reads all the rounded rows again, so past
// kRoundedRowsBytes of them (a long prompt's chunk) the GEMM, which converts each panel once for
// every row, takes over: at 1,024 rows of 576 inputs the GEMV still led, at 1,024 of 1,536 (1.5
// MiB) the GEMM did.
constexpr int64_t kRoundedRowsBytes = 1024 * 1024;
constexpr int64_t kGemmRowsRounded = 64;

int64_t gemm_rows_for(bool rounding, int64_t /*bits: the same for int8 and 4-bit codes*/, int64_t k) {
    if (!rounding) return kGemmRows;
    return std::max<int64_t>(kGemmRowsRounded, kRoundedRowsBytes / std::max<int64_t>(k, 1));
}

float bf16_to_float(uint16_t v) {
    const uint32_t bits = uint32_t(v) << 16;
    float out;
    std::memcpy(&out, &bits, 4);
    return out;
}

uint16_t float_to_bf16(float v) {  // round to nearest even, as torch's casts
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40);  // NaN stays NaN
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return uint16_t(bits >> 16);
}

Tensor reference_kernel(const Tensor& x, const Tensor& codes, const Tensor& scales, const std::optional<Tensor>& mins,
                        const std::optional<Tensor>& bias, int64_t bits, int64_t group_size) {
    std::array<StableIValue, 7> stack{torch::stable::detail::from(x), torch::stable::detail::from(codes),
                                      torch::stable::detail::from(scales), torch::stable::detail::from(mins),
                                      torch::stable::detail::from(bias), torch::stable::detail::from(bits),
                                      torch::stable::detail::from(group_size)};
    TORCH_ERROR_CODE_CHECK(aoti_torch_call_dispatcher("fastgen::quantized_linear_reference", "", stack.data()));
    return torch::stable::detail::to<Tensor>(stack[0]);
}

#if FASTGEN_HAVE_AVX512

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

// C outputs of one row (channels c0..c0+C-1, their codes `stride` bytes apart): sum over k of
// x[k] * w[c, k], w as the 8-bit codes say. C channels at once: C independent chains of
// additions (one channel alone waits on its own adds' latency) sharing every load of x.
template <int C>
inline void dot8(const int8_t* q, int64_t stride, const float* x, const uint16_t* scales, int64_t groups, int64_t k,
                 int64_t g, float* out) {
    __m512 total[C];
    for (int c = 0; c < C; ++c) total[c] = _mm512_setzero_ps();
    for (int64_t start = 0; start < k; start += g) {
        __m512 acc[C];
        for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
        for (int64_t j = start; j < start + g; j += 16) {
            const __m512 xs = _mm512_loadu_ps(x + j);
            for (int c = 0; c < C; ++c) {
                if (j % 64 == 0) _mm_prefetch((const char*)(q + (C + c) * stride + j), _MM_HINT_T0);
                const __m128i bytes = _mm_loadu_si128((const __m128i*)(q + c * stride + j));
                acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), xs, acc[c]);
            }
        }
        for (int c = 0; c < C; ++c)
            total[c] = _mm512_fmadd_ps(acc[c], _mm512_set1_ps(half_to_float(scales[c * groups + start / g])), total[c]);
    }
    for (int c = 0; c < C; ++c) out[c] = _mm512_reduce_add_ps(total[c]);
}

// The same over 4-bit codes (K / 2 bytes a channel); xsum: the sum of x over each group.
template <int C>
inline void dot4(const uint8_t* q, int64_t stride, const float* x, const float* xsum, const uint16_t* scales,
                 const uint16_t* mins, int64_t groups, int64_t g, float* out) {
    const __m512i low_nibble = _mm512_set1_epi32(15);
    __m512 total[C];
    float offsets[C];
    for (int c = 0; c < C; ++c) total[c] = _mm512_setzero_ps(), offsets[c] = 0.0f;
    const int64_t half = g / 2;
    for (int64_t group = 0; group < groups; ++group) {
        const float* xs = x + group * g;
        __m512 acc[C];
        for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
        for (int64_t j = 0; j < half; j += 16) {
            const __m512 x_low = _mm512_loadu_ps(xs + j), x_high = _mm512_loadu_ps(xs + half + j);
            for (int c = 0; c < C; ++c) {
                if ((group * half + j) % 64 == 0)
                    _mm_prefetch((const char*)(q + (C + c) * stride + group * half + j), _MM_HINT_T0);
                const __m128i bytes = _mm_loadu_si128((const __m128i*)(q + c * stride + group * half + j));
                const __m512i b = _mm512_cvtepu8_epi32(bytes);
                acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, low_nibble)), x_low, acc[c]);
                acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), x_high, acc[c]);
            }
        }
        for (int c = 0; c < C; ++c) {
            const float scale = half_to_float(scales[c * groups + group]);
            total[c] = _mm512_fmadd_ps(acc[c], _mm512_set1_ps(scale), total[c]);
            offsets[c] += (mins ? half_to_float(mins[c * groups + group]) : -8.0f * scale) * xsum[group];
        }
    }
    for (int c = 0; c < C; ++c) out[c] = _mm512_reduce_add_ps(total[c]) + offsets[c];
}

#if defined(__AVX512BF16__)
#define FASTGEN_HAVE_BF16_DOT 1

// dot4 for bf16 inputs, two codes per AVX-512 BF16 dot-product lane. A nibble q becomes the bf16
// number 128 + q by setting the exponent bits above it (0x4300 | q: exact, no conversion), so
// 32 bytes of codes are 64 weights in two vdpbf16ps; the 128 * (the group's input sum) that adds is
// taken off with the group's offset. The inputs come rearranged in the order the nibbles do
// (`low[b]`, `high[b]`: the inputs of byte b's low and high nibble). A 32-byte run spans one group,
// or two of 32 inputs: each lane's scale is picked out of 16 groups' scales with one permute.
template <int C>
inline void dot4_bf16(const uint8_t* q, int64_t stride, const uint16_t* low, const uint16_t* high, const float* xsum,
                      const uint16_t* scales, const uint16_t* mins, int64_t groups, int64_t g, float* out) {
    const __m512i nibble = _mm512_set1_epi16(15), exponent = _mm512_set1_epi16(0x4300);
    const int64_t half = g / 2, bytes = groups * half;
    __m512 total[C];
    for (int c = 0; c < C; ++c) total[c] = _mm512_setzero_ps();
    __m512 group_scales[C];
    int64_t loaded = -1;  // the first of the 16 groups whose scales group_scales holds
    for (int64_t b = 0; b < bytes; b += 32) {
        const int64_t first = b / half, second = (b + 16) / half;  // bytes b's and b + 16's groups
        if (loaded < 0 || second >= loaded + 16) {
            loaded = first;
            const __mmask16 mask = groups - first >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (groups - first)) - 1);
            for (int c = 0; c < C; ++c)
                group_scales[c] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, scales + c * groups + first));
        }
        const __m512i pick = _mm512_mask_blend_epi32((__mmask16)0xFF00, _mm512_set1_epi32(int(first - loaded)),
                                                     _mm512_set1_epi32(int(second - loaded)));
        const __m512bh x_low = (__m512bh)_mm512_loadu_si512(low + b), x_high = (__m512bh)_mm512_loadu_si512(high + b);
        for (int c = 0; c < C; ++c) {
            if (b % 64 == 0) _mm_prefetch((const char*)(q + (C + c) * stride + b), _MM_HINT_T0);
            const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(q + c * stride + b)));
            const __m512bh w_low = (__m512bh)_mm512_or_si512(_mm512_and_si512(w, nibble), exponent);
            const __m512bh w_high = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(w, 4), exponent);
            const __m512 acc = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), w_low, x_low), w_high, x_high);
            total[c] = _mm512_fmadd_ps(acc, _mm512_permutexvar_ps(pick, group_scales[c]), total[c]);
        }
    }
    // Each group's offset times its input sum: (min, or -8 scale) - 128 scale.
    for (int c = 0; c < C; ++c) {
        __m512 offsets = _mm512_setzero_ps();
        for (int64_t group = 0; group < groups; group += 16) {
            const __mmask16 mask = groups - group >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (groups - group)) - 1);
            const __m512 scale = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, scales + c * groups + group));
            const __m512 offset = mins ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, mins + c * groups + group))
                                       : _mm512_mul_ps(scale, _mm512_set1_ps(-8.0f));
            offsets = _mm512_fmadd_ps(_mm512_fmadd_ps(scale, _mm512_set1_ps(-128.0f), offset),
                                      _mm512_maskz_loadu_ps(mask, xsum + group), offsets);
        }
        out[c] = _mm512_reduce_add_ps(_mm512_add_ps(total[c], offsets));
    }
}
#else
#define FASTGEN_HAVE_BF16_DOT 0
#endif

#if defined(__AVX512VNNI__)
#define FASTGEN_HAVE_VNNI 1

// bf16 rows against codes, as llama.cpp multiplies its Q8_0 / Q4_0 / Q4_1 blocks: each row's inputs
// rounded to int8 in blocks of 32 (a float scale a block: its largest magnitude / 127), so that
// codes times inputs are exact integer dot products, 64 byte pairs an instruction (vpdpbusd), and
// only a block's sum is converted to float. Rounding the inputs costs about a quarter of a bf16
// step's precision (8 bits against bf16's 8 significant bits, but one scale for 32 inputs).
// vpdpbusd multiplies unsigned by signed bytes: int8 codes go in with their sign bit flipped
// (code + 128), and 128 times each block's input sum is taken off at the end; 4-bit codes are
// unsigned already.
constexpr int64_t kInputBlock = 32;

// One row's inputs rounded for the kernels below. q: the int8 inputs, in the codes' order (for
// 4-bit codes: each group's first halves, then each group's second halves, as the nibbles hold
// them); lane_scale: for each 64-byte chunk of codes, its 16 vpdpbusd lanes' input scales;
// block_scale and block_sum: each block's scale, and its scale times the sum of its inputs.
struct RoundedRow {
    const int8_t* q;
    const float* lane_scale;
    const float* block_scale;
    const float* block_sum;
    const float* group_sum;  // int8 codes: each group's blocks' block_sum added up
};

inline __m512 bf16x16_to_float(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// Rounds the k bf16 inputs at x (k a multiple of 32) into q (natural order), block_scale,
// block_sum and lane_scale (k / 4 floats).
inline void round_inputs(const uint16_t* x, int64_t k, int8_t* q, float* block_scale, float* block_sum,
                         float* lane_scale) {
    for (int64_t b = 0; b < k / kInputBlock; ++b) {
        const __m512 lo = bf16x16_to_float(x + b * kInputBlock), hi = bf16x16_to_float(x + b * kInputBlock + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        // A NaN (which max would drop) makes the block's scale NaN, so it reaches the outputs as
        // in the float kernels; a block too small for 127 / amax to be finite rounds to zeros.
        if (_mm512_cmp_ps_mask(lo, lo, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(hi, hi, _CMP_UNORD_Q)) amax = NAN;
        const float scale = amax / 127.0f;
        const float inverse = amax > 0.0f && std::isfinite(127.0f / amax) ? 127.0f / amax : 0.0f;
        const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inverse)));
        const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inverse)));
        _mm_storeu_si128((__m128i*)(q + b * kInputBlock), _mm512_cvtsepi32_epi8(qlo));
        _mm_storeu_si128((__m128i*)(q + b * kInputBlock + 16), _mm512_cvtsepi32_epi8(qhi));
        block_scale[b] = scale;
        block_sum[b] = scale * float(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));
        for (int lane = 0; lane < 8; ++lane) lane_scale[(b / 2) * 16 + (b % 2) * 8 + lane] = scale;
    }
    if ((k / kInputBlock) % 2)  // a last chunk of one block: its other lanes' dot products are 0, scaled by 0
        for (int lane = 8; lane < 16; ++lane) lane_scale[(k / 64) * 16 + lane] = 0.0f;
}

inline __mmask64 byte_mask(int64_t left) { return left >= 64 ? ~__mmask64(0) : (__mmask64(1) << left) - 1; }

// Σ over groups of a channel's group scales times `per_group` (16 groups a vector).
inline float scaled_sum(const uint16_t* scales, const float* per_group, int64_t groups) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t group = 0; group < groups; group += 16) {
        const __mmask16 mask = groups - group >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (groups - group)) - 1);
        acc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, scales + group)),
                              _mm512_maskz_loadu_ps(mask, per_group + group), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

// The outputs of C channels (codes `stride` bytes apart) for R rows at once, out[r * out_stride + c]: each
// chunk of codes is loaded once for all R rows. int8 codes, groups of g inputs (g a multiple of
// 64, or 32); a lane of a vpdpbusd sums 4 products of one block of 32 inputs.
template <int C, int R>
inline void dot8_vnni(const int8_t* w, int64_t stride, const RoundedRow* x, const uint16_t* scales, int64_t groups,
                      int64_t k, int64_t g, float* out, int64_t out_stride) {
    const __m512i flip = _mm512_set1_epi8(char(0x80));
    __m512 total[C][R];
    for (int c = 0; c < C; ++c)
        for (int r = 0; r < R; ++r) total[c][r] = _mm512_setzero_ps();
    __m512 window[C];  // groups of 32: 16 groups' scales, refreshed every 8 chunks
    for (int64_t j = 0; j < k; j += 64) {
        const int64_t chunk = j / 64;
        const __mmask64 mask = byte_mask(k - j);
        __m512i codes[C];
        __m512 weight_scale[C];
        if (g == 32 && chunk % 8 == 0) {
            const int64_t first = chunk * 2;
            const __mmask16 m16 = groups - first >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (groups - first)) - 1);
            for (int c = 0; c < C; ++c)
                window[c] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m16, scales + c * groups + first));
        }
        const __m512i pick = _mm512_mask_blend_epi32(__mmask16(0xFF00), _mm512_set1_epi32(int(2 * (chunk % 8))),
                                                     _mm512_set1_epi32(int(2 * (chunk % 8) + 1)));
        for (int c = 0; c < C; ++c) {
            _mm_prefetch((const char*)(w + (C + c) * stride + j), _MM_HINT_T0);
            codes[c] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, w + c * stride + j), flip);
            if (groups > 1)
                weight_scale[c] = g == 32 ? _mm512_permutexvar_ps(pick, window[c])
                                          : _mm512_set1_ps(half_to_float(scales[c * groups + j / g]));
        }
        for (int r = 0; r < R; ++r) {
            const __m512i xs = _mm512_maskz_loadu_epi8(mask, x[r].q + j);
            const __m512 lane = _mm512_loadu_ps(x[r].lane_scale + j / 4);
            for (int c = 0; c < C; ++c) {
                const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), codes[c], xs));
                total[c][r] = groups > 1 ? _mm512_fmadd_ps(_mm512_mul_ps(dot, lane), weight_scale[c], total[c][r])
                                         : _mm512_fmadd_ps(dot, lane, total[c][r]);
            }
        }
    }
    // One scale a channel is applied once; and the flipped sign bits are taken off: 128 times each
    // group's scale times its inputs' (scaled) sum.
    for (int c = 0; c < C; ++c)
        for (int r = 0; r < R; ++r) {
            const float sum = _mm512_reduce_add_ps(total[c][r]);
            out[r * out_stride + c] = groups > 1
                ? sum - 128.0f * scaled_sum(scales + c * groups, x[r].group_sum, groups)
                : half_to_float(scales[c]) * (sum - 128.0f * x[r].group_sum[0]);
        }
}

// The same over 4-bit codes in groups of 32 (16 bytes a group: a 64-byte chunk holds four
// groups, each lane four bytes of one). x[r].q: the low nibbles' inputs (k / 2), then the high
// nibbles'; x[r].lane_scale: each chunk's 16 lanes' input scales.
template <int C, int R>
inline void dot4_vnni(const uint8_t* w, int64_t stride, const RoundedRow* x, int64_t k, const uint16_t* scales,
                      const uint16_t* mins, int64_t groups, float* out, int64_t out_stride) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    const int64_t bytes = k / 2;
    __m512 total[C][R], window[C];
    for (int c = 0; c < C; ++c)
        for (int r = 0; r < R; ++r) total[c][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < bytes; b += 64) {
        const int64_t chunk = b / 64;
        if (chunk % 4 == 0) {  // the next 16 groups' scales
            const int64_t first = chunk * 4;
            const __mmask16 m16 = groups - first >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (groups - first)) - 1);
            for (int c = 0; c < C; ++c)
                window[c] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m16, scales + c * groups + first));
        }
        // lane l holds bytes 4l..4l+3 of the chunk: group 4 * (chunk % 4) + l / 4 of the 16
        const __m512i pick = _mm512_add_epi32(_mm512_set1_epi32(int(4 * (chunk % 4))),
                                              _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                                                                  11, 12, 13, 14, 15), 2));
        const __mmask64 mask = byte_mask(bytes - b);
        __m512i code_low[C], code_high[C];
        __m512 weight_scale[C];
        for (int c = 0; c < C; ++c) {
            _mm_prefetch((const char*)(w + (C + c) * stride + b), _MM_HINT_T0);
            const __m512i codes = _mm512_maskz_loadu_epi8(mask, w + c * stride + b);
            code_low[c] = _mm512_and_si512(codes, low);
            code_high[c] = _mm512_and_si512(_mm512_srli_epi16(codes, 4), low);
            weight_scale[c] = _mm512_permutexvar_ps(pick, window[c]);
        }
        for (int r = 0; r < R; ++r) {
            const __m512i x_low = _mm512_maskz_loadu_epi8(mask, x[r].q + b);
            const __m512i x_high = _mm512_maskz_loadu_epi8(mask, x[r].q + bytes + b);
            const __m512 lane = _mm512_loadu_ps(x[r].lane_scale + chunk * 16);
            for (int c = 0; c < C; ++c) {
                __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), code_low[c], x_low);
                dot = _mm512_dpbusd_epi32(dot, code_high[c], x_high);
                total[c][r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), lane), weight_scale[c],
                                              total[c][r]);
            }
        }
    }
    // Each group's offset (its minimum, or -8 times its scale) times its inputs' sum.
    for (int c = 0; c < C; ++c)
        for (int r = 0; r < R; ++r) {
            const float offsets = mins ? scaled_sum(mins + c * groups, x[r].block_sum, groups)
                                       : -8.0f * scaled_sum(scales + c * groups, x[r].block_sum, groups);
            out[r * out_stride + c] = _mm512_reduce_add_ps(total[c][r]) + offsets;
        }
}
// The outputs of one panel of a twin (48 columns; codes in the lanes order of gemm.cpp's
// dequantize_lanes_panel: 4-bit, or int8 + 128; scales and 4-bit offsets [groups][48]) for R rows,
// out[r * 48 + column]. Per block of 32 inputs: for each run d of four inputs, the three sets of
// 16 columns' code vectors (a column a 32-bit lane) are loaded once, and each row's four inputs
// of that run are broadcast to every lane once for all three sets (vpdpbusd: 16 columns' sums in
// one vector; 4-bit codes give two runs a vector, their low and high nibbles); each block's scale
// and offset (int8: -128 scale in float32, taking off the + 128) then apply as vectors, and nothing is summed
// across lanes. One row keeps two chains of sums a set (so their latency overlaps). x[r].q: the
// rounded inputs in natural order.
template <int BITS, int R>
inline void panel_dot_vnni(const uint8_t* codes, const uint16_t* scales, const uint16_t* offsets, const RoundedRow* x,
                           int64_t k, int64_t group_size, float* out) {
    constexpr int kVectors = BITS == 8 ? 8 : 4;           // 64-byte vectors of a set of columns in a block
    constexpr int64_t kBlockBytes = 3 * kVectors * 64;    // a block of 32 inputs of the panel's 48 columns
    constexpr int64_t kAhead = 4 * kBlockBytes;           // prefetched this far ahead (the thread's next panel too)
    constexpr int kChains = R == 1 ? 2 : 1;
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    __m512 acc[3][R];
    for (int set = 0; set < 3; ++set)
        for (int r = 0; r < R; ++r) acc[set][r] = _mm512_setzero_ps();
    for (int64_t block = 0; block < k / 32; ++block) {
        const uint8_t* base = codes + block * kBlockBytes;
        for (int64_t line = 0; line < kBlockBytes; line += 64)
            _mm_prefetch((const char*)(base + kAhead + line), _MM_HINT_T0);
        __m512i sums[kChains][3][R];
        for (int chain = 0; chain < kChains; ++chain)
            for (int set = 0; set < 3; ++set)
                for (int r = 0; r < R; ++r) sums[chain][set][r] = _mm512_setzero_si512();
        for (int d = 0; d < kVectors; ++d) {
            __m512i first[3], second[3];  // 4-bit: the low and high nibbles (runs d and d + 4); int8: run d
            for (int set = 0; set < 3; ++set) {
                const __m512i v = _mm512_loadu_si512(base + (set * kVectors + d) * 64);
                if (BITS == 8) {
                    first[set] = v;
                } else {
                    first[set] = _mm512_and_si512(v, nibble);
                    second[set] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
                }
            }
            for (int r = 0; r < R; ++r) {
                int32_t inputs;  // the run's four inputs
                std::memcpy(&inputs, x[r].q + block * 32 + 4 * d, 4);
                const __m512i xs = _mm512_set1_epi32(inputs);
                const int chain = BITS == 8 ? d % kChains : 0;
                for (int set = 0; set < 3; ++set) sums[chain][set][r] = _mm512_dpbusd_epi32(sums[chain][set][r], first[set], xs);
                if (BITS == 4) {
                    std::memcpy(&inputs, x[r].q + block * 32 + 16 + 4 * d, 4);
                    const __m512i xh = _mm512_set1_epi32(inputs);
                    for (int set = 0; set < 3; ++set)
                        sums[kChains - 1][set][r] = _mm512_dpbusd_epi32(sums[kChains - 1][set][r], second[set], xh);
                }
            }
        }
        const int64_t group = block * 32 / group_size;
        for (int set = 0; set < 3; ++set) {
            const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(scales + group * 48 + 16 * set)));
            const __m512 offset = BITS == 8 ? _mm512_mul_ps(scale, _mm512_set1_ps(-128.0f))
                : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(offsets + group * 48 + 16 * set)));
            for (int r = 0; r < R; ++r) {
                const __m512i sum = kChains == 2 ? _mm512_add_epi32(sums[0][set][r], sums[kChains - 1][set][r])
                                                 : sums[0][set][r];
                acc[set][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum),
                                              _mm512_mul_ps(scale, _mm512_set1_ps(x[r].block_scale[block])),
                                              acc[set][r]);
                acc[set][r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(x[r].block_sum[block]), acc[set][r]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int set = 0; set < 3; ++set) _mm512_storeu_ps(out + r * 48 + 16 * set, acc[set][r]);
}

template <int BITS>
inline void panel_dot_vnni_rows(int rows, const uint8_t* codes, const uint16_t* scales, const uint16_t* offsets,
                                const RoundedRow* x, int64_t k, int64_t group_size, float* out) {
    switch (rows) {
        case 4: panel_dot_vnni<BITS, 4>(codes, scales, offsets, x, k, group_size, out); break;
        case 3: panel_dot_vnni<BITS, 3>(codes, scales, offsets, x, k, group_size, out); break;
        case 2: panel_dot_vnni<BITS, 2>(codes, scales, offsets, x, k, group_size, out); break;
        default: panel_dot_vnni<BITS, 1>(codes, scales, offsets, x, k, group_size, out); break;
    }
}
#else
#define FASTGEN_HAVE_VNNI 0
#endif

#endif  // FASTGEN_HAVE_AVX512

// Whether a product over `bits`-bit codes in groups of `group_size` rounds its bf16 rows to int8
// for the integer kernels (dot8_vnni / dot4_vnni).
bool rounds_rows(int64_t bits, int64_t group_size) {
#if FASTGEN_HAVE_AVX512 && FASTGEN_HAVE_VNNI
    return rounded_inputs.load(std::memory_order_relaxed) &&
           (bits == 8 ? group_size % 64 == 0 || group_size == 32 : group_size == 32);
#else
    (void)bits, (void)group_size;
    return false;
#endif
}

Tensor quantized_linear(Tensor x, Tensor codes, Tensor scales, std::optional<Tensor> mins, std::optional<Tensor> bias,
                        int64_t bits, int64_t group_size) {
#if FASTGEN_HAVE_AVX512
    const int32_t bf16 = aoti_torch_dtype_bfloat16(), f32 = aoti_torch_dtype_float32(),
                  f16 = aoti_torch_dtype_float16();
    int32_t x_dtype = 0, c_dtype = 0, s_dtype = 0, m_dtype = f16, b_dtype = 0;
    aoti_torch_get_dtype(x.get(), &x_dtype);
    aoti_torch_get_dtype(codes.get(), &c_dtype);
    aoti_torch_get_dtype(scales.get(), &s_dtype);
    if (mins.has_value()) aoti_torch_get_dtype(mins->get(), &m_dtype);
    if (bias.has_value()) aoti_torch_get_dtype(bias->get(), &b_dtype);
    const int64_t k = x.dim() > 0 ? x.size(-1) : 0;
    const int64_t n = codes.dim() == 2 ? codes.size(0) : 0;
    const int64_t groups = group_size > 0 ? k / group_size : 0;
    const bool served = (x_dtype == bf16 || x_dtype == f32) && x.is_contiguous() && k > 0 && n > 0 &&
        codes.is_contiguous() && scales.is_contiguous() && s_dtype == f16 && m_dtype == f16 &&
        (bits == 8 || bits == 4) && group_size > 0 && group_size % 32 == 0 && k % group_size == 0 &&
        c_dtype == (bits == 8 ? aoti_torch_dtype_int8() : aoti_torch_dtype_uint8()) &&
        codes.size(1) == (bits == 8 ? k : k / 2) && scales.dim() == 2 && scales.size(0) == n &&
        scales.size(1) == groups && (!mins.has_value() || (bits == 4 && mins->is_contiguous() && mins->dim() == 2 &&
                                                           mins->size(0) == n && mins->size(1) == groups)) &&
        (!bias.has_value() || (b_dtype == x_dtype && bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous()));
    if (!served) return reference_kernel(x, codes, scales, mins, bias, bits, group_size);

    std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
    sizes.back() = n;
    std::vector<int64_t> strides(sizes.size(), 1);
    for (int64_t d = int64_t(sizes.size()) - 2; d >= 0; --d) strides[d] = strides[d + 1] * sizes[d + 1];
    AtenTensorHandle handle = nullptr;
    TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(int64_t(sizes.size()), sizes.data(), strides.data(), x_dtype,
                                                    aoti_torch_device_type_cpu(), 0, &handle));
    Tensor out(handle);
    const int64_t m = x.numel() / k;
    if (m == 0) return out;
    served_count.fetch_add(1, std::memory_order_relaxed);

    Twin twin;
    const QuantizedGemmFn kernel = gemm.load();
    const bool vnni = x_dtype == bf16 && rounds_rows(bits, group_size);
    const bool has_twin = x_dtype == bf16 && lookup(codes.data_ptr(), &twin) && twin.n == n && twin.k == k &&
        twin.bits == bits && twin.group_size == group_size;
    const bool to_gemm = m >= gemm_rows_for(vnni, bits, k);
    // Fewer rows, with a twin: the GEMV over the twin's panels, a column a lane.
    const bool lanes = vnni && has_twin && !to_gemm;
    if (to_gemm && has_twin && kernel != nullptr) {
        thread_local std::vector<float> bias32;  // the GEMM adds a float32 bias
        if (bias.has_value()) {
            const uint16_t* bb = static_cast<const uint16_t*>(bias->data_ptr());
            bias32.resize(n);
            for (int64_t i = 0; i < n; ++i) bias32[i] = bf16_to_float(bb[i]);
        }
        if (kernel(static_cast<const uint16_t*>(x.data_ptr()), twin.codes, twin.scales, twin.offsets,
                   bias.has_value() ? bias32.data() : nullptr, static_cast<uint16_t*>(out.data_ptr()), m, n, k,
                   int(bits), group_size, omp_get_max_threads()) == 0) {
            gemm_count.fetch_add(1, std::memory_order_relaxed);
            return out;
        }
    }

    // The rows in float32 (and, for 4-bit codes, each group's input sum), once for all channels.
    // bf16 inputs against 4-bit codes: the dot-product kernel, its inputs in nibble order (each
    // group's first half, then each group's second half), and no float32 copy of them.
    const bool bf16_dot = !vnni && FASTGEN_HAVE_BF16_DOT && bits == 4 && x_dtype == bf16 && (k / 2) % 32 == 0;
    const uint16_t* xb = static_cast<const uint16_t*>(x.data_ptr());
    thread_local std::vector<float> rows, sums;
    thread_local std::vector<uint16_t> nibble_order;
#if FASTGEN_HAVE_VNNI
    // Each row rounded to int8 once for all channels (4-bit codes: in the nibbles' order).
    thread_local std::vector<int8_t> rounded, rounded_natural;
    thread_local std::vector<float> lane_scales, block_scales, block_sums, group_sums;
    std::vector<RoundedRow> rounded_rows;
    if (vnni) {
        const int64_t blocks = k / kInputBlock, lane_count = (k + 63) / 64 * 16;
        rounded.resize(m * k);
        rounded_natural.resize(k);
        lane_scales.resize(m * lane_count);
        block_scales.resize(m * blocks);
        block_sums.resize(m * blocks);
        group_sums.resize(m * groups);
        for (int64_t r = 0; r < m; ++r) {
            int8_t* q = bits == 8 || lanes ? rounded.data() + r * k : rounded_natural.data();
            round_inputs(xb + r * k, k, q, block_scales.data() + r * blocks, block_sums.data() + r * blocks,
                         lane_scales.data() + r * lane_count);
            if (bits == 4 && !lanes) {  // the nibbles' order, and each 64-byte chunk's lanes' scales (4 lanes a group)
                for (int64_t group = 0; group < blocks; ++group) {
                    std::memcpy(rounded.data() + r * k + group * 16, q + group * 32, 16);
                    std::memcpy(rounded.data() + r * k + k / 2 + group * 16, q + group * 32 + 16, 16);
                }
                float* lane = lane_scales.data() + r * lane_count;
                for (int64_t i = 0; i < lane_count; ++i)
                    lane[i] = (i / 16) * 4 + (i % 16) / 4 < blocks ? block_scales[r * blocks + (i / 16) * 4 + (i % 16) / 4]
                                                                 : 0.0f;
            }
            if (bits == 8 && !lanes) {  // each group's blocks' scaled input sums, for dot8_vnni's sign correction
                const int64_t per_group = group_size / kInputBlock;
                for (int64_t group = 0; group < groups; ++group) {
                    float sum = 0.0f;
                    for (int64_t b = group * per_group; b < (group + 1) * per_group; ++b) sum += block_sums[r * blocks + b];
                    group_sums[r * groups + group] = sum;
                }
            }
            rounded_rows.push_back(RoundedRow{rounded.data() + r * k, lane_scales.data() + r * lane_count,
                                              block_scales.data() + r * blocks, block_sums.data() + r * blocks,
                                              group_sums.data() + r * groups});
        }
    }
    if (lanes) {
        twin_gemv_count.fetch_add(1, std::memory_order_relaxed);
        const int64_t panels = (n + 47) / 48, panel_bytes = k * bits / 8 * 48, panel_scales = groups * 48;
        const RoundedRow* xr = rounded_rows.data();
        const uint16_t* bias16 = bias.has_value() ? static_cast<const uint16_t*>(bias->data_ptr()) : nullptr;
        uint16_t* o = static_cast<uint16_t*>(out.data_ptr());
        #pragma omp parallel for schedule(static) num_threads(omp_get_max_threads())
        for (int64_t p = 0; p < panels; ++p) {
            const uint8_t* pc = twin.codes + p * panel_bytes;
            const uint16_t* ps = twin.scales + p * panel_scales;
            const uint16_t* po = twin.offsets ? twin.offsets + p * panel_scales : nullptr;
            const int64_t cols = std::min<int64_t>(48, n - p * 48);
            float v[4 * 48];
            for (int64_t r = 0; r < m; r += 4) {
                const int rows_now = int(std::min<int64_t>(4, m - r));
                if (bits == 8) panel_dot_vnni_rows<8>(rows_now, pc, ps, po, xr + r, k, group_size, v);
                else panel_dot_vnni_rows<4>(rows_now, pc, ps, po, xr + r, k, group_size, v);
                for (int i = 0; i < rows_now; ++i)
                    for (int64_t c = 0; c < cols; ++c) {
                        const float add = bias16 ? bf16_to_float(bias16[p * 48 + c]) : 0.0f;
                        o[(r + i) * n + p * 48 + c] = float_to_bf16(v[i * 48 + c] + add);
                    }
            }
        }
        return out;
    }
#endif
    const float* xf = static_cast<const float*>(x.data_ptr());
    if (x_dtype == bf16 && !bf16_dot && !vnni) {
        rows.resize(m * k);
        for (int64_t i = 0; i < m * k; ++i) rows[i] = bf16_to_float(xb[i]);
        xf = rows.data();
    }
    if (bits == 4 && !vnni) {  // each group's input sum, 16 inputs a vector (group_size is a multiple of 32)
        sums.resize(m * groups);
        for (int64_t r = 0; r < m; ++r)
            for (int64_t group = 0; group < groups; ++group) {
                __m512 acc = _mm512_setzero_ps();
                for (int64_t j = 0; j < group_size; j += 16) {
                    const int64_t at = r * k + group * group_size + j;
                    acc = _mm512_add_ps(acc, x_dtype == bf16
                        ? _mm512_castsi512_ps(_mm512_slli_epi32(
                              _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(xb + at))), 16))
                        : _mm512_loadu_ps(xf + at));
                }
                sums[r * groups + group] = _mm512_reduce_add_ps(acc);
            }
    }
    if (bf16_dot) {
        const int64_t half = group_size / 2;
        nibble_order.resize(m * k);
        for (int64_t r = 0; r < m; ++r)
            for (int64_t group = 0; group < groups; ++group) {
                std::memcpy(&nibble_order[r * k + group * half], xb + r * k + group * group_size, half * 2);
                std::memcpy(&nibble_order[r * k + k / 2 + group * half], xb + r * k + group * group_size + half,
                            half * 2);
            }
    }
    const uint16_t* arranged = nibble_order.data();
    const uint16_t* sc = static_cast<const uint16_t*>(scales.data_ptr());
    const uint16_t* mn = mins.has_value() ? static_cast<const uint16_t*>(mins->data_ptr()) : nullptr;
    const void* b = bias.has_value() ? bias->data_ptr() : nullptr;
    const bool out_bf16 = x_dtype == bf16;
    void* o = out.data_ptr();
    const float* xsums = sums.data();
    const int8_t* q8 = static_cast<const int8_t*>(codes.data_ptr());
    const uint8_t* q4 = static_cast<const uint8_t*>(codes.data_ptr());
    constexpr int64_t kBlock = 4;  // channels computed together (see dot8)
    const int64_t blocks = (n + kBlock - 1) / kBlock;
    const int64_t row_bytes = bits == 8 ? k : k / 2;
#if FASTGEN_HAVE_VNNI
    if (vnni) {
        // Blocks of kVnniChannels channels; rows kVnniRows at a time (then one at a time), each
        // chunk of codes loaded once for all of them.
        constexpr int kVnniChannels = 4, kVnniRows = 4;
        const int64_t vnni_blocks = (n + kVnniChannels - 1) / kVnniChannels;
        const RoundedRow* xr = rounded_rows.data();
        #pragma omp parallel for schedule(static) num_threads(omp_get_max_threads())
        for (int64_t block = 0; block < vnni_blocks; ++block) {
            const int64_t first = block * kVnniChannels, count = std::min<int64_t>(kVnniChannels, n - first);
            float v[kVnniRows * kVnniChannels];
            for (int64_t r = 0; r < m;) {
                const int rows_now = m - r >= kVnniRows ? kVnniRows : 1;
                for (int64_t c0 = 0; c0 < count;) {
                    const int64_t col = first + c0;
                    const int cols_now = count - c0 >= kVnniChannels ? kVnniChannels : 1;
                    float* res = v + c0;  // v[row * kVnniChannels + channel]
                    if (bits == 8) {
                        const int8_t* codes8 = q8 + col * k;
                        const uint16_t* s8 = sc + col * groups;
                        if (rows_now == kVnniRows && cols_now == kVnniChannels)
                            dot8_vnni<kVnniChannels, kVnniRows>(codes8, row_bytes, xr + r, s8, groups, k, group_size, res, kVnniChannels);
                        else if (rows_now == kVnniRows) dot8_vnni<1, kVnniRows>(codes8, row_bytes, xr + r, s8, groups, k, group_size, res, kVnniChannels);
                        else if (cols_now == kVnniChannels) dot8_vnni<kVnniChannels, 1>(codes8, row_bytes, xr + r, s8, groups, k, group_size, res, kVnniChannels);
                        else dot8_vnni<1, 1>(codes8, row_bytes, xr + r, s8, groups, k, group_size, res, kVnniChannels);
                    } else {
                        const uint8_t* codes4 = q4 + col * row_bytes;
                        const uint16_t* s4 = sc + col * groups;
                        const uint16_t* m4 = mn ? mn + col * groups : nullptr;
                        if (rows_now == kVnniRows && cols_now == kVnniChannels)
                            dot4_vnni<kVnniChannels, kVnniRows>(codes4, row_bytes, xr + r, k, s4, m4, groups, res, kVnniChannels);
                        else if (rows_now == kVnniRows) dot4_vnni<1, kVnniRows>(codes4, row_bytes, xr + r, k, s4, m4, groups, res, kVnniChannels);
                        else if (cols_now == kVnniChannels) dot4_vnni<kVnniChannels, 1>(codes4, row_bytes, xr + r, k, s4, m4, groups, res, kVnniChannels);
                        else dot4_vnni<1, 1>(codes4, row_bytes, xr + r, k, s4, m4, groups, res, kVnniChannels);
                    }
                    c0 += cols_now;
                }
                for (int i = 0; i < rows_now; ++i)
                    for (int64_t c = 0; c < count; ++c) {
                        const int64_t col = first + c;
                        const float add = b == nullptr ? 0.0f : bf16_to_float(static_cast<const uint16_t*>(b)[col]);
                        static_cast<uint16_t*>(o)[(r + i) * n + col] = float_to_bf16(v[i * kVnniChannels + c] + add);
                    }
                r += rows_now;
            }
        }
        return out;
    }
#endif
    #pragma omp parallel for schedule(static) num_threads(omp_get_max_threads())
    for (int64_t block = 0; block < blocks; ++block) {
        const int64_t first = block * kBlock, count = std::min(kBlock, n - first);
        for (int64_t r = 0; r < m; ++r) {
            float v[kBlock];
            for (int64_t c0 = 0; c0 < count; c0 += (count - c0 >= kBlock ? kBlock : 1)) {
                const int64_t col = first + c0;
                const bool four = count - c0 >= kBlock;
                if (bits == 8) {
                    if (four) dot8<kBlock>(q8 + col * k, row_bytes, xf + r * k, sc + col * groups, groups, k, group_size, v + c0);
                    else dot8<1>(q8 + col * k, row_bytes, xf + r * k, sc + col * groups, groups, k, group_size, v + c0);
                } else if (bf16_dot) {
#if FASTGEN_HAVE_BF16_DOT
                    const uint16_t* mc = mn ? mn + col * groups : nullptr;
                    const uint16_t* lo = arranged + r * k;
                    if (four) dot4_bf16<kBlock>(q4 + col * row_bytes, row_bytes, lo, lo + k / 2, xsums + r * groups, sc + col * groups, mc, groups, group_size, v + c0);
                    else dot4_bf16<1>(q4 + col * row_bytes, row_bytes, lo, lo + k / 2, xsums + r * groups, sc + col * groups, mc, groups, group_size, v + c0);
#endif
                } else {
                    const uint16_t* mc = mn ? mn + col * groups : nullptr;
                    if (four) dot4<kBlock>(q4 + col * row_bytes, row_bytes, xf + r * k, xsums + r * groups, sc + col * groups, mc, groups, group_size, v + c0);
                    else dot4<1>(q4 + col * row_bytes, row_bytes, xf + r * k, xsums + r * groups, sc + col * groups, mc, groups, group_size, v + c0);
                }
            }
            for (int64_t c = 0; c < count; ++c) {
                const int64_t col = first + c;
                const float add = b == nullptr ? 0.0f
                    : out_bf16 ? bf16_to_float(static_cast<const uint16_t*>(b)[col]) : static_cast<const float*>(b)[col];
                if (out_bf16) static_cast<uint16_t*>(o)[r * n + col] = float_to_bf16(v[c] + add);
                else static_cast<float*>(o)[r * n + col] = v[c] + add;
            }
        }
    }
    return out;
#else
    return reference_kernel(x, codes, scales, mins, bias, bits, group_size);
#endif
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fastgen, CPU, m) { m.impl("quantized_linear", TORCH_BOX(&quantized_linear)); }

extern "C" {

int64_t fastgen_quantized_linear_served() { return served_count.load(); }

// 1 where this build has the kernels (AVX-512); 0: every call goes to the reference kernel.
int fastgen_quantized_linear_supported() { return FASTGEN_HAVE_AVX512; }

int64_t fastgen_quantized_linear_served_by_gemm() { return gemm_count.load(); }

int64_t fastgen_quantized_linear_served_by_twin_gemv() { return twin_gemv_count.load(); }

// 1 where bf16 rows are rounded to int8 for the integer dot-product kernels: the CPU has AVX-512
// VNNI and the rounding is on (fastgen_quantized_linear_set_rounded_inputs).
int fastgen_quantized_linear_has_rounded_inputs() { return rounds_rows(8, 64); }

// From how many bf16 rows of `k` inputs a product over codes of `bits` bits in groups of
// `group_size` goes to the GEMM over its twin.
int64_t fastgen_quantized_linear_gemm_rows(int64_t bits, int64_t group_size, int64_t k) {
    return gemm_rows_for(rounds_rows(bits, group_size), bits, k);
}

// Round bf16 rows to int8 (1, the default where the CPU can) or multiply them as they are (0).
void fastgen_quantized_linear_set_rounded_inputs(int on) { rounded_inputs.store(on); }

void fastgen_quantized_linear_set_gemm(void* fn) { gemm.store(reinterpret_cast<QuantizedGemmFn>(fn)); }

// The twin of the codes at `codes` ([n, k] weights of `bits` bits, groups of `group_size`), packed
// into panels by fastgen.cpu.native.quantized_linear.
void fastgen_quantized_linear_add_twin(const void* codes, const void* panel_codes, const void* scales,
                                       const void* offsets, int64_t n, int64_t k, int64_t bits, int64_t group_size) {
    std::lock_guard<std::mutex> lock(twins_mutex);
    twins[codes] = Twin{static_cast<const uint8_t*>(panel_codes), static_cast<const uint16_t*>(scales),
                        static_cast<const uint16_t*>(offsets), n, k, bits, group_size};
}

// Forget the twin of `codes`, if it is still the one whose panels are at `panel_codes`.
void fastgen_quantized_linear_drop_twin(const void* codes, const void* panel_codes) {
    std::lock_guard<std::mutex> lock(twins_mutex);
    auto it = twins.find(codes);
    if (it != twins.end() && it->second.codes == panel_codes) twins.erase(it);
}

}  // extern "C"
