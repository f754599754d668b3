// MXFP4 weight-only GEMM (gpt-oss's experts, models/quant/mxfp4.py): out = x W^T (+ bias), W read from its blocks
// (16 bytes of e2m1 nibbles and one e8m0 scale per 32 weights), never widened to a copy. x and out are float32.
// Each block's 32 weights are decoded once (a 16-entry table of the doubled e2m1 values, times 2^(e - 128)) and
// multiplied with up to MX_ROWS rows of x at a time: one row is a decode step's dot product, several share the
// decoding. Or, with int8_act (the default), x rounded to int8 per block and integer products (mx_dot_rows_i8).
// Two nibble orders: GGUF's (byte j: weights j, j + 16) read as stored; the released checkpoints' (byte j: weights
// 2j, 2j + 1) by first reordering each row of x within its blocks to GGUF's order, once a call.
// AVX2 + FMA where the compiler targets them (-march=native at first use), plain C elsewhere (and with
// -DWS_PORTABLE): the same numbers up to the order of float32 sums.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && !defined(WS_PORTABLE)
#include <immintrin.h>
#define MX_AVX2 1
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define MX_512 1 /* int8 activations: four blocks a 512-bit step (mx_dot_rows_512) */
#endif
#endif

#define MX_ROWS 8

static const int8_t MX_KVALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// 2^(e - 128), built from its bits (subnormal for e < 2)
static inline float mx_half_scale(uint8_t e) {
    uint32_t bits = e >= 2 ? (uint32_t)(e - 1) << 23 : (uint32_t)1 << (21 + e);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

// every scale byte's 2^(e - 128), read by broadcast loads (no shuffle-port work a block)
static float MX_HALF[256];

static void mx_init_table(void) {
    static int done = 0;
    if (__atomic_load_n(&done, __ATOMIC_ACQUIRE)) return;
    for (int e = 0; e < 256; e++) MX_HALF[e] = mx_half_scale((uint8_t)e);
    __atomic_store_n(&done, 1, __ATOMIC_RELEASE);
}

// the row loops below are inlined with a constant row count (MX_DISPATCH), so that their accumulators stay in
// registers
#define MX_INLINE static inline __attribute__((always_inline))
#define MX_DISPATCH(fn, nr, ...)          \
    switch (nr) {                         \
    case 1: fn(__VA_ARGS__, 1); break;    \
    case 2: fn(__VA_ARGS__, 2); break;    \
    case 3: fn(__VA_ARGS__, 3); break;    \
    case 4: fn(__VA_ARGS__, 4); break;    \
    case 5: fn(__VA_ARGS__, 5); break;    \
    case 6: fn(__VA_ARGS__, 6); break;    \
    case 7: fn(__VA_ARGS__, 7); break;    \
    default: fn(__VA_ARGS__, 8); break;   \
    }

#ifdef MX_AVX2
static inline float mx_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

// nr rows of x (at most MX_ROWS; a constant once inlined) against one weight row w: acc[r] = sum_k x[r, k] w[k]
MX_INLINE void mx_dot_rows(const float *x, int64_t k, const uint8_t *q, const uint8_t *e, float *acc, const int nr) {
    const int64_t blocks = k / 32;
#ifdef MX_AVX2
    __m256 s[MX_ROWS];
    for (int r = 0; r < nr; r++) s[r] = _mm256_setzero_ps();
    const __m128i table = _mm_loadu_si128((const __m128i *)MX_KVALUES);
    const __m128i low = _mm_set1_epi8(0x0f);
    for (int64_t b = 0; b < blocks; b++) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(q + 16 * b));
        const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(bytes, low));
        const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), low));
        const __m256 d = _mm256_broadcast_ss(MX_HALF + e[b]);
        const __m256 w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), d);
        const __m256 w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), d);
        const __m256 w2 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), d);
        const __m256 w3 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), d);
        const float *xb = x + 32 * b;
        for (int r = 0; r < nr; r++) {
            const float *xr = xb + r * k;
            __m256 t = _mm256_mul_ps(w0, _mm256_loadu_ps(xr));
            t = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), t);
            t = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xr + 16), t);
            t = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xr + 24), t);
            s[r] = _mm256_add_ps(s[r], t);
        }
    }
    for (int r = 0; r < nr; r++) acc[r] = mx_hsum(s[r]);
#else
    for (int64_t r = 0; r < nr; r++) acc[r] = 0.0f;
    float w[32];
    for (int64_t b = 0; b < blocks; b++) {
        const float d = mx_half_scale(e[b]);
        for (int j = 0; j < 16; j++) {
            w[j] = MX_KVALUES[q[16 * b + j] & 15] * d;
            w[j + 16] = MX_KVALUES[q[16 * b + j] >> 4] * d;
        }
        for (int64_t r = 0; r < nr; r++) {
            const float *xr = x + r * k + 32 * b;
            float t = 0.0f;
            for (int j = 0; j < 32; j++) t += w[j] * xr[j];
            acc[r] += t;
        }
    }
#endif
}

// The same dot products with x rounded to int8 per block of 32 (xq, one float scale dx a block, as llama.cpp's
// Q8_0 activations): the weights stay int8 (the doubled values), products are summed exactly in integers and each
// block's sum is scaled once, so a block costs a few integer instructions instead of widening 32 weights to float.
#ifdef MX_AVX2
// s[r] += the blocks [b0, k / 32) of row r's sums, in 8 lanes (mx_dot_rows_i8's AVX2 steps)
MX_INLINE void mx_blocks_i8(const int8_t *xq, const float *dx, int64_t k, const uint8_t *q, const uint8_t *e,
                            int64_t b0, __m256 *s, const int nr) {
    const int64_t blocks = k / 32;
    const __m128i table = _mm_loadu_si128((const __m128i *)MX_KVALUES);
    const __m128i low = _mm_set1_epi8(0x0f);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = b0; b < blocks; b++) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(q + 16 * b));
        const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(bytes, low));
        const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), low));
        const __m256i w = _mm256_set_m128i(hi, lo);  // weights 0..15, then 16..31
        const __m256i aw = _mm256_sign_epi8(w, w);
        const __m256 d = _mm256_broadcast_ss(MX_HALF + e[b]);
        for (int r = 0; r < nr; r++) {
            const __m256i y = _mm256_loadu_si256((const __m256i *)(xq + r * k + 32 * b));
            // |w| <= 12 and |y| <= 127: the pairwise int16 sums (at most 3048) cannot saturate
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(y, w)), ones);
            const __m256 scale = _mm256_mul_ps(d, _mm256_broadcast_ss(dx + r * blocks + b));
            s[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, s[r]);
        }
    }
}
#endif

MX_INLINE void mx_dot_rows_i8(const int8_t *xq, const float *dx, int64_t k, const uint8_t *q, const uint8_t *e,
                              float *acc, const int nr) {
#ifdef MX_AVX2
    __m256 s[MX_ROWS];
    for (int r = 0; r < nr; r++) s[r] = _mm256_setzero_ps();
    mx_blocks_i8(xq, dx, k, q, e, 0, s, nr);
    for (int r = 0; r < nr; r++) acc[r] = mx_hsum(s[r]);
#else
    const int64_t blocks = k / 32;
    for (int64_t r = 0; r < nr; r++) acc[r] = 0.0f;
    int8_t w[32];
    for (int64_t b = 0; b < blocks; b++) {
        const float d = mx_half_scale(e[b]);
        for (int j = 0; j < 16; j++) {
            w[j] = MX_KVALUES[q[16 * b + j] & 15];
            w[j + 16] = MX_KVALUES[q[16 * b + j] >> 4];
        }
        for (int64_t r = 0; r < nr; r++) {
            const int8_t *yr = xq + r * k + 32 * b;
            int32_t t = 0;
            for (int j = 0; j < 32; j++) t += (int32_t)w[j] * yr[j];
            acc[r] += (float)t * (d * dx[r * blocks + b]);
        }
    }
#endif
}

#ifdef MX_512
// The e2m1 values doubled plus 12 (0..24, unsigned), so that dpbusd multiplies them with signed int8 x; the 12 x sum(x)
// this adds is taken out by starting each sum at -12 x sum(x) (mx512_prepare's corr)
static const uint8_t MX_UVALUES[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

// x's int8 rows laid out for mx_dot_rows_512, per row and group of 4 blocks (128 weights): xa, the 4 blocks' first
// 16 values (as the low nibbles of their 64 weight bytes pair with them), then their last 16; corr, int32 [16] a
// group: -12 x each lane's 8 values of x (the lane's 4 bytes in both halves); dxv, float [16] a group: each block's
// scale 4 times (its 4 lanes). Blocks past the last whole group stay in xq and dx.
typedef struct {
    int8_t *xa;
    int32_t *corr;
    float *dxv;
    int64_t groups;
} mx512_t;

static int mx512_prepare(const int8_t *xq, const float *dx, int64_t m, int64_t k, mx512_t *p) {
    const int64_t groups = k / 128, blocks = k / 32;
    p->groups = groups;
    p->xa = (int8_t *)malloc((size_t)(m * groups * 128) + 1);
    p->corr = (int32_t *)malloc(sizeof(int32_t) * (size_t)(m * groups * 16) + 1);
    p->dxv = (float *)malloc(sizeof(float) * (size_t)(m * groups * 16) + 1);
    if (!p->xa || !p->corr || !p->dxv) return 0;
    for (int64_t r = 0; r < m; r++)
        for (int64_t g = 0; g < groups; g++) {
            int8_t *xa = p->xa + (r * groups + g) * 128;
            int32_t *corr = p->corr + (r * groups + g) * 16;
            float *dxv = p->dxv + (r * groups + g) * 16;
            for (int b = 0; b < 4; b++) {
                const int8_t *xb = xq + r * k + (4 * g + b) * 32;
                memcpy(xa + 16 * b, xb, 16);
                memcpy(xa + 64 + 16 * b, xb + 16, 16);
                for (int l = 0; l < 4; l++) {
                    int32_t t = 0;
                    for (int i = 0; i < 4; i++) t += xb[4 * l + i] + xb[16 + 4 * l + i];
                    corr[4 * b + l] = -12 * t;
                    dxv[4 * b + l] = dx[r * blocks + 4 * g + b];
                }
            }
        }
    return 1;
}

static void mx512_free(mx512_t *p) { free(p->xa), free(p->corr), free(p->dxv); }

// mx_dot_rows_i8's sums, four blocks a step: 64 weight bytes widened by one table lookup a half to unsigned values,
// multiplied with x by dpbusd (exact integer sums, 4 lanes a block), each block's lanes scaled by its weight's and
// x's scales; the blocks past the last group of 4 by mx_blocks_i8, as mx_dot_rows_i8 takes them
MX_INLINE void mx_dot_rows_512(const mx512_t *p, const int8_t *xq, const float *dx, int64_t k, const uint8_t *q,
                               const uint8_t *e, float *acc, const int nr) {
    const int64_t groups = p->groups;
    __m512 s[MX_ROWS];
    for (int r = 0; r < nr; r++) s[r] = _mm512_setzero_ps();
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)MX_UVALUES));
    const __m512i low = _mm512_set1_epi8(0x0f), one = _mm512_set1_epi32(1), two = _mm512_set1_epi32(2);
    const __m128i spread = _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    for (int64_t g = 0; g < groups; g++) {
        _mm_prefetch((const char *)(q + 64 * g + 2048), _MM_HINT_T0);
        _mm_prefetch((const char *)(q + 64 * g + 8192), _MM_HINT_T1); // and into L2: more lines in flight
        const __m512i bytes = _mm512_loadu_si512((const void *)(q + 64 * g));
        const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(bytes, low));
        const __m512i hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low));
        uint32_t e4;
        memcpy(&e4, e + 4 * g, sizeof e4);
        const __m512i ev = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(_mm_cvtsi32_si128((int)e4), spread));
        // 2^(e - 128) from its bits: (e - 1) << 23, or 1 << (21 + e) below e = 2 (subnormal), as mx_half_scale
        __m512i bits = _mm512_slli_epi32(_mm512_sub_epi32(ev, one), 23);
        bits = _mm512_mask_sllv_epi32(bits, _mm512_cmplt_epu32_mask(ev, two), one,
                                      _mm512_add_epi32(ev, _mm512_set1_epi32(21)));
        const __m512 dw = _mm512_castsi512_ps(bits);
        for (int r = 0; r < nr; r++) {
            const int64_t at = r * groups + g;
            const int8_t *xa = p->xa + at * 128;
            __m512i a = _mm512_loadu_si512((const void *)(p->corr + at * 16));
            a = _mm512_dpbusd_epi32(a, lo, _mm512_loadu_si512((const void *)xa));
            a = _mm512_dpbusd_epi32(a, hi, _mm512_loadu_si512((const void *)(xa + 64)));
            const __m512 scale = _mm512_mul_ps(dw, _mm512_loadu_ps(p->dxv + at * 16));
            s[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a), scale, s[r]);
        }
    }
    __m256 t[MX_ROWS];
    for (int r = 0; r < nr; r++) t[r] = _mm256_setzero_ps();
    mx_blocks_i8(xq, dx, k, q, e, 4 * groups, t, nr);
    for (int r = 0; r < nr; r++) acc[r] = _mm512_reduce_add_ps(s[r]) + mx_hsum(t[r]);
}
#endif

// x rounded to int8 per block of 32: dx = max |x| / 127, xq = round(x / dx) (0 where the block is 0)
static void mx_quantize_rows(const float *x, int64_t m, int64_t k, int8_t *xq, float *dx) {
    for (int64_t i = 0; i < m * k / 32; i++) {
        const float *xb = x + 32 * i;
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
        dx[i] = d;
        for (int j = 0; j < 32; j++) xq[32 * i + j] = (int8_t)lrintf(xb[j] * inv);
    }
}

static inline uint16_t mx_f32_bf16(float f) {  // round to nearest even, as torch's .to(torch.bfloat16)
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffffu)) return (uint16_t)((u >> 16) | 0x40);  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float mx_bf16_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#define MX_TILE_ROWS 16 /* batches from this many rows take AMX tiles, else the int8 vectors (VNNI or AVX2) */
int qgemm_mxfp4_tiles(const float *x, int64_t M, int64_t K, const uint8_t *q, const uint8_t *e, const float *bias,
                      const uint16_t *res, void *out, int out_bf16, int64_t ldo, int64_t N);

// out[m, n] (row stride ldo) = sum_k x[m, k] W[n, k] (+ bias[n]); x [M, K] contiguous, float32 or bf16 (x_bf16),
// K a multiple of 32; q uint8 [N, K / 2], e uint8 [N, K / 32]; interleaved: the checkpoints' nibble order (else
// GGUF's); int8_act: x rounded to int8 per block of 32 (mx_dot_rows_i8), else used as it is. out float32, or bf16
// (out_bf16: each sum plus its bias rounded once, as QuantLinear rounds a float32 result), plus the bf16 residual
// res [M, ldo] where given (bf16(res + out), as torch adds two bf16 tensors). Each output depends only on its own
// weight row, so any slice of the rows (q, e, bias and out offset) gives the whole call's values; inside a parallel
// region (moe_experts_bf16's) the loop runs on the calling thread.
void mxfp4_gemm(const void *x, int x_bf16, int64_t m, int64_t k, const uint8_t *q, const uint8_t *e, int64_t n,
                int interleaved, int int8_act, const float *bias, const uint16_t *res, void *out, int out_bf16,
                int64_t ldo) {
    mx_init_table();
    float *xf = NULL;
    if (x_bf16 || interleaved) {  // float32 rows, in GGUF's order within each block of 32
        xf = (float *)malloc(sizeof(float) * (size_t)(m * k));
        if (!xf) return;
        for (int64_t i = 0; i < m * k; i += 32)
            for (int j = 0; j < 32; j++) {
                const int64_t at = interleaved ? i + (j < 16 ? 2 * j : 2 * (j - 16) + 1) : i + j;
                xf[i + j] = x_bf16 ? mx_bf16_f32(((const uint16_t *)x)[at]) : ((const float *)x)[at];
            }
    }
    const float *xs = xf ? xf : (const float *)x;
    /* batches on AMX tiles or int8 vectors (quant_kernels.c's gemm_amx, gemm_vnni, gemm_i8v: they round x to int8
     * themselves) */
    if (int8_act && m >= MX_TILE_ROWS && qgemm_mxfp4_tiles(xs, m, k, q, e, bias, res, out, out_bf16, ldo, n)) {
        free(xf);
        return;
    }
    int8_t *xq = NULL;
    float *dx = NULL;
    if (int8_act) {
        xq = (int8_t *)malloc((size_t)(m * k));
        dx = (float *)malloc(sizeof(float) * (size_t)(m * k / 32));
        if (!xq || !dx) {
            free(xq), free(dx), free(xf);
            return;
        }
        mx_quantize_rows(xs, m, k, xq, dx);
    }
    const int64_t row_bytes = k / 2, row_scales = k / 32;
#ifdef MX_512
    mx512_t p512 = {0};
    const int use512 = int8_act && k >= 128 && mx512_prepare(xq, dx, m, k, &p512);
#endif
#pragma omp parallel for schedule(static) if (n * m * k > (1 << 16))
    for (int64_t col = 0; col < n; col++) {
        float acc[MX_ROWS];
        const float b = bias ? bias[col] : 0.0f;
        for (int64_t r0 = 0; r0 < m; r0 += MX_ROWS) {
            const int64_t nr = m - r0 < MX_ROWS ? m - r0 : MX_ROWS;
            const uint8_t *qc = q + col * row_bytes, *ec = e + col * row_scales;
#ifdef MX_512
            if (use512) {
                mx512_t rows = p512;
                rows.xa += r0 * p512.groups * 128, rows.corr += r0 * p512.groups * 16;
                rows.dxv += r0 * p512.groups * 16;
                MX_DISPATCH(mx_dot_rows_512, nr, &rows, xq + r0 * k, dx + r0 * (k / 32), k, qc, ec, acc)
            } else
#endif
            if (int8_act) {
                MX_DISPATCH(mx_dot_rows_i8, nr, xq + r0 * k, dx + r0 * (k / 32), k, qc, ec, acc)
            } else {
                MX_DISPATCH(mx_dot_rows, nr, xs + r0 * k, k, qc, ec, acc)
            }
            for (int64_t r = 0; r < nr; r++) {
                const int64_t at = (r0 + r) * ldo + col;
                const float v = acc[r] + b;
                if (!out_bf16) ((float *)out)[at] = v;
                else if (!res) ((uint16_t *)out)[at] = mx_f32_bf16(v);
                else ((uint16_t *)out)[at] = mx_f32_bf16(mx_bf16_f32(res[at]) + mx_bf16_f32(mx_f32_bf16(v)));
            }
        }
    }
#ifdef MX_512
    mx512_free(&p512);
#endif
    free(xq), free(dx), free(xf);
}
