/* bf16 weights x bf16-rounded activations on AMX tiles (tdpbf16ps), for CPUs with AMX-BF16 (Intel
 * Xeon from Sapphire Rapids on): dflash_bf16amx_gemm, y[M, N] = x[M, K] . W[N, K]^T (+ bias).
 *
 * One tdpbf16ps multiplies a tile of 16 weight rows x 32 k by a tile of 32 k x 16 activation rows
 * (bf16 pairs) into 16 x 16 float32 sums: 8,192 products per instruction, against 32 per vdpbf16ps.
 * A decode or verify step of up to 16 rows costs one pass over the weights whatever its row count
 * (the step is bound by reading the weights), and a prompt's prefill runs at the tiles' rate.
 *
 * The weights are the A tiles, read in place from the row-major [N, K] bf16 tensor (16 rows of 64
 * bytes, 2K bytes apart: no packed copy of the model); the activations are rounded per row to bf16
 * (round to nearest even, vcvtneps2bf16, from that row alone) and laid out as the B tiles want them:
 * k pairs by rows, input rows by columns ([K/2][Mp][2], Mp = M rounded up to 16, zero-padded).
 *
 * Exactness contract (greedy DFlash == plain greedy): the sum for (weight row n, input row m) is one
 * C-tile element, accumulated by the same tdpbf16ps sequence over k (32 at a time, in order) whatever
 * M, the tile the row sits in, the other rows and the thread count; every element of a tile is
 * computed on its own (the other rows of B are other columns of C). So a verify row equals the row
 * computed alone. Its results differ from dflash_bf16dp_gemm's (another summation inside the
 * instruction), so a process runs one bf16 path for every step (runtime/engine/linear.py measures).
 *
 * Runs only where (a) cpuid reports AMX-TILE, AMX-BF16 and AVX-512 F/BW/BF16, (b) Linux grants the
 * process the tile state (arch_prctl ARCH_REQ_XCOMP_PERM), and (c) a probe in a forked child computes
 * one tile correctly: some VMs advertise AMX and fault on it, and a fault in a child is only a "no".
 * Elsewhere, or with a compiler without AMX intrinsics (GCC < 11, clang < 12), or where K is not a
 * multiple of 32 or N < 16, dflash_bf16amx_supported() is 0 / the call runs dflash_bf16dp_gemm. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#ifndef HAVE_AMX /* -DHAVE_AMX=0 builds the fallback only (as an older compiler does) */
#if defined(__linux__) && defined(__x86_64__) &&                                                          \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif
#endif

#if HAVE_AMX
#include <cpuid.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define VAMX __attribute__((target("avx512f,avx512bw,avx512bf16,amx-tile,amx-bf16,amx-int8")))

/* Rows per pass over the weights in a prefill: the pass's bf16 activations (AMX_PASS x K) stay in L2
 * while every weight tile of the pass uses them. */
#ifndef AMX_PASS
#define AMX_PASS 256
#endif

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) TileConfig;

/* Load this thread's tile configuration: every tile used is 16 rows of 64 bytes: C (tmm0-3) 16 x 16
 * sums, A (tmm4-5) 16 weight rows x 64 bytes, B (tmm6-7) 16 rows of k pairs (bf16) or quads (int8)
 * x 16 input rows. */
VAMX static void load_tile_config(void) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.colsb[i] = 64;
        c.rows[i] = 16;
    }
    _tile_loadconfig(&c);
}

static int cpu_has_amx(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    const int tile = (d >> 24) & 1, bf16 = (d >> 22) & 1;
    __builtin_cpu_init();
    return tile && bf16 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512bf16");
}

/* One tile product in this process: 16 x 16 sums of 32 products of 1.0 x 2.0; 1 where all are 64. */
VAMX static int probe_tiles(void) {
    static uint16_t a[16 * 32], b[16 * 32];
    static float out[16 * 16];
    for (int i = 0; i < 16 * 32; i++) {
        a[i] = 0x3F80; /* 1.0 */
        b[i] = 0x4000; /* 2.0 */
    }
    load_tile_config();
    _tile_zero(0);
    _tile_loadd(4, a, 64);
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_stored(0, out, 64);
    _tile_release();
    for (int i = 0; i < 16 * 16; i++)
        if (out[i] != 64.0f) return 0;
    return 1;
}

static int amx_state = -1; /* the probe's answer: -1 = not asked yet */
static int amx_allowed = 1;  /* dflash_amx_allow */

/* 1 where this CPU, kernel and build run the AMX path (probed once, see the top of this file) and
 * the process allows it. */
int dflash_bf16amx_supported(void) {
    if (!amx_allowed) return 0;
    if (amx_state >= 0) return amx_state;
    amx_state = 0;
    if (!cpu_has_amx()) return 0;
    const pid_t pid = fork();
    if (pid < 0) return 0;
    if (pid == 0) { /* the child: only system calls and the probe, then _exit */
        if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) _exit(2);
        _exit(probe_tiles() ? 0 : 3);
    }
    int status = 0;
    if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) return 0;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return 0;
    amx_state = probe_tiles();
    return amx_state;
}

/* Round rows [m0, m0 + mb) of x [., K] to bf16 and lay them out for B tiles: xp[(p * Mp + i) * 2 + j] =
 * bf16(x[m0 + i][2p + j]) for the K/2 pairs p, zero for i >= mb (Mp a multiple of 16). */
VAMX static void pack_rows(const float *x, int64_t m0, int64_t mb, int64_t K, int64_t Mp, uint32_t *xp) {
    const int64_t P = K / 2;
    if (mb < Mp) memset(xp, 0, (size_t)(P * Mp * 4));
    for (int64_t i = 0; i < mb; i++) {
        const float *src = x + (m0 + i) * K;
        for (int64_t k = 0; k < K; k += 16) { /* K is a multiple of 32: eight pairs at a time */
            uint32_t pairs[8];
            _mm256_storeu_si256((__m256i *)pairs, (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + k)));
            for (int q = 0; q < 8; q++) xp[(k / 2 + q) * Mp + i] = pairs[q];
        }
    }
}

/* A C tile (16 weight rows n0.. x 16 input rows m0..) into y [., N]: weight rows from nfrom on, input rows
 * below mlim. */
static void store_tile(const float *c, int64_t n0, int64_t nfrom, int64_t m0, int64_t mlim, int64_t N,
                       const float *bias, float *y) {
    for (int64_t r = nfrom - n0; r < 16; r++) {
        const float b = bias ? bias[n0 + r] : 0.0f;
        for (int64_t i = 0; i < mlim - m0 && i < 16; i++) {
            const float v = c[r * 16 + i];
            y[(m0 + i) * N + n0 + r] = bias ? v + b : v;
        }
    }
}

/* The first weight row of 16-row block t of N rows: blocks of 16 from 0, the last one ending at N
 * (it overlaps the one before where N % 16 != 0; the overlap is computed the same way, stored once). */
static inline int64_t block_row(int64_t t, int64_t N) { return t * 16 + 16 <= N ? t * 16 : N - 16; }

/* The first row that block t stores: its own first row, or where block t - 1 ended (an overlapping
 * last block). */
static inline int64_t block_from(int64_t t, int64_t N) {
    const int64_t n0 = block_row(t, N);
    return t > 0 && n0 < t * 16 ? t * 16 : n0;
}

/* The accumulator tiles tmm0-3: zeroed, and stored to c (four 16 x 16 blocks of 4-byte sums). */
VAMX static inline __attribute__((always_inline)) void zero_c4(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}
VAMX static inline __attribute__((always_inline)) void store_c4(void *c) {
    _tile_stored(0, (char *)c, 64);
    _tile_stored(1, (char *)c + 1024, 64);
    _tile_stored(2, (char *)c + 2048, 64);
    _tile_stored(3, (char *)c + 3072, 64);
}

/* Up to 16 input rows (one B column block, Mp = 16): two weight blocks per k step share one B tile.
 * Measured on a 2-core Xeon with AMX, a step's weights streamed from memory (24 layers of the embedded
 * target, 2 threads): two blocks per step ran a one-row step in 27.2 ms against 27.8 with one and 28.3
 * with four; software prefetch of the next rows (in k order, or the next blocks' contiguous bytes)
 * made every variant slower, and so did loading the next k step's tiles ahead of the products. */
VAMX static void amx_small(const uint32_t *xp, int64_t M, int64_t K, const uint16_t *w, const float *bias, int64_t N,
                           float *y, int threads) {
    const int64_t blocks = (N + 15) / 16, pairs = (blocks + 1) / 2;
    const int64_t stride = K * 2;
#pragma omp parallel num_threads(threads)
    {
        load_tile_config();
        float c[2][256];
#pragma omp for schedule(static)
        for (int64_t g = 0; g < pairs; g++) {
            const int64_t t0 = g * 2, two = t0 + 1 < blocks;
            const uint16_t *w0 = w + block_row(t0, N) * K, *w1 = w + block_row(two ? t0 + 1 : t0, N) * K;
            _tile_zero(0);
            _tile_zero(1);
            for (int64_t k = 0; k < K; k += 32) {
                _tile_loadd(6, xp + k / 2 * 16, 64);
                _tile_loadd(4, w0 + k, stride);
                _tile_dpbf16ps(0, 4, 6);
                if (two) {
                    _tile_loadd(5, w1 + k, stride);
                    _tile_dpbf16ps(1, 5, 6);
                }
            }
            _tile_stored(0, c[0], 64);
            _tile_stored(1, c[1], 64);
            for (int64_t a = 0; a <= two; a++) store_tile(c[a], block_row(t0 + a, N), block_from(t0 + a, N), 0, M, N, bias, y);
        }
        _tile_release();
    }
}

/* A pass of Mp (> 16) input rows: tiles of 32 weight rows x 32 input rows (2 A x 2 B tiles, 4 C). */
VAMX static void amx_pass(const uint32_t *xp, int64_t m0, int64_t mb, int64_t Mp, int64_t K, const uint16_t *w,
                          const float *bias, int64_t N, float *y, int threads) {
    const int64_t blocks = (N + 15) / 16, pairs = (blocks + 1) / 2, mpairs = (Mp / 16 + 1) / 2;
    const int64_t stride = K * 2, bstride = Mp * 4;
#pragma omp parallel num_threads(threads)
    {
        load_tile_config();
        float c[4][256];
#pragma omp for schedule(static)
        for (int64_t g = 0; g < pairs; g++) {
            const int64_t t0 = g * 2, two_n = t0 + 1 < blocks;
            const uint16_t *wa = w + block_row(t0, N) * K, *wb = w + block_row(two_n ? t0 + 1 : t0, N) * K;
            for (int64_t j = 0; j < mpairs; j++) {
                const int64_t c0 = j * 32, two_m = c0 + 16 < Mp;
                const uint32_t *xa = xp + c0, *xb = xp + (two_m ? c0 + 16 : c0);
                zero_c4();
                for (int64_t k = 0; k < K; k += 32) {
                    _tile_loadd(4, wa + k, stride);
                    _tile_loadd(5, wb + k, stride);
                    _tile_loadd(6, xa + k / 2 * Mp, bstride);
                    _tile_loadd(7, xb + k / 2 * Mp, bstride);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
                store_c4(c);
                for (int64_t a = 0; a <= two_n; a++) {
                    const int64_t n0 = block_row(t0 + a, N), from = block_from(t0 + a, N);
                    store_tile(c[a * 2], n0, from, m0 + c0, m0 + mb, N, bias, y);
                    if (two_m) store_tile(c[a * 2 + 1], n0, from, m0 + c0 + 16, m0 + mb, N, bias, y);
                }
            }
        }
        _tile_release();
    }
}

/* ---- int8 weights x 15-bit activations on AMX tiles (tdpbssd, tdpbsud) -----------------------
 *
 * dflash_int8amx_dots: the exact integer dot products of dflash_int8_gemm (gemm.c: int8 weights x
 * activations rounded per row to int16 of at most 16383 in magnitude), on tiles. A tile multiplies
 * bytes, so each activation is split into a signed high byte and an unsigned low byte, x = 256 hi +
 * lo (hi in [-64, 63], lo in [0, 255]): tdpbssd sums w * hi, tdpbsud sums w * lo, each in int32
 * without overflow for K <= AMX_INT8_KMAX (255 * 128 * K < 2^31), and the dot product is 256 sum_hi
 * + sum_lo in int64: the same integer as gemm.c's, so the same float32 result bit for bit (identical
 * to the AVX2 and AVX-512 VNNI paths; which path runs changes nothing but time). */
#ifndef AMX_INT8_KMAX
#define AMX_INT8_KMAX 65536
#endif

/* Split rows [m0, m0 + mb) of xq (int16, Kp apart) into B tiles of bytes: hi/lo[(g * Mp + i) * 4 + j]
 * = the high/low byte of xq[m0 + i][4g + j] for the K/4 groups g, zero for i >= mb. */
VAMX static void split_rows(const int16_t *xq, int64_t Kp, int64_t m0, int64_t mb, int64_t K, int64_t Mp, int8_t *hi,
                            uint8_t *lo) {
    if (mb < Mp) {
        memset(hi, 0, (size_t)(K * Mp));
        memset(lo, 0, (size_t)(K * Mp));
    }
    const __m256i low = _mm256_set1_epi16(0xFF);
    for (int64_t i = 0; i < mb; i++) {
        const int16_t *r = xq + (m0 + i) * Kp;
        for (int64_t k = 0; k < K; k += 16) { /* K is a multiple of 64 */
            const __m256i v = _mm256_loadu_si256((const __m256i *)(r + k));
            const __m256i h = _mm256_srai_epi16(v, 8), l = _mm256_and_si256(v, low); /* arithmetic shift: floor(v / 256) */
            const __m128i h8 = _mm_packs_epi16(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
            const __m128i l8 = _mm_packus_epi16(_mm256_castsi256_si128(l), _mm256_extracti128_si256(l, 1));
            int32_t hw[4], lw[4];
            _mm_storeu_si128((__m128i *)hw, h8);
            _mm_storeu_si128((__m128i *)lw, l8);
            for (int q = 0; q < 4; q++) {
                const int64_t at = ((k / 4 + q) * Mp + i) * 4;
                memcpy(hi + at, &hw[q], 4);
                memcpy(lo + at, &lw[q], 4);
            }
        }
    }
}

/* y rows [m0, m0 + mb): for each pair of 16-row weight blocks (in parallel) and each block of 16 input
 * rows, the high and low sums over k, 64 at a time in order; then y = dot * (xs * scale) (+ bias),
 * the expression of gemm.c's store_dots. */
VAMX static void amx_int8_pass(const int8_t *hi, const uint8_t *lo, int64_t m0, int64_t mb, int64_t Mp, int64_t K,
                               const int8_t *w, const float *xs, const float *scale, const float *bias, int64_t N,
                               float *y, int threads) {
    const int64_t blocks = (N + 15) / 16, pairs = (blocks + 1) / 2, bstride = Mp * 4;
#pragma omp parallel num_threads(threads)
    {
        load_tile_config();
        int32_t c[4][256];
#pragma omp for schedule(static)
        for (int64_t g = 0; g < pairs; g++) {
            const int64_t t0 = g * 2, two = t0 + 1 < blocks;
            const int8_t *w0 = w + block_row(t0, N) * K, *w1 = w + block_row(two ? t0 + 1 : t0, N) * K;
            for (int64_t j = 0; j < Mp; j += 16) {
                zero_c4();
                for (int64_t k = 0; k < K; k += 64) {
                    _tile_loadd(6, hi + (k / 4 * Mp + j) * 4, bstride);
                    _tile_loadd(7, lo + (k / 4 * Mp + j) * 4, bstride);
                    _tile_loadd(4, w0 + k, K);
                    _tile_dpbssd(0, 4, 6);
                    _tile_dpbsud(1, 4, 7);
                    if (two) {
                        _tile_loadd(5, w1 + k, K);
                        _tile_dpbssd(2, 5, 6);
                        _tile_dpbsud(3, 5, 7);
                    }
                }
                store_c4(c);
                for (int64_t a = 0; a <= two; a++) {
                    const int64_t n0 = block_row(t0 + a, N), from = block_from(t0 + a, N);
                    for (int64_t r = from - n0; r < 16; r++) {
                        const int64_t n = n0 + r;
                        for (int64_t i = 0; i < 16 && j + i < mb; i++) {
                            const int64_t m = m0 + j + i;
                            const int64_t dot = 256 * (int64_t)c[2 * a][r * 16 + i] + c[2 * a + 1][r * 16 + i];
                            const float v = (float)dot * (xs[m] * scale[n]);
                            y[m * N + n] = bias ? v + bias[n] : v;
                        }
                    }
                }
            }
        }
        _tile_release();
    }
}

/* 1 where dflash_int8amx_dots runs on tiles here (AMX-INT8 too), else 0 (the caller runs its own path). */
int dflash_int8amx_supported(void) {
    if (!dflash_bf16amx_supported()) return 0;
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 25) & 1);
}

/* y [M, N] from xq [M, Kp] int16 (rounded by gemm.c), its row scales xs [M], w [N, K] int8, scale [N],
 * bias [N] or NULL. Returns 0, 1 where these shapes do not run on tiles (K not a multiple of 64 or
 * above AMX_INT8_KMAX, N < 16: the caller computes them), or -1 without memory. */
int dflash_int8amx_gemm(const int16_t *xq, int64_t M, int64_t Kp, const int8_t *w, int64_t K, const float *xs,
                        const float *scale, const float *bias, int64_t N, float *y, int threads) {
    if (!dflash_int8amx_supported() || K % 64 != 0 || K > AMX_INT8_KMAX || N < 16) return 1;
    const int64_t pass = M < AMX_PASS ? M : AMX_PASS, Mp_max = (pass + 15) & ~(int64_t)15;
    int8_t *hi = (int8_t *)aligned_alloc(64, (size_t)(K * Mp_max));
    uint8_t *lo = (uint8_t *)aligned_alloc(64, (size_t)(K * Mp_max));
    if (!hi || !lo) {
        free(hi);
        free(lo);
        return -1;
    }
    for (int64_t m0 = 0; m0 < M; m0 += AMX_PASS) {
        const int64_t mb = M - m0 < AMX_PASS ? M - m0 : AMX_PASS, Mp = (mb + 15) & ~(int64_t)15;
        split_rows(xq, Kp, m0, mb, K, Mp, hi, lo);
        amx_int8_pass(hi, lo, m0, mb, Mp, K, w, xs, scale, bias, N, y, threads);
    }
    free(hi);
    free(lo);
    return 0;
}
#else
static int amx_allowed = 1;
int dflash_bf16amx_supported(void) { return 0; }
int dflash_int8amx_supported(void) { return 0; }
int dflash_int8amx_gemm(const int16_t *xq, int64_t M, int64_t Kp, const int8_t *w, int64_t K, const float *xs,
                        const float *scale, const float *bias, int64_t N, float *y, int threads) {
    (void)xq, (void)M, (void)Kp, (void)w, (void)K, (void)xs, (void)scale, (void)bias, (void)N, (void)y, (void)threads;
    return 1;
}
#endif

/* Allow (1) or forbid (0) the AMX paths in this process (the CLI's DFLASH_AMX=0 forbids them); returns
 * whether they run now. Call it before the first GEMM: the int8 kernel picks its path once
 * (dflash_int8_isa). */
int dflash_amx_allow(int allow) {
    amx_allowed = allow != 0;
    return dflash_bf16amx_supported();
}

/* x [M, K] float32 row-major (rounded to bf16 here), w [N, K] bfloat16 bits row-major, bias [N] float32
 * or NULL, y [M, N]. Returns 0, or -1 when the activation buffer cannot be allocated. */
int dflash_bf16amx_gemm(const float *x, int64_t M, int64_t K, const uint16_t *w, const float *bias, int64_t N,
                        float *y, int threads) {
#if HAVE_AMX
    if (dflash_bf16amx_supported() && K % 32 == 0 && N >= 16) {
        if (M <= 16) {
            uint32_t *xp = (uint32_t *)aligned_alloc(64, (size_t)(K / 2 * 16 * 4));
            if (!xp) return -1;
            pack_rows(x, 0, M, K, 16, xp);
            amx_small(xp, M, K, w, bias, N, y, threads);
            free(xp);
            return 0;
        }
        const int64_t pass = M < AMX_PASS ? M : AMX_PASS;
        const int64_t Mp_max = (pass + 15) & ~(int64_t)15;
        uint32_t *xp = (uint32_t *)aligned_alloc(64, (size_t)(K / 2 * Mp_max * 4));
        if (!xp) return -1;
        for (int64_t m0 = 0; m0 < M; m0 += AMX_PASS) {
            const int64_t mb = M - m0 < AMX_PASS ? M - m0 : AMX_PASS, Mp = (mb + 15) & ~(int64_t)15;
            pack_rows(x, m0, mb, K, Mp, xp);
            amx_pass(xp, m0, mb, Mp, K, w, bias, N, y, threads);
        }
        free(xp);
        return 0;
    }
#endif
    return dflash_bf16dp_gemm(x, M, K, w, bias, N, y, threads);
}
