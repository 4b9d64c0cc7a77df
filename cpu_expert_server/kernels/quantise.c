/* Group-wise int8/int4 quantisation of one float matrix into the CPU backend's row or tiled
 * format, byte for byte what cpu_expert_server/packing.py's torch path writes (the layouts are
 * described in packing.py's docstring).
 *
 * Shapes: R rows, C a row's features, G the group, NB a row's bytes (body + 4 * C/G).
 *
 * The torch path's arithmetic, step for step:
 *   absmax = max |w| over a group, from the float bits (|w| is the bits without the sign)
 *   scale  = max(absmax / QMAX, 1e-12f)                  float32, true division
 *   code   = round_half_even(float(w) / scale)          float32, true division
 *   int8: clamp(code, -127, 127)      int4: clamp(code + 8, 0, 15)
 *
 * NOTE: build without -ffast-math (kernels/quantise.py FLAGS): it would turn the division into a
 * reciprocal multiply and the rounding trick below into a no-op, and the bytes would differ.
 * No global state: reader threads call this at once, each through ctypes without the GIL.
 */
#include <stdint.h>
#include <string.h>

/* every helper is inlined into quantise_as, whose callers fix the dtype, format and ISA */
#define INLINE static inline __attribute__((always_inline))

enum { IN_BF16 = 0, IN_F16 = 1, IN_F32 = 2 };
enum { Q_INT8 = 0, Q_INT4 = 1 };
enum { QUANT_OK = 0, QUANT_NONFINITE = 1, QUANT_BAD_ARGS = 2 };

/* features converted and coded at a time: one step of the tiled format */
#define STEP 64
/* x + 1.5 * 2^23 rounds x to an integer, ties to even (the default rounding mode), for
 * |x| < 2^22. NOTE: |w / scale| <= QMAX (1 + 2^-23) as |w| <= absmax and scale >= absmax / QMAX
 * rounded, so with inf and NaN refused every code is far inside that range */
#define ROUND_MAGIC 12582912.0f

INLINE float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

INLINE float bf16_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

/* IEEE half -> float, exact (every half is a float); inf/NaN never get here */
INLINE float f16_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
    if (e == 0) {  // zero or subnormal: m * 2^-24, exact in float
        float v = (float)m * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    return bits_f32(sign | ((e + 112) << 23) | (m << 13));
}

/* The group's scale, or QUANT_NONFINITE where |w| has an inf or NaN (the torch path's codes
 * then come from converting NaN to an integer, which the caller leaves to torch). */
INLINE int group_scale(const void *w, int dt, int64_t at, int64_t n, float qmax, float *scale)
{
    float amax;
    if (dt == IN_F32) {
        const uint32_t *s = (const uint32_t *)w + at;
        uint32_t m = 0;
        for (int64_t i = 0; i < n; i++) {
            uint32_t v = s[i] & 0x7FFFFFFFu;
            m = v > m ? v : m;
        }
        if (m >= 0x7F800000u)
            return QUANT_NONFINITE;
        amax = bits_f32(m);
    } else {
        const uint16_t *s = (const uint16_t *)w + at;
        uint16_t m = 0;
        for (int64_t i = 0; i < n; i++) {
            uint16_t v = s[i] & 0x7FFF;
            m = v > m ? v : m;
        }
        if (m >= (dt == IN_BF16 ? 0x7F80 : 0x7C00))
            return QUANT_NONFINITE;
        amax = dt == IN_BF16 ? bf16_f32(m) : f16_f32(m);
    }
    float s = amax / qmax;
    *scale = s < 1e-12f ? 1e-12f : s;
    return QUANT_OK;
}

/* w[at] as float */
INLINE float load_f32(const void *w, int dt, int64_t at)
{
    if (dt == IN_F32)
        return ((const float *)w)[at];
    uint16_t h = ((const uint16_t *)w)[at];
    return dt == IN_BF16 ? bf16_f32(h) : f16_f32(h);
}

/* codes of n <= STEP values from ``at``: int8 levels, or int4 levels + 8 */
INLINE void codes(const void *w, int dt, int64_t at, int n, float scale, int q, int8_t *restrict out)
{
    const int add = q == Q_INT8 ? 0 : 8, lo = q == Q_INT8 ? -127 : 0, hi = q == Q_INT8 ? 127 : 15;
    for (int i = 0; i < n; i++) {
        int c = (int)((load_f32(w, dt, at + i) / scale + ROUND_MAGIC) - ROUND_MAGIC) + add;
        out[i] = (int8_t)(c < lo ? lo : (c > hi ? hi : c));
    }
}

/* n <= STEP int4 bytes: element ``a + j`` in the low nibble of byte j, ``b + j`` in the high */
INLINE void pair_nibbles(const void *w, int dt, int64_t a, int64_t b, int n, float scale,
                         uint8_t *restrict out)
{
    int8_t lo[STEP], hi[STEP];
    codes(w, dt, a, n, scale, Q_INT4, lo);
    codes(w, dt, b, n, scale, Q_INT4, hi);
    for (int j = 0; j < n; j++)
        out[j] = (uint8_t)(lo[j] | (hi[j] << 4));
}

/* Row r's group gi into the row format: its codes at row + gi*G (int8) or row + gi*G/2 (int4) */
INLINE void row_group(const void *w, int dt, int64_t at, int64_t g, float scale, int q, uint8_t *row,
                      int64_t gi)
{
    if (q == Q_INT8) {
        for (int64_t k = 0; k < g; k += STEP) {
            int n = (int)(g - k < STEP ? g - k : STEP);
            codes(w, dt, at + k, n, scale, q, (int8_t *)row + gi * g + k);
        }
        return;
    }
    for (int64_t k = 0; k < g / 2; k += STEP) {
        int n = (int)(g / 2 - k < STEP ? g / 2 - k : STEP);
        pair_nibbles(w, dt, at + k, at + g / 2 + k, n, scale, row + gi * (g / 2) + k);
    }
}

/* Row r's group gi into the tiled format: each step of 64 features goes to its tile, at row
 * r % 16 of the block's [C/64, 16, 64 or 32] bodies */
INLINE void tile_group(const void *w, int dt, int64_t at, int64_t g, float scale, int q, uint8_t *block,
                       int64_t r16, int64_t f0)
{
    const int64_t step = q == Q_INT8 ? 64 : 32;  // a row's bytes per step
    for (int64_t k = 0; k < g; k += 64) {
        uint8_t *dst = block + ((f0 + k) / 64 * 16 + r16) * step;
        if (q == Q_INT8)
            codes(w, dt, at + k, 64, scale, q, (int8_t *)dst);
        else
            pair_nibbles(w, dt, at + k, at + k + 32, 32, scale, dst);
    }
}

/* w [R, C] -> out [R, NB], row after row, group after group (a group's scale, then its codes) */
INLINE int quantise_as(const void *w, int dt, int64_t rows, int64_t c, int q, int64_t g, int tiled,
                       uint8_t *out)
{
    const int64_t body = q == Q_INT8 ? c : c / 2, groups = c / g, nb = body + 4 * groups;
    const float qmax = q == Q_INT8 ? 127.0f : 7.0f;
    for (int64_t r = 0; r < rows; r++) {
        uint8_t *block = out + (r / 16) * 16 * nb;  // tiled: this row's block of 16
        for (int64_t gi = 0; gi < groups; gi++) {
            const int64_t at = r * c + gi * g;
            float scale;
            if (group_scale(w, dt, at, g, qmax, &scale) != QUANT_OK)
                return QUANT_NONFINITE;
            if (tiled) {
                tile_group(w, dt, at, g, scale, q, block, r % 16, gi * g);
                memcpy(block + 16 * body + (gi * 16 + r % 16) * 4, &scale, 4);  // scales [C/G, 16]
            } else {
                row_group(w, dt, at, g, scale, q, out + r * nb, gi);
                memcpy(out + r * nb + body + gi * 4, &scale, 4);
            }
        }
    }
    return QUANT_OK;
}

/* One copy of the loops per input dtype and format (the constants folded in), per ISA: the
 * same IEEE operations, only wider (the vectoriser keeps IEEE semantics without fast-math). */
#define QUANTISE_ISA(name, attr)                                                                      \
    attr static int name(const void *w, int dt, int64_t rows, int64_t c, int q, int64_t g, int tiled, \
                         uint8_t *out)                                                                \
    {                                                                                                 \
        if (dt == IN_BF16)                                                                            \
            return q == Q_INT8 ? quantise_as(w, IN_BF16, rows, c, Q_INT8, g, tiled, out)              \
                               : quantise_as(w, IN_BF16, rows, c, Q_INT4, g, tiled, out);             \
        if (dt == IN_F16)                                                                             \
            return q == Q_INT8 ? quantise_as(w, IN_F16, rows, c, Q_INT8, g, tiled, out)               \
                               : quantise_as(w, IN_F16, rows, c, Q_INT4, g, tiled, out);              \
        return q == Q_INT8 ? quantise_as(w, IN_F32, rows, c, Q_INT8, g, tiled, out)                   \
                           : quantise_as(w, IN_F32, rows, c, Q_INT4, g, tiled, out);                  \
    }

QUANTISE_ISA(quantise_base, )
#if defined(__x86_64__)
QUANTISE_ISA(quantise_avx2, __attribute__((target("avx2"))))
QUANTISE_ISA(quantise_avx512, __attribute__((target("avx512f,avx512bw,avx512vl"))))
#endif

/* The widest ISA this CPU runs the loops in: 0 baseline, 1 AVX2, 2 AVX-512. */
int quantise_isa(void)
{
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))
        return 2;
    if (__builtin_cpu_supports("avx2"))
        return 1;
#endif
    return 0;
}

/* w [R, C] (dt: IN_BF16/IN_F16/IN_F32, contiguous) -> out [R, NB] uint8 (contiguous): tiled
 * (G % 64 == 0, R % 16 == 0) or the row format, in the loops of ISA ``isa`` (at most
 * quantise_isa(); tests pick each). Returns QUANT_OK, QUANT_NONFINITE (a group with an inf or
 * NaN: out is partly written, the caller redoes it) or QUANT_BAD_ARGS. */
int quantise_rows(const void *w, int dt, int64_t rows, int64_t c, int q, int64_t g, int tiled, uint8_t *out,
                  int isa)
{
    if (g <= 0 || c % g || (q == Q_INT4 && g % 2) || (tiled && (g % 64 || rows % 16)))
        return QUANT_BAD_ARGS;
    if (dt < IN_BF16 || dt > IN_F32 || (q != Q_INT8 && q != Q_INT4) || isa < 0 || isa > quantise_isa())
        return QUANT_BAD_ARGS;
#if defined(__x86_64__)
    if (isa == 2)
        return quantise_avx512(w, dt, rows, c, q, g, tiled, out);
    if (isa == 1)
        return quantise_avx2(w, dt, rows, c, q, g, tiled, out);
#endif
    return quantise_base(w, dt, rows, c, q, g, tiled, out);
}
