/* Float32 matmuls with a few rows on a packed weight layout, for the shared-base LoRA fast path
   (scpdr/lora/layers.py; built, measured against torch and loaded by scpdr/kernels/build.py).

   Decoding multiplies a few rows by every weight of the model. torch's sgemm (MKL) handles a
   few rows poorly on CPU (docs/lora_fast_path.md): 1 row streams the weights at ~9 GB/s and 24
   rows reach ~45% of the core's peak. Here a weight W (N, K) of y = x·Wᵀ is stored once as
   panels of NR output columns, panel p being the (K, NR) block W[p·NR : p·NR + NR, :]ᵀ (rows
   past N are zero), so that a micro-kernel holding an MR x NR tile of y in registers reads each
   panel contiguously: one weight stream for up to MR rows, the panel re-read from L1/L2 for the
   next MR rows, and the rows' inputs broadcast from L1/L2; while the later tiles of a panel
   compute, they prefetch the next panel into L2 (where measured faster: scpdr_gemm_set_prefetch).
   Rows are processed in chunks whose inputs fit L2; past one chunk the weights of a layer are
   re-read from L3.

   The tile is chosen at build time from the compiler's predefined macros so that its MR x NV
   accumulators (NV vectors of the ISA's width per row, NR = NV x lanes) plus NV weight vectors
   and one broadcast fit the register file:
     AVX-512F       32 x 512-bit: MR 12, NR 32 (24 accumulators + 2 weights + 1 broadcast)
     AVX2 + FMA     16 x 256-bit: MR 4,  NR 24 (12 accumulators + 3 weights + 1 broadcast)
     aarch64 NEON   32 x 128-bit: MR 6,  NR 16 (24 accumulators + 4 weights + 1 broadcast)
   (AVX-512 and AVX2 tiles measured against the alternatives on the embedded model's shapes at
   1, 3, 8 and 24 rows, docs/performance.md; the NEON tile is only checked to compile to a loop
   without spills, with GCC 12's aarch64 cross compiler).
   Anything else builds a generic variant that scpdr_gemm_isa() names "generic": the Python
   side does not use it (torch's matmuls instead). A 6 x 64 tile on AVX2 would need 48
   accumulators for 16 registers and spill: 5-7x slower than torch.

   Written with GCC vector extensions. Built with -fopenmp where the compiler has it: the
   library then needs libgomp.so.1, which resolves to the copy torch already loaded, so the
   panels are split over torch's own thread pool (torch.get_num_threads() threads, passed in).
   Results equal torch's up to the order of the float additions (tested against a torch
   reference on the same layout), the same for any thread count (each output is computed by one
   thread in the same order). */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__)
#define VBYTES 64
#define NV 2
#define MR 12
#define ISA_NAME "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#define VBYTES 32
#define NV 3
#define MR 4
#define ISA_NAME "avx2"
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define VBYTES 16
#define NV 4
#define MR 6
#define ISA_NAME "neon"
#if defined(__GNUC__) && !defined(__clang__)
/* GCC's pre-allocation scheduler hoists the row broadcasts and then spills accumulators (24
   fmla with ~14 stack accesses per step in GCC 12); without it the loop keeps all in registers */
#pragma GCC optimize("no-schedule-insns")
#endif
#else
#define VBYTES 16
#define NV 2
#define MR 4
#define ISA_NAME "generic"
#endif
#ifdef SCPDR_TILE_MR /* other tiles, for benchmarks/bench_kernels.py to time */
#undef MR
#define MR SCPDR_TILE_MR
#endif
#ifdef SCPDR_TILE_NV
#undef NV
#define NV SCPDR_TILE_NV
#endif
#ifndef MR_BF16 /* the tile's rows with bf16 weights (their widening needs registers too) */
#if MR > 3 && VBYTES == 32
#define MR_BF16 3
#else
#define MR_BF16 MR
#endif
#endif
#define LANES (VBYTES / 4)
#define NR (NV * LANES)
#define X_CHUNK_BYTES (192 * 1024)

typedef float vf __attribute__((vector_size(VBYTES), aligned(4)));

/* Whether the tiles after a panel's first prefetch the next panel (gemm_panels): on, unless
   scpdr_gemm_set_prefetch(0) (the Python side measures both and keeps the faster). */
static int prefetch_next = 1; /* read by every thread of a call: atomic loads and stores */
void scpdr_gemm_set_prefetch(int on) {
    __atomic_store_n(&prefetch_next, on != 0, __ATOMIC_RELAXED);
}
int scpdr_gemm_prefetch(void) { return __atomic_load_n(&prefetch_next, __ATOMIC_RELAXED); }
/* read, into L2. With two tiles a panel a step is NR floats (96 or 128 bytes): every other
   64-byte line is asked for, the rest left to the L2's adjacent-line and stream prefetchers
   (two prefetches a step could not be told apart from one on the noisy host that measured it) */
#define PREFETCH(a) __builtin_prefetch((a), 0, 2)

/* What this build is: the ISA its tile is for, and the tile (the Python side packs panels of
   scpdr_panel_width() columns). */
const char *scpdr_gemm_isa(void) { return ISA_NAME; }
int64_t scpdr_panel_width(void) { return NR; }
int64_t scpdr_tile_rows(void) { return MR; }

/* Weights are float32, or bfloat16 (the upper 16 bits of a float32; the rows, the products and
   the sums stay float32). A bf16 panel pairs the weights of two consecutive inputs k, k + 1 of
   each column in one 32-bit word (layout (ceil(K / 2), NR, 2), the last pair zero-padded for an
   odd K), so that one vector load yields two float32 weight vectors exactly, by a shift (input
   k: the low half) and two (input k + 1: the high half; no mask constant, which would take a
   register) — no cross-lane conversion; the
   weight stream is half the float32 one. `wt` is a compile-time constant in every call of
   tile() (inlined per case), so each variant's loop has no branch. */
typedef uint32_t vu __attribute__((vector_size(VBYTES), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VBYTES), aligned(4)));
typedef uint8_t vb __attribute__((vector_size(LANES), aligned(1)));

#define W_F32 0
#define W_BF16 1
#define W_Q4 2
/* Rows of a q4 tile that rebuilds the weights in registers (more rows: gemm_panels_q4_sliced) */
#define Q4_MR (MR < 3 ? MR : 3)
#include "q4_panels.h"

/* y[0:mr, 0:nvalid] (+)= x[0:mr, 0:k] · panel (k, NR). A sum over k in parts (q4 panels
   dequantized a slice of inputs at a time): the accumulators start from `init` (mr x NR, the
   previous slices' sums) and, unless this is the last slice, are stored to `save` instead of
   y — exact float32 stores and loads, so the sums are those of one pass. */
static inline __attribute__((always_inline)) void tile(const int mr, int64_t k, const float *x,
                                                       int64_t ldx, const void *panel, float *y,
                                                       int64_t ldy, int64_t nvalid,
                                                       int accumulate, const int wt,
                                                       const char *pf, int64_t pf_step,
                                                       const float *init, float *save) {
    vf c[MR][NV];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NV; j++)
            c[i][j] = init && i < mr ? *(const vf *)(init + i * NR + LANES * j) : (vf){0};
    if (wt == W_Q4) { /* one block of 32 inputs at a time; input 2j, then 2j + 1 */
        const char *blk = (const char *)panel;
        for (int64_t kb = 0; kb < k; kb += 32, blk += QBLOCK) {
            const float *d = (const float *)blk, *m = d + NR;
            const uint8_t *q = (const uint8_t *)(m + NR);
            for (int jj = 0; jj < 16; jj++, q += NR) {
                vf wv[NV];
                for (int hi = 0; hi < 2; hi++) {
                    q4_weights(d, m, q, hi, wv);
                    for (int i = 0; i < mr; i++) {
                        const float s = x[i * ldx + kb + 2 * jj + hi];
                        for (int j = 0; j < NV; j++) c[i][j] += wv[j] * s;
                    }
                }
            }
        }
    } else if (wt == W_BF16) {
        const vu *w = (const vu *)panel;
        int64_t kk = 0;
        for (; kk + 1 < k; kk += 2, w += NV) {
            if (pf) PREFETCH(pf + (kk >> 1) * pf_step);
            /* input k, then input k + 1 from the same words (re-read from L1): NV weight
               registers at a time, as in the float32 loop (AVX2 has 16 in all) */
            vf wv[NV];
            for (int j = 0; j < NV; j++) wv[j] = (vf)(w[j] << 16);
            for (int i = 0; i < mr; i++) {
                const float s = x[i * ldx + kk];
                for (int j = 0; j < NV; j++) c[i][j] += wv[j] * s;
            }
            for (int j = 0; j < NV; j++) wv[j] = (vf)((w[j] >> 16) << 16);
            for (int i = 0; i < mr; i++) {
                const float s = x[i * ldx + kk + 1];
                for (int j = 0; j < NV; j++) c[i][j] += wv[j] * s;
            }
        }
        if (kk < k) { /* odd K: the last input, whose pair is padding */
            vf w0[NV];
            for (int j = 0; j < NV; j++) w0[j] = (vf)(w[j] << 16);
            for (int i = 0; i < mr; i++) {
                const float s0 = x[i * ldx + kk];
                for (int j = 0; j < NV; j++) c[i][j] += w0[j] * s0;
            }
        }
    } else {
        for (int64_t kk = 0; kk < k; kk++) {
            if (pf) PREFETCH(pf + kk * pf_step);
            const vf *w = (const vf *)((const float *)panel + kk * NR);
            vf wv[NV];
            for (int j = 0; j < NV; j++) wv[j] = w[j];
            for (int i = 0; i < mr; i++) {
                const float s = x[i * ldx + kk];
                for (int j = 0; j < NV; j++) c[i][j] += wv[j] * s;
            }
        }
    }
    if (save) {
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < NV; j++) *(vf *)(save + i * NR + LANES * j) = c[i][j];
        return;
    }
    for (int i = 0; i < mr; i++) {
        float *yi = y + i * ldy;
        if (nvalid == NR) {
            for (int j = 0; j < NV; j++) {
                vf *o = (vf *)(yi + LANES * j);
                *o = accumulate ? *o + c[i][j] : c[i][j];
            }
        } else {
            float t[NR];
            for (int j = 0; j < NV; j++) *(vf *)(t + LANES * j) = c[i][j];
            for (int64_t n = 0; n < nvalid; n++) yi[n] = accumulate ? yi[n] + t[n] : t[n];
        }
    }
}

static void tile_rows(int64_t mr, int64_t k, const float *x, int64_t ldx, const void *panel,
                      float *y, int64_t ldy, int64_t nvalid, int accumulate, int wt,
                      const char *pf, int64_t pf_step) {
#define TILE(R)                                                                                \
    case R:                                                                                    \
        if (R <= Q4_MR && wt == W_Q4)                                                          \
            tile(R, k, x, ldx, panel, y, ldy, nvalid, accumulate, W_Q4, NULL, 0, NULL, NULL);  \
        else if (wt == W_BF16 && pf)                                                           \
            tile(R, k, x, ldx, panel, y, ldy, nvalid, accumulate, W_BF16, pf, pf_step, NULL,   \
                 NULL);                                                                        \
        else if (wt == W_BF16)                                                                 \
            tile(R, k, x, ldx, panel, y, ldy, nvalid, accumulate, W_BF16, NULL, 0, NULL, NULL);\
        else if (pf)                                                                           \
            tile(R, k, x, ldx, panel, y, ldy, nvalid, accumulate, 0, pf, pf_step, NULL, NULL); \
        else                                                                                   \
            tile(R, k, x, ldx, panel, y, ldy, nvalid, accumulate, 0, NULL, 0, NULL, NULL);     \
        break;
    switch (mr) {
#include "tile_cases.h"
    default: break;
    }
#undef TILE
}

/* tile_rows on a float32 panel for a sum over k in parts (init, save: tile()). Its own
   function: as a sixth variant in tile_rows it made the float32 tiles there 6-8% slower at 24
   and 60 rows (AVX-512 build, Intel Xeon). */
static void tile_rows_part(int64_t mr, int64_t k, const float *x, int64_t ldx, const float *panel,
                           float *y, int64_t ldy, int64_t nvalid, int accumulate,
                           const float *init, float *save) {
#define TILE(R)                                                                                \
    case R:                                                                                    \
        tile(R, k, x, ldx, panel, y, ldy, nvalid, accumulate, W_F32, NULL, 0, init, save);     \
        break;
    switch (mr) {
#include "tile_cases.h"
    default: break;
    }
#undef TILE
}

/* gemm_panels for q4 panels and more rows than one in-register tile: for each panel, each
   slice of Q4_SLICE inputs is dequantized once into buf and every float32 tile of the row chunk
   adds it to its partial sums (kept in buf after the slice; the last slice writes y). The sums
   are those of one pass over k in order. Returns 0 (nothing done) without a buffer. */
static int gemm_panels_q4_sliced(int64_t m, int64_t n, int64_t k, const float *x, int64_t ldx,
                                 const void *w, float *y, int64_t ldy, int accumulate,
                                 int64_t p0, int64_t p1) {
    int64_t chunk = X_CHUNK_BYTES / (k * (int64_t)sizeof(float)) / MR * MR;
    if (chunk < MR) chunk = MR;
    const int64_t rows = m < chunk ? m : chunk;
    float *dq = q4_buffer(Q4_SLICE * NR + rows * NR);
    if (dq == NULL) return 0;
    float *part = dq + Q4_SLICE * NR;
    const int64_t panel_bytes = k / 32 * QBLOCK;
    for (int64_t m0 = 0; m0 < m; m0 += chunk) {
        const int64_t mc = m - m0 < chunk ? m - m0 : chunk;
        const int64_t tiles = (mc + MR - 1) / MR;
        for (int64_t p = p0; p < p1; p++) {
            const char *panel = (const char *)w + p * panel_bytes;
            const int64_t nvalid = n - p * NR < NR ? n - p * NR : NR;
            for (int64_t k0 = 0; k0 < k; k0 += Q4_SLICE) {
                const int64_t kc = k - k0 < Q4_SLICE ? k - k0 : Q4_SLICE;
                q4_dequantize(kc, panel + k0 / 32 * QBLOCK, dq);
                for (int64_t t = 0; t < tiles; t++) {
                    const int64_t i = mc * t / tiles, mr = mc * (t + 1) / tiles - i;
                    tile_rows_part(mr, kc, x + (m0 + i) * ldx + k0, ldx, dq,
                                   y + (m0 + i) * ldy + p * NR, ldy, nvalid, accumulate,
                                   k0 ? part + i * NR : NULL, k0 + kc < k ? part + i * NR : NULL);
                }
            }
        }
    }
    return 1;
}

/* Panels [p0, p1) of y (m, n; row stride ldy) = x (m, k; row stride ldx) · Wᵀ, or += with
   accumulate != 0, where w is W (n, k) packed as (ceil(n / NR), k, NR), float32 elements
   (wt W_F32), bfloat16 ones (W_BF16) or q4 blocks (W_Q4, k a multiple of 32). */
static void gemm_panels(int64_t m, int64_t n, int64_t k, const float *x, int64_t ldx,
                        const void *w, float *y, int64_t ldy, int accumulate, int64_t p0,
                        int64_t p1, int wt) {
    if (k <= 0) { /* an empty sum (rank 0): y = 0, or unchanged when accumulating */
        if (!accumulate)
            for (int64_t i = 0; i < m; i++)
                for (int64_t c = p0 * NR; c < n && c < p1 * NR; c++) y[i * ldy + c] = 0.0f;
        return;
    }
    /* q4 weights: up to Q4_MR rows in one tile that rebuilds the weights in registers, more
       rows in float32 tiles over slices dequantized once */
    if (wt == W_Q4 && m > Q4_MR &&
        gemm_panels_q4_sliced(m, n, k, x, ldx, w, y, ldy, accumulate, p0, p1))
        return;
    /* bytes of a panel: k x NR floats, ceil(k / 2) x NR pairs of bf16, or k / 32 q4 blocks */
    const int64_t panel_bytes = wt == W_Q4    ? k / 32 * QBLOCK
                                : wt == W_BF16 ? (k + 1) / 2 * NR * 4
                                               : k * NR * 4;
    const int64_t tr = wt == W_F32 ? MR : wt == W_BF16 ? MR_BF16 : Q4_MR; /* rows per tile */
    const int prefetch = scpdr_gemm_prefetch();
    int64_t chunk = X_CHUNK_BYTES / (k * (int64_t)sizeof(float)) / tr * tr;
    if (chunk < tr) chunk = tr;
    for (int64_t m0 = 0; m0 < m; m0 += chunk) {
        const int64_t mc = m - m0 < chunk ? m - m0 : chunk;
        for (int64_t p = p0; p < p1; p++) {
            const void *panel = (const char *)w + p * panel_bytes;
            const int64_t nvalid = n - p * NR < NR ? n - p * NR : NR;
            /* ceil(mc / MR) tiles of balanced heights (8 rows: 4 + 4, not 6 + 2: a short tile
               has too few independent accumulators to hide the FMA latency) */
            const int64_t tiles = (mc + tr - 1) / tr;
            const int64_t iters = wt == W_BF16 ? k / 2 : k; /* tile()'s loop steps over the panel */
            for (int64_t t = 0; t < tiles; t++) {
                const int64_t i = mc * t / tiles, mr = mc * (t + 1) / tiles - i;
                /* The first tile streams the panel from memory; the others re-read it from
                   L1/L2 and are compute-bound: they prefetch the next panel into L2, a share
                   each, so that the next first tile finds it there (AVX2 build at 24 rows on
                   an Intel Xeon: 14.3-14.8 -> 10.9-11.7 ms for a layer's linears x 4) */
                const char *pf = NULL;
                int64_t pf_step = 0;
                if (prefetch && wt != W_Q4 && t >= 1 && p + 1 < p1 && iters > 0) {
                    const int64_t part = (panel_bytes + tiles - 2) / (tiles - 1);
                    pf = (const char *)panel + panel_bytes + (t - 1) * part;
                    pf_step = (part + iters - 1) / iters;
                }
                tile_rows(mr, k, x + (m0 + i) * ldx, ldx, panel, y + (m0 + i) * ldy + p * NR,
                          ldy, nvalid, accumulate, wt, pf, pf_step);
            }
        }
    }
}

/* This thread's share [*p0, *p1) of `panels` panels (all of them outside a parallel region). */
static void share(int64_t panels, int64_t *p0, int64_t *p1) {
#ifdef _OPENMP
    const int64_t t = omp_get_num_threads(), i = omp_get_thread_num();
    *p0 = panels * i / t;
    *p1 = panels * (i + 1) / t;
#else
    *p0 = 0;
    *p1 = panels;
#endif
}

/* Whether a matmul is worth a parallel region (fork/join costs a few microseconds). */
static int parallel_worth(int64_t threads, int64_t m, int64_t n, int64_t k) {
    return threads > 1 && n >= 2 * NR && m * n * k >= ((int64_t)1 << 18);
}

/* y (m, n; row stride ldy) = x (m, k; row stride ldx) · Wᵀ, or += with accumulate != 0, where
   w is W (n, k) packed as (ceil(n / NR), k, NR); the panels split over `threads` threads (the
   OpenMP runtime torch uses, when built with it). */
static void gemm_packed(int64_t m, int64_t n, int64_t k, const float *x, int64_t ldx,
                        const void *w, float *y, int64_t ldy, int accumulate, int64_t threads,
                        int wt) {
    const int64_t panels = (n + NR - 1) / NR;
#pragma omp parallel num_threads((int)threads) if (parallel_worth(threads, m, n, k))
    {
        int64_t p0, p1;
        share(panels, &p0, &p1);
        gemm_panels(m, n, k, x, ldx, w, y, ldy, accumulate, p0, p1, wt);
    }
}

void scpdr_gemm_packed_f32(int64_t m, int64_t n, int64_t k, const float *x, int64_t ldx,
                           const float *w, float *y, int64_t ldy, int accumulate,
                           int64_t threads) {
    gemm_packed(m, n, k, x, ldx, w, y, ldy, accumulate, threads, 0);
}

/* The same with W's panels in bfloat16 (uint16 bit patterns). */
void scpdr_gemm_packed_bf16w(int64_t m, int64_t n, int64_t k, const float *x, int64_t ldx,
                             const uint16_t *w, float *y, int64_t ldy, int accumulate,
                             int64_t threads) {
    gemm_packed(m, n, k, x, ldx, w, y, ldy, accumulate, threads, W_BF16);
}

/* The same with W's panels in q4 blocks (k a multiple of 32). */
void scpdr_gemm_packed_q4w(int64_t m, int64_t n, int64_t k, const float *x, int64_t ldx,
                           const uint8_t *w, float *y, int64_t ldy, int accumulate,
                           int64_t threads) {
    gemm_packed(m, n, k, x, ldx, w, y, ldy, accumulate, threads, W_Q4);
}

/* The stacked LoRA linear of scpdr.lora.StackedLoraLinear: x holds g groups of `rows` rows
   (g·rows, k); y (g·rows, n) = x·Wᵀ, then for the first l groups y_i += (x_i·A_iᵀ)·(s_i·B_i)ᵀ,
   with a = A_iᵀ of rank r packed as (l, ceil(r / NR), k, NR) and b = s_i·B_i packed as
   (l, ceil(n / NR), r, NR); tmp has room for l x rows x ceil(r / NR)·NR floats. One parallel
   region: the base panels and the l products x_i·A_iᵀ, a barrier, then the panels of the
   deltas added to y. W's panels are float32, bfloat16 or q4 blocks (wt); a and b are float32. */
static void lora_linear(int64_t g, int64_t rows, int64_t n, int64_t k, const float *x,
                        const void *w, int64_t l, int64_t r, const float *a, const float *b,
                        float *tmp, float *y, int64_t threads, int wt) {
    const int64_t rp = (r + NR - 1) / NR * NR;
    const int64_t np = (n + NR - 1) / NR * NR;
    const int64_t panels = np / NR;
    if (l > g) l = g;
#pragma omp parallel num_threads((int)threads) if (parallel_worth(threads, g * rows, n, k))
    {
        int64_t p0, p1;
        share(panels, &p0, &p1);
        gemm_panels(g * rows, n, k, x, k, w, y, n, 0, p0, p1, wt);
        int64_t i0, i1;
        share(l, &i0, &i1);
        for (int64_t i = i0; i < i1; i++)
            gemm_panels(rows, rp, k, x + i * rows * k, k, a + i * rp * k, tmp + i * rows * rp, rp,
                        0, 0, rp / NR, 0);
#pragma omp barrier
        for (int64_t i = 0; i < l; i++)
            gemm_panels(rows, n, r, tmp + i * rows * rp, rp, b + i * np * r, y + i * rows * n, n,
                        1, p0, p1, 0);
    }
}

void scpdr_lora_linear_f32(int64_t g, int64_t rows, int64_t n, int64_t k, const float *x,
                           const float *w, int64_t l, int64_t r, const float *a, const float *b,
                           float *tmp, float *y, int64_t threads) {
    lora_linear(g, rows, n, k, x, w, l, r, a, b, tmp, y, threads, 0);
}

/* The same with W's panels in bfloat16 (uint16 bit patterns). */
void scpdr_lora_linear_bf16w(int64_t g, int64_t rows, int64_t n, int64_t k, const float *x,
                             const uint16_t *w, int64_t l, int64_t r, const float *a,
                             const float *b, float *tmp, float *y, int64_t threads) {
    lora_linear(g, rows, n, k, x, w, l, r, a, b, tmp, y, threads, W_BF16);
}

/* The same with W's panels in q4 blocks (k a multiple of 32). */
void scpdr_lora_linear_q4w(int64_t g, int64_t rows, int64_t n, int64_t k, const float *x,
                           const uint8_t *w, int64_t l, int64_t r, const float *a,
                           const float *b, float *tmp, float *y, int64_t threads) {
    lora_linear(g, rows, n, k, x, w, l, r, a, b, tmp, y, threads, W_Q4);
}
