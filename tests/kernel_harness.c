/* The C kernels checked on their own, without Python: tests/test_kernel.py builds this with a
   cross compiler (aarch64 NEON) and runs it under qemu-user where both are installed. Prints
   OK and exits 0 when every check passes. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
const char *scpdr_gemm_isa(void);
int64_t scpdr_panel_width(void);
void scpdr_gemm_packed_f32(int64_t m, int64_t n, int64_t k, const float *x, int64_t ldx, const float *w, float *y, int64_t ldy, int accumulate, int64_t threads);
void scpdr_gemm_packed_q4w(int64_t m, int64_t n, int64_t k, const float *x, int64_t ldx, const uint8_t *w, float *y, int64_t ldy, int accumulate, int64_t threads);
int scp_delta_r_f32(const float *x, int64_t k, int64_t n, int64_t v, const float *base, int64_t base_rows, int64_t m, float *out, int64_t *kept, int64_t threads);
int cp_fuse_stats_f32(const float *lp, int64_t n, int64_t v, float step, int64_t ni, int64_t nj, double *out, int64_t threads);
static float rnd(void) { return (float)rand() / RAND_MAX * 2 - 1; }
int main(void) {
    int bad = 0;
    const int64_t NR = scpdr_panel_width();
    printf("isa %s, panel width %ld\n", scpdr_gemm_isa(), (long)NR);
    int64_t shapes[][3] = {{1, 70, 40}, {7, 130, 576}, {24, 65, 300}, {13, 200, 33}, {6, 16, 5}};
    for (int s = 0; s < 5; s++) {
        int64_t m = shapes[s][0], n = shapes[s][1], k = shapes[s][2], p = (n + NR - 1) / NR;
        float *x = malloc(4 * m * k), *w = malloc(4 * n * k), *pk = calloc(p * k * NR, 4), *y = malloc(4 * m * n);
        for (int64_t i = 0; i < m * k; i++) x[i] = rnd();
        for (int64_t i = 0; i < n * k; i++) w[i] = rnd();
        for (int64_t r = 0; r < n; r++) for (int64_t c = 0; c < k; c++) pk[((r / NR) * k + c) * NR + r % NR] = w[r * k + c];
        scpdr_gemm_packed_f32(m, n, k, x, k, pk, y, n, 0, 1);
        double err = 0;
        for (int64_t i = 0; i < m; i++) for (int64_t j = 0; j < n; j++) {
            double acc = 0; for (int64_t c = 0; c < k; c++) acc += (double)x[i * k + c] * w[j * k + c];
            err = fmax(err, fabs(acc - y[i * n + j]));
        }
        printf("gemm %ldx%ldx%ld max err %.2e\n", (long)m, (long)n, (long)k, err);
        bad |= err > 1e-3;
    }
    /* q4 panels (k / 32 blocks of d[NR], m[NR] float32, 16 x NR bytes of two nibbles) equal
       the float32 kernel on their dequantized values, fl(fl(d * q) + m), bit for bit */
    int64_t q4rows[] = {1, 3, 7, 24};
    for (int s = 0; s < 4; s++) {
        int64_t m = q4rows[s], n = 70, k = 160, p = (n + NR - 1) / NR, qb = 24 * NR;
        uint8_t *pq = calloc(p * (k / 32) * qb, 1);
        float *pk = calloc(p * k * NR, 4), *x = malloc(4 * m * k), *y = malloc(4 * m * n), *y2 = malloc(4 * m * n);
        for (int64_t i = 0; i < m * k; i++) x[i] = rnd();
        for (int64_t pp = 0; pp < p; pp++) for (int64_t b = 0; b < k / 32; b++) {
            uint8_t *blk = pq + (pp * (k / 32) + b) * qb;
            float *d = (float *)blk, *mn = d + NR;
            for (int64_t c = 0; c < NR && pp * NR + c < n; c++) { d[c] = 0.05f * (rnd() + 1.01f); mn[c] = -0.4f * (rnd() + 1); }
            for (int64_t j = 0; j < 16; j++) for (int64_t c = 0; c < NR; c++) {
                if (pp * NR + c >= n) continue;
                uint8_t lo = rand() & 15, hi = rand() & 15;
                blk[8 * NR + j * NR + c] = lo | hi << 4;
                for (int h = 0; h < 2; h++) {
                    volatile float prod = d[c] * (float)(h ? hi : lo);
                    pk[(pp * k + b * 32 + 2 * j + h) * NR + c] = prod + mn[c];
                }
            }
        }
        scpdr_gemm_packed_q4w(m, n, k, x, k, pq, y, n, 0, 1);
        scpdr_gemm_packed_f32(m, n, k, x, k, pk, y2, n, 0, 1);
        int same = memcmp(y, y2, 4 * m * n) == 0;
        printf("q4 gemm %ldx%ldx%ld same bits as float32: %d\n", (long)m, (long)n, (long)k, same);
        bad |= !same;
    }
    /* SCP-Δr: normalized output, kept tokens distinct; all-equal input keeps ids 0..m-1 */
    int64_t V = 3000, K = 2, N = 2, M = 10;
    float *x = malloc(4 * K * N * V), *b = malloc(4 * N * V), *o = malloc(4 * N * V);
    int64_t kept[2 * 2 * 10];
    for (int64_t i = 0; i < K * N * V; i++) x[i] = 5 * rnd();
    for (int64_t i = 0; i < N * V; i++) b[i] = 5 * rnd();
    bad |= scp_delta_r_f32(x, K, N, V, b, N, M, o, kept, 2) != 0;
    for (int64_t r = 0; r < N; r++) { double z = 0; for (int64_t t = 0; t < V; t++) z += exp(o[r * V + t]); printf("scp row %ld sum p = %.7f\n", (long)r, z); bad |= fabs(z - 1) > 1e-5; }
    memset(x, 0, 4 * K * N * V); memset(b, 0, 4 * N * V);
    scp_delta_r_f32(x, K, 1, 10, b, 1, 4, o, kept, 1);
    printf("ties keep:"); for (int j = 0; j < 4; j++) printf(" %ld", (long)kept[j]); printf("\n");
    for (int j = 0; j < 4; j++) bad |= kept[j] != j;
    /* CP-Fuse statistics against double sums */
    float *lp = malloc(4 * 2 * 700);
    for (int i = 0; i < 1400; i++) lp[i] = -20 * (float)rand() / RAND_MAX;
    double *st = malloc(8 * 11 * 33); bad |= cp_fuse_stats_f32(lp, 1, 700, 0.2f, 11, 11, st, 1) != 0;
    double rel = 0;
    for (int i = 0; i < 11; i++) for (int q = 0; q < 33; q++) {
        double acc = 0; int j = q % 11;
        for (int t = 0; t < 700; t++) { double v = exp(0.2 * i * lp[t]) * exp(0.2 * j * lp[700 + t]); acc += q < 11 ? v : q < 22 ? v * lp[t] : v * lp[700 + t]; }
        rel = fmax(rel, fabs(st[i * 33 + q] - acc) / fabs(acc));
    }
    printf("cp_fuse stats max rel err %.2e\n", rel); bad |= rel > 1e-5;
    printf(bad ? "FAILED\n" : "OK\n");
    return bad;
}
