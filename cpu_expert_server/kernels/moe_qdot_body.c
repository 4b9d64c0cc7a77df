/* Integer dot products of quantised weight rows with int8 activations (included by moe_qdot.c
 * once per ISA; not a translation unit of its own). The including file defines:
 *   QNAME(x)        the function name for this ISA
 *   QTARGET         its target attribute string
 *   W8_PREP(w)      per int8 weight vector, once for all tokens
 *   DOT_I8(a, w, x) a += 4-byte dot products of int8 weights (after W8_PREP) with int8 x
 *   DOT_U4(a, n, x) a += 4-byte dot products of unsigned nibbles n (0..15) with int8 x
 *   K8              what DOT_I8 adds per unit of sum(x): the bias W8_PREP put on the weights
 * int4's nibbles are q + 8, so DOT_U4 adds 8 * sum(x); both biases come off once per row. */

/* res[j] = row . x_j, x_j = xq[j] * xs[j] per group; xc[j][gi] = xs[j][gi] * sum of group gi of
 * xq[j]. Needs g % 64 == 0 (int8 groups of 2 x 32 bytes, int4 groups of 32 bytes). */
static inline __attribute__((always_inline, target(QTARGET))) void QNAME(m_)(
    const uint8_t *row, int wdtype, int c, int g, const int8_t *const *xq, const float *const *xs,
    const float *const *xc, const int m, float *res) {
    __m256 af[QM];
    float corr[QM];
    for (int j = 0; j < m; j++) af[j] = _mm256_setzero_ps(), corr[j] = 0.0f;
    const float *ws = (const float *)(row + (wdtype == 1 ? c : c / 2));
    const __m256i nib = _mm256_set1_epi8(15);
    for (int gi = 0; gi < c / g; gi++) {
        /* two integer accumulators per token: halves the dependency chain of the dot products */
        __m256i ai[QM], bi[QM];
        for (int j = 0; j < m; j++) ai[j] = bi[j] = _mm256_setzero_si256();
        if (wdtype == 1) {
            const uint8_t *wg = row + (size_t)gi * g;
            for (int i = 0; i < g; i += 64) {
                __m256i w0 = _mm256_loadu_si256((const __m256i *)(wg + i));
                __m256i w1 = _mm256_loadu_si256((const __m256i *)(wg + i + 32));
                W8_PREP(w0);
                W8_PREP(w1);
                for (int j = 0; j < m; j++) {
                    const int8_t *xg = xq[j] + gi * g + i;
                    ai[j] = DOT_I8(ai[j], w0, _mm256_loadu_si256((const __m256i *)xg));
                    bi[j] = DOT_I8(bi[j], w1, _mm256_loadu_si256((const __m256i *)(xg + 32)));
                }
            }
        } else {
            const uint8_t *wg = row + (size_t)gi * (g / 2);
            for (int i = 0; i < g / 2; i += 32) {
                const __m256i b = _mm256_loadu_si256((const __m256i *)(wg + i));
                const __m256i lo = _mm256_and_si256(b, nib), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), nib);
                for (int j = 0; j < m; j++) {
                    const int8_t *xg = xq[j] + gi * g + i;
                    ai[j] = DOT_U4(ai[j], lo, _mm256_loadu_si256((const __m256i *)xg));
                    bi[j] = DOT_U4(bi[j], hi, _mm256_loadu_si256((const __m256i *)(xg + g / 2)));
                }
            }
        }
        const float s = ws[gi];
        for (int j = 0; j < m; j++) {
            const __m256 d = _mm256_cvtepi32_ps(_mm256_add_epi32(ai[j], bi[j]));
            af[j] = _mm256_fmadd_ps(d, _mm256_set1_ps(s * xs[j][gi]), af[j]);
            corr[j] += s * xc[j][gi];
        }
    }
    const float k = wdtype == 1 ? (float)K8 : 8.0f;
    for (int j = 0; j < m; j++) {
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(af[j]), _mm256_extractf128_ps(af[j], 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        res[j] = _mm_cvtss_f32(h) - k * corr[j];
    }
}

__attribute__((target(QTARGET))) static void QNAME(dots_)(const uint8_t *row, int wdtype, int c, int g,
                                                          const int8_t *const *xq, const float *const *xs,
                                                          const float *const *xc, int m, float *res) {
    for (int j0 = 0; j0 < m; j0 += QM) {
        const int8_t *const *q = xq + j0;
        const float *const *s = xs + j0, *const *cc = xc + j0;
        float *r = res + j0;
        switch (m - j0 < QM ? m - j0 : QM) {
            case 1: QNAME(m_)(row, wdtype, c, g, q, s, cc, 1, r); break;
            case 2: QNAME(m_)(row, wdtype, c, g, q, s, cc, 2, r); break;
            case 3: QNAME(m_)(row, wdtype, c, g, q, s, cc, 3, r); break;
            default: QNAME(m_)(row, wdtype, c, g, q, s, cc, 4, r); break;
        }
    }
}
