/* CPU kernels that PyTorch has no fast op for, compiled on the user's machine at first use (see __init__.py).
 *
 *   paged_decode_attention: one query token per sequence against its keys/values read in place from the paged KV
 *       pool (no gather into a batch copy first), all query heads of a key/value head together.
 *   gemm_bf16_packed: y = x W^T + b with bfloat16 weights widened to float32 in registers: decoding reads half
 *       the bytes of a float32 copy, and PyTorch's own bf16 GEMM is emulated (slow) on CPUs without AVX512-BF16.
 *   rmsnorm_bf16, decode_attention_bf16: a layer's small ops for bf16 rows, each one call instead of many.
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

/* Row t of a sequence in one layer's keys or values ([slots, kv_heads, head_dim], float32 or bfloat16): a pointer
 * into the pool, or, for bfloat16, the row widened into buf. */
static inline const float *cache_row(const void *cache, int is_bf16, const int64_t *table, int64_t t,
                                     int64_t block_size, int64_t row_len, float *buf) {
    const int64_t at = (table[t / block_size] * block_size + t % block_size) * row_len;
    if (!is_bf16) return (const float *)cache + at;
    const uint16_t *src = (const uint16_t *)cache + at;
    for (int64_t i = 0; i < row_len; i++) buf[i] = bf16_to_f32(src[i]);
    return buf;
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
                const float *k = cache_row(k_cache, is_bf16, table, t, block_size, row_len, row);
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
                const float *v = cache_row(v_cache, is_bf16, table, t, block_size, row_len, row);
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
/* Linear layers with bfloat16 weights, y = x W^T (+ b), for any number of rows M.
 *
 * W is packed once at load (waferscale.kernels.pack_bf16): panels of 16 output columns, [N / 16][K][16] bf16,
 * the middle quarters of each 16 swapped so that unpacklo/unpackhi against zero widen them to float32 in column
 * order. The micro-kernel keeps up to 6 rows x 16 columns of float32 sums in 12 registers: per k, one 32-byte
 * load of weights and 12 FMAs. Weights stream from memory once per 48 rows of x (chunks that stay in L2), so few
 * rows (decoding) read half the bytes of a float32 copy, and many rows (prefill) run near the FMA peak. */
/* acc[i][0..15] = sum_k x[i, k] * W[n0 + 0..15, k] for i < MB rows, from the packed panel wp [K][16] */
#ifdef WS_AVX2
#define MICRO(MB)                                                                                   \
static inline void micro_##MB(const float *x, int64_t ldx, const uint16_t *wp, int64_t K, float *acc) { \
    __m256 a0[MB], a1[MB];                                                                          \
    for (int i = 0; i < MB; i++) a0[i] = a1[i] = _mm256_setzero_ps();                              \
    const __m256i zero = _mm256_setzero_si256();                                                    \
    for (int64_t k = 0; k < K; k++) {                                                               \
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(wp + k * 16));                    \
        const __m256 w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, raw));                    \
        const __m256 w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, raw));                    \
        for (int i = 0; i < MB; i++) {                                                              \
            const __m256 xb = _mm256_broadcast_ss(x + i * ldx + k);                                 \
            a0[i] = _mm256_fmadd_ps(w0, xb, a0[i]);                                                 \
            a1[i] = _mm256_fmadd_ps(w1, xb, a1[i]);                                                 \
        }                                                                                           \
    }                                                                                               \
    for (int i = 0; i < MB; i++) { _mm256_storeu_ps(acc + i * 16, a0[i]); _mm256_storeu_ps(acc + i * 16 + 8, a1[i]); } \
}
MICRO(1) MICRO(2) MICRO(3) MICRO(4) MICRO(5) MICRO(6)
#else
/* portable fallback with the same packed layout (slower: no explicit vectors) */
static void micro_n(int mb, const float *x, int64_t ldx, const uint16_t *wp, int64_t K, float *acc) {
    static const int col[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
    memset(acc, 0, sizeof(float) * 16 * (size_t)mb);
    for (int64_t k = 0; k < K; k++)
        for (int i = 0; i < mb; i++)
            for (int r = 0; r < 16; r++) acc[i * 16 + col[r]] += x[i * ldx + k] * bf16_to_f32(wp[k * 16 + r]);
}
#define micro_6(x, l, w, k, a) micro_n(6, x, l, w, k, a)
#define micro_5(x, l, w, k, a) micro_n(5, x, l, w, k, a)
#define micro_4(x, l, w, k, a) micro_n(4, x, l, w, k, a)
#define micro_3(x, l, w, k, a) micro_n(3, x, l, w, k, a)
#define micro_2(x, l, w, k, a) micro_n(2, x, l, w, k, a)
#define micro_1(x, l, w, k, a) micro_n(1, x, l, w, k, a)
#endif

void gemm_bf16_packed(const void *x, int x_bf16, const uint16_t *wp, const float *bias, void *y, int y_bf16,
                      int64_t M, int64_t K, int64_t N) {
    const float *xf = (const float *)x;
    float *tmp = NULL;
    if (x_bf16) {
        tmp = (float *)malloc((size_t)(M * K) * sizeof(float));
#pragma omp parallel for schedule(static) if (M * K > 65536)
        for (int64_t i = 0; i < M * K; i++) tmp[i] = bf16_to_f32(((const uint16_t *)x)[i]);
        xf = tmp;
    }
    const int64_t NB = (N + 15) / 16, CHUNK = 48;
    for (int64_t c0 = 0; c0 < M; c0 += CHUNK) {
        const int64_t c1 = M - c0 < CHUNK ? M : c0 + CHUNK;
#pragma omp parallel for schedule(static)
        for (int64_t nb = 0; nb < NB; nb++) {
            const uint16_t *panel = wp + nb * K * 16;
            const int64_t n0 = nb * 16, cols = N - n0 < 16 ? N - n0 : 16;
            float acc[6 * 16];
            for (int64_t m0 = c0; m0 < c1; m0 += 6) {
                const int64_t mb = c1 - m0 < 6 ? c1 - m0 : 6;
                const float *xm = xf + m0 * K;
                switch (mb) {
                    case 6: micro_6(xm, K, panel, K, acc); break;
                    case 5: micro_5(xm, K, panel, K, acc); break;
                    case 4: micro_4(xm, K, panel, K, acc); break;
                    case 3: micro_3(xm, K, panel, K, acc); break;
                    case 2: micro_2(xm, K, panel, K, acc); break;
                    default: micro_1(xm, K, panel, K, acc); break;
                }
                for (int64_t i = 0; i < mb; i++)
                    for (int64_t j = 0; j < cols; j++) {
                        const float v = acc[i * 16 + j] + (bias ? bias[n0 + j] : 0.f);
                        if (y_bf16) ((uint16_t *)y)[(m0 + i) * N + n0 + j] = f32_to_bf16(v);
                        else ((float *)y)[(m0 + i) * N + n0 + j] = v;
                    }
            }
        }
    }
    free(tmp);
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
