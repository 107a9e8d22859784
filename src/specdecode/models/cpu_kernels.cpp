// The CPU kernels of the native runtime, for x86 CPUs with AVX512-VNNI: the row-independent
// W8A8 and Q4_K linears (see quant.py, Int8Linear layout "vnni", Q4KLinear), the attention of
// decode and verify rows and the MLP's activation (attention.py: attend_rows; native.py: MLP); built by
// quant.py at first use, loaded with ctypes.
//
// y[m, n] = ((float)(sum_k q[m, k] * w[n, k]) * xs[m]) * ws[n] (+ bias[n]), where row m of x
// is quantized alone: xs[m] = max|x[m]| / 127, q = round-half-even(x / xs[m]). The integer
// sum is exact, and every float step is the same IEEE operation, in the same order, as the
// PyTorch fallback in quant.py (built with -ffp-contract=off: no fused multiply-add), so a
// row's output is the same bit for bit alone, in any batch, and on either path.
//
// vpdpbusd multiplies unsigned by signed bytes, so weights are stored as w + 128 and
// 128 * sum_k q[m, k] is subtracted at the end. Weights are packed in blocks of 16 output
// channels: pack[nb][k / 4][j][k % 4] = w[16 nb + j][k], so one 64-byte load feeds 16
// accumulators' lanes (one per output channel) with 4 products each, and a block of up to
// 8 rows of x reuses it from registers: one pass over the weights serves a verify pass of
// up to 8 tokens (NB = 2 such blocks share each load of x). The weights stream from memory
// once per 8 rows.
//
// On CPUs with AMX-INT8 (Sapphire Rapids and later), int8 passes of 2+ rows and Q4_K passes
// of 9+ rows run on the tile unit instead (sd_set_amx): TDPBSUD multiplies signed bytes of x
// by the same unsigned packed weights, whose 64-byte rows are exactly its B-tile rows (16
// channels x 4 bytes; Q4_K nibbles unpacked to bytes first, a group of 32 per tile), so it
// computes the same exact int32 sums as vpdpbusd, and every float step after them is shared
// (store_row, add_group): a row's output is the same bit for bit on either unit, alone or in
// a batch. One pass over the weights then serves up to 16 rows at the tile unit's rate.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <vector>

namespace {

constexpr int NB = 2;  // blocks of 16 output channels per step: the x loads serve both
// Weights are prefetched this far ahead of the loads: a pass of several rows computes long
// enough per byte that the hardware prefetcher alone left the loops waiting on memory
// (paired, q4 target: an 8-row pass 84 -> 78 ms; one row 65 -> 61 ms).
constexpr int64_t PREFETCH_BYTES = 8192;

// 16 outputs of one row from its int32 sums of x * (w + 128): the one float path of both
// units. y = ((acc - 128 * rowsum(x)) * xs) * ws (+ bias).
inline void store_row(__m512i acc, int32_t xsum, float xs, __m512 wsv, const float* bias,
                      float* y) {
    const __m512i exact = _mm512_sub_epi32(acc, _mm512_set1_epi32(xsum * 128));
    __m512 v = _mm512_cvtepi32_ps(exact);
    v = _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(xs)), wsv);
    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias));
    _mm512_storeu_ps(y, v);
}

// 16 floats rounded to the nearest bf16, ties to even (torch's conversion of finite values).
inline void store_bf16(__m512 v, uint16_t* dst) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    _mm256_storeu_si256((__m256i*)dst, _mm512_cvtepi32_epi16(r));
}

// acc[i][m] += sum over 4 bytes of wu (weights + 128, unsigned) * x (signed), then
// y = ((acc - 128 * rowsum(x)) * xs) * ws (+ bias) for NB blocks of 16 channels at n0.
template <int MB>
inline void block(const int8_t* xq, const int32_t* xsum, int64_t K, const uint8_t* wp,
                  const float* xs, const float* ws, const float* bias, float* y, int64_t N,
                  int64_t n0, int nb) {
    __m512i acc[NB][MB];
    for (int i = 0; i < NB; i++)
        for (int m = 0; m < MB; m++) acc[i][m] = _mm512_setzero_si512();
    const int64_t k4n = K / 4;
    const uint8_t* w1 = wp + (nb > 1 ? 16 * K : 0);
    for (int64_t k4 = 0; k4 < k4n; k4++) {
        _mm_prefetch((const char*)(wp + k4 * 64 + PREFETCH_BYTES), _MM_HINT_T0);
        _mm_prefetch((const char*)(w1 + k4 * 64 + PREFETCH_BYTES), _MM_HINT_T0);
        const __m512i wa = _mm512_loadu_si512((const void*)(wp + k4 * 64));
        const __m512i wb = _mm512_loadu_si512((const void*)(w1 + k4 * 64));
        for (int m = 0; m < MB; m++) {
            // a 4-byte group of row m, broadcast: folded into vpdpbusd's memory operand
            const __m512i xb = _mm512_set1_epi32(*(const int32_t*)(xq + m * K + k4 * 4));
            acc[0][m] = _mm512_dpbusd_epi32(acc[0][m], wa, xb);
            acc[1][m] = _mm512_dpbusd_epi32(acc[1][m], wb, xb);
        }
    }
    for (int i = 0; i < nb; i++) {
        const int64_t n = n0 + 16 * i;
        const __m512 wsv = _mm512_loadu_ps(ws + n);
        for (int m = 0; m < MB; m++)
            store_row(acc[i][m], xsum[m], xs[m], wsv, bias ? bias + n : nullptr, y + m * N + n);
    }
}

typedef void (*block_fn)(const int8_t*, const int32_t*, int64_t, const uint8_t*, const float*,
                         const float*, const float*, float*, int64_t, int64_t, int);

constexpr int MAXMB = 8;
const block_fn BLOCKS[MAXMB + 1] = {nullptr, block<1>, block<2>, block<3>, block<4>,
                                    block<5>, block<6>, block<7>, block<8>};

#ifdef __AMX_INT8__
bool use_amx = false;
bool use_amx_bf16 = false;
// The fewest rows a pass takes to the tile unit (measured on the 1.5B target, 2 cores:
// int8 2 rows 0.99x the AVX512 time, 8 rows 0.88x. Q4_K: with the weights prefetched
// (PREFETCH_BYTES) the AVX512 loop is faster up to 8 rows, where the tile loop's two tile
// products per 2 groups of 32 (K = 32 each: Q4_K's group) leave it bound by tile loads and
// stores; docs/EXPERIMENTS.md).
constexpr int64_t AMX_INT8_MIN_ROWS = 2, AMX_Q4K_MIN_ROWS = 9;

// Tiles: 0, 1 the int32 sums of two blocks of 16 channels (mb rows x 16); 2 x (mb rows x 64
// bytes); 3, 4 the two blocks' weights (16 rows of 4 bytes x 16 channels).
struct TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

void configure(int mb) {
    TileConfig c;
    for (int t = 0; t < 5; t++) {
        c.colsb[t] = 64;
        c.rows[t] = t < 3 ? mb : 16;
    }
    _tile_loadconfig(&c);
}

// sd_int8_linear on the tile unit (K % 64 == 0): per step, blocks of 16 rows of x.
void amx_int8_linear(const int8_t* xq, const float* xs, const int32_t* xsum, int64_t M,
                     int64_t K, const uint8_t* wp, const float* ws, const float* bias, int64_t N,
                     float* y) {
    const int64_t steps = (N + 16 * NB - 1) / (16 * NB);
#pragma omp parallel
    {
        int configured = 0;
        alignas(64) int32_t sums[NB][16][16];
#pragma omp for schedule(static)
        for (int64_t s = 0; s < steps; s++) {
            const uint8_t* w0 = wp + s * NB * 16 * K;
            const uint8_t* w1 = w0 + 16 * K;
            const int nb = N - s * NB * 16 < NB * 16 ? 1 : NB;
            for (int64_t m0 = 0; m0 < M; m0 += 16) {
                const int mb = M - m0 < 16 ? (int)(M - m0) : 16;
                if (mb != configured) {
                    configure(mb);
                    configured = mb;
                }
                _tile_zero(0);
                _tile_zero(1);
                for (int64_t k = 0; k < K; k += 64) {  // B row k4 = k / 4 + r at 64 * k4 bytes
                    _tile_loadd(2, xq + m0 * K + k, K);
                    _tile_loadd(3, w0 + k * 16, 64);
                    _tile_dpbsud(0, 2, 3);
                    if (nb > 1) {
                        _tile_loadd(4, w1 + k * 16, 64);
                        _tile_dpbsud(1, 2, 4);
                    }
                }
                _tile_stored(0, sums[0], 64);
                if (nb > 1) _tile_stored(1, sums[1], 64);
                for (int i = 0; i < nb; i++) {
                    const int64_t n = s * NB * 16 + 16 * i;
                    const __m512 wsv = _mm512_loadu_ps(ws + n);
                    for (int m = 0; m < mb; m++)
                        store_row(_mm512_load_si512((const void*)sums[i][m]), xsum[m0 + m],
                                  xs[m0 + m], wsv, bias ? bias + n : nullptr, y + (m0 + m) * N + n);
                }
            }
        }
        if (configured) _tile_release();
    }
}
#endif

}  // namespace

extern "C" {

// Quantize rows of x [M, K] (fp32; K % 16 == 0) into xq [M, K] int8, xs [M] and
// xsum [M] = sum_k xq. The same IEEE steps as quant.py: max|x| / 127, x / s rounded half to
// even (vcvtps2dq under the default rounding mode), clamped to +-127.
// gsum, if not null, gets [M, K / 32] sums of xq over groups of 32 (the Q4_K kernel's).
void sd_quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* xs,
                      int32_t* xsum, int32_t* gsum) {
    const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    // rows in parallel for a prefill chunk (each row's steps are its own: the same bits);
    // done by one thread, it kept the other waiting for 3 % of a 1,024-token prefill
#pragma omp parallel for schedule(static) if (M >= 16)
    for (int64_t m = 0; m < M; m++) {
        const float* r = x + m * K;
        __m512 vmax = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(r + k)));
        const float amax = _mm512_reduce_max_ps(vmax);
        const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
        xs[m] = s;
        const __m512 sv = _mm512_set1_ps(s);
        __m512i vsum = _mm512_setzero_si512();
        for (int64_t k = 0; k < K; k += 16) {
            __m512 q = _mm512_div_ps(_mm512_loadu_ps(r + k), sv);
            __m512i qi = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(q, lo), hi));
            vsum = _mm512_add_epi32(vsum, qi);
            _mm_storeu_si128((__m128i*)(xq + m * K + k), _mm512_cvtepi32_epi8(qi));
            if (gsum) {
                const int32_t part = _mm512_reduce_add_epi32(qi);
                if (k % 32 == 0) gsum[m * (K / 32) + k / 32] = part;
                else gsum[m * (K / 32) + k / 32] += part;
            }
        }
        xsum[m] = _mm512_reduce_add_epi32(vsum);
    }
}

// y [M, N] = the W8A8 product of quantized rows (xq, xs, xsum) and packed weights wp
// (weights + 128; N % 16 == 0, K % 16 == 0); bias may be null.
void sd_int8_linear(const int8_t* xq, const float* xs, const int32_t* xsum, int64_t M,
                    int64_t K, const uint8_t* wp, const float* ws, const float* bias, int64_t N,
                    float* y) {
#ifdef __AMX_INT8__
    if (use_amx && M >= AMX_INT8_MIN_ROWS && K % 64 == 0) {
        amx_int8_linear(xq, xs, xsum, M, K, wp, ws, bias, N, y);
        return;
    }
#endif
    const int64_t steps = (N + 16 * NB - 1) / (16 * NB);
#pragma omp parallel for schedule(static)
    for (int64_t s = 0; s < steps; s++) {
        const uint8_t* w = wp + s * NB * 16 * K;
        for (int64_t m0 = 0; m0 < M; m0 += MAXMB) {
            const int64_t mb = M - m0 < MAXMB ? M - m0 : MAXMB;
            const int nb = N - s * NB * 16 < NB * 16 ? 1 : NB;  // a last single block
            BLOCKS[mb](xq + m0 * K, xsum + m0, K, w, xs + m0, ws, bias, y + m0 * N, N,
                       s * NB * 16, nb);
        }
    }
}

// Use the tile unit for passes of 2+ rows (on = 1) or not (0); returns whether it is in use:
// 0 where the CPU lacks AMX-INT8, Linux does not grant this process the tile state, or the
// kernel was built without AMX. The output is the same bits either way.
int sd_set_amx(int on) {
#ifdef __AMX_INT8__
    static int available = -1;
    if (available < 0) {
        unsigned a, b, c, d;
        __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
        const bool cpu = (d >> 24 & 1) && (d >> 25 & 1);  // AMX-TILE, AMX-INT8
        // ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18): once per process
        available = cpu && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    }
    use_amx = on && available;
#ifdef __AMX_BF16__
    unsigned a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    use_amx_bf16 = use_amx && (d >> 22 & 1);  // AMX-BF16
#endif
    return use_amx;
#else
    (void)on;
    return 0;
#endif
}

int sd_amx_in_use() {
#ifdef __AMX_INT8__
    return use_amx;
#else
    return 0;
#endif
}

}  // extern "C"

namespace {

// Q4_K weights: w = d * sc * q - dmin * m, q in 0..15, sc and m 6-bit per group of 32, d and
// dmin fp16 per 256 (llama.cpp's block_q4_K, taken from the GGUF file as they are). Per
// block of 16 channels: wq [K/32][4][16][4] bytes, byte (v, j, b) of group g holding q of
// k = 32 g + 8 v + b (low nibble) and k + 4 (high nibble) of channel j; d, dmin [K/256][16]
// fp16; sc, mn [K/32][16] uint8. Per group and row: the exact int32 sum of q * xq, then
// f = (f + A * sum) - B * gsum with A = d * sc, B = dmin * m as gguf-py dequantizes them.
// The float steps both units share (so that they give the same bits): a group's scales
// A = d * sc and B = dmin * m for 16 channels; f = (f + A * sum) - B * gsum; the row's output.
inline void group_scales(const uint16_t* d, const uint16_t* dmin, const uint8_t* sc,
                         const uint8_t* mn, int64_t g, __m512& a, __m512& bm) {
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(d + (g / 8) * 16)));
    const __m512 dmv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(dmin + (g / 8) * 16)));
    a = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
        _mm_loadu_si128((const __m128i*)(sc + g * 16)))));
    bm = _mm512_mul_ps(dmv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
        _mm_loadu_si128((const __m128i*)(mn + g * 16)))));
}

inline __m512 add_group(__m512 f, __m512 a, __m512 bm, __m512i sum, int32_t gsum) {
    const __m512 t = _mm512_add_ps(f, _mm512_mul_ps(a, _mm512_cvtepi32_ps(sum)));
    return _mm512_sub_ps(t, _mm512_mul_ps(bm, _mm512_set1_ps((float)gsum)));
}

inline void store_q4k_row(__m512 f, float xs, const float* bias, float* y) {
    __m512 v = _mm512_mul_ps(f, _mm512_set1_ps(xs));
    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias));
    _mm512_storeu_ps(y, v);
}

template <int MB>
inline void q4k_block(const int8_t* xq, const int32_t* gsum, int64_t K, const uint8_t* wq,
                      const uint16_t* d, const uint16_t* dmin, const uint8_t* sc,
                      const uint8_t* mn, const float* xs, const float* bias, float* y,
                      int64_t N, int64_t n0) {
    __m512 f[MB];
    for (int m = 0; m < MB; m++) f[m] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F);
    const int64_t groups = K / 32;
    for (int64_t g = 0; g < groups; g++) {
        for (int c = 0; c < 4; c++)
            _mm_prefetch((const char*)(wq + g * 256 + PREFETCH_BYTES + 64 * c), _MM_HINT_T0);
        __m512 a, bm;
        group_scales(d, dmin, sc, mn, g, a, bm);
        __m512i acc[MB];
        for (int m = 0; m < MB; m++) acc[m] = _mm512_setzero_si512();
        for (int v = 0; v < 4; v++) {
            const __m512i w = _mm512_loadu_si512((const void*)(wq + (g * 4 + v) * 64));
            const __m512i lo = _mm512_and_si512(w, low);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
            for (int m = 0; m < MB; m++) {
                const int8_t* r = xq + m * K + g * 32 + v * 8;
                acc[m] = _mm512_dpbusd_epi32(acc[m], lo, _mm512_set1_epi32(*(const int32_t*)r));
                acc[m] = _mm512_dpbusd_epi32(acc[m], hi, _mm512_set1_epi32(*(const int32_t*)(r + 4)));
            }
        }
        for (int m = 0; m < MB; m++) f[m] = add_group(f[m], a, bm, acc[m], gsum[m * groups + g]);
    }
    for (int m = 0; m < MB; m++) store_q4k_row(f[m], xs[m], bias ? bias + n0 : nullptr, y + m * N + n0);
}

typedef void (*q4k_fn)(const int8_t*, const int32_t*, int64_t, const uint8_t*, const uint16_t*,
                       const uint16_t*, const uint8_t*, const uint8_t*, const float*,
                       const float*, float*, int64_t, int64_t);
const q4k_fn Q4K_BLOCKS[MAXMB + 1] = {nullptr, q4k_block<1>, q4k_block<2>, q4k_block<3>,
                                      q4k_block<4>, q4k_block<5>, q4k_block<6>, q4k_block<7>,
                                      q4k_block<8>};

#ifdef __AMX_INT8__
// Tiles: 0, 1 the int32 sums of two groups of 32 (mb rows x 16 channels); 2, 3 their x (mb
// rows x 32 bytes); 4, 5 their weights unpacked to bytes (8 rows of 4 bytes x 16 channels).
void configure_q4k(int mb) {
    TileConfig c;
    for (int t = 0; t < 6; t++) {
        c.rows[t] = t < 4 ? mb : 8;
        c.colsb[t] = t == 2 || t == 3 ? 32 : 64;
    }
    _tile_loadconfig(&c);
}

// The 8 B-tile rows of group g: its 4 packed vectors' low nibbles (k-quad 2v) and high
// nibbles (k-quad 2v + 1), as q4k_block reads them.
inline void unpack_group(const uint8_t* wq, int64_t g, uint8_t* b) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int v = 0; v < 4; v++) {
        const __m512i w = _mm512_loadu_si512((const void*)(wq + (g * 4 + v) * 64));
        _mm512_store_si512((void*)(b + 128 * v), _mm512_and_si512(w, low));
        _mm512_store_si512((void*)(b + 128 * v + 64), _mm512_and_si512(_mm512_srli_epi16(w, 4), low));
    }
}

// sd_q4k_linear on the tile unit: per block of 16 channels and 16 rows, two groups in flight.
void amx_q4k_linear(const int8_t* xq, const float* xs, const int32_t* gsum, int64_t M, int64_t K,
                    const uint8_t* wq, const uint16_t* d, const uint16_t* dmin, const uint8_t* sc,
                    const uint8_t* mn, const float* bias, int64_t N, float* y) {
    const int64_t nblocks = N / 16, groups = K / 32;
#pragma omp parallel
    {
        int configured = 0;
        alignas(64) uint8_t b[2][512];
        alignas(64) int32_t sums[2][16][16];
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < nblocks; nb++) {
            const uint8_t* w = wq + nb * 16 * K / 2;
            const uint16_t* dn = d + nb * 16 * (K / 256);
            const uint16_t* dmn = dmin + nb * 16 * (K / 256);
            const uint8_t* scn = sc + nb * 16 * (K / 32);
            const uint8_t* mnn = mn + nb * 16 * (K / 32);
            for (int64_t m0 = 0; m0 < M; m0 += 16) {
                const int mb = M - m0 < 16 ? (int)(M - m0) : 16;
                if (mb != configured) {
                    configure_q4k(mb);
                    configured = mb;
                }
                __m512 f[16];
                for (int m = 0; m < mb; m++) f[m] = _mm512_setzero_ps();
                const int8_t* x = xq + m0 * K;
                const int32_t* gs = gsum + m0 * groups;
                for (int64_t g = 0; g < groups; g += 2) {  // groups is a multiple of 8
                    for (int c = 0; c < 8; c++)
                        _mm_prefetch((const char*)(w + g * 256 + PREFETCH_BYTES + 64 * c), _MM_HINT_T0);
                    unpack_group(w, g, b[0]);
                    unpack_group(w, g + 1, b[1]);
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_loadd(2, x + 32 * g, K);
                    _tile_loadd(3, x + 32 * (g + 1), K);
                    _tile_loadd(4, b[0], 64);
                    _tile_loadd(5, b[1], 64);
                    _tile_dpbsud(0, 2, 4);
                    _tile_dpbsud(1, 3, 5);
                    _tile_stored(0, sums[0], 64);
                    _tile_stored(1, sums[1], 64);
                    for (int i = 0; i < 2; i++) {
                        __m512 a, bm;
                        group_scales(dn, dmn, scn, mnn, g + i, a, bm);
                        for (int m = 0; m < mb; m++)
                            f[m] = add_group(f[m], a, bm, _mm512_load_si512((const void*)sums[i][m]),
                                             gs[m * groups + g + i]);
                    }
                }
                for (int m = 0; m < mb; m++)
                    store_q4k_row(f[m], xs[m0 + m], bias ? bias + nb * 16 : nullptr,
                                  y + (m0 + m) * N + nb * 16);
            }
        }
        if (configured) _tile_release();
    }
}
#endif

}  // namespace

extern "C" {

// y [M, N] from quantized rows (xq, xs, gsum) and Q4_K weights packed as above (N % 16 == 0,
// K % 256 == 0); bias may be null.
void sd_q4k_linear(const int8_t* xq, const float* xs, const int32_t* gsum, int64_t M, int64_t K,
                   const uint8_t* wq, const uint16_t* d, const uint16_t* dmin, const uint8_t* sc,
                   const uint8_t* mn, const float* bias, int64_t N, float* y) {
#ifdef __AMX_INT8__
    if (use_amx && M >= AMX_Q4K_MIN_ROWS) {
        amx_q4k_linear(xq, xs, gsum, M, K, wq, d, dmin, sc, mn, bias, N, y);
        return;
    }
#endif
    const int64_t nblocks = N / 16;
#pragma omp parallel for schedule(static)
    for (int64_t nb = 0; nb < nblocks; nb++) {
        for (int64_t m0 = 0; m0 < M; m0 += MAXMB) {
            const int64_t mb = M - m0 < MAXMB ? M - m0 : MAXMB;
            Q4K_BLOCKS[mb](xq + m0 * K, gsum + m0 * (K / 32), K, wq + nb * 16 * K / 2,
                           d + nb * 16 * (K / 256), dmin + nb * 16 * (K / 256),
                           sc + nb * 16 * (K / 32), mn + nb * 16 * (K / 32), xs + m0, bias,
                           y + m0 * N, N, nb * 16);
        }
    }
}

}  // extern "C"

namespace {

// Scratch for the activations of the calling thread (a Python thread per request may call
// at once: ctypes releases the GIL), grown as needed, never shrunk.
struct Scratch {
    std::vector<float> xpad;
    std::vector<int8_t> xq;
    std::vector<float> xs;
    std::vector<int32_t> xsum, gsum;
};
thread_local Scratch scratch;

}  // namespace

extern "C" {

// The same as sd_quantize_rows + sd_int8_linear, in one call from fp32 x [M, K]: one
// crossing from Python instead of two, and no tensors allocated for the quantized rows.
void sd_int8_linear_x(const float* x, int64_t M, int64_t K, const uint8_t* wp, const float* ws,
                      const float* bias, int64_t N, float* y) {
    Scratch& s = scratch;
    s.xq.resize(M * K);
    s.xs.resize(M);
    s.xsum.resize(M);
    sd_quantize_rows(x, M, K, s.xq.data(), s.xs.data(), s.xsum.data(), nullptr);
    sd_int8_linear(s.xq.data(), s.xs.data(), s.xsum.data(), M, K, wp, ws, bias, N, y);
}

// sd_quantize_rows (with group sums) + sd_q4k_linear from fp32 x [M, Kin]; the weights
// cover K >= Kin inputs (K % 256 == 0, Kin % 16 == 0), those past Kin meeting zeros, which
// change neither a row's scale nor any sum (so the result is that of x padded with zeros).
void sd_q4k_linear_x(const float* x, int64_t M, int64_t Kin, int64_t K, const uint8_t* wq,
                     const uint16_t* d, const uint16_t* dmin, const uint8_t* sc,
                     const uint8_t* mn, const float* bias, int64_t N, float* y) {
    Scratch& s = scratch;
    if (Kin != K) {
        s.xpad.assign(M * K, 0.0f);
        for (int64_t m = 0; m < M; m++) memcpy(s.xpad.data() + m * K, x + m * Kin, Kin * sizeof(float));
        x = s.xpad.data();
    }
    s.xq.resize(M * K);
    s.xs.resize(M);
    s.xsum.resize(M);
    s.gsum.resize(M * (K / 32));
    sd_quantize_rows(x, M, K, s.xq.data(), s.xs.data(), s.xsum.data(), s.gsum.data());
    sd_q4k_linear(s.xq.data(), s.xs.data(), s.gsum.data(), M, K, wq, d, dmin, sc, mn, bias, N, y);
}

}  // extern "C"

// Causal attention of decode and verify rows (attention.py, attend_rows). Query row (b, t) of
// head h attends to cache slots 0..lens[b * T + t] - 1 of its KV head, computed by one thread
// in one fixed order that depends only on that row's own query, keys and values: a row comes
// out the same bit for bit alone or among any other rows (the property speculative decoding
// needs), at any thread count. fp32 throughout; head_dim % 16 == 0.
namespace {

// exp(x) to ~1 ulp (Cephes' expf: Cody-Waite reduction by ln 2, degree-5 polynomial, 2^n
// applied by vscalefps); below -87 it returns ~1e-38, not 0 (harmless in a softmax), above
// ~88.7 it overflows to inf (silu's 1 / (1 + inf) = 0, as in PyTorch).
inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1); }

// out[h][0..16 NV) = sum_j p[h][j] * v[slot(j)] / sum[h] for hc <= 24 / NV heads (p stride
// n, out stride D): each pass over the values serves several heads, in registers.
template <int NV, typename Slot>
void weigh_values(const float* p, int64_t n, int hc, const float* v, int64_t sl, Slot slot,
                  const float* sum, float* out, int64_t D) {
    constexpr int HG = 24 / NV;
    __m512 acc[HG][NV];
    for (int h = 0; h < HG; h++)
        for (int c = 0; c < NV; c++) acc[h][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        const float* vj = v + slot(j) * sl;
        __m512 vv[NV];
        for (int c = 0; c < NV; c++) vv[c] = _mm512_loadu_ps(vj + 16 * c);
        for (int h = 0; h < HG; h++) {
            if (h >= hc) break;
            const __m512 ph = _mm512_set1_ps(p[h * n + j]);
            for (int c = 0; c < NV; c++) acc[h][c] = _mm512_fmadd_ps(ph, vv[c], acc[h][c]);
        }
    }
    for (int h = 0; h < hc; h++) {
        const __m512 sh = _mm512_set1_ps(sum[h]);
        for (int c = 0; c < NV; c++)
            _mm512_storeu_ps(out + h * D + 16 * c, _mm512_div_ps(acc[h][c], sh));
    }
}

template <typename Slot>
void weigh(int nv, const float* p, int64_t n, int hc, const float* v, int64_t sl, Slot slot,
           const float* sum, float* out, int64_t D) {
    switch (nv) {
        case 1: weigh_values<1>(p, n, hc, v, sl, slot, sum, out, D); break;
        case 2: weigh_values<2>(p, n, hc, v, sl, slot, sum, out, D); break;
        case 3: weigh_values<3>(p, n, hc, v, sl, slot, sum, out, D); break;
        case 4: weigh_values<4>(p, n, hc, v, sl, slot, sum, out, D); break;
        case 5: weigh_values<5>(p, n, hc, v, sl, slot, sum, out, D); break;
        case 6: weigh_values<6>(p, n, hc, v, sl, slot, sum, out, D); break;
        case 7: weigh_values<7>(p, n, hc, v, sl, slot, sum, out, D); break;
        default: weigh_values<8>(p, n, hc, v, sl, slot, sum, out, D); break;
    }
}
constexpr int HEADS_PER_PASS[9] = {0, 24, 12, 8, 6, 4, 4, 3, 3};

// Lane k of the result = the sum of the 16 lanes of a[k]: a transpose-and-add tree that
// sums every input's lanes in the same order (l + 8, then + 4, + 2, + 1), so a key's score
// does not depend on its place among the 16.
inline __m512 sum16(const __m512* a) {
    __m512 c[8], d[4], e[2];
    for (int j = 0; j < 8; j++)
        c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[j], a[j + 8], 0x44),
                             _mm512_shuffle_f32x4(a[j], a[j + 8], 0xEE));
    for (int j = 0; j < 4; j++)
        d[j] = _mm512_add_ps(_mm512_shuffle_f32x4(c[j], c[j + 4], 0x88),
                             _mm512_shuffle_f32x4(c[j], c[j + 4], 0xDD));
    for (int j = 0; j < 2; j++)
        e[j] = _mm512_add_ps(_mm512_shuffle_ps(d[j], d[j + 2], 0x44),
                             _mm512_shuffle_ps(d[j], d[j + 2], 0xEE));
    const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], 0x88),
                                   _mm512_shuffle_ps(e[0], e[1], 0xDD));
    // f's lane p holds key PERM[p]; PERM is its own inverse
    const __m512i perm = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
    return _mm512_permutexvar_ps(perm, f);
}

// g query heads (q, stride qh) of one row against the n keys at slots slot(0..n-1) of one
// KV head, in that order: scores of 16 keys at a time (keys past n get 0 and are never
// read), then per head softmax and the values. The arithmetic depends only on that sequence
// of keys and values, not on where they sit in the cache: a draft tree's node attending to
// the committed slots and its ancestors computes the bits of the one-token pass that sees
// the same keys at consecutive slots.
template <typename Slot>
void attend_group(const float* q, int64_t qh, int g, int64_t D, const float* k, const float* v,
                  int64_t sl, int64_t n, Slot slot, float scale, float* out, float* s) {
    const __m512 sv = _mm512_set1_ps(scale);
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
        const int64_t cnt = n - j0 < 16 ? n - j0 : 16;
        for (int i = 0; i < g; i++) {
            const float* qi = q + i * qh;
            __m512 acc[16];
            for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d += 16) {
                const __m512 qd = _mm512_loadu_ps(qi + d);
                for (int j = 0; j < cnt; j++)
                    acc[j] = _mm512_fmadd_ps(qd, _mm512_loadu_ps(k + slot(j0 + j) * sl + d), acc[j]);
            }
            _mm512_mask_storeu_ps(s + i * n + j0, tail_mask(cnt), _mm512_mul_ps(sum16(acc), sv));
        }
    }
    float sums[256];  // g <= 256 (checked by the caller)
    for (int i = 0; i < g; i++) {
        float* si = s + i * n;
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < n; j += 16)
            vmax = _mm512_mask_max_ps(vmax, tail_mask(n - j), vmax, _mm512_loadu_ps(si + j));
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
        __m512 vsum = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 t = tail_mask(n - j);
            const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(t, si + j), m));
            vsum = _mm512_mask_add_ps(vsum, t, vsum, e);
            _mm512_mask_storeu_ps(si + j, t, e);
        }
        sums[i] = _mm512_reduce_add_ps(vsum);
    }
    for (int64_t d0 = 0; d0 < D; d0 += 128) {
        const int nv = (int)((D - d0 < 128 ? D - d0 : 128) / 16);
        for (int h0 = 0; h0 < g; h0 += HEADS_PER_PASS[nv]) {
            const int hc = g - h0 < HEADS_PER_PASS[nv] ? g - h0 : HEADS_PER_PASS[nv];
            weigh(nv, s + h0 * n, n, hc, v + d0, sl, slot, sums + h0, out + h0 * D + d0, D);
        }
    }
}

thread_local std::vector<float> scores;

}  // namespace

extern "C" {

// sd_attend with query (b, t) seeing the slots slots[(b*T+t)*S + 0..lens[b*T+t]-1], in that
// order (a draft tree: the committed slots, then the node's ancestors and itself); slots
// null: slots 0..lens[b*T+t]-1.
void sd_attend_slots(const float* q, int64_t B, int64_t T, int64_t H, int64_t D, int64_t qb,
                     int64_t qt, int64_t qh, const float* k, const float* v, int64_t Hkv,
                     int64_t L, const int64_t* lens, const int64_t* slots, int64_t S,
                     float scale, float* out) {
    const int g = (int)(H / Hkv);
    const int64_t items = B * T * Hkv;
    // round robin: a causal chunk's later rows see more slots, so halves would be unequal
#pragma omp parallel for schedule(static, 1)
    for (int64_t it = 0; it < items; it++) {
        const int64_t b = it / (T * Hkv), t = it / Hkv % T, kv = it % Hkv;
        const int64_t n = lens[b * T + t];
        if ((int64_t)scores.size() < g * n) scores.resize(g * n);
        const int64_t cache = (b * Hkv + kv) * L * D;
        const float* qi = q + b * qb + t * qt + kv * g * qh;
        float* o = out + ((b * T + t) * H + kv * g) * D;
        if (slots == nullptr) {
            attend_group(qi, qh, g, D, k + cache, v + cache, D, n, [](int64_t j) { return j; },
                         scale, o, scores.data());
        } else {
            const int64_t* sl = slots + (b * T + t) * S;
            attend_group(qi, qh, g, D, k + cache, v + cache, D, n, [sl](int64_t j) { return sl[j]; },
                         scale, o, scores.data());
        }
    }
}

// out [B, T, H, D] = attention of q (element strides qb, qt, qh; D contiguous) over the
// caches k, v [B, Hkv, L, D] (contiguous), query (b, t) seeing slots 0..lens[b*T+t]-1
// (1 <= lens <= L); H % Hkv == 0, D % 16 == 0; scores scaled by `scale`.
void sd_attend(const float* q, int64_t B, int64_t T, int64_t H, int64_t D, int64_t qb,
               int64_t qt, int64_t qh, const float* k, const float* v, int64_t Hkv, int64_t L,
               const int64_t* lens, float scale, float* out) {
    sd_attend_slots(q, B, T, H, D, qb, qt, qh, k, v, Hkv, L, lens, nullptr, 0, scale, out);
}

}  // extern "C"

extern "C" {

// out[i] = silu(gate[i]) * up[i] = gate[i] / (1 + exp(-gate[i])) * up[i] for n floats: the
// MLP's activation in one pass (element-wise, so rows stay independent).
void sd_silu_mul(const float* gate, const float* up, int64_t n, float* out) {
    const int64_t chunks = (n + 15) / 16;
#pragma omp parallel for schedule(static) if (n >= 16384)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t i = 16 * c;
        const __mmask16 t = tail_mask(n - i);
        const __m512 g = _mm512_maskz_loadu_ps(t, gate + i);
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g));
        const __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        _mm512_mask_storeu_ps(out + i, t, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(t, up + i)));
    }
}

}  // extern "C"

// Long passes (prefill chunks) of the int8 and Q4_K linears on the AMX-BF16 tile unit:
// y [M, N] fp32 = x [M, K] (rounded to bf16) times the weight dequantized to bf16 (see
// q4k_panel), products summed in fp32 by
// TDPBF16PS. The weight is the A operand (16 output channels x 32 inputs a tile, rows as they
// are dequantized) and x, packed in pairs, the B operand, so each 16 x 16 result tile is
// y^T. Per panel of 32 channels the weights are dequantized once into a buffer of the
// thread (K x 64 bytes: in its L2) and serve every row of x. Each output is the sum over the
// groups of 32 inputs in order, whatever M and the other rows: a row's bits are its own, so
// rows of several requests can share a pass.
namespace {

#if defined(__AMX_INT8__) && defined(__AMX_BF16__)
inline uint16_t bf16_bits(float f) {  // nearest, ties to even (finite values)
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// x [M, K] fp32 -> pairs for B tiles: xb[(mb * G + g) * 256 + r * 16 + m] = the bf16 pair
// (x[16 mb + m][32 g + 2 r], x[...][32 g + 2 r + 1]); rows past M are zeros.
void pack_x(const float* x, int64_t M, int64_t K, uint32_t* xb) {
    const int64_t G = K / 32, MB = (M + 15) / 16;
#pragma omp parallel for schedule(static)
    for (int64_t mb = 0; mb < MB; mb++)
        for (int m = 0; m < 16; m++) {
            const int64_t row = 16 * mb + m;
            for (int64_t g = 0; g < G; g++) {
                uint32_t* t = xb + (mb * G + g) * 256 + m;
                if (row >= M) {
                    for (int r = 0; r < 16; r++) t[r * 16] = 0;
                    continue;
                }
                const float* xr = x + row * K + 32 * g;
                for (int r = 0; r < 16; r++)
                    t[r * 16] = bf16_bits(xr[2 * r]) | ((uint32_t)bf16_bits(xr[2 * r + 1]) << 16);
            }
        }
}

// One panel's weights in bf16: wp[g * 32 + c][0..31] = channel n0 + c, inputs 32 g .. 32 g +
// 31, each gguf-py's fp32 value ((d * sc) * q - dmin * m for Q4_K, q * ws for int8) rounded
// to the nearest bf16, ties to even.
typedef void (*panel_fn)(const void* const* w, int64_t n0, int64_t K, int64_t Kp, uint16_t* wp);

void q4k_panel(const void* const* w, int64_t n0, int64_t K, int64_t Kp, uint16_t* wp) {
    const uint8_t* wq = (const uint8_t*)w[0];
    const uint16_t* d = (const uint16_t*)w[1];
    const uint16_t* dmin = (const uint16_t*)w[2];
    const uint8_t* sc = (const uint8_t*)w[3];
    const uint8_t* mn = (const uint8_t*)w[4];
    const __m128i low = _mm_set1_epi8(0x0F);
    alignas(64) float a[16], bm[16];
    for (int half = 0; half < 2; half++) {
        const int64_t nb = n0 / 16 + half;
        const uint8_t* wn = wq + nb * 16 * Kp / 2;
        for (int64_t g = 0; g < K / 32; g++) {
            __m512 av, bv;
            group_scales(d + nb * 16 * (Kp / 256), dmin + nb * 16 * (Kp / 256),
                         sc + nb * 16 * (Kp / 32), mn + nb * 16 * (Kp / 32), g, av, bv);
            _mm512_store_ps(a, av);
            _mm512_store_ps(bm, bv);
            const uint8_t* wg = wn + g * 256;
            for (int j = 0; j < 16; j++) {
                const __m128i x = _mm_set_epi32(*(const int32_t*)(wg + 192 + 4 * j),
                                                *(const int32_t*)(wg + 128 + 4 * j),
                                                *(const int32_t*)(wg + 64 + 4 * j),
                                                *(const int32_t*)(wg + 4 * j));
                const __m128i lo = _mm_and_si128(x, low);
                const __m128i hi = _mm_and_si128(_mm_srli_epi16(x, 4), low);
                const __m128i halves[2] = {_mm_unpacklo_epi32(lo, hi), _mm_unpackhi_epi32(lo, hi)};
                uint16_t* row = wp + (g * 32 + 16 * half + j) * 32;
                for (int h = 0; h < 2; h++) {
                    const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(halves[h]));
                    store_bf16(_mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(a[j]), q),
                                             _mm512_set1_ps(bm[j])), row + 16 * h);
                }
            }
        }
    }
}

void int8_panel(const void* const* w, int64_t n0, int64_t K, int64_t, uint16_t* wp) {
    const uint8_t* q8 = (const uint8_t*)w[0];
    const float* ws = (const float*)w[1];
    for (int c = 0; c < 32; c++) {
        const int64_t n = n0 + c;
        const uint8_t* wn = q8 + (n / 16) * 16 * K + 4 * (n % 16);
        const __m512 s = _mm512_set1_ps(ws[n]);
        for (int64_t k = 0; k < K; k += 16) {
            const uint8_t* q = wn + (k / 4) * 64;
            const __m128i x = _mm_set_epi32(*(const int32_t*)(q + 192), *(const int32_t*)(q + 128),
                                            *(const int32_t*)(q + 64), *(const int32_t*)q);
            const __m512i v = _mm512_sub_epi32(_mm512_cvtepu8_epi32(x), _mm512_set1_epi32(128));
            store_bf16(_mm512_mul_ps(_mm512_cvtepi32_ps(v), s), wp + ((k / 32) * 32 + c) * 32 + k % 32);
        }
    }
}

// Tiles: 0, 1 weights (channels c0 .. c0+15, c0+16 ..); 2, 3 x pairs (rows of two blocks of
// 16); 4..7 the sums, tile 4 + 2 a + b = channels of a, rows of b.
void configure_bf16() {
    TileConfig c;
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = 16;
    }
    _tile_loadconfig(&c);
}

void bf16_linear(panel_fn panel, const void* const* w, const float* x, int64_t M, int64_t K,
                 int64_t Kp, const float* bias, int64_t N, float* y) {
    const int64_t G = K / 32, MB = (M + 15) / 16, panels = N / 32;
    std::vector<uint32_t> xb(MB * G * 256);
    pack_x(x, M, K, xb.data());
#pragma omp parallel
    {
        configure_bf16();
        std::vector<uint16_t> wp(G * 32 * 32);
        alignas(64) float c[16][16];
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const int64_t n0 = 32 * p;
            panel(w, n0, K, Kp, wp.data());
            for (int64_t mb = 0; mb < MB; mb += 2) {
                const int nbx = mb + 1 < MB ? 2 : 1;
                _tile_zero(4);
                _tile_zero(5);
                _tile_zero(6);
                _tile_zero(7);
                const uint32_t* x0 = xb.data() + mb * G * 256;
                const uint32_t* x1 = x0 + (nbx > 1 ? G * 256 : 0);
                for (int64_t g = 0; g < G; g++) {
                    // the next group's tiles into L1 while these multiply
                    const char* nw = (const char*)(wp.data() + (g + 1) * 1024);
                    const char* n0x = (const char*)(x0 + (g + 1) * 256);
                    const char* n1x = (const char*)(x1 + (g + 1) * 256);
                    for (int l = 0; l < 2048; l += 64) _mm_prefetch(nw + l, _MM_HINT_T0);
                    for (int l = 0; l < 1024; l += 64) {
                        _mm_prefetch(n0x + l, _MM_HINT_T0);
                        _mm_prefetch(n1x + l, _MM_HINT_T0);
                    }
                    _tile_loadd(0, wp.data() + g * 1024, 64);
                    _tile_loadd(1, wp.data() + g * 1024 + 512, 64);
                    _tile_loadd(2, x0 + g * 256, 64);
                    _tile_loadd(3, x1 + g * 256, 64);
                    _tile_dpbf16ps(4, 0, 2);
                    _tile_dpbf16ps(5, 0, 3);
                    _tile_dpbf16ps(6, 1, 2);
                    _tile_dpbf16ps(7, 1, 3);
                }
                for (int t = 0; t < 4; t++) {
                    const int a = t / 2, b = t % 2;
                    if (b >= nbx) continue;
                    switch (t) {  // the tile number must be a constant
                        case 0: _tile_stored(4, c, 64); break;
                        case 1: _tile_stored(5, c, 64); break;
                        case 2: _tile_stored(6, c, 64); break;
                        default: _tile_stored(7, c, 64); break;
                    }
                    for (int m = 0; m < 16; m++) {
                        const int64_t row = 16 * (mb + b) + m;
                        if (row >= M) break;
                        float* yr = y + row * N + n0 + 16 * a;
                        for (int j = 0; j < 16; j++)
                            yr[j] = bias ? c[j][m] + bias[n0 + 16 * a + j] : c[j][m];
                    }
                }
            }
        }
        _tile_release();
    }
}
#endif

}  // namespace

extern "C" {

// Whether sd_q4k_linear_bf16 / sd_int8_linear_bf16 can run (AMX-BF16, the tile unit in use).
int sd_amx_bf16_in_use() {
#if defined(__AMX_INT8__) && defined(__AMX_BF16__)
    return use_amx_bf16;
#else
    return 0;
#endif
}

// y [M, N] of a long pass on the tile unit (see above): x fp32 [M, K] (K % 32 == 0, the
// weights cover Kp >= K inputs), Q4_K weights as sd_q4k_linear's; N % 32 == 0.
void sd_q4k_linear_bf16(const float* x, int64_t M, int64_t K, int64_t Kp, const uint8_t* wq,
                        const uint16_t* d, const uint16_t* dmin, const uint8_t* sc,
                        const uint8_t* mn, const float* bias, int64_t N, float* y) {
#if defined(__AMX_INT8__) && defined(__AMX_BF16__)
    const void* w[5] = {wq, d, dmin, sc, mn};
    bf16_linear(q4k_panel, w, x, M, K, Kp, bias, N, y);
#endif
}

// The same for int8 weights packed for vnni (K % 32 == 0, N % 32 == 0).
void sd_int8_linear_bf16(const float* x, int64_t M, int64_t K, const uint8_t* wp,
                         const float* ws, const float* bias, int64_t N, float* y) {
#if defined(__AMX_INT8__) && defined(__AMX_BF16__)
    const void* w[2] = {wp, ws};
    bf16_linear(int8_panel, w, x, M, K, K, bias, N, y);
#endif
}

}  // extern "C"


// ---- the decoder layer stack in one call (cpu_layers.h, models/fused.py) ----

extern "C" {

// out[m, :] = w * (x[m, :] * r), r = 1 / sqrt(mean(x[m, :]^2) + eps), for M rows of N floats:
// each row's sum of squares in one fixed order (16 lanes, masked tail, then the lanes'
// sum), its own bits whatever M.
void sd_rmsnorm(const float* x, int64_t M, int64_t N, const float* w, float eps, float* out) {
    for (int64_t m = 0; m < M; m++) {
        const float* r = x + m * N;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t k = 0; k < N; k += 16) {
            const __m512 v = _mm512_maskz_loadu_ps(tail_mask(N - k), r + k);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        const float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)N + eps);
        const __m512 iv = _mm512_set1_ps(inv);
        float* o = out + m * N;
        for (int64_t k = 0; k < N; k += 16) {
            const __mmask16 t = tail_mask(N - k);
            const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(t, r + k), iv);
            _mm512_mask_storeu_ps(o + k, t, _mm512_mul_ps(_mm512_maskz_loadu_ps(t, w + k), v));
        }
    }
}

}  // extern "C"

namespace {

// kind 0 of cpu_layers.h's linears: an Int8Linear "vnni" (p0 qweight, p1 wscale, p2 bias or 0)
inline void int8_linear_x(const float* in, int64_t m, int64_t k, const int64_t* p, int64_t n,
                          float* out) {
    sd_int8_linear_x(in, m, k, (const uint8_t*)p[0], (const float*)p[1], (const float*)p[2], n, out);
}

}  // namespace

#include "cpu_convert.h"
#include "cpu_layers.h"
