/* Fused SCP-Δr (Alg. 1, Def. 2.6 on the smoothed RPDs of §4.1) for float32 rows on CPU.
   Built, measured against torch and loaded by scpdr/kernels/build.py; scpdr.naf.scp_delta_r
   uses it where it is the faster (scpdr.naf.scp_delta_r_torch is the torch implementation).

   Per row: max and sum-exp of each distribution, its exponentials kept (one exponential per
   token and distribution, the base's included), its floored mean and (the base's) floored
   mass from the kept exponentials, the smoothing scores p·d block by block into an L1 buffer
   with a running top-m (sub-blocks that cannot reach the m-th score are not scanned), the
   union U of kept tokens, one output pass. Rows are independent: large batches split them over
   threads (OpenMP, where built with it). The loops are plain C that the compiler
   vectorizes for the target ISA (#pragma omp simd); the blocking (1024 floats, 8 KiB of
   scores per block) fits the L1 cache of every ISA the package targets, so nothing here
   depends on the register file.

   S_m's kept set (§4.1) is the m tokens of largest score, ties broken by the smaller token id
   (the order the insertion buffer keeps: an equal score never displaces an earlier token), as
   in the torch implementation (scpdr.naf.smoothing.top_m_indices).

   The output is normalized in closed form from the base's floored mass and the m·K corrected
   entries, Z = Z_base - sum_U e^yb + sum_U e^(yb+g), unless most of the base's mass lies on U
   and g is very negative there: the difference then cancels (with K = 2, V = 12, m = 11 and
   logits of ±26 it lost every digit), and Z is summed over the output row instead. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define LOG_FLOOR (-20.0f)
#define BLOCK 1024
#define SUB 64
#define MAX_K 16
#define MAX_M 64

#if defined(__AVX512F__)
#define ISA_NAME "avx512"
#elif defined(__AVX2__)
#define ISA_NAME "avx2"
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define ISA_NAME "neon"
#else
#define ISA_NAME "generic"
#endif

const char *scpdr_scp_isa(void) { return ISA_NAME; }
int64_t scpdr_scp_max_k(void) { return MAX_K; }
int64_t scpdr_scp_max_m(void) { return MAX_M; }

#include "fast_math.h" /* fmx, fmn, vexpf */

/* max and log of sum exp(x - max) of a row, in one sweep: per L1-sized block, its max, then
   its sum against the running max (the sum so far rescaled when the max grows). Sums are float
   within a block (<= 64 terms a lane) and double across blocks. Returns log of the sum in
   double; *logs_out is it rounded to float. */
static double max_logsum(const float *x, int64_t v, float *mx_out, float *logs_out) {
    float mx = -INFINITY;
    double s = 0.0;
    for (int64_t t0 = 0; t0 < v; t0 += BLOCK) {
        const int64_t len = v - t0 < BLOCK ? v - t0 : BLOCK;
        const float *xb = x + t0;
        float bm = -INFINITY;
#pragma omp simd reduction(max : bm)
        for (int64_t t = 0; t < len; t++) bm = fmx(bm, xb[t]);
        if (bm > mx) {
            s *= exp((double)mx - (double)bm);
            mx = bm;
        }
        float bs = 0.0f;
#pragma omp simd reduction(+ : bs)
        for (int64_t t = 0; t < len; t++) bs += vexpf(xb[t] - mx);
        s += (double)bs;
    }
    *mx_out = mx;
    *logs_out = (float)log(s);
    return log(s);
}

/* Like max_logsum, with the row's max found first, and e[t] = exp(x[t] - max) stored: the
   probabilities are then e[t] / sum, a function of x[t] alone (exact ties stay ties). */
static double max_logsum_store(const float *x, int64_t v, float *e, float *mx_out,
                               float *logs_out) {
    float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
    for (int64_t t = 0; t < v; t++) mx = fmx(mx, x[t]);
    double s = 0.0;
    for (int64_t t0 = 0; t0 < v; t0 += BLOCK) {
        const int64_t len = v - t0 < BLOCK ? v - t0 : BLOCK;
        float bs = 0.0f;
#pragma omp simd reduction(+ : bs)
        for (int64_t t = t0; t < t0 + len; t++) {
            e[t] = vexpf(x[t] - mx);
            bs += e[t];
        }
        s += (double)bs;
    }
    *mx_out = mx;
    *logs_out = (float)log(s);
    return log(s);
}

/* One row's log-sum-exp as mx + logs, the mean of its floored log-probs y = max(x - mx - logs,
   LOG_FLOOR) and (z_out, may be NULL) the sum of its floored probabilities, sum max(p,
   e^LOG_FLOOR) = sum e^y, from sum p = e^(log s - logs) (the float rounding of logs) and the
   floored tokens' shortfall e^LOG_FLOOR - p, summed in the same sweep as the mean from the
   stored exponentials (p = e[t]·e^-logs: no second exponential per token, no second sweep).
   e: room for the row's exp(x - max) (see max_logsum_store). */
static void row_stats(const float *x, int64_t v, float *e, float *mx_out, float *logs_out,
                      float *mean_out, double *z_out) {
    float mx, logs;
    const double log_s = max_logsum_store(x, v, e, &mx, &logs);
    const float floor_p = vexpf(LOG_FLOOR);
    const float c = (float)exp(-(double)logs); /* e^-logs: p = e[t]·c */
    double acc = 0.0, short_p = 0.0;
    for (int64_t t0 = 0; t0 < v; t0 += BLOCK) {
        const int64_t len = v - t0 < BLOCK ? v - t0 : BLOCK;
        const float *xb = x + t0;
        float ba = 0.0f;
        if (z_out) { /* with e^F - p of the floored tokens, in the same sweep */
            const float *eb = e + t0;
            float bz = 0.0f;
#pragma omp simd reduction(+ : ba, bz)
            for (int64_t t = 0; t < len; t++) {
                const float y = (xb[t] - mx) - logs;
                ba += fmx(y, LOG_FLOOR);
                bz += y < LOG_FLOOR ? floor_p - eb[t] * c : 0.0f;
            }
            short_p += (double)bz;
        } else {
#pragma omp simd reduction(+ : ba)
            for (int64_t t = 0; t < len; t++) ba += fmx((xb[t] - mx) - logs, LOG_FLOOR);
        }
        acc += (double)ba;
    }
    if (z_out) *z_out = exp(log_s - (double)logs) + short_p;
    *mx_out = mx;
    *logs_out = logs;
    *mean_out = (float)(acc / (double)v);
}

/* The m largest scores p·d of one constituent row, ties to the smaller token id, into
   idx[0:m] (by decreasing score). p = max(e[t]·c, e^LOG_FLOOR) with e[t] = exp(x[t] - xm) and
   c = 1 / sum (a function of x[t] alone: exact ties stay ties), d = (y - mi) - (yb - mu_b) with
   y = max((x - xm) - li, LOG_FLOOR) the floored log-probs. */
static void top_m(const float *xi, const float *e, float c, const float *b, int64_t v,
                  int64_t m, float xm, float li, float mi, float mx_b, float ls_b, float mu_b,
                  int64_t *idx) {
    const float floor_p = vexpf(LOG_FLOOR);
    float best[MAX_M];
    int64_t fill = 0;
    for (int64_t t0 = 0; t0 < v; t0 += BLOCK) {
        const int64_t len = v - t0 < BLOCK ? v - t0 : BLOCK;
        const float *xb = xi + t0, *bb = b + t0, *eb = e + t0;
        float sc[BLOCK];
        float smax = -INFINITY;
#pragma omp simd reduction(max : smax)
        for (int64_t t = 0; t < len; t++) {
            const float y = fmx((xb[t] - xm) - li, LOG_FLOOR);
            const float yb = fmx((bb[t] - mx_b) - ls_b, LOG_FLOOR);
            sc[t] = fmx(eb[t] * c, floor_p) * ((y - mi) - (yb - mu_b));
            smax = fmx(smax, sc[t]);
        }
        if (fill == m && !(smax > best[m - 1])) continue; /* nothing to insert */
        for (int64_t s0 = 0; s0 < len; s0 += SUB) { /* only sub-blocks reaching the top m */
            const int64_t sl = len - s0 < SUB ? len - s0 : SUB;
            float cm = -INFINITY;
#pragma omp simd reduction(max : cm)
            for (int64_t t = s0; t < s0 + sl; t++) cm = fmx(cm, sc[t]);
            if (fill == m && !(cm > best[m - 1])) continue;
            for (int64_t t = s0; t < s0 + sl; t++) {
                const float sv = sc[t];
                if (fill == m && !(sv > best[m - 1])) continue; /* a tie keeps the earlier token */
                int64_t j = fill < m ? fill++ : m - 1;
                while (j > 0 && best[j - 1] < sv) { /* after the equal scores already kept */
                    best[j] = best[j - 1];
                    idx[j] = idx[j - 1];
                    j--;
                }
                best[j] = sv;
                idx[j] = t0 + t;
            }
        }
    }
}

typedef struct {
    int64_t token;
    int32_t who; /* the constituent keeping it */
} kept_t;

static int by_token(const void *a, const void *b) {
    const kept_t *p = a, *q = b;
    if (p->token != q->token) return p->token < q->token ? -1 : 1;
    return p->who - q->who;
}

/* Per-thread scratch of one row: the (token, constituent) pairs of the kept sets and then
   the union, the union's corrected entries, and one constituent's exp(x - max). */
typedef struct {
    kept_t *pairs;
    float *ug;
    float *e;
} scratch_t;

/* Row `row` of the output (see scp_delta_r_f32); the base's statistics are passed in when the
   base is constant (base_rows == 1) and computed here otherwise. */
static void one_row(const float *restrict x, int64_t k, int64_t n, int64_t v,
                    const float *restrict base, int64_t base_rows, int64_t m,
                    float *restrict out, int64_t *restrict kept, int64_t row,
                    const scratch_t *sc, float mx_b0, float ls_b0, float mu_b0, double zb0) {
    kept_t *pairs = sc->pairs;
    float *ug = sc->ug, *e = sc->e;
    const float *b = base + (base_rows == 1 ? 0 : row * v);
    float mx_b = mx_b0, ls_b = ls_b0, mu_b = mu_b0;
    double z_base = zb0;
    if (base_rows != 1) row_stats(b, v, e, &mx_b, &ls_b, &mu_b, &z_base);
    float mx[MAX_K], ls[MAX_K], mu[MAX_K], c[MAX_K] = {0.0f}; /* k >= 1: c[0] is set below */
    int64_t idx[MAX_K][MAX_M];
    for (int64_t i = 0; i < k; i++) {
        const float *xi = x + (i * n + row) * v;
        row_stats(xi, v, e, &mx[i], &ls[i], &mu[i], NULL);
        const float c_i = (float)(1.0 / exp((double)ls[i]));
        top_m(xi, e, c_i, b, v, m, mx[i], ls[i], mu[i], mx_b, ls_b, mu_b, idx[i]);
        double dsum = 0.0;
        for (int64_t j = 0; j < m; j++) {
            const int64_t t = idx[i][j];
            const float y = fmx((xi[t] - mx[i]) - ls[i], LOG_FLOOR);
            const float yb = fmx((b[t] - mx_b) - ls_b, LOG_FLOOR);
            dsum += (double)((y - mu[i]) - (yb - mu_b));
            pairs[i * m + j] = (kept_t){t, (int32_t)i};
            if (kept) kept[(i * n + row) * m + j] = t;
        }
        c[i] = (float)(dsum / (double)v);
    }
    float cmax = c[0];
    for (int64_t i = 1; i < k; i++) cmax = fmx(cmax, c[i]);
    /* u = yb (floored base log-probs) off the union U of kept tokens; on U,
       u = yb + g with g = min_i((kept_i ? d_i : 0) - c_i) + max_i c_i. */
    qsort(pairs, (size_t)(k * m), sizeof(kept_t), by_token);
    int64_t nu = 0;
    double z_u_base = 0.0, z_u = 0.0;
    for (int64_t p = 0; p < k * m;) {
        const int64_t t = pairs[p].token;
        const float yb = fmx((b[t] - mx_b) - ls_b, LOG_FLOOR);
        float g = INFINITY;
        uint32_t keeps = 0;
        for (; p < k * m && pairs[p].token == t; p++) {
            const int32_t i = pairs[p].who;
            const float y = fmx((x[(i * n + row) * v + t] - mx[i]) - ls[i], LOG_FLOOR);
            g = fmn(g, ((y - mu[i]) - (yb - mu_b)) - c[i]);
            keeps |= 1u << i;
        }
        for (int64_t i = 0; i < k; i++)
            if (!(keeps & (1u << i))) g = fmn(g, -c[i]);
        g += cmax;
        z_u_base += exp((double)yb);
        z_u += exp((double)yb + (double)g);
        pairs[nu].token = t; /* the union, each token once, written over the pairs read */
        ug[nu++] = yb + g;
    }
    float *o = out + row * v;
    const double z = z_base - z_u_base + z_u;
    if (z > 0.25 * z_base) {
        const float log_z = (float)log(z);
#pragma omp simd
        for (int64_t t = 0; t < v; t++) o[t] = fmx((b[t] - mx_b) - ls_b, LOG_FLOOR) - log_z;
        for (int64_t j = 0; j < nu; j++) o[pairs[j].token] = ug[j] - log_z;
    } else { /* the closed form cancels: normalize by the sum over the output row itself */
#pragma omp simd
        for (int64_t t = 0; t < v; t++) o[t] = fmx((b[t] - mx_b) - ls_b, LOG_FLOOR);
        for (int64_t j = 0; j < nu; j++) o[pairs[j].token] = ug[j];
        float mo, lo;
        max_logsum(o, v, &mo, &lo);
        const float log_z = mo + lo;
#pragma omp simd
        for (int64_t t = 0; t < v; t++) o[t] -= log_z;
    }
}

/* Rows split over threads only where each gets enough work to pay the fork/join (a few
   microseconds; one row of K = 2, V = 49152 takes ~0.4 ms). */
#define PARALLEL_MIN_ELEMENTS ((int64_t)1 << 16)

/* x: (k, n, v); base: (base_rows, v) with base_rows 1 (constant) or n; out: (n, v); kept: NULL
   or (k, n, m) for the kept tokens (by decreasing score). The rows are split over up to
   `threads` threads (the OpenMP runtime torch uses, when built with -fopenmp); each row is
   computed by one thread with the same code, so the output is the same for any thread count.
   Returns 0, or -1 for unsupported sizes (m > MAX_M, k > MAX_K, m >= v) or -2 when out of
   memory. */
int scp_delta_r_f32(const float *restrict x, int64_t k, int64_t n, int64_t v,
                    const float *restrict base, int64_t base_rows, int64_t m,
                    float *restrict out, int64_t *restrict kept, int64_t threads) {
    if (m > MAX_M || k > MAX_K || m < 1 || k < 1 || m >= v) return -1;
    int64_t nt = 1;
#ifdef _OPENMP
    if (threads > 1 && n > 1 && k * n * v >= PARALLEL_MIN_ELEMENTS) nt = threads < n ? threads : n;
#else
    (void)threads;
#endif
    scratch_t *sc = calloc((size_t)nt, sizeof(scratch_t));
    if (!sc) return -2;
    int failed = 0;
    for (int64_t t = 0; t < nt; t++) {
        sc[t].pairs = malloc(sizeof(kept_t) * (size_t)(k * m));
        sc[t].ug = malloc(sizeof(float) * (size_t)(k * m));
        sc[t].e = malloc(sizeof(float) * (size_t)v);
        failed |= !sc[t].pairs || !sc[t].ug || !sc[t].e;
    }
    if (!failed) {
        float mx_b0 = 0.0f, ls_b0 = 0.0f, mu_b0 = 0.0f;
        double zb0 = 0.0;
        if (base_rows == 1) /* once for all rows */
            row_stats(base, v, sc[0].e, &mx_b0, &ls_b0, &mu_b0, &zb0);
#pragma omp parallel for num_threads((int)nt) if (nt > 1) schedule(static)
        for (int64_t row = 0; row < n; row++) {
#ifdef _OPENMP
            const scratch_t *mine = &sc[omp_get_thread_num()];
#else
            const scratch_t *mine = &sc[0];
#endif
            one_row(x, k, n, v, base, base_rows, m, out, kept, row, mine, mx_b0, ls_b0, mu_b0,
                    zb0);
        }
    }
    for (int64_t t = 0; t < nt; t++) {
        free(sc[t].pairs);
        free(sc[t].ug);
        free(sc[t].e);
    }
    free(sc);
    return failed ? -2 : 0;
}
