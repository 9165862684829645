/* The decoder layers of a Llama-family target (Llama, Qwen2/2.5, Qwen3) for one decode or verify step,
 * in one native call: float32 activations, projections through dflash's int8, bf16 or float32 GEMMs (gemm.c), its AMX one (amx.c) or its 4-bit one (q4.c).
 *
 * Why: at one to a few rows a step's arithmetic between the GEMMs (norms, rotary embedding,
 * attention over a few hundred keys, SiLU, residual adds) is tiny, but in eager PyTorch it is ~20
 * small ops per layer, each paying dispatch and allocation; measured on a 2-core AVX2 EPYC, an int8
 * step spent ~26 ms of 68 outside the GEMMs. Here the same math is plain loops over float32 rows.
 *
 * The math mirrors the lean forward (runtime/engine/models/lean_target.py) and transformers: RMSNorm in
 * float32 (x * 1/sqrt(mean(x^2) + eps), then the weight), q/k norms per head where the model has them
 * (Qwen3), rotary embedding q * cos + rotate_half(q) * sin from the model's own tables, grouped-query
 * attention (head h reads kv head h / (H / KV)) with scores scaled after the dot product and a float32
 * softmax, SiLU(gate) * up.
 *
 * Exactness contract (greedy DFlash == plain greedy): every row is computed by the same instruction
 * sequence whatever the number of rows, the other rows and the thread count: the GEMMs guarantee it
 * (gemm.c), each norm and each attention row reduces in a fixed order, and attention visits the keys
 * a row may see in ascending slot order, so a tree or chain verify row sees exactly the sums a
 * one-token step at that position sees.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

/* One projection: weights [N, K] (int8 with one scale per row, bf16 or float32), bias [N] or NULL. */
typedef struct {
    const void *w;
    const float *scale; /* int8: per-row scales; q4: the float16 scales and minimums (q4.c); bf16, float32: NULL */
    const float *bias;
    int64_t n, k;
    int64_t kind; /* weights: 0 = bf16, 1 = int8, 2 = float32, 3 = bf16 on the AVX-512-BF16 path (gemm.c), 4 = q4 (q4.c),
                     5 = bf16 on AMX tiles (amx.c) */
} Proj;

/* One decoder layer (the order of fields is the ctypes Structure in kernels/__init__.py). */
typedef struct {
    Proj qkv, o, gate_up, down;
    const float *ln1, *ln2; /* [D] */
    const float *q_norm, *k_norm; /* [hd] or NULL */
    float eps1, eps2, qk_eps, scaling;
} Layer;

/* Model shape (one per call). */
typedef struct {
    int64_t d, heads, kv_heads, head_dim, ffn;
} Shape;

static int proj(const Proj *p, const float *x, int64_t m, float *y, int threads) {
    if (p->kind == 1) return dflash_int8_gemm(x, m, p->k, (const int8_t *)p->w, p->scale, p->bias, p->n, y, threads);
    if (p->kind == 2) {
        dflash_f32_gemm(x, m, p->k, (const float *)p->w, p->bias, p->n, y, threads);
        return 0;
    }
    if (p->kind == 4)
        return dflash_q4_gemm(x, m, p->k, (const uint8_t *)p->w, (const uint16_t *)p->scale, p->bias, p->n, y, threads);
    if (p->kind == 5) return dflash_bf16amx_gemm(x, m, p->k, (const uint16_t *)p->w, p->bias, p->n, y, threads);
    if (p->kind == 3) return dflash_bf16dp_gemm(x, m, p->k, (const uint16_t *)p->w, p->bias, p->n, y, threads);
    dflash_bf16_gemm(x, m, p->k, (const uint16_t *)p->w, p->bias, p->n, y, threads);
    return 0;
}

/* y = weight * (x / sqrt(mean(x^2) + eps)), one row of n */
static void rms_row(const float *x, const float *weight, float eps, int64_t n, float *y) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) y[i] = weight[i] * (x[i] * r);
}

/* in place: x = x * cos + rotate_half(x) * sin, one head of hd (rotate_half(x) = [-x2, x1]) */
static void rope_head(float *x, const float *cos, const float *sin, int64_t hd) {
    const int64_t half = hd / 2;
    float tmp[512];
    memcpy(tmp, x, (size_t)hd * sizeof(float));
    for (int64_t i = 0; i < half; i++) x[i] = tmp[i] * cos[i] + (-tmp[i + half]) * sin[i];
    for (int64_t i = half; i < hd; i++) x[i] = tmp[i] * cos[i] + tmp[i - half] * sin[i];
}

/* q . k over hd (a multiple of 8: eight lanes, summed in a fixed order; else in order) */
static inline float dot(const float *a, const float *b, int64_t n) {
    if (n % 8 == 0) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i += 8) acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
        float l[8];
        _mm256_storeu_ps(l, acc);
        return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
    }
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* q . k for the eight keys k, k + hd, ..., k + 7 hd (hd a multiple of 8): lane i is key i's dot, each
 * summed exactly as dot() sums one key (the same products, the same lane sums, the same order). */
static inline __m256 dot8(const float *q, const float *k, int64_t hd) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < hd; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int i = 0; i < 8; i++) a[i] = _mm256_add_ps(a[i], _mm256_mul_ps(qv, _mm256_loadu_ps(k + i * hd + d)));
    }
    /* lane i: ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) of a[i], as in dot() */
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* exp(x) in eight lanes, x clamped to [-87.3, 88.3] (~1e-38 .. ~2e38; attention passes scores minus
 * their maximum, <= 0):
 * x = n ln2 + r with n = round(x log2 e), e^r by a degree-7 polynomial (Cephes' expf coefficients),
 * times 2^n built in the exponent bits. Each lane's result depends on that lane's input alone, with
 * no fused operations, so a key's weight is the same in any lane, block or row. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* SiLU(g) * u in eight lanes: (g / (1 + exp(-g))) * u, each lane from its own inputs (exp8; a very
 * negative g gives ~0, as the exact function does). It replaced libm's expf per element: 4-5% of an
 * 8-row bf16 verify (perf, 2-core AVX-512 EPYC with AVX-VNNI). */
static inline __m256 silu_mul8(__m256 g, __m256 u) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

/* Whether a row sees key j: its mask row says so or, without one, j is at or before its own slot. */
static inline int visible(const uint8_t *mask, int64_t j, int64_t self) { return mask ? mask[j] != 0 : j <= self; }

/* Attention for one query row and one head: keys [0, len) where visible (mask row or, without one,
 * every key up to and including slot `self`). Every key's score (eight keys at a time) and weight
 * (exp8) depend on that key alone; the weights are summed and the values accumulated over the visible
 * keys in ascending order, so a row's result depends only on which keys it sees, in which order: a
 * tree's row, whose ancestors sit at other slots than a chain's, sees the sums a one-token step sees.
 * `scores` holds len + 8 floats. */
static void attend(const float *q, const float *ck, const float *cv, int64_t hd, int64_t len, const uint8_t *mask,
                   int64_t self, float scaling, float *scores, float *out) {
    int64_t j = 0;
    if (hd % 8 == 0)
        for (; j + 8 <= len; j += 8)
            _mm256_storeu_ps(scores + j, _mm256_mul_ps(dot8(q, ck + j * hd, hd), _mm256_set1_ps(scaling)));
    for (; j < len; j++) scores[j] = dot(q, ck + j * hd, hd) * scaling;
    float mx = -INFINITY;
    for (j = 0; j < len; j++)
        if (visible(mask, j, self) && scores[j] > mx) mx = scores[j];
    const __m256 m8 = _mm256_set1_ps(mx);
    for (j = 0; j < len; j += 8) /* the last block reads and writes up to 7 floats past len (scratch) */
        _mm256_storeu_ps(scores + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), m8)));
    float sum = 0.0f;
    for (j = 0; j < len; j++)
        if (visible(mask, j, self)) sum += scores[j];
    for (int64_t d = 0; d < hd; d++) out[d] = 0.0f;
    const float inv = 1.0f / sum;
    for (j = 0; j < len; j++) {
        if (!visible(mask, j, self)) continue;
        const float p = scores[j] * inv;
        const float *vr = cv + j * hd;
        for (int64_t d = 0; d < hd; d++) out[d] += p * vr[d];
    }
}

/* Run `n_layers` decoder layers over h [T, D] in place (rows are new tokens at cache slots start ..
 * start + T - 1), writing their K/V into the caches (ck[i], cv[i]: [KV, cap, hd] float32 each).
 *   cos, sin: [T, hd] rotary tables of the rows' positions.
 *   mask: [T, start + T] uint8 (1 = may attend) or NULL for causal over the slots.
 *   taps, n_taps, tapbuf: after layer taps[j], h is copied into tapbuf[:, j * D : (j + 1) * D] ([T, n_taps * D]).
 * Returns 0, or -1 when scratch memory cannot be allocated. */
int dflash_layers(const Layer *layers, int64_t n_layers, const Shape *shape, float *const *ck, float *const *cv,
                  int64_t cap, float *h, int64_t T, int64_t start, const float *cos, const float *sin,
                  const uint8_t *mask, const int64_t *taps, int64_t n_taps, float *tapbuf, int threads) {
    const int64_t D = shape->d, H = shape->heads, KV = shape->kv_heads, hd = shape->head_dim, F = shape->ffn;
    const int64_t nq = H * hd, nkv = KV * hd, nqkv = nq + 2 * nkv, len = start + T, groups = H / KV;
    if (hd > 512) return -2;
    const int64_t width = nqkv > 2 * F ? nqkv : 2 * F;
    float *x = malloc((size_t)(T * D) * sizeof(float));
    float *big = malloc((size_t)(T * width) * sizeof(float));
    float *att = malloc((size_t)(T * nq) * sizeof(float));
    float *act = malloc((size_t)(T * F) * sizeof(float));
    float *scores = malloc((size_t)(threads * (len + 8)) * sizeof(float));
    int rc = 0;
    if (!x || !big || !att || !act || !scores) rc = -1;
    for (int64_t li = 0; li < n_layers && rc == 0; li++) {
        const Layer *L = &layers[li];
        for (int64_t t = 0; t < T; t++) rms_row(h + t * D, L->ln1, L->eps1, D, x + t * D);
        if ((rc = proj(&L->qkv, x, T, big, threads)) != 0) break;
        float *kc = ck[li], *vc = cv[li];
        for (int64_t t = 0; t < T; t++) {
            float *row = big + t * nqkv;
            for (int64_t hh = 0; hh < H + KV; hh++) {
                float *v = row + hh * hd;
                if (L->q_norm && hh < H) rms_row(v, L->q_norm, L->qk_eps, hd, v);
                if (L->k_norm && hh >= H) rms_row(v, L->k_norm, L->qk_eps, hd, v);
                rope_head(v, cos + t * hd, sin + t * hd, hd);
            }
            for (int64_t g = 0; g < KV; g++) {
                memcpy(kc + (g * cap + start + t) * hd, row + nq + g * hd, (size_t)hd * sizeof(float));
                memcpy(vc + (g * cap + start + t) * hd, row + nq + nkv + g * hd, (size_t)hd * sizeof(float));
            }
        }
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t job = 0; job < T * H; job++) {
            const int64_t t = job / H, hh = job % H, g = hh / groups;
            const int tid = omp_get_thread_num();
            attend(big + t * nqkv + hh * hd, kc + g * cap * hd, vc + g * cap * hd, hd, len,
                   mask ? mask + t * len : NULL, start + t, L->scaling, scores + tid * (len + 8), att + t * nq + hh * hd);
        }
        if ((rc = proj(&L->o, att, T, x, threads)) != 0) break;
        for (int64_t i = 0; i < T * D; i++) h[i] += x[i];
        for (int64_t t = 0; t < T; t++) rms_row(h + t * D, L->ln2, L->eps2, D, x + t * D);
        if ((rc = proj(&L->gate_up, x, T, big, threads)) != 0) break;
        const int64_t nb = (F + 7) / 8; /* eight-wide blocks per row */
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t job = 0; job < T * nb; job++) {
            const int64_t t = job / nb, i = (job % nb) * 8;
            const float *gr = big + t * 2 * F, *ur = gr + F;
            float *ar = act + t * F;
            if (i + 8 <= F)
                _mm256_storeu_ps(ar + i, silu_mul8(_mm256_loadu_ps(gr + i), _mm256_loadu_ps(ur + i)));
            else /* a row's last elements: the same lane math, one at a time */
                for (int64_t e = i; e < F; e++)
                    ar[e] = _mm256_cvtss_f32(silu_mul8(_mm256_set1_ps(gr[e]), _mm256_set1_ps(ur[e])));
        }
        if ((rc = proj(&L->down, act, T, x, threads)) != 0) break;
        for (int64_t i = 0; i < T * D; i++) h[i] += x[i];
        for (int64_t j = 0; j < n_taps; j++)
            if (taps[j] == li)
                for (int64_t t = 0; t < T; t++)
                    memcpy(tapbuf + (t * n_taps + j) * D, h + t * D, (size_t)D * sizeof(float));
    }
    free(x);
    free(big);
    free(att);
    free(act);
    free(scores);
    return rc;
}
