/* Dot products on narrow data, one variant per ISA (included by moe_gemv.c, which picks a variant
 * at run time from the CPU's flags; each function carries its own target attribute, so one
 * library serves every x86-64 CPU).
 *
 * Quantised weights x int8 activations: activations are quantised per token (or per
 * intermediate row) in the weights' groups, symmetric int8, so each group's integer dot product
 * is scaled once by (weight scale * activation scale). The weights stay bytes in the inner loop:
 *   AVX2:        int8: |x| (u8) x sign-transferred w (s8) with vpmaddubsw + vpmaddwd (no
 *                saturation: |w|, |x| <= 127); int4: nibble (u8) x x (s8)
 *   AVX512-VNNI: vpdpbusd (u8 x s8 -> s32): int8 weights become u8 by flipping the top bit
 *                (q + 128), int4 nibbles are already u8 (q + 8); the biases times sum(x) come off
 *                once per row
 * bf16 weights x bf16 activations: vdpbf16ps (AVX512_BF16), 32 products per instruction.
 */

#define QM 4 /* tokens per pass over a row: accumulators stay in registers */

#define QNAME(x) x##avx2
#define QTARGET "avx2,fma"
#define W8_PREP(w) ((void)0)
#define DOT_I8(a, w, x)                                                                                         \
    _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(x), _mm256_sign_epi8(w, x)), \
                                          _mm256_set1_epi16(1)))
#define DOT_U4(a, n, x) _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(n, x), _mm256_set1_epi16(1)))
#define K8 0
#include "moe_qdot_body.c"
#undef QNAME
#undef QTARGET
#undef W8_PREP
#undef DOT_I8
#undef DOT_U4
#undef K8

#define QNAME(x) x##vnni
#define QTARGET "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni"
#define W8_PREP(w) ((w) = _mm256_xor_si256((w), _mm256_set1_epi8((char)0x80)))
#define DOT_I8(a, w, x) _mm256_dpbusd_epi32(a, w, x)
#define DOT_U4(a, n, x) _mm256_dpbusd_epi32(a, n, x)
#define K8 128
#include "moe_qdot_body.c"
#undef QNAME
#undef QTARGET
#undef W8_PREP
#undef DOT_I8
#undef DOT_U4
#undef K8

/* x [c] fp32 -> q [c] int8, sc [c/g] scales, cs [c/g] = scale * sum(q) of each group. Round half
 * away from zero (torch rounds half to even: ties differ, ~never with real data). */
static void quant_act(const float *x, int c, int g, int8_t *q, float *sc, float *cs) {
    for (int gi = 0; gi < c / g; gi++) {
        const float *xg = x + (size_t)gi * g;
        float amax = 0.0f;
        for (int i = 0; i < g; i++) amax = fmaxf(amax, fabsf(xg[i]));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int i = 0; i < g; i++) {
            const float y = xg[i] * inv;
            int v = (int)(y + (y >= 0.0f ? 0.5f : -0.5f));
            v = v > 127 ? 127 : (v < -127 ? -127 : v);
            q[(size_t)gi * g + i] = (int8_t)v;
            sum += v;
        }
        sc[gi] = amax / 127.0f;
        cs[gi] = sc[gi] * (float)sum;
    }
}

/* fp32 -> bf16, round to nearest even (inputs are finite) */
static inline __attribute__((always_inline)) uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline __attribute__((always_inline)) void row_to_bf16(const float *x, int c, uint16_t *out) {
    for (int i = 0; i < c; i++) out[i] = to_bf16(x[i]);
}

#define BF16_TARGET "avx512f,avx512bw,avx512vl,avx512bf16,fma"

/* res[j] = row . xb[j], bf16 row and bf16 activations, c % 64 == 0 */
static inline __attribute__((always_inline, target(BF16_TARGET))) void bf16_m(const uint8_t *row, int c,
                                                                              const uint16_t *const *xb,
                                                                              const int m, float *res) {
    __m512 a[MAXM], b[MAXM];
    for (int j = 0; j < m; j++) a[j] = b[j] = _mm512_setzero_ps();
    for (int i = 0; i < c; i += 64) {
        const __m512i w0 = _mm512_loadu_si512(row + 2 * i), w1 = _mm512_loadu_si512(row + 2 * i + 64);
        for (int j = 0; j < m; j++) {
            a[j] = _mm512_dpbf16_ps(a[j], (__m512bh)w0, (__m512bh)_mm512_loadu_si512(xb[j] + i));
            b[j] = _mm512_dpbf16_ps(b[j], (__m512bh)w1, (__m512bh)_mm512_loadu_si512(xb[j] + i + 32));
        }
    }
    for (int j = 0; j < m; j++) res[j] = _mm512_reduce_add_ps(_mm512_add_ps(a[j], b[j]));
}

__attribute__((target(BF16_TARGET))) static void dots_bf16(const uint8_t *row, int c, const uint16_t *const *xb,
                                                            int m, float *res) {
    for (int j0 = 0; j0 < m; j0 += MAXM) {
        const uint16_t *const *x = xb + j0;
        float *r = res + j0;
        switch (m - j0 < MAXM ? m - j0 : MAXM) {
            case 1: bf16_m(row, c, x, 1, r); break;
            case 2: bf16_m(row, c, x, 2, r); break;
            case 3: bf16_m(row, c, x, 3, r); break;
            case 4: bf16_m(row, c, x, 4, r); break;
            case 5: bf16_m(row, c, x, 5, r); break;
            case 6: bf16_m(row, c, x, 6, r); break;
            case 7: bf16_m(row, c, x, 7, r); break;
            default: bf16_m(row, c, x, 8, r); break;
        }
    }
}
