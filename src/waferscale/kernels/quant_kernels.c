/* Weight-only quantized linear layers: y = x W^T for W held as integer blocks (see waferscale/models/quant.py).
 *
 * Two layouts cover every GGUF format we serve, losslessly:
 *   int8: one byte per weight, signed (Q8_0, Q6_K, --quantization int8) or unsigned 0..127 (Q5_K's 5-bit values),
 *         a float32 scale per group of G = 16, 32 or 64 weights along K, and optionally a float32 min per group;
 *   int4: two weights per byte (each 32-weight block: 16 bytes, byte j holding weight j in its low nibble and
 *         weight j + 16 in its high one, as GGUF's Q4_0/Q4_1 do), unsigned 0..15, a scale and a min per group.
 * A weight is scale * q + min. Each input row is quantized to int8 in blocks of 32 (scale = max|x| / 127, as
 * llama.cpp's Q8 activations), so a block's dot product is exact in 32-bit integers (maddubs + madd on AVX2, dpbusd
 * with VNNI), then scaled once in float32; the mins meet the float32 sum of x over their group. Every row's result
 * depends only on that row, never on the batch. Without AVX2 (or built with -DWS_PORTABLE) plain C computes the
 * same integers.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && !defined(WS_PORTABLE)
#include <immintrin.h>
#define WQ_AVX2 1
#endif

#define QB 32 /* activation block: K must be a multiple of it */
#define MT 4  /* input rows per pass over a weight row (the row stays in L1 between passes) */

static inline float bf16_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* float32 -> bfloat16, rounding to nearest even (as c10::BFloat16 does); NaN stays NaN. */
static inline uint16_t f32_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* x rows [M, K] (float32, or bf16 when x_bf16) -> int8 blocks xq [M, K], per-block scales xs [M, K / 32], and
 * per-group float32 sums xg [M, K / G] (for the mins). */
static void quantize_rows(const void *x, int x_bf16, int64_t M, int64_t K, int64_t G, int8_t *xq, float *xs,
                          float *xg, float *xf) {
    const int64_t nb = K / QB, ng = K / G;
#pragma omp parallel for schedule(static) if (M > 4)
    for (int64_t m = 0; m < M; m++) {
        float row[K];
        const float *xm = (const float *)x + m * K;
        if (x_bf16) {
            for (int64_t k = 0; k < K; k++) row[k] = bf16_f32(((const uint16_t *)x)[m * K + k]);
            xm = row;
        }
        if (xf) memcpy(xf + m * K, xm, (size_t)K * sizeof(float));
        for (int64_t b = 0; b < (xq ? nb : 0); b++) {
            float amax = 0.f;
            for (int i = 0; i < QB; i++) amax = fmaxf(amax, fabsf(xm[b * QB + i]));
            const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
            xs[m * nb + b] = d;
            for (int i = 0; i < QB; i++) xq[m * K + b * QB + i] = (int8_t)lrintf(xm[b * QB + i] * id);
        }
        for (int64_t g = 0; g < ng; g++) {
            float s = 0.f;
            for (int64_t i = 0; i < G; i++) s += xm[g * G + i];
            xg[m * ng + g] = s;
        }
    }
}

#ifdef WQ_AVX2
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DOT_U8S8(u, s) _mm256_dpbusd_epi32(_mm256_setzero_si256(), (u), (s))
#elif defined(__AVXVNNI__)
#define DOT_U8S8(u, s) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), (u), (s))
#else
/* no saturation: |u| <= 128 and |s| <= 127 give pair sums within int16 */
#define DOT_U8S8(u, s) _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1))
#endif

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* out[m] = sum over blocks of scale_w * scale_x * (integer dot), for mt rows of xq against one weight row */
static inline __attribute__((always_inline)) void row_dots(const uint8_t *w, const float *ws, int gshift, int64_t nb,
                                                           const int8_t *xq, const float *xs, int64_t K,
                                                           const int bits, const int sgn, const int mt,
                                                           float *out) {
    __m256 acc[MT];
    for (int m = 0; m < mt; m++) acc[m] = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        __m256i wv;
        if (bits == 8) {
            wv = _mm256_loadu_si256((const __m256i *)(w + b * QB));
        } else {
            const __m128i raw = _mm_loadu_si128((const __m128i *)(w + b * QB / 2));
            wv = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low4);
        }
        const __m256i wu = sgn ? _mm256_sign_epi8(wv, wv) : wv;
        const __m256 wsc = gshift == 4 ? _mm256_set_m128(_mm_set1_ps(ws[2 * b + 1]), _mm_set1_ps(ws[2 * b]))
                                       : _mm256_set1_ps(ws[(b * QB) >> gshift]);
        for (int m = 0; m < mt; m++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + m * K + b * QB));
            if (sgn) xv = _mm256_sign_epi8(xv, wv);
            const __m256 p = _mm256_cvtepi32_ps(DOT_U8S8(wu, xv));
            acc[m] = _mm256_fmadd_ps(p, _mm256_mul_ps(wsc, _mm256_set1_ps(xs[m * nb + b])), acc[m]);
        }
    }
    for (int m = 0; m < mt; m++) out[m] = hsum(acc[m]);
}

/* the same for float32 activations (no rounding of x): each block's weights widened to float32 in registers */
static inline __attribute__((always_inline)) void row_dots_f(const uint8_t *w, const float *ws, int gshift,
                                                             int64_t nb, const float *xf, int64_t K, const int bits,
                                                             const int sgn, const int mt, float *out) {
    __m256 acc[MT];
    for (int m = 0; m < mt; m++) acc[m] = _mm256_setzero_ps();
    const __m128i low4 = _mm_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        __m256 wf[4];
        if (bits == 8) {
            for (int j = 0; j < 4; j++) {
                const __m128i q = _mm_loadl_epi64((const __m128i *)(w + b * QB + 8 * j));
                wf[j] = _mm256_cvtepi32_ps(sgn ? _mm256_cvtepi8_epi32(q) : _mm256_cvtepu8_epi32(q));
            }
        } else {
            const __m128i raw = _mm_loadu_si128((const __m128i *)(w + b * QB / 2));
            const __m128i lo = _mm_and_si128(raw, low4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
            wf[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
            wf[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
            wf[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
            wf[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
        }
        for (int m = 0; m < mt; m++) {
            const float *xb = xf + m * K + b * QB;
            __m256 d0 = _mm256_mul_ps(wf[0], _mm256_loadu_ps(xb));
            d0 = _mm256_fmadd_ps(wf[1], _mm256_loadu_ps(xb + 8), d0);
            __m256 d1 = _mm256_mul_ps(wf[2], _mm256_loadu_ps(xb + 16));
            d1 = _mm256_fmadd_ps(wf[3], _mm256_loadu_ps(xb + 24), d1);
            if (gshift == 4) {
                acc[m] = _mm256_fmadd_ps(d0, _mm256_set1_ps(ws[2 * b]), acc[m]);
                acc[m] = _mm256_fmadd_ps(d1, _mm256_set1_ps(ws[2 * b + 1]), acc[m]);
            } else {
                acc[m] = _mm256_fmadd_ps(_mm256_add_ps(d0, d1), _mm256_set1_ps(ws[(b * QB) >> gshift]), acc[m]);
            }
        }
    }
    for (int m = 0; m < mt; m++) out[m] = hsum(acc[m]);
}
#else
/* portable: the same integer dot products and the same scaling per block (summed in another order than AVX2) */
static inline void row_dots(const uint8_t *w, const float *ws, int gshift, int64_t nb, const int8_t *xq,
                            const float *xs, int64_t K, const int bits, const int sgn, const int mt, float *out) {
    for (int m = 0; m < mt; m++) {
        float acc = 0.f;
        for (int64_t b = 0; b < nb; b++) {
            int32_t lo = 0, hi = 0;
            for (int i = 0; i < QB; i++) {
                int32_t q;
                if (bits == 8) q = sgn ? (int32_t)(int8_t)w[b * QB + i] : (int32_t)w[b * QB + i];
                else q = i < 16 ? (w[b * QB / 2 + i] & 0x0F) : (w[b * QB / 2 + i - 16] >> 4);
                const int32_t p = q * (int32_t)xq[m * K + b * QB + i];
                if (i < 16) lo += p; else hi += p;
            }
            const float sx = xs[m * nb + b];
            if (gshift == 4) acc += (float)lo * (ws[2 * b] * sx) + (float)hi * (ws[2 * b + 1] * sx);
            else acc += (float)(lo + hi) * (ws[(b * QB) >> gshift] * sx);
        }
        out[m] = acc;
    }
}
static inline void row_dots_f(const uint8_t *w, const float *ws, int gshift, int64_t nb, const float *xf, int64_t K,
                              const int bits, const int sgn, const int mt, float *out) {
    for (int m = 0; m < mt; m++) {
        float acc = 0.f;
        for (int64_t b = 0; b < nb; b++) {
            float lo = 0.f, hi = 0.f;
            for (int i = 0; i < QB; i++) {
                int32_t q;
                if (bits == 8) q = sgn ? (int32_t)(int8_t)w[b * QB + i] : (int32_t)w[b * QB + i];
                else q = i < 16 ? (w[b * QB / 2 + i] & 0x0F) : (w[b * QB / 2 + i - 16] >> 4);
                const float p = (float)q * xf[m * K + b * QB + i];
                if (i < 16) lo += p; else hi += p;
            }
            if (gshift == 4) acc += lo * ws[2 * b] + hi * ws[2 * b + 1];
            else acc += (lo + hi) * ws[(b * QB) >> gshift];
        }
        out[m] = acc;
    }
}
#endif

static inline __attribute__((always_inline)) void weight_row(const uint8_t *w, const float *ws, const float *wm,
                                                             int gshift, int64_t ng, int64_t nb, const int8_t *xq,
                                                             const float *xs, const float *xg, const float *xf,
                                                             int64_t M, int64_t K, const int bits, const int sgn,
                                                             float *y, int64_t ldy) {
    float out[MT];
    for (int64_t m0 = 0; m0 < M; m0 += MT) {
        const int64_t mt = M - m0 < MT ? M - m0 : MT;
        if (xf) {
            const float *fm = xf + m0 * K;
            switch (mt) {
                case 4: row_dots_f(w, ws, gshift, nb, fm, K, bits, sgn, 4, out); break;
                case 3: row_dots_f(w, ws, gshift, nb, fm, K, bits, sgn, 3, out); break;
                case 2: row_dots_f(w, ws, gshift, nb, fm, K, bits, sgn, 2, out); break;
                default: row_dots_f(w, ws, gshift, nb, fm, K, bits, sgn, 1, out); break;
            }
        }
        const int8_t *xm = xf ? NULL : xq + m0 * K;
        const float *sm = xf ? NULL : xs + m0 * nb;
        if (!xf) switch (mt) {
            case 4: row_dots(w, ws, gshift, nb, xm, sm, K, bits, sgn, 4, out); break;
            case 3: row_dots(w, ws, gshift, nb, xm, sm, K, bits, sgn, 3, out); break;
            case 2: row_dots(w, ws, gshift, nb, xm, sm, K, bits, sgn, 2, out); break;
            default: row_dots(w, ws, gshift, nb, xm, sm, K, bits, sgn, 1, out); break;
        }
        for (int64_t i = 0; i < mt; i++) {
            float v = out[i];
            if (wm) {
                const float *g = xg + (m0 + i) * ng;
                float t = 0.f;
#pragma omp simd reduction(+ : t)
                for (int64_t j = 0; j < ng; j++) t += wm[j] * g[j];
                v += t;
            }
            y[(m0 + i) * ldy] = v;
        }
    }
}

/* out[m, n] (row stride ldo) = y[m, n] (+ bias[n]), as float32, or rounded to bf16, or res[m, n] + bf16(...) in
 * bf16 (the residual add, each step rounded as torch's bf16 ops round it) */
static void epilogue(const float *y, int64_t M, int64_t N, const float *bias, const uint16_t *res, void *out,
                     int out_bf16, int64_t ldo) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            float v = y[m * N + n] + (bias ? bias[n] : 0.f);
            if (!out_bf16) {
                ((float *)out)[m * ldo + n] = v;
                continue;
            }
            if (res) v = bf16_f32(res[m * ldo + n]) + bf16_f32(f32_bf16(v));
            ((uint16_t *)out)[m * ldo + n] = f32_bf16(v);
        }
}

/* out[m, n] (row stride ldo) = sum_k x[m, k] * W[n, k] (+ bias[n]) for W [N, K] in one of the layouts above: bits
 * 8 (sgn: signed values) or 4; scales and mins (or NULL) [N, K / G]. x: float32 or bf16 (x_bf16) [M, K]; K a
 * multiple of 32 and of G. out: float32, or bf16 (out_bf16), plus the bf16 residual res [M, ldo] when given. */
void qgemm(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, int bits, int sgn, int64_t G,
           const float *scales, const float *mins, const float *bias, const uint16_t *res, void *out, int out_bf16,
           int64_t ldo, int64_t N, int act_int8) {
    const int64_t nb = K / QB, ng = K / G, row_bytes = bits == 8 ? K : K / 2, ldy = N;
    const int gshift = G == 16 ? 4 : G == 32 ? 5 : G == 64 ? 6 : 7;
    int8_t *xq = act_int8 ? (int8_t *)malloc((size_t)(M * K)) : NULL;
    float *xs = act_int8 ? (float *)malloc((size_t)(M * nb) * sizeof(float)) : NULL;
    float *xf = act_int8 ? NULL : (float *)malloc((size_t)(M * K) * sizeof(float));
    float *xg = (float *)malloc((size_t)(M * ng) * sizeof(float));
    float *y = (float *)malloc((size_t)(M * N) * sizeof(float));
    quantize_rows(x, x_bf16, M, K, G, xq, xs, xg, xf);
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wn = w + n * row_bytes;
        const float *sn = scales + n * ng, *mn = mins ? mins + n * ng : NULL;
        if (bits == 4) weight_row(wn, sn, mn, gshift, ng, nb, xq, xs, xg, xf, M, K, 4, 0, y + n, ldy);
        else if (sgn) weight_row(wn, sn, mn, gshift, ng, nb, xq, xs, xg, xf, M, K, 8, 1, y + n, ldy);
        else weight_row(wn, sn, mn, gshift, ng, nb, xq, xs, xg, xf, M, K, 8, 0, y + n, ldy);
    }
    epilogue(y, M, N, bias, res, out, out_bf16, ldo);
    free(xq);
    free(xs);
    free(xf);
    free(xg);
    free(y);
}

/* out [N, K] float32 = scale * q + min for rows of W in either layout (prefill's tiles, embeddings' rows). */
__attribute__((optimize("fp-contract=off"))) void qdequant(const uint8_t *w, int bits, int sgn, int64_t G, const float *scales, const float *mins, int64_t N,
              int64_t K, float *out) {
    const int64_t ng = K / G, row_bytes = bits == 8 ? K : K / 2;
#pragma omp parallel for schedule(static) if (N * K > 65536)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wn = w + n * row_bytes;
        for (int64_t k = 0; k < K; k++) {
            float q;
            if (bits == 8) q = sgn ? (float)(int8_t)wn[k] : (float)wn[k];
            else {
                const int64_t b = k / QB, i = k % QB;
                q = (float)(i < 16 ? (wn[b * 16 + i] & 0x0F) : (wn[b * 16 + i - 16] >> 4));
            }
            const float v = scales[n * ng + k / G] * q;
            out[n * K + k] = mins ? v + mins[n * ng + k / G] : v;
        }
    }
}
