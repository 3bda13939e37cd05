// bf16 GEMM with AVX-512 BF16 dot products: C [M, N] = A [M, K] . W[N, K]^T (+ bias), fp32 sums.
//
// Built by fastgen.cpu.native.library (-march=native); where the CPU has no AVX-512 BF16 the
// library still builds and fastgen_gemm_supported() says 0.
//
// W is packed once (fastgen_gemm_pack) into panels of 48 output columns, each panel
// [ceil(K / 2)][48][2]: for every pair of k, the 48 columns' two weights side by side, which is
// the operand layout of vdpbf16ps (16 fp32 lanes, each adding a pair of products). A panel is
// read front to back, once per 8 rows of A; its 96-element rows stay in L1 between row blocks.
// Eight rows by 48 columns is 24 zmm accumulators, three weight loads and eight broadcasts of
// an A pair per k pair. The output columns past N (the last panel's padding) are never stored,
// and a missing last k (odd K) is packed as 0 and read as 0.
//
// Each output sums its k pairs in order, in one fp32 accumulator, and is rounded to bf16 once
// (round to nearest even), the bias added before rounding: the same products and order as
// oneDNN's bf16 GEMM on the same CPU gave on SmolLM2's shapes, all but a few outputs in ten
// thousand identical to F.linear.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define FASTGEN_HAVE_BF16 1
#else
#define FASTGEN_HAVE_BF16 0
#endif

namespace {

constexpr int64_t kPanel = 48;  // output columns per panel: three vectors of 16 fp32 lanes
constexpr int64_t kRows = 8;    // rows of A per register tile
constexpr int64_t kChunkBytes = 256 * 1024;  // of A, swept by every panel in turn
constexpr int64_t kWholeBytes = 16 << 20;  // most bf16 bytes a quantized GEMM dequantizes at once, per thread

int64_t num_pairs(int64_t k) { return (k + 1) / 2; }

#if FASTGEN_HAVE_BF16

// One A pair (a[2p], a[2p + 1]) broadcast to every lane; the pair past an odd K's end reads 0.
inline __m512bh a_pair(const uint16_t* row, int64_t p, int64_t k) {
    int32_t pair = 0;
    if (2 * p + 1 < k) {
        std::memcpy(&pair, row + 2 * p, 4);
    } else {
        pair = row[2 * p];
    }
    return (__m512bh)_mm512_set1_epi32(pair);
}

// What a row block asks the memory for while it computes: the next `lines` cache lines of the
// panel its thread computes next, from `from` (into L2, spread evenly over the k loop), and,
// with `own`, its own panel 3 KiB ahead of use (into L1: for a panel nothing fetched before).
struct Prefetch {
    const char* from;
    int64_t lines;
    bool own;
};

template <int R>
void tile(const uint16_t* a, int64_t k, const uint16_t* panel, const float* bias, uint16_t* c, int64_t ldc,
          int64_t cols, Prefetch ahead) {
    __m512 acc[R][3];
    for (int r = 0; r < R; ++r) {
        for (int j = 0; j < 3; ++j) acc[r][j] = _mm512_setzero_ps();
    }
    const int64_t pairs = num_pairs(k);
    const int64_t lines_per_pair = (ahead.lines + pairs - 1) / pairs;
    int64_t line = 0;
    for (int64_t p = 0; p < pairs; ++p) {
        const uint16_t* w = panel + p * 2 * kPanel;
        if (ahead.own) {
            _mm_prefetch(reinterpret_cast<const char*>(w + 2 * kPanel * 16), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(w + 2 * kPanel * 16 + 32), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(w + 2 * kPanel * 16 + 64), _MM_HINT_T0);
        }
        for (int64_t i = 0; i < lines_per_pair && line < ahead.lines; ++i, ++line)
            _mm_prefetch(ahead.from + 64 * line, _MM_HINT_T1);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + 32);
        const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 64);
        for (int r = 0; r < R; ++r) {
            const __m512bh x = a_pair(a + r * k, p, k);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, w1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], x, w2);
        }
    }
    for (int j = 0; j < 3; ++j) {
        const int64_t left = cols - 16 * j;
        if (left <= 0) break;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * j) : _mm512_setzero_ps();
        for (int r = 0; r < R; ++r) {
            const __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][j], b));
            _mm256_mask_storeu_epi16(c + r * ldc + 16 * j, mask, out);
        }
    }
}

void rows(int r, const uint16_t* a, int64_t k, const uint16_t* panel, const float* bias, uint16_t* c, int64_t ldc,
          int64_t cols, Prefetch ahead) {
    switch (r) {
        case 8: tile<8>(a, k, panel, bias, c, ldc, cols, ahead); break;
        case 7: tile<7>(a, k, panel, bias, c, ldc, cols, ahead); break;
        case 6: tile<6>(a, k, panel, bias, c, ldc, cols, ahead); break;
        case 5: tile<5>(a, k, panel, bias, c, ldc, cols, ahead); break;
        case 4: tile<4>(a, k, panel, bias, c, ldc, cols, ahead); break;
        case 3: tile<3>(a, k, panel, bias, c, ldc, cols, ahead); break;
        case 2: tile<2>(a, k, panel, bias, c, ldc, cols, ahead); break;
        default: tile<1>(a, k, panel, bias, c, ldc, cols, ahead); break;
    }
}

// One panel of a quantized twin (fastgen.cpu.native.quantized_linear: `_lanes_order` for 4-bit
// codes, `_lanes_order8` for int8 ones), dequantized into the bf16 panel layout above (`out`: K / 2
// pair rows of 96). Per block of 32 inputs, three sets of 16 columns, each a few 64-byte vectors
// whose 32-bit lane c holds column c's codes of a run of the block: 4-bit, four vectors, run d's
// bytes 4d..4d+3 (byte j: input j in its low nibble, input j + 16 in its high one); int8 + 128,
// eight vectors, run d's inputs 4d..4d+3. A lane's first two codes are inputs 2p and 2p + 1 of one
// pair row p, its last two those of pair row p + 1 (4-bit: the low nibbles rows 2d and 2d + 1, the
// high ones 8 + 2d and 9 + 2d; int8: rows 2d and 2d + 1); spread to 16 bits each they are already
// the panel's element order (column c's input 2p, then 2p + 1), so 16 columns of a pair row come
// out of one vector. w = code * scale + offset (4-bit: the twin's; int8: -128 scale, in float32)
// in float32, rounded to bf16 once: the weight `fastgen.quantization.dequantize` gives in bf16.
template <int BITS>
void dequantize_lanes_panel(const uint8_t* codes, const uint16_t* scales, const uint16_t* offsets, int64_t pairs,
                            int64_t group_size, uint16_t* out) {
    constexpr int kRuns = BITS == 8 ? 8 : 4;  // 64-byte vectors a set of 16 columns takes in a block
    const __m512i twice = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i nibble = _mm512_set1_epi8(0x0F), first_byte = _mm512_set1_epi32(0xFF),
                  second_byte = _mm512_set1_epi32(0xFF00);
    for (int64_t block = 0; block < pairs / 16; ++block) {
        const int64_t group = block * 32 / group_size;
        for (int set = 0; set < 3; ++set) {
            __m512 scale[2], offset[2];  // columns 16 set + 0..7 and + 8..15, each twice
            for (int h = 0; h < 2; ++h) {
                const int64_t at = group * kPanel + 16 * set + 8 * h;
                scale[h] = _mm512_permutexvar_ps(
                    twice, _mm512_cvtph_ps(_mm256_zextsi128_si256(_mm_loadu_si128((const __m128i*)(scales + at)))));
                offset[h] = BITS == 8 ? _mm512_mul_ps(scale[h], _mm512_set1_ps(-128.0f))
                                      : _mm512_permutexvar_ps(twice, _mm512_cvtph_ps(_mm256_zextsi128_si256(
                                                                         _mm_loadu_si128((const __m128i*)(offsets + at)))));
            }
            for (int d = 0; d < kRuns; ++d) {
                const __m512i v = _mm512_loadu_si512(codes + (block * 3 + set) * kRuns * 64 + d * 64);
                __m512i sources[4];
                int64_t pair_rows[4];
                int count = 0;
                if (BITS == 8) {
                    sources[count] = v, pair_rows[count++] = 2 * d;
                    sources[count] = _mm512_srli_epi32(v, 16), pair_rows[count++] = 2 * d + 1;
                } else {
                    const __m512i low = _mm512_and_si512(v, nibble);
                    const __m512i high = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
                    sources[count] = low, pair_rows[count++] = 2 * d;
                    sources[count] = _mm512_srli_epi32(low, 16), pair_rows[count++] = 2 * d + 1;
                    sources[count] = high, pair_rows[count++] = 8 + 2 * d;
                    sources[count] = _mm512_srli_epi32(high, 16), pair_rows[count++] = 9 + 2 * d;
                }
                for (int i = 0; i < count; ++i) {
                    const __m512i x = sources[i];  // a lane's two codes in its bytes 0 and 1
                    const __m512i pair = _mm512_or_si512(_mm512_and_si512(x, first_byte),
                                                         _mm512_slli_epi32(_mm512_and_si512(x, second_byte), 8));
                    const __m512 w0 = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(pair, 0))), scale[0], offset[0]);
                    const __m512 w1 = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(pair, 1))), scale[1], offset[1]);
                    _mm512_storeu_si512(out + (block * 16 + pair_rows[i]) * 96 + 32 * set,
                                        (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
                }
            }
        }
    }
}

// A panel of the quantized twin into the bf16 panel layout.
void dequantize_twin_panel(const uint8_t* codes, const uint16_t* scales, const uint16_t* offsets, int64_t pairs,
                           int64_t group_size, int bits, uint16_t* out) {
    if (bits == 8) dequantize_lanes_panel<8>(codes, scales, offsets, pairs, group_size, out);
    else dequantize_lanes_panel<4>(codes, scales, offsets, pairs, group_size, out);
}

#endif  // FASTGEN_HAVE_BF16

}  // namespace

extern "C" {

int fastgen_gemm_supported() { return FASTGEN_HAVE_BF16; }

// Elements of the packed form of an [n, k] weight.
int64_t fastgen_gemm_packed_size(int64_t n, int64_t k) {
    return (n + kPanel - 1) / kPanel * num_pairs(k) * 2 * kPanel;
}

// w: bf16 [n, k] row-major; packed: fastgen_gemm_packed_size(n, k) bf16 elements.
void fastgen_gemm_pack(const uint16_t* w, uint16_t* packed, int64_t n, int64_t k, int num_threads) {
    const int64_t pairs = num_pairs(k);
    const int64_t panels = (n + kPanel - 1) / kPanel;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < panels; ++p) {
        uint16_t* out = packed + p * pairs * 2 * kPanel;
        for (int64_t q = 0; q < pairs; ++q) {
            for (int64_t j = 0; j < kPanel; ++j) {
                const int64_t col = p * kPanel + j;
                uint16_t* d = out + (q * kPanel + j) * 2;
                d[0] = col < n ? w[col * k + 2 * q] : 0;
                d[1] = col < n && 2 * q + 1 < k ? w[col * k + 2 * q + 1] : 0;
            }
        }
    }
}

// a: bf16 [m, k] row-major; packed: from fastgen_gemm_pack; bias: fp32 [n] or null;
// c: bf16 [m, n] row-major; k >= 1; num_threads: torch's (as Inductor's own loops use).
// Returns 0, or -1 where the library has no kernel for this CPU.
int fastgen_gemm(const uint16_t* a, const uint16_t* packed, const float* bias, uint16_t* c, int64_t m, int64_t n,
                 int64_t k, int num_threads) {
#if FASTGEN_HAVE_BF16
    const int64_t pairs = num_pairs(k);
    const int64_t panels = (n + kPanel - 1) / kPanel;
    // Many rows (prefill) go in chunks of about 256 KiB of A, which stay in L2 while every panel
    // sweeps them (else each panel reads all of A from L3). At 3,183 rows (SmolLM2's shapes,
    // alternating in one process) that was 1-2% faster than unchunked, at 855-890 GFLOP/s
    // against oneDNN's 646-856.
    const int64_t chunk = std::max<int64_t>(kRows, (kChunkBytes / (2 * k)) / kRows * kRows);
    const int64_t panel_elements = pairs * 2 * kPanel;
    const int64_t panel_lines = (panel_elements * 2 + 63) / 64;
    #pragma omp parallel num_threads(num_threads)
    {
        // Each thread takes a contiguous range of panels, so it knows which panel comes next and
        // fetches it while the current one computes: the row blocks after a panel's first reuse
        // it from cache and leave the memory idle otherwise. At 32 rows (SmolLM2's 121 products
        // of a decode step, weights cold, alternating in one process) this took 11.8 against
        // 13.4 ms; at 16 rows 4.8-5.7 against 5.9-6.4; prefill sizes were unchanged.
        const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
        const int64_t begin = panels * thread / threads, end = panels * (thread + 1) / threads;
        for (int64_t first = 0; first < m; first += chunk) {
            const int64_t last = std::min(m, first + chunk);
            const int64_t blocks = (last - first + kRows - 1) / kRows;
            for (int64_t p = begin; p < end; ++p) {
                const uint16_t* panel = packed + p * panel_elements;
                const int64_t next = p + 1 < end ? p + 1 : (last < m ? begin : -1);
                const char* next_panel = next < 0 ? nullptr : reinterpret_cast<const char*>(packed + next * panel_elements);
                const int64_t col = p * kPanel;
                const int64_t cols = std::min(kPanel, n - col);
                const float* b = bias ? bias + col : nullptr;
                for (int64_t block = 0; block < blocks; ++block) {
                    const int64_t r = first + block * kRows;
                    // The row blocks share the next panel's lines out between them.
                    const int64_t lo = panel_lines * block / blocks, hi = panel_lines * (block + 1) / blocks;
                    const Prefetch ahead{next_panel ? next_panel + 64 * lo : nullptr, next_panel ? hi - lo : 0,
                                         block == 0 && p == begin && first == 0};
                    rows(static_cast<int>(std::min(kRows, last - r)), a + r * k, k, panel, b, c + r * n + col, n,
                         cols, ahead);
                }
            }
        }
    }
    return 0;
#else
    (void)a, (void)packed, (void)bias, (void)c, (void)m, (void)n, (void)k, (void)num_threads;
    return -1;
#endif
}

// C [m, n] = A [m, k] . W^T (+ bias) for a weight quantized into panels: codes, ceil(n / 48)
// panels of k / 32 blocks in the lanes order (dequantize_lanes_panel; k and group_size multiples
// of 32); scales and (4-bit only, else null) offsets float16 [panels][k / group_size][48]. Each thread dequantizes its
// panels one at a time into a bf16 panel of its own (in L2 for the model's widths) and sweeps
// every row of A over it with the bf16 kernel: a weight is converted once a call, not once a row.
int fastgen_gemm_quantized(const uint16_t* a, const uint8_t* codes, const uint16_t* scales, const uint16_t* offsets,
                           const float* bias, uint16_t* c, int64_t m, int64_t n, int64_t k, int bits,
                           int64_t group_size, int num_threads) {
#if FASTGEN_HAVE_BF16
    if (k % 32 || group_size <= 0 || group_size % 32 || (bits != 8 && bits != 4) || (bits == 4 && !offsets)) return -1;
    const int64_t pairs = k / 2, panels = (n + kPanel - 1) / kPanel, groups = k / group_size;
    const int64_t panel_bytes = pairs * (bits == 8 ? 96 : 48), panel_scales = groups * kPanel;
    const int64_t chunk = std::max<int64_t>(kRows, (kChunkBytes / (2 * k)) / kRows * kRows);
    const int64_t panel_elements = pairs * 2 * kPanel;
    #pragma omp parallel num_threads(num_threads)
    {
        const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
        const int64_t begin = panels * thread / threads, end = panels * (thread + 1) / threads;
        // Rows in one chunk (a decode batch): one panel at a time, in cache. Several chunks (a
        // prefill): the thread's panels all at once, so no chunk converts them again, unless that
        // copy would pass kWholeBytes (a vocabulary-wide LM head over many rows).
        const bool whole = m > chunk && (end - begin) * panel_elements * 2 <= kWholeBytes;
        thread_local std::vector<uint16_t> scratch;
        scratch.resize((whole ? std::max<int64_t>(end - begin, 1) : 1) * panel_elements);
        if (whole) {
            for (int64_t p = begin; p < end; ++p)
                dequantize_twin_panel(codes + p * panel_bytes, scales + p * panel_scales,
                                      offsets ? offsets + p * panel_scales : nullptr, pairs, group_size, bits,
                                      scratch.data() + (p - begin) * panel_elements);
        }
        for (int64_t first = 0; first < m; first += chunk) {
            const int64_t last = std::min(m, first + chunk);
            for (int64_t p = begin; p < end; ++p) {
                uint16_t* panel = scratch.data() + (whole ? (p - begin) * panel_elements : 0);
                if (!whole)
                    dequantize_twin_panel(codes + p * panel_bytes, scales + p * panel_scales,
                                          offsets ? offsets + p * panel_scales : nullptr, pairs, group_size, bits,
                                          panel);
                const int64_t col = p * kPanel;
                const int64_t cols = std::min(kPanel, n - col);
                for (int64_t r = first; r < last; r += kRows)
                    rows(static_cast<int>(std::min(kRows, last - r)), a + r * k, k, panel,
                         bias ? bias + col : nullptr, c + r * n + col, n, cols, Prefetch{nullptr, 0, false});
            }
        }
    }
    return 0;
#else
    (void)a, (void)codes, (void)scales, (void)offsets, (void)bias, (void)c, (void)m, (void)n, (void)k, (void)bits,
        (void)group_size, (void)num_threads;
    return -1;
#endif
}

}  // extern "C"
