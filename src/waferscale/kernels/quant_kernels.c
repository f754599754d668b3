/* Weight-only quantized linear layers: y = x W^T for W held as integer blocks (see waferscale/models/quant/).
 *
 * Four layouts cover every GGUF format we serve, losslessly:
 *   int8: one byte per weight, signed (Q8_0, --quantization int8) or unsigned 0..127 (Q5_K's 5-bit values),
 *         a scale per group of G = 16, 32 or 64 weights along K, and optionally a min per group;
 *   int5: Q5_0's and Q5_1's blocks as GGUF stores their weights (20 bytes a 32-weight block: the low four bits as
 *         int4 holds them, then a little-endian uint32 whose bit j is weight j's fifth), q 0..31, signed ones
 *         (Q5_0) meaning q - 16; a scale per 32, and a min where unsigned (Q5_1);
 *   int6: Q6_K's 6-bit q (24 bytes a 32-weight block: the low four bits as int4 holds them, then 8 bytes, byte i
 *         holding the top two bits of weights i, i + 8, i + 16 and i + 24 in its bit pairs 0, 2, 4, 6), meaning
 *         q - 32, scales per 16 in two levels;
 *   int4: two weights per byte (each 32-weight block: 16 bytes, byte j holding weight j in its low nibble and
 *         weight j + 16 in its high one, as GGUF's Q4_0/Q4_1 do), unsigned 0..15, a scale and a min per group.
 * Scales and mins are float32, float16 (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 as GGUF stores them) or two-level (the
 * K-quants: sc_t).
 * A weight is scale * q + min. Three ways to multiply (qgemm's act: ACT_*):
 *   float32 activations (the default): x as it is (bf16 widened), two paths by batch size (see below): for a few
 *       rows, weights widened to float32 q in registers, each block's sum scaled once; for PANEL_ROWS rows or more,
 *       weights dequantized exactly into L1-sized float32 panels once per call and register-blocked micro-kernels
 *       (as cpu_kernels.c's bf16 GEMM) over them. A row's result is the same in any batch on the same path.
 *   int8 activations: each input row is quantized to int8 in blocks of 32 (scale = max|x| / 127, as llama.cpp's Q8
 *       activations), so a block's dot product is exact in 32-bit integers (maddubs + madd on AVX2, dpbusd with
 *       VNNI), then scaled once in float32; the mins meet the float32 sum of x over their group. Every row's result
 *       depends only on that row, never on the batch.
 *   auto (the default): below INT8_ROWS_K rows (16 with AVX2, 32 in a step verifying drafts; 28 with AVX-512 VNNI)
 *       the two-level layouts (K-quants, int4) with activations rounded to int8 per 256 and integer sums over
 *       each super-block (gemm_k), and below INT8_ROWS_Q8 (12; 5 with AVX-512 VNNI) 8-bit blocks (Q8_0, Q5_0,
 *       int8) with activations rounded per 32
 *       (gemm_q8), as llama.cpp multiplies them; on CPUs with AMX,
 *       8-bit blocks from AMX_ROWS_Q8 (3) rows and the two-level layouts (Q4_K, Q5_K, Q6_K) from AMX_ROWS_K (16)
 *       with activations per 32 by int8 tiles (gemm_amx, gemm_amx16), 8-bit blocks below 3 rows by q8_exact (the
 *       tiles' sums row by row), and from AMX_BF16Q_ROWS (4) bf16 rows Q4_0, Q4_1 and Q5_1 by bf16 tiles
 *       (gemm_amx_bf16q); one-level 4-bit blocks (Q4_0, Q4_1) below INT8_ROWS_4 (8) rows with activations rounded
 *       to int8 per 32 (gemm_i4m); Q5_1, and the 4-bit blocks' larger batches where AVX-512 VNNI does not take
 *       them, with activations rounded to int16 per 32 (gemm_i16 row by row below PANEL_ROWS (6), gemm_i16b from
 *       there); int8 vectors past the row paths where the build has them (gemm_vnni, gemm_i8k, gemm_i8v); float32
 *       for everything else.
 * Without AVX2 (or built with -DWS_PORTABLE) plain C computes the same sums in the same orders (within rounding).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && !defined(WS_PORTABLE)
#include <immintrin.h>
#define WQ_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define WQ_512 1 /* 512-bit paths: quantize_rows_k's rounding, gemm_i16's blocks, gemm_i16b's passes */
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define WQ_TILES 1 /* batches on int8 vectors with AVX-512 VNNI (gemm_vnni), the AMX tiles' counterpart */
#endif
#endif

/* The build compiles this file as two units side by side (kernels/__init__.py: -DWQ_PART=1 and -DWQ_PART=2), each
 * with every helper: part 2 the kernels marked WQ_PART2_KERNEL (the row paths gemm_small, gemm_k, gemm_q8 and the
 * batches on int8 vectors and tiles), part 1 the float32 panels, the dispatcher and the exported entry points, which
 * call part 2's kernels through their declarations. About as long to compile each, so a first start waits for half
 * the file. Without WQ_PART the file is one unit. */
#ifndef WQ_PART
#define WQ_PART 0
#endif
#if WQ_PART
#define WQ_PART2_KERNEL __attribute__((visibility("hidden")))
#else
#define WQ_PART2_KERNEL static
#endif

#define QB 32 /* activation block: K must be a multiple of it */
#define MT 4  /* input rows per pass over a weight row (the row stays in L1 between passes) */
/* set by the thread that runs a step verifying speculative drafts (qgemm_set_rows_exact): 8-bit blocks then keep
 * gemm_q8, and one-level 4-bit blocks gemm_i4m, up to INT8_ROWS_Q8_EXACT rows, and the K-quants gemm_k up to
 * INT8_ROWS_K_EXACT, so that each row gets the bits it gets decoded alone */
static _Thread_local int rows_exact = 0;

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

/* IEEE half -> float32 (exact) */
static inline float f16_f32(uint16_t h) {
#if defined(WQ_AVX2) && defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    uint32_t u;
    if (e == 0x1f) u = sign | 0x7f800000u | (m << 13); /* inf, NaN */
    else if (e) u = sign | ((e + 112) << 23) | (m << 13);
    else if (!m) u = sign;
    else { /* subnormal: m * 2^-24 */
        float f = (float)m * 5.9604644775390625e-8f;
        memcpy(&u, &f, sizeof u);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

/* A weight matrix's scales (or mins), one per group of G weights along K, in one of four formats (SC_*):
 * float32 [N, K / G] (f); float16 [N, K / G] (h: GGUF's Q8_0, Q4_0 and Q4_1 as they store them); for GGUF's
 * K-quants, their two levels as stored (b: a byte per group, signed as the weights are, times sup: a float32 per
 * 256 weights [N, K / 256]), so that a group's value is sup[g >> shift] * b[g]; or MXFP4's e8m0 bytes (e: 2^(e - 128),
 * against its doubled e2m1 values; the tile path only, gemm_amx). Either is widened or multiplied out
 * where it is used: the float32 value the one-level array would hold (an f16 times a 6- or 8-bit integer is exact
 * in float32), with fewer bytes to read. */
enum { SC_F32 = 0, SC_F16 = 1, SC_TWO_LEVEL = 2, SC_E8M0 = 3 };
/* qgemm's activations (act): float32 (exact weights), int8 per 32 (every layout, every batch), or auto (see the
 * top of this file: gemm_k and gemm_q8 below INT8_ROWS_K and INT8_ROWS_Q8 rows, float32 for the rest) */
enum { ACT_FLOAT32 = 0, ACT_INT8 = 1, ACT_AUTO = 2 };
typedef struct {
    const float *f;
    const uint16_t *h;
    const uint8_t *b;
    const float *sup;
    int sgn, shift;
    const uint8_t *e;
} sc_t;

/* row n's scales, ng of them (NULL pointers stay NULL) */
static inline __attribute__((always_inline)) sc_t sc_row(sc_t s, int64_t n, int64_t ng) {
    if (s.f) s.f += n * ng;
    if (s.h) s.h += n * ng;
    if (s.b) {
        s.b += n * ng;
        s.sup += n * (ng >> s.shift);
    }
    if (s.e) s.e += n * ng;
    return s;
}

static inline int sc_some(const sc_t *s) { return s->f || s->h || s->b || s->e; }

static inline __attribute__((always_inline)) float sc_at(const sc_t *s, int64_t g) {
    if (s->f) return s->f[g];
    if (s->e) { /* 2^(e - 128) from its bits (subnormal below e = 2), as mxfp4_kernels.c's mx_half_scale */
        const uint32_t bits = s->e[g] >= 2 ? (uint32_t)(s->e[g] - 1) << 23 : (uint32_t)1 << (21 + s->e[g]);
        float v;
        memcpy(&v, &bits, sizeof v);
        return v;
    }
    if (s->h) return f16_f32(s->h[g]);
    return s->sup[g >> s->shift] * (s->sgn ? (float)(int8_t)s->b[g] : (float)s->b[g]);
}

/* row n's ng scales as float32 into dst (float16 ones widened 16 at a time where the build has AVX-512) */
static inline void row_scales(const sc_t *s, int64_t n, int64_t ng, float *dst) {
    const sc_t r = sc_row(*s, n, ng);
    int64_t g = 0;
#if defined(__AVX512F__) && !defined(WS_PORTABLE)
    if (r.h)
        for (; g + 16 <= ng; g += 16)
            _mm512_storeu_ps(dst + g, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(r.h + g))));
#endif
    if (r.b && !r.e && !r.f && !r.h) {
        for (; g < ng; g++) dst[g] = r.sup[g >> r.shift] * (r.sgn ? (float)(int8_t)r.b[g] : (float)r.b[g]);
        return;
    }
    for (; g < ng; g++) dst[g] = sc_at(&r, g);
}

/* bytes a 32-weight block takes in a row of a layout (bits 8, 6, 5 or 4), and a row of K weights */
#define BLOCK_BYTES(bits) ((bits) == 8 ? 32 : (bits) == 6 ? 24 : (bits) == 5 ? 20 : 16)
static inline int64_t row_bytes_of(int bits, int64_t K) { return K / QB * BLOCK_BYTES(bits); }

/* weight i (< 32) of the block at blk as the integer the kernels multiply */
static inline int32_t block_q(const uint8_t *blk, int bits, int sgn, int i) {
    if (bits == 8) return sgn ? (int32_t)(int8_t)blk[i] : (int32_t)blk[i];
    int32_t q = i < 16 ? (blk[i] & 0x0F) : (blk[i - 16] >> 4);
    if (bits == 5) {
        q |= ((blk[16 + i / 8] >> (i % 8)) & 1) << 4;
        if (sgn) q -= 16;
    }
    if (bits == 6) {
        q |= ((blk[16 + i % 8] >> (2 * (i / 8))) & 3) << 4;
        if (sgn) q -= 32;
    }
    return q;
}

#ifdef WQ_AVX2
/* the 32 weights of the block at blk as bytes in order (signed where sgn: int8, int6, int5), from any layout */
static inline __attribute__((always_inline)) __m256i block_bytes(const uint8_t *blk, const int bits, const int sgn) {
    if (bits == 8) return _mm256_loadu_si256((const __m256i *)blk);
    const __m128i raw = _mm_loadu_si128((const __m128i *)blk);
    __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
    if (bits == 5) {
        uint32_t h;
        memcpy(&h, blk + 16, sizeof h);
        const __m256i sixteen = _mm256_set1_epi8(16);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
        q = sgn ? _mm256_mask_sub_epi8(q, _cvtu32_mask32(~h), q, sixteen)
                : _mm256_mask_add_epi8(q, _cvtu32_mask32(h), q, sixteen);
#else /* byte j of h's j / 8 to every weight of its eight, then each weight's own bit */
        const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
                                              3, 3, 3, 3, 3, 3, 3, 3);
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
        const __m256i hb = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)h), pick), bit);
        q = _mm256_or_si256(q, _mm256_and_si256(_mm256_cmpeq_epi8(hb, bit), sixteen));
        if (sgn) q = _mm256_sub_epi8(q, sixteen);
#endif
    }
    if (bits == 6) { /* 64-bit lane t (weights 8 t ..) takes the bit pairs at 2 t of the 8 bytes */
        uint64_t h;
        memcpy(&h, blk + 16, sizeof h);
        const __m256i hv = _mm256_srlv_epi64(_mm256_set1_epi64x((long long)h), _mm256_setr_epi64x(0, 2, 4, 6));
        q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(hv, _mm256_set1_epi8(3)), 4));
        if (sgn) q = _mm256_sub_epi8(q, _mm256_set1_epi8(32));
    }
    return q;
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* sum over a row's groups of min[j] * xg[j] */
static inline float mins_dot(const sc_t *wm, const float *xg, int64_t ng) {
    float t = 0.f;
#ifdef WQ_AVX2
    if (wm->b && wm->shift == 3) { /* two-level, 8 groups a super-block: its 8 mins formed together */
        __m256 acc = _mm256_setzero_ps();
        for (int64_t sb = 0; sb < ng / 8; sb++) {
            const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(wm->b + 8 * sb)));
            const __m256 mn = _mm256_mul_ps(_mm256_set1_ps(wm->sup[sb]), _mm256_cvtepi32_ps(v));
            acc = _mm256_fmadd_ps(mn, _mm256_loadu_ps(xg + 8 * sb), acc);
        }
        return hsum(acc);
    }
    if (wm->h) { /* 8 mins widened together */
        __m256 acc = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= ng; j += 8)
            acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wm->h + j))),
                                  _mm256_loadu_ps(xg + j), acc);
        t = hsum(acc);
        for (; j < ng; j++) t += f16_f32(wm->h[j]) * xg[j];
        return t;
    }
#endif
    if (wm->f) {
#pragma omp simd reduction(+ : t)
        for (int64_t j = 0; j < ng; j++) t += wm->f[j] * xg[j];
    } else {
#pragma omp simd reduction(+ : t)
        for (int64_t j = 0; j < ng; j++) t += sc_at(wm, j) * xg[j];
    }
    return t;
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
#ifdef WQ_AVX2
            /* the scalar loop's values in vectors for finite x: cvtps rounds to nearest even, as lrintf;
             * |values| <= 127 */
            const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
            __m256 v[4], mx = _mm256_setzero_ps();
            for (int j = 0; j < 4; j++) {
                v[j] = _mm256_loadu_ps(xm + b * QB + 8 * j);
                mx = _mm256_max_ps(_mm256_and_ps(v[j], abs), mx); /* a NaN skipped, as fmaxf skips it */
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
            const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
            xs[m * nb + b] = d;
            const __m256 vid = _mm256_set1_ps(id);
            __m256i i32[4];
            for (int j = 0; j < 4; j++) i32[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], vid));
            const __m256i w01 = _mm256_packs_epi32(i32[0], i32[1]), w23 = _mm256_packs_epi32(i32[2], i32[3]);
            _mm256_storeu_si256((__m256i *)(xq + m * K + b * QB),
                                _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23),
                                                            _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
            float amax = 0.f;
            for (int i = 0; i < QB; i++) amax = fmaxf(amax, fabsf(xm[b * QB + i]));
            const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
            xs[m * nb + b] = d;
            for (int i = 0; i < QB; i++) xq[m * K + b * QB + i] = (int8_t)lrintf(xm[b * QB + i] * id);
#endif
        }
        for (int64_t g = 0; g < (xg ? ng : 0); g++) {
            float s = 0.f;
            for (int64_t i = 0; i < G; i++) s += xm[g * G + i];
            xg[m * ng + g] = s;
        }
    }
}

/* xg [M, K / 32] = each block's rounded values summed, times its scale: the sums the mins meet where x is rounded to
 * int8 per 32 for one-level 4-bit blocks, so that a block's error is sum_i w_i (s xq_i - x_i), the weights' own
 * values (scale x q + min, centred) against x's rounding, as llama.cpp's Q8_1 sums. Against x's exact sums, the
 * error is sum_i scale q_i (s xq_i - x_i), q 0..15 uncentred: about twice as large. */
static inline void rounded_sums(const int8_t *xq, const float *xs, int64_t M, int64_t K, float *xg) {
    const int64_t nb = K / QB;
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) {
            int32_t t = 0;
            for (int i = 0; i < QB; i++) t += xq[m * K + b * QB + i];
            xg[m * nb + b] = (float)t * xs[m * nb + b];
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

/* out[m] = sum over blocks of scale_w * scale_x * (integer dot), for mt rows of xq against one weight row */
static inline __attribute__((always_inline)) void row_dots(const uint8_t *w, const sc_t *ws, int gshift, int64_t nb,
                                                           const int8_t *xq, const float *xs, int64_t K,
                                                           const int bits, const int sgn, const int mt,
                                                           float *out) {
    __m256 acc[MT];
    for (int m = 0; m < mt; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m256i wv = block_bytes(w + b * BLOCK_BYTES(bits), bits, sgn);
        const __m256i wu = sgn ? _mm256_sign_epi8(wv, wv) : wv;
        const __m256 wsc = gshift == 4
                               ? _mm256_set_m128(_mm_set1_ps(sc_at(ws, 2 * b + 1)), _mm_set1_ps(sc_at(ws, 2 * b)))
                               : _mm256_set1_ps(sc_at(ws, (b * QB) >> gshift));
        for (int m = 0; m < mt; m++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + m * K + b * QB));
            if (sgn) xv = _mm256_sign_epi8(xv, wv);
            const __m256 p = _mm256_cvtepi32_ps(DOT_U8S8(wu, xv));
            acc[m] = _mm256_fmadd_ps(p, _mm256_mul_ps(wsc, _mm256_set1_ps(xs[m * nb + b])), acc[m]);
        }
    }
    for (int m = 0; m < mt; m++) out[m] = hsum(acc[m]);
}

#else
/* portable: the same integer dot products and the same scaling per block (summed in another order than AVX2) */
static inline void row_dots(const uint8_t *w, const sc_t *ws, int gshift, int64_t nb, const int8_t *xq,
                            const float *xs, int64_t K, const int bits, const int sgn, const int mt, float *out) {
    for (int m = 0; m < mt; m++) {
        float acc = 0.f;
        for (int64_t b = 0; b < nb; b++) {
            int32_t lo = 0, hi = 0;
            for (int i = 0; i < QB; i++) {
                const int32_t p = block_q(w + b * BLOCK_BYTES(bits), bits, sgn, i) * (int32_t)xq[m * K + b * QB + i];
                if (i < 16) lo += p; else hi += p;
            }
            const float sx = xs[m * nb + b];
            if (gshift == 4) acc += (float)lo * (sc_at(ws, 2 * b) * sx) + (float)hi * (sc_at(ws, 2 * b + 1) * sx);
            else acc += (float)(lo + hi) * (sc_at(ws, (b * QB) >> gshift) * sx);
        }
        out[m] = acc;
    }
}
#endif


/* ACT_INT8: out_m = x_m . w for every input row against one weight row, MT input rows a pass (the weight row stays
 * in L1 between passes); the mins meet the rows' float32 sums over their groups. y: row stride ldy. */
static inline __attribute__((always_inline)) void weight_row_int8(const uint8_t *w, const sc_t *ws, const sc_t *wm,
                                                                  int gshift, int64_t ng, int64_t nb,
                                                                  const int8_t *xq, const float *xs, const float *xg,
                                                                  int64_t M, int64_t K, const int bits, const int sgn,
                                                                  float *y, int64_t ldy) {
    float out[MT];
    for (int64_t m0 = 0; m0 < M; m0 += MT) {
        const int64_t mt = M - m0 < MT ? M - m0 : MT;
        const int8_t *xm = xq + m0 * K;
        const float *sm = xs + m0 * nb;
        switch (mt) {
            case 4: row_dots(w, ws, gshift, nb, xm, sm, K, bits, sgn, 4, out); break;
            case 3: row_dots(w, ws, gshift, nb, xm, sm, K, bits, sgn, 3, out); break;
            case 2: row_dots(w, ws, gshift, nb, xm, sm, K, bits, sgn, 2, out); break;
            default: row_dots(w, ws, gshift, nb, xm, sm, K, bits, sgn, 1, out); break;
        }
        for (int64_t i = 0; i < mt; i++) {
            float v = out[i];
            if (sc_some(wm)) v += mins_dot(wm, xg + (m0 + i) * ng, ng);
            y[(m0 + i) * ldy] = v;
        }
    }
}

/* out[m, n] (row stride ldo) = v (+ bias[n]), as float32, or rounded to bf16, or res[m, n] + bf16(...) in bf16 (the
 * residual add, each step rounded as torch's bf16 ops round it) */
static inline void put(float v, int64_t m, int64_t n, const float *bias, const uint16_t *res, void *out, int out_bf16,
                       int64_t ldo) {
    v += bias ? bias[n] : 0.f;
    if (!out_bf16) {
        ((float *)out)[m * ldo + n] = v;
        return;
    }
    if (res) v = bf16_f32(res[m * ldo + n]) + bf16_f32(f32_bf16(v));
    ((uint16_t *)out)[m * ldo + n] = f32_bf16(v);
}

#ifdef WQ_AVX2
/* 8 float32 sums as put stores them (bias already added): bf16 rounded to nearest even, NaN kept a NaN, plus the
 * bf16 residual where there is one (then rounded again), or float32 */
static inline __attribute__((always_inline)) __m256i bf16x8(__m256 y) {
    const __m256i u = _mm256_castps_si256(y);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rne = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(rne, quiet, nan); /* 8 int32, each a bf16's bits */
}

static inline __attribute__((always_inline)) void put8(__m256 y, int64_t m, int64_t n, const uint16_t *res, void *out,
                                                       int out_bf16, int64_t ldo) {
    if (!out_bf16) {
        _mm256_storeu_ps((float *)out + m * ldo + n, y);
        return;
    }
    __m256i b = bf16x8(y);
    if (res) {
        const __m256 r = _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(res + m * ldo + n))), 16));
        b = bf16x8(_mm256_add_ps(r, _mm256_castsi256_ps(_mm256_slli_epi32(b, 16))));
    }
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0x08);
    _mm_storeu_si128((__m128i *)((uint16_t *)out + m * ldo + n), _mm256_castsi256_si128(p));
}

/* v [16 weight rows][16 input rows] sums of weight rows n0 .. n0 + nr - 1 and input rows m0 .. m0 + rows - 1, put
 * as put puts each (vector stores where all 16 weight rows are there) */
static void put16(const float v[16][16], int64_t rows, int64_t nr, int64_t m0, int64_t n0, const float *bias,
                  const uint16_t *res, void *out, int out_bf16, int64_t ldo) {
    if (nr < 16) {
        for (int64_t m = 0; m < rows; m++)
            for (int64_t i = 0; i < nr; i++) put(v[i][m], m0 + m, n0 + i, bias, res, out, out_bf16, ldo);
        return;
    }
    for (int64_t m = 0; m < rows; m++) {
        float t[16] __attribute__((aligned(32)));
        for (int i = 0; i < 16; i++) t[i] = v[i][m];
        for (int h = 0; h < 2; h++) {
            __m256 y = _mm256_load_ps(t + 8 * h);
            if (bias) y = _mm256_add_ps(y, _mm256_loadu_ps(bias + n0 + 8 * h));
            put8(y, m0 + m, n0 + 8 * h, res, out, out_bf16, ldo);
        }
    }
}
#endif

/* ---------------------------------------------------------------- float32 activations (the default)
 *
 * The weights are dequantized exactly (scale * q rounded, then + min: what qdequant and gguf.quants.dequantize give)
 * into panels like the bf16 GEMM's (cpu_kernels.c): 16 weight rows as [kc][16] float32, kc columns at a time so that
 * a task's panels stay in L1, and register-blocked micro-kernels run over them for every input row: per k, 16
 * weights times a broadcast x[m, k] into MB x P x 16 sums. So a weight is dequantized once per call, whatever the
 * batch. Each output is one chain of FMAs over k in order (between chunks its sum waits in a buffer: stored and
 * reloaded, the same chain), so a row's result never depends on the other rows, nor on the micro-kernel that ran it.
 */
#define KC 256 /* columns of a panel dequantized at a time: [KC][16] float32, 16 KiB, stays in L1 */

/* call CALL(bits, sgn, mins) with compile-time constants for one of the layouts */
#define LAYOUT_DISPATCH(bits, sgn, mins, CALL)                                                                  \
    do {                                                                                                        \
        if ((bits) == 4) { if (mins) CALL(4, 0, 1); else CALL(4, 0, 0); }                                       \
        else if ((bits) == 5) { if (sgn) CALL(5, 1, 0); else if (mins) CALL(5, 0, 1); else CALL(5, 0, 0); }      \
        else if ((bits) == 6) CALL(6, 1, 0);                                                                    \
        else if (sgn) { if (mins) CALL(8, 1, 1); else CALL(8, 1, 0); }                                          \
        else { if (mins) CALL(8, 0, 1); else CALL(8, 0, 0); }                                                   \
    } while (0)

#ifdef WQ_AVX2
/* an opaque step: keeps the compiler from contracting a product and the add after it into one FMA */
#define NOFUSE(v) __asm__("" : "+x"(v))

/* one column's 8 weights (bytes v8, one per row) scaled exactly, to out[0..7] */
static inline __attribute__((always_inline)) void deq_col8(__m128i v8, __m256 s, __m256 mn, float *out,
                                                           const int sgn, const int mins) {
    __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(sgn ? _mm256_cvtepi8_epi32(v8) : _mm256_cvtepu8_epi32(v8)), s);
    if (mins) {
        NOFUSE(p);
        p = _mm256_add_ps(p, mn);
    }
    _mm256_storeu_ps(out, p);
}

/* 8 weight rows (rows[r], r < 8) over the 32 columns of the block at kb: column k's 8 exact weights to
 * out[k * 16 + 0..7]. s, mn: the 8 rows' scales and mins of the block's first and second 16 columns. The rows'
 * bytes (or nibbles, widened to bytes) are transposed in registers: 3 rounds of unpacks within each 128-bit half. */
static inline __attribute__((always_inline)) void deq_block8(const uint8_t *const *rows, int64_t kb, const __m256 s[2],
                                                             const __m256 mn[2], float *out, const int bits,
                                                             const int sgn, const int mins) {
    __m256i R[8], a[8], b[8], c[8];
    for (int r = 0; r < 8; r++) R[r] = block_bytes(rows[r] + kb / QB * BLOCK_BYTES(bits), bits, sgn);
    /* per half (columns j and 16 + j): a: row pairs, b: row quads, c: all 8 rows of 2 columns */
    for (int p = 0; p < 4; p++) {
        a[2 * p] = _mm256_unpacklo_epi8(R[2 * p], R[2 * p + 1]);     /* columns 0..7 */
        a[2 * p + 1] = _mm256_unpackhi_epi8(R[2 * p], R[2 * p + 1]); /* columns 8..15 */
    }
    for (int q = 0; q < 2; q++)
        for (int h = 0; h < 2; h++) {
            b[4 * q + 2 * h] = _mm256_unpacklo_epi16(a[4 * q + h], a[4 * q + 2 + h]);     /* 8h + 0..3 */
            b[4 * q + 2 * h + 1] = _mm256_unpackhi_epi16(a[4 * q + h], a[4 * q + 2 + h]); /* 8h + 4..7 */
        }
    for (int i = 0; i < 4; i++) {
        c[2 * i] = _mm256_unpacklo_epi32(b[i], b[4 + i]);     /* columns 4i, 4i + 1 */
        c[2 * i + 1] = _mm256_unpackhi_epi32(b[i], b[4 + i]); /* columns 4i + 2, 4i + 3 */
    }
    for (int i = 0; i < 8; i++) {
        const __m128i lo = _mm256_castsi256_si128(c[i]), hi = _mm256_extracti128_si256(c[i], 1);
        deq_col8(lo, s[0], mn[0], out + (2 * i) * 16, sgn, mins);
        deq_col8(_mm_unpackhi_epi64(lo, lo), s[0], mn[0], out + (2 * i + 1) * 16, sgn, mins);
        deq_col8(hi, s[1], mn[1], out + (16 + 2 * i) * 16, sgn, mins);
        deq_col8(_mm_unpackhi_epi64(hi, hi), s[1], mn[1], out + (17 + 2 * i) * 16, sgn, mins);
    }
}

/* group g's scale (or min) of 8 rows, all in one format: float16 ones widened together (as sc_at widens each) */
static inline __attribute__((always_inline)) __m256 gather8(const sc_t a[8], int64_t g) {
    if (a[0].h)
        return _mm256_cvtph_ps(_mm_setr_epi16((short)a[0].h[g], (short)a[1].h[g], (short)a[2].h[g],
                                              (short)a[3].h[g], (short)a[4].h[g], (short)a[5].h[g],
                                              (short)a[6].h[g], (short)a[7].h[g]));
    if (a[0].f)
        return _mm256_setr_ps(a[0].f[g], a[1].f[g], a[2].f[g], a[3].f[g], a[4].f[g], a[5].f[g], a[6].f[g], a[7].f[g]);
    return _mm256_setr_ps(sc_at(&a[0], g), sc_at(&a[1], g), sc_at(&a[2], g), sc_at(&a[3], g), sc_at(&a[4], g),
                          sc_at(&a[5], g), sc_at(&a[6], g), sc_at(&a[7], g));
}

/* the panel of weight rows n0 .. n0 + 15 (rows past N repeat row N - 1), columns k0 .. k0 + kc: P[k][16] */
static inline __attribute__((always_inline)) void deq_panel_l(const uint8_t *w, int64_t row_bytes, const sc_t *ws,
                                                              const sc_t *wm, int64_t ng, int gshift, int64_t N,
                                                              int64_t n0, int64_t k0, int64_t kc, float *P,
                                                              const int bits, const int sgn, const int mins) {
    for (int64_t o = 0; o < 2; o++) { /* rows 0..7, then 8..15 */
        const uint8_t *rows[8];
        sc_t sr[8], mr[8];
        for (int r = 0; r < 8; r++) {
            const int64_t n = n0 + 8 * o + r < N ? n0 + 8 * o + r : N - 1;
            rows[r] = w + n * row_bytes;
            sr[r] = sc_row(*ws, n, ng);
            mr[r] = sc_row(*wm, n, ng);
        }
        for (int64_t kb = k0; kb < k0 + kc; kb += QB) {
            const int64_t g0 = kb >> gshift, g1 = (kb + 16) >> gshift;
            __m256 s[2], mn[2];
            s[0] = gather8(sr, g0);
            s[1] = g1 == g0 ? s[0] : gather8(sr, g1);
            mn[0] = mins ? gather8(mr, g0) : _mm256_setzero_ps();
            mn[1] = !mins ? mn[0] : g1 == g0 ? mn[0] : gather8(mr, g1);
            deq_block8(rows, kb, s, mn, P + (kb - k0) * 16 + 8 * o, bits, sgn, mins);
        }
    }
}

static void deq_panel(const uint8_t *w, int bits, int sgn, int64_t row_bytes, const sc_t *ws, const sc_t *wm,
                      int64_t ng, int gshift, int64_t N, int64_t n0, int64_t k0, int64_t kc, float *P) {
#define DEQ(B, S, MN) deq_panel_l(w, row_bytes, ws, wm, ng, gshift, N, n0, k0, kc, P, B, S, MN)
    LAYOUT_DISPATCH(bits, sgn, sc_some(wm), DEQ);
#undef DEQ
}

/* acc[i * 16 + 0..15] += sum over k < kc of x[i * ldx + k] * P[k][0..15] for i < MB: one FMA chain each, in registers
 * (loops unrolled before GCC's scalar replacement: else the sums go through the stack at every step) */
#define UNROLL _Pragma("GCC unroll 8")
#define QMICRO(MB)                                                                                               \
    static __attribute__((noinline)) void qmicro_##MB(const float *x, int64_t ldx, const float *P, int64_t kc,   \
                                                      float *acc) {                                              \
        __m256 lo[MB], hi[MB];                                                                                   \
        UNROLL for (int i = 0; i < MB; i++) {                                                                    \
            lo[i] = _mm256_loadu_ps(acc + i * 16);                                                               \
            hi[i] = _mm256_loadu_ps(acc + i * 16 + 8);                                                           \
        }                                                                                                        \
        for (int64_t k = 0; k < kc; k++) {                                                                       \
            const __m256 w0 = _mm256_loadu_ps(P + k * 16), w1 = _mm256_loadu_ps(P + k * 16 + 8);                 \
            UNROLL for (int i = 0; i < MB; i++) {                                                                \
                const __m256 xb = _mm256_broadcast_ss(x + i * ldx + k);                                          \
                lo[i] = _mm256_fmadd_ps(w0, xb, lo[i]);                                                          \
                hi[i] = _mm256_fmadd_ps(w1, xb, hi[i]);                                                          \
            }                                                                                                    \
        }                                                                                                        \
        UNROLL for (int i = 0; i < MB; i++) {                                                                    \
            _mm256_storeu_ps(acc + i * 16, lo[i]);                                                               \
            _mm256_storeu_ps(acc + i * 16 + 8, hi[i]);                                                           \
        }                                                                                                        \
    }
QMICRO(1) QMICRO(2) QMICRO(3) QMICRO(4) QMICRO(5) QMICRO(6)

/* mb rows (1..6) */
static inline void qmicro(int64_t mb, const float *x, int64_t ldx, const float *P, int64_t kc, float *acc) {
    switch (mb) {
        case 6: qmicro_6(x, ldx, P, kc, acc); break;
        case 5: qmicro_5(x, ldx, P, kc, acc); break;
        case 4: qmicro_4(x, ldx, P, kc, acc); break;
        case 3: qmicro_3(x, ldx, P, kc, acc); break;
        case 2: qmicro_2(x, ldx, P, kc, acc); break;
        default: qmicro_1(x, ldx, P, kc, acc); break;
    }
}
#else
/* portable: the same exact weights, one row at a time, and the same chains over k (without explicit vectors) */
static __attribute__((optimize("fp-contract=off"))) void deq_row(const uint8_t *w, int bits, int sgn, int gshift,
                                                                 const sc_t *ws, const sc_t *wm, int64_t k0,
                                                                 int64_t kc, float *out, int64_t stride) {
    for (int64_t k = k0; k < k0 + kc; k++) {
        const float q = (float)block_q(w + k / QB * BLOCK_BYTES(bits), bits, sgn, (int)(k % QB));
        const float v = sc_at(ws, k >> gshift) * q;
        out[(k - k0) * stride] = sc_some(wm) ? v + sc_at(wm, k >> gshift) : v;
    }
}

static void deq_panel(const uint8_t *w, int bits, int sgn, int64_t row_bytes, const sc_t *ws, const sc_t *wm,
                      int64_t ng, int gshift, int64_t N, int64_t n0, int64_t k0, int64_t kc, float *P) {
    for (int64_t j = 0; j < 16; j++) {
        const int64_t n = n0 + j < N ? n0 + j : N - 1;
        const sc_t sr = sc_row(*ws, n, ng), mr = sc_row(*wm, n, ng);
        deq_row(w + n * row_bytes, bits, sgn, gshift, &sr, &mr, k0, kc, P + j, 16);
    }
}

static void qmicro(int64_t mb, const float *x, int64_t ldx, const float *P, int64_t kc, float *acc) {
    for (int64_t i = 0; i < mb; i++)
        for (int64_t j = 0; j < 16; j++) {
            float a = acc[i * 16 + j];
            for (int64_t k = 0; k < kc; k++) a = fmaf(P[k * 16 + j], x[i * ldx + k], a);
            acc[i * 16 + j] = a;
        }
}
#endif

/* Few rows (M < PANEL_ROWS), where dequantizing a panel would cost more than the products: each weight row's
 * 32-blocks widened to float32 q in registers, multiplied with up to 3 input rows' values, and each block's sum
 * scaled once (scale * sum q x); the mins meet the input rows' float32 sums over their groups (min * sum x). One
 * weight row at a time: 4 rows read side by side streamed from memory 25-35% slower (1B shapes, one thread). The
 * same weights as the panels, summed in another order: a row's result is the same in any batch of 1-5 rows, and in
 * any batch of PANEL_ROWS or more, but not across the two. */
#define PANEL_ROWS 6 /* measured: 4 and 5 rows are faster row by row, 6 and 8 in panels (1B and 135M shapes) */

#ifdef WQ_AVX2
/* the 32 q of the block at kb (unscaled), as float32, in column order */
static inline __attribute__((always_inline)) void widen32(const uint8_t *w, int64_t kb, __m256 wf[4], const int bits,
                                                          const int sgn) {
    if (bits == 5 || bits == 6) { /* widened to bytes first */
        uint8_t b[32];
        _mm256_storeu_si256((__m256i *)b, block_bytes(w + kb / QB * BLOCK_BYTES(bits), bits, sgn));
        for (int j = 0; j < 4; j++) {
            const __m128i q = _mm_loadl_epi64((const __m128i *)(b + 8 * j));
            wf[j] = _mm256_cvtepi32_ps(sgn ? _mm256_cvtepi8_epi32(q) : _mm256_cvtepu8_epi32(q));
        }
    } else if (bits == 8) {
        for (int j = 0; j < 4; j++) {
            const __m128i q = _mm_loadl_epi64((const __m128i *)(w + kb + 8 * j));
            wf[j] = _mm256_cvtepi32_ps(sgn ? _mm256_cvtepi8_epi32(q) : _mm256_cvtepu8_epi32(q));
        }
    } else { /* byte j: weight j in its low nibble, j + 16 in its high one */
        const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + kb / 2)));
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + kb / 2 + 8)));
        const __m256i low4 = _mm256_set1_epi32(15);
        wf[0] = _mm256_cvtepi32_ps(_mm256_and_si256(a, low4));
        wf[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b, low4));
        wf[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
        wf[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
    }
}

/* acc[m] += scale * (x_m . q) over the 32-block at kb of one weight row, for mt input rows (G = 16: two scales) */
static inline __attribute__((always_inline)) void block_scaled(const uint8_t *w, const float *sr, const float *x,
                                                               int64_t K, int64_t kb, __m256 acc[4], const int mt,
                                                               const int bits, const int sgn, const int g16) {
    __m256 wf[4];
    widen32(w, kb, wf, bits, sgn);
    const __m256 s0 = _mm256_set1_ps(sr[0]), s1 = g16 ? _mm256_set1_ps(sr[1]) : s0;
    for (int m = 0; m < mt; m++) {
        const float *xb = x + m * K + kb;
        __m256 d0 = _mm256_mul_ps(wf[0], _mm256_loadu_ps(xb));
        d0 = _mm256_fmadd_ps(wf[1], _mm256_loadu_ps(xb + 8), d0);
        __m256 d1 = _mm256_mul_ps(wf[2], _mm256_loadu_ps(xb + 16));
        d1 = _mm256_fmadd_ps(wf[3], _mm256_loadu_ps(xb + 24), d1);
        if (!g16) {
            acc[m] = _mm256_fmadd_ps(_mm256_add_ps(d0, d1), s0, acc[m]);
        } else {
            acc[m] = _mm256_fmadd_ps(d0, s0, acc[m]);
            acc[m] = _mm256_fmadd_ps(d1, s1, acc[m]);
        }
    }
}

/* the ng scales of groups g0 .. g0 + ng of a 256-weight chunk (at most 16) as float32: f's own, or formed in buf */
static inline __attribute__((always_inline)) const float *chunk_scales(const sc_t *ws, int64_t g0, int64_t ng,
                                                                       const int sgn, float buf[16]) {
    if (ws->f) return ws->f + g0;
    if (ws->h) {
        if (ng == 8) _mm256_storeu_ps(buf, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(ws->h + g0))));
        else for (int64_t j = 0; j < ng; j++) buf[j] = f16_f32(ws->h[g0 + j]);
        return buf;
    }
    const __m256 d = _mm256_set1_ps(ws->sup[g0 >> ws->shift]); /* a chunk is one super-block */
    for (int64_t j = 0; j < ng; j += 8) {
        const __m128i b8 = _mm_loadl_epi64((const __m128i *)(ws->b + g0 + j));
        const __m256i v = sgn ? _mm256_cvtepi8_epi32(b8) : _mm256_cvtepu8_epi32(b8);
        _mm256_storeu_ps(buf + j, _mm256_mul_ps(d, _mm256_cvtepi32_ps(v)));
    }
    return buf;
}

/* sums[m] = x_m . w for one weight row (w; its scales ws and mins wm or NULL, ng of each) and mt (1..4) input rows
 * (x: row stride K; xg: their group sums, row stride ng). Four blocks (a cache line of nibbles) a step, each asking
 * for the line PF_AHEAD bytes on: the next rows follow on, so a task's rows are one stream. */
#define PF_AHEAD 1024
/* the row kernels of the K-quants and 8-bit blocks ask for the line PF_FAR bytes on into L2 as well: more lines in
 * flight than the L1's fill buffers allow, so a row or two of a small projection (an expert's) streams nearer the
 * memory's speed */
#define PF_FAR 4096
/* the line PF_AHEAD bytes past p into L1 and the one PF_FAR past it into L2 */
static inline __attribute__((always_inline)) void prefetch_near_far(const uint8_t *p) {
    _mm_prefetch((const char *)(p + PF_AHEAD), _MM_HINT_T0);
    _mm_prefetch((const char *)(p + PF_FAR), _MM_HINT_T1);
}
static inline __attribute__((always_inline)) void row_scaled(const uint8_t *w, const sc_t *ws, const sc_t *wm,
                                                             int64_t ng, int gshift, const float *x, const float *xg,
                                                             int64_t K, float sums[4], const int mt, const int bits,
                                                             const int sgn, const int g16) {
    __m256 acc[4];
    for (int m = 0; m < mt; m++) acc[m] = _mm256_setzero_ps();
    float buf[16];
    for (int64_t kb = 0; kb < K;) { /* 8 blocks (256 weights) a chunk, their scales formed together */
        const int64_t nblk = K - kb < 8 * QB ? (K - kb) / QB : 8;
        const float *sr = chunk_scales(ws, kb >> gshift, (nblk * QB) >> gshift, sgn, buf);
        for (int64_t u = 0; u < nblk; u++, kb += QB) {
            if (u % 4 == 0) {
                _mm_prefetch((const char *)(w + (kb * bits) / 8 + PF_AHEAD), _MM_HINT_T0);
                if (bits == 8) _mm_prefetch((const char *)(w + kb + 64 + PF_AHEAD), _MM_HINT_T0);
            }
            block_scaled(w, sr + ((u * QB) >> gshift), x, K, kb, acc, mt, bits, sgn, g16);
        }
    }
    for (int m = 0; m < mt; m++) {
        float v = hsum(acc[m]);
        if (sc_some(wm)) v += mins_dot(wm, xg + m * ng, ng);
        sums[m] = v;
    }
}

/* weight rows n0 .. n1 against all M rows, 4 input rows a pass (a weight row stays in L1 between passes), one
 * function per (bits, sgn, g16) */
#define SMALL_FN(B, S, G16)                                                                                       \
    static __attribute__((noinline)) void small_##B##_##S##_##G16(                                                 \
        const float *xf, const float *xg, int64_t M, int64_t K, const uint8_t *w, int64_t row_bytes,             \
        const sc_t *ws, const sc_t *wm, int64_t ng, int gshift, int64_t n0, int64_t n1, const float *bias,       \
        const uint16_t *res, void *out, int out_bf16, int64_t ldo) {                                              \
        for (int64_t n = n0; n < n1; n++)                                                                         \
            for (int64_t m0 = 0; m0 < M; m0 += 4) {                                                               \
                const int64_t mt = M - m0 < 4 ? M - m0 : 4;                                                       \
                const uint8_t *wn = w + n * row_bytes;                                                            \
                const sc_t sr = sc_row(*ws, n, ng), mr = sc_row(*wm, n, ng), *sn = &sr, *mn = &mr;                 \
                const float *xm = xf + m0 * K, *gm = xg ? xg + m0 * ng : NULL;                                    \
                float sums[4];                                                                                    \
                if (mt == 4) row_scaled(wn, sn, mn, ng, gshift, xm, gm, K, sums, 4, B, S, G16);                   \
                else if (mt == 3) row_scaled(wn, sn, mn, ng, gshift, xm, gm, K, sums, 3, B, S, G16);              \
                else if (mt == 2) row_scaled(wn, sn, mn, ng, gshift, xm, gm, K, sums, 2, B, S, G16);              \
                else row_scaled(wn, sn, mn, ng, gshift, xm, gm, K, sums, 1, B, S, G16);                           \
                for (int64_t i = 0; i < mt; i++) put(sums[i], m0 + i, n, bias, res, out, out_bf16, ldo);          \
            }                                                                                                     \
    }
SMALL_FN(4, 0, 0) SMALL_FN(4, 0, 1) SMALL_FN(8, 1, 0) SMALL_FN(8, 1, 1) SMALL_FN(8, 0, 0) SMALL_FN(8, 0, 1)
SMALL_FN(5, 1, 0) SMALL_FN(5, 0, 0) SMALL_FN(6, 1, 1)
#else
static void row_scaled_p(const uint8_t *w, const sc_t *ws, const sc_t *wm, int64_t ng, int gshift, const float *x,
                         const float *xg, int64_t K, float *sums, int64_t mt, int bits, int sgn) {
    for (int64_t m = 0; m < mt; m++) {
        float acc = 0.f;
        for (int64_t kb = 0; kb < K; kb += QB) {
            float lo = 0.f, hi = 0.f;
            for (int i = 0; i < QB; i++) {
                const float q = (float)block_q(w + kb / QB * BLOCK_BYTES(bits), bits, sgn, i);
                if (i < 16) lo += q * x[m * K + kb + i];
                else hi += q * x[m * K + kb + i];
            }
            acc += lo * sc_at(ws, kb >> gshift) + hi * sc_at(ws, (kb + 16) >> gshift);
        }
        for (int64_t j = 0; sc_some(wm) && j < ng; j++) acc += sc_at(wm, j) * xg[m * ng + j];
        sums[m] = acc;
    }
}
#endif

/* few rows (M < PANEL_ROWS): a group of 4 weight rows a task */
#if WQ_PART != 1
WQ_PART2_KERNEL void gemm_small(const float *xf, const float *xg, int64_t M, int64_t K, const uint8_t *w, int bits,
                                int sgn, int64_t G, const sc_t *ws, const sc_t *wm, const float *bias,
                                const uint16_t *res, void *out, int out_bf16, int64_t ldo, int64_t N) {
    const int64_t ng = K / G, row_bytes = row_bytes_of(bits, K), groups = (N + 3) / 4;
    const int gshift = G == 16 ? 4 : G == 32 ? 5 : G == 64 ? 6 : 7;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t n0 = 4 * g, n1 = n0 + 4 < N ? n0 + 4 : N;
#ifdef WQ_AVX2
#define SMALL(B, S, G16) small_##B##_##S##_##G16(xf, xg, M, K, w, row_bytes, ws, wm, ng, gshift, n0, n1, bias, res, out, \
                                                 out_bf16, ldo)
        const int g16 = gshift == 4;
        if (bits == 4) { if (g16) SMALL(4, 0, 1); else SMALL(4, 0, 0); }
        else if (bits == 5) { if (sgn) SMALL(5, 1, 0); else SMALL(5, 0, 0); } /* groups of 32 only */
        else if (bits == 6) SMALL(6, 1, 1);                                    /* Q6_K: signed, groups of 16 */
        else if (sgn) { if (g16) SMALL(8, 1, 1); else SMALL(8, 1, 0); }
        else { if (g16) SMALL(8, 0, 1); else SMALL(8, 0, 0); }
#undef SMALL
#else
        for (int64_t n = n0; n < n1; n++) {
            float sums[PANEL_ROWS];
            const sc_t sr = sc_row(*ws, n, ng), mr = sc_row(*wm, n, ng);
            row_scaled_p(w + n * row_bytes, &sr, &mr, ng, gshift, xf, xg, K, sums, M, bits, sgn);
            for (int64_t m = 0; m < M; m++) put(sums[m], m, n, bias, res, out, out_bf16, ldo);
        }
#endif
    }
}
#endif

/* ask for the bytes [lo, hi) of rows n0 .. n1 of a [N, row] byte array ahead of their use: a task reads its rows a
 * chunk at a time, 16 or 32 short pieces far apart, which the hardware prefetchers do not follow */
static inline void prefetch_rows(const void *base, int64_t row, int64_t n0, int64_t n1, int64_t lo, int64_t hi) {
    for (int64_t n = n0; n < n1; n++)
        for (int64_t b = (lo & ~(int64_t)63); b < hi; b += 64) __builtin_prefetch((const char *)base + n * row + b);
}

static void gemm_panels(const float *xf, int64_t M, int64_t K, const uint8_t *w, int bits, int sgn, int64_t G,
                        const sc_t *scales, const sc_t *mins, const float *bias, const uint16_t *res, void *out,
                        int out_bf16, int64_t ldo, int64_t N) {
    const int64_t ng = K / G, row_bytes = row_bytes_of(bits, K);
    const int64_t sb = scales->f ? 4 : scales->h ? 2 : 1; /* bytes a scale (or min) as stored */
#define SC_BASE(s) ((s)->f ? (const void *)(s)->f : (s)->h ? (const void *)(s)->h : (const void *)(s)->b)
    const void *sv = SC_BASE(scales), *mv = SC_BASE(mins);
#undef SC_BASE
    const int gshift = G == 16 ? 4 : G == 32 ? 5 : G == 64 ? 6 : 7;
    const int64_t panels = (N + 15) / 16, chunks = (K + KC - 1) / KC;
    /* blocks of rows for the micro-kernel: 5 or 6 rows keep the FMA units busy, fewer wait on the FMA latency; so
     * as even as can be while all have 5 or 6 (32 rows: 6, 6, 5, 5, 5, 5, not 5 x 6 and 2), else 6s and the rest
     * (8 rows: 6 and 2, faster than 4 and 4) */
    const int64_t blocks = (M + 5) / 6, short_by = blocks * 6 - M, even = M >= 5 * blocks;
#pragma omp parallel
    {
        float *P = (float *)aligned_alloc(64, KC * 16 * sizeof(float));
        float *acc = (float *)aligned_alloc(64, (size_t)(M * 16) * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            const int64_t n0 = p * 16, nr = N - n0 < 16 ? N - n0 : 16;
            memset(acc, 0, (size_t)(M * 16) * sizeof(float));
            for (int64_t c = 0; c < chunks; c++) {
                const int64_t k0 = c * KC, kc = K - k0 < KC ? K - k0 : KC;
                { /* the next chunk's weights, scales and mins (or the next panel's first) */
                    const int64_t pn = c + 1 < chunks ? n0 : n0 + 16, pk = c + 1 < chunks ? k0 + kc : 0;
                    const int64_t pn1 = pn + 16 < N ? pn + 16 : N, pk1 = K - pk < KC ? K : pk + KC;
                    prefetch_rows(w, row_bytes, pn, pn1, pk / QB * BLOCK_BYTES(bits), pk1 / QB * BLOCK_BYTES(bits));
                    prefetch_rows(sv, ng * sb, pn, pn1, (pk / G) * sb, (pk1 / G) * sb);
                    if (mv) prefetch_rows(mv, ng * sb, pn, pn1, (pk / G) * sb, (pk1 / G) * sb);
                }
                deq_panel(w, bits, sgn, row_bytes, scales, mins, ng, gshift, N, n0, k0, kc, P);
                for (int64_t b = 0, m0 = 0; b < blocks; b++) {
                    const int64_t mb = even ? 6 - short_by / blocks - (b >= blocks - short_by % blocks)
                                            : M - m0 < 6 ? M - m0 : 6;
                    qmicro(mb, xf + m0 * K + k0, K, P, kc, acc + m0 * 16);
                    m0 += mb;
                }
            }
            for (int64_t m = 0; m < M; m++)
                for (int64_t j = 0; j < nr; j++) put(acc[m * 16 + j], m, n0 + j, bias, res, out, out_bf16, ldo);
        }
        free(P);
        free(acc);
    }
}

/* the sc_t of scales (or mins) v [N, K / G] in format fmt (SC_*): float32, float16, or bytes (signed: sgn) times
 * sup [N, K / 256] */
static sc_t sc_of(const void *v, const float *sup, int fmt, int sgn, int64_t G) {
    sc_t s = {NULL, NULL, NULL, NULL, sgn, 0, NULL};
    if (!v) return s;
    if (fmt == SC_E8M0) {
        s.e = (const uint8_t *)v;
        return s;
    }
    if (fmt != SC_TWO_LEVEL) {
        if (fmt == SC_F16) s.h = (const uint16_t *)v;
        else s.f = (const float *)v;
        return s;
    }
    s.b = (const uint8_t *)v;
    s.sup = sup;
    for (int64_t per = 256 / G; per > 1; per >>= 1) s.shift++;
    return s;
}

/* ------------------------------------------------ K-quants below INT8_ROWS_K rows: int8 activations per 256
 *
 * For the two-level layouts (Q4_K, Q5_K, Q6_K) below INT8_ROWS_K rows (decoding), as llama.cpp multiplies them:
 * each input row is rounded to int8 with one scale per 256 values (a super-block: max|x| / 127, llama.cpp's Q8_K),
 * so a whole super-block sums in 32-bit integers: per 32-block, maddubs of the weight bytes (unsigned, or |w| with
 * x's signs moved over) and x's, then madd with the block's integer scale (two for G = 16); the super-block's sum is
 * turned to float32 once and scaled by sup * x's scale. The mins meet the integer sums of x's rounded values over
 * their groups. About a third of the instructions a weight of the float32 path's, so a few rows stream the weights at
 * memory speed instead of being bound by the widening. Every row's result depends only on that row.
 * No overflow: |w| <= 32 (Q6_K), <= 31 (Q5_K), <= 15 (Q4_K), |x| <= 127, so maddubs' pair sums stay within int16
 * (<= 8128), and the super-block's integer sum within 2^31 (scales <= 127). */
#ifdef WQ_AVX2
#define KS 256
enum { NIBBLES_256 = 1, NIBBLES_512 = 2 }; /* quantize_rows_k's layouts of x for 4-bit weights */

/* where a 32-block's half hi (values 16 hi .. 16 hi + 15) of block b lies in its 256 (quantize_rows_k's layouts) */
static inline int rows_k_at(int nibbles, int b, int hi) {
    const int p = b / 2, h = b % 2;
    return nibbles == NIBBLES_512 ? 128 * (p / 2) + 64 * hi + 32 * (p % 2) + 16 * h
           : nibbles          ? 64 * p + 32 * hi + 16 * h
                              : b * QB + 16 * hi;
}

#ifdef WQ_512
static inline __m512 load16_ps(const void *x, int x_bf16, int64_t at) {
    if (!x_bf16) return _mm512_loadu_ps((const float *)x + at);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + at));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* one row's 256 values from x + at: rounded to int8 at their places in q, returns amax; the sums per 32 in sums */
static inline float round_256(const void *x, int x_bf16, int64_t at, int nibbles, int8_t *q, int32_t *sums) {
    __m512 v[KS / 16];
    __m512 mx = _mm512_setzero_ps();
    for (int i = 0; i < KS / 16; i++) {
        v[i] = load16_ps(x, x_bf16, at + 16 * i);
        mx = _mm512_max_ps(mx, _mm512_abs_ps(v[i]));
    }
    const float amax = _mm512_reduce_max_ps(mx);
    const __m512 id = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    for (int b = 0; b < KS / QB; b++) { /* cvtps rounds to nearest even, as lrintf */
        const __m512i lo = _mm512_cvtps_epi32(_mm512_mul_ps(v[2 * b], id));
        const __m512i hi = _mm512_cvtps_epi32(_mm512_mul_ps(v[2 * b + 1], id));
        _mm_storeu_si128((__m128i *)(q + rows_k_at(nibbles, b, 0)), _mm512_cvtepi32_epi8(lo));
        _mm_storeu_si128((__m128i *)(q + rows_k_at(nibbles, b, 1)), _mm512_cvtepi32_epi8(hi));
        sums[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(lo, hi));
    }
    return amax;
}
#else
static inline __m256 load8_ps(const void *x, int x_bf16, int64_t at) {
    if (!x_bf16) return _mm256_loadu_ps((const float *)x + at);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + at));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* one row's 256 values from x + at: rounded to int8 at their places in q, returns amax; the sums per 32 in sums */
static inline float round_256(const void *x, int x_bf16, int64_t at, int nibbles, int8_t *q, int32_t *sums) {
    __m256 v[KS / 8];
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 mx = _mm256_setzero_ps();
    for (int i = 0; i < KS / 8; i++) {
        v[i] = load8_ps(x, x_bf16, at + 8 * i);
        mx = _mm256_max_ps(mx, _mm256_and_ps(v[i], abs));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
    const __m256 id = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int b = 0; b < KS / QB; b++) { /* cvtps rounds to nearest even, as lrintf; |values| <= 127: no saturation */
        __m256i i32[4];
        for (int j = 0; j < 4; j++) i32[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[4 * b + j], id));
        const __m256i w01 = _mm256_packs_epi32(i32[0], i32[1]), w23 = _mm256_packs_epi32(i32[2], i32[3]);
        const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23), order);
        _mm_storeu_si128((__m128i *)(q + rows_k_at(nibbles, b, 0)), _mm256_castsi256_si128(bytes));
        _mm_storeu_si128((__m128i *)(q + rows_k_at(nibbles, b, 1)), _mm256_extracti128_si256(bytes, 1));
        const __m256i t = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
        __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4e));
        sums[b] = _mm_cvtsi128_si32(_mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xb1)));
    }
    return amax;
}
#endif

/* rows of x [M, K] -> int8 xq [M, K], one scale a 256 xd [M, K / 256], and per 32 the sums of xq, xb [M, K / 32].
 * nibbles: each pair of 32-blocks (A, B) laid out as A 0-15, B 0-15, A 16-31, B 16-31, the order in which a 32-byte
 * load of the two blocks' nibbles gives their weights (low nibbles, then high ones); NIBBLES_512: two pairs a 64-byte
 * load (rows_k_at). Each value is lrintf(x * 127 / amax of its 256), in vectors. */
static void quantize_rows_k(const void *x, int x_bf16, int64_t M, int64_t K, int nibbles, int8_t *xq, float *xd,
                            int32_t *xb) {
#pragma omp parallel for schedule(static) if (M * K >= (1 << 16))
    for (int64_t m = 0; m < M; m++)
        for (int64_t s0 = 0; s0 < K; s0 += KS) {
            const float amax = round_256(x, x_bf16, m * K + s0, nibbles, xq + m * K + s0, xb + m * (K / QB) + s0 / QB);
            xd[m * (K / KS) + s0 / KS] = amax / 127.f;
        }
}

/* shuffle control: int16 scale 2p of a vector in every int16 of the low lane, 2p + 1 in the high lane */
static inline __m256i pair_scale_shuffle(int p) {
    const __m128i a = _mm_set1_epi16((int16_t)(0x0100 + 0x0202 * (2 * p)));
    const __m128i b = _mm_set1_epi16((int16_t)(0x0100 + 0x0202 * (2 * p + 1)));
    return _mm256_set_m128i(b, a);
}

/* shuffle control: int16 scale a of a vector in every int16 of the low lane, b in the high lane */
static inline __m256i lane_scale_shuffle(int a, int b) {
    return _mm256_set_m128i(_mm_set1_epi16((int16_t)(0x0100 + 0x0202 * b)), _mm_set1_epi16((int16_t)(0x0100 + 0x0202 * a)));
}

/* lane m of v in every lane */
static inline __attribute__((always_inline)) __m256 lane256(__m128 v, int m) {
    return m ? _mm256_permutevar8x32_ps(_mm256_castps128_ps256(v), _mm256_set1_epi32(m)) : _mm256_broadcastss_ps(v);
}

/* a super-block's 8 integer mins (bytes) as float32 */
static inline __attribute__((always_inline)) __m256 mins8(const uint8_t *b) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)b)));
}

/* sums[m] = x_m . w for one weight row (two-level scales ws, mins wm) and mt (1..4) input rows; bits 4, and Q6_K's
 * values (6 bits, or 8 signed with G 16): x as quantize_rows_k lays it out for nibbles. xd: the 4-row block's
 * super-block scales, [K / 256][4] as gemm_k lays them out; xb: x's block sums as float32, [mt, K / 32]; xs (Q6_K):
 * x's sums per 16-group, [mt, K / 16]. Q6_K's bounds: vpmaddubsw's pair sums <= 2 * 63 * 127 = 16002 (no
 * saturation), a lane gains <= 4 * 16002 * 128 a step, 4 steps a super-block, and the 32s' correction is <= 32 * 2 *
 * 2032 * 128: within 2^31. */
static inline __attribute__((always_inline)) void row_k(const uint8_t *w, const sc_t *ws, const sc_t *wm,
                                                        const int8_t *xq, const float *xd, const float *xb,
                                                        const int16_t *xs, int64_t K, float sums[4], const int mt,
                                                        const int bits, const int sgn, const int g16) {
    __m256 acc[4];
    for (int m = 0; m < mt; m++) acc[m] = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const int per = g16 ? 16 : 8; /* groups a super-block */
    for (int64_t sb = 0; sb < K / KS; sb++) {
        const int64_t k0 = sb * KS;
        for (int o = 0; o < KS * bits / 8; o += 64) prefetch_near_far(w + (k0 * bits) / 8 + o);
        __m256i isum[4];
        for (int m = 0; m < mt; m++) isum[m] = _mm256_setzero_si256();
        /* the super-block's integer scales as int16, in both 128-bit lanes (16 for G = 16: two vectors); a block's
         * scale vector is one byte shuffle of them */
        const uint8_t *scb = ws->b + sb * per;
        const __m128i s8 = g16 ? _mm_loadu_si128((const __m128i *)scb) : _mm_loadl_epi64((const __m128i *)scb);
        const __m256i slo = _mm256_broadcastsi128_si256(sgn ? _mm_cvtepi8_epi16(s8) : _mm_cvtepu8_epi16(s8));
        const __m256i shi = g16 ? _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_srli_si128(s8, 8))) : slo;
        if (bits == 4) { /* a pair of blocks (A, B) a step: one 32-byte load, x laid out to match (quantize_rows_k) */
            for (int p = 0; p < 4; p++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(w + k0 / 2 + 32 * p));
                const __m256i lo = _mm256_and_si256(raw, low4);                        /* A 0-15, B 0-15 */
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4); /* A 16-31, B 16-31 */
                const __m256i sc = _mm256_shuffle_epi8(slo, pair_scale_shuffle(p));    /* A's lanes | B's */
                for (int m = 0; m < mt; m++) {
                    const int8_t *xp = xq + m * K + k0 + 64 * p;
                    const __m256i a = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xp));
                    const __m256i b = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xp + 32)));
                    /* a lane of a and of b: the same block, so the same scale; |a + b| <= 4 * 15 * 127 */
                    isum[m] = _mm256_add_epi32(isum[m], _mm256_madd_epi16(_mm256_add_epi16(a, b), sc));
                }
            }
        } else if (sgn) { /* Q6_K (6 bits, or a byte a weight: values -32..31; G = 16) */
            /* a pair of blocks (A, B) a step as for 4 bits (x laid out to match), q + 32 unsigned (0..63); the 32s
             * come off per 16-group below, from x's group sums xs. The same integer lanes for both layouts. */
            const __m256i m30 = _mm256_set1_epi8(0x30), shifts = _mm256_setr_epi64x(0, 2, 0, 2);
            for (int p = 0; p < 4; p++) {
                __m256i qlo, qhi; /* A 0-15, B 0-15; A 16-31, B 16-31 */
                if (bits == 6) {
                    const uint8_t *a = w + (k0 / QB + 2 * p) * BLOCK_BYTES(6); /* A; B at a + 24 */
                    const __m256i raw = _mm256_inserti128_si256(
                        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                        _mm_loadu_si128((const __m128i *)(a + 24)), 1);
                    /* A's top bits twice, B's twice (a + 16: A's 8 bytes, B's nibbles, B's 8), shifted so that each
                     * byte's bits 0-1 are its low-nibble weight's, bits 4-5 its high-nibble weight's */
                    int64_t ha, hb;
                    memcpy(&ha, a + 16, 8);
                    memcpy(&hb, a + 40, 8);
                    const __m256i h = _mm256_srlv_epi64(
                        _mm256_blend_epi32(_mm256_set1_epi64x(ha), _mm256_set1_epi64x(hb), 0xF0), shifts);
                    qlo = _mm256_or_si256(_mm256_and_si256(raw, low4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m30));
                    qhi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low4), _mm256_and_si256(h, m30));
                } else {
                    const uint8_t *a = w + (k0 / QB + 2 * p) * BLOCK_BYTES(8);
                    const __m256i b32 = _mm256_set1_epi8(32);
                    qlo = _mm256_add_epi8(_mm256_inserti128_si256(
                        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                        _mm_loadu_si128((const __m128i *)(a + 32)), 1), b32);
                    qhi = _mm256_add_epi8(_mm256_inserti128_si256(
                        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(a + 16))),
                        _mm_loadu_si128((const __m128i *)(a + 48)), 1), b32);
                }
                const __m256i sv = p < 2 ? slo : shi; /* groups 4p .. 4p + 3: A's two, then B's */
                const __m256i sca = _mm256_shuffle_epi8(sv, lane_scale_shuffle(4 * p % 8, 4 * p % 8 + 2));
                const __m256i scb = _mm256_shuffle_epi8(sv, lane_scale_shuffle(4 * p % 8 + 1, 4 * p % 8 + 3));
                for (int m = 0; m < mt; m++) {
                    const int8_t *xp = xq + m * K + k0 + 64 * p;
                    const __m256i pa = _mm256_maddubs_epi16(qlo, _mm256_loadu_si256((const __m256i *)xp));
                    const __m256i pb = _mm256_maddubs_epi16(qhi, _mm256_loadu_si256((const __m256i *)(xp + 32)));
                    isum[m] = _mm256_add_epi32(isum[m],
                                               _mm256_add_epi32(_mm256_madd_epi16(pa, sca), _mm256_madd_epi16(pb, scb)));
                }
            }
            /* q - 32: 32 x each group's scale x its sum of x, in integers */
            const __m256i s16 = _mm256_cvtepi8_epi16(s8);
            for (int m = 0; m < mt; m++) {
                const __m256i g = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(xs + m * (K / 16) + sb * 16)), s16);
                isum[m] = _mm256_sub_epi32(isum[m], _mm256_slli_epi32(g, 5));
            }
        } else { /* unsigned bytes, G = 32 (Q5_K) */
#pragma GCC unroll 8
            for (int j = 0; j < KS / QB; j++) { /* unrolled: each block's scale shuffle a constant */
                const int64_t kb = k0 + j * QB;
                const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + kb));
                const __m256i sc = _mm256_shuffle_epi8(slo, _mm256_set1_epi16((int16_t)(0x0100 + 0x0202 * j)));
                for (int m = 0; m < mt; m++) {
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + m * K + kb));
                    isum[m] = _mm256_add_epi32(isum[m], _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), sc));
                }
            }
        }
        /* the super-block's scales for the mt rows at once (d x dx, dmin x dx: the scalar products, lane by lane);
         * the mins: their 8 products with x's block sums (float32, exact: integers below 2^24) formed together and
         * added to the products' lanes, scaled per super-block: no horizontal sum until the row's end */
        const __m128 dx4 = _mm_loadu_ps(xd + sb * 4);
        const __m128 dd = _mm_mul_ps(_mm_set1_ps(ws->sup[sb]), dx4);
        const __m128 dm = wm->b ? _mm_mul_ps(_mm_set1_ps(wm->sup[sb]), dx4) : dd;
        const __m256 mb = wm->b ? mins8(wm->b + sb * 8) : _mm256_setzero_ps();
        for (int m = 0; m < mt; m++) {
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m]), lane256(dd, m), acc[m]);
            if (wm->b)
                acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(mb, _mm256_loadu_ps(xb + m * (K / QB) + sb * 8)),
                                         lane256(dm, m), acc[m]);
        }
    }
    for (int m = 0; m < mt; m++) sums[m] = hsum(acc[m]);
}

#if defined(__AVX512BW__) && defined(__AVX512F__)
/* two consecutive int6 blocks (48 bytes at p) as 64 signed bytes: with VBMI, two byte permutes place the nibbles and
 * the top bits' bytes, one 64-bit variable shift brings each quarter's bit pair down; else block_bytes twice */
static inline __attribute__((always_inline)) __m512i blocks6_512(const uint8_t *p) {
#if defined(__AVX512VBMI__)
    static const uint8_t nib_at[64] __attribute__((aligned(64))) = {
        0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15, 0,  1,  2,  3,  4,  5,  6,  7,  8,  9,
        10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 24, 25, 26, 27,
        28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39};
    static const uint8_t top_at[64] __attribute__((aligned(64))) = {
        16, 17, 18, 19, 20, 21, 22, 23, 16, 17, 18, 19, 20, 21, 22, 23, 16, 17, 18, 19, 20, 21, 22, 23, 16, 17,
        18, 19, 20, 21, 22, 23, 40, 41, 42, 43, 44, 45, 46, 47, 40, 41, 42, 43, 44, 45, 46, 47, 40, 41, 42, 43,
        44, 45, 46, 47, 40, 41, 42, 43, 44, 45, 46, 47};
    const __m512i v = _mm512_maskz_loadu_epi8((__mmask64)0xFFFFFFFFFFFFULL, p); /* 48 bytes, no read past them */
    __m512i n = _mm512_permutexvar_epi8(_mm512_load_si512((const void *)nib_at), v);
    n = _mm512_and_si512(_mm512_mask_srli_epi16(n, (__mmask32)0xFF00FF00u, n, 4), _mm512_set1_epi8(0x0F));
    __m512i h = _mm512_permutexvar_epi8(_mm512_load_si512((const void *)top_at), v);
    h = _mm512_srlv_epi64(h, _mm512_set_epi64(6, 4, 2, 0, 6, 4, 2, 0));
    h = _mm512_slli_epi16(_mm512_and_si512(h, _mm512_set1_epi8(3)), 4);
    return _mm512_sub_epi8(_mm512_or_si512(n, h), _mm512_set1_epi8(32));
#else
    return _mm512_inserti64x4(_mm512_castsi256_si512(block_bytes(p, 6, 1)), block_bytes(p + 24, 6, 1), 1);
#endif
}

/* lane m of v in every lane */
static inline __attribute__((always_inline)) __m512 lane512(__m128 v, int m) {
    return m ? _mm512_permutexvar_ps(_mm512_set1_epi32(m), _mm512_castps128_ps512(v)) : _mm512_broadcastss_ps(v);
}

/* acc + the pairwise products of int16 a and b summed in int32: vpdpwssd with VNNI where several rows' sums
 * interleave (the same integers; one row's chain of them waits on its latency) */
static inline __attribute__((always_inline)) __m512i madd_acc512(__m512i acc, __m512i a, __m512i b, const int mt) {
#if defined(__AVX512VNNI__)
    if (mt > 1) return _mm512_dpwssd_epi32(acc, a, b);
#endif
    (void)mt;
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
}

/* row_k with 64-byte steps (AVX-512BW): half the instructions a weight. A step's products take their scales by one
 * permute of the super-block's integer scales: int16 lane l of the step's pair sums gets scale first + l / span.
 * 4-bit: two pairs of blocks a step (x as quantize_rows_k's NIBBLES_512 lays it out); 8-bit: two 32-blocks or four
 * 16-groups a step, signs moved onto x by a masked negation. The mins: their 8 products with x's block sums (float32,
 * exact) formed together, scaled per super-block. Every row's result depends only on that row. */
static inline __attribute__((always_inline)) void row_k512(const uint8_t *w, const sc_t *ws, const sc_t *wm,
                                                           const int8_t *xq, const float *xd, const float *xb,
                                                           const int16_t *xs, int64_t K, float sums[4], const int mt,
                                                           const int bits, const int sgn, const int g16) {
    (void)xs; /* 6 bits are signed bytes here (blocks6_512) */
    __m512 acc[4];
    __m256 macc[4];
    for (int m = 0; m < mt; m++) {
        acc[m] = _mm512_setzero_ps();
        macc[m] = _mm256_setzero_ps();
    }
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const int per = g16 ? 16 : 8;         /* groups a super-block */
    const int steps = bits == 4 ? 2 : 4; /* 64-weight-pair or 64-weight steps a super-block */
    const int stride = bits == 4 || g16 ? 4 : 2, shift = bits == 4 || g16 ? 3 : 4;
    const __m512i iota = _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14,
                                          13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i sidx[4];
    for (int c = 0; c < steps; c++)
        sidx[c] = _mm512_add_epi16(_mm512_set1_epi16((int16_t)(stride * c)), _mm512_srli_epi16(iota, shift));
    for (int64_t sb = 0; sb < K / KS; sb++) {
        const int64_t k0 = sb * KS;
        const uint8_t *wb = w + (k0 * bits) / 8;
        for (int o = 0; o < KS * bits / 8; o += 64) prefetch_near_far(wb + o);
        __m512i isum[4];
        for (int m = 0; m < mt; m++) isum[m] = _mm512_setzero_si512();
        const uint8_t *scb = ws->b + sb * per;
        const __m512i s16 =
            g16 ? _mm512_zextsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)scb)))
                : _mm512_zextsi128_si512(sgn ? _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)scb))
                                             : _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)scb)));
        if (bits == 4) {
            for (int c = 0; c < 2; c++) {
                const __m512i raw = _mm512_loadu_si512((const void *)(wb + 64 * c));
                const __m512i lo = _mm512_and_si512(raw, low4);
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
                const __m512i sc = _mm512_permutexvar_epi16(sidx[c], s16);
                for (int m = 0; m < mt; m++) {
                    const int8_t *xp = xq + m * K + k0 + 128 * c;
                    const __m512i a = _mm512_maddubs_epi16(lo, _mm512_loadu_si512((const void *)xp));
                    const __m512i b = _mm512_maddubs_epi16(hi, _mm512_loadu_si512((const void *)(xp + 64)));
                    /* a lane of a and of b: the same block, so the same scale; |a + b| <= 4 * 15 * 127 */
                    isum[m] = madd_acc512(isum[m], _mm512_add_epi16(a, b), sc, mt);
                }
            }
        } else {
            for (int c = 0; c < 4; c++) {
                const __m512i wv = bits == 6 ? blocks6_512(wb + 48 * c) /* Q6_K: signed */
                                             : _mm512_loadu_si512((const void *)(wb + 64 * c));
                const __m512i wu = sgn ? _mm512_abs_epi8(wv) : wv;
                const __mmask64 neg = sgn ? _mm512_movepi8_mask(wv) : 0;
                const __m512i sc = _mm512_permutexvar_epi16(sidx[c], s16);
                for (int m = 0; m < mt; m++) {
                    __m512i xv = _mm512_loadu_si512((const void *)(xq + m * K + k0 + 64 * c));
                    if (sgn) xv = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
                    isum[m] = madd_acc512(isum[m], _mm512_maddubs_epi16(wu, xv), sc, mt);
                }
            }
        }
        /* the super-block's scales for the mt rows at once (d x dx, dmin x dx: the scalar products, lane by lane) */
        const __m128 dx4 = _mm_loadu_ps(xd + sb * 4);
        const __m128 dd = _mm_mul_ps(_mm_set1_ps(ws->sup[sb]), dx4);
        for (int m = 0; m < mt; m++)
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m]), lane512(dd, m), acc[m]);
        if (wm->b) { /* the mins' products with the block sums, in float32 (exact: integers below 2^24) */
            const __m128 dm = _mm_mul_ps(_mm_set1_ps(wm->sup[sb]), dx4);
            const __m256 mb = mins8(wm->b + sb * 8);
            for (int m = 0; m < mt; m++)
                macc[m] = _mm256_fmadd_ps(_mm256_mul_ps(mb, _mm256_loadu_ps(xb + m * (K / QB) + sb * 8)),
                                          lane256(dm, m), macc[m]);
        }
    }
    for (int m = 0; m < mt; m++) sums[m] = _mm512_reduce_add_ps(acc[m]) + (wm->b ? hsum(macc[m]) : 0.f);
}
#define ROW_K row_k512
#define NIBBLES NIBBLES_512
#define NIBBLES6 0 /* row_k512 reads 6-bit blocks as signed bytes, x in order */
#else
#define ROW_K row_k
#define NIBBLES NIBBLES_256
#define NIBBLES6 NIBBLES_256 /* row_k reads 6-bit blocks in pairs, as 4-bit ones */
#endif

#define KROWS_FN(B, S, G16)                                                                                       \
    static __attribute__((noinline)) void krows_##B##_##S##_##G16(                                                 \
        const int8_t *xq, const float *xd, const float *xb, const int16_t *xs, int64_t M, int64_t K,             \
        const uint8_t *w, int64_t row_bytes, const sc_t *ws, const sc_t *wm, int64_t ng, int64_t n0, int64_t n1, \
        const float *bias, const uint16_t *res, void *out, int out_bf16, int64_t ldo) {                          \
        for (int64_t n = n0; n < n1; n++)                                                                         \
            for (int64_t m0 = 0; m0 < M; m0 += 4) {                                                               \
                const int64_t mt = M - m0 < 4 ? M - m0 : 4;                                                       \
                const sc_t sr = sc_row(*ws, n, ng), mr = sc_row(*wm, n, ng);                                      \
                const uint8_t *wn = w + n * row_bytes;                                                            \
                const int8_t *xm = xq + m0 * K;                                                                   \
                const float *dm = xd + m0 * (K / KS); /* 4-row block m0 / 4 of gemm_k's layout (m0: 4 at a time) */ \
                const float *bm = xb + m0 * (K / QB);                                                             \
                const int16_t *sm = xs ? xs + m0 * (K / 16) : NULL;                                              \
                float sums[4];                                                                                    \
                if (mt == 4) ROW_K(wn, &sr, &mr, xm, dm, bm, sm, K, sums, 4, B, S, G16);                          \
                else if (mt == 3) ROW_K(wn, &sr, &mr, xm, dm, bm, sm, K, sums, 3, B, S, G16);                     \
                else if (mt == 2) ROW_K(wn, &sr, &mr, xm, dm, bm, sm, K, sums, 2, B, S, G16);                     \
                else ROW_K(wn, &sr, &mr, xm, dm, bm, sm, K, sums, 1, B, S, G16);                                  \
                for (int64_t i = 0; i < mt; i++) put(sums[i], m0 + i, n, bias, res, out, out_bf16, ldo);          \
            }                                                                                                     \
    }
KROWS_FN(4, 0, 0) KROWS_FN(8, 1, 1) KROWS_FN(8, 0, 0) KROWS_FN(6, 1, 1)

/* auto takes the integer paths below these batch sizes, the float32 panels from them on. Measured on a 2-core AMD
 * EPYC (Zen 1, AVX2, no VNNI: its slowest integer units) with bench_qgemm.py, 1B shapes, time of the integer path
 * over the panels': the K-quants 0.63-0.75x at 10 rows, 0.81-1.08x at 16, 0.87-1.17x at 24; 8-bit blocks 0.75-0.94x
 * at 10, 0.90-1.16x at 16, 1.3-1.45x at 32. CPUs with VNNI or full-width AVX2 units favour the integer paths more.
 * Where the batches go to int8 vectors instead: gemm_i8k (AVX2) took the K-quants from 32 rows (set against
 * gemm_i8v, which took them before it, as built for AVX2 on a 2-core Zen 5 EPYC, 1B shapes, Q4_K and Q6_K: gemm_k's
 * time over gemm_i8v's 0.67-0.80x at 16-20 rows, 0.79-0.97x at 24, 0.82-0.98x at 32; gemm_i8k's over gemm_k's
 * 0.81-1.05x at 16 rows, 0.88-1.10x at 24). On a 2-core Zen 3 EPYC (AVX2 only) gemm_i8k is the faster from 16
 * rows (its time over gemm_k's, Qwen3-30B-A3B's experts and dense projections and 1B shapes: Q4_K 0.74-0.80x at 16
 * rows, 0.79-0.87x at 24, 0.97-1.29x at 12, 1.36-1.95x at 8; Q6_K 0.63-0.74x, 0.69-0.78x, 0.86-0.95x, 1.20-1.35x;
 * it costs as much for 9-16 rows as for 16), so AVX2 builds take it from 16, except in a step that verifies drafts
 * (rows_exact), which keeps gemm_k below 32 rows. With AVX-512 VNNI gemm_i8k's 512-bit passes take them from 28
 * (its time over gemm_k's 0.71-1.29x at 16-24 rows, parity), set when gemm_vnni took them: it costs as much for
 * 17-32 rows as for 32 (16 input rows a vector), and gemm_k is faster up to 28 (2-core Zen 5 EPYC, 1B
 * shapes, gemm_k's time over gemm_vnni's: Q4_K 0.67-0.90x at 16 rows, 0.52-0.72x at 20, 0.75-0.79x at 24, 0.89-0.98x at
 * 28, 0.96-1.09x at 32; Q6_K 0.80-0.93x, 0.65-0.77x, 0.86-0.92x, 0.98-1.03x, 0.95-1.08x). So a few streams' speculative
 * verification steps keep one-row decoding's numbers too. */
#ifdef WQ_TILES
#define INT8_ROWS_K 28
#define INT8_ROWS_K_EXACT 28
#else
#define INT8_ROWS_K 16
#define INT8_ROWS_K_EXACT 32 /* gemm_k's rows in a step verifying drafts: each row gets one row's bits */
#endif
/* the batch size from which the K-quants leave gemm_k on this thread */
static inline int rows_k(void) { return rows_exact ? INT8_ROWS_K_EXACT : INT8_ROWS_K; }
#define INT8_ROWS_Q8_EXACT 12 /* gemm_q8's rows where a step's rows must each get one row's bits */
#ifdef WQ_TILES
#define INT8_ROWS_Q8 5 /* gemm_vnni's 16 rows a vector cost less than gemm_q8's passes from 5 rows, more below */
#else
#define INT8_ROWS_Q8 INT8_ROWS_Q8_EXACT
#endif
/* the batch size from which 8-bit blocks leave gemm_q8 on this thread */
static inline int rows_q8(void) { return rows_exact ? INT8_ROWS_Q8_EXACT : INT8_ROWS_Q8; }

/* the two-level layouts this path serves: Q4_K (4, unsigned, G 32), Q6_K (6, signed, G 16; and 8 bits, as earlier
 * conversions hold it), Q5_K (8, unsigned, 32) */
static int gemm_k_serves(int bits, int sgn, int64_t G, int sfmt, int64_t K) {
    if (sfmt != SC_TWO_LEVEL || K % KS) return 0;
    return (bits == 4 && !sgn && G == 32) || ((bits == 8 || bits == 6) && sgn && G == 16) ||
           (bits == 8 && !sgn && G == 32);
}

#if WQ_PART != 1
WQ_PART2_KERNEL void gemm_k(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, int bits, int sgn,
                            int64_t G, const sc_t *ws, const sc_t *wm, const float *bias, const uint16_t *res,
                            void *out, int out_bf16, int64_t ldo, int64_t N) {
    const int64_t ng = K / G, row_bytes = row_bytes_of(bits, K), groups = (N + 3) / 4;
    int8_t *xq = (int8_t *)malloc((size_t)(M * K));
    float *xd = (float *)malloc((size_t)(M * (K / KS)) * sizeof(float));
    int32_t *xb = (int32_t *)malloc((size_t)(M * (K / QB)) * sizeof(int32_t));
    const int q6 = bits == 6 || (bits == 8 && sgn); /* Q6_K's values, in 6 bits or a byte each */
    const int nibbles = bits == 4 ? NIBBLES : q6 ? NIBBLES6 : 0;
    quantize_rows_k(x, x_bf16, M, K, nibbles, xq, xd, xb);
    /* as row_k and row_k512 read them: each 4-row block's super-block scales side by side, the sums as float32 */
    const int64_t nsb = K / KS, nblk = K / QB;
    float *xd4 = (float *)calloc((size_t)(((M + 3) / 4) * 4 * nsb), sizeof(float));
    float *xbf = (float *)malloc((size_t)(M * nblk) * sizeof(float));
    for (int64_t m = 0; m < M; m++) {
        for (int64_t sb = 0; sb < nsb; sb++) xd4[(m / 4) * 4 * nsb + sb * 4 + m % 4] = xd[m * nsb + sb];
        for (int64_t b = 0; b < nblk; b++) xbf[m * nblk + b] = (float)xb[m * nblk + b];
    }
    /* Q6_K's values read unsigned (row_k): x's sums per 16-group, in group order (|sum| <= 16 * 127) */
    int16_t *xs = q6 && NIBBLES6 ? (int16_t *)malloc((size_t)(M * (K / 16)) * sizeof(int16_t)) : NULL;
    if (xs)
        for (int64_t m = 0; m < M; m++)
            for (int64_t sb = 0; sb < nsb; sb++)
                for (int b = 0; b < KS / QB; b++)
                    for (int hi = 0; hi < 2; hi++) {
                        const int8_t *q = xq + m * K + sb * KS + rows_k_at(nibbles, b, hi);
                        int s = 0;
                        for (int i = 0; i < 16; i++) s += q[i];
                        xs[m * (K / 16) + sb * 16 + 2 * b + hi] = (int16_t)s;
                    }
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t n0 = 4 * g, n1 = n0 + 4 < N ? n0 + 4 : N;
#define KROWS(B, S, G16) krows_##B##_##S##_##G16(xq, xd4, xbf, xs, M, K, w, row_bytes, ws, wm, ng, n0, n1, bias, \
                                                 res, out, out_bf16, ldo)
        if (bits == 4) KROWS(4, 0, 0);
        else if (bits == 6) KROWS(6, 1, 1);
        else if (sgn) KROWS(8, 1, 1);
        else KROWS(8, 0, 0);
#undef KROWS
    }
    free(xq);
    free(xd);
    free(xb);
    free(xd4);
    free(xbf);
    free(xs);
}
#endif

/* cs[m][j] = weight scale x row m's scale of blocks c .. c + 7 (fewer at the row's end) for mt input rows (xs: [mt,
 * nb] per 32): the scales of row_q8's and row_i16's integer block sums; returns how many blocks */
static inline __attribute__((always_inline)) int64_t block_scales(const sc_t *ws, const float *xs, int64_t nb,
                                                                  int64_t c, const int mt, const int sgn,
                                                                  float cs[4][8]) {
    const int64_t nblk = nb - c < 8 ? nb - c : 8;
    float wbuf[16];
    const float *wsc = chunk_scales(ws, c, nblk, sgn, wbuf);
    for (int m = 0; m < mt; m++)
        for (int64_t j = 0; j < nblk; j++) cs[m][j] = wsc[j] * xs[m * nb + c + j];
    return nblk;
}

#define Q8_SHORT_K 1024
/* Weight rows a pass side by side read as many streams, which the hardware prefetchers follow poorly here (2-core Zen
 * 3 EPYC: one row of gemm_q8's 4-row passes took 1.8x the time from memory without a software prefetch): the rows'
 * kernels ask for the rows this many passes ahead, in address order, as far as they read a pass */
#define PF_PASSES 2
/* signed blocks of 32 without mins (Q8_0, --quantization int8; Q5_0 in its 5 bits) below INT8_ROWS_Q8 rows, activations int8 per
 * 32 as llama.cpp multiplies Q8_0 by Q8_0: per block an integer dot product (dpbusd with VNNI, maddubs + madd without),
 * turned to float32 and scaled by the weight's and x's scales, formed for 8 blocks at a time. sums[r][m] for R weight
 * rows (wr[r], scales sr[r]) side by side and mt input rows: each weight row the same operations whatever R and mt
 * (one input row takes 4 weight rows a pass: a row is otherwise one chain of dependent FMAs, and a short one, as a
 * head of K 576, mostly its ends). */
static inline __attribute__((always_inline)) void rows_q8x(const uint8_t *const wr[4], const sc_t sr[4],
                                                           const int8_t *xq, const float *xs, int64_t K,
                                                           float sums[4][4], const int mt, const int R,
                                                           const int bits) {
    const int64_t nb = K / QB, rb = row_bytes_of(bits, K);
    const uint8_t *next = wr[0] + PF_PASSES * R * rb; /* R > 1: the rows ahead */
    __m256 acc[4][4];
    float cs[4][4][8];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < mt; m++) acc[r][m] = _mm256_setzero_ps();
    for (int64_t c = 0; c < nb; c += 8) {
        int64_t nblk = 0;
        for (int r = 0; r < R; r++) nblk = block_scales(&sr[r], xs, nb, c, mt, 1, cs[r]);
        for (int64_t j = 0; j < nblk; j++) {
            const int64_t kb = (c + j) * QB, at = (c + j) * BLOCK_BYTES(bits);
            if (R == 1 && j % 2 == 0) prefetch_near_far(wr[0] + at);
            if (R > 1) /* a block's bytes of R rows ahead */
                prefetch_rows(next, 0, 0, 1, (c + j) * R * BLOCK_BYTES(bits), (c + j + 1) * R * BLOCK_BYTES(bits));
            for (int r = 0; r < R; r++) {
                const __m256i wv = block_bytes(wr[r] + at, bits, 1);
                const __m256i wu = _mm256_sign_epi8(wv, wv);
                for (int m = 0; m < mt; m++) {
                    const __m256i xv = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xq + m * K + kb)), wv);
                    const __m256 p = _mm256_cvtepi32_ps(DOT_U8S8(wu, xv));
                    acc[r][m] = _mm256_fmadd_ps(p, _mm256_broadcast_ss(&cs[r][m][j]), acc[r][m]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < mt; m++) sums[r][m] = hsum(acc[r][m]);
}

/* rows n0 .. n1 (at most 4) of gemm_q8 for all M input rows: one input row of short weight rows takes them in one
 * pass (a short pass repeats its last row, whose sums are the same, and stores only the rows' own); otherwise one by
 * one (the longer rows of a 1B model read from memory faster one stream at a time) */
#define Q8ROWS_FN(BITS)                                                                                          \
    static __attribute__((noinline)) void q8rows_##BITS(const int8_t *xq, const float *xs, int64_t M, int64_t K,  \
                                                        const uint8_t *w, const sc_t *ws, int64_t n0, int64_t n1, \
                                                        const float *bias, const uint16_t *res, void *out,        \
                                                        int out_bf16, int64_t ldo) {                              \
        const int64_t nb = K / QB;                                                                                \
        const uint8_t *wr[4];                                                                                     \
        sc_t sr[4];                                                                                               \
        float sums[4][4];                                                                                         \
        if (M == 1 && K <= Q8_SHORT_K) {                                                                          \
            for (int r = 0; r < 4; r++) {                                                                         \
                const int64_t nr = n0 + r < n1 ? n0 + r : n1 - 1;                                                 \
                wr[r] = w + nr * row_bytes_of(BITS, K);                                                           \
                sr[r] = sc_row(*ws, nr, nb);                                                                      \
            }                                                                                                     \
            rows_q8x(wr, sr, xq, xs, K, sums, 1, 4, BITS);                                                        \
            for (int64_t n = n0; n < n1; n++) put(sums[n - n0][0], 0, n, bias, res, out, out_bf16, ldo);          \
            return;                                                                                               \
        }                                                                                                         \
        for (int64_t n = n0; n < n1; n++)                                                                         \
            for (int64_t m0 = 0; m0 < M; m0 += 4) {                                                               \
                const int64_t mt = M - m0 < 4 ? M - m0 : 4;                                                       \
                wr[0] = w + n * row_bytes_of(BITS, K);                                                            \
                sr[0] = sc_row(*ws, n, nb);                                                                       \
                const int8_t *xm = xq + m0 * K;                                                                   \
                const float *sm = xs + m0 * nb;                                                                   \
                if (mt == 4) rows_q8x(wr, sr, xm, sm, K, sums, 4, 1, BITS);                                       \
                else if (mt == 3) rows_q8x(wr, sr, xm, sm, K, sums, 3, 1, BITS);                                  \
                else if (mt == 2) rows_q8x(wr, sr, xm, sm, K, sums, 2, 1, BITS);                                  \
                else rows_q8x(wr, sr, xm, sm, K, sums, 1, 1, BITS);                                               \
                for (int64_t i = 0; i < mt; i++) put(sums[0][i], m0 + i, n, bias, res, out, out_bf16, ldo);       \
            }                                                                                                     \
    }
Q8ROWS_FN(8) Q8ROWS_FN(5)

static int gemm_q8_serves(int bits, int sgn, int64_t G, int sfmt, const void *mins) {
    return (bits == 8 || bits == 5) && sgn && G == QB && sfmt != SC_TWO_LEVEL && !mins;
}

#if WQ_PART != 1
WQ_PART2_KERNEL void gemm_q8(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, const int bits,
                             const sc_t *ws, const float *bias, const uint16_t *res, void *out, int out_bf16,
                             int64_t ldo, int64_t N) {
    const int64_t groups = (N + 3) / 4;
    int8_t *xq = (int8_t *)malloc((size_t)(M * K));
    float *xs = (float *)malloc((size_t)(M * (K / QB)) * sizeof(float));
    quantize_rows(x, x_bf16, M, K, QB, xq, xs, NULL, NULL);
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t n0 = 4 * g, n1 = n0 + 4 < N ? n0 + 4 : N;
        if (bits == 5) q8rows_5(xq, xs, M, K, w, ws, n0, n1, bias, res, out, out_bf16, ldo);
        else q8rows_8(xq, xs, M, K, w, ws, n0, n1, bias, res, out, out_bf16, ldo);
    }
    free(xq);
    free(xs);
}
#endif

/* One-level blocks of 32 with mins (Q4_0, Q4_1 and --quantization int4 as 4-bit; Q5_1 as 5-bit or a byte) below PANEL_ROWS
 * rows: activations rounded to int16 per 32 (step max|x| / 32767, 256 times finer than int8's: below bf16's own
 * rounding of the block's larger values), so a block's dot product is exact in int32 (madd: weights widened to
 * int16, no saturation), then scaled once by the weight's and x's scales; the mins meet the float32 group sums, as
 * on the float32 path. Widening to int16 costs half of widening to float32: the row kernels were bound by it. */
#define I16_LEVELS 32767.f

static int gemm_i16_serves(int bits, int sgn, int64_t G, int sfmt) {
    return (bits == 4 || ((bits == 5 || bits == 8) && !sgn)) && G == QB && sfmt != SC_TWO_LEVEL;
}

/* xq [M, K] = round(x / s) (to nearest even) and xs [M, K / 32] = s = max|x| / 32767 per 32 of float32 rows xf */
static void quantize_rows16(const float *xf, int64_t M, int64_t K, int16_t *xq, float *xs) {
    const int64_t nb = K / QB;
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) {
            const float *xb = xf + m * K + b * QB;
            __m256 v[4], mx = _mm256_setzero_ps();
            for (int j = 0; j < 4; j++) {
                v[j] = _mm256_loadu_ps(xb + 8 * j);
                mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[j]));
            }
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
            const __m256 id = _mm256_set1_ps(amax > 0.f ? I16_LEVELS / amax : 0.f);
            xs[m * nb + b] = amax / I16_LEVELS;
            for (int j = 0; j < 4; j += 2) { /* packs interleaves the lanes: the permute puts them back in order */
                const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));
                const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(v[j + 1], id));
                const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);
                _mm256_storeu_si256((__m256i *)(xq + m * K + b * QB + 8 * j), p);
            }
        }
}

/* sums[m] = x_m . w for one weight row (scales ws, mins wm, ng = K / 32 of each) and mt (1..4) input rows */
static inline __attribute__((always_inline)) void row_i16(const uint8_t *w, const sc_t *ws, const sc_t *wm,
                                                          const int16_t *xq, const float *xs, const float *xg,
                                                          int64_t K, float sums[4], const int mt, const int bits) {
    const int64_t nb = K / QB;
    const __m128i m4 = _mm_set1_epi8(0x0F);
    float cs[4][8];
#ifdef WQ_512
    /* a block's 32 weights widened to int16 in their order, one 512-bit register, met by x's 32 in one vpdpwssd
     * (vpmaddwd without VNNI): 16 pair sums, exact in int32, scaled once into 16 lanes (AVX2 takes two registers of
     * each, two vpmaddwd and an add). Every row the same operations: a row's sum is the same for 1 to 4 rows. */
    __m512 acc[4];
    for (int m = 0; m < mt; m++) acc[m] = _mm512_setzero_ps();
#else
    __m256 acc[4];
    for (int m = 0; m < mt; m++) acc[m] = _mm256_setzero_ps();
#endif
    for (int64_t c = 0; c < nb; c += 8) {
        const int64_t nblk = block_scales(ws, xs, nb, c, mt, 0, cs);
        for (int64_t j = 0; j < nblk; j++) {
            const int64_t kb = (c + j) * QB, at = (c + j) * BLOCK_BYTES(bits);
            if (j % 2 == 0) _mm_prefetch((const char *)(w + at + PF_AHEAD), _MM_HINT_T0);
#ifdef WQ_512
            __m512i wv;
            if (bits == 4) { /* byte i: weight i in its low nibble, i + 16 in its high one */
                const __m128i raw = _mm_loadu_si128((const __m128i *)(w + at));
                wv = _mm512_cvtepu8_epi16(_mm256_inserti128_si256(
                    _mm256_castsi128_si256(_mm_and_si128(raw, m4)), _mm_and_si128(_mm_srli_epi16(raw, 4), m4), 1));
            } else {
                wv = _mm512_cvtepu8_epi16(block_bytes(w + at, bits, 0));
            }
            for (int m = 0; m < mt; m++) {
                const __m512i xv = _mm512_loadu_si512((const void *)(xq + m * K + kb));
#ifdef __AVX512VNNI__
                const __m512i p = _mm512_dpwssd_epi32(_mm512_setzero_si512(), wv, xv);
#else
                const __m512i p = _mm512_madd_epi16(wv, xv);
#endif
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(cs[m][j]), acc[m]);
            }
#else
            __m256i lo, hi;
            if (bits == 4) { /* byte i: weight i in its low nibble, i + 16 in its high one */
                const __m128i raw = _mm_loadu_si128((const __m128i *)(w + at));
                lo = _mm256_cvtepu8_epi16(_mm_and_si128(raw, m4));
                hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), m4));
            } else {
                const __m256i q = block_bytes(w + at, bits, 0);
                lo = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(q));
                hi = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(q, 1));
            }
            for (int m = 0; m < mt; m++) {
                const int16_t *xb = xq + m * K + kb;
                const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)xb)),
                                                   _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(xb + 16))));
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(&cs[m][j]), acc[m]);
            }
#endif
        }
    }
#ifdef WQ_512
    for (int m = 0; m < mt; m++) sums[m] = _mm512_reduce_add_ps(acc[m]) + mins_dot(wm, xg + m * nb, nb);
#else
    for (int m = 0; m < mt; m++) sums[m] = hsum(acc[m]) + mins_dot(wm, xg + m * nb, nb);
#endif
}

#define I16ROWS_FN(BITS)                                                                                         \
    static __attribute__((noinline)) void i16rows_##BITS(const int16_t *xq, const float *xs, const float *xg,    \
                                                         int64_t M, int64_t K, const uint8_t *w, const sc_t *ws,  \
                                                         const sc_t *wm, int64_t n0, int64_t n1, const float *bias, \
                                                         const uint16_t *res, void *out, int out_bf16, int64_t ldo) { \
        const int64_t nb = K / QB;                                                                                \
        for (int64_t n = n0; n < n1; n++)                                                                         \
            for (int64_t m0 = 0; m0 < M; m0 += 4) {                                                               \
                const int64_t mt = M - m0 < 4 ? M - m0 : 4;                                                       \
                const sc_t sr = sc_row(*ws, n, nb), mr = sc_row(*wm, n, nb);                                      \
                const uint8_t *wn = w + n * row_bytes_of(BITS, K);                                                \
                const int16_t *xm = xq + m0 * K;                                                                  \
                const float *sm = xs + m0 * nb, *gm = xg + m0 * nb;                                               \
                float sums[4];                                                                                    \
                if (mt == 4) row_i16(wn, &sr, &mr, xm, sm, gm, K, sums, 4, BITS);                                 \
                else if (mt == 3) row_i16(wn, &sr, &mr, xm, sm, gm, K, sums, 3, BITS);                            \
                else if (mt == 2) row_i16(wn, &sr, &mr, xm, sm, gm, K, sums, 2, BITS);                            \
                else row_i16(wn, &sr, &mr, xm, sm, gm, K, sums, 1, BITS);                                         \
                for (int64_t i = 0; i < mt; i++) put(sums[i], m0 + i, n, bias, res, out, out_bf16, ldo);          \
            }                                                                                                     \
    }
I16ROWS_FN(4) I16ROWS_FN(5) I16ROWS_FN(8)

/* x [M, K] as gemm_i16 and gemm_i16b take it: int16 per 32 (*xq [M, K], *xs [M, K / 32]) and the float32 sums per
 * block (*xg), as the float32 path forms them; the caller frees the three */
static void i16_inputs(const void *x, int x_bf16, int64_t M, int64_t K, int16_t **xq, float **xs, float **xg) {
    const int64_t nb = K / QB;
    float *xf = (float *)malloc((size_t)(M * K) * sizeof(float));
    *xg = (float *)malloc((size_t)(M * nb) * sizeof(float));
    *xq = (int16_t *)malloc((size_t)(M * K) * sizeof(int16_t));
    *xs = (float *)malloc((size_t)(M * nb) * sizeof(float));
    quantize_rows(x, x_bf16, M, K, QB, NULL, NULL, *xg, xf);
    quantize_rows16(xf, M, K, *xq, *xs);
    free(xf);
}

static void gemm_i16(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, const int bits,
                     const sc_t *ws, const sc_t *wm, const float *bias, const uint16_t *res, void *out, int out_bf16,
                     int64_t ldo, int64_t N) {
    const int64_t groups = (N + 3) / 4;
    int16_t *xq;
    float *xs, *xg;
    i16_inputs(x, x_bf16, M, K, &xq, &xs, &xg);
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t n0 = 4 * g, n1 = n0 + 4 < N ? n0 + 4 : N;
        if (bits == 5) i16rows_5(xq, xs, xg, M, K, w, ws, wm, n0, n1, bias, res, out, out_bf16, ldo);
        else if (bits == 8) i16rows_8(xq, xs, xg, M, K, w, ws, wm, n0, n1, bias, res, out, out_bf16, ldo);
        else i16rows_4(xq, xs, xg, M, K, w, ws, wm, n0, n1, bias, res, out, out_bf16, ldo);
    }
    free(xg);
    free(xq);
    free(xs);
}

/* One-level 4-bit blocks of 32 with mins (Q4_0, Q4_1, --quantization int4 where not two-level) below INT8_ROWS_4
 * rows: activations int8 per 32 as llama.cpp multiplies Q4_1 by Q8_1 and as the int8 mode rounds them, each block's
 * integer dot (u8 nibbles x s8) scaled once by the weight's and x's scales, the mins met by x's float32 sums per 32.
 * Against gemm_i16 (int16 x, 32 products an instruction) a 512-bit vpdpbusd takes two blocks (64 products): its
 * row kernels were bound by their vector instructions, not by memory. Built for AVX2, two blocks a vector too: one
 * 256-bit load holds both blocks' nibbles, their low and high halves meet x laid out for it once a call
 * (i4m_pairs), and the two vpmaddubsw are summed in int16 before one vpmaddwd, one conversion and one FMA for both
 * (about half the instructions of one block a vector). I4M_R weight rows a pass, side by side: a short row (K 576:
 * 18 blocks) is otherwise one chain of dependent FMAs. With AVX-512 each row asks for its line of the next pass's
 * rows (the next rows lie right after them), a pass ahead; with AVX2 the pass asks for the rows PF_PASSES passes
 * ahead in address order. */
#ifdef WQ_512
#define I4M_R 4
#else
#define I4M_R 2 /* AVX2's 16 registers */
#endif
#define I4M_SHORT_K 1024
/* from 8 rows, gemm_vnni's 16 rows a vector cost less (AVX-512 VNNI, 135M and 1B shapes); built for AVX2, gemm_i16b's
 * int16 passes cost about the same at 8 rows and less from 12 (gemm_i8v's more than either). A step verifying drafts
 * keeps this path up to INT8_ROWS_Q8_EXACT rows: each row the bits it gets alone. (On a Zen 3 this path is faster up
 * to 11 rows, but a prompt's uncached tail of 8-11 tokens after a prefix-cache hit would then round its activations
 * otherwise than the whole prompt's prefill did, and answer otherwise: docs/quantization.md, "gemm_i4m".) */
#define INT8_ROWS_4 8
static inline int rows_4(void) { return rows_exact ? INT8_ROWS_Q8_EXACT : INT8_ROWS_4; }

static int gemm_i4m_serves(int bits, int sgn, int64_t G, int sfmt) {
    return bits == 4 && !sgn && G == QB && sfmt != SC_TWO_LEVEL;
}

/* blocks a pass of rows_i4m's loop: their scales formed together first */
#define I4M_CHUNK 32

/* 8 floats from p, n (1..8) of them, the rest 0 */
static inline __attribute__((always_inline)) __m256 floats8(const float *p, int64_t n) {
    if (n == 8) return _mm256_loadu_ps(p);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), lanes));
}

/* 8 float32 scales (or mins) of a row from block j on, n (1..8) of them, the rest 0 (never read past the n) */
static inline __attribute__((always_inline)) __m256 scales8(const sc_t *s, int64_t j, int64_t n) {
    if (s->h) {
        const uint16_t *p = s->h + j;
        if (n == 8) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        __m128i v = _mm_insert_epi16(_mm_setzero_si128(), p[0], 0); /* inserted, not stored and reloaded */
        if (n > 1) v = _mm_insert_epi16(v, p[1], 1);
        if (n > 2) v = _mm_insert_epi16(v, p[2], 2);
        if (n > 3) v = _mm_insert_epi16(v, p[3], 3);
        if (n > 4) v = _mm_insert_epi16(v, p[4], 4);
        if (n > 5) v = _mm_insert_epi16(v, p[5], 5);
        if (n > 6) v = _mm_insert_epi16(v, p[6], 6);
        return _mm256_cvtph_ps(v);
    }
    return s->f ? floats8(s->f + j, n) : _mm256_setzero_ps();
}

#ifdef WQ_512
#ifdef __AVX512VNNI__
#define DOT512_U8S8(u, s) _mm512_dpbusd_epi32(_mm512_setzero_si512(), (u), (s))
#else
#define DOT512_U8S8(u, s) _mm512_madd_epi16(_mm512_maddubs_epi16((u), (s)), _mm512_set1_epi16(1))
#endif
#endif

/* sums[r][m] = x_m . w_r for R (I4M_R, or 4) weight rows (wr[r], scales sr[r], mins mr[r]) and mt (1..4) input rows (xq int8
 * per 32, row stride K; xs their scales, xg their float32 sums per 32). Every row the same operations whatever mt:
 * a row's sum is the same for 1 to 4 input rows, and the same whichever pass and slot its weight row lands in. */
static inline __attribute__((always_inline)) void rows_i4m(const uint8_t *const wr[4], const sc_t sr[4],
                                                           const sc_t mr[4], const int8_t *xq, const float *xs,
                                                           const float *xg, int64_t K, float sums[4][4],
                                                           const int mt, const int R) {
    const int64_t nb = K / QB;
    float cs[4][4][I4M_CHUNK];
#ifdef WQ_512
    /* two blocks a vector: A's 32 weights in lanes 0-7 (4 a lane), B's in 8-15, met by x's two blocks as they lie */
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m512i pair_idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < mt; m++) acc[r][m] = _mm512_setzero_ps();
#else
    __m256 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < mt; m++) acc[r][m] = _mm256_setzero_ps();
#endif
    for (int64_t c = 0; c < nb; c += I4M_CHUNK) {
        const int64_t nblk = nb - c < I4M_CHUNK ? nb - c : I4M_CHUNK;
        for (int64_t j8 = 0; j8 < nblk; j8 += 8) { /* the chunk's scales, and its mins met by x's sums */
            const int64_t n8 = nblk - j8 < 8 ? nblk - j8 : 8;
            for (int r = 0; r < R; r++) {
                const __m256 s8 = scales8(&sr[r], c + j8, n8), m8 = scales8(&mr[r], c + j8, n8);
                for (int m = 0; m < mt; m++) {
                    _mm256_storeu_ps(&cs[r][m][j8], _mm256_mul_ps(s8, floats8(xs + m * nb + c + j8, n8)));
                    const __m256 g = _mm256_mul_ps(m8, floats8(xg + m * nb + c + j8, n8));
#ifdef WQ_512
                    acc[r][m] = _mm512_add_ps(acc[r][m], _mm512_zextps256_ps512(g));
#else
                    acc[r][m] = _mm256_add_ps(acc[r][m], g);
#endif
                }
            }
        }
        int64_t j = 0;
#ifdef WQ_512
        for (; j + 2 <= nblk; j += 2) {
            const int64_t kb = (c + j) * QB, at = (c + j) * 16;
            __m512i xv[4];
            for (int m = 0; m < mt; m++) xv[m] = _mm512_loadu_si512((const void *)(xq + m * K + kb));
            for (int r = 0; r < R; r++) {
                if (j % 4 == 0) _mm_prefetch((const char *)(wr[r] + at + R * K / 2), _MM_HINT_T0);
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(wr[r] + at)); /* byte i: i, i + 16 */
                const __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
                const __m512i lh = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); /* A lo, B lo, A hi, B hi */
                const __m512i wv = _mm512_shuffle_i64x2(lh, lh, 0xD8);                   /* A lo, A hi, B lo, B hi */
                for (int m = 0; m < mt; m++) {
                    const __m512 sc = _mm512_permutexvar_ps(
                        pair_idx, _mm512_castps128_ps512(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)&cs[r][m][j]))));
                    acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(DOT512_U8S8(wv, xv[m])), sc, acc[r][m]);
                }
            }
        }
#else
        /* two blocks a vector: their low nibbles (weights 0-15 of each) met by x's first halves, the high nibbles by
         * the second halves, as i4m_pairs lays x out; the two products summed in int16 (at most 2 * 2 * 15 * 128) */
        const __m256i m4 = _mm256_set1_epi8(0x0F);
        const __m256i pair_idx = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
        for (; j + 2 <= nblk; j += 2) {
            const int64_t kb = (c + j) * QB, at = (c + j) * 16;
            if (j % 4 == 0) /* the rows PF_PASSES passes ahead, in address order: 4 blocks' bytes of R rows */
                prefetch_rows(wr[0] + PF_PASSES * R * (K / 2), 0, 0, 1, (c + j) * R * 16, (c + j + 4) * R * 16);
            for (int r = 0; r < R; r++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(wr[r] + at)); /* blocks j, j + 1 */
                const __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
                for (int m = 0; m < mt; m++) {
                    const int8_t *xp = xq + m * K + kb;
                    const __m256i p16 =
                        _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xp)),
                                         _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xp + 32))));
                    const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
                    const __m256 sc = _mm256_permutevar8x32_ps(
                        _mm256_castps128_ps256(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)&cs[r][m][j]))),
                        pair_idx);
                    acc[r][m] = _mm256_fmadd_ps(p, sc, acc[r][m]);
                }
            }
        }
#endif
        for (; j < nblk; j++) { /* one block a vector (an odd chunk's last) */
            const int64_t kb = (c + j) * QB, at = (c + j) * 16;
            for (int r = 0; r < R; r++) {
                if (j % 4 == 0) _mm_prefetch((const char *)(wr[r] + at + R * K / 2), _MM_HINT_T0);
                const __m128i raw = _mm_loadu_si128((const __m128i *)(wr[r] + at));
                const __m256i wv = _mm256_and_si256(
                    _mm256_inserti128_si256(_mm256_castsi128_si256(raw), _mm_srli_epi16(raw, 4), 1),
                    _mm256_set1_epi8(0x0F));
                for (int m = 0; m < mt; m++) {
                    const __m256 p =
                        _mm256_cvtepi32_ps(DOT_U8S8(wv, _mm256_loadu_si256((const __m256i *)(xq + m * K + kb))));
#ifdef WQ_512
                    const __m256 v = _mm256_mul_ps(p, _mm256_set1_ps(cs[r][m][j]));
                    acc[r][m] = _mm512_add_ps(acc[r][m], _mm512_zextps256_ps512(v));
#else
                    acc[r][m] = _mm256_fmadd_ps(p, _mm256_set1_ps(cs[r][m][j]), acc[r][m]);
#endif
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < mt; m++)
#ifdef WQ_512
            sums[r][m] = _mm512_reduce_add_ps(acc[r][m]);
#else
            sums[r][m] = hsum(acc[r][m]);
#endif
}

/* rows n0 .. n1 (at most 4) of gemm_i4m for all M input rows, R weight rows a pass (a last pass short of rows
 * repeats the last one, whose sums are the same, and stores only the rows' own) */
static __attribute__((noinline)) void i4m_rows(const int8_t *xq, const float *xs, const float *xg, int64_t M,
                                               int64_t K, const uint8_t *w, const sc_t *ws, const sc_t *wm,
                                               int64_t n0, int64_t n1, const float *bias, const uint16_t *res,
                                               void *out, int out_bf16, int64_t ldo) {
    const int64_t nb = K / QB;
    /* one or two input rows of short weight rows (K <= I4M_SHORT_K): 4 weight rows a pass with AVX2 too, a pass's
     * fixed costs shared by more rows (3-4 input rows gained nothing: their sums spill); longer rows keep 2, whose
     * streams the memory serves better */
    const int R = M <= 2 && K <= I4M_SHORT_K ? 4 : I4M_R;
    for (int64_t n = n0; n < n1; n += R) {
        const uint8_t *wr[4];
        sc_t sr[4], mr[4];
        for (int r = 0; r < R; r++) {
            const int64_t nr = n + r < n1 ? n + r : n1 - 1;
            wr[r] = w + nr * row_bytes_of(4, K);
            sr[r] = sc_row(*ws, nr, nb);
            mr[r] = sc_row(*wm, nr, nb);
        }
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int64_t mt = M - m0 < 4 ? M - m0 : 4;
            const int8_t *xm = xq + m0 * K;
            const float *sm = xs + m0 * nb, *gm = xg + m0 * nb;
            float sums[4][4];
            if (R == 4 && mt == 1) rows_i4m(wr, sr, mr, xm, sm, gm, K, sums, 1, 4);
            else if (R == 4 && mt == 2) rows_i4m(wr, sr, mr, xm, sm, gm, K, sums, 2, 4);
            else if (mt == 4) rows_i4m(wr, sr, mr, xm, sm, gm, K, sums, 4, I4M_R);
            else if (mt == 3) rows_i4m(wr, sr, mr, xm, sm, gm, K, sums, 3, I4M_R);
            else if (mt == 2) rows_i4m(wr, sr, mr, xm, sm, gm, K, sums, 2, I4M_R);
            else rows_i4m(wr, sr, mr, xm, sm, gm, K, sums, 1, I4M_R);
            for (int64_t r = 0; r < R && n + r < n1; r++)
                for (int64_t i = 0; i < mt; i++) put(sums[r][i], m0 + i, n + r, bias, res, out, out_bf16, ldo);
        }
    }
}

#ifndef WQ_512
/* x's int8 rows [M, K] laid out in place for rows_i4m's AVX2 pairs: each pair of blocks (2p, 2p + 1) as the first
 * 16 values of both, then the last 16 of both; an odd last block as it is */
static void i4m_pairs(int8_t *xq, int64_t M, int64_t K) {
    const int64_t nb = K / QB;
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j + 2 <= nb; j += 2) {
            int8_t *p = xq + m * K + j * QB;
            const __m256i a = _mm256_loadu_si256((const __m256i *)p), b = _mm256_loadu_si256((const __m256i *)(p + 32));
            _mm256_storeu_si256((__m256i *)p, _mm256_permute2x128_si256(a, b, 0x20));
            _mm256_storeu_si256((__m256i *)(p + 32), _mm256_permute2x128_si256(a, b, 0x31));
        }
}
#endif

static void gemm_i4m(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, const sc_t *ws,
                     const sc_t *wm, const float *bias, const uint16_t *res, void *out, int out_bf16, int64_t ldo,
                     int64_t N) {
    const int64_t groups = (N + 3) / 4, nb = K / QB;
    int8_t *xq = (int8_t *)malloc((size_t)(M * K));
    float *xs = (float *)malloc((size_t)(M * nb) * sizeof(float));
    float *xg = (float *)malloc((size_t)(M * nb) * sizeof(float));
    quantize_rows(x, x_bf16, M, K, QB, xq, xs, NULL, NULL);
    rounded_sums(xq, xs, M, K, xg);
#ifndef WQ_512
    i4m_pairs(xq, M, K);
#endif
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t n0 = 4 * g, n1 = n0 + 4 < N ? n0 + 4 : N;
        i4m_rows(xq, xs, xg, M, K, w, ws, wm, n0, n1, bias, res, out, out_bf16, ldo);
    }
    free(xq);
    free(xs);
    free(xg);
}

/* Batches of the one-level blocks with mins (Q4_0, Q4_1, Q5_1: gemm_i16's layouts) from PANEL_ROWS rows on AVX2: x
 * rounded to int16 per 32 as gemm_i16 rounds it, 2 weight rows x 16 input rows a pass, per step of 2 values 2 loads
 * of x and 2 weight pair broadcasts feeding 4 vpmaddwd (16 products each, where the float32 panels' FMA does 8), each
 * block's exact int32 sum scaled once and its min met by x's float32 sums, as gemm_i16 does; so each row is what it is
 * alone, within float32 rounding. */
typedef struct {
    int16_t *bt; /* [mg][K / 2][16][2]: input rows 16 m0 .. 16 m0 + 15, 2 values a step (rows past M 0) */
    float *xst;  /* [mg][nb][16] their scales per block */
    float *xgt;  /* [mg][nb][16] their float32 sums per block */
} i16b_in_t;

static i16b_in_t i16b_inputs(const void *x, int x_bf16, int64_t M, int64_t K) {
    const int64_t mg = (M + 15) / 16, nb = K / QB;
    int16_t *xq;
    float *xs, *xg;
    i16_inputs(x, x_bf16, M, K, &xq, &xs, &xg);
    i16b_in_t in;
    in.bt = (int16_t *)aligned_alloc(64, (size_t)(mg * K * 16) * sizeof(int16_t));
    memset(in.bt, 0, (size_t)(mg * K * 16) * sizeof(int16_t));
    in.xst = (float *)calloc((size_t)(mg * nb * 16), sizeof(float));
    in.xgt = (float *)calloc((size_t)(mg * nb * 16), sizeof(float));
    for (int64_t m = 0; m < M; m++) {
        int16_t *tile = in.bt + (m / 16) * K * 16 + (m % 16) * 2;
        for (int64_t k = 0; k < K; k += 2) memcpy(tile + k * 16, xq + m * K + k, 4);
        for (int64_t b = 0; b < nb; b++) {
            in.xst[((m / 16) * nb + b) * 16 + m % 16] = xs[m * nb + b];
            in.xgt[((m / 16) * nb + b) * 16 + m % 16] = xg[m * nb + b];
        }
    }
    free(xg);
    free(xq);
    free(xs);
    return in;
}

/* blocks b0 .. b1 - 1 of weight rows wq[0..1] (int16, at the row's start) against 8 H input rows: c[r][h] += */
static inline __attribute__((always_inline)) void i16b_pass(const int16_t *const wq[2], const float *const wsr[2],
                                                            const float *const wmr[2], const i16b_in_t *in,
                                                            int64_t g0, int64_t K, int64_t b0, int64_t b1,
                                                            __m256 c[2][2], const int H) {
    const int64_t nb = K / QB;
    __m256 acc[2][2] = {{c[0][0], c[0][1]}, {c[1][0], c[1][1]}};
    for (int64_t b = b0; b < b1; b++) {
        const int16_t *xt = in->bt + g0 * K * 16 + b * QB * 16;
        __m256i s[2][2];
        for (int r = 0; r < 2; r++) s[r][0] = s[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 16
        for (int j = 0; j < QB / 2; j++) {
            __m256i x0 = _mm256_load_si256((const __m256i *)(xt + 32 * j));
            __m256i x1 = H == 2 ? _mm256_load_si256((const __m256i *)(xt + 32 * j + 16)) : x0;
            __asm__("" : "+x"(x0), "+x"(x1)); /* loaded once for both weight rows */
            for (int r = 0; r < 2; r++) {
                int32_t w2;
                memcpy(&w2, wq[r] + b * QB + 2 * j, 4);
                const __m256i wb = _mm256_set1_epi32(w2);
                s[r][0] = _mm256_add_epi32(s[r][0], _mm256_madd_epi16(wb, x0));
                if (H == 2) s[r][1] = _mm256_add_epi32(s[r][1], _mm256_madd_epi16(wb, x1));
                __asm__("" : "+x"(s[r][0]), "+x"(s[r][1])); /* each step's sums in registers (as gemm_i8k) */
            }
        }
        const float *xs = in->xst + (g0 * nb + b) * 16, *xg = in->xgt + (g0 * nb + b) * 16;
        for (int h = 0; h < H; h++) {
            const __m256 xsv = _mm256_loadu_ps(xs + 8 * h), xgv = _mm256_loadu_ps(xg + 8 * h);
            for (int r = 0; r < 2; r++) {
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][h]), _mm256_mul_ps(_mm256_set1_ps(wsr[r][b]), xsv),
                                            acc[r][h]);
                if (wmr[r]) acc[r][h] = _mm256_fmadd_ps(_mm256_set1_ps(wmr[r][b]), xgv, acc[r][h]);
            }
        }
    }
    for (int r = 0; r < 2; r++) c[r][0] = acc[r][0], c[r][1] = acc[r][1];
}

#ifdef WQ_512
#ifdef __AVX512VNNI__
#define I16B_DPW(s, w, x) _mm512_dpwssd_epi32(s, w, x)
#else
#define I16B_DPW(s, w, x) _mm512_add_epi32(s, _mm512_madd_epi16(w, x))
#endif
/* i16b_pass in 512-bit registers, for R weight rows against NG groups of 16 input rows (g0 ..): a step's 2 values of
 * a group's 16 rows are one load, and each weight pair meets them in one vpdpwssd (vpmaddwd + vpaddd without VNNI),
 * where 256 bits took two loads, two vpmaddwd and two vpaddd. Each x load feeds R vpdpwssd and each broadcast NG: 2 x
 * 1 is bound by its loads, so batches of 32 rows and more take 4 x 2. U sums a row and group (steps j mod U), added
 * at the end, keep R x NG x U chains in flight (a chain is bound by the instruction's latency); integer sums, so
 * the same totals, then the same float32 operations lane by lane whatever R, NG and U: the same bits.
 * c[r * 2 NG + 2 g + half]: weight row r's sums for group g's halves. */
static inline __attribute__((always_inline)) void i16b_pass_wide(const int16_t *const *wq, const float *const *wsr,
                                                                 const float *const *wmr, const i16b_in_t *in,
                                                                 int64_t g0, int64_t K, int64_t b0, int64_t b1,
                                                                 __m256 *c, const int R, const int NG, const int U) {
    const int64_t nb = K / QB;
    __m512 acc[4][2];
    for (int r = 0; r < R; r++)
        for (int g = 0; g < NG; g++)
            acc[r][g] = _mm512_insertf32x8(_mm512_castps256_ps512(c[r * 2 * NG + 2 * g]), c[r * 2 * NG + 2 * g + 1], 1);
    for (int64_t b = b0; b < b1; b++) {
        const int16_t *xt = in->bt + g0 * K * 16 + b * QB * 16;
        __m512i p[4][2][4];
        for (int r = 0; r < R; r++)
            for (int g = 0; g < NG; g++)
                for (int u = 0; u < U; u++) p[r][g][u] = _mm512_setzero_si512();
#pragma GCC unroll 16
        for (int j = 0; j < QB / 2; j++) {
            __m512i x[2];
            for (int g = 0; g < NG; g++) /* rows 0-7 then 8-15 of group g0 + g, 2 values each */
                x[g] = _mm512_load_si512((const void *)(xt + g * K * 16 + 32 * j));
            for (int r = 0; r < R; r++) {
                int32_t w2;
                memcpy(&w2, wq[r] + b * QB + 2 * j, 4);
                const __m512i wb = _mm512_set1_epi32(w2);
                for (int g = 0; g < NG; g++) p[r][g][j % U] = I16B_DPW(p[r][g][j % U], wb, x[g]);
            }
        }
        for (int g = 0; g < NG; g++) {
            const float *xs = in->xst + ((g0 + g) * nb + b) * 16, *xg = in->xgt + ((g0 + g) * nb + b) * 16;
            const __m512 xsv = _mm512_loadu_ps(xs), xgv = _mm512_loadu_ps(xg);
            for (int r = 0; r < R; r++) {
                __m512i sum = p[r][g][0];
                for (int u = 1; u < U; u++) sum = _mm512_add_epi32(sum, p[r][g][u]);
                acc[r][g] =
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(_mm512_set1_ps(wsr[r][b]), xsv), acc[r][g]);
                if (wmr[r]) acc[r][g] = _mm512_fmadd_ps(_mm512_set1_ps(wmr[r][b]), xgv, acc[r][g]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int g = 0; g < NG; g++) {
            c[r * 2 * NG + 2 * g] = _mm512_castps512_ps256(acc[r][g]);
            c[r * 2 * NG + 2 * g + 1] = _mm512_extractf32x8_ps(acc[r][g], 1);
        }
}

/* 4 weight rows against the two groups g0 and g0 + 1 (gemm_i16b where the batch has 32 rows or more) */
static __attribute__((noinline)) void i16b_pass32(const int16_t *const wq[4], const float *const wsr[4],
                                                  const float *const wmr[4], const i16b_in_t *in, int64_t g0,
                                                  int64_t K, int64_t b0, int64_t b1, __m256 c[4][4]) {
    i16b_pass_wide(wq, wsr, wmr, in, g0, K, b0, b1, &c[0][0], 4, 2, 2);
}
#endif

/* the pass for 16 input rows, and for 8 or fewer (the group's second half left out) */
static __attribute__((noinline)) void i16b_pass16(const int16_t *const wq[2], const float *const wsr[2],
                                                  const float *const wmr[2], const i16b_in_t *in, int64_t g0,
                                                  int64_t K, int64_t b0, int64_t b1, __m256 c[2][2]) {
#ifdef WQ_512
    i16b_pass_wide(wq, wsr, wmr, in, g0, K, b0, b1, &c[0][0], 2, 1, 4);
#else
    i16b_pass(wq, wsr, wmr, in, g0, K, b0, b1, c, 2);
#endif
}

static __attribute__((noinline)) void i16b_pass8(const int16_t *const wq[2], const float *const wsr[2],
                                                 const float *const wmr[2], const i16b_in_t *in, int64_t g0,
                                                 int64_t K, int64_t b0, int64_t b1, __m256 c[2][2]) {
    i16b_pass(wq, wsr, wmr, in, g0, K, b0, b1, c, 1);
}

static void gemm_i16b(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, const int bits,
                      const sc_t *ws, const sc_t *wm, const float *bias, const uint16_t *res, void *out, int out_bf16,
                      int64_t ldo, int64_t N) {
    const int64_t nb = K / QB, mg = (M + 15) / 16, tasks = (N + 15) / 16, row_bytes = row_bytes_of(bits, K);
    const int mins = wm != NULL && sc_some(wm);
    i16b_in_t in = i16b_inputs(x, x_bf16, M, K);
#pragma omp parallel
    {
        int16_t *wide = (int16_t *)aligned_alloc(64, (size_t)(16 * K) * sizeof(int16_t)); /* [16][K] */
        float *wsf = (float *)calloc((size_t)(16 * nb), sizeof(float));
        float *wmf = mins ? (float *)calloc((size_t)(16 * nb), sizeof(float)) : NULL;
        __m256 c[16][2];
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t n0 = 16 * t, nr = N - n0 < 16 ? N - n0 : 16;
            for (int i = 0; i < 16; i++) {
                if (i >= nr) { /* rows past N: zeros */
                    memset(wide + i * K, 0, (size_t)K * sizeof(int16_t));
                    continue;
                }
                row_scales(ws, n0 + i, nb, wsf + i * nb);
                if (mins) row_scales(wm, n0 + i, nb, wmf + i * nb);
                const uint8_t *wr = w + (n0 + i) * row_bytes;
                for (int64_t b = 0; b < nb; b++) {
                    __m256i lo, hi;
                    if (bits == 4) { /* byte i: weight i in its low nibble, i + 16 in its high one */
                        const __m128i raw = _mm_loadu_si128((const __m128i *)(wr + b * 16));
                        lo = _mm256_cvtepu8_epi16(_mm_and_si128(raw, _mm_set1_epi8(0x0F)));
                        hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F)));
                    } else {
                        const __m256i q = block_bytes(wr + b * BLOCK_BYTES(bits), bits, 0);
                        lo = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(q));
                        hi = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(q, 1));
                    }
                    _mm256_store_si256((__m256i *)(wide + i * K + b * QB), lo);
                    _mm256_store_si256((__m256i *)(wide + i * K + b * QB + 16), hi);
                }
            }
            int64_t g0 = 0;
#ifdef WQ_512
            for (; g0 + 1 < mg; g0 += 2) { /* two groups of 16 input rows at a time */
                __m256 cc[16][4];
                for (int i = 0; i < 16; i++) cc[i][0] = cc[i][1] = cc[i][2] = cc[i][3] = _mm256_setzero_ps();
                for (int64_t b0 = 0; b0 < nb; b0 += 8) {
                    const int64_t b1 = b0 + 8 < nb ? b0 + 8 : nb;
                    for (int r0 = 0; r0 < 16; r0 += 4) {
                        const int16_t *wq[4];
                        const float *wsr[4], *wmr[4];
                        for (int r = 0; r < 4; r++) {
                            wq[r] = wide + (r0 + r) * K;
                            wsr[r] = wsf + (r0 + r) * nb;
                            wmr[r] = mins ? wmf + (r0 + r) * nb : NULL;
                        }
                        i16b_pass32(wq, wsr, wmr, &in, g0, K, b0, b1, cc + r0);
                    }
                }
                for (int g = 0; g < 2; g++) {
                    float v[16][16] __attribute__((aligned(32)));
                    for (int i = 0; i < 16; i++)
                        _mm256_store_ps(v[i], cc[i][2 * g]), _mm256_store_ps(v[i] + 8, cc[i][2 * g + 1]);
                    const int64_t m0 = 16 * (g0 + g);
                    put16((const float(*)[16])v, M - m0 < 16 ? M - m0 : 16, nr, m0, n0, bias, res, out, out_bf16,
                          ldo);
                }
            }
#endif
            for (; g0 < mg; g0++) {
                for (int i = 0; i < 16; i++) c[i][0] = c[i][1] = _mm256_setzero_ps();
                for (int64_t b0 = 0; b0 < nb; b0 += 8) { /* 256 values of the 16 rows' x at a time: 16 KiB */
                    const int64_t b1 = b0 + 8 < nb ? b0 + 8 : nb;
                    for (int r0 = 0; r0 < 16; r0 += 2) {
                        const int16_t *wq[2] = {wide + r0 * K, wide + (r0 + 1) * K};
                        const float *wsr[2] = {wsf + r0 * nb, wsf + (r0 + 1) * nb};
                        const float *wmr[2] = {mins ? wmf + r0 * nb : NULL, mins ? wmf + (r0 + 1) * nb : NULL};
                        if (M - 16 * g0 > 8) i16b_pass16(wq, wsr, wmr, &in, g0, K, b0, b1, c + r0);
                        else i16b_pass8(wq, wsr, wmr, &in, g0, K, b0, b1, c + r0);
                    }
                }
                float v[16][16] __attribute__((aligned(32)));
                for (int i = 0; i < 16; i++) _mm256_store_ps(v[i], c[i][0]), _mm256_store_ps(v[i] + 8, c[i][1]);
                const int64_t m0 = 16 * g0;
                put16((const float(*)[16])v, M - m0 < 16 ? M - m0 : 16, nr, m0, n0, bias, res, out, out_bf16, ldo);
            }
        }
        free(wide);
        free(wsf);
        free(wmf);
    }
    free(in.bt);
    free(in.xst);
    free(in.xgt);
}

/* What the int8 tiles (AMX) and their vector counterparts (AVX-512 VNNI, AVX2) share: the input rows in the tile
 * unit's layout, and the weight rows past the last whole task. */
/* one input row (xm: its int8 values, xsm: its scales per 32, xgm: its sums per 32 or NULL) against one weight row
 * (wn, its scales sr and mins mr), the integer sums per group of G (16 or 32) scaled as the tiles' are. A function of
 * its own, one body for every caller and one pair a call: a row's last bit depended on how many rows came with it
 * where amx_tail looped over the rows itself (GCC 13 on an AMX Xeon: a row alone, by q8_exact, differed from the same
 * row in a batch, by the tiles, in the rows past their last task) */
#if defined(__GNUC__) && !defined(__clang__)
#define ONE_BODY __attribute__((noipa)) /* neither inlined nor cloned for a caller's constants */
#else
#define ONE_BODY __attribute__((noinline))
#endif
static ONE_BODY float tail_sum(const int8_t *xm, const float *xsm, const float *xgm, int64_t K, const uint8_t *wn,
                               int bits, int sgn, int64_t G, const sc_t *sr, const sc_t *mr, const int8_t *table) {
    float acc = 0.f;
    for (int64_t g = 0; g < K / G; g++) {
        int32_t dot = 0;
        const int64_t k0 = g * G, b = k0 / QB;
        const int8_t *xb = xm + k0;
        if (bits == 4 && table) /* one loop per layout: GCC 12 vectorized a select between them wrongly */
            for (int i = 0; i < 16; i++)
                dot += table[wn[b * 16 + i] & 0x0F] * (int32_t)xb[i] + table[wn[b * 16 + i] >> 4] * (int32_t)xb[i + 16];
        else if (bits == 4)
            for (int i = 0; i < 16; i++)
                dot += (wn[b * 16 + i] & 0x0F) * (int32_t)xb[i] + (wn[b * 16 + i] >> 4) * (int32_t)xb[i + 16];
        else if (bits == 5 || bits == 6)
            for (int i = 0; i < G; i++)
                dot += block_q(wn + b * BLOCK_BYTES(bits), bits, sgn, (int)(k0 % QB) + i) * (int32_t)xb[i];
        else if (sgn)
            for (int i = 0; i < G; i++) dot += (int32_t)((const int8_t *)wn)[k0 + i] * (int32_t)xb[i];
        else
            for (int i = 0; i < G; i++) dot += (int32_t)wn[k0 + i] * (int32_t)xb[i];
        acc += (float)dot * (sc_at(sr, g) * xsm[b]);
        if (mr) acc += sc_at(mr, g) * xgm[b];
    }
    return acc;
}

/* the integer sums of weight rows n0 .. n1 against every input row, one at a time, then scaled as the tiles' are:
 * the rows past the tiles' last whole task (plain C: at most 31 rows); scales per group of G (16 or 32) */
static void amx_tail(const int8_t *xq, const float *xs, const float *xg, int64_t M, int64_t K, const uint8_t *w,
                     int bits, int sgn, int64_t G, const sc_t *ws, const sc_t *wm, int64_t n0, int64_t n1,
                     const float *bias, const uint16_t *res, void *out, int out_bf16, int64_t ldo,
                     const int8_t *table) {
    const int64_t nb = K / QB, ng = K / G, row_bytes = row_bytes_of(bits, K);
    for (int64_t n = n0; n < n1; n++) {
        const sc_t sr = sc_row(*ws, n, ng), mr = wm ? sc_row(*wm, n, ng) : sr;
        for (int64_t m = 0; m < M; m++) {
            const float acc = tail_sum(xq + m * K, xs + m * nb, wm ? xg + m * nb : NULL, K, w + n * row_bytes, bits,
                                       sgn, G, &sr, wm ? &mr : NULL, table);
            put(acc, m, n, bias, res, out, out_bf16, ldo);
        }
    }
}

/* part b (of nb) of asking for `lines` cache lines at next, into L2, spread over a task's blocks: the next task's
 * rows, which tile loads and rows read side by side walk as more streams than the hardware prefetchers follow */
static inline void prefetch_part(const char *next, int64_t lines, int64_t nb, int64_t b) {
    const int64_t per = (lines + nb - 1) / nb;
    for (int64_t l = b * per; l < (b + 1) * per && l < lines; l++) _mm_prefetch(next + 64 * l, _MM_HINT_T1);
}

/* rows n0 .. n0 + 31's scales (and mins, where wm) as float32, [32][ng] row after row */
static void task_scales(const sc_t *ws, const sc_t *wm, int64_t n0, int64_t ng, float *wsf, float *wmf) {
    for (int i = 0; i < 32; i++) {
        row_scales(ws, n0 + i, ng, wsf + i * ng);
        if (wm) row_scales(wm, n0 + i, ng, wmf + i * ng);
    }
}

/* The input rows as the tile kernels take them: int8 per 32 (xq, xs; and xg, the sums per block for layouts with
 * mins: sums 1, x's float32 sums; 2, its rounded values' (rounded_sums: one-level 4-bit blocks)), as B tiles bt
 * [mg][nb][8][64] (byte 4 m + j of row r: xq[16 g + m][32 b + 4 r + j]; rows past M 0), and the scales (and sums)
 * per block as [mg][nb][16]. */
typedef struct {
    int8_t *xq, *bt;
    float *xs, *xg, *xst, *xgt;
} amx_in_t;

static amx_in_t amx_inputs(const void *x, int x_bf16, int64_t M, int64_t K, int sums) {
    const int64_t nb = K / QB, mg = (M + 15) / 16;
    amx_in_t in;
    in.xq = (int8_t *)malloc((size_t)(M * K));
    in.xs = (float *)malloc((size_t)(M * nb) * sizeof(float));
    in.xg = sums ? (float *)malloc((size_t)(M * nb) * sizeof(float)) : NULL;
    quantize_rows(x, x_bf16, M, K, QB, in.xq, in.xs, sums == 1 ? in.xg : NULL, NULL);
    if (sums == 2) rounded_sums(in.xq, in.xs, M, K, in.xg);
    in.bt = (int8_t *)aligned_alloc(64, (size_t)(mg * nb * 512)); /* tile rows on cache lines */
    memset(in.bt, 0, (size_t)(mg * nb * 512));
    in.xst = (float *)calloc((size_t)(mg * nb * 16), sizeof(float));
    in.xgt = sums ? (float *)calloc((size_t)(mg * nb * 16), sizeof(float)) : NULL;
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) {
            int8_t *tile = in.bt + ((m / 16) * nb + b) * 512;
            const int8_t *src = in.xq + m * K + b * QB;
            for (int64_t k = 0; k < QB; k += 4) memcpy(tile + (k / 4) * 64 + (m % 16) * 4, src + k, 4);
            in.xst[((m / 16) * nb + b) * 16 + m % 16] = in.xs[m * nb + b];
            if (sums) in.xgt[((m / 16) * nb + b) * 16 + m % 16] = in.xg[m * nb + b];
        }
    return in;
}

static void amx_inputs_free(amx_in_t *in) {
    free(in->xq);
    free(in->bt);
    free(in->xs);
    free(in->xg);
    free(in->xst);
    free(in->xgt);
}

/* one weight row's K values a byte each into dst (32-byte aligned): 4-bit blocks widened (through `table` where the
 * layout has one), the rest as block_bytes gives them; plus `add` (mod 256: 128 makes signed bytes unsigned, 32
 * Q6_K's) */
static void widen_row(const uint8_t *wr, const int bits, const int sgn, int64_t K, const int8_t *table, int add,
                      uint8_t *dst) {
    const __m128i tab = table ? _mm_loadu_si128((const __m128i *)table) : _mm_setzero_si128();
    for (int64_t b = 0; b < K / QB; b++) {
        __m256i v;
        if (bits == 4) { /* byte j of a block: weight j in its low nibble, weight j + 16 in its high one */
            const __m128i q = _mm_loadu_si128((const __m128i *)(wr + b * 16));
            __m128i lo = _mm_and_si128(q, _mm_set1_epi8(0x0F));
            __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(0x0F));
            if (table) lo = _mm_shuffle_epi8(tab, lo), hi = _mm_shuffle_epi8(tab, hi); /* signed values */
            v = _mm256_set_m128i(hi, lo);
        } else if (bits == 8)
            v = _mm256_loadu_si256((const __m256i *)(wr + b * QB));
        else
            v = block_bytes(wr + b * BLOCK_BYTES(bits), bits, sgn);
        if (add) v = _mm256_add_epi8(v, _mm256_set1_epi8((char)add));
        _mm256_store_si256((__m256i *)(dst + b * QB), v);
    }
}

/* weight rows n0 .. n0 + 15 as the vector kernels read them: their values a byte each in wide [16][K] (4-bit
 * blocks widened, through `table` where the layout has one; signed ones + 128 where plus128), their scales in wsf
 * and mins in wmf (or none) [16][ng] */
static void stage_rows(const uint8_t *w, const int bits, const int sgn, int64_t row_bytes, int64_t K,
                       const int8_t *table, const sc_t *ws, const sc_t *wm, int64_t ng, int64_t n0, int plus128,
                       uint8_t *wide, float *wsf, float *wmf) {
    for (int i = 0; i < 16; i++) {
        row_scales(ws, n0 + i, ng, wsf + i * ng);
        if (wm) row_scales(wm, n0 + i, ng, wmf + i * ng);
        widen_row(w + (n0 + i) * row_bytes, bits, sgn, K, table, sgn && plus128 ? 128 : 0, wide + i * K);
    }
}

#ifdef WQ_TILES
/* acc[i] (lanes: input rows m0 .. m0 + 15) holds weight row n0 + i's sums, i < nrows (16 or 32): written as input
 * rows of nrows sums each (vector stores for float32 out), `rows` of them */
static void amx_store(const __m512 *acc, int nrows, int64_t rows, int64_t m0, int64_t n0, const float *bias,
                      const uint16_t *res, void *out, int out_bf16, int64_t ldo) {
    float v[32][16], r[16][32] __attribute__((aligned(64)));
    for (int i = 0; i < nrows; i++) _mm512_storeu_ps(v[i], acc[i]);
    for (int64_t m = 0; m < rows; m++)
        for (int i = 0; i < nrows; i++) r[m][i] = v[i][m];
    for (int64_t m = 0; m < rows; m++) {
        if (!out_bf16) {
            float *o = (float *)out + (m0 + m) * ldo + n0;
            for (int h = 0; h < nrows / 16; h++) {
                __m512 y = _mm512_load_ps(r[m] + 16 * h);
                if (bias) y = _mm512_add_ps(y, _mm512_loadu_ps(bias + n0 + 16 * h));
                _mm512_storeu_ps(o + 16 * h, y);
            }
        } else
            for (int i = 0; i < nrows; i++) put(r[m][i], m0 + m, n0 + i, bias, res, out, out_bf16, ldo);
    }
}

/* Batches on CPUs with AVX-512 VNNI where AMX is missing (or off): what gemm_amx and gemm_amx16 compute, with
 * vpdpbusd on 512-bit vectors in place of the tile unit. The input rows are the tiles' B layout (16 rows a vector:
 * 4 bytes of each), the weights broadcast 4 bytes at a time; each block's integer dot is exact, then scaled and
 * added in the tiles' order (mins first, then the dot; for groups of 16, each half with its own scale): the same
 * sums within float32 rounding (the same bits for layouts without mins, on this machine's builds). vpdpbusd multiplies unsigned by signed bytes: signed weights go in as w + 128, and 128 times
 * the block's sum of x comes off. 16 weight rows a task, widened to bytes once for every group of input rows. */
static int vnni_state = 1; /* on unless a test turns it off */

static int gemm_vnni_serves(int bits, int sgn, int64_t G, int sfmt, const void *mins) {
    if (gemm_q8_serves(bits, sgn, G, sfmt, mins)) return 1;
    if (sfmt != SC_TWO_LEVEL) return 0;
    return (G == QB && !sgn && (bits == 4 || bits == 8)) || (G == 16 && sgn && (bits == 8 || bits == 6) && !mins);
}

/* 8 weight rows (wide: [rows][K] bytes, their scales wsf / mins wmf [rows][ng]) against one group of 16 input rows:
 * acc[r] (lanes: the input rows) = their sums over all nb blocks. A block's steps one at a time (x loaded once for
 * the 8 rows, each row's 4 bytes broadcast as it is used), its halves in two sums a row (16 chains of vpdpbusd):
 * GCC otherwise hoists the block's 64 broadcasts and spills them and the sums. Not inlined: both halves of a task's
 * rows inlined together spilled too. */
static __attribute__((noinline)) void vnni_rows8(const uint8_t *wide, int64_t K, int64_t nb, int64_t ng,
                                                 const float *wsf, const float *wmf, const int8_t *bt,
                                                 const float *xst, const float *xgt, const int32_t *c128,
                                                 const int g16, __m512 acc[8]) {
    for (int r = 0; r < 8; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m512 xsv = _mm512_loadu_ps(xst + b * 16);
        __m512i d[8], e[8];
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++) d[r] = e[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            __m512i xv = _mm512_load_si512((const void *)(bt + b * 512 + 64 * j));
            __asm__("" : "+v"(xv));
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++) {
                const int32_t *wr = (const int32_t *)(wide + r * K + b * QB);
                if (j < 4) d[r] = _mm512_dpbusd_epi32(d[r], _mm512_set1_epi32(wr[j]), xv);
                else e[r] = _mm512_dpbusd_epi32(e[r], _mm512_set1_epi32(wr[j]), xv);
                __asm__("" : "+v"(d[r]), "+v"(e[r]));
            }
        }
        if (!g16) /* one sum a block: exact in int32, so the same as summing its steps in one chain */
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++) d[r] = _mm512_add_epi32(d[r], e[r]);
        if (c128) { /* signed weights: 128 x the block's (each half's) sum of x off */
            const __m512i c0 = _mm512_loadu_si512((const void *)(c128 + b * 32));
            const __m512i c1 = _mm512_loadu_si512((const void *)(c128 + b * 32 + 16));
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++) {
                d[r] = _mm512_sub_epi32(d[r], c0);
                if (g16) e[r] = _mm512_sub_epi32(e[r], c1);
            }
        }
        if (wmf) {
            const __m512 xgv = _mm512_loadu_ps(xgt + b * 16);
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(wmf[r * ng + b]), xgv, acc[r]);
        }
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++) {
            if (g16) {
                const float *sr = wsf + r * ng + 2 * b;
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[r]), _mm512_mul_ps(_mm512_set1_ps(sr[0]), xsv), acc[r]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(e[r]), _mm512_mul_ps(_mm512_set1_ps(sr[1]), xsv), acc[r]);
            } else
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[r]),
                                         _mm512_mul_ps(_mm512_set1_ps(wsf[r * ng + b]), xsv), acc[r]);
        }
    }
}

#if WQ_PART != 1
WQ_PART2_KERNEL void gemm_vnni(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, const int bits,
                               const int sgn, const int64_t G, const sc_t *ws, const sc_t *wm, const float *bias,
                               const uint16_t *res, void *out, int out_bf16, int64_t ldo, int64_t N,
                               const int8_t *table) {
    const int64_t nb = K / QB, ng = K / G, mg = (M + 15) / 16, tasks = N / 16, row_bytes = row_bytes_of(bits, K);
    const int g16 = G == 16;
    const int sums = !wm ? 0 : !ws->b && bits == 4 ? 2 : 1; /* one-level 4-bit blocks: rounded x's sums */
    amx_in_t in = amx_inputs(x, x_bf16, M, K, sums);
    int32_t *c128 = NULL; /* [mg][nb][2][16]: 128 x the block's sum of x (G = 16: each half's) */
    if (sgn) {
        c128 = (int32_t *)calloc((size_t)(mg * nb * 32), sizeof(int32_t));
        for (int64_t m = 0; m < M; m++)
            for (int64_t b = 0; b < nb; b++) {
                const int8_t *xb = in.xq + m * K + b * QB;
                int32_t lo = 0, hi = 0;
                for (int i = 0; i < 16; i++) lo += xb[i], hi += xb[i + 16];
                int32_t *c = c128 + ((m / 16) * nb + b) * 32 + m % 16;
                if (g16) c[0] = 128 * lo, c[16] = 128 * hi;
                else c[0] = 128 * (lo + hi);
            }
    }
#pragma omp parallel
    {
        uint8_t *wide = (uint8_t *)aligned_alloc(64, (size_t)(16 * K)); /* the task's rows as bytes, [16][K] */
        float *wsf = (float *)malloc((size_t)(16 * ng) * sizeof(float)); /* [16][ng] their scales */
        float *wmf = wm ? (float *)malloc((size_t)(16 * ng) * sizeof(float)) : NULL;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t n0 = 16 * t;
            stage_rows(w, bits, sgn, row_bytes, K, table, ws, wm, ng, n0, 1, wide, wsf, wmf);
            for (int64_t g0 = 0; g0 < mg; g0++) {
                __m512 acc[16];
                for (int h = 0; h < 2; h++)
                    vnni_rows8(wide + 8 * h * K, K, nb, ng, wsf + 8 * h * ng, wmf ? wmf + 8 * h * ng : NULL,
                               in.bt + g0 * nb * 512, in.xst + g0 * nb * 16, in.xgt ? in.xgt + g0 * nb * 16 : NULL,
                               c128 ? c128 + g0 * nb * 32 : NULL, g16, acc + 8 * h);
                const int64_t m0 = 16 * g0, rows = M - m0 < 16 ? M - m0 : 16;
                amx_store(acc, 16, rows, m0, n0, bias, res, out, out_bf16, ldo);
            }
        }
        free(wide);
        free(wsf);
        free(wmf);
    }
    if (tasks * 16 < N)
        amx_tail(in.xq, in.xs, in.xg, M, K, w, bits, sgn, G, ws, wm, tasks * 16, N, bias, res, out, out_bf16, ldo,
                 table);
    free(c128);
    amx_inputs_free(&in);
}
#endif

#endif

#ifdef WQ_AVX2
typedef struct {
    int8_t *bt;   /* [mg][K / 4][16][4]: input rows 16 m0 .. 16 m0 + 15, 4 bytes a step (rows past M 0) */
    float *xdt;   /* [mg][K / 256][16] their scales */
    int16_t *xst; /* [mg][K / 64][16][2] their sums per 32, two groups a pair (for layouts with mins) */
    int16_t *xs16; /* [mg][K / 32][16][2] their sums per 16, a 32-block's halves a pair (Q6_K staged q + 32) */
} i8k_in_t;

static i8k_in_t i8k_inputs(const void *x, int x_bf16, int64_t M, int64_t K, int sums, int sums16) {
    const int64_t mg = (M + 15) / 16, nsb = K / KS, nb = K / QB;
    int8_t *xq = (int8_t *)malloc((size_t)(M * K));
    float *xd = (float *)malloc((size_t)(M * nsb) * sizeof(float));
    int32_t *xb = (int32_t *)malloc((size_t)(M * nb) * sizeof(int32_t));
    quantize_rows_k(x, x_bf16, M, K, 0, xq, xd, xb);
    i8k_in_t in;
    in.bt = (int8_t *)aligned_alloc(64, (size_t)(mg * K * 16));
    memset(in.bt, 0, (size_t)(mg * K * 16));
    in.xdt = (float *)calloc((size_t)(mg * nsb * 16), sizeof(float));
    in.xst = sums ? (int16_t *)calloc((size_t)(mg * nb * 16), sizeof(int16_t)) : NULL;
    in.xs16 = sums16 ? (int16_t *)calloc((size_t)(mg * nb * 32), sizeof(int16_t)) : NULL;
    for (int64_t m = 0; m < M; m++) {
        int8_t *tile = in.bt + (m / 16) * K * 16 + (m % 16) * 4;
        for (int64_t k = 0; k < K; k += 4) memcpy(tile + k * 16, xq + m * K + k, 4);
        for (int64_t s = 0; s < nsb; s++) in.xdt[((m / 16) * nsb + s) * 16 + m % 16] = xd[m * nsb + s];
        if (sums) /* |sum| <= 32 * 127: an int16 */
            for (int64_t b = 0; b < nb; b++)
                in.xst[(((m / 16) * (nb / 2) + b / 2) * 16 + m % 16) * 2 + b % 2] = (int16_t)xb[m * nb + b];
        if (sums16) /* |sum| <= 16 * 127 */
            for (int64_t b = 0; b < nb; b++)
                for (int hf = 0; hf < 2; hf++) {
                    int32_t t = 0;
                    for (int i = 0; i < 16; i++) t += xq[m * K + b * QB + 16 * hf + i];
                    in.xs16[(((m / 16) * nb + b) * 16 + m % 16) * 2 + hf] = (int16_t)t;
                }
    }
    free(xq);
    free(xd);
    free(xb);
    return in;
}

#endif

#ifdef WQ_TILES
/* gemm_i8k on 512-bit vectors (AVX-512BW), for CPUs with AVX-512 VNNI and no AMX: the two-level layouts' batches with
 * x rounded per 256 as gemm_k rounds it, all 16 input rows of a group in one vector (one x load a step), 4 weight rows
 * a pass; vpdpbusd over a group, then one vpmulld by its integer scale (0.92-0.95x the time of vpmaddubsw and vpaddw
 * over the group and vpmaddwd with the scale; the same integers). Q6_K's signed q staged unsigned, q + 32 (AVX-512
 * has no vpsignb to move signs onto x; the |w| and masked negation that stand in for it took 1.3-1.6x the time), and
 * 32 x each group's scale times x's sum over it taken off per super-block. */
static inline __attribute__((always_inline)) void i8k512_pass(const uint8_t *const *wr, const int8_t *xt,
                                                              const int16_t *const *sc, const int32_t *const *mp,
                                                              const float *dr, const float *mr, const float *xd,
                                                              const int16_t *xs, const int16_t *xs16, __m512 *c,
                                                              const int g16) {
    const int per = g16 ? 16 : 8, js = g16 ? 4 : 8;
    __m512i i32[4];
    for (int r = 0; r < 4; r++) i32[r] = _mm512_setzero_si512();
    for (int g = 0; g < per; g++) {
        __m512i q[4];
        for (int r = 0; r < 4; r++) q[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int j = 0; j < js; j++) {
            const int k = g * js * 4 + 4 * j;
            __m512i x0 = _mm512_load_si512((const void *)(xt + 16 * k));
            __asm__("" : "+v"(x0));
            for (int r = 0; r < 4; r++) {
                int32_t w4;
                memcpy(&w4, wr[r] + k, 4);
                q[r] = _mm512_dpbusd_epi32(q[r], _mm512_set1_epi32(w4), x0);
                __asm__("" : "+v"(q[r]));
            }
        }
        for (int r = 0; r < 4; r++)
            i32[r] = _mm512_add_epi32(i32[r], _mm512_mullo_epi32(q[r], _mm512_set1_epi32(sc[r][g])));
    }
    if (xs16) /* q staged + 32 (Q6_K): 32 x the scales' products with x's sums per 16 off */
        for (int r = 0; r < 4; r++) {
            __m512i t = _mm512_setzero_si512();
            for (int q = 0; q < per / 2; q++) {
                int32_t pair;
                memcpy(&pair, sc[r] + 2 * q, 4);
                t = _mm512_add_epi32(t, _mm512_madd_epi16(_mm512_loadu_si512((const void *)(xs16 + 32 * q)),
                                                          _mm512_set1_epi32(pair)));
            }
            i32[r] = _mm512_sub_epi32(i32[r], _mm512_slli_epi32(t, 5));
        }
    const __m512 dx = _mm512_loadu_ps(xd);
    for (int r = 0; r < 4; r++) {
        c[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i32[r]), _mm512_mul_ps(_mm512_set1_ps(dr[r]), dx), c[r]);
        if (mp) {
            __m512i im = _mm512_setzero_si512();
            for (int q = 0; q < per / 2; q++)
                im = _mm512_add_epi32(im, _mm512_madd_epi16(_mm512_loadu_si512((const void *)(xs + 32 * q)),
                                                            _mm512_set1_epi32(mp[r][q])));
            c[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(im), _mm512_mul_ps(_mm512_set1_ps(mr[r]), dx), c[r]);
        }
    }
}

/* what gemm_i8k's passes (I8K_FN) take in this build: weight rows a pass, one weight row's sums for the 16 input rows,
 * and the pass */
#define I8K_R 4
typedef __m512 i8k_acc_t;
#define I8K_PASS(wr, xt, sc, mp, dr, mr, xd, xs, x16, c, G16, DEPTH) \
    i8k512_pass(wr, xt, sc, mp, dr, mr, xd, xs, x16, c, G16)
static inline void i8k_zero(i8k_acc_t *c) {
    for (int i = 0; i < 16; i++) c[i] = _mm512_setzero_ps();
}
static inline void i8k_store(const i8k_acc_t *c, float v[16][16]) {
    for (int i = 0; i < 16; i++) _mm512_store_ps(v[i], c[i]);
}
#endif

#if !defined(WQ_TILES)
#define WQ_I8V 1
/* Batches on AVX2 CPUs without AVX-512 VNNI: gemm_vnni's sums with 256-bit vpmaddubsw (unsigned x signed bytes into
 * int16 pairs) and vpmaddwd, 8 input rows a vector, 2 weight rows x 16 input rows a pass (x loaded once a step for
 * both weight rows; 8 input rows where a group has no more). Unsigned weights go in as they are; signed ones as |w|,
 * their signs moved onto x (vpsignb). Pairs are summed in int16 only where they cannot saturate: 4-bit and 5-bit
 * weights (|w| <= 16) over a whole block, 6-bit (|w| <= 32) over half of one, 8-bit a step at a time. Each block's
 * integer dot is exact, then scaled and added as gemm_vnni adds it (the same bits where the layout has no mins; those
 * with mins within the last bit, the compiler fusing their products otherwise). */
static int i8v_state = 1; /* on unless a test turns it off */

static int gemm_i8v_serves(int bits, int sgn, int64_t G, int sfmt, const void *mins) {
    if (gemm_q8_serves(bits, sgn, G, sfmt, mins)) return 1;
    if (sfmt != SC_TWO_LEVEL) return 0;
    return (G == QB && !sgn && (bits == 4 || bits == 8)) || (G == 16 && sgn && (bits == 8 || bits == 6) && !mins);
}

/* weight rows wr[0..1] (a task's staged bytes, at the row's start; scales sr, mins mr) against the 8 H input rows
 * of a group (bt: its B-layout blocks, xs / xg: their scales and sums per block), all nb blocks: acc[r][h]. Each step
 * loads x once for both rows. i16: pairs summed in int16 over a whole block (2), a half (1) or a step (0). wa: the
 * rows' |w| as staged (signed layouts), or NULL (the array itself): formed a step at a time */
static inline __attribute__((always_inline)) void i8v_pass(const int32_t *const wr[2], const int32_t *const wa[2],
                                                           const float *const sr[2], const float *const mr[2],
                                                           const int8_t *bt, const float *xs, const float *xg,
                                                           int64_t nb, __m256 acc[2][2], const int H, const int sgn,
                                                           const int i16, const int g16) {
    const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 2
    for (int r = 0; r < 2; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *xb = bt + b * 512;
        __m256i d[2][2][2]; /* [half block][weight row][input half] int32 sums */
#pragma GCC unroll 2
        for (int q = 0; q < 2; q++)
#pragma GCC unroll 2
            for (int r = 0; r < 2; r++) d[q][r][0] = d[q][r][1] = _mm256_setzero_si256();
        __m256i s16[2][2];
#pragma GCC unroll 2
        for (int q = 0; q < 2; q++) {
            if (q == 0 || i16 != 2) /* whole blocks: the pairs go on in int16 over both halves */
#pragma GCC unroll 2
                for (int r = 0; r < 2; r++) s16[r][0] = s16[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int j = 4 * q; j < 4 * q + 4; j++) {
                __m256i x0 = _mm256_load_si256((const __m256i *)(xb + 64 * j));
                __m256i x1 = H == 2 ? _mm256_load_si256((const __m256i *)(xb + 64 * j + 32)) : x0;
                __asm__("" : "+x"(x0), "+x"(x1)); /* loaded once for both weight rows */
#pragma GCC unroll 2
                for (int r = 0; r < 2; r++) {
                    const __m256i wb = _mm256_set1_epi32(wr[r][b * 8 + j]);
                    __m256i p0, p1;
                    if (sgn) { /* |w| staged (a broadcast load, not an op a step) where groups share it */
                        const __m256i wu = wa ? _mm256_set1_epi32(wa[r][b * 8 + j]) : _mm256_abs_epi8(wb);
                        p0 = _mm256_maddubs_epi16(wu, _mm256_sign_epi8(x0, wb));
                        p1 = H == 2 ? _mm256_maddubs_epi16(wu, _mm256_sign_epi8(x1, wb)) : p0;
                    } else {
                        p0 = _mm256_maddubs_epi16(wb, x0);
                        p1 = H == 2 ? _mm256_maddubs_epi16(wb, x1) : p0;
                    }
                    if (i16) {
                        s16[r][0] = _mm256_add_epi16(s16[r][0], p0);
                        if (H == 2) s16[r][1] = _mm256_add_epi16(s16[r][1], p1);
                    } else {
                        d[q][r][0] = _mm256_add_epi32(d[q][r][0], _mm256_madd_epi16(p0, ones));
                        if (H == 2) d[q][r][1] = _mm256_add_epi32(d[q][r][1], _mm256_madd_epi16(p1, ones));
                    }
                    __asm__("" : "+x"(s16[r][0]), "+x"(s16[r][1]), "+x"(d[q][r][0]), "+x"(d[q][r][1]));
                }
            }
            if (i16 == 1 || (i16 == 2 && q == 1))
#pragma GCC unroll 2
                for (int r = 0; r < 2; r++)
#pragma GCC unroll 2
                    for (int h = 0; h < H; h++) d[q][r][h] = _mm256_madd_epi16(s16[r][h], ones);
        }
#pragma GCC unroll 2
        for (int h = 0; h < H; h++) {
            const __m256 xsv = _mm256_loadu_ps(xs + b * 16 + 8 * h);
#pragma GCC unroll 2
            for (int r = 0; r < 2; r++) {
                if (g16) {
                    acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[0][r][h]),
                                                _mm256_mul_ps(_mm256_set1_ps(sr[r][2 * b]), xsv), acc[r][h]);
                    acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[1][r][h]),
                                                _mm256_mul_ps(_mm256_set1_ps(sr[r][2 * b + 1]), xsv), acc[r][h]);
                } else {
                    if (mr[0]) /* the mins first, as gemm_vnni adds them */
                        acc[r][h] = _mm256_fmadd_ps(_mm256_set1_ps(mr[r][b]), _mm256_loadu_ps(xg + b * 16 + 8 * h),
                                                    acc[r][h]);
                    const __m256i dd = _mm256_add_epi32(d[0][r][h], d[1][r][h]);
                    acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dd), _mm256_mul_ps(_mm256_set1_ps(sr[r][b]), xsv),
                                                acc[r][h]);
                }
            }
        }
    }
}

/* STAGED: |w| read from the staged copy (wa), else formed a step at a time */
#define I8V_FN(NAME, H, SGN, I16, STAGED)                                                                        \
    static __attribute__((noinline)) void NAME(const int32_t *const wr[2], const int32_t *const wa[2],           \
                                               const float *const sr[2], const float *const mr[2],               \
                                               const int8_t *bt, const float *xs, const float *xg, int64_t nb,   \
                                               __m256 acc[2][2]) {                                               \
        i8v_pass(wr, STAGED ? wa : NULL, sr, mr, bt, xs, xg, nb, acc, H, SGN, I16, 0);                           \
    }
I8V_FN(i8v_q8_16, 2, 1, 0, 0) I8V_FN(i8v_q8_8, 1, 1, 0, 0) I8V_FN(i8v_s4_16, 2, 1, 2, 0) I8V_FN(i8v_s4_8, 1, 1, 2, 0)
I8V_FN(i8v_q8_16s, 2, 1, 0, 1) I8V_FN(i8v_q8_8s, 1, 1, 0, 1) I8V_FN(i8v_s4_16s, 2, 1, 2, 1)
I8V_FN(i8v_s4_8s, 1, 1, 2, 1)

#if WQ_PART != 1
WQ_PART2_KERNEL void gemm_i8v(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, const int bits,
                              const int sgn, const int64_t G, const sc_t *ws, const sc_t *wm, const float *bias,
                              const uint16_t *res, void *out, int out_bf16, int64_t ldo, int64_t N,
                              const int8_t *table) {
    const int64_t nb = K / QB, ng = K / G, mg = (M + 15) / 16, tasks = N / 16, row_bytes = row_bytes_of(bits, K);
    const int g16 = G == 16;
    /* pairs summed in int16 over a whole block (8 steps) or a half (4): 4-bit and 5-bit weights, 6-bit */
    const int whole16 = bits == 4 || bits == 5, half16 = whole16 || bits == 6;
    amx_in_t in = amx_inputs(x, x_bf16, M, K, wm != NULL);
#pragma omp parallel
    {
        uint8_t *wide = (uint8_t *)aligned_alloc(64, (size_t)(16 * K)); /* the task's rows as bytes, [16][K] */
        /* and their |w|, where more than one group of input rows shares them */
        uint8_t *wabs = sgn && mg > 1 ? (uint8_t *)aligned_alloc(64, (size_t)(16 * K)) : NULL;
        float *wsf = (float *)malloc((size_t)(16 * ng) * sizeof(float)); /* [16][ng] their scales */
        float *wmf = wm ? (float *)malloc((size_t)(16 * ng) * sizeof(float)) : NULL;
        float c[16][16]; /* [weight row][input row] a group's sums */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t n0 = 16 * t;
            stage_rows(w, bits, sgn, row_bytes, K, table, ws, wm, ng, n0, 0, wide, wsf, wmf);
            if (wabs)
                for (int64_t i = 0; i < 16 * K; i += 32)
                    _mm256_store_si256((__m256i *)(wabs + i),
                                       _mm256_abs_epi8(_mm256_load_si256((const __m256i *)(wide + i))));
            for (int64_t g0 = 0; g0 < mg; g0++) {
                const int64_t m0 = 16 * g0, rows = M - m0 < 16 ? M - m0 : 16;
                for (int r0 = 0; r0 < 16; r0 += 2) {
                    const int32_t *wr[2] = {(const int32_t *)(wide + r0 * K), (const int32_t *)(wide + (r0 + 1) * K)};
                    const int32_t *wa[2] = {wabs ? (const int32_t *)(wabs + r0 * K) : NULL,
                                            wabs ? (const int32_t *)(wabs + (r0 + 1) * K) : NULL};
                    const int st = wabs != NULL;
                    const float *sr[2] = {wsf + r0 * ng, wsf + (r0 + 1) * ng};
                    const float *mr[2] = {wmf ? wmf + r0 * ng : NULL, wmf ? wmf + (r0 + 1) * ng : NULL};
                    const int8_t *bt = in.bt + g0 * nb * 512;
                    const float *xs = in.xst + g0 * nb * 16, *xg = in.xgt ? in.xgt + g0 * nb * 16 : NULL;
                    __m256 acc[2][2];
#define I8V(F)                                          \
    do {                                                \
        if (st) F##s(wr, wa, sr, mr, bt, xs, xg, nb, acc); \
        else F(wr, wa, sr, mr, bt, xs, xg, nb, acc);      \
    } while (0)
                    if (rows > 8 && sgn && bits == 8 && !g16 && !wm) I8V(i8v_q8_16);
                    else if (rows > 8 && sgn && whole16 && !g16 && !wm) I8V(i8v_s4_16);
                    else if (sgn && bits == 8 && !g16 && !wm) I8V(i8v_q8_8);
                    else if (sgn && whole16 && !g16 && !wm) I8V(i8v_s4_8);
                    else
                        i8v_pass(wr, st ? wa : NULL, sr, mr, bt, xs, xg, nb, acc, rows > 8 ? 2 : 1, sgn,
                                 whole16 ? 2 : half16 ? 1 : 0, g16);
#undef I8V
                    for (int r = 0; r < 2; r++)
                        for (int h = 0; h < (rows > 8 ? 2 : 1); h++) _mm256_storeu_ps(c[r0 + r] + 8 * h, acc[r][h]);
                }
                put16((const float(*)[16])c, rows, 16, m0, n0, bias, res, out, out_bf16, ldo);
            }
        }
        free(wide);
        free(wabs);
        free(wsf);
        free(wmf);
    }
    if (tasks * 16 < N)
        amx_tail(in.xq, in.xs, in.xg, M, K, w, bits, sgn, G, ws, wm, tasks * 16, N, bias, res, out, out_bf16, ldo,
                 table);
    amx_inputs_free(&in);
}
#endif

/* gemm_i8k: batches of the two-level layouts (Q4_K, Q5_K, Q6_K), K a multiple of 256, past gemm_k's rows. x is
 * rounded to int8 per 256 as gemm_k rounds it (llama.cpp's Q8_K), so that each super-block sums in 32-bit integers
 * with the groups' integer scales (vpmaddwd of a group's int16 pair sums with its scale; gemm_i8v converts and scales
 * every 32-block) and is scaled once. AVX2 (these passes): 2 weight rows x 16 input rows a pass, per 4-byte step 2
 * loads of x and 2 weight broadcasts feeding 4 vpmaddubsw; with AVX-512 VNNI, i8k512_pass above. The mins meet x's
 * integer sums per group (vpmaddwd of pairs of groups). Q6_K's q is staged unsigned (q + 32) in both, 32 x each
 * group's scale times x's sum over it taken off per super-block (as built for AVX2 0.78-0.97x the time of moving
 * signs onto x). Pairs are summed in int16 over 8 steps for 4-bit weights (|w| <= 15), 4 for Q5_K's (<= 31), 2 for
 * Q6_K's (<= 63): no overflow. */
/* one super-block of weight rows wr[0 .. R - 1] (bytes, at the super-block) against 16 input rows (xt: the
 * super-block's steps, 64 bytes each): c[r][h] += their sums; sc: each row's group scales as int16 (from the
 * super-block's first), mp: the mins' pairs as int16 pairs (or NULL), dr / mr: each row's super-scales, xd: the 16
 * rows' scales, xs: their group-pair sums */
static inline __attribute__((always_inline)) void i8k_pass(const uint8_t *const *wr, const int8_t *xt,
                                                           const int16_t *const *sc, const int32_t *const *mp,
                                                           const float *dr, const float *mr, const float *xd,
                                                           const int16_t *xs, const int16_t *xs16, __m256 (*c)[2],
                                                           const int R, const int g16, const int depth) {
    const int per = g16 ? 16 : 8, js = g16 ? 4 : 8; /* groups a super-block, 4-byte steps a group */
    __m256i i32[4][2];
    for (int r = 0; r < R; r++) i32[r][0] = i32[r][1] = _mm256_setzero_si256();
    for (int g = 0; g < per; g++) {
        for (int j0 = 0; j0 < js; j0 += depth) {
            __m256i p[4][2];
            for (int r = 0; r < R; r++) p[r][0] = p[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int j = j0; j < j0 + depth; j++) {
                const int k = g * js * 4 + 4 * j;
                __m256i x0 = _mm256_load_si256((const __m256i *)(xt + 16 * k));
                __m256i x1 = _mm256_load_si256((const __m256i *)(xt + 16 * k + 32));
                __asm__("" : "+x"(x0), "+x"(x1)); /* loaded once for all the weight rows */
                for (int r = 0; r < R; r++) {
                    int32_t w4;
                    memcpy(&w4, wr[r] + k, 4);
                    const __m256i wb = _mm256_set1_epi32(w4);
                    p[r][0] = _mm256_add_epi16(p[r][0], _mm256_maddubs_epi16(wb, x0));
                    p[r][1] = _mm256_add_epi16(p[r][1], _mm256_maddubs_epi16(wb, x1));
                    /* keeps each step's sums in their registers: GCC otherwise forms all the steps' products
                     * first and spills them */
                    __asm__("" : "+x"(p[r][0]), "+x"(p[r][1]));
                }
            }
            for (int r = 0; r < R; r++) {
                const __m256i s = _mm256_set1_epi16(sc[r][g]);
                i32[r][0] = _mm256_add_epi32(i32[r][0], _mm256_madd_epi16(p[r][0], s));
                i32[r][1] = _mm256_add_epi32(i32[r][1], _mm256_madd_epi16(p[r][1], s));
            }
        }
    }
    if (xs16) /* q staged + 32 (Q6_K): 32 x the scales' products with x's sums per 16 off */
        for (int r = 0; r < R; r++)
            for (int h = 0; h < 2; h++) {
                __m256i t = _mm256_setzero_si256();
                for (int q = 0; q < per / 2; q++) {
                    int32_t pair;
                    memcpy(&pair, sc[r] + 2 * q, 4);
                    const __m256i sums = _mm256_loadu_si256((const __m256i *)(xs16 + 32 * q + 16 * h));
                    t = _mm256_add_epi32(t, _mm256_madd_epi16(sums, _mm256_set1_epi32(pair)));
                }
                i32[r][h] = _mm256_sub_epi32(i32[r][h], _mm256_slli_epi32(t, 5));
            }
    for (int h = 0; h < 2; h++) {
        const __m256 dx = _mm256_loadu_ps(xd + 8 * h);
        for (int r = 0; r < R; r++) {
            c[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32[r][h]), _mm256_mul_ps(_mm256_set1_ps(dr[r]), dx), c[r][h]);
            if (mp) {
                __m256i im = _mm256_setzero_si256();
                for (int q = 0; q < per / 2; q++) {
                    const __m256i pair = _mm256_loadu_si256((const __m256i *)(xs + 32 * q + 16 * h));
                    im = _mm256_add_epi32(im, _mm256_madd_epi16(pair, _mm256_set1_epi32(mp[r][q])));
                }
                c[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(im), _mm256_mul_ps(_mm256_set1_ps(mr[r]), dx), c[r][h]);
            }
        }
    }
}

#define I8K_R 2 /* weight rows a pass */
typedef __m256 i8k_acc_t[2];
#define I8K_PASS(wr, xt, sc, mp, dr, mr, xd, xs, x16, c, G16, DEPTH) \
    i8k_pass(wr, xt, sc, mp, dr, mr, xd, xs, x16, c, I8K_R, G16, DEPTH)
static inline void i8k_zero(i8k_acc_t *c) {
    for (int i = 0; i < 16; i++) c[i][0] = c[i][1] = _mm256_setzero_ps();
}
static inline void i8k_store(const i8k_acc_t *c, float v[16][16]) {
    for (int i = 0; i < 16; i++) _mm256_store_ps(v[i], c[i][0]), _mm256_store_ps(v[i] + 8, c[i][1]);
}

#endif

#ifdef WQ_AVX2
/* a super-block at a time, I8K_R weight rows a pass against input group g0 (the build's I8K_PASS): c[i] += weight
 * row i's sums */
#define I8K_FN(NAME, G16, DEPTH, MINS, C32)                                                                      \
    static __attribute__((noinline)) void NAME(const uint8_t *wide, const int16_t *sci, const int32_t *mpi,      \
                                               const float *dsup, const float *msup, const i8k_in_t *in,         \
                                               int64_t g0, int64_t K, i8k_acc_t *c) {                            \
        const int64_t nsb = K / KS, ng = K / (G16 ? 16 : 32), per = ng / nsb;                                    \
        for (int64_t s = 0; s < nsb; s++) {                                                                      \
            const int8_t *xt = in->bt + g0 * K * 16 + s * KS * 16;                                               \
            const float *xd = in->xdt + (g0 * nsb + s) * 16;                                                     \
            const int16_t *xs = MINS ? in->xst + (g0 * (K / 64) + s * 4) * 32 : NULL;                             \
            const int16_t *x16 = C32 ? in->xs16 + (g0 * (K / 32) + s * 8) * 32 : NULL;                            \
            for (int r0 = 0; r0 < 16; r0 += I8K_R) {                                                             \
                const uint8_t *wr[I8K_R];                                                                        \
                const int16_t *sc[I8K_R];                                                                        \
                const int32_t *mp[I8K_R];                                                                        \
                float dr[I8K_R], mr[I8K_R];                                                                      \
                for (int r = 0; r < I8K_R; r++) {                                                                \
                    wr[r] = wide + (r0 + r) * K + s * KS;                                                        \
                    sc[r] = sci + (r0 + r) * ng + s * per;                                                       \
                    mp[r] = MINS ? mpi + (r0 + r) * (ng / 2) + s * (per / 2) : NULL;                             \
                    dr[r] = dsup[(r0 + r) * nsb + s];                                                            \
                    mr[r] = MINS ? msup[(r0 + r) * nsb + s] : 0.f;                                               \
                }                                                                                                \
                I8K_PASS(wr, xt, sc, MINS ? mp : NULL, dr, mr, xd, xs, x16, c + r0, G16, DEPTH);                 \
            }                                                                                                    \
        }                                                                                                        \
    }
I8K_FN(i8k_q4, 0, 8, 1, 0)
I8K_FN(i8k_q5, 0, 4, 1, 0)
I8K_FN(i8k_q6, 1, 2, 0, 1) /* q + 32 <= 63: pairs in int16 over 2 steps */

#if WQ_PART != 1
WQ_PART2_KERNEL void gemm_i8k(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, const int bits,
                              const int sgn, const int64_t G, const sc_t *ws, const sc_t *wm, const float *bias,
                              const uint16_t *res, void *out, int out_bf16, int64_t ldo, int64_t N) {
    const int64_t ng = K / G, nsb = K / KS, mg = (M + 15) / 16, tasks = (N + 15) / 16;
    const int64_t row_bytes = row_bytes_of(bits, K);
    const int mins = wm != NULL && wm->b != NULL;
    const int plus32 = sgn; /* Q6_K staged unsigned, q + 32 */
    i8k_in_t in = i8k_inputs(x, x_bf16, M, K, mins, plus32);
#pragma omp parallel
    {
        uint8_t *wide = (uint8_t *)aligned_alloc(64, (size_t)(16 * K));
        int16_t *sci = (int16_t *)malloc((size_t)(16 * ng) * sizeof(int16_t));
        int32_t *mpi = mins ? (int32_t *)malloc((size_t)(16 * ng / 2) * sizeof(int32_t)) : NULL;
        float *dsup = (float *)malloc((size_t)(16 * nsb) * sizeof(float));
        float *msup = mins ? (float *)malloc((size_t)(16 * nsb) * sizeof(float)) : NULL;
        i8k_acc_t c[16];
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t n0 = 16 * t, nr = N - n0 < 16 ? N - n0 : 16;
            for (int i = 0; i < 16; i++) { /* the task's rows staged (rows past N: zeros) */
                if (i >= nr) {
                    memset(wide + i * K, 0, (size_t)K);
                    for (int64_t g = 0; g < ng; g++) sci[i * ng + g] = 0;
                    for (int64_t s = 0; s < nsb; s++) dsup[i * nsb + s] = 0.f;
                    if (mins) {
                        for (int64_t g = 0; g < ng / 2; g++) mpi[i * (ng / 2) + g] = 0;
                        for (int64_t s = 0; s < nsb; s++) msup[i * nsb + s] = 0.f;
                    }
                    continue;
                }
                const sc_t sr = sc_row(*ws, n0 + i, ng);
                for (int64_t g = 0; g < ng; g++) sci[i * ng + g] = sgn ? (int8_t)sr.b[g] : sr.b[g];
                for (int64_t s = 0; s < nsb; s++) dsup[i * nsb + s] = sr.sup[s];
                if (mins) {
                    const sc_t mr = sc_row(*wm, n0 + i, ng);
                    for (int64_t g = 0; g < ng / 2; g++)
                        mpi[i * (ng / 2) + g] = (int32_t)((uint32_t)mr.b[2 * g] | ((uint32_t)mr.b[2 * g + 1] << 16));
                    for (int64_t s = 0; s < nsb; s++) msup[i * nsb + s] = mr.sup[s];
                }
                widen_row(w + (n0 + i) * row_bytes, bits, sgn, K, NULL, plus32 ? 32 : 0, wide + i * K);
            }
            /* the next task's rows asked for (into L2) a share before each group's passes, so that staging them
             * does not wait on memory (a step's experts are read from memory once, a few groups of rows each) */
            const int64_t next = N - n0 - 16 < 16 ? N - n0 - 16 : 16;
            const uint8_t *ahead = w + (n0 + 16) * row_bytes;
            const int64_t lines = next > 0 ? (next * row_bytes + 63) / 64 : 0, per_group = (lines + mg - 1) / mg;
            for (int64_t g0 = 0; g0 < mg; g0++) {
                float v[16][16] __attribute__((aligned(64)));
                for (int64_t l = g0 * per_group; l < lines && l < (g0 + 1) * per_group; l++)
                    _mm_prefetch((const char *)(ahead + 64 * l), _MM_HINT_T1);
                i8k_zero(c);
                if (bits == 4) i8k_q4(wide, sci, mpi, dsup, msup, &in, g0, K, c);
                else if (sgn) i8k_q6(wide, sci, NULL, dsup, NULL, &in, g0, K, c);
                else i8k_q5(wide, sci, mpi, dsup, msup, &in, g0, K, c);
                i8k_store(c, v);
                const int64_t m0 = 16 * g0;
                put16((const float(*)[16])v, M - m0 < 16 ? M - m0 : 16, nr, m0, n0, bias, res, out, out_bf16, ldo);
            }
        }
        free(wide);
        free(sci);
        free(mpi);
        free(dsup);
        free(msup);
    }
    free(in.bt);
    free(in.xdt);
    free(in.xst);
    free(in.xs16);
}
#endif
#endif

#if defined(WQ_TILES) && defined(__AMX_INT8__) && defined(__AMX_TILE__)
#define WQ_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

/* Batches on CPUs with AMX (gemm_amx_serves below says which): activations int8 per 32 (as gemm_q8), each block's
 * products summed by the tile unit. A = 16 weight rows x one 32-weight block, read in place (row stride K; 4-bit
 * blocks widened to bytes first, through a 16-entry table where the layout has one: MXFP4's e2m1 values); B = the
 * block of 16 input rows in the tile unit's 4-byte-interleaved layout, made once per call; C [16 weight rows][16
 * input rows] int32, then scaled (weight scale x row scale, plus min x the rows' sums over the block) into float32
 * sums, block by block (another order of the float32 adds than the row paths'). Weight rows past the last multiple
 * of 32 go through amx_tail. */
/* the batch sizes from which the tiles take a layout. 8-bit blocks from 3 rows, where they beat gemm_q8 (Gemma 3
 * 270M's 262k-row Q8_0 head: 9 rows 20.8 -> 8.9 ms); below, q8_exact gives each row the tiles' very sums. The
 * two-level layouts from 16 rows, where the tiles take over from gemm_k (activations per 256): the tiles round them
 * per 32, so a row's numbers change where the path does, and a single stream's speculative verification steps (up
 * to 9 rows) keep one-row decoding's (the tiles would be faster from 6-8 rows: Q6_K 9 rows 0.19 -> 0.13 ms) */
#define AMX_ROWS_Q8 3
#define AMX_ROWS_K 16
static int amx_state = -1; /* -1 not asked yet, 0 unavailable or off, 1 on */

static int amx_on(void) {
    if (amx_state < 0) /* Linux gives a process the tile data state on request (ARCH_REQ_XCOMP_PERM, XTILEDATA) */
        amx_state = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return amx_state;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

/* what the int8 tiles serve under auto: 8-bit blocks without mins (Q8_0, Q5_0, int8) from AMX_ROWS_Q8 rows; the
 * two-level layouts (Q4_K, Q5_K, int4 where K allows, and Q6_K's groups of 16 in gemm_amx16) from AMX_ROWS_K,
 * activations per 32 (finer than gemm_k's per 256). The one-level blocks whose int8 activations cost accuracy (Q4_0,
 * Q4_1, Q5_1) take the bf16 tiles (gemm_amx_bf16q) for bf16 rows, else the float32 paths. */
static int gemm_amx_serves(int64_t M, int bits, int sgn, int64_t G, int sfmt, const void *mins) {
    if (gemm_q8_serves(bits, sgn, G, sfmt, mins)) return M >= AMX_ROWS_Q8;
    if (M < AMX_ROWS_K || sfmt != SC_TWO_LEVEL) return 0;
    return (G == QB && !sgn && (bits == 4 || bits == 8)) || (G == 16 && sgn && (bits == 8 || bits == 6) && !mins);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define WQ_Q8_EXACT 1
/* 8-bit blocks (Q8_0, Q5_0, int8) below AMX_ROWS_Q8 rows where the tiles take the larger batches: gemm_q8's integer
 * products (int8 activations per 32), but each block's dot summed whole and scaled as gemm_amx scales it (float(dot)
 * times (weight scale times row scale), added block after block from zero; the rows past the tiles' last task in
 * amx_tail, as there). So a row gets the same bits alone as in any batch: a speculative verification step's rows
 * give what one-row decoding gives. 8 weight rows a step of two blocks: a row's two blocks in each of 8 registers,
 * a cache line of 8-bit blocks (w + 128, so that dpbusd takes them unsigned; 128 x the block's sum of x taken off
 * after), each block's 8 partial sums folded together. */
static void q8_exact(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, const int bits,
                     const sc_t *ws, const float *bias, const uint16_t *res, void *out, int out_bf16, int64_t ldo,
                     int64_t N) {
    const int64_t nb = K / QB, row_bytes = row_bytes_of(bits, K), whole = N / 32 * 32;
    int8_t *xq = (int8_t *)malloc((size_t)(M * K));
    float *xs = (float *)malloc((size_t)(M * nb) * sizeof(float));
    quantize_rows(x, x_bf16, M, K, QB, xq, xs, NULL, NULL);
    int32_t *xsum = (int32_t *)malloc((size_t)(M * nb) * sizeof(int32_t)); /* each block's sum of xq */
    for (int64_t i = 0; i < M * nb; i++) {
        int32_t t = 0;
        for (int k = 0; k < QB; k++) t += xq[i * QB + k];
        xsum[i] = t;
    }
#pragma omp parallel
    {
        const int64_t steps = (nb + 1) / 2;                                                /* two blocks a step */
        float *wsf = (float *)aligned_alloc(64, (size_t)(steps * 16) * sizeof(float)); /* [nb][8] */
        float *row = (float *)malloc((size_t)nb * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t g = 0; g < whole / 8; g++) {
            const int64_t n0 = 8 * g;
            for (int r = 0; r < 8; r++) {
                row_scales(ws, n0 + r, nb, row);
                for (int64_t b = 0; b < nb; b++) wsf[b * 8 + r] = row[b];
            }
            const char *next = (const char *)(w + (n0 + 8) * row_bytes); /* the next group's 8 rows */
            const int64_t lines = n0 + 8 < whole ? 8 * row_bytes / 64 : 0;
            for (int64_t m0 = 0; m0 < M; m0 += 2) { /* two input rows a pass: each block's weights widened once */
                const int two = m0 + 1 < M;
                __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
                for (int64_t b = 0; b < nb; b += 2) {
                    const int pair = b + 1 < nb; /* blocks b and b + 1, or b alone at an odd row's end */
                    if (m0 == 0) prefetch_part(next, lines, steps, b / 2);
                    __m512i wu[8]; /* row j's blocks b (low half) and b + 1 (high half), as unsigned: w + 128 */
                    for (int j = 0; j < 8; j++) {
                        const uint8_t *p = w + (n0 + j) * row_bytes + b * BLOCK_BYTES(bits);
                        const __m512i wv =
                            bits == 8 && pair ? _mm512_loadu_si512((const void *)p)
                                              : _mm512_inserti64x4(_mm512_castsi256_si512(block_bytes(p, bits, 1)),
                                                                   pair ? block_bytes(p + BLOCK_BYTES(bits), bits, 1)
                                                                        : _mm256_setzero_si256(),
                                                                   1);
                        wu[j] = _mm512_xor_si512(wv, _mm512_set1_epi8((char)0x80));
                    }
                    for (int i = 0; i < 1 + two; i++) {
                        const int64_t m = m0 + i;
                        const int8_t *xb = xq + m * K + b * QB;
                        const __m512i xz = pair ? _mm512_loadu_si512((const void *)xb)
                                                : _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)xb));
                        __m512i z[8];
                        for (int j = 0; j < 8; j++) z[j] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wu[j], xz);
                        /* each 128-bit chunk of p[k] and q[k]: its 4 sums of rows 4 k .. 4 k + 3's chunk */
                        __m512i p[4], q[2];
                        for (int j = 0; j < 4; j++)
                            p[j] = _mm512_add_epi32(_mm512_unpacklo_epi32(z[2 * j], z[2 * j + 1]),
                                                    _mm512_unpackhi_epi32(z[2 * j], z[2 * j + 1]));
                        for (int j = 0; j < 2; j++)
                            q[j] = _mm512_add_epi32(_mm512_unpacklo_epi64(p[2 * j], p[2 * j + 1]),
                                                    _mm512_unpackhi_epi64(p[2 * j], p[2 * j + 1]));
                        /* chunks 0 and 1 hold block b, 2 and 3 block b + 1: rows 0-3 and 4-7 of each block,
                         * then in the order rows 0-7 of block b, rows 0-7 of block b + 1 */
                        const __m512i sum =
                            _mm512_add_epi32(_mm512_shuffle_i32x4(q[0], q[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                             _mm512_shuffle_i32x4(q[0], q[1], _MM_SHUFFLE(3, 1, 3, 1)));
                        const __m512i two_blocks = _mm512_shuffle_i32x4(sum, sum, _MM_SHUFFLE(3, 1, 2, 0));
                        /* less 128 x each block's sum of x (the + 128 above) */
                        const __m512i off = _mm512_inserti64x4(
                            _mm512_castsi256_si512(_mm256_set1_epi32(128 * xsum[m * nb + b])),
                            _mm256_set1_epi32(pair ? 128 * xsum[m * nb + b + 1] : 0), 1);
                        const __m512 dots = _mm512_cvtepi32_ps(_mm512_sub_epi32(two_blocks, off));
                        acc[i] = _mm256_fmadd_ps(
                            _mm512_castps512_ps256(dots),
                            _mm256_mul_ps(_mm256_load_ps(wsf + b * 8), _mm256_set1_ps(xs[m * nb + b])), acc[i]);
                        if (pair) { /* block b + 1 after block b, as the tiles add them */
                            const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(dots), 1));
                            const __m256 sc =
                                _mm256_mul_ps(_mm256_load_ps(wsf + (b + 1) * 8), _mm256_set1_ps(xs[m * nb + b + 1]));
                            acc[i] = _mm256_fmadd_ps(hi, sc, acc[i]);
                        }
                    }
                }
                for (int i = 0; i < 1 + two; i++) {
                    float v[8];
                    _mm256_storeu_ps(v, acc[i]);
                    for (int r = 0; r < 8; r++) put(v[r], m0 + i, n0 + r, bias, res, out, out_bf16, ldo);
                }
            }
        }
        free(wsf);
        free(row);
    }
    if (whole < N)
        amx_tail(xq, xs, NULL, M, K, w, bits, 1, QB, ws, NULL, whole, N, bias, res, out, out_bf16, ldo, NULL);
    free(xq);
    free(xs);
    free(xsum);
}
#endif

#if WQ_PART != 1
/* block b of weight rows n0 .. n0 + 31 a byte each, as gemm_amx's A tiles take them: ab[h][r] row n0 + 16 h + r's 32
 * weights (5 bits as block_bytes gives them; 4 bits, byte j holding weights j and j + 16, through `table` where the
 * layout has one) */
static inline __attribute__((always_inline)) void amx_widen_block(const uint8_t *w, int64_t row_bytes, int64_t n0,
                                                                  int64_t b, const int bits, const int sgn,
                                                                  const int8_t *table, uint8_t ab[2][16][32]) {
    const __m128i tab = table ? _mm_loadu_si128((const __m128i *)table) : _mm_setzero_si128();
    for (int h = 0; h < 2; h++) {
        const uint8_t *blk = w + (n0 + 16 * h) * row_bytes + b * BLOCK_BYTES(bits);
#pragma GCC unroll 16
        for (int r = 0; r < 16; r++, blk += row_bytes) {
            if (bits == 5) {
                _mm256_store_si256((__m256i *)ab[h][r], block_bytes(blk, 5, sgn));
                continue;
            }
            const __m128i v = _mm_loadu_si128((const __m128i *)blk);
            __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0x0F));
            __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F));
            if (table) lo = _mm_shuffle_epi8(tab, lo), hi = _mm_shuffle_epi8(tab, hi);
            _mm256_store_si256((__m256i *)ab[h][r], _mm256_set_m128i(hi, lo));
        }
    }
}

WQ_PART2_KERNEL void gemm_amx(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, const int bits,
                              const int sgn, const sc_t *ws, const sc_t *wm, const float *bias, const uint16_t *res,
                              void *out, int out_bf16, int64_t ldo, int64_t N, const int8_t *table) {
    const int64_t nb = K / QB, mg = (M + 15) / 16, tasks = N / 32, row_bytes = row_bytes_of(bits, K);
    amx_in_t in = amx_inputs(x, x_bf16, M, K, wm != NULL);
    const int8_t *bt = in.bt;
    const float *xst = in.xst, *xgt = in.xgt;
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 4; i++) cfg.rows[i] = 16, cfg.colsb[i] = 64; /* C: 16 weight rows x 16 int32 */
    for (int i = 4; i < 6; i++) cfg.rows[i] = 16, cfg.colsb[i] = 32; /* A: 16 weight rows x 32 int8 */
    for (int i = 6; i < 8; i++) cfg.rows[i] = 8, cfg.colsb[i] = 64;  /* B: 8 rows of 16 x 4 int8 */
    /* a task: 32 weight rows (two A tiles) against the input rows, 32 at a time (two B tiles): four C tiles a
     * block, whose products run side by side */
#pragma omp parallel
    {
        _tile_loadconfig(&cfg);
        int32_t c[4][16][16] __attribute__((aligned(64)));
        float *wsf = (float *)malloc((size_t)(nb * 32) * sizeof(float)); /* [32][nb] the task's weight scales */
        float *wmf = (float *)malloc((size_t)(nb * 32) * sizeof(float)); /* [32][nb] and mins */
        uint8_t ab[2][16][32] __attribute__((aligned(64))); /* a block of 4- or 5-bit weights widened to bytes */
        /* more than one pass over the input rows: the task's blocks widened once, [nb][2][16][32], for every pass */
        uint8_t(*staged)[16][32] =
            bits != 8 && mg > 2 ? (uint8_t(*)[16][32])aligned_alloc(64, (size_t)(nb * 1024)) : NULL;
        __m512 acc[2][32];
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t n0 = 32 * t;
            task_scales(ws, wm, n0, nb, wsf, wmf); /* [32][nb]: per block */
            if (staged)
                for (int64_t b = 0; b < nb; b++) amx_widen_block(w, row_bytes, n0, b, bits, sgn, table, staged + 2 * b);
            const char *next = (const char *)(w + (n0 + 32) * row_bytes); /* the next task's rows */
            const int64_t lines = t + 1 < tasks ? 32 * row_bytes / 64 : 0;
            for (int64_t g0 = 0; g0 < mg; g0 += 2) {
                const int two = g0 + 1 < mg;
                for (int gi = 0; gi < 2; gi++)
                    for (int i = 0; i < 32; i++) acc[gi][i] = _mm512_setzero_ps();
                for (int64_t b = 0; b < nb; b++) {
                    if (g0 == 0) prefetch_part(next, lines, nb, b);
                    if (bits == 8) {
                        _tile_loadd(4, w + n0 * K + b * QB, K);
                        _tile_loadd(5, w + (n0 + 16) * K + b * QB, K);
                    } else {
                        uint8_t(*wb)[16][32] = staged ? staged + 2 * b : ab;
                        if (!staged) amx_widen_block(w, row_bytes, n0, b, bits, sgn, table, ab);
                        _tile_loadd(4, wb[0], 32);
                        _tile_loadd(5, wb[1], 32);
                    }
                    _tile_loadd(6, bt + (g0 * nb + b) * 512, 64);
                    _tile_zero(0);
                    _tile_zero(1);
                    if (sgn) {
                        _tile_dpbssd(0, 4, 6);
                        _tile_dpbssd(1, 5, 6);
                    } else {
                        _tile_dpbusd(0, 4, 6);
                        _tile_dpbusd(1, 5, 6);
                    }
                    if (two) {
                        _tile_loadd(7, bt + ((g0 + 1) * nb + b) * 512, 64);
                        _tile_zero(2);
                        _tile_zero(3);
                        if (sgn) {
                            _tile_dpbssd(2, 4, 7);
                            _tile_dpbssd(3, 5, 7);
                        } else {
                            _tile_dpbusd(2, 4, 7);
                            _tile_dpbusd(3, 5, 7);
                        }
                    }
                    _tile_stored(0, c[0], 64);
                    _tile_stored(1, c[1], 64);
                    if (two) {
                        _tile_stored(2, c[2], 64);
                        _tile_stored(3, c[3], 64);
                    }
                    const float *wb = wsf + b, *mb = wmf + b; /* row i's: wb[i * nb], mb[i * nb] */
                    for (int gi = 0; gi < 1 + two; gi++) {
                        const __m512 xsv = _mm512_loadu_ps(xst + ((g0 + gi) * nb + b) * 16);
                        const __m512 xgv = wm ? _mm512_loadu_ps(xgt + ((g0 + gi) * nb + b) * 16) : xsv;
                        for (int h = 0; h < 2; h++) { /* tile 2 gi + h: weight rows 16 h .. 16 h + 15 */
                            const int32_t(*ct)[16] = c[2 * gi + h];
                            __m512 *a = acc[gi] + 16 * h;
                            const float *wh = wb + 16 * h * nb, *mh = mb + 16 * h * nb;
#pragma GCC unroll 16
                            for (int i = 0; i < 16; i++) { /* the mins meet the rows' sums over the block first */
                                __m512 v = a[i];
                                if (wm) v = _mm512_fmadd_ps(_mm512_set1_ps(mh[i * nb]), xgv, v);
                                const __m512 p = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)ct[i]));
                                a[i] = _mm512_fmadd_ps(p, _mm512_mul_ps(_mm512_set1_ps(wh[i * nb]), xsv), v);
                            }
                        }
                    }
                }
                for (int gi = 0; gi < 1 + two; gi++) {
                    const int64_t m0 = 16 * (g0 + gi), rows = M - m0 < 16 ? M - m0 : 16;
                    amx_store(acc[gi], 32, rows, m0, n0, bias, res, out, out_bf16, ldo);
                }
            }
        }
        free(wsf);
        free(wmf);
        free(staged);
        _tile_release();
    }
    if (tasks * 32 < N)
        amx_tail(in.xq, in.xs, in.xg, M, K, w, bits, sgn, QB, ws, wm, tasks * 32, N, bias, res, out, out_bf16, ldo,
                 table);
    amx_inputs_free(&in);
}
#endif
/* Q6_K's groups of 16 (signed bytes, two-level scales, no mins): each 32-weight block's halves in their own tile
 * products (K = 16: A 16 weight rows x 16 bytes, B the half's 4 rows of the block's B tile), each scaled by its
 * group's scale; 16 weight rows and 16 input rows a pass. Rows past a multiple of 16 in amx_tail. */
#if WQ_PART != 1
WQ_PART2_KERNEL void gemm_amx16(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, const int bits,
                                const sc_t *ws, const float *bias, const uint16_t *res, void *out, int out_bf16,
                                int64_t ldo, int64_t N) {
    const int64_t nb = K / QB, ng = K / 16, mg = (M + 15) / 16, tasks = N / 16;
    amx_in_t in = amx_inputs(x, x_bf16, M, K, 0);
    const int8_t *bt = in.bt;
    const float *xst = in.xst;
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 2; i++) cfg.rows[i] = 16, cfg.colsb[i] = 64;     /* C: the block's two halves */
    for (int i = 2; i < 4; i++) cfg.rows[i] = 16, cfg.colsb[i] = 16;     /* A: 16 weight rows x 16 bytes */
    for (int i = 4; i < 6; i++) cfg.rows[i] = 4, cfg.colsb[i] = 64;      /* B: 4 rows of 16 x 4 bytes */
#pragma omp parallel
    {
        _tile_loadconfig(&cfg);
        int32_t c[2][16][16] __attribute__((aligned(64)));
        float *wsf = (float *)malloc((size_t)(ng * 16) * sizeof(float)); /* [ng][16] the task's group scales */
        /* int6: the task's 16 rows widened to bytes once, [nb][16][32], for every group of input rows */
        uint8_t *wide = bits == 6 ? (uint8_t *)aligned_alloc(64, (size_t)(nb * 512)) : NULL;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t n0 = 16 * t;
            for (int i = 0; i < 16; i++) {
                const sc_t sr = sc_row(*ws, n0 + i, ng);
                for (int64_t g = 0; g < ng; g++) wsf[g * 16 + i] = sc_at(&sr, g);
            }
            if (wide)
                for (int i = 0; i < 16; i++) {
                    const uint8_t *wr = w + (n0 + i) * row_bytes_of(6, K);
                    for (int64_t b = 0; b < nb; b++)
                        _mm256_store_si256((__m256i *)(wide + b * 512 + i * 32), block_bytes(wr + b * 24, 6, 1));
                }
            for (int64_t g0 = 0; g0 < mg; g0++) {
                __m512 acc[16];
                for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
                for (int64_t b = 0; b < nb; b++) {
                    if (wide) {
                        _tile_loadd(2, wide + b * 512, 32);
                        _tile_loadd(3, wide + b * 512 + 16, 32);
                    } else {
                        _tile_loadd(2, w + n0 * K + b * QB, K);
                        _tile_loadd(3, w + n0 * K + b * QB + 16, K);
                    }
                    _tile_loadd(4, bt + (g0 * nb + b) * 512, 64);
                    _tile_loadd(5, bt + (g0 * nb + b) * 512 + 256, 64);
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_dpbssd(0, 2, 4);
                    _tile_dpbssd(1, 3, 5);
                    _tile_stored(0, c[0], 64);
                    _tile_stored(1, c[1], 64);
                    const __m512 xsv = _mm512_loadu_ps(xst + (g0 * nb + b) * 16);
                    const float *lo = wsf + 2 * b * 16, *hi = lo + 16;
#pragma GCC unroll 16
                    for (int i = 0; i < 16; i++) {
                        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void *)c[0][i])),
                                                 _mm512_mul_ps(_mm512_set1_ps(lo[i]), xsv), acc[i]);
                        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void *)c[1][i])),
                                                 _mm512_mul_ps(_mm512_set1_ps(hi[i]), xsv), acc[i]);
                    }
                }
                const int64_t m0 = 16 * g0, rows = M - m0 < 16 ? M - m0 : 16;
                amx_store(acc, 16, rows, m0, n0, bias, res, out, out_bf16, ldo);
            }
        }
        free(wsf);
        free(wide);
        _tile_release();
    }
    if (tasks * 16 < N)
        amx_tail(in.xq, in.xs, NULL, M, K, w, bits, 1, 16, ws, NULL, tasks * 16, N, bias, res, out, out_bf16, ldo,
                 NULL);
    amx_inputs_free(&in);
}
#endif

#if defined(__AMX_BF16__)
#define WQ_AMX_BF16 1
#define AMX_BF16Q_ROWS 4 /* measured (135M shapes): even at 2-3 rows, 1.1-2x faster from 4, 2-3x at 64-256 */
/* The one-level blocks whose int8 activations cost accuracy (Q4_0, Q4_1, Q5_1: unsigned q of 4 or 5 bits, or a byte
 * each as earlier conversions held Q5_1, a scale per 32-multiple group, mins where the layout has them) for bf16
 * input rows at any batch size: q and x are exact in bf16, so each block's sum of q x comes from the tile unit's bf16
 * products (float32 sums), then scaled: scale x sum plus min x the row's sum over the block, block by block. A = 16
 * weight rows x a block's 32 q as bf16 (through a 32-entry table; bytes converted), B = 16 input rows' block in
 * pairs (made once per call), C [16 weight rows][16 input rows]. Each output is the same in any batch (the tile unit
 * sums a column on its own); weight rows past a multiple of 32 in plain C. */
static int gemm_amx_bf16q_serves(int x_bf16, int bits, int sgn, int64_t G, int sfmt) {
    return x_bf16 && !sgn && (bits == 4 || bits == 5 || bits == 8) && G % QB == 0 && sfmt != SC_TWO_LEVEL;
}

#if WQ_PART != 1
WQ_PART2_KERNEL void gemm_amx_bf16q(const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, const int bits,
                                    int64_t G, const sc_t *ws, const sc_t *wm, const float *bias, const uint16_t *res,
                                    void *out, int out_bf16, int64_t ldo, int64_t N) {
    const int64_t nb = K / QB, ng = K / G, mg = (M + 15) / 16, tasks = N / 32, row_bytes = row_bytes_of(bits, K);
    const int gshift = G == 32 ? 0 : G == 64 ? 1 : G == 128 ? 2 : 3; /* block b's group: b >> gshift */
    /* B tiles [mg][nb][16 pairs][16 rows x 2] bf16, and each input row's float32 sum over each block [mg][nb][16] */
    uint16_t *bt = (uint16_t *)aligned_alloc(64, (size_t)(mg * nb * 512) * sizeof(uint16_t));
    float *xgt = (float *)calloc((size_t)(mg * nb * 16), sizeof(float));
    memset(bt, 0, (size_t)(mg * nb * 512) * sizeof(uint16_t));
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) {
            uint16_t *tile = bt + ((m / 16) * nb + b) * 512;
            const uint16_t *src = x + m * K + b * QB;
            float t = 0.f;
            for (int k = 0; k < QB; k++) {
                tile[(k / 2) * 32 + (m % 16) * 2 + k % 2] = src[k];
                t += bf16_f32(src[k]);
            }
            xgt[((m / 16) * nb + b) * 16 + m % 16] = t;
        }
    uint16_t table[32] __attribute__((aligned(64))); /* q -> bf16 */
    for (int q = 0; q < 32; q++) table[q] = f32_bf16((float)q);
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 4; i++) cfg.rows[i] = 16, cfg.colsb[i] = 64; /* C: 16 weight rows x 16 float32 */
    for (int i = 4; i < 8; i++) cfg.rows[i] = 16, cfg.colsb[i] = 64; /* A: 16 x 32 bf16; B: 16 pairs x 16 x 2 */
#pragma omp parallel
    {
        _tile_loadconfig(&cfg);
        float c[4][16][16] __attribute__((aligned(64)));
        float *wsf = (float *)malloc((size_t)(ng * 32) * sizeof(float)); /* [32][ng] the task's scales */
        float *wmf = (float *)malloc((size_t)(ng * 32) * sizeof(float)); /* [32][ng] and mins */
        uint16_t ab[2][16][32] __attribute__((aligned(64)));                /* A: q as bf16 */
        const __m512i tab = _mm512_load_si512((const void *)table);
        __m512 acc[2][32];
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t n0 = 32 * t;
            task_scales(ws, wm, n0, ng, wsf, wmf); /* [32][ng]: per group */
            const char *next = (const char *)(w + (n0 + 32) * row_bytes); /* the next task's rows */
            const int64_t lines = t + 1 < tasks ? 32 * row_bytes / 64 : 0;
            for (int64_t g0 = 0; g0 < mg; g0 += 2) {
                const int two = g0 + 1 < mg;
                for (int gi = 0; gi < 2; gi++)
                    for (int i = 0; i < 32; i++) acc[gi][i] = _mm512_setzero_ps();
                for (int64_t b = 0; b < nb; b++) {
                    if (g0 == 0) prefetch_part(next, lines, nb, b);
                    for (int h = 0; h < 2; h++) {
                        const uint8_t *blk = w + (n0 + 16 * h) * row_bytes + b * BLOCK_BYTES(bits);
#pragma GCC unroll 16
                        for (int r = 0; r < 16; r++, blk += row_bytes) {
                            __m256i q;
                            if (bits == 4) { /* byte j: weight j in its low nibble, weight j + 16 in its high one */
                                const __m128i v = _mm_loadu_si128((const __m128i *)blk);
                                q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F)),
                                                     _mm_and_si128(v, _mm_set1_epi8(0x0F)));
                            } else if (bits == 8) { /* a byte a weight (Q5_1 as earlier conversions hold it): any
                                                      * byte is exact in bf16, its float32's top half */
                                for (int hf = 0; hf < 2; hf++) {
                                    const __m128i b16 = _mm_loadu_si128((const __m128i *)(blk + 16 * hf));
                                    const __m512 fv = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b16));
                                    const __m512i f = _mm512_castps_si512(fv);
                                    _mm256_store_si256((__m256i *)(ab[h][r] + 16 * hf),
                                                       _mm512_cvtepi32_epi16(_mm512_srli_epi32(f, 16)));
                                }
                                continue;
                            } else
                                q = block_bytes(blk, 5, 0);
                            _mm512_store_si512((void *)ab[h][r], _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(q), tab));
                        }
                    }
                    _tile_loadd(4, ab[0], 64);
                    _tile_loadd(5, ab[1], 64);
                    _tile_loadd(6, bt + (g0 * nb + b) * 512, 64);
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 5, 6);
                    if (two) {
                        _tile_loadd(7, bt + ((g0 + 1) * nb + b) * 512, 64);
                        _tile_zero(2);
                        _tile_zero(3);
                        _tile_dpbf16ps(2, 4, 7);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                    _tile_stored(0, c[0], 64);
                    _tile_stored(1, c[1], 64);
                    if (two) {
                        _tile_stored(2, c[2], 64);
                        _tile_stored(3, c[3], 64);
                    }
                    const float *wb = wsf + (b >> gshift), *mb = wmf + (b >> gshift); /* row i's: [i * ng] */
                    for (int gi = 0; gi < 1 + two; gi++) {
                        if (wm) { /* the mins meet the rows' sums over the block */
                            const __m512 xgv = _mm512_loadu_ps(xgt + ((g0 + gi) * nb + b) * 16);
#pragma GCC unroll 32
                            for (int i = 0; i < 32; i++)
                                acc[gi][i] = _mm512_fmadd_ps(_mm512_set1_ps(mb[i * ng]), xgv, acc[gi][i]);
                        }
                        for (int h = 0; h < 2; h++) { /* tile 2 gi + h: weight rows 16 h .. 16 h + 15 */
                            __m512 *a = acc[gi] + 16 * h;
                            const float *wh = wb + 16 * h * ng;
#pragma GCC unroll 16
                            for (int i = 0; i < 16; i++)
                                a[i] = _mm512_fmadd_ps(_mm512_load_ps(c[2 * gi + h][i]), _mm512_set1_ps(wh[i * ng]),
                                                       a[i]);
                        }
                    }
                }
                for (int gi = 0; gi < 1 + two; gi++) {
                    const int64_t m0 = 16 * (g0 + gi), rows = M - m0 < 16 ? M - m0 : 16;
                    amx_store(acc[gi], 32, rows, m0, n0, bias, res, out, out_bf16, ldo);
                }
            }
        }
        free(wsf);
        free(wmf);
        _tile_release();
    }
    /* weight rows past the last whole task: the same sums in plain C (the same for a row in any batch) */
    for (int64_t n = tasks * 32; n < N; n++) {
        const uint8_t *wn = w + n * row_bytes;
        const sc_t sr = sc_row(*ws, n, ng), mr = wm ? sc_row(*wm, n, ng) : sr;
        for (int64_t m = 0; m < M; m++) {
            float acc = 0.f;
            for (int64_t b = 0; b < nb; b++) {
                float dot = 0.f;
                for (int i = 0; i < QB; i++)
                    dot += (float)block_q(wn + b * BLOCK_BYTES(bits), bits, 0, i) * bf16_f32(x[m * K + b * QB + i]);
                acc += dot * sc_at(&sr, b >> gshift);
                if (wm) acc += sc_at(&mr, b >> gshift) * xgt[((m / 16) * nb + b) * 16 + m % 16];
            }
            put(acc, m, n, bias, res, out, out_bf16, ldo);
        }
    }
    free(bt);
    free(xgt);
}
#endif
#endif

#endif
#endif

#if WQ_PART == 1 /* part 2's kernels */
WQ_PART2_KERNEL void gemm_small(const float *xf, const float *xg, int64_t M, int64_t K, const uint8_t *w, int bits,
                                int sgn, int64_t G, const sc_t *ws, const sc_t *wm, const float *bias,
                                const uint16_t *res, void *out, int out_bf16, int64_t ldo, int64_t N);
WQ_PART2_KERNEL void gemm_k(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, int bits, int sgn,
                            int64_t G, const sc_t *ws, const sc_t *wm, const float *bias, const uint16_t *res,
                            void *out, int out_bf16, int64_t ldo, int64_t N);
WQ_PART2_KERNEL void gemm_q8(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, const int bits,
                             const sc_t *ws, const float *bias, const uint16_t *res, void *out, int out_bf16,
                             int64_t ldo, int64_t N);
WQ_PART2_KERNEL void gemm_vnni(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, const int bits,
                               const int sgn, const int64_t G, const sc_t *ws, const sc_t *wm, const float *bias,
                               const uint16_t *res, void *out, int out_bf16, int64_t ldo, int64_t N,
                               const int8_t *table);
WQ_PART2_KERNEL void gemm_i8v(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, const int bits,
                              const int sgn, const int64_t G, const sc_t *ws, const sc_t *wm, const float *bias,
                              const uint16_t *res, void *out, int out_bf16, int64_t ldo, int64_t N,
                              const int8_t *table);
WQ_PART2_KERNEL void gemm_i8k(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, const int bits,
                              const int sgn, const int64_t G, const sc_t *ws, const sc_t *wm, const float *bias,
                              const uint16_t *res, void *out, int out_bf16, int64_t ldo, int64_t N);
WQ_PART2_KERNEL void gemm_amx(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, const int bits,
                              const int sgn, const sc_t *ws, const sc_t *wm, const float *bias, const uint16_t *res,
                              void *out, int out_bf16, int64_t ldo, int64_t N, const int8_t *table);
WQ_PART2_KERNEL void gemm_amx16(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, const int bits,
                                const sc_t *ws, const float *bias, const uint16_t *res, void *out, int out_bf16,
                                int64_t ldo, int64_t N);
WQ_PART2_KERNEL void gemm_amx_bf16q(const uint16_t *x, int64_t M, int64_t K, const uint8_t *w, const int bits,
                                    int64_t G, const sc_t *ws, const sc_t *wm, const float *bias, const uint16_t *res,
                                    void *out, int out_bf16, int64_t ldo, int64_t N);
#endif

#if WQ_PART != 2 /* the dispatcher and the exported entry points: part 1 */

/* MXFP4 blocks (mxfp4_kernels.c's batches, GGUF's nibble order: byte j holds weights j and j + 16; e8m0 scales
 * against the doubled e2m1 values) on the tiles where they are on, else on the int8 vectors (gemm_vnni, gemm_i8v),
 * 4-bit blocks widened to signed bytes through the e2m1 table; x float32 [M, K], rounded to int8 per 32. Returns
 * whether it ran (0 without either, or with them off). */
int qgemm_mxfp4_tiles(const float *x, int64_t M, int64_t K, const uint8_t *q, const uint8_t *e, const float *bias,
                      const uint16_t *res, void *out, int out_bf16, int64_t ldo, int64_t N) {
#ifdef WQ_AVX2
    static const int8_t MX_TABLE[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    const sc_t ws = sc_of(e, NULL, SC_E8M0, 1, QB);
#ifdef WQ_AMX
    if (amx_on()) {
        gemm_amx(x, 0, M, K, q, 4, 1, &ws, NULL, bias, res, out, out_bf16, ldo, N, MX_TABLE);
        return 1;
    }
#endif
#if defined(WQ_TILES)
    if (vnni_state) { /* the same sums on vectors */
        gemm_vnni(x, 0, M, K, q, 4, 1, QB, &ws, NULL, bias, res, out, out_bf16, ldo, N, MX_TABLE);
        return 1;
    }
#elif defined(WQ_I8V)
    if (i8v_state) {
        gemm_i8v(x, 0, M, K, q, 4, 1, QB, &ws, NULL, bias, res, out, out_bf16, ldo, N, MX_TABLE);
        return 1;
    }
#endif
#endif
    (void)x, (void)M, (void)K, (void)q, (void)e, (void)bias, (void)res, (void)out, (void)out_bf16, (void)ldo, (void)N;
    return 0;
}

/* whether the tiles are on (cpu_kernels.c's bf16 batches take them too) */
int qgemm_amx_on(void) {
#ifdef WQ_AMX
    return amx_on();
#else
    return 0;
#endif
}

/* the batch size from which auto stops taking gemm_q8 for 8-bit blocks on this thread (where AMX does not take them) */
int qgemm_int8_rows_q8(void) {
#ifdef WQ_AVX2
    return rows_q8();
#else
    return 0; /* the portable build: float32 for every batch */
#endif
}

/* the batch size from which auto stops taking gemm_i4m (int8 x per 32) for one-level 4-bit blocks on this thread
 * (where AMX's bf16 tiles do not take them first) */
int qgemm_int8_rows_4(void) {
#ifdef WQ_AVX2
    return rows_4();
#else
    return 0; /* the portable build: float32 for every batch */
#endif
}

/* whether auto takes the int8 vectors (gemm_vnni, int8 x per 32) for one-level 4-bit blocks from that batch size on
 * (AVX-512 VNNI, while they are on); else gemm_i16b (int16 x) */
int qgemm_int8_vectors_4(void) {
#ifdef WQ_TILES
    return vnni_state;
#else
    return 0;
#endif
}

/* the batch size from which auto stops taking gemm_k for the two-level layouts (where AMX does not take them) */
int qgemm_int8_rows_k(void) {
#ifdef WQ_AVX2
    return rows_k();
#else
    return 0; /* the portable build: float32 for every batch */
#endif
}

/* the values over which the int8 vector batches round the two-level layouts' activations: 256 (gemm_i8k, as gemm_k
 * rounds them, with AVX2 or AVX-512), 0 where the build has no vector batches */
int qgemm_int8_vectors_block_k(void) {
#if defined(WQ_TILES) || defined(WQ_I8V)
    return KS;
#else
    return 0;
#endif
}

/* whether this thread's qgemm calls give each row of a batch the bits it gets alone where a path allows it (8-bit
 * and one-level 4-bit blocks up to INT8_ROWS_Q8_EXACT rows, the K-quants up to INT8_ROWS_K_EXACT): on while a step
 * verifies drafts; returns the setting before */
int qgemm_set_rows_exact(int on) {
    const int was = rows_exact;
    rows_exact = on;
    return was;
}

/* this thread's setting (a parallel region's callers hand it to their team: it is per thread) */
int qgemm_rows_exact(void) { return rows_exact; }

/* the int8 vector batches (gemm_vnni with AVX-512 VNNI, else gemm_i8v with AVX2) on or off for this process
 * (benchmarks and tests compare the paths); returns whether they are on (0 where the build has neither) */
int qgemm_set_int8_vectors(int on) {
#if defined(WQ_TILES)
    vnni_state = on;
    return vnni_state;
#elif defined(WQ_I8V)
    i8v_state = on;
    return i8v_state;
#else
    (void)on;
    return 0;
#endif
}

/* AMX on or off for this process (tests take the other paths with it off); returns whether it is on */
int qgemm_set_amx(int on) {
#ifdef WQ_AMX
    if (!on) amx_state = 0;
    else {
        amx_state = -1;
        amx_on();
    }
    return amx_state;
#else
    (void)on;
    return 0;
#endif
}

/* out[m, n] (row stride ldo) = sum_k x[m, k] * W[n, k] (+ bias[n]) for W [N, K] in one of the layouts above: bits
 * 8 (sgn: signed values) or 4; scales and mins (or NULL) [N, K / G] in format sfmt (SC_*): float32, float16, or
 * two-level: bytes (the scales' signed as the weights, the mins' unsigned) times sup / supm [N, K / 256]. x:
 * float32 or bf16 (x_bf16) [M, K]; K a multiple of 32 and of G. out: float32, or bf16 (out_bf16), plus the bf16
 * residual res [M, ldo] when given. act: how x is multiplied (ACT_*, see above). */
void qgemm(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, int bits, int sgn, int64_t G,
           const void *scales_v, const void *mins_v, const float *sup, const float *supm, int sfmt, const float *bias,
           const uint16_t *res, void *out, int out_bf16, int64_t ldo, int64_t N, int act) {
    const sc_t sc = sc_of(scales_v, sup, sfmt, sgn, G), mn = sc_of(mins_v, supm, sfmt, 0, G);
    const sc_t *scales = &sc, *mins = sc_some(&mn) ? &mn : NULL;
#ifdef WQ_AVX2
#ifdef WQ_AMX
    if (act == ACT_AUTO && gemm_amx_serves(M, bits, sgn, G, sfmt, mins_v) && amx_on()) {
        if (G == 16) gemm_amx16(x, x_bf16, M, K, w, bits, scales, bias, res, out, out_bf16, ldo, N);
        else gemm_amx(x, x_bf16, M, K, w, bits, sgn, scales, mins, bias, res, out, out_bf16, ldo, N, NULL);
        return;
    }
#endif
    if (act == ACT_AUTO && M < rows_k() && gemm_k_serves(bits, sgn, G, sfmt, K)) {
        gemm_k(x, x_bf16, M, K, w, bits, sgn, G, scales, &mn, bias, res, out, out_bf16, ldo, N);
        return;
    }
    if (act == ACT_AUTO && M < rows_q8() && gemm_q8_serves(bits, sgn, G, sfmt, mins_v)) {
#ifdef WQ_Q8_EXACT
        if (amx_on()) { /* the tiles take this layout from AMX_ROWS_Q8 rows: the same sums below */
            q8_exact(x, x_bf16, M, K, w, bits, scales, bias, res, out, out_bf16, ldo, N);
            return;
        }
#endif
        gemm_q8(x, x_bf16, M, K, w, bits, scales, bias, res, out, out_bf16, ldo, N);
        return;
    }
#ifdef WQ_TILES
    if (act == ACT_AUTO && vnni_state && gemm_k_serves(bits, sgn, G, sfmt, K)) { /* past gemm_k's rows */
        gemm_i8k(x, x_bf16, M, K, w, bits, sgn, G, scales, mins, bias, res, out, out_bf16, ldo, N);
        return;
    }
    if (act == ACT_AUTO && vnni_state && gemm_vnni_serves(bits, sgn, G, sfmt, mins_v)) { /* past the row paths */
        gemm_vnni(x, x_bf16, M, K, w, bits, sgn, G, scales, mins, bias, res, out, out_bf16, ldo, N, NULL);
        return;
    }
#endif
#ifdef WQ_I8V
    if (act == ACT_AUTO && i8v_state && gemm_k_serves(bits, sgn, G, sfmt, K)) { /* past gemm_k's rows */
        gemm_i8k(x, x_bf16, M, K, w, bits, sgn, G, scales, mins, bias, res, out, out_bf16, ldo, N);
        return;
    }
    if (act == ACT_AUTO && i8v_state && gemm_i8v_serves(bits, sgn, G, sfmt, mins_v)) {
        gemm_i8v(x, x_bf16, M, K, w, bits, sgn, G, scales, mins, bias, res, out, out_bf16, ldo, N, NULL);
        return;
    }
#endif
    if (act == ACT_AUTO && rows_exact && M < rows_4() && gemm_i4m_serves(bits, sgn, G, sfmt)) {
        gemm_i4m(x, x_bf16, M, K, w, scales, &mn, bias, res, out, out_bf16, ldo, N); /* before AMX's bf16 tiles */
        return;
    }
#ifdef WQ_AMX_BF16
    if (act == ACT_AUTO && M >= AMX_BF16Q_ROWS && gemm_amx_bf16q_serves(x_bf16, bits, sgn, G, sfmt) && amx_on()) {
        gemm_amx_bf16q((const uint16_t *)x, M, K, w, bits, G, scales, mins, bias, res, out, out_bf16, ldo, N);
        return;
    }
#endif
    if (act == ACT_AUTO && M < rows_4() && gemm_i4m_serves(bits, sgn, G, sfmt)) {
        gemm_i4m(x, x_bf16, M, K, w, scales, &mn, bias, res, out, out_bf16, ldo, N);
        return;
    }
#ifdef WQ_TILES
    if (act == ACT_AUTO && vnni_state && gemm_i4m_serves(bits, sgn, G, sfmt)) { /* past gemm_i4m's rows */
        gemm_vnni(x, x_bf16, M, K, w, bits, sgn, G, scales, mins, bias, res, out, out_bf16, ldo, N, NULL);
        return;
    }
#endif
    if (act == ACT_AUTO && M < PANEL_ROWS && gemm_i16_serves(bits, sgn, G, sfmt)) {
        gemm_i16(x, x_bf16, M, K, w, bits, scales, &mn, bias, res, out, out_bf16, ldo, N);
        return;
    }
    if (act == ACT_AUTO && gemm_i16_serves(bits, sgn, G, sfmt)) { /* from PANEL_ROWS */
        gemm_i16b(x, x_bf16, M, K, w, bits, scales, &mn, bias, res, out, out_bf16, ldo, N);
        return;
    }
#endif
    if (act != ACT_INT8) {
        const int small = M < PANEL_ROWS;
        float *xf = x_bf16 ? (float *)malloc((size_t)(M * K) * sizeof(float)) : NULL;
        float *xg = small && mins ? (float *)malloc((size_t)(M * (K / G)) * sizeof(float)) : NULL;
        if (xf || xg) quantize_rows(x, x_bf16, M, K, G, NULL, NULL, xg, xf);
        const float *xr = xf ? xf : (const float *)x;
        if (small) gemm_small(xr, xg, M, K, w, bits, sgn, G, scales, &mn, bias, res, out, out_bf16, ldo, N);
        else gemm_panels(xr, M, K, w, bits, sgn, G, scales, &mn, bias, res, out, out_bf16, ldo, N);
        free(xf);
        free(xg);
        return;
    }
    const int64_t nb = K / QB, ng = K / G, row_bytes = row_bytes_of(bits, K);
    const int gshift = G == 16 ? 4 : G == 32 ? 5 : G == 64 ? 6 : 7;
    int8_t *xq = (int8_t *)malloc((size_t)(M * K));
    float *xs = (float *)malloc((size_t)(M * nb) * sizeof(float));
    float *xg = (float *)malloc((size_t)(M * ng) * sizeof(float));
    float *y = (float *)malloc((size_t)(M * N) * sizeof(float));
    quantize_rows(x, x_bf16, M, K, G, xq, xs, xg, NULL);
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wn = w + n * row_bytes;
        const sc_t sr = sc_row(sc, n, ng), mr = sc_row(mn, n, ng), *sn = &sr, *mnr = &mr;
        if (bits == 4) weight_row_int8(wn, sn, mnr, gshift, ng, nb, xq, xs, xg, M, K, 4, 0, y + n, N);
        else if (bits == 5 && sgn) weight_row_int8(wn, sn, mnr, gshift, ng, nb, xq, xs, xg, M, K, 5, 1, y + n, N);
        else if (bits == 5) weight_row_int8(wn, sn, mnr, gshift, ng, nb, xq, xs, xg, M, K, 5, 0, y + n, N);
        else if (bits == 6) weight_row_int8(wn, sn, mnr, gshift, ng, nb, xq, xs, xg, M, K, 6, 1, y + n, N);
        else if (sgn) weight_row_int8(wn, sn, mnr, gshift, ng, nb, xq, xs, xg, M, K, 8, 1, y + n, N);
        else weight_row_int8(wn, sn, mnr, gshift, ng, nb, xq, xs, xg, M, K, 8, 0, y + n, N);
    }
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) put(y[m * N + n], m, n, bias, res, out, out_bf16, ldo);
    free(xq);
    free(xs);
    free(xg);
    free(y);
}

/* qgemm over weight rows [n0, n0 + N) only (out: the first of their N output columns), their scales and mins
 * found as every path finds a row's (sc_row): each output depends only on its own weight row, so a slice gives the
 * whole call's values. bias: the rows' own [N] (or NULL); no residual. */
void qgemm_rows(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *w, int bits, int sgn, int64_t G,
                const void *scales_v, const void *mins_v, const float *sup, const float *supm, int sfmt,
                const float *bias, void *out, int out_bf16, int64_t ldo, int64_t n0, int64_t N, int act) {
    const int64_t ng = K / G;
    const sc_t sc = sc_row(sc_of(scales_v, sup, sfmt, sgn, G), n0, ng);
    const sc_t mn = sc_row(sc_of(mins_v, supm, sfmt, 0, G), n0, ng);
    const void *sv = sc.f ? (const void *)sc.f : sc.h ? (const void *)sc.h : (const void *)sc.b;
    const void *mv = mn.f ? (const void *)mn.f : mn.h ? (const void *)mn.h : (const void *)mn.b;
    qgemm(x, x_bf16, M, K, w + n0 * row_bytes_of(bits, K), bits, sgn, G, sv, mv, sc.sup, mn.sup, sfmt, bias, NULL,
          out, out_bf16, ldo, N, act);
}

/* one row of weights as float32 (scale * q + min, in that order: the values QuantWeight.dequantize gives) */
__attribute__((optimize("fp-contract=off"))) static void dequant_row(const uint8_t *wn, int bits, int sgn, int64_t G,
                                                                     const sc_t *sr, const sc_t *mr, int mins,
                                                                     int64_t K, float *out) {
    for (int64_t k = 0; k < K; k++) {
        const float q = (float)block_q(wn + k / QB * BLOCK_BYTES(bits), bits, sgn, (int)(k % QB));
        const float v = sc_at(sr, k / G) * q;
        out[k] = mins ? v + sc_at(mr, k / G) : v;
    }
}

/* rows ids[0 .. n) of W (rows 0 .. n - 1 where ids is NULL) as float32, out [n, K] */
__attribute__((optimize("fp-contract=off"))) static void dequant_rows(const uint8_t *w, int bits, int sgn, int64_t G,
                                                                      const void *scales, const void *mins,
                                                                      const float *sup, const float *supm, int sfmt,
                                                                      const int64_t *ids, int64_t n, int64_t K,
                                                                      float *out) {
    const int64_t ng = K / G, row_bytes = row_bytes_of(bits, K);
    const sc_t sc = sc_of(scales, sup, sfmt, sgn, G), mn = sc_of(mins, supm, sfmt, 0, G);
#pragma omp parallel for schedule(static) if (n * K > 65536)
    for (int64_t i = 0; i < n; i++) {
        const int64_t r = ids ? ids[i] : i;
        const sc_t sr = sc_row(sc, r, ng), mr = sc_row(mn, r, ng);
        dequant_row(w + r * row_bytes, bits, sgn, G, &sr, &mr, mins != NULL, K, out + i * K);
    }
}

/* out [N, K] float32 = scale * q + min for rows of W in either layout (prefill's tiles, embeddings' rows), the
 * product rounded before the min is added: the same weights the float32 path multiplies. */
__attribute__((optimize("fp-contract=off"))) void qdequant(const uint8_t *w, int bits, int sgn, int64_t G,
                                                           const void *scales, const void *mins, const float *sup,
                                                           const float *supm, int sfmt, int64_t N, int64_t K,
                                                           float *out) {
    dequant_rows(w, bits, sgn, G, scales, mins, sup, supm, sfmt, NULL, N, K, out);
}

/* rows ids[0 .. n) of a weight matrix of N rows as qdequant gives them, out [n, K]: a quantized token embedding's
 * lookup (a decode step's one row without the PyTorch ops of slicing and widening blocks); returns the place in
 * ids of the first id out of 0 .. N - 1 (nothing written), else -1 */
__attribute__((optimize("fp-contract=off"))) int64_t qdequant_rows(const uint8_t *w, int bits, int sgn, int64_t G,
                                                                   const void *scales, const void *mins,
                                                                   const float *sup, const float *supm, int sfmt,
                                                                   int64_t N, const int64_t *ids, int64_t n,
                                                                   int64_t K, float *out) {
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= N) return i;
    dequant_rows(w, bits, sgn, G, scales, mins, sup, supm, sfmt, ids, n, K, out);
    return -1;
}
#endif /* WQ_PART != 2 */
