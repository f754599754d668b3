/* CPU kernels that PyTorch has no fast op for, compiled on the user's machine at first use (see __init__.py).
 *
 *   paged_decode_attention: one query token per sequence against its keys/values read in place from the paged KV
 *       pool (no gather into a batch copy first), all query heads of a key/value head together.
 *   linear_bf16: y = x W^T + b for a few rows x (float32) and bfloat16 weights, converted on the fly: decoding one
 *       or a few sequences is bound by reading the weights, and bfloat16 halves the bytes of a float32 copy.
 *
 * Both accumulate in float32. Work is split over threads with OpenMP, which shares PyTorch's runtime (the
 * library loads the same libgomp.so.1 that torch has already loaded).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define WS_AVX2 1
#endif

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* float32 -> bfloat16, rounding to nearest even (as c10::BFloat16 does); NaN stays NaN. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Keys and values of one layer: float32 or bfloat16 rows of [slots, kv_heads, head_dim]. */
static inline void load_row(const void *cache, int is_bf16, int64_t offset, int64_t d, float *dst) {
    if (is_bf16) {
        const uint16_t *src = (const uint16_t *)cache + offset;
        for (int64_t i = 0; i < d; i++) dst[i] = bf16_to_f32(src[i]);
    } else {
        memcpy(dst, (const float *)cache + offset, (size_t)d * sizeof(float));
    }
}

/* out[b, h, :] = softmax(q[b, h] . K[b]^T * scale) V[b] over the first lengths[b] positions of sequence b, whose
 * position t lives in slot tables[b, t / block_size] * block_size + t % block_size of the pool.
 * q, out: float32 [B, H, D]; tables: int64 [B, W]; lengths: int64 [B]; H is a multiple of KVH.
 * One sequence per task: each slot's keys (all kv heads, contiguous) are read once, by one thread. */
void paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, int is_bf16,
                            const int64_t *tables, const int64_t *lengths, float *out, int64_t B, int64_t H,
                            int64_t KVH, int64_t D, int64_t W, int64_t block_size, float scale) {
    const int64_t G = H / KVH, row_len = KVH * D;
#pragma omp parallel
    {
        int64_t cap = 0;
        float *scores = NULL;
        float *row = (float *)malloc((size_t)row_len * sizeof(float));
        float *acc = (float *)malloc((size_t)(H * D) * sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < B; b++) {
            const int64_t len = lengths[b];
            if (len > cap) {
                free(scores);
                cap = len;
                scores = (float *)malloc((size_t)(H * cap) * sizeof(float));
            }
            const float *qb = q + b * H * D;
            const int64_t *table = tables + b * W;
            /* scores[h, t] = q_h . k_t * scale, with k_t the row of h's kv head */
            for (int64_t t = 0; t < len; t++) {
                const int64_t slot = table[t / block_size] * block_size + t % block_size;
                const float *k;
                if (is_bf16) {
                    load_row(k_cache, 1, slot * row_len, row_len, row);
                    k = row;
                } else {
                    k = (const float *)k_cache + slot * row_len;
                }
                for (int64_t h = 0; h < H; h++) {
                    const float *qh = qb + h * D, *kh = k + (h / G) * D;
                    float s = 0.f;
#pragma omp simd reduction(+ : s)
                    for (int64_t d = 0; d < D; d++) s += qh[d] * kh[d];
                    scores[h * len + t] = s * scale;
                }
            }
            /* softmax over t, per query head */
            for (int64_t h = 0; h < H; h++) {
                float *sh = scores + h * len;
                float m = -FLT_MAX;
                for (int64_t t = 0; t < len; t++) m = sh[t] > m ? sh[t] : m;
                float sum = 0.f;
#pragma omp simd reduction(+ : sum)
                for (int64_t t = 0; t < len; t++) {
                    sh[t] = expf(sh[t] - m);
                    sum += sh[t];
                }
                const float inv = 1.f / sum;
#pragma omp simd
                for (int64_t t = 0; t < len; t++) sh[t] *= inv;
            }
            /* out_h = sum_t p[h, t] v_t */
            memset(acc, 0, (size_t)(H * D) * sizeof(float));
            for (int64_t t = 0; t < len; t++) {
                const int64_t slot = table[t / block_size] * block_size + t % block_size;
                const float *v;
                if (is_bf16) {
                    load_row(v_cache, 1, slot * row_len, row_len, row);
                    v = row;
                } else {
                    v = (const float *)v_cache + slot * row_len;
                }
                for (int64_t h = 0; h < H; h++) {
                    const float p = scores[h * len + t], *vh = v + (h / G) * D;
                    float *ah = acc + h * D;
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) ah[d] += p * vh[d];
                }
            }
            memcpy(out + b * H * D, acc, (size_t)(H * D) * sizeof(float));
        }
        free(scores);
        free(row);
        free(acc);
    }
}

/* y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) with w in bfloat16: x float32 [M, K], w [N, K]; y is float32 [M, N],
 * or bfloat16 (rounded to nearest even) when y16 is given.
 * Each thread walks its share of w's rows in order, one row at a time, so the weights stream from memory in one
 * sequential pass; up to 4 rows of x are served from each weight row while it is in L1. */
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 4
#endif

static void linear_bf16_rows(const float *x, const uint16_t *w, const float *bias, float *y, uint16_t *y16,
                             int64_t M, int64_t K, int64_t N) {
    enum { MB = 4 };
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint16_t *wn = w + n * K;
        const float b = bias ? bias[n] : 0.f;
#ifdef WS_AVX2
        /* ask for the weights PREFETCH_ROWS rows ahead now: more reads in flight than the hardware prefetcher keeps */
        if (PREFETCH_ROWS && n + PREFETCH_ROWS < N) {
            const char *ahead = (const char *)(wn + PREFETCH_ROWS * K);
            for (int64_t off = 0; off < K * 2; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
        }
#endif
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
            const int64_t mb = M - m0 < MB ? M - m0 : MB;
            float dots[MB] = {0.f, 0.f, 0.f, 0.f};
            int64_t k0 = 0;
#ifdef WS_AVX2
            /* two accumulators per row of x (even and odd 8-wide chunks) hide the FMA latency */
            __m256 a[MB][2];
            for (int64_t i = 0; i < MB; i++) a[i][0] = a[i][1] = _mm256_setzero_ps();
            for (; k0 + 16 <= K; k0 += 16) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(wn + k0));
                const __m256 w0 = _mm256_castsi256_ps(
                    _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(raw)), 16));
                const __m256 w1 = _mm256_castsi256_ps(
                    _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(raw, 1)), 16));
                for (int64_t i = 0; i < mb; i++) {
                    const float *xi = x + (m0 + i) * K + k0;
                    a[i][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xi), a[i][0]);
                    a[i][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xi + 8), a[i][1]);
                }
            }
            for (int64_t i = 0; i < mb; i++) {
                const __m256 v = _mm256_add_ps(a[i][0], a[i][1]);
                __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
                r = _mm_hadd_ps(r, r);
                r = _mm_hadd_ps(r, r);
                dots[i] = _mm_cvtss_f32(r);
            }
#endif
            for (int64_t i = 0; i < mb; i++) {
                const float *xi = x + (m0 + i) * K;
                float s = dots[i];
                for (int64_t k = k0; k < K; k++) s += xi[k] * bf16_to_f32(wn[k]);
                if (y16)
                    y16[(m0 + i) * N + n] = f32_to_bf16(s + b);
                else
                    y[(m0 + i) * N + n] = s + b;
            }
        }
    }
}

/* linear_bf16_rows for x in float32 (x_bf16 = 0) or bfloat16, writing float32 y or, when y_bf16, bfloat16 y. */
void linear_bf16(const void *x, int x_bf16, const uint16_t *w, const float *bias, void *y, int y_bf16, int64_t M,
                 int64_t K, int64_t N) {
    float *xf = NULL;
    if (x_bf16) {
        xf = (float *)malloc((size_t)(M * K) * sizeof(float));
        for (int64_t i = 0; i < M * K; i++) xf[i] = bf16_to_f32(((const uint16_t *)x)[i]);
    }
    linear_bf16_rows(xf ? xf : (const float *)x, w, bias, y_bf16 ? NULL : (float *)y, y_bf16 ? (uint16_t *)y : NULL,
                     M, K, N);
    free(xf);
}

/* Hugging Face's LlamaRMSNorm on bfloat16 rows: y = w * bf16(x * rsqrt(mean(x^2) + eps)), the product rounded to
 * bfloat16; the statistics in float32. x, y: [M, D]; w: [D]. */
void rmsnorm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t M, int64_t D, float eps) {
#pragma omp parallel for schedule(static) if (M > 8)
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *xm = x + m * D;
        uint16_t *ym = y + m * D;
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t d = 0; d < D; d++) {
            const float v = bf16_to_f32(xm[d]);
            ss += v * v;
        }
        const float r = 1.f / sqrtf(ss / (float)D + eps);
        for (int64_t d = 0; d < D; d++) {
            const float h = bf16_to_f32(f32_to_bf16(bf16_to_f32(xm[d]) * r));
            ym[d] = f32_to_bf16(bf16_to_f32(w[d]) * h);
        }
    }
}

/* One decode step of a layer's attention for B sequences, from the qkv projection to the attention output, all
 * in one call: rope on q and k (Hugging Face's rotate-half form, each bf16 op rounded as torch rounds it), the new
 * key and value written to their pool slots, then paged_decode_attention's computation; output rounded to bf16.
 * qkv: bfloat16 [B, (H + 2 KVH) D]; cos, sin: bfloat16 [B, D] (each row's position); slots: int64 [B];
 * out: bfloat16 [B, H D]. */
void decode_attention_bf16(const uint16_t *qkv, const uint16_t *cos, const uint16_t *sin, void *k_cache,
                           void *v_cache, int is_bf16, const int64_t *slots, const int64_t *tables,
                           const int64_t *lengths, uint16_t *out, int64_t B, int64_t H, int64_t KVH, int64_t D,
                           int64_t W, int64_t block_size, float scale) {
    const int64_t width = (H + 2 * KVH) * D, half = D / 2, row_len = KVH * D;
    float *q = (float *)malloc((size_t)(B * H * D) * sizeof(float));
    float *o = (float *)malloc((size_t)(B * H * D) * sizeof(float));
#pragma omp parallel for schedule(static) if (B > 1)
    for (int64_t b = 0; b < B; b++) {
        const uint16_t *src = qkv + b * width, *cb = cos + b * D, *sb = sin + b * D;
        /* rope over the H query heads and the KVH key heads, which lie next to each other in qkv */
        for (int64_t h = 0; h < H + KVH; h++) {
            const uint16_t *x = src + h * D;
            float roped[512];
            for (int64_t d = 0; d < D; d++) {
                const float xd = bf16_to_f32(x[d]);
                const float rot = d < half ? -bf16_to_f32(x[d + half]) : bf16_to_f32(x[d - half]);
                const float a = bf16_to_f32(f32_to_bf16(xd * bf16_to_f32(cb[d])));
                const float r = bf16_to_f32(f32_to_bf16(rot * bf16_to_f32(sb[d])));
                roped[d] = bf16_to_f32(f32_to_bf16(a + r));
            }
            if (h < H) {
                memcpy(q + (b * H + h) * D, roped, (size_t)D * sizeof(float));
            } else {
                const int64_t at = slots[b] * row_len + (h - H) * D;
                if (is_bf16)
                    for (int64_t d = 0; d < D; d++) ((uint16_t *)k_cache)[at + d] = f32_to_bf16(roped[d]);
                else
                    memcpy((float *)k_cache + at, roped, (size_t)D * sizeof(float));
            }
        }
        const uint16_t *v = src + (H + KVH) * D;
        for (int64_t j = 0; j < row_len; j++) {
            if (is_bf16)
                ((uint16_t *)v_cache)[slots[b] * row_len + j] = v[j];
            else
                ((float *)v_cache)[slots[b] * row_len + j] = bf16_to_f32(v[j]);
        }
    }
    paged_decode_attention(q, k_cache, v_cache, is_bf16, tables, lengths, o, B, H, KVH, D, W, block_size, scale);
    for (int64_t i = 0; i < B * H * D; i++) out[i] = f32_to_bf16(o[i]);
    free(q);
    free(o);
}
