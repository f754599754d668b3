/* CPU kernels that PyTorch has no fast op for, compiled on the user's machine at first use (see __init__.py).
 *
 *   paged_decode_attention: one query token per sequence against its keys/values read in place from the paged KV
 *       pool (no gather into a batch copy first), all query heads of a key/value head together.
 *   gemm_bf16_packed: y = x W^T + b with bfloat16 weights widened to float32 in registers: decoding reads half
 *       the bytes of a float32 copy, and PyTorch's own bf16 GEMM is emulated (slow) on CPUs without AVX512-BF16.
 *       gemm_bf16_silu_mul and gemm_bf16_add finish a Llama MLP's gate/up or a residual add in the same pass.
 *   gemm_f32: y = x W^T + b with float32 weights as loaded: MKL's float32 GEMMs, which PyTorch calls, are slow on
 *       AMD CPUs for few rows and give a row other bits at other batch sizes.
 *   rmsnorm_bf16, rmsnorm_gemma_bf16, gelu_mul_bf16, decode_attention_bf16: a layer's small ops for bf16 rows,
 *       each one call instead of many.
 *   decode_layer: a whole decoder layer for a batch of decodes, the kernels above (or quantized projections
 *       through quant_kernels.c's qgemm) in one call.
 *   argmax_logsumexp: the sampler's per-row argmax and log-sum-exp of the logits in one pass each.
 *   masked_argmax: the argmax among the tokens a grammar's bitmask allows, read from the mask as llguidance
 *       writes it (no boolean row, no masked copy of the logits).
 *
 * All accumulate in float32. Work is split over threads with OpenMP, which shares PyTorch's runtime (the
 * library loads the same libgomp.so.1 that torch has already loaded).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#if defined(__AVX2__) && defined(__FMA__) && !defined(WS_PORTABLE)
#include <immintrin.h>
#define WS_AVX2 1
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512F__)
#define WS_AMX 1 /* large bf16 batches on the tile unit (gemm_amx_bf16) */
#endif
#endif

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

/* float32 -> bfloat16, rounding to nearest even (as c10::BFloat16 does); NaN stays NaN. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* KV cache formats (the `fmt` argument): float32, bfloat16, or int8 with float32 scales per slot, kv head and
 * KV_GROUP channels (scales [slots, kv_heads, D / kv_group(D)]; engine/kv_int8.py) */
enum { KV_F32 = 0, KV_BF16 = 1, KV_I8 = 2 };
#define KV_GROUP 64

/* Channels per int8 scale: KV_GROUP where D is a multiple of it, else the whole head (kv_int8.group_size). */
static inline int64_t kv_group(int64_t D) { return D % KV_GROUP == 0 ? KV_GROUP : D; }

/* The pool slot of position t of a sequence whose block table is `table`. */
static inline int64_t slot_of(const int64_t *table, int64_t t, int64_t block_size) {
    return table[t / block_size] * block_size + t % block_size;
}

/* Row t of a sequence in one layer's float32 or bfloat16 keys or values ([slots, kv_heads, head_dim]): a pointer
 * into the pool, or, for bfloat16, the row widened into buf. */
static inline const float *cache_row(const void *cache, int is_bf16, int64_t slot, int64_t row_len, float *buf) {
    const int64_t at = slot * row_len;
    if (!is_bf16) return (const float *)cache + at;
    const uint16_t *src = (const uint16_t *)cache + at;
    for (int64_t i = 0; i < row_len; i++) buf[i] = bf16_to_f32(src[i]);
    return buf;
}

/* q[0..D) = round-to-nearest-even(x / s) in int8 and *scale = s, with s = max |x| / 127 (1 as the divisor of an
 * all-zero x), for one group of D channels: engine/kv_int8.quantize's IEEE operations exactly (no -ffast-math here:
 * a reciprocal in place of the division would round some values to the other integer), so both paths store the
 * same bytes. */
__attribute__((noinline, optimize("no-fast-math"))) static void kv_quantize(const float *x, int64_t D, int8_t *q,
                                                                            float *scale) {
    float amax = 0.f;
    for (int64_t d = 0; d < D; d++) {
        const float a = fabsf(x[d]);
        amax = a > amax ? a : amax;
    }
    const float s = amax / 127.f, div = s > 0.f ? s : 1.f;
    for (int64_t d = 0; d < D; d++) {
        float r = rintf(x[d] / div);
        r = r > 127.f ? 127.f : (r < -127.f ? -127.f : r);
        q[d] = (int8_t)r;
    }
    *scale = s;
}

/* Store D float32 values as head h of a slot (row_len = KVH * D values a slot) in a cache of any format. */
static inline void store_head(void *cache, float *scales, int fmt, int64_t slot, int64_t KVH, int64_t h, int64_t D,
                              const float *x) {
    const int64_t at = (slot * KVH + h) * D;
    if (fmt == KV_I8) {
        const int64_t g = kv_group(D), ng = D / g;
        for (int64_t j = 0; j < ng; j++)
            kv_quantize(x + j * g, g, (int8_t *)cache + at + j * g, scales + (slot * KVH + h) * ng + j);
    } else if (fmt == KV_BF16)
        for (int64_t d = 0; d < D; d++) ((uint16_t *)cache)[at + d] = f32_to_bf16(x[d]);
    else
        memcpy((float *)cache + at, x, (size_t)D * sizeof(float));
}

/* The pool slots of positions pos0, pos0 + 1, ... of a sequence: one block-table lookup a block, no division per
 * position (the next block is looked up when its first slot is asked for, never past the last). */
typedef struct {
    const int64_t *table;
    int64_t block_size, blk, off, base;
} slot_walk_t;

static inline slot_walk_t slot_walk(const int64_t *table, int64_t pos0, int64_t block_size) {
    const int64_t blk = pos0 / block_size;
    return (slot_walk_t){table, block_size, blk, pos0 % block_size, table[blk] * block_size};
}

static inline int64_t slot_next(slot_walk_t *w) {
    if (w->off == w->block_size) {
        w->off = 0;
        w->base = w->table[++w->blk] * w->block_size;
    }
    return w->base + w->off++;
}

/* Positions ahead of the one being read whose kv head the decode kernels prefetch: a head is only part of its
 * slot's row, and a sequence's pages lie anywhere in the pool, so the hardware prefetchers did not keep up */
#define ATT_PREFETCH 32

/* A walk ATT_PREFETCH positions ahead of one starting at pos0 that reads n positions (none when n is shorter) */
static inline slot_walk_t slot_walk_ahead(const int64_t *table, int64_t pos0, int64_t n, int64_t block_size) {
    return slot_walk(table, pos0 + (n > ATT_PREFETCH ? ATT_PREFETCH : 0), block_size);
}

/* Prefetch the D values of kv head g of a slot in a cache of any format, and an int8 cache's scales of them */
static inline void prefetch_head(const void *cache, int fmt, const float *scales, int64_t slot, int64_t KVH,
                                 int64_t g, int64_t D) {
    const int64_t size = fmt == KV_I8 ? 1 : fmt == KV_BF16 ? 2 : 4;
    const char *p = (const char *)cache + (slot * KVH + g) * D * size;
    for (int64_t o = 0; o < D * size; o += 64) __builtin_prefetch(p + o);
    if (fmt == KV_I8) __builtin_prefetch(scales + (slot * KVH + g) * (D / kv_group(D)));
}

/* scores[h, t] = q_h . k_t * scale for the n positions pos0 .. pos0 + n - 1 of a sequence (k_t the row of h's kv
 * head; row: a scratch row of KVH * D floats). An int8 cache is read as it is stored: q . k_int8 over each group of
 * channels times that group's scale. */
static void att_scores(const float *qb, const void *k_cache, int fmt, const float *k_scale, const int64_t *table,
                       int64_t pos0, int64_t n, int64_t H, int64_t KVH, int64_t D, int64_t block_size, float scale,
                       float *row, float *scores) {
    const int64_t G = H / KVH, row_len = KVH * D, qg = kv_group(D), ng = D / qg;
    slot_walk_t walk = slot_walk(table, pos0, block_size);
    for (int64_t t = 0; t < n; t++) {
        const int64_t slot = slot_next(&walk);
        if (fmt == KV_I8) {
            const int8_t *k = (const int8_t *)k_cache + slot * row_len;
            const float *ks = k_scale + slot * KVH * ng;
#pragma omp simd
            for (int64_t i = 0; i < row_len; i++) row[i] = (float)k[i]; /* once per kv head, not per query head */
            for (int64_t h = 0; h < H; h++) {
                const float *qh = qb + h * D, *kss = ks + (h / G) * ng, *kh = row + (h / G) * D;
                float s = 0.f;
                for (int64_t j = 0; j < ng; j++) {
                    float sj = 0.f;
#pragma omp simd reduction(+ : sj)
                    for (int64_t d = j * qg; d < (j + 1) * qg; d++) sj += qh[d] * kh[d];
                    s += sj * kss[j];
                }
                scores[h * n + t] = s * scale;
            }
            continue;
        }
        const float *k = cache_row(k_cache, fmt == KV_BF16, slot, row_len, row);
        for (int64_t h = 0; h < H; h++) {
            const float *qh = qb + h * D, *kh = k + (h / G) * D;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; d++) s += qh[d] * kh[d];
            scores[h * n + t] = s * scale;
        }
    }
}

/* acc[h] += sum_t p[h, t] v_t over the same n positions (an int8 value's weight times its group's scale, nothing
 * widened to a float copy first). */
static void att_values(const float *p, const void *v_cache, int fmt, const float *v_scale, const int64_t *table,
                       int64_t pos0, int64_t n, int64_t H, int64_t KVH, int64_t D, int64_t block_size, float *row,
                       float *acc) {
    const int64_t G = H / KVH, row_len = KVH * D, qg = kv_group(D), ng = D / qg;
    slot_walk_t walk = slot_walk(table, pos0, block_size);
    for (int64_t t = 0; t < n; t++) {
        const int64_t slot = slot_next(&walk);
        if (fmt == KV_I8) {
            const int8_t *v = (const int8_t *)v_cache + slot * row_len;
            const float *vs = v_scale + slot * KVH * ng;
#pragma omp simd
            for (int64_t i = 0; i < row_len; i++) row[i] = (float)v[i];
            for (int64_t h = 0; h < H; h++) {
                const float *vh = row + (h / G) * D;
                float *ah = acc + h * D;
                for (int64_t j = 0; j < ng; j++) {
                    const float w = p[h * n + t] * vs[(h / G) * ng + j];
#pragma omp simd
                    for (int64_t d = j * qg; d < (j + 1) * qg; d++) ah[d] += w * vh[d];
                }
            }
            continue;
        }
        const float *v = cache_row(v_cache, fmt == KV_BF16, slot, row_len, row);
        for (int64_t h = 0; h < H; h++) {
            const float w = p[h * n + t], *vh = v + (h / G) * D;
            float *ah = acc + h * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) ah[d] += w * vh[d];
        }
    }
}

/* VL float32 lanes (GCC's vector extension): 16, one AVX-512 register, where the build has AVX-512; else 8, one
 * AVX2 register (GCC spills 64-byte vectors split over AVX2 registers); and VL channels of a cache row widened to
 * them exactly. */
#if defined(__AVX512F__) && defined(WS_AVX2)
#define VL 16
#else
#define VL 8
#endif
typedef float vf __attribute__((vector_size(VL * 4)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));
typedef uint16_t vh __attribute__((vector_size(VL * 2)));
typedef int8_t vb __attribute__((vector_size(VL)));

static inline vf loadv(const void *cache, int fmt, int64_t at) {
    vf x;
    if (fmt == KV_BF16) {
        const uint16_t *src = (const uint16_t *)cache + at;
#if VL == 16 /* one widening load (GCC splits __builtin_convertvector's into halves and re-joins them) */
        const __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src)), 16);
        memcpy(&x, &u, sizeof x);
#elif defined(WS_AVX2)
        const __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)src)), 16);
        memcpy(&x, &u, sizeof x);
#else
        vh h;
        memcpy(&h, src, sizeof h);
        const vu u = __builtin_convertvector(h, vu) << 16;
        memcpy(&x, &u, sizeof x);
#endif
    } else if (fmt == KV_I8) {
        vb b;
        memcpy(&b, (const int8_t *)cache + at, sizeof b);
#if VL == 16
        __m128i raw;
        memcpy(&raw, &b, sizeof raw);
        const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
        memcpy(&x, &f, sizeof x);
#elif defined(WS_AVX2)
        const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)&b)));
        memcpy(&x, &f, sizeof x);
#else
        x = __builtin_convertvector(__builtin_convertvector(b, vi), vf);
#endif
    } else {
        memcpy(&x, (const float *)cache + at, sizeof x);
    }
    return x;
}

static inline float hsum(vf v) {
#if VL == 16
    __m512 z;
    memcpy(&z, &v, sizeof z);
    return _mm512_reduce_add_ps(z);
#elif defined(WS_AVX2)
    __m256 s8;
    memcpy(&s8, &v, sizeof s8);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
    return _mm_cvtss_f32(s4);
#else
    float r = 0.f;
    for (int i = 0; i < VL; i++) r += v[i];
    return r;
#endif
}

#if VL == 16
/* r[i] = hsum(v[i]) for 16 vectors, each summed in hsum's order (_mm512_reduce_add_ps's: the 256-bit halves, the
 * 128-bit halves, then lanes 0 + 2 and 1 + 3, then those two), so the same bits as 16 calls of hsum: the vectors
 * transposed while they are added, 15 additions and 30 shuffles for 16 sums */
static inline vf hsum16(const vf *v) {
    __m512 w[8], u[4], t[2];
    for (int j = 0; j < 8; j++) {
        __m512 a, b;
        memcpy(&a, &v[2 * j], sizeof a);
        memcpy(&b, &v[2 * j + 1], sizeof b);
        w[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    }
    for (int k = 0; k < 4; k++) /* 128-bit lane l: v[4k + l]'s sums of 4 */
        u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0xDD));
    for (int m = 0; m < 2; m++) /* lane l: v[8m + l]'s sums of 2, then v[8m + 4 + l]'s */
        t[m] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * m], u[2 * m + 1], 0x44),
                             _mm512_shuffle_ps(u[2 * m], u[2 * m + 1], 0xEE));
    /* lane 4l + e: hsum(v[l + 4e]) */
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(t[0], t[1], 0x88), _mm512_shuffle_ps(t[0], t[1], 0xDD));
    const __m512 o = _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), r);
    vf out;
    memcpy(&out, &o, sizeof out);
    return out;
}
#define HSUM_VL hsum16
#elif defined(WS_AVX2)
/* r[i] = hsum(v[i]) for 8 vectors, each summed in hsum's order (the 128-bit halves, then lanes 0 + 2 and 1 + 3,
 * then those two): the same bits as 8 calls of hsum */
static inline vf hsum8x8(const vf *v) {
    __m256 w[4], t[2];
    for (int j = 0; j < 4; j++) { /* 128-bit lane l: v[2j + l]'s sums of 2 */
        __m256 a, b;
        memcpy(&a, &v[2 * j], sizeof a);
        memcpy(&b, &v[2 * j + 1], sizeof b);
        w[j] = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
    }
    for (int m = 0; m < 2; m++) /* lane l: v[4m + l]'s sums of 2 halves, then v[4m + 2 + l]'s */
        t[m] = _mm256_add_ps(_mm256_shuffle_ps(w[2 * m], w[2 * m + 1], 0x44),
                             _mm256_shuffle_ps(w[2 * m], w[2 * m + 1], 0xEE));
    /* lane 4l + e: hsum(v[l + 2e]) */
    const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], 0x88), _mm256_shuffle_ps(t[0], t[1], 0xDD));
    const __m256 o = _mm256_permutevar8x32_ps(r, _mm256_set_epi32(7, 3, 6, 2, 5, 1, 4, 0));
    vf out;
    memcpy(&out, &o, sizeof out);
    return out;
}
#define HSUM_VL hsum8x8
#endif

/* FN(format, group size) with both as constants, for the common group sizes (each combination compiled apart, its
 * format tests and group loop bounds folded); `fmt`, H and KVH in scope. */
#define ATT_GROUPS(FN, F)                                                                                           \
    switch (H / KVH) {                                                                                              \
    case 1: FN(F, 1); break;                                                                                        \
    case 2: FN(F, 2); break;                                                                                        \
    case 3: FN(F, 3); break;                                                                                        \
    case 4: FN(F, 4); break;                                                                                        \
    case 8: FN(F, 8); break;                                                                                        \
    default: FN(F, H / KVH);                                                                                        \
    }
#define ATT_SPECIALIZED(FN)                                                                                         \
    if (fmt == KV_I8) {                                                                                             \
        ATT_GROUPS(FN, KV_I8)                                                                                       \
    } else if (fmt == KV_BF16) {                                                                                    \
        ATT_GROUPS(FN, KV_BF16)                                                                                     \
    } else {                                                                                                        \
        ATT_GROUPS(FN, KV_F32)                                                                                      \
    }

#define ATT_MAX_GROUP 16 /* query heads per kv head that att_values_grouped keeps in registers */

/* Vectors of channels att_values_grouped_fmt takes a pass for a group of G query heads: G x that many sums held in
 * registers (AVX-512 has 32, AVX2 16, a few kept for the row and weights), so that a pass reads more of each row
 * and fewer passes walk the positions */
#define ATT_VALUE_REGS (VL == 16 ? 24 : 12)
#define ATT_VALUE_VECS(G) ((G) * 4 <= ATT_VALUE_REGS ? 4 : (G) * 2 <= ATT_VALUE_REGS ? 2 : 1)

/* Positions att_values_grouped_fmt takes a chunk: every pass over a kv head's channels reads the chunk's rows, which
 * stay in L1 between passes (8 query heads a kv head of 128 on AVX2 take 16 passes of one vector: walking every
 * position each pass read the rows from L2 16 times) */
#define ATT_VALUE_CHUNK 64

/* NV vectors of channels c .. c + NV * VL - 1 of kv head g over positions t0 .. t1 - 1 of n, the sums of its G query
 * heads kept in registers; acc is set from them at t0 = 0, else added to in the same order (the sums carried over in
 * acc as they were in registers: the same bits as one pass over every position) */
static inline __attribute__((always_inline)) void att_values_pass(const float *p, const void *v_cache, int fmt,
                                                                   const float *v_scale, const int64_t *table,
                                                                   int64_t pos0, int64_t n, int64_t t0, int64_t t1,
                                                                   int64_t G, int64_t NV, int64_t KVH, int64_t g,
                                                                   int64_t c, int64_t D, int64_t block_size,
                                                                   float *acc) {
    const int64_t row_len = KVH * D, qg = kv_group(D), ng = D / qg;
    vf a[ATT_MAX_GROUP][4];
    for (int64_t h = 0; h < G; h++)
        for (int64_t k = 0; k < NV; k++) {
            a[h][k] = (vf){0};
            if (t0) memcpy(&a[h][k], acc + (g * G + h) * D + c + k * VL, sizeof a[h][k]);
        }
    slot_walk_t walk = slot_walk(table, pos0 + t0, block_size);
    slot_walk_t ahead = slot_walk_ahead(table, pos0 + t0, n - t0, block_size);
    for (int64_t t = t0; t < t1; t++) {
        const int64_t slot = slot_next(&walk);
        if (c == 0 && t + ATT_PREFETCH < n) prefetch_head(v_cache, fmt, v_scale, slot_next(&ahead), KVH, g, D);
        /* one scale for the pass: NV * VL channels (16-64) lie within one scale group (64 channels, or the head) */
        const float s = fmt == KV_I8 ? v_scale[(slot * KVH + g) * ng + c / qg] : 1.f;
        float w[ATT_MAX_GROUP];
        for (int64_t h = 0; h < G; h++) w[h] = fmt == KV_I8 ? p[(g * G + h) * n + t] * s : p[(g * G + h) * n + t];
        for (int64_t k = 0; k < NV; k++) {
            const vf x = loadv(v_cache, fmt, slot * row_len + g * D + c + k * VL);
            for (int64_t h = 0; h < G; h++) a[h][k] += w[h] * x;
        }
    }
    for (int64_t h = 0; h < G; h++)
        for (int64_t k = 0; k < NV; k++) memcpy(acc + (g * G + h) * D + c + k * VL, &a[h][k], sizeof a[h][k]);
}

/* att_values for D a multiple of 16 and at most ATT_MAX_GROUP query heads a kv head: ATT_VALUE_VECS(G) vectors of
 * channels of one kv head at a time, the sums of its query heads kept in registers over a chunk of positions (not
 * loaded and stored per position); acc is set, not added to. The same products summed in the same order as
 * att_values. */
static inline __attribute__((always_inline)) void att_values_grouped_fmt(const float *p, const void *v_cache,
                                                                          int fmt, const float *v_scale,
                               const int64_t *table, int64_t pos0, int64_t n, int64_t G, int64_t KVH, int64_t g0,
                               int64_t g1, int64_t D, int64_t block_size, float *acc) {
    const int64_t NV = ATT_VALUE_VECS(G);
    for (int64_t g = g0; g < g1; g++)
        for (int64_t t0 = 0; t0 == 0 || t0 < n; t0 += ATT_VALUE_CHUNK) { /* n = 0: acc set to zeros */
            const int64_t t1 = n - t0 < ATT_VALUE_CHUNK ? n : t0 + ATT_VALUE_CHUNK;
            int64_t c = 0;
            for (; c + NV * VL <= D; c += NV * VL)
                att_values_pass(p, v_cache, fmt, v_scale, table, pos0, n, t0, t1, G, NV, KVH, g, c, D, block_size,
                                acc);
            for (; c < D; c += VL)
                att_values_pass(p, v_cache, fmt, v_scale, table, pos0, n, t0, t1, G, 1, KVH, g, c, D, block_size,
                                acc);
        }
}

/* att_values_grouped_fmt compiled per cache format and group size, for kv heads g0 .. g1 - 1 */
static void att_values_grouped(const float *p, const void *v_cache, int fmt, const float *v_scale,
                               const int64_t *table, int64_t pos0, int64_t n, int64_t H, int64_t KVH, int64_t g0,
                               int64_t g1, int64_t D, int64_t block_size, float *acc) {
#define ATT_VALUES_G(F, GG) \
    att_values_grouped_fmt(p, v_cache, F, v_scale, table, pos0, n, GG, KVH, g0, g1, D, block_size, acc)
    ATT_SPECIALIZED(ATT_VALUES_G)
#undef ATT_VALUES_G
}


/* att_scores for D a multiple of 16 and at most ATT_MAX_GROUP query heads a kv head: each position's key row of a
 * kv head widened VL channels at a time and multiplied by every query head of its group, one horizontal sum per
 * head and scale group (64 channels). */
static inline __attribute__((always_inline)) void att_scores_grouped_fmt(const float *qb, const void *k_cache,
                                                                          int fmt, const float *k_scale,
                                                                          const int64_t *table, int64_t pos0,
                                                                          int64_t n, int64_t G, int64_t KVH,
                                                                          int64_t g0, int64_t g1, int64_t D,
                                                                          int64_t block_size, float scale,
                                                                          float *scores) {
    const int64_t row_len = KVH * D, qg = kv_group(D), ng = D / qg;
#ifdef HSUM_VL
    /* VL positions at a time: their products per head summed across lanes together (HSUM_VL), not one hsum each */
    for (int64_t g = g0; g < g1; g++) {
        const float *qgp = qb + g * G * D;
        slot_walk_t walk = slot_walk(table, pos0, block_size), ahead = slot_walk_ahead(table, pos0, n, block_size);
        for (int64_t t0 = 0; t0 < n; t0 += VL) {
            const int64_t nt = n - t0 < VL ? n - t0 : VL;
            int64_t slots[VL];
            for (int64_t i = 0; i < nt; i++) {
                slots[i] = slot_next(&walk);
                if (t0 + i + ATT_PREFETCH < n) prefetch_head(k_cache, fmt, k_scale, slot_next(&ahead), KVH, g, D);
            }
            vf tot[ATT_MAX_GROUP];
            for (int64_t h = 0; h < G; h++) tot[h] = (vf){0};
            for (int64_t j = 0; j < ng; j++) {
                vf part[ATT_MAX_GROUP][VL];
                for (int64_t i = 0; i < VL; i++) {
                    vf pv[ATT_MAX_GROUP];
                    for (int64_t h = 0; h < G; h++) pv[h] = (vf){0};
                    for (int64_t c = j * qg; i < nt && c < (j + 1) * qg; c += VL) {
                        const vf x = loadv(k_cache, fmt, slots[i] * row_len + g * D + c);
                        for (int64_t h = 0; h < G; h++) {
                            vf qv;
                            memcpy(&qv, qgp + h * D + c, sizeof qv);
                            pv[h] += qv * x;
                        }
                    }
                    for (int64_t h = 0; h < G; h++) part[h][i] = pv[h];
                }
                vf ks = (vf){0} + 1.f;
                if (fmt == KV_I8)
                    for (int64_t i = 0; i < nt; i++) ks[i] = k_scale[(slots[i] * KVH + g) * ng + j];
                for (int64_t h = 0; h < G; h++) tot[h] += HSUM_VL(part[h]) * ks;
            }
            for (int64_t h = 0; h < G; h++)
                for (int64_t i = 0; i < nt; i++) scores[(g * G + h) * n + t0 + i] = tot[h][i] * scale;
        }
    }
#else
    for (int64_t g = g0; g < g1; g++) {
        const float *qgp = qb + g * G * D;
        slot_walk_t walk = slot_walk(table, pos0, block_size);
        for (int64_t t = 0; t < n; t++) {
            const int64_t slot = slot_next(&walk);
            float tot[ATT_MAX_GROUP];
            for (int64_t h = 0; h < G; h++) tot[h] = 0.f;
            for (int64_t j = 0; j < ng; j++) {
                vf part[ATT_MAX_GROUP];
                for (int64_t h = 0; h < G; h++) part[h] = (vf){0};
                for (int64_t c = j * qg; c < (j + 1) * qg; c += VL) {
                    const vf x = loadv(k_cache, fmt, slot * row_len + g * D + c);
                    for (int64_t h = 0; h < G; h++) {
                        vf qv;
                        memcpy(&qv, qgp + h * D + c, sizeof qv);
                        part[h] += qv * x;
                    }
                }
                const float ks = fmt == KV_I8 ? k_scale[(slot * KVH + g) * ng + j] : 1.f;
                for (int64_t h = 0; h < G; h++) tot[h] += hsum(part[h]) * ks;
            }
            for (int64_t h = 0; h < G; h++) scores[(g * G + h) * n + t] = tot[h] * scale;
        }
    }
#endif
}

/* att_scores_grouped_fmt compiled per cache format and group size, for kv heads g0 .. g1 - 1 */
static void att_scores_grouped(const float *qb, const void *k_cache, int fmt, const float *k_scale,
                               const int64_t *table, int64_t pos0, int64_t n, int64_t H, int64_t KVH, int64_t g0,
                               int64_t g1, int64_t D, int64_t block_size, float scale, float *scores) {
#define ATT_SCORES_G(F, GG) \
    att_scores_grouped_fmt(qb, k_cache, F, k_scale, table, pos0, n, GG, KVH, g0, g1, D, block_size, scale, scores)
    ATT_SPECIALIZED(ATT_SCORES_G)
#undef ATT_SCORES_G
}

/* Positions a task of paged_decode_attention_ex covers: a longer sequence is split into chunks of this many, each its
 * own task (so that one long sequence takes every thread), combined afterwards in chunk order. The split depends on
 * the sequence's length only, never on the batch: a sequence gets the same numbers in any batch. */
#define ATT_CHUNK 512

/* out[b, h, :] = softmax(q[b, h] . K[b]^T * scale) V[b] over positions starts[b] .. lengths[b] - 1 (starts NULL: from
 * 0; a sliding window) of sequence b, whose position t lives in slot tables[b, t / block_size] * block_size +
 * t % block_size of the pool, with sinks[h] (NULL: none) joining each head's softmax denominator as one more logit.
 * q, out: float32 [B, H, D]; tables: int64 [B, W]; lengths: int64 [B]; H is a multiple of KVH. A sequence of at most
 * ATT_CHUNK positions is one task (its softmax normalised before the values are summed); a longer one is split into
 * chunks, each summing exp(s - its own max) v and exp(s - max), merged in chunk order (flash-decoding). */
void paged_decode_attention_ex(const float *q, const void *k_cache, const void *v_cache, int fmt,
                               const float *k_scale, const float *v_scale, const int64_t *tables,
                               const int64_t *starts, const int64_t *lengths, const float *sinks, float *out,
                               int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t W, int64_t block_size,
                               float scale) {
    const int64_t row_len = KVH * D;
    int64_t *first_task = (int64_t *)malloc((size_t)(B + 1) * sizeof(int64_t));
    first_task[0] = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t len = lengths[b] - (starts ? starts[b] : 0);
        first_task[b + 1] = first_task[b] + (len > ATT_CHUNK ? (len + ATT_CHUNK - 1) / ATT_CHUNK : 1);
    }
    const int64_t T = first_task[B];
    int64_t *task_seq = (int64_t *)malloc((size_t)T * sizeof(int64_t));
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = first_task[b]; i < first_task[b + 1]; i++) task_seq[i] = b;
    /* chunked tasks' partial results: each head's max, sum of exp and unnormalised sum of values */
    float *pm = NULL, *pl = NULL, *pacc = NULL;
    if (T > B) {
        pm = (float *)malloc((size_t)(T * H) * sizeof(float));
        pl = (float *)malloc((size_t)(T * H) * sizeof(float));
        pacc = (float *)malloc((size_t)(T * H * D) * sizeof(float));
    }
    /* Work items: a task each, except for the rows of one sequence (a step verifying drafts, a draft catching up:
     * the same table and starts, lengths one apart) longer than a chunk, whose tasks of one chunk form one item run
     * on one thread, row after row, so that the chunk's keys and values are read from memory once, then from the
     * core's caches. Each task computes what it computes alone. */
    int64_t *item_first = (int64_t *)malloc((size_t)(T + 1) * sizeof(int64_t)); /* into items' task list */
    int64_t *item_tasks = (int64_t *)malloc((size_t)T * sizeof(int64_t));
    int64_t NI = 0, filled = 0;
    for (int64_t b0 = 0; b0 < B;) {
        int64_t b1 = b0 + 1;
        if (first_task[b0 + 1] - first_task[b0] > 1)
            while (b1 < B && lengths[b1] == lengths[b1 - 1] + 1 && (!starts || starts[b1] == starts[b0]) &&
                   memcmp(tables + b1 * W, tables + b0 * W, (size_t)W * sizeof(int64_t)) == 0)
                b1++;
        const int64_t most = first_task[b1] - first_task[b1 - 1]; /* the group's last row has the most chunks */
        for (int64_t c = 0; c < most; c++) {
            item_first[NI++] = filled;
            for (int64_t b = b0; b < b1; b++)
                if (c < first_task[b + 1] - first_task[b]) item_tasks[filled++] = first_task[b] + c;
        }
        b0 = b1;
    }
    item_first[NI] = filled;
    /* Fewer than two items a thread (one stream of up to 2 x threads chunks): each item's kv heads become items of
     * their own (on the grouped kernels), so that the threads share the work evenly (3 kv heads or 3 chunks on 2
     * threads left one idle a third of the time). Not with more items: threads then shared chunks, and one chunk's
     * heads read by two cores measured slower. A head's numbers are the same whichever task computes them. */
    const int grouped = D % 16 == 0 && H / KVH <= ATT_MAX_GROUP;
    const int64_t S = grouped && NI < 2 * (int64_t)omp_get_max_threads() ? KVH : 1, G = H / KVH;
#pragma omp parallel
    {
        int64_t cap = 0;
        float *scores = NULL;
        float *row = (float *)malloc((size_t)row_len * sizeof(float));
        float *acc = (float *)malloc((size_t)(H * D) * sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (int64_t si = 0; si < NI * S; si++) {
            for (int64_t it = item_first[si / S]; it < item_first[si / S + 1]; it++) {
                const int64_t task = item_tasks[it], g0 = S == 1 ? 0 : si % S, g1 = S == 1 ? KVH : g0 + 1;
                const int64_t h0 = g0 * G, h1 = g1 * G;
                const int64_t b = task_seq[task], chunks = first_task[b + 1] - first_task[b];
                const int64_t c = task - first_task[b], seq_first = starts ? starts[b] : 0;
                const int64_t first = seq_first + c * ATT_CHUNK;
                const int64_t len = chunks == 1 ? lengths[b] - seq_first
                                                 : (lengths[b] - first < ATT_CHUNK ? lengths[b] - first : ATT_CHUNK);
                if (len > cap) {
                    free(scores);
                    cap = len;
                    scores = (float *)malloc((size_t)(H * cap) * sizeof(float));
                }
                const float *qb = q + b * H * D;
                const int64_t *table = tables + b * W;
                if (grouped)
                    att_scores_grouped(qb, k_cache, fmt, k_scale, table, first, len, H, KVH, g0, g1, D, block_size, scale,
                                       scores);
                else
                    att_scores(qb, k_cache, fmt, k_scale, table, first, len, H, KVH, D, block_size, scale, row, scores);
                for (int64_t h = h0; h < h1; h++) {
                    float *sh = scores + h * len;
                    float m = chunks == 1 && sinks ? sinks[h] : -FLT_MAX;
                    for (int64_t t = 0; t < len; t++) m = sh[t] > m ? sh[t] : m;
                    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
                    for (int64_t t = 0; t < len; t++) {
                        sh[t] = expf(sh[t] - m);
                        sum += sh[t];
                    }
                    if (chunks > 1) { /* kept unnormalised: the merge rescales each chunk by its max */
                        pm[task * H + h] = m;
                        pl[task * H + h] = sum;
                        continue;
                    }
                    if (sinks) sum += expf(sinks[h] - m);
                    const float inv = 1.f / sum;
#pragma omp simd
                    for (int64_t t = 0; t < len; t++) sh[t] *= inv;
                }
                if (grouped) {
                    att_values_grouped(scores, v_cache, fmt, v_scale, table, first, len, H, KVH, g0, g1, D, block_size,
                                       acc);
                } else {
                    memset(acc, 0, (size_t)(H * D) * sizeof(float));
                    att_values(scores, v_cache, fmt, v_scale, table, first, len, H, KVH, D, block_size, row, acc);
                }
                memcpy((chunks == 1 ? out + b * H * D : pacc + task * H * D) + h0 * D, acc + h0 * D,
                       (size_t)((h1 - h0) * D) * sizeof(float));
            }
        }
        free(scores);
        free(row);
        free(acc);
        if (T > B) {
#pragma omp for schedule(static)
            for (int64_t b = 0; b < B; b++) {
                const int64_t t0 = first_task[b], t1 = first_task[b + 1];
                if (t1 - t0 == 1) continue;
                for (int64_t h = 0; h < H; h++) {
                    float m = sinks ? sinks[h] : -FLT_MAX;
                    for (int64_t t = t0; t < t1; t++) m = pm[t * H + h] > m ? pm[t * H + h] : m;
                    float denom = sinks ? expf(sinks[h] - m) : 0.f;
                    float *o = out + (b * H + h) * D;
                    memset(o, 0, (size_t)D * sizeof(float));
                    for (int64_t t = t0; t < t1; t++) {
                        const float w = expf(pm[t * H + h] - m);
                        denom += w * pl[t * H + h];
                        const float *a = pacc + (t * H + h) * D;
#pragma omp simd
                        for (int64_t d = 0; d < D; d++) o[d] += w * a[d];
                    }
                    const float inv = 1.f / denom;
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) o[d] *= inv;
                }
            }
        }
    }
    free(pm);
    free(pl);
    free(pacc);
    free(first_task);
    free(task_seq);
    free(item_first);
    free(item_tasks);
}

void paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, int fmt,
                            const float *k_scale, const float *v_scale, const int64_t *tables,
                            const int64_t *lengths, float *out, int64_t B, int64_t H, int64_t KVH, int64_t D,
                            int64_t W, int64_t block_size, float scale) {
    paged_decode_attention_ex(q, k_cache, v_cache, fmt, k_scale, v_scale, tables, NULL, lengths, NULL, out, B, H,
                              KVH, D, W, block_size, scale);
}

/* Linear layers with bfloat16 weights, y = x W^T (+ b), for any number of rows M.
 *
 * W is packed once at load (waferscale.kernels.pack_bf16): panels of 16 output columns, [N / 16][K][16] bf16, the
 * middle quarters of each 16 swapped so that unpacklo/unpackhi against zero widen them to float32 in column order
 * (a shuffle port, where a shift would take an FMA port from the FMAs). The micro-kernel keeps MB rows x P panels of
 * float32 sums in registers: per k, P 32-byte loads of weights and 2 MB P FMAs. Many rows use one panel and up to
 * 6 rows (12 registers); one or two rows use 4 or 2 panels at once, so that 8 independent sums hide the FMA latency
 * (with 2 sums, one row streams only half the bytes memory can give). Each sum still runs over k in order, so a
 * row's result does not depend on the batch. Weights stream from memory once per 48 rows of x (chunks that stay in
 * L2), so few rows (decoding) read half the bytes of a float32 copy, and many rows (prefill) run near the FMA peak. */
/* acc[(p * 6 + i) * 16 + 0..15] = sum_k x[i, k] * W[panel p's 16 columns, k] for i < MB, p < P, the panels at
 * wp + p * K * 16; each k also prefetches pf[k * pfs] (a slice of the weights the next call reads) */
#ifdef WS_AVX2
#define MICRO(MB, P)                                                                                             \
static inline void micro_##MB##_##P(const float *x, int64_t ldx, const uint16_t *wp, int64_t K, float *acc,      \
                                    const uint16_t *pf, int64_t pfs) {                                           \
    __m256 lo[MB][P], hi[MB][P];                                                                                 \
    for (int i = 0; i < MB; i++)                                                                                 \
        for (int p = 0; p < P; p++) lo[i][p] = hi[i][p] = _mm256_setzero_ps();                                   \
    const __m256i zero = _mm256_setzero_si256();                                                                 \
    for (int64_t k = 0; k < K; k++) {                                                                            \
        for (int j = 0; j < (P + 1) / 2; j++) /* a 64-byte line per 2 panels read */                            \
            _mm_prefetch((const char *)(pf + k * pfs + j * 32), _MM_HINT_T0);                                    \
        for (int p = 0; p < P; p++) {                                                                            \
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(wp + p * K * 16 + k * 16));                \
            const __m256 w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, raw));                            \
            const __m256 w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, raw));                             \
            for (int i = 0; i < MB; i++) { /* (broadcast here: 16 registers hold 12 sums, 2 weights, x, zero) */ \
                const __m256 xb = _mm256_broadcast_ss(x + i * ldx + k);                                          \
                lo[i][p] = _mm256_fmadd_ps(w0, xb, lo[i][p]);                                                    \
                hi[i][p] = _mm256_fmadd_ps(w1, xb, hi[i][p]);                                                    \
            }                                                                                                    \
        }                                                                                                        \
    }                                                                                                            \
    for (int p = 0; p < P; p++)                                                                                  \
        for (int i = 0; i < MB; i++) {                                                                           \
            _mm256_storeu_ps(acc + (p * 6 + i) * 16, lo[i][p]);                                                  \
            _mm256_storeu_ps(acc + (p * 6 + i) * 16 + 8, hi[i][p]);                                              \
        }                                                                                                        \
}
MICRO(1, 1) MICRO(2, 1) MICRO(3, 1) MICRO(4, 1) MICRO(5, 1) MICRO(6, 1) MICRO(1, 4) MICRO(2, 2)
#else
/* portable fallback with the same packed layout (slower: no explicit vectors; no prefetch hints) */
static void micro_n(int mb, int np, const float *x, int64_t ldx, const uint16_t *wp, int64_t K, float *acc) {
    static const int col[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};
    for (int p = 0; p < np; p++)
        for (int i = 0; i < mb; i++) {
            float *a = acc + (p * 6 + i) * 16;
            memset(a, 0, sizeof(float) * 16);
            for (int64_t k = 0; k < K; k++)
                for (int r = 0; r < 16; r++) a[col[r]] += x[i * ldx + k] * bf16_to_f32(wp[p * K * 16 + k * 16 + r]);
        }
}
#define MICRO_FALLBACK(MB, P)                                                                                    \
static void micro_##MB##_##P(const float *x, int64_t ldx, const uint16_t *wp, int64_t K, float *acc,             \
                             const uint16_t *pf, int64_t pfs) {                                                  \
    (void)pf, (void)pfs;                                                                                         \
    micro_n(MB, P, x, ldx, wp, K, acc);                                                                          \
}
MICRO_FALLBACK(1, 1) MICRO_FALLBACK(2, 1) MICRO_FALLBACK(3, 1) MICRO_FALLBACK(4, 1) MICRO_FALLBACK(5, 1)
MICRO_FALLBACK(6, 1) MICRO_FALLBACK(1, 4) MICRO_FALLBACK(2, 2)
#endif

/* mb rows (1..6) by np panels (1; or 4 for one row, 2 for two rows) */
static inline void micro(int64_t mb, int64_t np, const float *x, int64_t K, const uint16_t *panel, float *acc,
                         const uint16_t *pf, int64_t ps) {
    if (np == 4) { micro_1_4(x, K, panel, K, acc, pf, ps); return; }
    if (np == 2) { micro_2_2(x, K, panel, K, acc, pf, ps); return; }
    switch (mb) {
        case 6: micro_6_1(x, K, panel, K, acc, pf, ps); break;
        case 5: micro_5_1(x, K, panel, K, acc, pf, ps); break;
        case 4: micro_4_1(x, K, panel, K, acc, pf, ps); break;
        case 3: micro_3_1(x, K, panel, K, acc, pf, ps); break;
        case 2: micro_2_1(x, K, panel, K, acc, pf, ps); break;
        default: micro_1_1(x, K, panel, K, acc, pf, ps); break;
    }
}

static inline float round_bf16(float v) { return bf16_to_f32(f32_to_bf16(v)); }

/* y[j] = bf16(silu(bf16(g[j])) * bf16(u[j])), j < n: torch's bf16 silu (computed in float32, rounded) and product */
static inline void silu_mul_tile(const float *g, const float *u, uint16_t *y, int64_t n) {
#pragma omp simd
    for (int64_t j = 0; j < n; j++) {
        const float gv = round_bf16(g[j]), uv = round_bf16(u[j]);
        /* where exp(-g) overflows, -ffast-math's g / inf is a NaN: silu is -0 there (torch's float32 silu is -0 from
         * g = -89, and below 1e-34 from -87.5, where the vectorised expf already gives -0) */
        const float silu = -gv < 88.7228f ? gv / (1.f + expf(-gv)) : -0.f;
        y[j] = f32_to_bf16(round_bf16(silu) * uv);
    }
}

/* y[o + j] = v[j] (+ bias[j]), or res[j] + bf16(v[j] (+ bias[j])) when res is given; float32 or bf16 */
static inline void store_tile(const float *v, const float *bias, const uint16_t *res, void *y, int y_bf16,
                              int64_t o, int64_t n) {
#pragma omp simd
    for (int64_t j = 0; j < n; j++) {
        float t = v[j] + (bias ? bias[j] : 0.f);
        if (res) t = bf16_to_f32(res[j]) + round_bf16(t);
        if (y_bf16) ((uint16_t *)y)[o + j] = f32_to_bf16(t);
        else ((float *)y)[o + j] = t;
    }
}

/* What the GEMM does with each tile of float32 sums: store it (+ bias); or, for a gate/up projection packed in
 * pairs of panels (gate columns 16p.., then up columns 16p..), write bf16 silu(gate) * up; or add the product to a
 * bf16 residual. Each step is rounded to bf16 where torch's separate ops would round it. */
enum { EPI_STORE = 0, EPI_SILU_MUL = 1, EPI_ADD = 2 };

/* Batches of bf16 rows on CPUs with AMX (gemm_run, from AMX_BF16_ROWS rows, K a multiple of 32): the packed panels
 * multiplied by the tile unit, so that large batches need no second, row-major copy of the weights for oneDNN. A: 16
 * rows of x by 32 k, read in place; B: one panel's 16 columns by 32 k, the tile unit's layout of k pairs made from
 * the panel (unpacking its rows 2r and 2r + 1 interleaves them: the middle quarters' swap puts columns in order), a
 * unit's tiles made once a call into a thread's buffer; C: 16 rows by 16 columns of float32 sums over all of K,
 * then the epilogue of the FMA path (store_tile, silu_mul_tile). Sums run in another order than the FMA path's. */
#ifdef WS_AMX
#define AMX_BF16_ROWS 17
#define AMX_UNITS 8 /* units (16 output columns) a task */
int qgemm_amx_on(void);

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} ws_tilecfg_t;

/* tiles [K / 32][16][32] bf16 of one panel (wp: [K][16], quarter-swapped) in the tile unit's pair layout */
static void amx_b_tiles(const uint16_t *wp, int64_t K, uint16_t *tiles) {
    for (int64_t r = 0; r < K / 2; r++) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(wp + 2 * r * 16));
        const __m256i b = _mm256_loadu_si256((const __m256i *)(wp + (2 * r + 1) * 16));
        uint16_t *row = tiles + (r / 16) * 512 + (r % 16) * 32;
        _mm256_storeu_si256((__m256i *)row, _mm256_unpacklo_epi16(a, b));
        _mm256_storeu_si256((__m256i *)(row + 16), _mm256_unpackhi_epi16(a, b));
    }
}

static int gemm_amx_bf16(const uint16_t *x, const uint16_t *wp, const float *bias, void *y, int y_bf16,
                         const uint16_t *res, int epi, int64_t M, int64_t K, int64_t N) {
    const int64_t per = epi == EPI_SILU_MUL ? 2 : 1, NB = (N + 15) / 16, units = NB / per, ldy = N / per;
    const int64_t kt = K / 32, mp = (M + 31) / 32; /* k tiles; pairs of 16-row blocks */
    /* x padded to whole pairs of 16-row blocks (zero rows) */
    uint16_t *xp = (uint16_t *)calloc((size_t)(mp * 32 * K), sizeof(uint16_t));
    if (!xp) return 0;
    memcpy(xp, x, (size_t)(M * K) * sizeof(uint16_t));
    ws_tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) cfg.rows[i] = 16, cfg.colsb[i] = 64; /* C 0-3, A 4-5, B 6-7: 16 x 64 bytes */
    /* a task: AMX_UNITS units (their B tiles made once, a few hundred KB that stay in L2), every pair of row
     * blocks against each of them in turn, so that a pair's A tiles are read from cache once per task rather than
     * once per unit */
    const int64_t tasks = (units + AMX_UNITS - 1) / AMX_UNITS, per_thread = AMX_UNITS * per * kt * 512;
    const int threads = omp_get_max_threads();
    /* every thread's B tiles, allocated here so that a failure falls back to the FMA path */
    uint16_t *all_bt = (uint16_t *)aligned_alloc(64, (size_t)(threads * per_thread) * sizeof(uint16_t));
    if (!all_bt) {
        free(xp);
        return 0;
    }
#pragma omp parallel num_threads(threads)
    {
        _tile_loadconfig(&cfg);
        uint16_t *bt = all_bt + omp_get_thread_num() * per_thread;
        float c[4][16][16] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t u0 = task * AMX_UNITS, nu = units - u0 < AMX_UNITS ? units - u0 : AMX_UNITS;
            for (int64_t p = 0; p < nu * per; p++) amx_b_tiles(wp + (u0 * per + p) * K * 16, K, bt + p * kt * 512);
            for (int64_t g = 0; g < mp; g++) /* rows 32 g .. 32 g + 31: C tile 2 p + h, rows 16 h .. */
                for (int64_t v = 0; v < nu; v++) {
                    const uint16_t *b = bt + v * per * kt * 512;
                    const int64_t n0 = (u0 + v) * 16, cols = ldy - n0 < 16 ? ldy - n0 : 16;
                    _tile_zero(0);
                    _tile_zero(1);
                    if (per == 2) {
                        _tile_zero(2);
                        _tile_zero(3);
                    }
                    const uint16_t *x0 = xp + 32 * g * K, *x1 = x0 + 16 * K;
                    for (int64_t t = 0; t < kt; t++) {
                        _tile_loadd(4, x0 + 32 * t, K * 2);
                        _tile_loadd(5, x1 + 32 * t, K * 2);
                        _tile_loadd(6, b + t * 512, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 5, 6);
                        if (per == 2) {
                            _tile_loadd(7, b + (kt + t) * 512, 64);
                            _tile_dpbf16ps(2, 4, 7);
                            _tile_dpbf16ps(3, 5, 7);
                        }
                    }
                    _tile_stored(0, c[0], 64);
                    _tile_stored(1, c[1], 64);
                    if (per == 2) {
                        _tile_stored(2, c[2], 64);
                        _tile_stored(3, c[3], 64);
                    }
                    for (int h = 0; h < 2; h++)
                        for (int64_t i = 0; i < 16; i++) {
                            const int64_t m = 32 * g + 16 * h + i, o = m * ldy + n0;
                            if (m >= M) break;
                            if (epi == EPI_SILU_MUL) silu_mul_tile(c[h][i], c[2 + h][i], (uint16_t *)y + o, cols);
                            else store_tile(c[h][i], bias ? bias + n0 : NULL, res ? res + o : NULL, y, y_bf16, o, cols);
                        }
                }
        }
        _tile_release();
    }
    free(all_bt);
    free(xp);
    return 1;
}

/* whether large bf16 batches take the tiles (the CPU has AMX, the OS grants it, and it is not turned off) */
int gemm_bf16_tiles(void) { return qgemm_amx_on(); }
#else
int gemm_bf16_tiles(void) { return 0; }
#endif

static void gemm_run(const void *x, int x_bf16, const uint16_t *wp, const float *bias, void *y, int y_bf16,
                     const uint16_t *res, int epi, int64_t M, int64_t K, int64_t N) {
#ifdef WS_AMX
    if (x_bf16 && M >= AMX_BF16_ROWS && K % 32 == 0 && qgemm_amx_on() &&
        gemm_amx_bf16((const uint16_t *)x, wp, bias, y, y_bf16, res, epi, M, K, N))
        return;
#endif
    const float *xf = (const float *)x;
    float *tmp = NULL;
    if (x_bf16) {
        tmp = (float *)malloc((size_t)(M * K) * sizeof(float));
#pragma omp parallel for schedule(static) if (M * K > 65536)
        for (int64_t i = 0; i < M * K; i++) tmp[i] = bf16_to_f32(((const uint16_t *)x)[i]);
        xf = tmp;
    }
    /* a unit is the panel (or pair of panels) behind 16 output columns; a group, the units of one micro-kernel call
     * (4 panels for one row, 2 for two rows, else 1) */
    const int64_t per = epi == EPI_SILU_MUL ? 2 : 1, NB = (N + 15) / 16, units = NB / per, ldy = N / per;
    const int64_t CHUNK = 48;
    const int64_t wide = M == 1 ? 4 : M == 2 ? 2 : 1, group = wide / per > 0 ? wide / per : 1;
    const int64_t groups = (units + group - 1) / group;
    for (int64_t c0 = 0; c0 < M; c0 += CHUNK) {
        const int64_t c1 = M - c0 < CHUNK ? M : c0 + CHUNK;
        /* decoding (one chunk): the micro-kernel calls on a group each prefetch a slice of the next group, one hint
         * per k, so the weights stream from memory evenly instead of in a burst at each panel's first call (10%
         * faster at 32 rows, 1.6x at 4; no gain for prefill, whose later chunks find the weights in cache). One row
         * reads 4 panels at once, which the hardware prefetcher streams well alone (the hints cost it 20%). */
        const int64_t calls = (c1 - c0 + 5) / 6 * (wide > 1 ? 1 : per);
        const int64_t slice = (group * per * K * 16 + calls - 1) / calls;
        const int64_t pfs = M <= CHUNK && M > 1 ? (slice + K - 1) / K : 0;
#pragma omp parallel for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t u0 = g * group, nu = units - u0 < group ? units - u0 : group;
            const uint16_t *panel = wp + u0 * per * K * 16;
            const uint16_t *next = g + 1 < groups && pfs ? panel + group * per * K * 16 : NULL;
            float acc[4 * 6 * 16];
            for (int64_t m0 = c0, call = 0; m0 < c1; m0 += 6) {
                const int64_t mb = c1 - m0 < 6 ? c1 - m0 : 6;
                const float *xm = xf + m0 * K;
                if (nu * per == wide && wide > 1) {  /* the whole group in one call */
                    micro(mb, wide, xm, K, panel, acc, next ? next + call * slice : panel, next ? pfs : 0);
                    call++;
                } else {  /* one panel a call (a short last group, or one panel per call) */
                    for (int64_t p = 0; p < nu * per; p++, call++)
                        micro(mb, 1, xm, K, panel + p * K * 16, acc + p * 6 * 16,
                              next ? next + call * slice : panel, next ? pfs : 0);
                }
                for (int64_t v = 0; v < nu; v++) {
                    const int64_t n0 = (u0 + v) * 16, cols = ldy - n0 < 16 ? ldy - n0 : 16;
                    const float *a = acc + v * per * 6 * 16;
                    for (int64_t i = 0; i < mb; i++) {
                        const int64_t o = (m0 + i) * ldy + n0;
                        if (epi == EPI_SILU_MUL) silu_mul_tile(a + i * 16, a + (6 + i) * 16, (uint16_t *)y + o, cols);
                        else store_tile(a + i * 16, bias ? bias + n0 : NULL, res ? res + o : NULL, y, y_bf16, o, cols);
                    }
                }
            }
        }
    }
    free(tmp);
}

/* y = x W^T (+ bias); x float32 or bf16 [M, K], W packed [N, K]; y float32 or bf16 (rounded to nearest even). */
void gemm_bf16_packed(const void *x, int x_bf16, const uint16_t *wp, const float *bias, void *y, int y_bf16,
                      int64_t M, int64_t K, int64_t N) {
    gemm_run(x, x_bf16, wp, bias, y, y_bf16, NULL, EPI_STORE, M, K, N);
}

/* float32 weights (--dtype float32, every batch): y[m, n] = sum_k x[m, k] W[n, k] (+ bias[n]), W row-major [N, K]
 * as loaded, read in place (no packed copy). PyTorch hands such shapes to MKL, whose small-batch float32 paths are
 * slow on AMD CPUs (5-10 GB/s of weights at one row where memory gives 15-20, and worse at 4 rows: 2 GB/s on a Zen 1
 * EPYC), and which gives a row other bits at 1-2 rows than at more. This kernel streams each group of F32_NR weight
 * rows from memory once per call, and multiplies it with F32_MB rows of x at a time while it stays in cache. Each
 * sum runs over k in 8 lanes (k mod 8), in order, then adds the lanes in a fixed tree and the K % 8 tail: a row's
 * result is the same whatever the batch. */
#define F32_NR 4 /* weight rows a call reads together */
#define F32_MB 2 /* x rows a call multiplies them with: 8 sums, 4 weights and x in 13 registers */
#ifdef WS_AVX2
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#define F32_DOTS(MB, NR)                                                                                          \
static inline void f32_dots_##MB##_##NR(const float *x, const float *w, int64_t K, float out[F32_MB][F32_NR]) {  \
    __m256 acc[MB][NR];                                                                                           \
    for (int i = 0; i < MB; i++)                                                                                  \
        for (int r = 0; r < NR; r++) acc[i][r] = _mm256_setzero_ps();                                            \
    const int64_t K8 = K & ~(int64_t)7;                                                                           \
    for (int64_t k = 0; k < K8; k += 8) {                                                                         \
        __m256 wv[NR];                                                                                            \
        for (int r = 0; r < NR; r++) wv[r] = _mm256_loadu_ps(w + r * K + k);                                     \
        for (int i = 0; i < MB; i++) {                                                                            \
            const __m256 xv = _mm256_loadu_ps(x + i * K + k);                                                     \
            for (int r = 0; r < NR; r++) acc[i][r] = _mm256_fmadd_ps(xv, wv[r], acc[i][r]);                      \
        }                                                                                                         \
    }                                                                                                             \
    for (int i = 0; i < MB; i++)                                                                                  \
        for (int r = 0; r < NR; r++) {                                                                            \
            float s = hsum8(acc[i][r]);                                                                           \
            for (int64_t k = K8; k < K; k++) s += x[i * K + k] * w[r * K + k];                                    \
            out[i][r] = s;                                                                                        \
        }                                                                                                         \
}
F32_DOTS(1, 4) F32_DOTS(2, 4) F32_DOTS(1, 1) F32_DOTS(2, 1)
#endif

/* out[i][r] = x row i . W row r, for mb (1..F32_MB) rows of x and nr (1..F32_NR) rows of W */
static void f32_dots(int64_t mb, int64_t nr, const float *x, const float *w, int64_t K, float out[F32_MB][F32_NR]) {
#ifdef WS_AVX2
    if (nr == F32_NR) {
        if (mb == 2) f32_dots_2_4(x, w, K, out);
        else f32_dots_1_4(x, w, K, out);
        return;
    }
    float one[F32_MB][F32_NR];
    for (int64_t r = 0; r < nr; r++) { /* a short last group of weight rows: one at a time, the same sums */
        if (mb == 2) f32_dots_2_1(x, w + r * K, K, one);
        else f32_dots_1_1(x, w + r * K, K, one);
        for (int64_t i = 0; i < mb; i++) out[i][r] = one[i][0];
    }
#else
    for (int64_t i = 0; i < mb; i++)
        for (int64_t r = 0; r < nr; r++) {
            float lanes[8] = {0};
            const int64_t K8 = K & ~(int64_t)7;
            for (int64_t k = 0; k < K8; k += 8)
                for (int j = 0; j < 8; j++) lanes[j] += x[i * K + k + j] * w[r * K + k + j];
            float s = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
            for (int64_t k = K8; k < K; k++) s += x[i * K + k] * w[r * K + k];
            out[i][r] = s;
        }
#endif
}

/* y [M, N] float32 = x [M, K] W^T (+ bias) for float32 W [N, K], row-major. */
void gemm_f32(const float *x, const float *w, const float *bias, float *y, int64_t M, int64_t K, int64_t N) {
    const int64_t groups = (N + F32_NR - 1) / F32_NR;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t n0 = g * F32_NR, nr = N - n0 < F32_NR ? N - n0 : F32_NR;
        float out[F32_MB][F32_NR];
        for (int64_t m0 = 0; m0 < M; m0 += F32_MB) {
            const int64_t mb = M - m0 < F32_MB ? M - m0 : F32_MB;
            f32_dots(mb, nr, x + m0 * K, w + n0 * K, K, out);
            for (int64_t i = 0; i < mb; i++)
                for (int64_t r = 0; r < nr; r++) y[(m0 + i) * N + n0 + r] = out[i][r] + (bias ? bias[n0 + r] : 0.f);
        }
    }
}

/* y = silu(x G^T) * (x U^T) in bf16, [M, N / 2], from the gate and up weights packed in pairs of panels
 * (waferscale.kernels.pack_bf16_pairs): a Llama MLP's first half in one pass, as torch's bf16 ops round it. */
void gemm_bf16_silu_mul(const void *x, int x_bf16, const uint16_t *wp, uint16_t *y, int64_t M, int64_t K,
                        int64_t N) {
    gemm_run(x, x_bf16, wp, NULL, y, 1, NULL, EPI_SILU_MUL, M, K, N);
}

/* y = residual + (x W^T (+ bias)) in bf16, [M, N]: a projection and the residual add after it. */
void gemm_bf16_add(const void *x, int x_bf16, const uint16_t *wp, const float *bias, const uint16_t *residual,
                   uint16_t *y, int64_t M, int64_t K, int64_t N) {
    gemm_run(x, x_bf16, wp, bias, y, 1, residual, EPI_ADD, M, K, N);
}

/* RMSNorm of one bfloat16 row of D values, r = 1 / sqrt(mean(x^2) + eps) in float32: Llama's (kind NORM_LLAMA, w
 * bf16: y = bf16(w * bf16(x r)), Hugging Face's LlamaRMSNorm) or Gemma's (NORM_GEMMA, w float32 holding 1 + weight:
 * y = bf16(x r w), Gemma3RMSNorm). One out-of-line function serves the modules' calls and decode_layer's, so both
 * sum and round alike. y may be x. */
enum { NORM_LLAMA = 0, NORM_GEMMA = 1 };

__attribute__((noinline)) static void norm_row(const uint16_t *x, const void *w, int kind, uint16_t *y, int64_t D,
                                               float eps) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t d = 0; d < D; d++) {
        const float v = bf16_to_f32(x[d]);
        ss += v * v;
    }
    const float r = 1.f / sqrtf(ss / (float)D + eps);
    if (kind == NORM_GEMMA) {
        const float *wf = (const float *)w;
        for (int64_t d = 0; d < D; d++) y[d] = f32_to_bf16(bf16_to_f32(x[d]) * r * wf[d]);
        return;
    }
    const uint16_t *wb = (const uint16_t *)w;
    for (int64_t d = 0; d < D; d++) {
        const float h = bf16_to_f32(f32_to_bf16(bf16_to_f32(x[d]) * r));
        y[d] = f32_to_bf16(bf16_to_f32(wb[d]) * h);
    }
}

static void norm_rows(const uint16_t *x, const void *w, int kind, uint16_t *y, int64_t M, int64_t D, float eps) {
#pragma omp parallel for schedule(static) if (M > 8)
    for (int64_t m = 0; m < M; m++) norm_row(x + m * D, w, kind, y + m * D, D, eps);
}

/* Hugging Face's LlamaRMSNorm on bfloat16 rows x, y [M, D], bf16 weight w [D] (norm_row's NORM_LLAMA). */
void rmsnorm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t M, int64_t D, float eps) {
    norm_rows(x, w, NORM_LLAMA, y, M, D, eps);
}

/* Gemma 3's RMSNorm on bfloat16 rows x, y [M, D]; w1: float32 [D], 1 + the weight (norm_row's NORM_GEMMA). */
void rmsnorm_gemma_bf16(const uint16_t *x, const float *w1, uint16_t *y, int64_t M, int64_t D, float eps) {
    norm_rows(x, w1, NORM_GEMMA, y, M, D, eps);
}

/* y [M, I] = bf16(bf16(silu(gate)) * up) for gu [M, 2 I] bf16, gate columns first then up: a quantized gate/up's
 * SiLU middle (silu_mul_tile's rounding), one function for the modules' call and decode_layer's. */
static inline void silu_mul_chunk(const uint16_t *gu, uint16_t *y, int64_t I, int64_t m, int64_t j0) {
    float g[256], u[256];
    const int64_t n = I - j0 < 256 ? I - j0 : 256;
    for (int64_t j = 0; j < n; j++) {
        g[j] = bf16_to_f32(gu[m * 2 * I + j0 + j]);
        u[j] = bf16_to_f32(gu[m * 2 * I + I + j0 + j]);
    }
    silu_mul_tile(g, u, y + m * I + j0, n);
}

void silu_mul_bf16(const uint16_t *gu, uint16_t *y, int64_t M, int64_t I) {
#pragma omp parallel for schedule(static) if (M > 8)
    for (int64_t m = 0; m < M; m++)
        for (int64_t j0 = 0; j0 < I; j0 += 256) silu_mul_chunk(gu, y, I, m, j0);
}

/* y [M, I] = bf16((min(up, limit) clamped below at -limit, + 1) * g * sigmoid(alpha g)) with g = min(gate, limit),
 * in float32 and rounded once, for gu [M, 2 I] bf16, gate columns first then up: gpt-oss's clamped SwiGLU, one
 * function for the experts' modules and moe_experts_bf16. */
static inline void swiglu_chunk(const uint16_t *gu, uint16_t *y, int64_t I, int64_t m, int64_t j0, float alpha,
                                float limit) {
    const int64_t n = I - j0 < 256 ? I - j0 : 256;
    const uint16_t *g = gu + m * 2 * I + j0, *u = g + I;
    for (int64_t j = 0; j < n; j++) {
        const float gv = fminf(bf16_to_f32(g[j]), limit), uv = fminf(fmaxf(bf16_to_f32(u[j]), -limit), limit);
        /* -0 where exp(-alpha g) overflows (-ffast-math's g / inf is a NaN), as silu_mul_tile */
        const float glu = -alpha * gv < 88.7228f ? gv / (1.f + expf(-alpha * gv)) : -0.f;
        y[m * I + j0 + j] = f32_to_bf16((uv + 1.f) * glu);
    }
}

void swiglu_clamped_bf16(const uint16_t *gu, uint16_t *y, int64_t M, int64_t I, float alpha, float limit) {
#pragma omp parallel for schedule(static) if (M > 8)
    for (int64_t m = 0; m < M; m++)
        for (int64_t j0 = 0; j0 < I; j0 += 256) swiglu_chunk(gu, y, I, m, j0, alpha, limit);
}

/* A mixture of experts' gated activation (moe_t's act, alpha, limit): SiLU times up, or the clamped SwiGLU */
enum { MOE_ACT_SILU = 0, MOE_ACT_SWIGLU_CLAMPED = 1 };
typedef struct {
    int64_t kind;
    float alpha, limit;
} moe_act_t;

/* act_chunk: one row's 256 columns of the experts' activation, as silu_mul_bf16 or swiglu_clamped_bf16 rounds it */
static inline void act_chunk(const moe_act_t *a, const uint16_t *gu, uint16_t *y, int64_t I, int64_t m, int64_t j0) {
    if (a->kind == MOE_ACT_SWIGLU_CLAMPED) swiglu_chunk(gu, y, I, m, j0, a->alpha, a->limit);
    else silu_mul_chunk(gu, y, I, m, j0);
}

/* tanh-GELU: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), as torch's gelu(approximate="tanh") in float32 */
static inline float gelu_tanh(float x) {
    const float inner = 0.7978845608028654f * (x + 0.044715f * (x * x * x));
    return 0.5f * x * (1.f + tanhf(inner));
}

/* y [M, I] = bf16(bf16(gelu(gate)) * up) for gu [M, 2 I] bf16, gate columns first then up: Gemma's gated MLP
 * middle, rounded as torch's bf16 ops round it (the modules' call and decode_layer's). */
void gelu_mul_bf16(const uint16_t *gu, uint16_t *y, int64_t M, int64_t I) {
#pragma omp parallel for schedule(static) if (M > 8)
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *g = gu + m * 2 * I, *u = g + I;
        for (int64_t j = 0; j < I; j++)
            y[m * I + j] = f32_to_bf16(round_bf16(gelu_tanh(bf16_to_f32(g[j]))) * bf16_to_f32(u[j]));
    }
}

/* What a layer adds to Llama's for decode_layer (NULL: nothing): the kind of all its norms (norm_row); per-head
 * norms of q and k before rope; norms of the attention's and the MLP's outputs before their residual adds (Gemma's
 * sandwich); the MLP's activation; a mixture of experts in place of the MLP; gpt-oss's sink logit per head (float32
 * [H], joining each softmax's denominator) and the output projection's bias (float32 [E]). */
enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };
typedef struct {
    int64_t norm_kind;
    const void *q_norm, *k_norm;     /* [D] each, or NULL */
    const void *post_attn, *post_ff; /* [E] each, or NULL */
    int64_t act;
    const void *moe; /* a moe_t: the layer's feed-forward is a mixture of experts (gate_up, down unused); or NULL */
    const float *sinks, *o_bias; /* or NULL */
} layer_ext_t;

/* decode_attention_bf16 below, with the per-head q and k norms of ext (may be NULL) before rope and each row's
 * first visible position starts[b] (a sliding window; NULL: 0). */
static void decode_attention_run(const uint16_t *qkv, const layer_ext_t *ext, float eps, const uint16_t *cos,
                                 const uint16_t *sin, void *k_cache, void *v_cache, int fmt, float *k_scale,
                                 float *v_scale, const int64_t *slots, const int64_t *tables, const int64_t *starts,
                                 const int64_t *lengths, uint16_t *out, int64_t B, int64_t H, int64_t KVH, int64_t D,
                                 int64_t W, int64_t block_size, float scale) {
    const int64_t width = (H + 2 * KVH) * D, half = D / 2, row_len = KVH * D;
    float *q = (float *)malloc((size_t)(B * H * D) * sizeof(float));
    float *o = (float *)malloc((size_t)(B * H * D) * sizeof(float));
    const void *q_norm = ext ? ext->q_norm : NULL, *k_norm = ext ? ext->k_norm : NULL;
    const int kind = ext ? (int)ext->norm_kind : NORM_LLAMA;
#pragma omp parallel for schedule(static) if (B > 1)
    for (int64_t b = 0; b < B; b++) {
        const uint16_t *src = qkv + b * width, *cb = cos + b * D, *sb = sin + b * D;
        /* rope over the H query heads and the KVH key heads, which lie next to each other in qkv */
        for (int64_t h = 0; h < H + KVH; h++) {
            const uint16_t *x = src + h * D;
            const void *nw = h < H ? q_norm : k_norm;
            uint16_t normed[512];
            if (nw) {
                norm_row(x, nw, kind, normed, D, eps);
                x = normed;
            }
            float roped[512];
            for (int64_t d = 0; d < D; d++) {
                const float xd = bf16_to_f32(x[d]);
                const float rot = d < half ? -bf16_to_f32(x[d + half]) : bf16_to_f32(x[d - half]);
                const float a = bf16_to_f32(f32_to_bf16(xd * bf16_to_f32(cb[d])));
                const float r = bf16_to_f32(f32_to_bf16(rot * bf16_to_f32(sb[d])));
                roped[d] = bf16_to_f32(f32_to_bf16(a + r));
            }
            if (h < H)
                memcpy(q + (b * H + h) * D, roped, (size_t)D * sizeof(float));
            else
                store_head(k_cache, k_scale, fmt, slots[b], KVH, h - H, D, roped);
        }
        const uint16_t *v = src + (H + KVH) * D;
        if (fmt == KV_BF16) {
            memcpy((uint16_t *)v_cache + slots[b] * row_len, v, (size_t)row_len * sizeof(uint16_t));
        } else {
            float vf[512];
            for (int64_t h = 0; h < KVH; h++) {
                for (int64_t d = 0; d < D; d++) vf[d] = bf16_to_f32(v[h * D + d]);
                store_head(v_cache, v_scale, fmt, slots[b], KVH, h, D, vf);
            }
        }
    }
    paged_decode_attention_ex(q, k_cache, v_cache, fmt, k_scale, v_scale, tables, starts, lengths,
                              ext ? ext->sinks : NULL, o, B, H, KVH, D, W, block_size, scale);
    for (int64_t i = 0; i < B * H * D; i++) out[i] = f32_to_bf16(o[i]);
    free(q);
    free(o);
}

/* One decode step of a layer's attention for B sequences, from the qkv projection to the attention output, all
 * in one call: rope on q and k (Hugging Face's rotate-half form, each bf16 op rounded as torch rounds it), the new
 * key and value written to their pool slots, then paged_decode_attention's computation; output rounded to bf16.
 * qkv: bfloat16 [B, (H + 2 KVH) D]; cos, sin: bfloat16 [B, D] (each row's position); slots: int64 [B];
 * out: bfloat16 [B, H D]. */
void decode_attention_bf16(const uint16_t *qkv, const uint16_t *cos, const uint16_t *sin, void *k_cache,
                           void *v_cache, int fmt, float *k_scale, float *v_scale, const int64_t *slots,
                           const int64_t *tables, const int64_t *lengths, uint16_t *out, int64_t B, int64_t H,
                           int64_t KVH, int64_t D, int64_t W, int64_t block_size, float scale) {
    decode_attention_run(qkv, NULL, 0.f, cos, sin, k_cache, v_cache, fmt, k_scale, v_scale, slots, tables, NULL,
                         lengths, out, B, H, KVH, D, W, block_size, scale);
}

/* quant_kernels.c's GEMM over quantized weights */
void qgemm(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, int bits, int sgn, int64_t G,
           const void *scales, const void *mins, const float *sup, const float *supm, int sfmt, const float *bias,
           const uint16_t *res, void *out, int out_bf16, int64_t ldo, int64_t N, int act);
void qgemm_rows(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, int bits, int sgn, int64_t G,
                const void *scales_v, const void *mins_v, const float *sup, const float *supm, int sfmt,
                const float *bias, void *out, int out_bf16, int64_t ldo, int64_t n0, int64_t N, int act);
int qgemm_set_rows_exact(int on);
int qgemm_rows_exact(void);
void mxfp4_gemm(const void *x, int x_bf16, int64_t m, int64_t k, const uint8_t *q, const uint8_t *e, int64_t n,
                int interleaved, int int8_act, const float *bias, const uint16_t *res, void *out, int out_bf16,
                int64_t ldo);
#define SC_MXFP4 3 /* a qpart_t's sfmt for MXFP4 blocks (mxfp4_kernels.c: e8m0 scales) */

/* One of a layer's projections for decode_layer: bf16 weights packed as for the GEMMs above (packed; gate/up in
 * pairs of panels), or else quantized parts stacked along N (quant_kernels.c's layouts: models/quant/'s
 * QuantWeight; MXFP4 parts, sfmt SC_MXFP4, by mxfp4_gemm), multiplied as QuantLinear calls them (act as it passes);
 * bias: float32 [N] or NULL, added before the rounding to bf16 (experts' biases; decode_layer passes qkv's apart). */
typedef struct {
    const uint8_t *w;
    const void *scales, *mins;
    const float *sup, *supm; /* K-quants: scales and mins as bytes times these (see qgemm) */
    int64_t bits, sgn, group, rows, sfmt;
    int64_t interleaved; /* MXFP4: the checkpoints' nibble order (mxfp4_gemm's interleaved) */
} qpart_t;
typedef struct {
    const uint16_t *packed;
    const qpart_t *parts;
    int64_t nparts, act;
    const float *bias;
} proj_t;

/* y [:, 0:n] (row stride ldy) = x W[r0:r0 + n]^T (+ bias[0:n]) (+ res) for rows of one quantized part (q), by the
 * part's kernel: qgemm_rows (a slice's values are the whole call's), or mxfp4_gemm for MXFP4 blocks. */
static void part_rows(const qpart_t *q, const uint16_t *x, int64_t M, int64_t K, int64_t r0, int64_t n,
                      const float *bias, const uint16_t *res, void *y, int y_bf16, int64_t ldy, int act) {
    if (q->sfmt == SC_MXFP4)
        mxfp4_gemm(x, 1, M, K, q->w + r0 * (K / 2), (const uint8_t *)q->scales + r0 * (K / 32), n,
                   (int)q->interleaved, act != 0 /* not float32 */, bias, res, y, y_bf16, ldy);
    else if (!r0 && n == q->rows)
        qgemm(x, 1, M, K, q->w, (int)q->bits, (int)q->sgn, q->group, q->scales, q->mins, q->sup, q->supm,
              (int)q->sfmt, bias, res, y, y_bf16, ldy, n, act);
    else /* a slice: no residual (moe_experts_few's) */
        qgemm_rows(x, 1, M, K, q->w, (int)q->bits, (int)q->sgn, q->group, q->scales, q->mins, q->sup, q->supm,
                   (int)q->sfmt, bias, y, y_bf16, ldy, r0, n, act);
}

/* y [M, N] = x W^T (+ bias) (+ res, which may be y itself), bf16, or float32 (y_bf16 = 0, quantized parts only) */
static void proj_run(const proj_t *p, const uint16_t *x, int64_t M, int64_t K, int64_t N, const float *bias,
                     const uint16_t *res, void *y, int y_bf16) {
    if (!bias) bias = p->bias;
    if (p->packed) {
        gemm_run(x, 1, p->packed, bias, y, y_bf16, res, res ? EPI_ADD : EPI_STORE, M, K, N);
        return;
    }
    for (int64_t i = 0, col = 0; i < p->nparts; col += p->parts[i].rows, i++) {
        const qpart_t *q = p->parts + i;
        void *yc = y_bf16 ? (void *)((uint16_t *)y + col) : (void *)((float *)y + col);
        part_rows(q, x, M, K, 0, q->rows, bias ? bias + col : NULL, res ? res + col : NULL, yc, y_bf16, N,
                  (int)p->act);
    }
}

/* A mixture-of-experts feed-forward as moe_forward_bf16 reads it: the router (a projection, and its float32 bias
 * or NULL), each expert's projections (as moe_experts_bf16 reads them), the routing (order MOE_SOFTMAX_TOPK: softmax
 * over the experts, then the k largest, divided by their sum where renormalize; MOE_TOPK_SOFTMAX: the k largest
 * logits, then softmax over them), load: int64 [num_experts], the rows routed to each expert, added to, and the
 * experts' activation. */
enum { MOE_SOFTMAX_TOPK = 0, MOE_TOPK_SOFTMAX = 1 };
typedef struct {
    const proj_t *router;
    const float *router_bias;
    const proj_t *gate_up, *down;
    int64_t num_experts, top_k, order, renormalize, inter;
    int64_t *load;
    moe_act_t act;
} moe_t;

void moe_forward_bf16(const uint16_t *x, int64_t M, int64_t E, const moe_t *moe, uint16_t *h);

/* h[i] = bf16(h[i] + norm(y[i])) for bf16 rows h, y [M, E]: a Gemma sandwich norm's output and its residual add,
 * as torch's ops round them (y is normalised in place). */
static void add_normed(uint16_t *h, uint16_t *y, const void *w, int kind, int64_t M, int64_t E, float eps) {
    norm_rows(y, w, kind, y, M, E, eps);
    for (int64_t i = 0; i < M * E; i++) h[i] = f32_to_bf16(bf16_to_f32(h[i]) + bf16_to_f32(y[i]));
}

/* h += down(act(gate(x)) * up(x)) for decode_layer (x [M, E], the normed rows; act [M, I], scratch), with Gemma's
 * norm of the output before the residual add where ext has it: x is overwritten. */
static void dense_mlp(uint16_t *h, uint16_t *x, uint16_t *act, const proj_t *gate_up_w, const proj_t *down_w,
                      int64_t M, int64_t E, int64_t I, const layer_ext_t *ext, int kind, float eps) {
    if (ext && ext->act == ACT_GELU_TANH) { /* gate/up in bf16 as the projection gives them, then gelu_mul_bf16 */
        uint16_t *gu = (uint16_t *)malloc((size_t)(M * 2 * I) * sizeof(uint16_t));
        proj_run(gate_up_w, x, M, E, 2 * I, NULL, NULL, gu, 1);
        gelu_mul_bf16(gu, act, M, I);
        free(gu);
    } else if (gate_up_w->packed) {
        gemm_run(x, 1, gate_up_w->packed, NULL, act, 1, NULL, EPI_SILU_MUL, M, E, 2 * I);
    } else { /* quantized: gate/up in bf16 as the projection gives them, then silu_mul_bf16 (as the modules) */
        uint16_t *gu = (uint16_t *)malloc((size_t)(M * 2 * I) * sizeof(uint16_t));
        proj_run(gate_up_w, x, M, E, 2 * I, NULL, NULL, gu, 1);
        silu_mul_bf16(gu, act, M, I);
        free(gu);
    }
    if (ext && ext->post_ff) {
        proj_run(down_w, act, M, I, E, NULL, NULL, x, 1);
        add_normed(h, x, ext->post_ff, kind, M, E, eps);
    } else {
        proj_run(down_w, act, M, I, E, NULL, h, h, 1);
    }
}

/* One decoder layer for decode rows only (row b: one sequence's next token), in place on the bf16 hidden states
 * h [M, E]. Llama's (ext NULL): h += o(attention(rope(qkv(norm1(h))))), then h += down(silu(gate(x)) * up(x))
 * with x = norm2(h). ext adds what Qwen3 and Gemma 3 have (layer_ext_t): q/k norms before rope, a norm on each
 * branch's output before its residual add, tanh-GELU, Gemma's norms, or a mixture of experts in place of the MLP
 * (moe_forward_bf16: gate_up_w, I and down_w unused); starts: each row's first visible position
 * (a sliding window; NULL: none). The same kernels, in the same order, as the layer's modules call one by one
 * (bit-identical), in one call: for a few rows, Python's per-module overhead is much of a step. Projections as
 * proj_t above (a quantized gate/up: gate rows first, then silu * up as torch's bf16 ops round it); qkv_bias
 * float32 or NULL; norms as norm_row takes them; caches and the attention arguments as decode_attention_bf16. */
void decode_layer(uint16_t *h, int64_t M, int64_t E, const void *norm1, const proj_t *qkv_w, const float *qkv_bias,
                  const proj_t *o_w, const void *norm2, const proj_t *gate_up_w, int64_t I, const proj_t *down_w,
                  float eps, const uint16_t *cos, const uint16_t *sin, void *k_cache, void *v_cache, int fmt,
                  float *k_scale, float *v_scale, const int64_t *slots, const int64_t *tables, const int64_t *lengths,
                  int64_t H, int64_t KVH, int64_t D, int64_t W, int64_t block_size, float scale,
                  const layer_ext_t *ext, const int64_t *starts) {
    const int64_t QKV = (H + 2 * KVH) * D;
    const int kind = ext ? (int)ext->norm_kind : NORM_LLAMA;
    uint16_t *x = (uint16_t *)malloc((size_t)(M * E) * sizeof(uint16_t));
    uint16_t *qkv = (uint16_t *)malloc((size_t)(M * QKV) * sizeof(uint16_t));
    uint16_t *att = (uint16_t *)malloc((size_t)(M * H * D) * sizeof(uint16_t));
    uint16_t *act = (uint16_t *)malloc((size_t)(M * I) * sizeof(uint16_t));
    norm_rows(h, norm1, kind, x, M, E, eps);
    proj_run(qkv_w, x, M, E, QKV, qkv_bias, NULL, qkv, 1);
    decode_attention_run(qkv, ext, eps, cos, sin, k_cache, v_cache, fmt, k_scale, v_scale, slots, tables, starts,
                         lengths, att, M, H, KVH, D, W, block_size, scale);
    const float *o_bias = ext ? ext->o_bias : NULL;
    if (ext && ext->post_attn) { /* h + norm(o(att)): o's output rounded to bf16, normalised, then added */
        proj_run(o_w, att, M, H * D, E, o_bias, NULL, x, 1);
        add_normed(h, x, ext->post_attn, kind, M, E, eps);
    } else {
        proj_run(o_w, att, M, H * D, E, o_bias, h, h, 1); /* each output reads its residual, then writes it */
    }
    norm_rows(h, norm2, kind, x, M, E, eps);
    if (ext && ext->moe)
        moe_forward_bf16(x, M, E, (const moe_t *)ext->moe, h);
    else
        dense_mlp(h, x, act, gate_up_w, down_w, M, E, I, ext, kind, eps);
    free(x);
    free(qkv);
    free(att);
    free(act);
}

/* decode_layer's arguments of one layer that hold from step to step: its weights, heads and KV caches */
typedef struct {
    const void *norm1;
    const proj_t *qkv_w;
    const float *qkv_bias;
    const proj_t *o_w;
    const void *norm2;
    const proj_t *gate_up_w;
    const proj_t *down_w;
    const layer_ext_t *ext;
    void *k_cache, *v_cache;
    float *k_scale, *v_scale;
    int64_t I, H, KVH, D, fmt;
    float eps, scale;
} layer_call_t;

/* a layer's arguments that change from step to step, int64 each: its rope rows, its KV group's slots, block tables
 * (and their width) and lengths, and its window's first positions (0: no window) */
enum { STEP_COS, STEP_SIN, STEP_SLOTS, STEP_TABLES, STEP_LENGTHS, STEP_WIDTH, STEP_STARTS, STEP_FIELDS };

/* Every decoder layer of a decode step, one after the other, in place on h: decode_layer for layers[l] with
 * step[l * STEP_FIELDS ..]'s arguments (one call from Python for the whole model, not one a layer) */
void decode_layers(uint16_t *h, int64_t M, int64_t E, int64_t L, const layer_call_t *layers, const int64_t *step,
                   int64_t block_size) {
    for (int64_t l = 0; l < L; l++) {
        const layer_call_t *c = layers + l;
        const int64_t *s = step + l * STEP_FIELDS;
        decode_layer(h, M, E, c->norm1, c->qkv_w, c->qkv_bias, c->o_w, c->norm2, c->gate_up_w, c->I, c->down_w,
                     c->eps, (const uint16_t *)(intptr_t)s[STEP_COS], (const uint16_t *)(intptr_t)s[STEP_SIN],
                     c->k_cache, c->v_cache, (int)c->fmt, c->k_scale, c->v_scale,
                     (const int64_t *)(intptr_t)s[STEP_SLOTS], (const int64_t *)(intptr_t)s[STEP_TABLES],
                     (const int64_t *)(intptr_t)s[STEP_LENGTHS], c->H, c->KVH, c->D, s[STEP_WIDTH], block_size,
                     c->scale, c->ext, (const int64_t *)(intptr_t)s[STEP_STARTS]);
    }
}

/* Per row of float32 logits x [B, V]: idx[b], the first index of the row's maximum (torch.argmax's tie rule), and
 * lse[b] = max + log(sum exp(x - max)) as torch.logsumexp computes it: -inf for a row of -inf, +inf for a row
 * with +inf, NaN for a row with NaN. Special values are tested on the bits: -ffast-math assumes they never occur. */
void argmax_logsumexp(const float *x, int64_t B, int64_t V, int64_t *idx, float *lse) {
#pragma omp parallel for schedule(static) if (B > 1)
    for (int64_t b = 0; b < B; b++) {
        const float *r = x + b * V;
        const uint32_t *u = (const uint32_t *)r;
        float m = r[0];
        uint32_t nan = 0;
        for (int64_t v = 0; v < V; v++) {
            m = r[v] > m ? r[v] : m;
            nan |= (u[v] & 0x7fffffffu) > 0x7f800000u;
        }
        const uint32_t mb = f32_bits(m);
        int64_t at = 0;
        if (nan) {  /* torch.argmax points at a NaN */
            while ((u[at] & 0x7fffffffu) <= 0x7f800000u) at++;
            idx[b] = at;
            lse[b] = bits_f32(0x7fc00000u);
            continue;
        }
        while (!(r[at] == m)) at++;
        idx[b] = at;
        if (mb == 0xff800000u || mb == 0x7f800000u) {  /* all -inf, or a +inf: the sum is exp(max) itself */
            lse[b] = m;
            continue;
        }
        float s = 0.f;
        /* exp of a difference below -87 is below float32's smallest normal and cannot change a sum that holds
         * exp(0) = 1; clamping it keeps the vector expf off its slow path for huge and infinite arguments (a
         * grammar-masked row is mostly -inf: 10x slower unclamped) */
#pragma omp simd reduction(+ : s)
        for (int64_t v = 0; v < V; v++) {
            const float d = r[v] - m;
            s += (f32_bits(r[v]) == 0xff800000u) ? 0.f : expf(d < -87.f ? -87.f : d);
        }
        lse[b] = m + logf(s);
    }
}

/* Per row b of float32 logits x [B, V] and its allowed-token bitmask [B, W] (bit j of word w: token 32 w + j, as
 * llguidance fills it): the first index of the largest allowed value, as torch.argmax over the row with every other
 * token at -inf; -1 where no allowed token is above -inf (the grammar allows nothing the row can take). Rows carry
 * no NaN here (the caller has failed those). Whole words of allowed tokens take a plain maximum (vectorized); mixed
 * words go bit by bit. */
void masked_argmax(const float *x, int64_t B, int64_t V, const uint32_t *mask, int64_t W, int64_t *idx) {
#pragma omp parallel for schedule(static) if (B > 1)
    for (int64_t b = 0; b < B; b++) {
        const float *r = x + b * V;
        const uint32_t *mw = mask + b * W;
        const int64_t full = V / 32; /* words whose 32 tokens are all in the vocabulary */
        float m = -INFINITY;
        for (int64_t w = 0; w < W; w++) {
            uint32_t bits = mw[w];
            if (!bits) continue;
            const float *p = r + w * 32;
            if (bits == 0xffffffffu && w < full) {
                float wm = -INFINITY;
#pragma omp simd reduction(max : wm)
                for (int j = 0; j < 32; j++) wm = p[j] > wm ? p[j] : wm;
                m = wm > m ? wm : m;
                continue;
            }
            while (bits) {
                const int j = __builtin_ctz(bits);
                bits &= bits - 1;
                if (w * 32 + j >= V) break;
                m = p[j] > m ? p[j] : m;
            }
        }
        int64_t at = -1;
        uint32_t mbits; /* m above -inf, compared as bits: -ffast-math lets a compiler fold m > -INFINITY to true */
        memcpy(&mbits, &m, sizeof mbits);
        if (mbits != 0xff800000u) {
            for (int64_t w = 0; w < W && at < 0; w++) {
                uint32_t bits = mw[w];
                while (bits) {
                    const int j = __builtin_ctz(bits);
                    bits &= bits - 1;
                    if (w * 32 + j >= V) break;
                    if (r[w * 32 + j] == m) {
                        at = w * 32 + j;
                        break;
                    }
                }
            }
        }
        idx[b] = at;
    }
}

/* y[:, r0:r1] (row stride ldy, bf16) = x W[r0:r1]^T (+ its bias) for rows [r0, r1) of a projection's quantized
 * parts stacked along N, by part_rows on each part's slice (the whole call's values). Called inside a parallel
 * region, where qgemm's own loops run on the calling thread. */
static void proj_rows(const proj_t *p, const uint16_t *x, int64_t M, int64_t K, int64_t r0, int64_t r1, uint16_t *y,
                      int64_t ldy) {
    for (int64_t i = 0, base = 0; i < p->nparts; base += p->parts[i].rows, i++) {
        const qpart_t *q = p->parts + i;
        const int64_t a = r0 > base ? r0 : base, b = r1 < base + q->rows ? r1 : base + q->rows;
        if (a < b)
            part_rows(q, x, M, K, a - base, b - a, p->bias ? p->bias + a : NULL, NULL, y + a, 1, ldy, (int)p->act);
    }
}

/* thread t's share of n outputs among T: [share(t), share(t + 1)), in multiples of 16 */
static inline int64_t share(int64_t n, int t, int T) { return t >= T ? n : (n * t / T) & ~(int64_t)15; }

/* moe_experts_bf16 for a step whose experts all have quantized weights and a few rows each (decoding): every
 * expert's projections in one parallel region, each thread taking its share of every expert's outputs (gate/up
 * rows, then SiLU chunks, then down columns and their sums), instead of one parallel GEMM an expert: a decode step's
 * experts are a few MB each, too little to amortise a parallel region apiece. The same values as the per-expert
 * calls (a slice of qgemm's rows, silu_mul_bf16's chunks, the sums in expert order), a step verifying drafts
 * included: the calling thread's qgemm_set_rows_exact setting holds on every thread of the region. */
static void moe_experts_few(const uint16_t *xs, const int64_t *tokens, const uint16_t *w, const int64_t *counts,
                            const proj_t *gate_up, const proj_t *down, int64_t num_experts, int64_t E, int64_t I,
                            const moe_act_t *a, float *out) {
    int64_t S = 0;
    for (int64_t e = 0; e < num_experts; e++) S += counts[e];
    uint16_t *gu = (uint16_t *)malloc((size_t)(S * 2 * I) * sizeof(uint16_t));
    uint16_t *act = (uint16_t *)malloc((size_t)(S * I) * sizeof(uint16_t));
    uint16_t *y = (uint16_t *)malloc((size_t)(S * E) * sizeof(uint16_t));
    const int64_t chunks = (I + 255) / 256;
    const int exact = qgemm_rows_exact(); /* a step verifying drafts: its setting for every thread of the team */
#pragma omp parallel
    {
        const int was = qgemm_set_rows_exact(exact);
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t g0 = share(2 * I, t, T), g1 = share(2 * I, t + 1, T);
        for (int64_t e = 0, s = 0; e < num_experts; s += counts[e], e++)
            if (counts[e]) proj_rows(gate_up + e, xs + s * E, counts[e], E, g0, g1, gu + s * 2 * I, 2 * I);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t task = 0; task < S * chunks; task++)
            act_chunk(a, gu, act, I, task / chunks, task % chunks * 256);
        const int64_t d0 = share(E, t, T), d1 = share(E, t + 1, T);
        for (int64_t e = 0, s = 0; e < num_experts; s += counts[e], e++)
            if (counts[e]) proj_rows(down + e, act + s * I, counts[e], I, d0, d1, y + s * E, E);
        for (int64_t s = 0; s < S; s++) { /* experts in id order, as moe_experts_bf16 adds them */
            float *o = out + tokens[s] * E;
            const float wv = bf16_to_f32(w[s]);
            for (int64_t j = d0; j < d1; j++) o[j] += round_bf16(bf16_to_f32(y[s * E + j]) * wv);
        }
        qgemm_set_rows_exact(was);
    }
    free(gu);
    free(act);
    free(y);
}

/* A mixture-of-experts feed-forward for bf16 rows grouped by expert (models/layers/moe.py), in one call: expert e
 * takes the next counts[e] rows of xs [S, E] (0 for an expert no row chose), y = down(act(gate(x), up(x))) through
 * its projections (proj_t: packed bf16, gate/up in pairs of panels for SiLU, plain panels for the clamped SwiGLU;
 * or quantized parts, gate rows first; with their biases where proj_t has them), and each of its rows s adds
 * bf16(y * w[s]) to out[tokens[s]] (float32 [T, E], zeroed by the caller), experts in id order: the kernels,
 * roundings and order of the experts' modules called one by one from Python (bit-identical: a quantized gate/up's
 * activation is silu_mul_bf16's or swiglu_clamped_bf16's, as the modules call them). */
#define MOE_FEW_ROWS 12 /* below it no expert's rows reach qgemm's tile path (AMX: tasks of 32 rows, a C tail) */
void moe_experts_bf16(const uint16_t *xs, const int64_t *tokens, const uint16_t *w, const int64_t *counts,
                      const proj_t *gate_up, const proj_t *down, int64_t num_experts, int64_t E, int64_t I,
                      const moe_act_t *a, float *out) {
    int64_t most = 0, packed = 0;
    for (int64_t e = 0; e < num_experts; e++) {
        most = counts[e] > most ? counts[e] : most;
        packed |= counts[e] && (gate_up[e].packed || down[e].packed);
    }
    if (!most) return;
    if (!packed && most < MOE_FEW_ROWS) {
        moe_experts_few(xs, tokens, w, counts, gate_up, down, num_experts, E, I, a, out);
        return;
    }
    uint16_t *act = (uint16_t *)malloc((size_t)(most * I) * sizeof(uint16_t));
    uint16_t *y = (uint16_t *)malloc((size_t)(most * E) * sizeof(uint16_t));
    uint16_t *gu = NULL;
    for (int64_t e = 0, s = 0; e < num_experts; s += counts[e], e++) {
        const int64_t n = counts[e];
        if (!n) continue;
        const uint16_t *x = xs + s * E;
        if (gate_up[e].packed && a->kind == MOE_ACT_SILU) { /* SiLU: gate/up packed in pairs, one pass */
            gemm_run(x, 1, gate_up[e].packed, NULL, act, 1, NULL, EPI_SILU_MUL, n, E, 2 * I);
        } else { /* bf16 out, as the expert's QuantLinear gives it (qgemm rounds its 6-row path's sums otherwise
                  * than a float32 output would), then silu_mul_bf16 as the expert's module calls it */
            if (!gu) gu = (uint16_t *)malloc((size_t)(most * 2 * I) * sizeof(uint16_t));
            proj_run(gate_up + e, x, n, E, 2 * I, NULL, NULL, gu, 1);
#pragma omp parallel for schedule(static) if (n > 8)
            for (int64_t r = 0; r < n; r++)
                for (int64_t j0 = 0; j0 < I; j0 += 256) act_chunk(a, gu, act, I, r, j0);
        }
        proj_run(down + e, act, n, I, E, NULL, NULL, y, 1);
        for (int64_t r = 0; r < n; r++) {
            float *o = out + tokens[s + r] * E;
            const uint16_t *yr = y + r * E;
            const float wv = bf16_to_f32(w[s + r]);
            for (int64_t j = 0; j < E; j++) o[j] += round_bf16(bf16_to_f32(yr[j]) * wv);
        }
    }
    free(gu);
    free(act);
    free(y);
}

/* Per row t of bf16 router logits [T, NE]: ids[t, :k], the k experts chosen (largest first; the lower id first
 * among equal values), and w[t, :k], their weights rounded to bf16, by the routing order of moe_t. One function for
 * the layer's module and the whole-layer decode call, so that both choose the same experts with the same weights. */
void moe_route_bf16(const uint16_t *logits, int64_t T, int64_t NE, int64_t k, int64_t order, int64_t renormalize,
                    int64_t *ids, uint16_t *w) {
    float *p = (float *)malloc((size_t)NE * sizeof(float));
    float *top = (float *)malloc((size_t)k * sizeof(float));
    unsigned char *taken = (unsigned char *)malloc((size_t)NE);
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *l = logits + t * NE;
        float m = -INFINITY;
        for (int64_t e = 0; e < NE; e++) {
            p[e] = bf16_to_f32(l[e]);
            m = p[e] > m ? p[e] : m;
        }
        if (order == MOE_SOFTMAX_TOPK) {
            float sum = 0.f;
            for (int64_t e = 0; e < NE; e++) {
                p[e] = expf(p[e] - m);
                sum += p[e];
            }
            for (int64_t e = 0; e < NE; e++) p[e] /= sum;
        }
        memset(taken, 0, (size_t)NE);
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < NE; e++)
                if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
            taken[best] = 1;
            ids[t * k + j] = best;
            top[j] = p[best];
        }
        float sum = 0.f;
        if (order == MOE_TOPK_SOFTMAX) {
            const float largest = top[0];
            for (int64_t j = 0; j < k; j++) {
                top[j] = expf(top[j] - largest);
                sum += top[j];
            }
        } else if (renormalize) {
            for (int64_t j = 0; j < k; j++) sum += top[j];
        }
        for (int64_t j = 0; j < k; j++) w[t * k + j] = f32_to_bf16(sum > 0.f ? top[j] / sum : top[j]);
    }
    free(p);
    free(top);
    free(taken);
}

/* A mixture-of-experts feed-forward for bf16 rows x [M, E] (the layer's normed input), added in place to the
 * residual h [M, E]: router logits in bf16 (as its projection gives them), moe_route_bf16, the (row, slot) pairs
 * grouped by expert (a row's slots in order within an expert, as models/layers/moe.py's group_by_expert), the
 * experts by moe_experts_bf16, then h = bf16(h + bf16(sum)) as torch adds the layer's bf16 output to its residual;
 * each expert's routed rows added to moe->load. */
void moe_forward_bf16(const uint16_t *x, int64_t M, int64_t E, const moe_t *moe, uint16_t *h) {
    const int64_t NE = moe->num_experts, k = moe->top_k, S = M * k;
    uint16_t *logits = (uint16_t *)malloc((size_t)(M * NE) * sizeof(uint16_t));
    int64_t *ids = (int64_t *)malloc((size_t)S * sizeof(int64_t));
    uint16_t *wt = (uint16_t *)malloc((size_t)S * sizeof(uint16_t));
    proj_run(moe->router, x, M, E, NE, moe->router_bias, NULL, logits, 1);
    moe_route_bf16(logits, M, NE, k, moe->order, moe->renormalize, ids, wt);
    int64_t *counts = (int64_t *)calloc((size_t)NE, sizeof(int64_t));
    int64_t *next = (int64_t *)malloc((size_t)NE * sizeof(int64_t));
    for (int64_t s = 0; s < S; s++) counts[ids[s]]++;
    for (int64_t e = 0, at = 0; e < NE; at += counts[e], e++) {
        next[e] = at;
        if (moe->load) moe->load[e] += counts[e];
    }
    int64_t *tokens = (int64_t *)malloc((size_t)S * sizeof(int64_t));
    uint16_t *xs = (uint16_t *)malloc((size_t)(S * E) * sizeof(uint16_t));
    uint16_t *wg = (uint16_t *)malloc((size_t)S * sizeof(uint16_t));
    for (int64_t s = 0; s < S; s++) { /* a counting sort: stable, as torch.argsort(stable=True) */
        const int64_t at = next[ids[s]]++;
        tokens[at] = s / k;
        wg[at] = wt[s];
        memcpy(xs + at * E, x + (s / k) * E, (size_t)E * sizeof(uint16_t));
    }
    float *out = (float *)calloc((size_t)(M * E), sizeof(float));
    moe_experts_bf16(xs, tokens, wg, counts, moe->gate_up, moe->down, NE, E, moe->inter, &moe->act, out);
    for (int64_t i = 0; i < M * E; i++) h[i] = f32_to_bf16(bf16_to_f32(h[i]) + bf16_to_f32(f32_to_bf16(out[i])));
    free(logits);
    free(ids);
    free(wt);
    free(counts);
    free(next);
    free(tokens);
    free(xs);
    free(wg);
    free(out);
}
