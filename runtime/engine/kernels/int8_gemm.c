/* int8 weight-only GEMM for decode steps: y[M, N] = x[M, K] . (w[N, K] * scale[N])^T, float32
 * activations and accumulation, AVX2 + FMA, OpenMP over output rows.
 *
 * Written for the shapes of a decode or verify step (M = 1..65 rows, K = hidden or MLP width): each
 * weight row is read from memory once per call and kept in L1 while every input row uses it.
 *
 * Exactness contract (dflash's greedy DFlash == plain greedy): the value computed for one input row
 * does not depend on M or on the other rows. Every (weight row, input row) pair is reduced the same
 * way: four 8-lane FMA chains over k (k mod 32), combined as (c0 + c1) + (c2 + c3), summed across
 * lanes in a fixed order, then the k % 32 tail in order, then scaled (and biased). Input rows are
 * taken in pairs only to share each weight conversion; a pair's rows run the very same instruction
 * sequence as a single row.
 */
#include <immintrin.h>
#include <stdint.h>

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

static inline __m256 load_w8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline float finish(__m256 c0, __m256 c1, __m256 c2, __m256 c3, const int8_t *w, const float *x,
                           int64_t k0, int64_t K) {
    float r = hsum8(_mm256_add_ps(_mm256_add_ps(c0, c1), _mm256_add_ps(c2, c3)));
    for (int64_t k = k0; k < K; k++) r += (float)w[k] * x[k];
    return r;
}

/* one weight row against two input rows (xa, xb) */
static inline void row2(const int8_t *w, const float *xa, const float *xb, int64_t K, float *ra, float *rb) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        _mm_prefetch((const char *)(w + k + PREFETCH), _MM_HINT_T0);
        __m256 w0 = load_w8(w + k), w1 = load_w8(w + k + 8), w2 = load_w8(w + k + 16), w3 = load_w8(w + k + 24);
        a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xa + k), a0);
        a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xa + k + 8), a1);
        a2 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xa + k + 16), a2);
        a3 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xa + k + 24), a3);
        b0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xb + k), b0);
        b1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + k + 8), b1);
        b2 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xb + k + 16), b2);
        b3 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xb + k + 24), b3);
    }
    *ra = finish(a0, a1, a2, a3, w, xa, k, K);
    *rb = finish(b0, b1, b2, b3, w, xb, k, K);
}

/* one weight row against one input row */
static inline float row1(const int8_t *w, const float *xa, int64_t K) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        _mm_prefetch((const char *)(w + k + PREFETCH), _MM_HINT_T0);
        a0 = _mm256_fmadd_ps(load_w8(w + k), _mm256_loadu_ps(xa + k), a0);
        a1 = _mm256_fmadd_ps(load_w8(w + k + 8), _mm256_loadu_ps(xa + k + 8), a1);
        a2 = _mm256_fmadd_ps(load_w8(w + k + 16), _mm256_loadu_ps(xa + k + 16), a2);
        a3 = _mm256_fmadd_ps(load_w8(w + k + 24), _mm256_loadu_ps(xa + k + 24), a3);
    }
    return finish(a0, a1, a2, a3, w, xa, k, K);
}

/* x [M, K] float32 row-major, w [N, K] int8 row-major, scale [N], bias [N] or NULL, y [M, N] */
void dflash_int8_gemm(const float *x, int64_t M, int64_t K, const int8_t *w, const float *scale,
                      const float *bias, int64_t N, float *y, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *wr = w + n * K;
        const float s = scale[n];
        const float b = bias ? bias[n] : 0.0f;
        int64_t m = 0;
        for (; m + 2 <= M; m += 2) {
            float ra, rb;
            row2(wr, x + m * K, x + (m + 1) * K, K, &ra, &rb);
            y[m * N + n] = ra * s + b;
            y[(m + 1) * N + n] = rb * s + b;
        }
        if (m < M) y[m * N + n] = row1(wr, x + m * K, K) * s + b;
    }
}
