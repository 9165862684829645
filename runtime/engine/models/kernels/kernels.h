/* The native kernels' functions that one source file calls in another (gemm.c, q4.c, amx.c,
 * layers.c): declared once here, so a changed signature fails to compile instead of miscalling. What
 * Python calls through ctypes is listed in build.py's SYMBOLS (wrappers.py checks the arguments). */
#ifndef DFLASH_KERNELS_H
#define DFLASH_KERNELS_H

#include <stdint.h>

/* gemm.c: y[M, N] = x[M, K] . W[N, K]^T (+ bias), float32 activations and output */
int dflash_int8_gemm(const float *x, int64_t M, int64_t K, const int8_t *w, const float *scale, const float *bias,
                     int64_t N, float *y, int threads);
void dflash_bf16_gemm(const float *x, int64_t M, int64_t K, const uint16_t *w, const float *bias, int64_t N, float *y,
                      int threads);
void dflash_f32_gemm(const float *x, int64_t M, int64_t K, const float *w, const float *bias, int64_t N, float *y,
                     int threads);
int dflash_bf16dp_gemm(const float *x, int64_t M, int64_t K, const uint16_t *w, const float *bias, int64_t N, float *y,
                       int threads);
/* gemm.c: the activation rounding the int8 and q4 kernels share */
float dflash_absmax(const float *r, int64_t n);
int64_t dflash_round_i16(const float *r, int64_t n, float inv, int16_t *q);

/* q4.c */
int dflash_q4_gemm(const float *x, int64_t M, int64_t K, const uint8_t *w, const uint16_t *sm, const float *bias,
                   int64_t N, float *y, int threads);

/* amx.c: the bf16 path on tiles, and the int8 kernel's tile form over activations gemm.c rounded */
int dflash_bf16amx_gemm(const float *x, int64_t M, int64_t K, const uint16_t *w, const float *bias, int64_t N, float *y,
                        int threads);
int dflash_int8amx_supported(void);
int dflash_int8amx_gemm(const int16_t *xq, int64_t M, int64_t Kp, const int8_t *w, int64_t K, const float *xs,
                        const float *scale, const float *bias, int64_t N, float *y, int threads);

#endif
