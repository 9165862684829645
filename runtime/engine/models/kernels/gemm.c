/* Weight-only GEMMs for decode and verify steps: y[M, N] = x[M, K] . (W[N, K] (* scale[N]))^T (+ bias),
 * float32 activations and accumulation, AVX2 + FMA, OpenMP over output rows. Three weight formats:
 *
 *   dflash_int8_gemm: int8 weights with one float32 scale per output row. The activations are
 *     rounded per row to 15-bit integers (scale = the row's largest magnitude / 16383, computed from
 *     that row alone) and the dot products are exact int32 sums of int16 x int8 products
 *     (vpmaddwd): two to six times fewer instructions per weight than widening the weights to
 *     float32, which decides a verify step's cost on a CPU without AVX-512 (a decode step of a few
 *     rows is compute-bound there). Integer sums do not depend on their order, so every row's
 *     result is independent of the other rows, of M and of the thread count by construction.
 *     Where the CPU has AVX-512 VNNI the same sums run as vpdpwssd (identical results, see tile512).
 *   dflash_bf16_gemm: bfloat16 weights (widened to float32 exactly: a 16-bit shift), float32
 *     activations and FMA accumulation.
 *   dflash_f32_gemm: float32 weights, register-blocked (see f32_tile).
 *   dflash_bf16dp_gemm: bfloat16 weights x activations rounded per row to bfloat16, vdpbf16ps
 *     (AVX-512-BF16, chosen at run time by cpuid; see the end of this file).
 *
 * Written for the shapes of a decode or verify step (M = 1..65 rows, K = hidden or MLP width): each
 * weight row is read from memory once per call and kept in L1 while every input row uses it, so a
 * verify block of M rows costs little more than one row when the step is bound by weight reads.
 *
 * Exactness contract (dflash's greedy DFlash == plain greedy): the value computed for one input row
 * does not depend on M, on the other rows or on the thread count. In the bf16 kernel every (weight row, input row) pair
 * is reduced the same way: four 8-lane FMA chains over k (k mod 32), combined as (c0 + c1) + (c2 + c3),
 * summed across lanes in a fixed order, then the k % 32 tail in order, then biased.
 * Input rows are taken in pairs per weight row only to share each weight conversion; a pair's rows
 * run the very instruction sequence of a lone row.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"

/* Input rows per pass over the weights. Each weight row stays in L1 while the rows of a pass use it,
 * and a pass's rows (MBLOCK x K activations: 112 KB of int16 at K = 896, 608 KB at K = 4864) stay
 * in L2 across weight rows; without passes a long prompt streams all its rows from L3 or memory
 * again for every weight row. A decode or verify step (<= 64 rows) is one pass. Rows are computed
 * the same way in any pass (see the exactness contract above), so the results do not depend on it. */
#ifndef MBLOCK
#define MBLOCK 64
#endif

/* bytes ahead of the weight stream to prefetch (rows are contiguous: this runs into the next rows) */
#ifndef PREFETCH
#define PREFETCH 2048
#endif

static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v);
    __m128 hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    __m128 sh = _mm_movehdup_ps(lo);
    __m128 s = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, s);
    s = _mm_add_ss(s, sh);
    return _mm_cvtss_f32(s);
}

static inline __m256 load_bf16(const uint16_t *p) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
static inline float scalar_bf16(const uint16_t *p) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)*p << 16;
    return c.f;
}

#define FMA4(c, W, X)                                                   \
    c##0 = _mm256_fmadd_ps(W##0, _mm256_loadu_ps((X) + k), c##0);       \
    c##1 = _mm256_fmadd_ps(W##1, _mm256_loadu_ps((X) + k + 8), c##1);   \
    c##2 = _mm256_fmadd_ps(W##2, _mm256_loadu_ps((X) + k + 16), c##2);  \
    c##3 = _mm256_fmadd_ps(W##3, _mm256_loadu_ps((X) + k + 24), c##3);

/* One weight format: one weight row against one or two input rows, and the GEMM over them. */
#define DEFINE_GEMM(NAME, WT, LOAD, SCALAR)                                                                   \
    static inline float NAME##_finish(__m256 c0, __m256 c1, __m256 c2, __m256 c3, const WT *w, const float *x, \
                                      int64_t k0, int64_t K) {                                                 \
        float r = hsum8(_mm256_add_ps(_mm256_add_ps(c0, c1), _mm256_add_ps(c2, c3)));                          \
        for (int64_t k = k0; k < K; k++) r += SCALAR(w + k) * x[k];                                            \
        return r;                                                                                              \
    }                                                                                                          \
    static inline float NAME##_1x1(const WT *w, const float *x, int64_t K) {                                   \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                                            \
        int64_t k = 0;                                                                                         \
        for (; k + 32 <= K; k += 32) {                                                                         \
            _mm_prefetch((const char *)(w + k) + PREFETCH, _MM_HINT_T0);                                       \
            __m256 w0 = LOAD(w + k), w1 = LOAD(w + k + 8), w2 = LOAD(w + k + 16), w3 = LOAD(w + k + 24);       \
            FMA4(a, w, x)                                                                                      \
        }                                                                                                      \
        return NAME##_finish(a0, a1, a2, a3, w, x, k, K);                                                      \
    }                                                                                                          \
    /* one weight row against two input rows */                                                               \
    static inline void NAME##_1x2(const WT *w, const float *xa, const float *xb, int64_t K, float *ra,         \
                                  float *rb) {                                                                 \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;       \
        int64_t k = 0;                                                                                         \
        for (; k + 32 <= K; k += 32) {                                                                         \
            _mm_prefetch((const char *)(w + k) + PREFETCH, _MM_HINT_T0);                                       \
            __m256 w0 = LOAD(w + k), w1 = LOAD(w + k + 8), w2 = LOAD(w + k + 16), w3 = LOAD(w + k + 24);       \
            FMA4(a, w, xa)                                                                                     \
            FMA4(b, w, xb)                                                                                     \
        }                                                                                                      \
        *ra = NAME##_finish(a0, a1, a2, a3, w, xa, k, K);                                                      \
        *rb = NAME##_finish(b0, b1, b2, b3, w, xb, k, K);                                                      \
    }                                                                                                          \
    /* every input row against weight row n */                                                                \
    static inline void NAME##_col(const WT *wr, const float *x, int64_t M, int64_t K, int64_t N, int64_t n,    \
                                  float *acc) {                                                                \
        int64_t m = 0;                                                                                         \
        for (; m + 2 <= M; m += 2) NAME##_1x2(wr, x + m * K, x + (m + 1) * K, K, acc + m * N + n,              \
                                              acc + (m + 1) * N + n);                                          \
        if (m < M) acc[m * N + n] = NAME##_1x1(wr, x + m * K, K);                                              \
    }                                                                                                          \
    static void NAME##_raw(const float *x, int64_t M, int64_t K, const WT *w, int64_t N, float *y,             \
                           int threads) {                                                                      \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                                     \
        for (int64_t n = 0; n < N; n++) NAME##_col(w + n * K, x, M, K, N, n, y);                               \
    }

DEFINE_GEMM(bf, uint16_t, load_bf16, scalar_bf16)

/* float32 weights: at float32's bytes a verify step of a few rows is bound by arithmetic sooner than
 * with bf16 or int8 weights, so the loop is register-blocked: a tile of up to 2 input rows x 4 weight
 * rows loads each weight vector once for both rows and each input vector once for four weight rows
 * (6 loads per 8 FMAs instead of 12). Every (input row, weight row) pair is one 8-lane FMA chain over
 * k (k mod 8 per lane, in order), summed across lanes in a fixed order, then the k % 8 tail in order:
 * the same instructions for the pair whatever tile it sits in, so a row's result does not depend on
 * M, on the other rows or on the thread count (the exactness contract above). */
static inline __attribute__((always_inline)) void f32_tile(const float *w, const float *x, int64_t K, int MR, int NR,
                                                           float *y, int64_t N) {
    __m256 acc[2][4];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 wv[4];
        for (int j = 0; j < NR; j++) wv[j] = _mm256_loadu_ps(w + j * K + k);
        for (int i = 0; i < MR; i++) {
            const __m256 xv = _mm256_loadu_ps(x + i * K + k);
            for (int j = 0; j < NR; j++) acc[i][j] = _mm256_fmadd_ps(wv[j], xv, acc[i][j]);
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) {
            float r = hsum8(acc[i][j]);
            for (int64_t t = k; t < K; t++) r += w[j * K + t] * x[i * K + t];
            y[i * N + j] = r;
        }
}

#define TILE(mr, nr) f32_tile(w, x + m * K, K, mr, nr, y + m * N + n, N)
/* weight rows [n, n + nr) (nr <= 4) against every input row, in pairs */
static void f32_rows(const float *w, const float *x, int64_t M, int64_t K, int64_t N, int64_t n, int nr, float *y) {
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) {
        switch (nr) {
        case 4: TILE(2, 4); break;
        case 3: TILE(2, 3); break;
        case 2: TILE(2, 2); break;
        default: TILE(2, 1); break;
        }
    }
    if (m < M) {
        switch (nr) {
        case 4: TILE(1, 4); break;
        case 3: TILE(1, 3); break;
        case 2: TILE(1, 2); break;
        default: TILE(1, 1); break;
        }
    }
}
#undef TILE

static void f32_raw(const float *x, int64_t M, int64_t K, const float *w, int64_t N, float *y, int threads) {
    const int64_t blocks = (N + 3) / 4;
    _Pragma("omp parallel for num_threads(threads) schedule(static)")
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n = b * 4;
        f32_rows(w + n * K, x, M, K, N, n, N - n < 4 ? (int)(N - n) : 4, y);
    }
}

static void epilogue(float *y, int64_t M, int64_t N, const float *scale, const float *bias) {
    if (!bias) return;
    for (int64_t m = 0; m < M; m++) {
        float *r = y + m * N;
        if (scale && bias)
            for (int64_t n = 0; n < N; n++) r[n] = r[n] * scale[n] + bias[n];
        else if (scale)
            for (int64_t n = 0; n < N; n++) r[n] = r[n] * scale[n];
        else
            for (int64_t n = 0; n < N; n++) r[n] = r[n] + bias[n];
    }
}

/* ---- int8 weights x int16 activations ------------------------------------------------------ */

/* One weight row per tile: it streams from memory about twice as fast as two or four rows in a
 * decode step (measured on an AVX2 EPYC), and two were no faster in a verify step. */
#define XMAX 16383.0f /* |activation| after rounding: keeps 2 * 127 * 16383 * K/16 within int32 per chunk */
#define CHUNK 4096    /* k per int32 partial sum (K/16 * 4.16M < 2^31 for K <= 8192; chunks add in int64) */

/* The largest |r[k]| of n floats (a maximum is exact in any order, so vector lanes change nothing). */
float dflash_absmax(const float *r, int64_t n) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(r + k)));
    float l[8], a = 0.0f;
    _mm256_storeu_ps(l, m);
    for (int i = 0; i < 8; i++) a = fmaxf(a, l[i]);
    for (; k < n; k++) a = fmaxf(a, fabsf(r[k]));
    return a;
}

/* q[k] = r[k] * inv rounded to an integer (the current rounding mode, nearest-even by default: what
 * lrintf gives, sixteen at a time), as int16 (|r[k] * inv| <= 32767); returns the sum of the q[k]
 * (exact). Shared by the int8 and q4 kernels' activation rounding. It replaced a call of libm's lrintf
 * per element, single-threaded before each GEMM: an 8-row int8 verify of 896 x 896 took 0.054 ms with
 * it, 0.035 ms without (2-core AVX-512 EPYC with AVX-VNNI). Results are identical bit for bit. */
int64_t dflash_round_i16(const float *r, int64_t n, float inv, int16_t *q) {
    const __m256 vi = _mm256_set1_ps(inv);
    __m256i acc = _mm256_setzero_si256();
    int64_t k = 0, sum = 0;
    for (; k + 16 <= n; k += 16) {
        const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(r + k), vi));
        const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(r + k + 8), vi));
        acc = _mm256_add_epi32(acc, _mm256_add_epi32(a, b));
        _mm256_storeu_si256((__m256i *)(q + k), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
    }
    int32_t l[8];
    _mm256_storeu_si256((__m256i *)l, acc);
    for (int i = 0; i < 8; i++) sum += l[i];
    for (; k < n; k++) {
        q[k] = (int16_t)lrintf(r[k] * inv);
        sum += q[k];
    }
    return sum;
}

/* Round x [M, K] per row to int16 (a multiple of 16 columns, zero-padded) and give each row's scale. */
static void quantize_rows(const float *x, int64_t M, int64_t K, int64_t Kp, int16_t *xq, float *xs) {
    for (int64_t m = 0; m < M; m++) {
        const float *r = x + m * K;
        const float amax = dflash_absmax(r, K);
        const float s = amax > 0.0f ? amax / XMAX : 1.0f;
        int16_t *q = xq + m * Kp;
        dflash_round_i16(r, K, 1.0f / s, q);
        for (int64_t k = K; k < Kp; k++) q[k] = 0;
        xs[m] = s;
    }
}

static inline int64_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi64(_mm_cvtepi32_epi64(_mm256_castsi256_si128(v)),
                              _mm_cvtepi32_epi64(_mm_unpackhi_epi64(_mm256_castsi256_si128(v), _mm256_castsi256_si128(v))));
    __m128i hi = _mm256_extracti128_si256(v, 1);
    s = _mm_add_epi64(s, _mm_add_epi64(_mm_cvtepi32_epi64(hi), _mm_cvtepi32_epi64(_mm_unpackhi_epi64(hi, hi))));
    return _mm_cvtsi128_si64(s) + _mm_extract_epi64(s, 1);
}

/* NW weight rows (w, K bytes apart) against MX int16 rows (xq, Kp apart): exact integer dot products. */
static inline __attribute__((always_inline)) void tile(const int8_t *w, int64_t K, const int16_t *xq, int64_t Kp, int NW, int MX, int64_t *out) {
    int64_t tot[8] = {0, 0, 0, 0, 0, 0, 0, 0};  /* NW * MX <= 8 */
    const int64_t K16 = K & ~(int64_t)15;
    for (int64_t k0 = 0; k0 < K16; k0 += CHUNK) {
        const int64_t k1 = k0 + CHUNK < K16 ? k0 + CHUNK : K16;
        __m256i acc[8];
        for (int i = 0; i < NW * MX; i++) acc[i] = _mm256_setzero_si256();
        int64_t k = k0;
        for (; k + 64 <= k1; k += 64) { /* a cache line of weights per row per step, one prefetch */
            for (int a = 0; a < NW; a++) _mm_prefetch((const char *)(w + a * K + k) + PREFETCH, _MM_HINT_T0);
            for (int u = 0; u < 64; u += 16)
                for (int a = 0; a < NW; a++) {
                    const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + a * K + k + u)));
                    for (int b = 0; b < MX; b++) {
                        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * Kp + k + u));
                        acc[a * MX + b] = _mm256_add_epi32(acc[a * MX + b], _mm256_madd_epi16(wv, xv));
                    }
                }
        }
        for (; k < k1; k += 16)
            for (int a = 0; a < NW; a++) {
                const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + a * K + k)));
                for (int b = 0; b < MX; b++) {
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * Kp + k));
                    acc[a * MX + b] = _mm256_add_epi32(acc[a * MX + b], _mm256_madd_epi16(wv, xv));
                }
            }
        for (int i = 0; i < NW * MX; i++) tot[i] += hsum_i32(acc[i]);
    }
    for (int a = 0; a < NW; a++)
        for (int b = 0; b < MX; b++) {
            int64_t t = tot[a * MX + b];
            for (int64_t k = K16; k < K; k++) t += (int64_t)w[a * K + k] * xq[b * Kp + k];
            out[a * MX + b] = t;
        }
}

/* Scale a tile's exact sums (NW weight rows x MX input rows, dots[a * MX + b]) into y (row stride N):
 * y[b][a] = dots * (xs[b] * scale[a]) (+ bias[a]); the one epilogue of both int8 paths. */
static inline void store_dots(const int64_t *dots, int NW, int MX, const float *xs, const float *scale, const float *bias,
                              int64_t N, float *y) {
    for (int a = 0; a < NW; a++)
        for (int b = 0; b < MX; b++) {
            float v = (float)dots[a * MX + b] * (xs[b] * scale[a]);
            y[b * N + a] = bias ? v + bias[a] : v;
        }
}

/* weight rows [n, n + NW) against every input row */
static inline __attribute__((always_inline)) void int8_rows(const int8_t *w, int64_t K, const int16_t *xq, int64_t Kp, const float *xs, int64_t M,
                             int64_t N, int64_t n, int NW, const float *scale, const float *bias, float *y) {
    int64_t dots[8];
    for (int64_t m = 0; m < M;) {
        const int64_t left = M - m;
        const int MX = left >= 8 ? 8 : (int)left;
        switch (NW * 16 + MX) { /* literal shapes, so each tile is compiled unrolled */
#define T(nw, mx) case nw * 16 + mx: tile(w + n * K, K, xq + m * Kp, Kp, nw, mx, dots); break;
            T(1, 1) T(1, 2) T(1, 3) T(1, 4) T(1, 5) T(1, 6) T(1, 7) T(1, 8)
#undef T
        }
        store_dots(dots, NW, MX, xs + m, scale + n, bias ? bias + n : NULL, N, y + m * N + n);
        m += MX;
    }
}

/* ---- the same int8 tile with AVX-512 VNNI (vpdpwssd: 32 int16 x int16 products summed in pairs into
 * 16 int32 lanes, one instruction) where the CPU has it. The dot products are the same exact integer
 * sums, so both paths give identical results; this one retires about a quarter of the instructions
 * per weight, which is what a verify block of several rows is bound by. */
#define V512 __attribute__((target("avx512f,avx512bw,avx512vnni")))

V512 static inline __attribute__((always_inline)) void tile512(const int8_t *w, int64_t K, const int16_t *xq, int64_t Kp, int NW, int MX, int64_t *out) {
    /* NW weight rows (K bytes apart) x MX int16 rows: out[a * MX + b]; NW * MX <= 16 */
    int64_t tot[16] = {0};
    const int64_t K32 = K & ~(int64_t)31;
    for (int64_t k0 = 0; k0 < K32; k0 += CHUNK) {
        const int64_t k1 = k0 + CHUNK < K32 ? k0 + CHUNK : K32;
        __m512i acc[16];
        for (int i = 0; i < NW * MX; i++) acc[i] = _mm512_setzero_si512();
        int64_t k = k0;
        for (; k + 64 <= k1; k += 64) {
            __m512i w0[4], w1[4];
            for (int a = 0; a < NW; a++) {
                if (NW == 1)
                    _mm_prefetch((const char *)(w + k) + PREFETCH, _MM_HINT_T0);
                else /* the same k of the next tile's rows */
                    _mm_prefetch((const char *)(w + (a + NW) * K + k), _MM_HINT_T0);
                w0[a] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + a * K + k)));
                w1[a] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + a * K + k + 32)));
            }
            for (int b = 0; b < MX; b++) {
                const __m512i x0 = _mm512_loadu_si512((const void *)(xq + b * Kp + k));
                const __m512i x1 = _mm512_loadu_si512((const void *)(xq + b * Kp + k + 32));
                for (int a = 0; a < NW; a++) {
                    acc[a * MX + b] = _mm512_dpwssd_epi32(acc[a * MX + b], w0[a], x0);
                    acc[a * MX + b] = _mm512_dpwssd_epi32(acc[a * MX + b], w1[a], x1);
                }
            }
        }
        for (; k < k1; k += 32) {
            for (int a = 0; a < NW; a++) {
                const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + a * K + k)));
                for (int b = 0; b < MX; b++)
                    acc[a * MX + b] = _mm512_dpwssd_epi32(acc[a * MX + b], w0, _mm512_loadu_si512((const void *)(xq + b * Kp + k)));
            }
        }
        for (int i = 0; i < NW * MX; i++) {
            const __m512i lo = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(acc[i]));
            const __m512i hi = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(acc[i], 1));
            tot[i] += _mm512_reduce_add_epi64(_mm512_add_epi64(lo, hi));
        }
    }
    for (int a = 0; a < NW; a++)
        for (int b = 0; b < MX; b++) {
            int64_t t = tot[a * MX + b];
            for (int64_t k = K32; k < K; k++) t += (int64_t)w[a * K + k] * xq[b * Kp + k];
            out[a * MX + b] = t;
        }
}

/* weight rows [n, n + NW) against every input row of the pass */
V512 static void int8_rows512(const int8_t *w, int64_t K, const int16_t *xq, int64_t Kp, const float *xs, int64_t M,
                              int64_t N, int64_t n, int NW, const float *scale, const float *bias, float *y) {
    int64_t dots[16];
    const int mmax = NW == 4 ? 4 : 8;
    for (int64_t m = 0; m < M;) {
        const int64_t left = M - m;
        const int MX = left >= mmax ? mmax : (int)left;
        switch (NW * 16 + MX) { /* literal shapes, so each tile is compiled unrolled */
#define T(nw, mx) case nw * 16 + mx: tile512(w + n * K, K, xq + m * Kp, Kp, nw, mx, dots); break;
            T(1, 1) T(1, 2) T(1, 3) T(1, 4) T(1, 5) T(1, 6) T(1, 7) T(1, 8)
            T(2, 1) T(2, 2) T(2, 3) T(2, 4) T(2, 5) T(2, 6) T(2, 7) T(2, 8)
            T(4, 1) T(4, 2) T(4, 3) T(4, 4)
#undef T
        }
        store_dots(dots, NW, MX, xs + m, scale + n, bias ? bias + n : NULL, N, y + m * N + n);
        m += MX;
    }
}

/* Passes of at least INT8_QUAD_M input rows (a prompt's prefill) take several weight rows per tile on
 * the AVX-512 path, so each activation vector loaded serves them all: four weight rows x four input
 * rows where N >= INT8_QUAD_N, else two x eight (measured on a 2-core AVX-512 EPYC, 512 rows: the
 * MLP's 9728 x 896 and 896 x 4864 ran 1.6-1.7x faster with four, the attention's 1152 x 896 and
 * 896 x 896 slower with four and faster with two). */
#ifndef INT8_QUAD_M
#define INT8_QUAD_M 32
#endif
#ifndef INT8_QUAD_N
#define INT8_QUAD_N 2048
#endif

/* A verify's rows (at least INT8_PAIR_M) against long weight rows (K >= INT8_PAIR_K: the MLP's down
 * projection) take two weight rows per tile on the AVX-512 path: eight int16 rows of 4,864 are 78 KB,
 * more than L1, so one weight row per tile read them from L2 once per weight row (measured on a 2-core
 * AVX-512 EPYC with AVX-VNNI, 896 x 4864, 8 rows: 0.245 -> 0.177 ms; 2 rows 0.077 -> 0.053 ms). A
 * one-row step keeps one weight row per tile (one stream). */
#ifndef INT8_PAIR_K
#define INT8_PAIR_K 2048
#endif
#ifndef INT8_PAIR_M
#define INT8_PAIR_M 2
#endif

/* Which int8 path runs: -1 = not chosen yet, 0 = AVX2, 1 = AVX-512 VNNI, 2 = AMX tiles (amx.c) for
 * calls of many rows (see INT8_AMX_M), AVX-512 VNNI for fewer. */
static int int8_isa = -1;

/* Rows from which the AMX path takes a call: INT8_AMX_M, or INT8_AMX_WIDE_M where N >= INT8_AMX_WIDE_N
 * (an output head). Measured on a 2-core Xeon with AMX, 2 threads, the embedded target's weights
 * streamed from memory (24 layers; head 151,936 x 896), ms VNNI / AMX: layers at 4 rows 19.4 / 23.3,
 * 8 rows 23.1 / 24.8, 12 rows 30.9 / 26.0, 16 rows 37.3 / 26.3; the head at 4 rows 7.6 / 7.1, 8 rows
 * 8.9 / 7.5; one row level (18.2 / 18.4). 512 rows (prefill), 9728 x 896: 23.3 / 7.4. Results are
 * identical either way. */
#ifndef INT8_AMX_M
#define INT8_AMX_M 10
#endif
#ifndef INT8_AMX_WIDE_M
#define INT8_AMX_WIDE_M 4
#endif
#ifndef INT8_AMX_WIDE_N
#define INT8_AMX_WIDE_N 32768
#endif

/* Choose the int8 path: 0 = AVX2, 1 = AVX-512 VNNI, 2 = AMX where the CPU has them (each falls back to
 * the one before), -1 = the best this CPU has. Returns the path now in use. All compute the same
 * integer sums: identical results. */
int dflash_int8_isa(int want) {
    __builtin_cpu_init();
    const int has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512vnni");
    const int best = has512 ? (dflash_int8amx_supported() ? 2 : 1) : 0;
    int8_isa = want < 0 || want > best ? best : want;
    return int8_isa;
}

/* x [M, K] float32 row-major, w [N, K] int8 row-major, scale [N], bias [N] or NULL, y [M, N].
 * Returns 0, or -1 when the activation buffer cannot be allocated. */
int dflash_int8_gemm(const float *x, int64_t M, int64_t K, const int8_t *w, const float *scale,
                     const float *bias, int64_t N, float *y, int threads) {
    const int64_t Kp = (K + 15) & ~(int64_t)15;
    int16_t *xq = (int16_t *)aligned_alloc(64, (size_t)((M * Kp * 2 + 63) & ~(int64_t)63));
    float *xs = (float *)malloc((size_t)M * sizeof(float));
    if (!xq || !xs) {
        free(xq);
        free(xs);
        return -1;
    }
    quantize_rows(x, M, K, Kp, xq, xs);
    if (int8_isa < 0) dflash_int8_isa(-1);
    if (int8_isa == 2 && (M >= INT8_AMX_M || (N >= INT8_AMX_WIDE_N && M >= INT8_AMX_WIDE_M))) {
        const int rc = dflash_int8amx_gemm(xq, M, Kp, w, K, xs, scale, bias, N, y, threads);
        if (rc <= 0) {
            free(xq);
            free(xs);
            return rc;
        }
    }
    /* one (or two, four: see INT8_PAIR_K, INT8_QUAD_M) weight rows against up to eight input rows at a
     * time, over blocks of at most MBLOCK rows */
    for (int64_t m0 = 0; m0 < M; m0 += MBLOCK) {
        const int64_t mb = M - m0 < MBLOCK ? M - m0 : MBLOCK;
        const int16_t *xb = xq + m0 * Kp;
        float *yb = y + m0 * N;
        if (int8_isa >= 1) {
            const int nw = mb >= INT8_QUAD_M ? (N >= INT8_QUAD_N ? 4 : 2) : (K >= INT8_PAIR_K && mb >= INT8_PAIR_M) ? 2 : 1;
            const int64_t tiles = (N + nw - 1) / nw;
#pragma omp parallel for num_threads(threads) schedule(static)
            for (int64_t t = 0; t < tiles; t++) {
                const int64_t n = nw * t;
                if (N - n >= nw)
                    int8_rows512(w, K, xb, Kp, xs + m0, mb, N, n, nw, scale, bias, yb);
                else /* the last rows one at a time */
                    for (int64_t r = n; r < N; r++) int8_rows512(w, K, xb, Kp, xs + m0, mb, N, r, 1, scale, bias, yb);
            }
        } else {
#pragma omp parallel for num_threads(threads) schedule(static)
            for (int64_t n = 0; n < N; n++) int8_rows(w, K, xb, Kp, xs + m0, mb, N, n, 1, scale, bias, yb);
        }
    }
    free(xq);
    free(xs);
    return 0;
}

/* x [M, K] float32 row-major, w [N, K] bfloat16 bits row-major, bias [N] float32 or NULL, y [M, N] */
void dflash_bf16_gemm(const float *x, int64_t M, int64_t K, const uint16_t *w, const float *bias, int64_t N,
                      float *y, int threads) {
    for (int64_t m0 = 0; m0 < M; m0 += MBLOCK) {
        const int64_t mb = M - m0 < MBLOCK ? M - m0 : MBLOCK;
        bf_raw(x + m0 * K, mb, K, w, N, y + m0 * N, threads);
    }
    epilogue(y, M, N, NULL, bias);
}

/* x [M, K] float32 row-major, w [N, K] float32 row-major, bias [N] float32 or NULL, y [M, N] */
void dflash_f32_gemm(const float *x, int64_t M, int64_t K, const float *w, const float *bias, int64_t N, float *y,
                     int threads) {
    for (int64_t m0 = 0; m0 < M; m0 += MBLOCK) {
        const int64_t mb = M - m0 < MBLOCK ? M - m0 : MBLOCK;
        f32_raw(x + m0 * K, mb, K, w, N, y + m0 * N, threads);
    }
    epilogue(y, M, N, NULL, bias);
}

/* ---- bf16 weights x bf16-rounded activations with AVX-512-BF16 (vdpbf16ps) ----------------------
 *
 * dflash_bf16dp_gemm: the activations are rounded per row to bfloat16 (round to nearest even, from
 * that row alone), and each (weight row, input row) pair is summed by vdpbf16ps: 32 bf16 x bf16
 * products per instruction, added in pairs into 16 float32 lanes. Half the arithmetic instructions
 * of the float32-activation path per weight and no widening of the weights, which is what a verify
 * block of several rows is bound by. Its results differ from dflash_bf16_gemm's (the activations are
 * rounded), so one process runs one of the two for a model's one-token steps and verifies alike
 * (runtime/engine/linear.py chooses by measurement).
 *
 * Exactness contract, as above: every (weight row, input row) pair is reduced the same way whatever
 * the row count, the other rows and the thread count (see dp_tile), then biased. Input rows are taken
 * up to eight at a time against one, two or four weight rows only to share loads. Measured on a 2-core
 * AVX-512-BF16 EPYC, weights streamed from memory, one thread: two weight rows per tile made an
 * 8-row verify at K = 4864 1.7x faster but every call at K = 896 1.5-2x slower (two streams 1.8 KB
 * apart), so rows of at least DP_PAIR_K go in pairs.
 *
 * Compiled with a target attribute (the library itself is built for AVX2) and called only where
 * cpuid reports AVX-512 F/BW/BF16; on other CPUs, or with a compiler that has no AVX-512-BF16
 * intrinsics (GCC < 10, clang < 9), dflash_bf16dp_supported() is 0 and dflash_bf16dp_gemm runs
 * dflash_bf16_gemm instead (never an illegal instruction). */
#ifndef DP_PAIR_K
#define DP_PAIR_K 2048
#endif
/* Passes of at least DP_QUAD_M input rows (a prompt's prefill) take several weight rows per tile, so
 * each activation vector loaded serves them all: four weight rows x four input rows where N >=
 * DP_QUAD_N (8 loads per 16 vdpbf16ps instead of 9 per 8), else two x eight (measured on a 2-core
 * AVX-512-BF16 EPYC, 512 rows: 9728 x 896 ran 1.6x faster with four, 1152 x 896 and 896 x 896 slower
 * with four than with one and ~1.4x faster with two). */
#ifndef DP_QUAD_M
#define DP_QUAD_M 32
#endif
#ifndef DP_QUAD_N
#define DP_QUAD_N 2048
#endif
#ifndef DP_SMALL_NW
#define DP_SMALL_NW 2
#endif
#ifndef HAVE_BF16DP /* -DHAVE_BF16DP=0 builds the fallback only (as an older compiler does) */
#if (defined(__clang__) && __clang_major__ >= 9) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10)
#define HAVE_BF16DP 1
#else
#define HAVE_BF16DP 0
#endif
#endif

static int bf16dp_cpu = -1; /* -1 = not asked yet */

/* 1 where this CPU (cpuid) and this build can run the AVX-512-BF16 path, else 0. */
int dflash_bf16dp_supported(void) {
    if (bf16dp_cpu < 0) {
        __builtin_cpu_init();
#if HAVE_BF16DP
        bf16dp_cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                     __builtin_cpu_supports("avx512bf16");
#else
        bf16dp_cpu = 0;
#endif
    }
    return bf16dp_cpu;
}

#if HAVE_BF16DP
#define VBF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))

/* Round x [M, K] float32 to bf16 rows of Kp (a multiple of 32) elements, zero-padded. */
VBF16 static void bf16_rows(const float *x, int64_t M, int64_t K, int64_t Kp, uint16_t *xb) {
    for (int64_t m = 0; m < M; m++) {
        const float *r = x + m * K;
        uint16_t *q = xb + m * Kp;
        for (int64_t k = 0; k < Kp; k += 16) {
            const int64_t left = K - k;
            const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
            const __m256bh v = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, r + k));
            _mm256_storeu_si256((__m256i *)(q + k), (__m256i)v);
        }
    }
}

/* NW weight rows (w, K elements apart; NW <= 4, NW * MX <= 16) against MX bf16 rows (xb, Kp apart; MX <= 8):
 * out[a * MX + b] = the dot product of weight row a and input row b. Each pair has one 16-lane
 * accumulator over k in 32-element chunks, in order (the last chunk zero-padded), reduced across lanes
 * in a fixed order: the same instructions for a pair whatever NW, MX or tile it sits in. */
VBF16 static inline __attribute__((always_inline)) void dp_tile(const uint16_t *w, int64_t K, const uint16_t *xb,
                                                                 int64_t Kp, int NW, int MX, float *out) {
    __m512 acc[4][8];
    for (int a = 0; a < NW; a++)
        for (int b = 0; b < MX; b++) acc[a][b] = _mm512_setzero_ps();
    const int64_t K32 = K & ~(int64_t)31;
    int64_t k = 0;
    for (; k < K32; k += 32) {
        __m512bh wv[4];
        for (int a = 0; a < NW; a++) {
            if (NW == 1) /* one stream: PREFETCH bytes ahead in its row */
                _mm_prefetch((const char *)(w + k) + PREFETCH, _MM_HINT_T0);
            else /* several rows: the same k of the next tile's rows */
                _mm_prefetch((const char *)(w + (a + NW) * K + k), _MM_HINT_T0);
            wv[a] = (__m512bh)_mm512_loadu_si512((const void *)(w + a * K + k));
        }
        for (int b = 0; b < MX; b++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xb + b * Kp + k));
            for (int a = 0; a < NW; a++) acc[a][b] = _mm512_dpbf16_ps(acc[a][b], wv[a], xv);
        }
    }
    if (k < K) { /* the last chunk: weights masked, activations zero-padded to Kp */
        const __mmask32 mask = (__mmask32)((1u << (K - k)) - 1);
        __m512bh wv[4];
        for (int a = 0; a < NW; a++) wv[a] = (__m512bh)_mm512_maskz_loadu_epi16(mask, (const void *)(w + a * K + k));
        for (int b = 0; b < MX; b++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xb + b * Kp + k));
            for (int a = 0; a < NW; a++) acc[a][b] = _mm512_dpbf16_ps(acc[a][b], wv[a], xv);
        }
    }
    for (int a = 0; a < NW; a++)
        for (int b = 0; b < MX; b++) out[a * MX + b] = _mm512_reduce_add_ps(acc[a][b]);
}
/* weight rows [n, n + NW) against every input row of the pass */
VBF16 static void dp_rows(const uint16_t *w, int64_t K, const uint16_t *xb, int64_t Kp, int64_t M, int64_t N,
                          int64_t n, int NW, const float *bias, float *y) {
    float dots[16];
    const int mmax = NW == 4 ? 4 : 8; /* NW * MX accumulators <= 16 */
    for (int64_t m = 0; m < M;) {
        const int64_t left = M - m;
        const int MX = left >= mmax ? mmax : (int)left;
        switch (NW * 16 + MX) { /* literal shapes, so each tile is compiled unrolled */
#define T(nw, mx) case nw * 16 + mx: dp_tile(w + n * K, K, xb + m * Kp, Kp, nw, mx, dots); break;
            T(1, 1) T(1, 2) T(1, 3) T(1, 4) T(1, 5) T(1, 6) T(1, 7) T(1, 8)
            T(2, 1) T(2, 2) T(2, 3) T(2, 4) T(2, 5) T(2, 6) T(2, 7) T(2, 8)
            T(4, 1) T(4, 2) T(4, 3) T(4, 4)
#undef T
        }
        for (int a = 0; a < NW; a++)
            for (int b = 0; b < MX; b++)
                y[(m + b) * N + n + a] = bias ? dots[a * MX + b] + bias[n + a] : dots[a * MX + b];
        m += MX;
    }
}
#endif

/* x [M, K] float32 row-major (rounded to bf16 here), w [N, K] bfloat16 bits row-major, bias [N] float32
 * or NULL, y [M, N]. Returns 0, or -1 when the activation buffer cannot be allocated. */
int dflash_bf16dp_gemm(const float *x, int64_t M, int64_t K, const uint16_t *w, const float *bias, int64_t N,
                       float *y, int threads) {
#if HAVE_BF16DP
    if (dflash_bf16dp_supported()) {
        const int64_t Kp = (K + 31) & ~(int64_t)31;
        uint16_t *xb = (uint16_t *)aligned_alloc(64, (size_t)((M * Kp * 2 + 63) & ~(int64_t)63));
        if (!xb) return -1;
        bf16_rows(x, M, K, Kp, xb);
        for (int64_t m0 = 0; m0 < M; m0 += MBLOCK) {
            const int64_t mb = M - m0 < MBLOCK ? M - m0 : MBLOCK;
            const uint16_t *xp = xb + m0 * Kp;
            float *yp = y + m0 * N;
            /* long rows: two weight rows per tile share each activation load (a verify's rows are
             * read from L1/L2 once per two weight rows); short rows: one, which streams the
             * weights from memory faster (measured, see above) */
            const int nw = mb >= DP_QUAD_M ? (N >= DP_QUAD_N ? 4 : DP_SMALL_NW) : K >= DP_PAIR_K ? 2 : 1;
            const int64_t tiles = (N + nw - 1) / nw;
#pragma omp parallel for num_threads(threads) schedule(static)
            for (int64_t t = 0; t < tiles; t++) {
                const int64_t n = nw * t;
                const int64_t left = N - n;
                if (left >= nw)
                    dp_rows(w, K, xp, Kp, mb, N, n, nw, bias, yp);
                else /* the last rows one at a time */
                    for (int64_t r = n; r < N; r++) dp_rows(w, K, xp, Kp, mb, N, r, 1, bias, yp);
            }
        }
        free(xb);
        return 0;
    }
#endif
    dflash_bf16_gemm(x, M, K, w, bias, N, y, threads);
    return 0;
}
