/* Fused SCP-Δr (Alg. 1, Def. 2.6 on the smoothed RPDs of §4.1) for float32 rows on CPU.
   Built and loaded by scpdr/_kernel.py; scpdr.naf.scp_delta_r uses it when it builds, and the
   tests compare it with the torch implementation (scpdr.naf._scp_delta_r). */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#define LOG_FLOOR (-20.0f)
#define BLOCK 1024

/* max/min as comparisons: fmaxf/fminf are library calls (NaN rules) and block vectorization */
static inline float fmx(float a, float b) { return a > b ? a : b; }
static inline float fmn(float a, float b) { return a < b ? a : b; }

static inline float vexpf(float x) {
    /* Cephes-style expf, vectorizable (no calls), ~1-2 ulp on [-87.3, 88.3]; clamps outside. */
    x = fmn(fmx(x, -87.3f), 88.3f);
    /* round to nearest with the 1.5 * 2^23 trick (|x log2 e| < 2^22) */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500E-4f;
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } u;
    u.i = ((int32_t)n + 127) << 23;
    return p * u.f;
}

/* One row's log-sum-exp as mx + logs, the mean of its floored log-probs max(x - lse, LOG_FLOOR)
   and (z_out, may be NULL) the sum of its floored probabilities max(p, e^LOG_FLOOR) (>= 1). */
static void row_stats(const float *x, int64_t v, float *mx_out, float *logs_out, float *mean_out,
                      double *z_out) {
    /* max and sum of exp(x - max) in one sweep: per L1-sized block, its max, then its sum
       against the running max (the sum so far rescaled when the max grows) */
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
        float bs = 0.0f; /* float within a block (<= 64 terms a lane), double across blocks */
#pragma omp simd reduction(+ : bs)
        for (int64_t t = 0; t < len; t++) bs += vexpf(xb[t] - mx);
        s += (double)bs;
    }
    float logs = (float)log(s);
    double acc = 0.0, z = 0.0;
    for (int64_t t0 = 0; t0 < v; t0 += BLOCK) {
        const int64_t len = v - t0 < BLOCK ? v - t0 : BLOCK;
        const float *xb = x + t0;
        float ba = 0.0f, bz = 0.0f;
        if (z_out) {
#pragma omp simd reduction(+ : ba, bz)
            for (int64_t t = 0; t < len; t++) {
                float y = fmx((xb[t] - mx) - logs, LOG_FLOOR);
                ba += y;
                bz += vexpf(y);
            }
        } else {
#pragma omp simd reduction(+ : ba)
            for (int64_t t = 0; t < len; t++) ba += fmx((xb[t] - mx) - logs, LOG_FLOOR);
        }
        acc += (double)ba;
        z += (double)bz;
    }
    if (z_out) *z_out = z;
    *mx_out = mx;
    *logs_out = logs;
    *mean_out = (float)(acc / (double)v);
}

/* x: (k, n, v); base: (base_rows, v) with base_rows 1 (constant) or n; out: (n, v).
   Returns 0, or -1 for unsupported sizes (m > 64, k > 16). */
int scp_delta_r_f32(const float *restrict x, int64_t k, int64_t n, int64_t v, const float *restrict base,
                    int64_t base_rows, int64_t m, float *restrict out) {
    if (m > 64 || k > 16 || m < 1 || k < 1) return -1;
    float mx_b0 = 0.0f, ls_b0 = 0.0f, mu_b0 = 0.0f;
    double zd0 = 0.0;
    if (base_rows == 1) row_stats(base, v, &mx_b0, &ls_b0, &mu_b0, &zd0); /* once for all rows */
    for (int64_t row = 0; row < n; row++) {
        const float *b = base + (base_rows == 1 ? 0 : row * v);
        float mx_b = mx_b0, ls_b = ls_b0, mu_b = mu_b0;
        double zd = zd0;
        if (base_rows != 1) row_stats(b, v, &mx_b, &ls_b, &mu_b, &zd);
        float mx[16], ls[16], mu[16], c[16];
        int64_t idx[16][64];
        for (int64_t i = 0; i < k; i++) {
            const float *xi = x + (i * n + row) * v;
            row_stats(xi, v, &mx[i], &ls[i], &mu[i], NULL);
            const float xm = mx[i], li = ls[i], mi = mu[i];
            /* scores p(y) * d(y) in L1-sized blocks, each scanned for the top m (a descending
               insertion buffer whose last entry is the threshold) */
            float best[64];
            int64_t fill = 0;
            for (int64_t t0 = 0; t0 < v; t0 += BLOCK) {
                const int64_t len = v - t0 < BLOCK ? v - t0 : BLOCK;
                const float *xb = xi + t0, *bb = b + t0;
                float sc[BLOCK], ds[BLOCK];
                float ymax = -INFINITY, dmax = -INFINITY;
#pragma omp simd reduction(max : ymax, dmax)
                for (int64_t t = 0; t < len; t++) {
                    float y = fmx((xb[t] - xm) - li, LOG_FLOOR);
                    float yb = fmx((bb[t] - mx_b) - ls_b, LOG_FLOOR);
                    float d = (y - mi) - (yb - mu_b);
                    sc[t] = y;
                    ds[t] = d;
                    ymax = fmx(ymax, y);
                    dmax = fmx(dmax, d);
                }
                if (fill == m) { /* skip a block none of whose scores p*d can enter the top m */
                    float bound = dmax > 0.0f ? vexpf(ymax) * dmax * 1.0001f : dmax * 2.0e-9f;
                    if (!(bound > best[m - 1])) continue;
                }
                float smax = -INFINITY;
#pragma omp simd reduction(max : smax)
                for (int64_t t = 0; t < len; t++) {
                    sc[t] = vexpf(sc[t]) * ds[t];
                    smax = fmx(smax, sc[t]);
                }
                if (fill == m && !(smax > best[m - 1])) continue; /* nothing to insert */
                for (int64_t t = 0; t < len; t++) {
                    float sv = sc[t];
                    if (fill == m && !(sv > best[m - 1])) continue;
                    int64_t j = fill < m ? fill++ : m - 1;
                    while (j > 0 && best[j - 1] < sv) {
                        best[j] = best[j - 1];
                        idx[i][j] = idx[i][j - 1];
                        j--;
                    }
                    best[j] = sv;
                    idx[i][j] = t0 + t;
                }
            }
            float dsum = 0.0f;
            for (int64_t j = 0; j < m; j++) {
                int64_t t = idx[i][j];
                float y = fmx((xi[t] - xm) - li, LOG_FLOOR);
                float yb = fmx((b[t] - mx_b) - ls_b, LOG_FLOOR);
                dsum += (y - mi) - (yb - mu_b);
            }
            c[i] = dsum / (float)v;
        }
        float cmax = c[0];
        for (int64_t i = 1; i < k; i++) cmax = fmx(cmax, c[i]);
        /* u = yb (floored base log-probs) off the union U of kept tokens; on U,
           u = yb + g with g = min_i((kept_i ? d_i : 0) - c_i) + max_i c_i. */
        float *o = out + row * v;
        int64_t nu = 0, ut[16 * 64];
        float ug[16 * 64];
        for (int64_t i = 0; i < k; i++) {
            for (int64_t j = 0; j < m; j++) {
                int64_t t = idx[i][j];
                int dup = 0; /* each token of U once */
                for (int64_t i2 = 0; i2 <= i && !dup; i2++)
                    for (int64_t j2 = 0; j2 < (i2 == i ? j : m); j2++)
                        if (idx[i2][j2] == t) { dup = 1; break; }
                if (dup) continue;
                float yb = fmx((b[t] - mx_b) - ls_b, LOG_FLOOR);
                float g = INFINITY;
                for (int64_t i3 = 0; i3 < k; i3++) {
                    int kept = 0;
                    for (int64_t j3 = 0; j3 < m; j3++) if (idx[i3][j3] == t) { kept = 1; break; }
                    float di = 0.0f;
                    if (kept) {
                        const float *x3 = x + (i3 * n + row) * v;
                        float y = fmx((x3[t] - mx[i3]) - ls[i3], LOG_FLOOR);
                        di = (y - mu[i3]) - (yb - mu_b);
                    }
                    g = fmn(g, di - c[i3]);
                }
                g += cmax;
                zd += exp((double)yb + (double)g) - exp((double)yb);
                ut[nu] = t;
                ug[nu++] = yb + g;
            }
        }
        const float log_z = (float)log(zd);
#pragma omp simd
        for (int64_t t = 0; t < v; t++) o[t] = fmx((b[t] - mx_b) - ls_b, LOG_FLOOR) - log_z;
        for (int64_t j = 0; j < nu; j++) o[ut[j]] = ug[j] - log_z;
    }
    return 0;
}
