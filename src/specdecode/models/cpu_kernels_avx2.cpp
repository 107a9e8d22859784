// The CPU kernels for x86 CPUs with AVX2 but without AVX512-VNNI (cpu_kernels.cpp has the
// AVX512 ones), where torch._int_mm runs a reference loop (~50x slower than an fp32 matmul of
// the same shape) and PyTorch's attention over rows of different lengths is not
// row-independent. The functions have the contracts of their AVX512 namesakes:
//
// sd_int8_mm_nk: the int8 x int8 -> int32 product of the W8A8 linears, y[m, n] = sum_k
//   x[m, k] * w[n, k] (w in the "nk" layout), exact in any order: the same bits as
//   torch._int_mm's, every row's its own, for weights and activations in -127..127 (the
//   symmetric int8 of quantize_rows; -128 would saturate vpmaddubsw, see tile()).
// sd_attend: causal attention of decode and verify rows, each (row, KV head) computed by one
//   thread in one fixed order that depends only on its own query, keys and values;
//   sd_attend_slots the same over a list of slots a query (a draft tree node).
// sd_silu_mul: silu(gate) * up, element-wise.
// sd_q4k_linear_x: the Q4_K linear of quant.Q4KLinear, the AVX512 kernel's bits.
// sd_rmsnorm, sd_layers: RMSNorm, and the decoder layer stack in one call (cpu_layers.h).

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

static inline int32_t hsum(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

// rows r0..r0+R-1 against channel j (R <= 8): R accumulators in registers. 32 products a
// step: vpmaddubsw(|w|, x * sign(w)) sums pairs into int16 exactly, since both operands lie
// in -127..127 (quantize_rows, QMAX): |2 * 127 * 127| = 32258 < 32767; vpmaddwd with ones
// widens the pairs into int32. The weights are prefetched PREFETCH bytes ahead: on an AMD
// Zen 3 with two threads, one channel at a time with the prefetch streamed a [8960, 1536]
// weight from memory at 17 GB/s for one row and 13 GB/s for five, against 8.5 and 6 for
// pairs of channels without it (docs/EXPERIMENTS.md).
constexpr int64_t PREFETCH = 1024;

template <int R, bool PF>
static inline void tile(const int8_t* x, int64_t k, const int8_t* w, int64_t n, int32_t* y,
                        int64_t r0, int64_t j, int64_t k0, int64_t k1, bool add) {
    const int64_t k32 = k0 + ((k1 - k0) & ~(int64_t)31);
    const __m256i ones = _mm256_set1_epi16(1);
    const int8_t* wr = w + j * k;
    __m256i acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
    for (int64_t i = k0; i < k32; i += 32) {
        if (PF) _mm_prefetch((const char*)(wr + i + PREFETCH), _MM_HINT_T0);
        const __m256i wv = _mm256_loadu_si256((const __m256i*)(wr + i));
        const __m256i wa = _mm256_abs_epi8(wv);
        for (int r = 0; r < R; ++r) {
            const __m256i xv = _mm256_loadu_si256((const __m256i*)(x + (r0 + r) * k + i));
            const __m256i p16 = _mm256_maddubs_epi16(wa, _mm256_sign_epi8(xv, wv));
            acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(p16, ones));
        }
    }
    for (int r = 0; r < R; ++r) {
        int32_t s = hsum(acc[r]);
        const int8_t* xr = x + (r0 + r) * k;
        for (int64_t i = k32; i < k1; ++i) s += (int32_t)xr[i] * (int32_t)wr[i];
        y[(r0 + r) * n + j] = add ? y[(r0 + r) * n + j] + s : s;
    }
}

// rows r0..r0+R-1 (R = 1..8) against channel j over k0..k1, into y or added to it
template <bool PF>
static inline void tiles(const int8_t* x, int64_t k, const int8_t* w, int64_t n, int32_t* y,
                         int64_t r0, int64_t R, int64_t j, int64_t k0, int64_t k1, bool add) {
    switch (R) {
        case 8: tile<8, PF>(x, k, w, n, y, r0, j, k0, k1, add); break;
        case 7: tile<7, PF>(x, k, w, n, y, r0, j, k0, k1, add); break;
        case 6: tile<6, PF>(x, k, w, n, y, r0, j, k0, k1, add); break;
        case 5: tile<5, PF>(x, k, w, n, y, r0, j, k0, k1, add); break;
        case 4: tile<4, PF>(x, k, w, n, y, r0, j, k0, k1, add); break;
        case 3: tile<3, PF>(x, k, w, n, y, r0, j, k0, k1, add); break;
        case 2: tile<2, PF>(x, k, w, n, y, r0, j, k0, k1, add); break;
        case 1: tile<1, PF>(x, k, w, n, y, r0, j, k0, k1, add); break;
        default: break;
    }
}

// Passes of BLOCKED_ROWS rows or more (prefill) are blocked for the caches: a thread takes NC
// channels at a time and walks k in slices of KC bytes, so that the slice of 8 rows it
// multiplies (8 * KC bytes) stays in L1 while the NC channels' slices (NC * KC bytes) stay in
// L2; one channel at a time over all the rows re-read every row from L2 or L3 for every
// channel. Integer sums are exact in any order, so the blocking never changes a bit.
constexpr int64_t KC = 2048, NC = 32;

// Below this many rows the weights' stream from memory (prefetched) bounds the product, not
// the arithmetic: one channel at a time over all the rows.
constexpr int64_t BLOCKED_ROWS = 32;

// y[m, n] = sum_k x[m, k] * w[n, k]: the channels split over the threads
extern "C" void sd_int8_mm_nk(const int8_t* x, int64_t rows, int64_t k, const int8_t* w,
                              int64_t n, int32_t* y) {
    if (rows < BLOCKED_ROWS) {  // decode and verify passes: each channel's weights read once
        #pragma omp parallel for schedule(static)
        for (int64_t j = 0; j < n; ++j)
            for (int64_t r0 = 0; r0 < rows; r0 += 8)
                tiles<true>(x, k, w, n, y, r0, rows - r0 < 8 ? rows - r0 : 8, j, 0, k, false);
        return;
    }
    const int64_t blocks = (n + NC - 1) / NC;
    #pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t j1 = (b + 1) * NC < n ? (b + 1) * NC : n;
        for (int64_t k0 = 0; k0 < k; k0 += KC) {
            const int64_t k1 = k - k0 <= KC + 31 ? k : k0 + KC;
            for (int64_t r0 = 0; r0 < rows; r0 += 8) {
                const int64_t R = rows - r0 < 8 ? rows - r0 : 8;
                for (int64_t j = b * NC; j < j1; ++j) tiles<false>(x, k, w, n, y, r0, R, j, k0, k1, k0 > 0);
            }
            if (k1 == k) break;
        }
    }
}

namespace {
thread_local std::vector<int8_t> xq_scratch;
thread_local std::vector<float> xs_scratch, xpad_scratch;
thread_local std::vector<int32_t> acc_scratch, gsum_scratch;

// Each row of x [M, K] quantized alone as quant.quantize_rows does (max|x| / 127, x / s
// rounded half to even, clamped to +-127; the same IEEE steps, so the same bits) into xq,
// xs; gsum, if not null, gets [M, K / 32] sums of xq over groups of 32 (K % 32 == 0).
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* xs, int32_t* gsum) {
    const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    #pragma omp parallel for schedule(static) if (M >= 16)
    for (int64_t m = 0; m < M; m++) {
        const float* r = x + m * K;
        int8_t* q = xq + m * K;
        const int64_t k8 = K & ~(int64_t)7;
        __m256 vmax = _mm256_setzero_ps();
        for (int64_t k = 0; k < k8; k += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(r + k), absmask));
        float lanes[8];
        _mm256_storeu_ps(lanes, vmax);
        float amax = 0.0f;
        for (int l = 0; l < 8; l++) amax = lanes[l] > amax ? lanes[l] : amax;
        for (int64_t k = k8; k < K; k++) amax = fabsf(r[k]) > amax ? fabsf(r[k]) : amax;
        const float sc = amax > 0.0f ? amax / 127.0f : 1.0f;
        xs[m] = sc;
        const __m256 sv = _mm256_set1_ps(sc);
        for (int64_t k = 0; k < k8; k += 8) {
            const __m256 v = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(_mm256_loadu_ps(r + k), sv), lo), hi);
            int32_t qi[8];
            _mm256_storeu_si256((__m256i*)qi, _mm256_cvtps_epi32(v));
            for (int l = 0; l < 8; l++) q[k + l] = (int8_t)qi[l];
        }
        for (int64_t k = k8; k < K; k++) {
            float v = r[k] / sc;
            v = v < -127.0f ? -127.0f : (v > 127.0f ? 127.0f : v);
            q[k] = (int8_t)nearbyintf(v);
        }
        if (gsum)
            for (int64_t g = 0; g < K / 32; g++) {
                int32_t s = 0;
                for (int b = 0; b < 32; b++) s += q[32 * g + b];
                gsum[m * (K / 32) + g] = s;
            }
    }
}
}  // namespace

// The W8A8 linear in one call from fp32 x [M, K]: each row quantized alone (quantize_rows),
// the exact product with w [N, K] int8, then y = acc * xs[m] * ws[n] (+ bias[n]) in fp32 in
// that order, as Int8Linear's torch path.
extern "C" void sd_int8_linear_nk_x(const float* x, int64_t M, int64_t K, const int8_t* w,
                                    const float* ws, const float* bias, int64_t N, float* y) {
    xq_scratch.resize(M * K);
    xs_scratch.resize(M);
    acc_scratch.resize(M * N);
    // the caller's scratch (thread_local: the OpenMP threads below would see their own)
    int8_t* xq = xq_scratch.data();
    float* xs = xs_scratch.data();
    int32_t* acc = acc_scratch.data();
    quantize_rows(x, M, K, xq, xs, nullptr);
    sd_int8_mm_nk(xq, M, K, w, N, acc);
    #pragma omp parallel for schedule(static) if (M >= 16)
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            float v = (float)acc[m * N + n] * xs[m];
            v = v * ws[n];
            y[m * N + n] = bias ? v + bias[n] : v;
        }
}

// Q4_K weights (quant.Q4KLinear): w = d * sc * q - dmin * m, q in 0..15, sc and m 6-bit per
// group of 32 inputs, d and dmin fp16 per 256, in the packing of the AVX512 kernel
// (cpu_kernels.cpp, q4k_block): per block of 16 channels, wq [K/32][4][16][4] bytes, byte
// (v, j, b) of group g holding q of k = 32 g + 8 v + b (low nibble) and k + 4 (high nibble)
// of channel j; d, dmin [K/256][16] fp16; sc, mn [K/32][16] uint8. A group's sum of q * xq
// per (row, channel) is exact: vpmaddubsw(q, xq) pairs are at most 2 * 15 * 127 = 3810, so
// the 8 of a group (4 vectors, two nibbles) add up in int16 (<= 30480) before vpmaddwd
// widens them, two multiplies per 32 products where the int8 product takes two per 32 and
// row. The float steps are the AVX512 kernel's, in its order (A = d * sc, B = dmin * m;
// f = (f + A * sum) - B * gsum; y = f * xs (+ bias)), so a q4 model's logits are the same
// bits on both kernels.
constexpr int64_t Q4K_PREFETCH = 1024;

static void q4k_block16(const int8_t* xq, const float* xs, const int32_t* gsum, int64_t M,
                        int64_t K, const uint8_t* wq, const uint16_t* d, const uint16_t* dmin,
                        const uint8_t* sc, const uint8_t* mn, const float* bias, float* y,
                        int64_t N, float* f) {
    const int64_t groups = K / 32;
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t i = 0; i < M * 16; i++) f[i] = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        for (int c = 0; c < 4; c++)
            _mm_prefetch((const char*)(wq + g * 256 + Q4K_PREFETCH + 64 * c), _MM_HINT_T0);
        __m256 a[2], bm[2];
        for (int h = 0; h < 2; h++) {
            const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(d + (g / 8) * 16 + 8 * h)));
            const __m256 dmv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dmin + (g / 8) * 16 + 8 * h)));
            a[h] = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                _mm_loadl_epi64((const __m128i*)(sc + g * 16 + 8 * h)))));
            bm[h] = _mm256_mul_ps(dmv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                _mm_loadl_epi64((const __m128i*)(mn + g * 16 + 8 * h)))));
        }
        __m256i wl[4][2], wh[4][2];  // half h: channels 8h..8h+7
        for (int v = 0; v < 4; v++)
            for (int h = 0; h < 2; h++) {
                const __m256i w = _mm256_loadu_si256((const __m256i*)(wq + (g * 4 + v) * 64 + 32 * h));
                wl[v][h] = _mm256_and_si256(w, low);
                wh[v][h] = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
            }
        for (int64_t m = 0; m < M; m++) {
            const int8_t* r = xq + m * K + g * 32;
            __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
            for (int v = 0; v < 4; v++) {
                int32_t x0, x1;
                memcpy(&x0, r + 8 * v, 4);
                memcpy(&x1, r + 8 * v + 4, 4);
                const __m256i b0 = _mm256_set1_epi32(x0), b1 = _mm256_set1_epi32(x1);
                s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(wl[v][0], b0));
                s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(wh[v][0], b1));
                s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(wl[v][1], b0));
                s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(wh[v][1], b1));
            }
            const __m256 gs = _mm256_set1_ps((float)gsum[m * groups + g]);
            const __m256i sum[2] = {_mm256_madd_epi16(s0, ones), _mm256_madd_epi16(s1, ones)};
            for (int h = 0; h < 2; h++) {
                float* fm = f + m * 16 + 8 * h;
                const __m256 t = _mm256_add_ps(_mm256_loadu_ps(fm), _mm256_mul_ps(a[h], _mm256_cvtepi32_ps(sum[h])));
                _mm256_storeu_ps(fm, _mm256_sub_ps(t, _mm256_mul_ps(bm[h], gs)));
            }
        }
    }
    for (int64_t m = 0; m < M; m++)
        for (int h = 0; h < 2; h++) {
            __m256 v = _mm256_mul_ps(_mm256_loadu_ps(f + m * 16 + 8 * h), _mm256_set1_ps(xs[m]));
            if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + 8 * h));
            _mm256_storeu_ps(y + m * N + 8 * h, v);
        }
}

// y [M, N] = x [M, Kin] (fp32) through Q4_K weights covering K >= Kin inputs (K % 256 == 0;
// the inputs past Kin meet zeros, which change neither a row's scale nor any sum), each row
// quantized alone (quantize_rows); N % 16 == 0; bias may be null. The AVX512 kernel's
// sd_q4k_linear_x, the same bits.
extern "C" void sd_q4k_linear_x(const float* x, int64_t M, int64_t Kin, int64_t K,
                                const uint8_t* wq, const uint16_t* d, const uint16_t* dmin,
                                const uint8_t* sc, const uint8_t* mn, const float* bias,
                                int64_t N, float* y) {
    if (Kin != K) {
        xpad_scratch.assign(M * K, 0.0f);
        for (int64_t m = 0; m < M; m++) memcpy(xpad_scratch.data() + m * K, x + m * Kin, Kin * sizeof(float));
        x = xpad_scratch.data();
    }
    xq_scratch.resize(M * K);
    xs_scratch.resize(M);
    gsum_scratch.resize(M * (K / 32));
    const int8_t* xq = xq_scratch.data();
    const float* xs = xs_scratch.data();
    const int32_t* gs = gsum_scratch.data();
    quantize_rows(x, M, K, xq_scratch.data(), xs_scratch.data(), gsum_scratch.data());
    const int64_t nblocks = N / 16;
    #pragma omp parallel
    {
        std::vector<float> f(M * 16);  // this thread's accumulators of one block
        #pragma omp for schedule(static)
        for (int64_t nb = 0; nb < nblocks; nb++)
            q4k_block16(xq, xs, gs, M, K, wq + nb * 16 * K / 2, d + nb * 16 * (K / 256),
                        dmin + nb * 16 * (K / 256), sc + nb * 16 * (K / 32), mn + nb * 16 * (K / 32),
                        bias ? bias + nb * 16 : nullptr, y + nb * 16, N, f.data());
    }
}

namespace {

// exp(x) to ~1 ulp, cpu_kernels.cpp's exp_ps for 8 lanes (2^n built in exponent fields)
inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    x = _mm256_min_ps(x, _mm256_set1_ps(89.0f));  // n <= 128: exp overflows to inf past ~88.72
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    // 2^n as 2^(n >> 1) * 2^(n - (n >> 1)): both factors normal for n in [-126, 128]
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
}

inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

thread_local std::vector<float> scores;

// One (row, query head) of sd_attend / sd_attend_slots: query qi over the n keys at cache
// slots slot(0..n-1) of kc, vc, in that order. The arithmetic depends only on that sequence
// of keys and values, not on where they sit in the cache: a tree node attending to the
// committed slots and its ancestors computes the bits of the one-token pass that sees the
// same keys at consecutive slots.
template <typename Slot>
inline void attend_one(const float* qi, const float* kc, const float* vc, int64_t D, int64_t n,
                       Slot slot, float scale, float* o) {
    if ((int64_t)scores.size() < n + 8) scores.resize(n + 8);
    float* s = scores.data();
    float m = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        const float* kj = kc + slot(j) * D;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(qi + d), _mm256_loadu_ps(kj + d), acc);
        s[j] = hsum8(acc) * scale;
        m = s[j] > m ? s[j] : m;
    }
    const __m256 mv = _mm256_set1_ps(m);
    __m256 vsum = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
        vsum = _mm256_add_ps(vsum, e);
        _mm256_storeu_ps(s + j, e);
    }
    float sum = hsum8(vsum);
    if (j < n) {  // the tail: 8 lanes with -inf past n
        float tail[8];
        for (int l = 0; l < 8; l++) tail[l] = j + l < n ? s[j + l] - m : -INFINITY;
        float e[8];
        _mm256_storeu_ps(e, exp8(_mm256_loadu_ps(tail)));
        for (int l = 0; l < 8 && j + l < n; l++) { s[j + l] = e[l]; sum += e[l]; }
    }
    for (int64_t d0 = 0; d0 < D; d0 += 32) {  // up to 4 x 8 floats of the values at a time
        const int nv = (int)((D - d0 < 32 ? D - d0 : 32) / 8);
        __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t jj = 0; jj < n; jj++) {
            const __m256 p = _mm256_set1_ps(s[jj]);
            const float* vj = vc + slot(jj) * D + d0;
            for (int c = 0; c < nv; c++) a[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 8 * c), a[c]);
        }
        const __m256 sv = _mm256_set1_ps(sum);
        for (int c = 0; c < nv; c++) _mm256_storeu_ps(o + d0 + 8 * c, _mm256_div_ps(a[c], sv));
    }
}

}  // namespace

extern "C" {

// sd_attend with query (b, t) seeing the slots slots[(b*T+t)*S + 0..lens[b*T+t]-1], in that
// order (a draft tree: the committed slots, then the node's ancestors and itself); slots
// null: slots 0..lens[b*T+t]-1.
void sd_attend_slots(const float* q, int64_t B, int64_t T, int64_t H, int64_t D, int64_t qb,
                     int64_t qt, int64_t qh, const float* k, const float* v, int64_t Hkv,
                     int64_t L, const int64_t* lens, const int64_t* slots, int64_t S,
                     float scale, float* out) {
    const int64_t g = H / Hkv;
    const int64_t items = B * T * H;
    // round robin: a causal chunk's later rows see more slots, so halves would be unequal
#pragma omp parallel for schedule(static, 1)
    for (int64_t it = 0; it < items; it++) {
        const int64_t b = it / (T * H), t = it / H % T, h = it % H, kv = h / g;
        const int64_t cache = (b * Hkv + kv) * L * D, n = lens[b * T + t];
        const float* qi = q + b * qb + t * qt + h * qh;
        float* o = out + ((b * T + t) * H + h) * D;
        if (slots == nullptr) {
            attend_one(qi, k + cache, v + cache, D, n, [](int64_t j) { return j; }, scale, o);
        } else {
            const int64_t* sl = slots + (b * T + t) * S;
            attend_one(qi, k + cache, v + cache, D, n, [sl](int64_t j) { return sl[j]; }, scale, o);
        }
    }
}

// out [B, T, H, D] = attention of q (element strides qb, qt, qh; D contiguous) over the
// caches k, v [B, Hkv, L, D] (contiguous), query (b, t) seeing slots 0..lens[b*T+t]-1
// (1 <= lens <= L); H % Hkv == 0, D % 8 == 0; scores scaled by `scale`.
void sd_attend(const float* q, int64_t B, int64_t T, int64_t H, int64_t D, int64_t qb,
               int64_t qt, int64_t qh, const float* k, const float* v, int64_t Hkv, int64_t L,
               const int64_t* lens, float scale, float* out) {
    sd_attend_slots(q, B, T, H, D, qb, qt, qh, k, v, Hkv, L, lens, nullptr, 0, scale, out);
}

// out[i] = silu(gate[i]) * up[i] = gate[i] / (1 + exp(-gate[i])) * up[i] for n floats
void sd_silu_mul(const float* gate, const float* up, int64_t n, float* out) {
    const int64_t chunks = n / 8;
#pragma omp parallel for schedule(static) if (n >= 16384)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t i = 8 * c;
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        const __m256 sg = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(sg, _mm256_loadu_ps(up + i)));
    }
    for (int64_t i = chunks * 8; i < n; i++) {
        float buf[8] = {0}, e[8];
        buf[0] = -gate[i];
        _mm256_storeu_ps(e, exp8(_mm256_loadu_ps(buf)));
        out[i] = gate[i] / (1.0f + e[0]) * up[i];
    }
}

}  // extern "C"

extern "C" {

// out[m, :] = w * (x[m, :] * r), r = 1 / sqrt(mean(x[m, :]^2) + eps), for M rows of N floats:
// each row's sum of squares in one fixed order (8 lanes, then the tail), its own bits.
void sd_rmsnorm(const float* x, int64_t M, int64_t N, const float* w, float eps, float* out) {
    const int64_t n8 = N & ~(int64_t)7;
    for (int64_t m = 0; m < M; m++) {
        const float* r = x + m * N;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t k = 0; k < n8; k += 8) {
            const __m256 v = _mm256_loadu_ps(r + k);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float sum = hsum8(acc);
        for (int64_t k = n8; k < N; k++) sum += r[k] * r[k];
        const float inv = 1.0f / sqrtf(sum / (float)N + eps);
        float* o = out + m * N;
        for (int64_t k = 0; k < N; k++) o[k] = w[k] * (r[k] * inv);
    }
}

}  // extern "C"

namespace {

// kind 0 of cpu_layers.h's linears: an Int8Linear "nk" (p0 qweight, p1 wscale, p2 bias or 0)
inline void int8_linear_x(const float* in, int64_t m, int64_t k, const int64_t* p, int64_t n,
                          float* out) {
    sd_int8_linear_nk_x(in, m, k, (const int8_t*)p[0], (const float*)p[1], (const float*)p[2], n, out);
}

}  // namespace

#include "cpu_convert.h"
#include "cpu_layers.h"
