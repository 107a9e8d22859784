// GGUF blocks into the kernels' formats while a model loads (quant.quantize_state), shared by
// cpu_kernels.cpp and cpu_kernels_avx2.cpp. Plain loops over rows on all threads: the file's
// bytes are only rearranged, or dequantized with the gguf package's float steps and rounded
// as quant.quantize_rows rounds, so the result is bit for bit what the PyTorch code computes
// (tests/test_quant.py), in a fraction of its time.
//
// sd_q4k_repack: rows of Q4_K blocks (llama.cpp's block_q4_K: fp16 d and dmin, 12 bytes of
//   6-bit scales and mins, 128 bytes of 4-bit values per 256 inputs) into quant.Q4KLinear's
//   buffers: qweight [n/16][K/32][4][16][4], d and dmin [n/16][K/256][16], sc and mn
//   [n/16][K/32][16], n % 16 == 0.
// sd_rows_int8: rows of Q4_K or Q6_K blocks (ggml types 12, 14) into symmetric int8 rows q
//   [n][K] and one fp32 scale a row (amax / 127, 1 for an all-zero row); returns -1 for
//   another type.
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <vector>

namespace {

// IEEE fp16 bits to fp32, exactly (subnormals, infinities and NaNs included)
inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0 && man == 0) {
        bits = sign;
    } else if (exp == 0) {  // subnormal: man * 2^-24, normalized
        int e = -1;
        do {
            e++;
            man <<= 1;
        } while (!(man & 0x400));
        bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3FF) << 13);
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

inline uint16_t load_u16(const uint8_t* p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

// llama.cpp's get_scale_min_k4: the 6-bit scale and min of group g (0..7) of a Q4_K block
inline void scale_min_k4(const uint8_t* x, int g, uint8_t& sc, uint8_t& mn) {
    if (g < 4) {
        sc = x[g] & 63;
        mn = x[g + 4] & 63;
    } else {
        sc = (x[g + 4] & 0xF) | ((x[g - 4] >> 6) << 4);
        mn = (x[g + 4] >> 4) | ((x[g] >> 6) << 4);
    }
}

// one Q4_K block's 256 weights: (d * sc) * q - dmin * m
void dequant_q4k_block(const uint8_t* b, float* w) {
    const float d = half_to_float(load_u16(b)), dmin = half_to_float(load_u16(b + 2));
    const uint8_t* qs = b + 16;
    for (int g = 0; g < 8; g++) {
        uint8_t sc, mn;
        scale_min_k4(b + 4, g, sc, mn);
        const float a = d * (float)sc, c = dmin * (float)mn;
        const uint8_t* q = qs + 32 * (g / 2);
        const int shift = 4 * (g % 2);
        for (int l = 0; l < 32; l++) w[32 * g + l] = (float)((q[l] >> shift) & 15) * a - c;
    }
}

// one Q6_K block's 256 weights: (q - 32) * (d * scale)
void dequant_q6k_block(const uint8_t* b, float* w) {
    const float d = half_to_float(load_u16(b + 208));
    const int8_t* sc = (const int8_t*)(b + 192);
    float scale[16];
    for (int i = 0; i < 16; i++) scale[i] = d * (float)sc[i];
    for (int h = 0; h < 2; h++) {
        const uint8_t* ql = b + 64 * h;
        const uint8_t* qh = b + 128 + 32 * h;
        float* y = w + 128 * h;
        // inputs 32c + l of this half: ql[l] (c 0, 2) or ql[l + 32] (c 1, 3), low nibble for
        // c < 2, and bits 2c, 2c + 1 of qh[l] above them; scale 8h + (32c + l) / 16
        for (int c = 0; c < 4; c++) {
            const uint8_t* lo = ql + 32 * (c % 2);
            const int shift = 4 * (c / 2);
            for (int l = 0; l < 32; l++) {
                const int q = ((lo[l] >> shift) & 0xF) | (((qh[l] >> (2 * c)) & 3) << 4);
                y[32 * c + l] = (float)(q - 32) * scale[8 * h + (32 * c + l) / 16];
            }
        }
    }
}

// the largest |w[i]| of a row (K % 8 == 0): max is exact, so any order gives the same value
float row_amax(const float* w, int64_t K) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int64_t i = 0; i < K; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(w + i)));
    float lanes[8], amax = 0.0f;
    _mm256_storeu_ps(lanes, m);
    for (int i = 0; i < 8; i++) amax = amax > lanes[i] ? amax : lanes[i];
    return amax;
}

// q[i] = clamp(round(w[i] / s), -127, 127), rounding half to even (K % 32 == 0)
void quantize_row(const float* w, int64_t K, float s, int8_t* q) {
    const __m256 vs = _mm256_set1_ps(s), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t i = 0; i < K; i += 32) {
        __m256i v[4];
        for (int j = 0; j < 4; j++) {
            const __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(w + i + 8 * j), vs),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            v[j] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
        }
        // packs work within 128-bit lanes: the bytes come out as four-byte groups v0[0..3],
        // v1[0..3], v2[0..3], v3[0..3], v0[4..7], v1[4..7], ...; the permute orders them
        const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        _mm256_storeu_si256((__m256i*)(q + i), _mm256_permutevar8x32_epi32(b, order));
    }
}

}  // namespace

extern "C" {

void sd_q4k_repack(const uint8_t* raw, int64_t n, int64_t nb, uint8_t* qweight, uint16_t* d,
                   uint16_t* dmin, uint8_t* sc, uint8_t* mn) {
    const int64_t G = nb * 8;
#pragma omp parallel for schedule(static)
    for (int64_t blk = 0; blk < n / 16; blk++) {
        for (int64_t j = 0; j < 16; j++) {
            const uint8_t* row = raw + (blk * 16 + j) * nb * 144;
            for (int64_t s = 0; s < nb; s++) {
                const uint8_t* b = row + s * 144;
                d[(blk * nb + s) * 16 + j] = load_u16(b);
                dmin[(blk * nb + s) * 16 + j] = load_u16(b + 2);
                for (int g = 0; g < 8; g++)
                    scale_min_k4(b + 4, g, sc[(blk * G + s * 8 + g) * 16 + j], mn[(blk * G + s * 8 + g) * 16 + j]);
                // bytes 32i + o hold inputs 64i + o (low nibble, group 2i) and 64i + 32 + o
                // (high, group 2i + 1); a qweight byte (v, e) of a group holds its inputs
                // 8v + e (low nibble) and 8v + 4 + e (high): four bytes e = 0..3 at a time
                const uint8_t* qs = b + 16;
                for (int i = 0; i < 4; i++) {
                    for (int v = 0; v < 4; v++) {
                        uint32_t lo, hi;
                        memcpy(&lo, qs + 32 * i + 8 * v, 4);
                        memcpy(&hi, qs + 32 * i + 8 * v + 4, 4);
                        const uint32_t even = (lo & 0x0F0F0F0Fu) | ((hi << 4) & 0xF0F0F0F0u);
                        const uint32_t odd = ((lo >> 4) & 0x0F0F0F0Fu) | (hi & 0xF0F0F0F0u);
                        const int64_t g = s * 8 + 2 * i;
                        memcpy(qweight + (((blk * G + g) * 4 + v) * 16 + j) * 4, &even, 4);
                        memcpy(qweight + (((blk * G + g + 1) * 4 + v) * 16 + j) * 4, &odd, 4);
                    }
                }
            }
        }
    }
}

int sd_rows_int8(int type, const uint8_t* raw, int64_t n, int64_t nb, int8_t* q, float* scale) {
    if (type != 12 && type != 14) return -1;
    const int64_t bytes = type == 12 ? 144 : 210, K = nb * 256;
#pragma omp parallel
    {
        std::vector<float> w(K);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r++) {
            const uint8_t* row = raw + r * nb * bytes;
            for (int64_t s = 0; s < nb; s++) {
                if (type == 12)
                    dequant_q4k_block(row + s * bytes, w.data() + s * 256);
                else
                    dequant_q6k_block(row + s * bytes, w.data() + s * 256);
            }
            const float amax = row_amax(w.data(), K);
            const float sr = amax > 0.0f ? amax / 127.0f : 1.0f;
            scale[r] = sr;
            quantize_row(w.data(), K, sr, q + r * K);
        }
    }
    return 0;
}

}  // extern "C"
