/* GGUF Q4_1 weight panels for packed_gemm.c (inlined into it by scpdr/kernels/build.py,
   after its vector types and tile macros). */

/* Weights may also be 4-bit GGUF Q4_1 blocks (a base model loaded from a .gguf file, e.g. the
   embedded SmolLM2-135M: every projection is Q4_1; scpdr/kernels/q4.py). Their float32 values
   are what the GGUF loader made of them: w = fl(fl(d·q) + m), d and m the block's float16 scale
   and minimum widened to float32, q in 0..15, one product then one sum (numpy; no fused
   multiply-add). A q4 panel holds k / 32 blocks of QBLOCK bytes: d[NR] and m[NR] (float32),
   then 16 rows of NR bytes, byte c of row j holding q of inputs 2j (low nibble) and 2j + 1
   (high nibble) of column c. The kernel rebuilds each weight with the same two roundings (the
   product kept out of a fused multiply-add by KEEP) and then runs the float32 tile's
   arithmetic in the same order: the results equal the float32 kernel's on the dequantized
   weights bit for bit, from ~3/16 of the bytes. */
#define QBLOCK (24 * NR)
#if defined(__AVX512F__)
#define KEEP(v) __asm__("" : "+v"(v))
#elif defined(__x86_64__) || defined(__i386__)
#define KEEP(v) __asm__("" : "+x"(v))
#elif defined(__aarch64__)
#define KEEP(v) __asm__("" : "+w"(v))
#else
#define KEEP(v) __asm__("" : "+m"(v))
#endif

/* LANES bytes at p widened to int32 lanes (GCC's __builtin_convertvector of a byte vector
   compiles to one byte insert per lane on x86: 20x slower than the ISA's widening load) */
#if defined(__AVX512F__)
static inline vi widen_u8(const uint8_t *p) {
    return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}
#elif defined(__AVX2__)
static inline vi widen_u8(const uint8_t *p) {
    return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}
#elif defined(__aarch64__) && defined(__ARM_NEON)
static inline vi widen_u8(const uint8_t *p) {
    uint32_t four;
    memcpy(&four, p, 4);
    const uint16x8_t h = vmovl_u8(vcreate_u8(four));
    return (vi)vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(h)));
}
#else
static inline vi widen_u8(const uint8_t *p) { return __builtin_convertvector(*(const vb *)p, vi); }
#endif

/* The NV weight vectors of input 2j + hi (hi 0 or 1) of a q4 block (d, m, q as above). */
static inline __attribute__((always_inline)) void q4_weights(const float *d, const float *m,
                                                             const uint8_t *q, const int hi,
                                                             vf *wv) {
    for (int j = 0; j < NV; j++) {
        const vi u = widen_u8(q + LANES * j);
        vf p = __builtin_convertvector(hi ? u >> 4 : u & 15, vf) * *(const vf *)(d + LANES * j);
        KEEP(p);
        wv[j] = p + *(const vf *)(m + LANES * j);
    }
}

/* The float32 panel (k, NR) of q4 panel `panel` (k a multiple of 32), into out. */
static void q4_dequantize(int64_t k, const char *panel, float *out) {
    for (int64_t kb = 0; kb < k; kb += 32, panel += QBLOCK) {
        const float *d = (const float *)panel, *m = d + NR;
        const uint8_t *q = (const uint8_t *)(m + NR);
        for (int jj = 0; jj < 16; jj++, q += NR)
            for (int hi = 0; hi < 2; hi++) {
                vf wv[NV];
                q4_weights(d, m, q, hi, wv);
                for (int j = 0; j < NV; j++)
                    *(vf *)(out + (kb + 2 * jj + hi) * NR + LANES * j) = wv[j];
            }
    }
}

/* Inputs per slice of a q4 panel dequantized for several tiles: a float32 slice of NR columns
   (16 KiB with AVX-512) that stays in L1 while every tile of the row chunk reads it. */
#define Q4_SLICE 128

/* This thread's buffer for a dequantized slice and the tiles' partial sums (grown, never
   freed; NULL when out of memory). */
static __thread float *q4_scratch;
static __thread int64_t q4_scratch_floats;

static float *q4_buffer(int64_t floats) {
    if (floats > q4_scratch_floats) {
        free(q4_scratch);
        q4_scratch = aligned_alloc(64, (size_t)(floats * 4 + 63) / 64 * 64);
        q4_scratch_floats = q4_scratch ? floats : 0;
    }
    return q4_scratch;
}
