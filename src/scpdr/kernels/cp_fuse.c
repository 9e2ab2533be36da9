/* Sufficient statistics of CP-Fuse's grid search (Abad et al. 2025) on a lattice grid, for
   float32 rows on CPU. Built, measured against torch and loaded by scpdr/kernels/build.py;
   scpdr.naf.cp_fuse_step uses it where it is the faster.

   CP-Fuse picks (b1, b2) on a grid minimizing max_i KL(r_b || p_i) - path_i with
   log r_b = b1 l1 + b2 l2 - A(b). Every term is a function of three sums over the vocabulary:
   Z(b) = sum_t e^(b1 l1 + b2 l2), and the same sums weighted by l1 and by l2 (A = log Z,
   E_r[l_k] = sum / Z). On a lattice b = step·(i, j) (the default grid: step 0.2, i, j in
   0..10), e^(b1 l1 + b2 l2) = u^i w^j with u = e^(step l1), w = e^(step l2), so all of them
   come from one pass over the row:

     S[i][q] = sum_t u_t^i W_q(t),  W_q = w^q (q < nj), w^(q-nj) l1 (q < 2 nj), w^(q-2nj) l2,

   i.e. (ni x V)·(V x 3 nj): two exponentials per token instead of one per token and grid point
   (120 with the default grid, which made the grid search cost ~1 decode step at batch 8).
   Blocks of BLOCK tokens: the powers into an L1/L2-sized buffer, then a register tile of TI x TQ
   dot products (by ISA, as in packed_gemm.c), float within a block, double across blocks.
   Rows are independent: batches of two rows or more split them over threads (OpenMP, where
   built with it). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
/* GCC's Zen tuning (what -march=native implies on this AMD EPYC) made this file ~12% slower
   than its generic tuning (5.4 vs 4.7 ms for 8 rows of 49152 tokens; docs/performance.md) */
#pragma GCC target("tune=generic")
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__)
#define VBYTES 64
#define TI 6 /* 24 accumulators + 7 registers of 32; 6 x 4 was 8% faster than 4 x 6 on Zen 4 */
#define TQ 4
#define ISA_NAME "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#define VBYTES 32
#define TI 3
#define TQ 4
#define ISA_NAME "avx2"
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define VBYTES 16
#define TI 4
#define TQ 6
#define ISA_NAME "neon"
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-schedule-insns") /* see packed_gemm.c: keeps the tile in registers */
#endif
#else
#define VBYTES 16
#define TI 2
#define TQ 3
#define ISA_NAME "generic"
#endif
#define LANES (VBYTES / 4)
_Static_assert(TI <= 6 && TQ <= 6, "tile_at compiles tiles of up to 6 x 6");
#define BLOCK 512
#define MAX_POW 32

typedef float vf __attribute__((vector_size(VBYTES), aligned(VBYTES)));

const char *scpdr_cp_fuse_isa(void) { return ISA_NAME; }
int64_t scpdr_cp_fuse_max_power(void) { return MAX_POW; }

#include "fast_math.h" /* fmx, fmn, vexpf (after the pragmas above, as the kernel) */

/* acc[i][q][lane] += sum_t U[i][t] W[q][t] over the tokens t = lane (mod LANES), t < len (a
   multiple of LANES), for the ti x tq tile at (i0, q0); rows of U and W are BLOCK floats apart.
   Inlined with constant ti <= TI, tq <= TQ (tile_at): the full tile inside the grid, smaller
   ones at its edges, so that no padded power is multiplied (the default lattice's 11 x 33 sums
   padded to 12 x 36 were 19% more multiply-adds). Every sum runs over the tokens in the same
   order whatever the tile: the bits do not depend on the tiling. */
static inline __attribute__((always_inline)) void tile(const float *u, const float *w,
                                                       int64_t len, int64_t i0, int64_t q0,
                                                       int64_t nq_pad, double *acc, const int ti,
                                                       const int tq) {
    vf a[TI][TQ];
    for (int i = 0; i < ti; i++)
        for (int q = 0; q < tq; q++) a[i][q] = (vf){0};
    for (int64_t t = 0; t < len; t += LANES) {
        vf uu[TI];
        for (int i = 0; i < ti; i++) uu[i] = *(const vf *)(u + (i0 + i) * BLOCK + t);
        for (int q = 0; q < tq; q++) {
            const vf ww = *(const vf *)(w + (q0 + q) * BLOCK + t);
            for (int i = 0; i < ti; i++) a[i][q] += uu[i] * ww;
        }
    }
    for (int i = 0; i < ti; i++) /* lane by lane into doubles (vectorized conversions) */
        for (int q = 0; q < tq; q++) {
            double *d = acc + ((i0 + i) * nq_pad + q0 + q) * LANES;
            for (int l = 0; l < LANES; l++) d[l] += (double)a[i][q][l];
        }
}

/* The ti x tq tile, each size (up to 6 x 6, clamped to TI x TQ) compiled on its own. */
#define TILE(I, Q) tile(u, w, len, i0, q0, nq_pad, acc, (I) < TI ? (I) : TI, (Q) < TQ ? (Q) : TQ)
#define TILE_Q(I)                                                                              \
    switch (tq) {                                                                              \
    case 1: TILE(I, 1); return;                                                                \
    case 2: TILE(I, 2); return;                                                                \
    case 3: TILE(I, 3); return;                                                                \
    case 4: TILE(I, 4); return;                                                                \
    case 5: TILE(I, 5); return;                                                                \
    default: TILE(I, 6); return;                                                               \
    }
static void tile_at(const float *u, const float *w, int64_t len, int64_t i0, int64_t q0,
                    int64_t nq_pad, double *acc, int ti, int tq) {
    switch (ti) {
    case 1: TILE_Q(1)
    case 2: TILE_Q(2)
    case 3: TILE_Q(3)
    case 4: TILE_Q(4)
    case 5: TILE_Q(5)
    default: TILE_Q(6)
    }
}

/* The statistics of row `row` (see cp_fuse_stats_f32) with this thread's buffers: u, of
   (ni_pad + nq_pad) x BLOCK floats zeroed once (its padded rows stay 0), and acc. */
static void row_stats(const float *restrict lp, int64_t n, int64_t v, float step, int64_t ni,
                      int64_t nj, double *restrict out, int64_t row, float *u, double *acc) {
    const int64_t ni_pad = (ni + TI - 1) / TI * TI, nq = 3 * nj;
    const int64_t nq_pad = (nq + TQ - 1) / TQ * TQ;
    float *w = u + ni_pad * BLOCK;
    const float *l1 = lp + row * v, *l2 = lp + (n + row) * v;
    memset(acc, 0, sizeof(double) * (size_t)(ni_pad * nq_pad * LANES));
    for (int64_t t0 = 0; t0 < v; t0 += BLOCK) {
        const int64_t len = v - t0 < BLOCK ? v - t0 : BLOCK;
        const int64_t len_pad = (len + LANES - 1) / LANES * LANES;
        float *u1 = u + BLOCK, *w1 = w + BLOCK;
#pragma omp simd
        for (int64_t t = 0; t < len; t++) {
            const float a = l1[t0 + t], b = l2[t0 + t];
            u[t] = 1.0f;
            w[t] = 1.0f;
            w[nj * BLOCK + t] = a;
            w[2 * nj * BLOCK + t] = b;
            if (ni > 1) u1[t] = vexpf(step * a);
            if (nj > 1) w1[t] = vexpf(step * b);
        }
        for (int64_t t = len; t < len_pad; t++) { /* past the row: U = 0 adds nothing */
            u[t] = 0.0f;
            if (ni > 1) u1[t] = 0.0f;
            w[t] = w[nj * BLOCK + t] = w[2 * nj * BLOCK + t] = 0.0f;
            if (nj > 1) w1[t] = 0.0f;
        }
        for (int64_t i = 2; i < ni; i++) {
            const float *prev = u + (i - 1) * BLOCK;
            float *cur = u + i * BLOCK;
#pragma omp simd
            for (int64_t t = 0; t < len_pad; t++) cur[t] = prev[t] * u1[t];
        }
        for (int64_t j = 2; j < nj; j++) {
            const float *prev = w + (j - 1) * BLOCK;
            float *cur = w + j * BLOCK;
#pragma omp simd
            for (int64_t t = 0; t < len_pad; t++) cur[t] = prev[t] * w1[t];
        }
        for (int64_t j = 1; j < nj; j++) {
            const float *wj = w + j * BLOCK;
            float *c1 = w + (nj + j) * BLOCK, *c2 = w + (2 * nj + j) * BLOCK;
            const float *a = w + nj * BLOCK, *b = w + 2 * nj * BLOCK;
#pragma omp simd
            for (int64_t t = 0; t < len_pad; t++) {
                c1[t] = wj[t] * a[t];
                c2[t] = wj[t] * b[t];
            }
        }
        for (int64_t i0 = 0; i0 < ni; i0 += TI)
            for (int64_t q0 = 0; q0 < nq; q0 += TQ)
                tile_at(u, w, len_pad, i0, q0, nq_pad, acc, (int)(ni - i0 < TI ? ni - i0 : TI),
                        (int)(nq - q0 < TQ ? nq - q0 : TQ));
    }
    double *o = out + row * ni * nq;
    for (int64_t i = 0; i < ni; i++)
        for (int64_t q = 0; q < nq; q++) {
            double sum = 0.0;
            for (int l = 0; l < LANES; l++) sum += acc[(i * nq_pad + q) * LANES + l];
            o[i * nq + q] = sum;
        }
}

/* Rows split over threads only where each gets enough work to pay the fork/join (one row of
   V = 49152 takes ~0.6 ms). */
#define PARALLEL_MIN_ELEMENTS ((int64_t)1 << 15)

/* lp: (2, n, v) float32 log-probs; step > 0; ni, nj in 1..MAX_POW (powers 0..ni-1, 0..nj-1);
   out: (n, ni, 3 nj) float64. The rows are split over up to `threads` threads (the OpenMP
   runtime torch uses, when built with -fopenmp); each row is computed by one thread with the
   same code, so the output is the same for any thread count. Returns 0, -1 for bad sizes, -2
   when out of memory. */
int cp_fuse_stats_f32(const float *restrict lp, int64_t n, int64_t v, float step, int64_t ni,
                      int64_t nj, double *restrict out, int64_t threads) {
    if (ni < 1 || nj < 1 || ni > MAX_POW || nj > MAX_POW || v < 1 || !(step > 0.0f)) return -1;
    const int64_t ni_pad = (ni + TI - 1) / TI * TI, nq = 3 * nj;
    const int64_t nq_pad = (nq + TQ - 1) / TQ * TQ;
    const size_t u_floats = (size_t)((ni_pad + nq_pad) * BLOCK);
    const size_t acc_doubles = (size_t)(ni_pad * nq_pad * LANES);
    int64_t nt = 1;
#ifdef _OPENMP
    if (threads > 1 && n > 1 && n * v >= PARALLEL_MIN_ELEMENTS) nt = threads < n ? threads : n;
#else
    (void)threads;
#endif
    float **us = calloc((size_t)nt, sizeof(float *));
    double **accs = calloc((size_t)nt, sizeof(double *));
    int failed = !us || !accs;
    for (int64_t t = 0; !failed && t < nt; t++) {
        us[t] = aligned_alloc(VBYTES, sizeof(float) * u_floats);
        accs[t] = malloc(sizeof(double) * acc_doubles);
        failed = !us[t] || !accs[t];
        if (!failed) memset(us[t], 0, sizeof(float) * u_floats); /* padded rows stay 0 */
    }
    if (!failed) {
#pragma omp parallel for num_threads((int)nt) if (nt > 1) schedule(static)
        for (int64_t row = 0; row < n; row++) {
#ifdef _OPENMP
            const int64_t me = omp_get_thread_num();
#else
            const int64_t me = 0;
#endif
            row_stats(lp, n, v, step, ni, nj, out, row, us[me], accs[me]);
        }
    }
    for (int64_t t = 0; t < nt; t++) {
        if (us) free(us[t]);
        if (accs) free(accs[t]);
    }
    free(us);
    free(accs);
    return failed ? -2 : 0;
}
