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
int scp_delta_r_f32(const float *x, int64_t k, int64_t n, int64_t v, const float *base, int64_t base_rows, int64_t m, float *out, int64_t *kept);
int cp_fuse_stats_f32(const float *lp, int64_t n, int64_t v, float step, int64_t ni, int64_t nj, double *out);
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
    /* SCP-Δr: normalized output, kept tokens distinct; all-equal input keeps ids 0..m-1 */
    int64_t V = 3000, K = 2, N = 2, M = 10;
    float *x = malloc(4 * K * N * V), *b = malloc(4 * N * V), *o = malloc(4 * N * V);
    int64_t kept[2 * 2 * 10];
    for (int64_t i = 0; i < K * N * V; i++) x[i] = 5 * rnd();
    for (int64_t i = 0; i < N * V; i++) b[i] = 5 * rnd();
    bad |= scp_delta_r_f32(x, K, N, V, b, N, M, o, kept) != 0;
    for (int64_t r = 0; r < N; r++) { double z = 0; for (int64_t t = 0; t < V; t++) z += exp(o[r * V + t]); printf("scp row %ld sum p = %.7f\n", (long)r, z); bad |= fabs(z - 1) > 1e-5; }
    memset(x, 0, 4 * K * N * V); memset(b, 0, 4 * N * V);
    scp_delta_r_f32(x, K, 1, 10, b, 1, 4, o, kept);
    printf("ties keep:"); for (int j = 0; j < 4; j++) printf(" %ld", (long)kept[j]); printf("\n");
    for (int j = 0; j < 4; j++) bad |= kept[j] != j;
    /* CP-Fuse statistics against double sums */
    float *lp = malloc(4 * 2 * 700);
    for (int i = 0; i < 1400; i++) lp[i] = -20 * (float)rand() / RAND_MAX;
    double *st = malloc(8 * 11 * 33); bad |= cp_fuse_stats_f32(lp, 1, 700, 0.2f, 11, 11, st) != 0;
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
