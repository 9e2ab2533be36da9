/* Float helpers shared by the C kernels (scp_delta_r.c, cp_fuse.c). scpdr/kernels/build.py
   inlines this header into each kernel's source before it compiles it (one translation unit,
   hashed whole); compiled in place (tests/kernel_harness.c) it is found beside the sources. */
#ifndef SCPDR_FAST_MATH_H
#define SCPDR_FAST_MATH_H

#include <stdint.h>

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

#endif
