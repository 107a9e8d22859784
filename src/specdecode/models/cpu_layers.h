// The decoder layer stack in one call (sd_layers), shared by cpu_kernels.cpp (AVX512) and
// cpu_kernels_avx2.cpp, each of which includes it after its own sd_rmsnorm, sd_attend_slots,
// sd_silu_mul, sd_q4k_linear_x and int8_linear_x (its int8 layout's linear) (models/fused.py).
//
// Each step calls those functions or does IEEE operations in the order of the PyTorch modules
// (native.py: RMSNorm, Attention, MLP, DecoderLayer; their RMSNorm calls the same
// sd_rmsnorm), so a pass through here gives the bits of the same pass through the modules,
// row by row; it only removes the Python the modules cost a decode step (~0.4 ms a layer).
#pragma once

#include <stdint.h>
#include <string.h>

#include <vector>

namespace {

// rotate-half RoPE in place on M tokens x `heads` heads of D floats (token m at position
// pos[m] of the [*, D] tables): x * cos + rotate_half(x) * sin, two products and a sum, each
// rounded as PyTorch's element-wise operators round them (native.apply_rope)
void rope(float* x, int64_t M, int64_t heads, int64_t D, const float* cos_tab,
          const float* sin_tab, const int64_t* pos) {
    const int64_t half = D / 2;
    for (int64_t m = 0; m < M; m++) {
        const float* c = cos_tab + pos[m] * D;
        const float* s = sin_tab + pos[m] * D;
        for (int64_t h = 0; h < heads; h++) {
            float* v = x + (m * heads + h) * D;
            for (int64_t d = 0; d < half; d++) {
                const float x1 = v[d], x2 = v[d + half];
                const float a = x1 * c[d], b = -x2 * s[d];
                const float a2 = x2 * c[d + half], b2 = x1 * s[d + half];
                v[d] = a + b;
                v[d + half] = a2 + b2;
            }
        }
    }
}

thread_local std::vector<float> fh, fq, fk, fv, fa, fo, fg, fu;

// One linear of a layer: LW int64 words, {kind, in_padded, p0..p5}: kind 0 an Int8Linear of
// the including file's layout (p0 qweight, p1 wscale, p2 bias or 0), kind 1 a Q4KLinear
// (in_padded its blocks' K; p0 qweight, p1 d, p2 dmin, p3 sc, p4 mn, p5 bias or 0).
constexpr int64_t LW = 8;

void linear(const int64_t* p, const float* in, int64_t m, int64_t k, int64_t n, float* out) {
    if (p[0] == 0) {
        int8_linear_x(in, m, k, p + 2, n, out);
    } else {
        sd_q4k_linear_x(in, m, k, p[1], (const uint8_t*)p[2], (const uint16_t*)p[3],
                        (const uint16_t*)p[4], (const uint8_t*)p[5], (const uint8_t*)p[6],
                        (const float*)p[7], n, out);
    }
}

// Run decoder layers which[0..nrun-1] over x [B*T, dim] in place (B rows of T new tokens).
// wp: 2 + 7 * LW int64 a layer: the input_layernorm and post_attention_layernorm weights,
// then LW words for each of the linears q, k, v, o, gate, up, down (linear(words, in [m, k],
// m, k, n, out [m, n])). cp: the layer's cache k, v
// [B, Hkv, L, D] (2 pointers a layer). pos: the RoPE position of each token [B*T]; slots: its
// cache slot, or -1 for padding (computed, not cached); lens [B*T]: how many slots each query
// sees: 0..lens-1, or with `seen` (a draft tree, [B*T, S]) seen[b*T+t, 0..lens-1]
// (sd_attend_slots). F: the MLP width. hid: null, or nrun pointers (0 for none) to [B*T, dim]
// floats that get x after that layer (the hidden states asked for). An entry of which is a
// layer index in its low 32 bits, with flags above (fused.SKIP_ATTN, fused.SKIP_MLP): bit 32
// skips the layer's attention sublayer (no cache write either), bit 33 its MLP sublayer; the
// residual stream passes through a skipped sublayer (SWIFT, arXiv:2410.06916).
void run_layers(float* x, int64_t B, int64_t T, int64_t dim, const int64_t* wp,
                const int64_t* cp, const int64_t* which, int64_t nrun, int64_t H, int64_t Hkv,
                int64_t D, int64_t F, int64_t L, float eps, const float* cos_tab,
                const float* sin_tab, const int64_t* pos, const int64_t* slots,
                const int64_t* lens, const int64_t* seen, int64_t S, const int64_t* hid,
                float scale) {
    const int64_t M = B * T, qd = H * D, kd = Hkv * D;
    fh.resize(M * dim); fq.resize(M * qd); fk.resize(M * kd); fv.resize(M * kd);
    fa.resize(M * qd); fo.resize(M * dim); fg.resize(M * F); fu.resize(M * F);
    for (int64_t i = 0; i < nrun; i++) {
        const int64_t layer = which[i] & 0xffffffffLL;
        const bool attn = !(which[i] & (1LL << 32)), mlp = !(which[i] & (1LL << 33));
        const int64_t* w = wp + layer * (2 + 7 * LW);
        const int64_t* lw = w + 2;
        float* kc = (float*)cp[layer * 2];
        float* vc = (float*)cp[layer * 2 + 1];
        if (attn) {
            sd_rmsnorm(x, M, dim, (const float*)w[0], eps, fh.data());
            linear(lw, fh.data(), M, dim, qd, fq.data());
            linear(lw + LW, fh.data(), M, dim, kd, fk.data());
            linear(lw + 2 * LW, fh.data(), M, dim, kd, fv.data());
            rope(fq.data(), M, H, D, cos_tab, sin_tab, pos);
            rope(fk.data(), M, Hkv, D, cos_tab, sin_tab, pos);
            for (int64_t m = 0; m < M; m++) {
                if (slots[m] < 0) continue;
                const int64_t b = m / T;
                for (int64_t h = 0; h < Hkv; h++) {
                    const int64_t at = ((b * Hkv + h) * L + slots[m]) * D;
                    memcpy(kc + at, fk.data() + (m * Hkv + h) * D, D * sizeof(float));
                    memcpy(vc + at, fv.data() + (m * Hkv + h) * D, D * sizeof(float));
                }
            }
            sd_attend_slots(fq.data(), B, T, H, D, T * qd, qd, D, kc, vc, Hkv, L, lens, seen, S,
                            scale, fa.data());
            linear(lw + 3 * LW, fa.data(), M, qd, dim, fo.data());
            for (int64_t j = 0; j < M * dim; j++) x[j] = x[j] + fo[j];
        }
        if (mlp) {
            sd_rmsnorm(x, M, dim, (const float*)w[1], eps, fh.data());
            linear(lw + 4 * LW, fh.data(), M, dim, F, fg.data());
            linear(lw + 5 * LW, fh.data(), M, dim, F, fu.data());
            sd_silu_mul(fg.data(), fu.data(), M * F, fg.data());
            linear(lw + 6 * LW, fg.data(), M, F, dim, fo.data());
            for (int64_t j = 0; j < M * dim; j++) x[j] = x[j] + fo[j];
        }
        if (hid != nullptr && hid[i] != 0) memcpy((float*)hid[i], x, M * dim * sizeof(float));
    }
}

}  // namespace

extern "C" {

// Run decoder layers which[0..nrun-1] over x [B*T, dim] in place: run_layers.
void sd_layers(float* x, int64_t B, int64_t T, int64_t dim, const int64_t* wp, const int64_t* cp,
               const int64_t* which, int64_t nrun, int64_t H, int64_t Hkv, int64_t D, int64_t F,
               int64_t L, float eps, const float* cos_tab, const float* sin_tab,
               const int64_t* pos, const int64_t* slots, const int64_t* lens,
               const int64_t* seen, int64_t S, const int64_t* hid, float scale) {
    run_layers(x, B, T, dim, wp, cp, which, nrun, H, Hkv, D, F, L, eps, cos_tab, sin_tab, pos,
               slots, lens, seen, S, hid, scale);
}

}  // extern "C"
