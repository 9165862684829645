/* 4-bit weights (dflash's q4 format, runtime/engine/models/q4.py) for decode and verify steps:
 * y[M, N] = x[M, K] . W[N, K]^T (+ bias), float32 activations and output, OpenMP over weight rows.
 *
 * Format: K is a multiple of 32; each weight row is G = K / 32 groups of 32 weights, weight k of
 * group g being s[g] * q + m[g] with q in 0..15 and a float16 scale s and minimum m per group.
 *   w  [N, K / 2] uint8: group g of a row is 16 bytes; byte i holds q[32 g + i] in its low nibble
 *      and q[32 g + 16 + i] in its high nibble (so a 32-byte load splits into two groups' halves);
 *   sm [N, 2 Gp] float16 (Gp = 8 * ceil(G / 8)): a row's G scales, zeros up to Gp, its G minimums,
 *      zeros up to Gp (eight groups' scales convert in one instruction; no tails).
 *
 * Math: the activations are rounded per row to 15-bit integers (xq = round(x / xs), xs = the row's
 * largest magnitude / 16383, from that row alone, as in the int8 kernel), so a group's dot product
 * with the 4-bit values is an exact integer sum (vpmaddwd), and
 *   y = xs * (sum_g s[g] * (sum_k q[k] xq[k]) + sum_g m[g] * (sum_k xq[k]))
 * where the second sum uses each row's per-group activation sums (exact integers, computed once per
 * row). Per group the integer sum is kept as 8 int32 lanes (lane j: the products at k = 2j, 2j + 1,
 * 2j + 16, 2j + 17), converted to float32 and fused into one of two 8-lane float32 accumulators
 * (even groups, odd groups) times the group's scale; the minimums go into a third accumulator eight
 * groups at a time; the three are added lane-wise, summed across lanes in a fixed order, scaled by
 * xs, then biased.
 *
 * Exactness contract (dflash's greedy DFlash == plain greedy): that sequence of float operations is
 * the same for a row whatever M, the other rows and the thread count, so a verify block computes
 * every row bit for bit as a one-token step does. The AVX-512 path below holds the even and odd
 * accumulators as the two halves of one 16-lane register and performs the very same float
 * operations lane for lane (the integer lanes are the same exact sums), so both paths give
 * identical results too.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#ifndef Q4_MBLOCK
#define Q4_MBLOCK 64 /* input rows per pass over the weights (see MBLOCK in gemm.c) */
#endif
#ifndef Q4_PREFETCH
#define Q4_PREFETCH 1024 /* bytes ahead in a weight row */
#endif
#define Q4_XMAX 16383.0f /* 2 * 15 * 16383 * 2 per int32 lane and group: far from overflow */
#define AI __attribute__((always_inline))


/* Activations of one call: xq [M, Kp] int16 with each pair of groups laid out as the weights unpack,
 * [g k0-15][g+1 k0-15][g k16-31][g+1 k16-31] (Kp = 64 * ceil(G / 2), a lone last group zero-padded);
 * isum [M, Gp] each group's sum of xq as float32 (exact: |sum| < 2^24), zero-padded to Gp = 8 * ceil(G / 8);
 * xs [M] each row's scale. */
static void q4_quantize_rows(const float *x, int64_t M, int64_t K, int64_t Kp, int64_t Gp, int16_t *xq, float *isum,
                             float *xs) {
    const int64_t G = K / 32;
    for (int64_t m = 0; m < M; m++) {
        const float *r = x + m * K;
        const float amax = dflash_absmax(r, K);
        const float s = amax > 0.0f ? amax / Q4_XMAX : 1.0f;
        const float inv = 1.0f / s;
        int16_t *q = xq + m * Kp;
        memset(q, 0, (size_t)Kp * sizeof(int16_t));
        float *is = isum + m * Gp;
        for (int64_t g = 0; g < Gp; g++) is[g] = 0.0f;
        for (int64_t g = 0; g < G; g++) {
            int16_t *dst = q + 32 * (g & ~(int64_t)1) + 16 * (g & 1);
            const int64_t lo = dflash_round_i16(r + 32 * g, 16, inv, dst);
            is[g] = (float)(lo + dflash_round_i16(r + 32 * g + 16, 16, inv, dst + 32));
        }
        xs[m] = s;
    }
}

static inline float q4_hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v);
    __m128 hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    __m128 sh = _mm_movehdup_ps(lo);
    __m128 s = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, s);
    s = _mm_add_ss(s, sh);
    return _mm_cvtss_f32(s);
}

/* eight groups' float16 scales (or minimums) as float32 */
static inline __m256 q4_eight(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
/* lane j of v in every lane */
static inline __m256 q4_lane(__m256 v, int j) { return _mm256_permutevar8x32_ps(v, _mm256_set1_epi32(j)); }

/* sum_g mins[g] * isum[g] in 8 lanes, eight groups at a time (both zero-padded to Gp) */
static inline AI __m256 q4_min_part(const uint16_t *mins, int64_t Gp, const float *isum) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t g = 0; g < Gp; g += 8) acc = _mm256_fmadd_ps(q4_eight(mins + g), _mm256_loadu_ps(isum + g), acc);
    return acc;
}

/* A lone group's integer lanes (weights: its 16 bytes; xb: its 64-int16 slot, the second 16 unused). */
static inline AI __m256i q4_group_dot(__m256i wl, __m256i wh, const int16_t *xb) {
    return _mm256_add_epi32(_mm256_madd_epi16(wl, _mm256_loadu_si256((const __m256i *)xb)),
                            _mm256_madd_epi16(wh, _mm256_loadu_si256((const __m256i *)(xb + 32))));
}

/* The end of a weight row's tile, both paths: a lone last group g (G odd; an even group, so into a0),
 * then per input row the minimums' part, a0 + a1 + it, summed across lanes: out[b]. */
static inline AI void q4_finish(const uint8_t *w, const uint16_t *sm, int64_t g, int64_t G, const int16_t *xq,
                                int64_t Kp, const float *isum, int64_t Gp, int MX, __m256 *a0, const __m256 *a1,
                                float *out) {
    if (g < G) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(w + 16 * g));
        const __m128i n16 = _mm_set1_epi8(0x0F);
        const __m256i w0l = _mm256_cvtepu8_epi16(_mm_and_si128(raw, n16));
        const __m256i w0h = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), n16));
        const __m256 s0 = q4_lane(q4_eight(sm + (g & ~(int64_t)7)), (int)(g & 7));
        for (int b = 0; b < MX; b++)
            a0[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q4_group_dot(w0l, w0h, xq + b * Kp + 32 * g)), s0, a0[b]);
    }
    for (int b = 0; b < MX; b++) {
        const __m256 mn = q4_min_part(sm + Gp, Gp, isum + b * Gp);
        out[b] = q4_hsum8(_mm256_add_ps(_mm256_add_ps(a0[b], a1[b]), mn));
    }
}

/* One weight row (w: K/2 bytes, sm: its 2 Gp float16) against MX <= 4 input rows (xq, Kp apart; isum,
 * Gp apart): out[b] = the row's sum before xs (see the top of this file). AVX2. */
static inline AI void q4_tile(const uint8_t *w, const uint16_t *sm, int64_t G, const int16_t *xq, int64_t Kp,
                              const float *isum, int64_t Gp, int MX, float *out) {
    __m256 a0[4], a1[4];
    for (int b = 0; b < MX; b++) a0[b] = a1[b] = _mm256_setzero_ps();
    const __m256i nib = _mm256_set1_epi8(0x0F);
    int64_t g = 0;
    __m256 s8 = _mm256_setzero_ps();
    for (; g + 2 <= G; g += 2) {
        _mm_prefetch((const char *)(w + 16 * g) + Q4_PREFETCH, _MM_HINT_T0);
        if ((g & 7) == 0) s8 = q4_eight(sm + g);
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(w + 16 * g));
        const __m256i lo = _mm256_and_si256(raw, nib);                        /* [g k0-15 | g+1 k0-15] */
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nib);  /* [g k16-31 | g+1 k16-31] */
        const __m256i w0l = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(lo));
        const __m256i w0h = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(hi));
        const __m256i w1l = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(lo, 1));
        const __m256i w1h = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(hi, 1));
        const __m256 s0 = q4_lane(s8, (int)(g & 7)), s1 = q4_lane(s8, (int)(g & 7) + 1);
        for (int b = 0; b < MX; b++) {
            const int16_t *xb = xq + b * Kp + 32 * g;
            const __m256i d0 = q4_group_dot(w0l, w0h, xb);
            const __m256i d1 = _mm256_add_epi32(_mm256_madd_epi16(w1l, _mm256_loadu_si256((const __m256i *)(xb + 16))),
                                                _mm256_madd_epi16(w1h, _mm256_loadu_si256((const __m256i *)(xb + 48))));
            a0[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), s0, a0[b]);
            a1[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), s1, a1[b]);
        }
    }
    q4_finish(w, sm, g, G, xq, Kp, isum, Gp, MX, a0, a1, out);
}

/* y[b][n] = out[b] * xs[b] (+ bias[n]) for MX rows */
static inline AI void q4_store(const float *dots, int MX, const float *xs, const float *bias, int64_t n, int64_t N,
                               float *y) {
    for (int b = 0; b < MX; b++) {
        const float v = dots[b] * xs[b];
        y[b * N + n] = bias ? v + bias[n] : v;
    }
}

static void q4_rows(const uint8_t *w, const uint16_t *sm, int64_t K, const int16_t *xq, int64_t Kp,
                    const float *isum, int64_t Gp, const float *xs, int64_t M, int64_t N, int64_t n,
                    const float *bias, float *y) {
    const int64_t G = K / 32;
    const uint8_t *wr = w + n * (K / 2);
    const uint16_t *sr = sm + n * 2 * Gp;
    float dots[4];
    for (int64_t m = 0; m < M;) {
        const int MX = M - m >= 4 ? 4 : (int)(M - m);
        switch (MX) { /* literal shapes, so each tile is compiled unrolled */
#define T(mx) case mx: q4_tile(wr, sr, G, xq + m * Kp, Kp, isum + m * Gp, Gp, mx, dots); break;
            T(1) T(2) T(3) T(4)
#undef T
        }
        q4_store(dots, MX, xs + m, bias, n, N, y + m * N);
        m += MX;
    }
}

/* ---- AVX-512 (F/BW/VNNI): two groups per 32-lane step; the same float operations (see the top) */
#define Q4_V512 __attribute__((target("avx512f,avx512bw,avx512vnni,f16c,fma,avx2")))

Q4_V512 static inline AI void q4_tile512(const uint8_t *w, const uint16_t *sm, int64_t G, int64_t rowb, int64_t rows,
                                         const int16_t *xq, int64_t Kp, const float *isum, int64_t Gp, int NW, int MX,
                                         float *out) {
    /* NW weight rows (w, rowb bytes apart; sm, rows halves apart) x MX input rows: out[a * MX + b];
     * NW * MX <= 16. Every (weight row, input row) pair runs the very float operations of a lone pair. */
    __m512 acc[16]; /* lanes 0-7: the even groups' accumulator, 8-15: the odd groups' */
    for (int i = 0; i < NW * MX; i++) acc[i] = _mm512_setzero_ps();
    const __m256i nib = _mm256_set1_epi8(0x0F);
    /* the scales of groups (j, j + 1) in lanes (0-7, 8-15) */
    const __m512i pair[4] = {_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                             _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2),
                             _mm512_set_epi32(5, 5, 5, 5, 5, 5, 5, 5, 4, 4, 4, 4, 4, 4, 4, 4),
                             _mm512_set_epi32(7, 7, 7, 7, 7, 7, 7, 7, 6, 6, 6, 6, 6, 6, 6, 6)};
    __m512 s8[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    int64_t g = 0;
    for (; g + 2 <= G; g += 2) {
        __m512i wl[2], wh[2];
        __m512 s[2];
        for (int a = 0; a < NW; a++) {
            const uint8_t *wa = w + a * rowb;
            _mm_prefetch((const char *)(wa + 16 * g) + Q4_PREFETCH, _MM_HINT_T0);
            if ((g & 7) == 0) s8[a] = _mm512_castps256_ps512(q4_eight(sm + a * rows + g));
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(wa + 16 * g));
            wl[a] = _mm512_cvtepu8_epi16(_mm256_and_si256(raw, nib));
            wh[a] = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 4), nib));
            s[a] = _mm512_permutexvar_ps(pair[(g & 7) >> 1], s8[a]);
        }
        for (int b = 0; b < MX; b++) {
            const int16_t *xb = xq + b * Kp + 32 * g;
            const __m512i x0 = _mm512_loadu_si512((const void *)xb), x1 = _mm512_loadu_si512((const void *)(xb + 32));
            for (int a = 0; a < NW; a++) {
                __m512i d = _mm512_dpwssd_epi32(_mm512_setzero_si512(), wl[a], x0);
                d = _mm512_dpwssd_epi32(d, wh[a], x1);
                acc[a * MX + b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), s[a], acc[a * MX + b]);
            }
        }
    }
    for (int a = 0; a < NW; a++) {
        __m256 a0[8], a1[8];
        for (int b = 0; b < MX; b++) {
            a0[b] = _mm512_castps512_ps256(acc[a * MX + b]);
            a1[b] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[a * MX + b]), 1));
        }
        q4_finish(w + a * rowb, sm + a * rows, g, G, xq, Kp, isum, Gp, MX, a0, a1, out + a * MX);
    }
}

/* weight rows [n, n + NW) against every input row of the pass */
Q4_V512 static void q4_rows512(const uint8_t *w, const uint16_t *sm, int64_t K, const int16_t *xq, int64_t Kp,
                               const float *isum, int64_t Gp, const float *xs, int64_t M, int64_t N, int64_t n,
                               int NW, const float *bias, float *y) {
    const int64_t G = K / 32;
    const uint8_t *wr = w + n * (K / 2);
    const uint16_t *sr = sm + n * 2 * Gp;
    float dots[16];
    const int mmax = NW == 2 ? 6 : 8;
    for (int64_t m = 0; m < M;) {
        const int MX = M - m >= mmax ? mmax : (int)(M - m);
        switch (NW * 16 + MX) { /* literal shapes, so each tile is compiled unrolled */
#define T(nw, mx) case nw * 16 + mx: q4_tile512(wr, sr, G, K / 2, 2 * Gp, xq + m * Kp, Kp, isum + m * Gp, Gp, nw, mx, dots); break;
            T(1, 1) T(1, 2) T(1, 3) T(1, 4) T(1, 5) T(1, 6) T(1, 7) T(1, 8)
            T(2, 1) T(2, 2) T(2, 3) T(2, 4) T(2, 5) T(2, 6)
#undef T
        }
        for (int a = 0; a < NW; a++) q4_store(dots + a * MX, MX, xs + m, bias, n + a, N, y + m * N);
        m += MX;
    }
}

/* Passes of at least Q4_PAIR_M input rows (a prompt's prefill) take two weight rows per tile on the
 * AVX-512 path, so each activation vector loaded serves both. */
#ifndef Q4_PAIR_M
#define Q4_PAIR_M 32
#endif

/* ... and so do a verify's rows (at least two) against long weight rows (K >= Q4_PAIR_K), as in
 * gemm.c's int8 path (measured, 896 x 4864, 8 rows: 0.281 -> 0.204 ms). */
#ifndef Q4_PAIR_K
#define Q4_PAIR_K 2048
#endif

/* Which path runs: -1 = not chosen yet, 0 = AVX2, 1 = AVX-512 (F/BW/VNNI). */
static int q4_isa = -1;

/* Choose the path: 0 = AVX2, anything else = AVX-512 where the CPU has it. Returns the path in use. */
int dflash_q4_isa(int want) {
    __builtin_cpu_init();
    const int has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512vnni");
    q4_isa = (want != 0 && has512) ? 1 : 0;
    return q4_isa;
}

/* x [M, K] float32 row-major (K a multiple of 32), w [N, K / 2] uint8, sm [N, 2 Gp] float16 bits,
 * bias [N] float32 or NULL, y [M, N] float32. Returns 0, -1 without memory for the activation
 * buffers, -3 when K is not a multiple of 32. */
int dflash_q4_gemm(const float *x, int64_t M, int64_t K, const uint8_t *w, const uint16_t *sm, const float *bias,
                   int64_t N, float *y, int threads) {
    if (K % 32 != 0 || K <= 0) return -3;
    const int64_t G = K / 32, Kp = 64 * ((G + 1) / 2), Gp = 8 * ((G + 7) / 8);
    int16_t *xq = (int16_t *)aligned_alloc(64, (size_t)((M * Kp * 2 + 63) & ~(int64_t)63));
    float *isum = (float *)malloc((size_t)(M * Gp) * sizeof(float));
    float *xs = (float *)malloc((size_t)M * sizeof(float));
    if (!xq || !isum || !xs) {
        free(xq);
        free(isum);
        free(xs);
        return -1;
    }
    q4_quantize_rows(x, M, K, Kp, Gp, xq, isum, xs);
    if (q4_isa < 0) dflash_q4_isa(-1);
    for (int64_t m0 = 0; m0 < M; m0 += Q4_MBLOCK) {
        const int64_t mb = M - m0 < Q4_MBLOCK ? M - m0 : Q4_MBLOCK;
        const int16_t *xb = xq + m0 * Kp;
        const float *ib = isum + m0 * Gp;
        float *yb = y + m0 * N;
        if (q4_isa == 1) {
            const int nw = (mb >= Q4_PAIR_M || (K >= Q4_PAIR_K && mb >= 2)) ? 2 : 1;
            const int64_t tiles = (N + nw - 1) / nw;
#pragma omp parallel for num_threads(threads) schedule(static)
            for (int64_t t = 0; t < tiles; t++) {
                const int64_t n = nw * t;
                if (N - n >= nw)
                    q4_rows512(w, sm, K, xb, Kp, ib, Gp, xs + m0, mb, N, n, nw, bias, yb);
                else /* a last odd row alone */
                    q4_rows512(w, sm, K, xb, Kp, ib, Gp, xs + m0, mb, N, n, 1, bias, yb);
            }
        } else {
#pragma omp parallel for num_threads(threads) schedule(static)
            for (int64_t n = 0; n < N; n++) q4_rows(w, sm, K, xb, Kp, ib, Gp, xs + m0, mb, N, n, bias, yb);
        }
    }
    free(xq);
    free(isum);
    free(xs);
    return 0;
}
