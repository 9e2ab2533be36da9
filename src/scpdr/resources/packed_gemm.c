/* Float32 matmuls with a few rows on a packed weight layout, for the shared-base LoRA fast path
   (scpdr/lora_fast.py; built and loaded by scpdr/_kernel.py).

   Decoding multiplies a few rows by every weight of the model. torch's sgemm (MKL) handles a
   few rows poorly on CPU (docs/lora_fast_path.md): 1 row streams the weights at ~9 GB/s and 24
   rows reach ~45% of the core's peak. Here a weight W (N, K) of y = x·Wᵀ is stored once as
   panels of NR = 64 output columns, panel p being the (K, NR) block W[p·NR : p·NR + NR, :]ᵀ
   (rows past N are zero), so that a micro-kernel holding an MR x NR tile of y in registers
   (MR = 6 rows: 24 vector accumulators) reads each panel contiguously: one weight stream for up
   to 6 rows, the panel re-read from L2 for the next 6 rows, and the rows' inputs broadcast from
   L1/L2. Rows are processed in chunks whose inputs fit L2; past one chunk the weights of a layer
   are re-read from L3.

   Written with GCC vector extensions (64-byte vectors), so -march=native picks the ISA: one
   AVX-512 register per vector, two AVX2 ones, etc. Built with -fopenmp where the compiler has
   it: the library then needs libgomp.so.1, which resolves to the copy torch already loaded, so
   the panels are split over torch's own thread pool (torch.get_num_threads() threads, passed
   in). Results equal torch's up to the order of the float additions (tested against a torch
   reference on the same layout), the same for any thread count (each output is computed by one
   thread in the same order). */
#include <stddef.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define NR 64
#define MR 6
#define X_CHUNK_BYTES (192 * 1024)

typedef float v16 __attribute__((vector_size(64), aligned(4)));

/* y[0:mr, 0:nvalid] (+)= x[0:mr, 0:k] · panel (k, NR) */
static inline __attribute__((always_inline)) void tile(const int mr, int64_t k, const float *x,
                                                       int64_t ldx, const float *panel, float *y,
                                                       int64_t ldy, int64_t nvalid,
                                                       int accumulate) {
    v16 c[MR][4];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < 4; j++) c[i][j] = (v16){0};
    for (int64_t kk = 0; kk < k; kk++) {
        const v16 *w = (const v16 *)(panel + kk * NR);
        const v16 w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
        for (int i = 0; i < mr; i++) {
            const float s = x[i * ldx + kk];
            c[i][0] += w0 * s;
            c[i][1] += w1 * s;
            c[i][2] += w2 * s;
            c[i][3] += w3 * s;
        }
    }
    for (int i = 0; i < mr; i++) {
        float *yi = y + i * ldy;
        if (nvalid == NR) {
            for (int j = 0; j < 4; j++) {
                v16 *o = (v16 *)(yi + 16 * j);
                *o = accumulate ? *o + c[i][j] : c[i][j];
            }
        } else {
            float t[NR];
            for (int j = 0; j < 4; j++) *(v16 *)(t + 16 * j) = c[i][j];
            for (int64_t n = 0; n < nvalid; n++) yi[n] = accumulate ? yi[n] + t[n] : t[n];
        }
    }
}

static void tile_rows(int64_t mr, int64_t k, const float *x, int64_t ldx, const float *panel,
                      float *y, int64_t ldy, int64_t nvalid, int accumulate) {
    switch (mr) { /* a constant row count per case: the accumulators stay in registers */
    case 6: tile(6, k, x, ldx, panel, y, ldy, nvalid, accumulate); break;
    case 5: tile(5, k, x, ldx, panel, y, ldy, nvalid, accumulate); break;
    case 4: tile(4, k, x, ldx, panel, y, ldy, nvalid, accumulate); break;
    case 3: tile(3, k, x, ldx, panel, y, ldy, nvalid, accumulate); break;
    case 2: tile(2, k, x, ldx, panel, y, ldy, nvalid, accumulate); break;
    case 1: tile(1, k, x, ldx, panel, y, ldy, nvalid, accumulate); break;
    default: break;
    }
}

/* Panels [p0, p1) of y (m, n; row stride ldy) = x (m, k; row stride ldx) · Wᵀ, or += with
   accumulate != 0, where w is W (n, k) packed as (ceil(n / NR), k, NR). */
static void gemm_panels(int64_t m, int64_t n, int64_t k, const float *x, int64_t ldx,
                        const float *w, float *y, int64_t ldy, int accumulate, int64_t p0,
                        int64_t p1) {
    if (k <= 0) { /* an empty sum (rank 0): y = 0, or unchanged when accumulating */
        if (!accumulate)
            for (int64_t i = 0; i < m; i++)
                for (int64_t c = p0 * NR; c < n && c < p1 * NR; c++) y[i * ldy + c] = 0.0f;
        return;
    }
    int64_t chunk = X_CHUNK_BYTES / (k * (int64_t)sizeof(float)) / MR * MR;
    if (chunk < MR) chunk = MR;
    for (int64_t m0 = 0; m0 < m; m0 += chunk) {
        const int64_t mc = m - m0 < chunk ? m - m0 : chunk;
        for (int64_t p = p0; p < p1; p++) {
            const float *panel = w + p * k * NR;
            const int64_t nvalid = n - p * NR < NR ? n - p * NR : NR;
            for (int64_t i = 0; i < mc; i += MR) {
                const int64_t mr = mc - i < MR ? mc - i : MR;
                tile_rows(mr, k, x + (m0 + i) * ldx, ldx, panel, y + (m0 + i) * ldy + p * NR,
                          ldy, nvalid, accumulate);
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
void scpdr_gemm_packed_f32(int64_t m, int64_t n, int64_t k, const float *x, int64_t ldx,
                           const float *w, float *y, int64_t ldy, int accumulate,
                           int64_t threads) {
    const int64_t panels = (n + NR - 1) / NR;
#pragma omp parallel num_threads((int)threads) if (parallel_worth(threads, m, n, k))
    {
        int64_t p0, p1;
        share(panels, &p0, &p1);
        gemm_panels(m, n, k, x, ldx, w, y, ldy, accumulate, p0, p1);
    }
}

/* The stacked LoRA linear of scpdr.lora_fast.StackedLoraLinear: x holds g groups of `rows` rows
   (g·rows, k); y (g·rows, n) = x·Wᵀ, then for the first l groups y_i += (x_i·A_iᵀ)·(s_i·B_i)ᵀ,
   with a = A_iᵀ of rank r packed as (l, ceil(r / NR), k, NR) and b = s_i·B_i packed as
   (l, ceil(n / NR), r, NR); tmp has room for l x rows x ceil(r / NR)·NR floats. One parallel
   region: the base panels and the l products x_i·A_iᵀ, a barrier, then the panels of the
   deltas added to y. */
void scpdr_lora_linear_f32(int64_t g, int64_t rows, int64_t n, int64_t k, const float *x,
                           const float *w, int64_t l, int64_t r, const float *a, const float *b,
                           float *tmp, float *y, int64_t threads) {
    const int64_t rp = (r + NR - 1) / NR * NR;
    const int64_t np = (n + NR - 1) / NR * NR;
    const int64_t panels = np / NR;
    if (l > g) l = g;
#pragma omp parallel num_threads((int)threads) if (parallel_worth(threads, g * rows, n, k))
    {
        int64_t p0, p1;
        share(panels, &p0, &p1);
        gemm_panels(g * rows, n, k, x, k, w, y, n, 0, p0, p1);
        int64_t i0, i1;
        share(l, &i0, &i1);
        for (int64_t i = i0; i < i1; i++)
            gemm_panels(rows, rp, k, x + i * rows * k, k, a + i * rp * k, tmp + i * rows * rp, rp,
                        0, 0, rp / NR);
#pragma omp barrier
        for (int64_t i = 0; i < l; i++)
            gemm_panels(rows, n, r, tmp + i * rows * rp, rp, b + i * np * r, y + i * rows * n, n,
                        1, p0, p1);
    }
}
