/* fp32 dot products of weight rows (bf16/fp32/int8/int4) with fp32 activations, one variant per
 * ISA (included by moe_gemv.c once per ISA; not a translation unit of its own). The including file
 * defines:
 *   FNAME(x)  the names of this variant
 *   FTARGET   its target attribute string
 *   FL        fp32 lanes of its vector registers (16 AVX-512, 8 AVX2, 4 SSE2)
 *   FM        tokens per pass over a row: 2 * FM accumulators stay in registers
 * NOTE: the vectors are exactly one register wide: GCC lowers a generic vector twice the
 * register width through the stack when it converts (bf16 widening, int8 -> fp32), which made
 * the AVX2 build of a 16-lane version 4-8x slower than its loads (2-core CI machine, perf).
 * Weights are converted 2 * FL at a time in registers and FMAed into FM tokens' accumulators,
 * two independent chains per token so the FMA latency does not bound the row rate. */
typedef float FNAME(vf) __attribute__((vector_size(FL * 4)));
typedef uint16_t FNAME(vu16) __attribute__((vector_size(FL * 2)));
typedef uint32_t FNAME(vu32) __attribute__((vector_size(FL * 4)));
typedef int32_t FNAME(vi32) __attribute__((vector_size(FL * 4)));
typedef int16_t FNAME(vi16) __attribute__((vector_size(FL * 2)));
typedef int8_t FNAME(vi8) __attribute__((vector_size(FL)));
typedef uint8_t FNAME(vu8) __attribute__((vector_size(FL)));

static inline __attribute__((always_inline, target(FTARGET))) FNAME(vf) FNAME(ldf)(const float *p) {
    FNAME(vf) v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline __attribute__((always_inline, target(FTARGET))) FNAME(vf) FNAME(cvt_bf16)(const uint8_t *p) {
    FNAME(vu16) u;
    memcpy(&u, p, sizeof u);
    FNAME(vu32) w = __builtin_convertvector(u, FNAME(vu32)) << 16;
    FNAME(vf) f;
    memcpy(&f, &w, sizeof f);
    return f;
}
/* NOTE: int8 -> int32 goes through 16 bits: GCC 12/13 scalarise a direct 8 -> 32 bit
 * __builtin_convertvector of loaded bytes (one movsbl per byte: int8 ran at ~10 GB/s) */
static inline __attribute__((always_inline, target(FTARGET))) FNAME(vf) FNAME(cvt_i8)(const uint8_t *p) {
    FNAME(vi8) q;
    memcpy(&q, p, sizeof q);
    return __builtin_convertvector(
        __builtin_convertvector(__builtin_convertvector(q, FNAME(vi16)), FNAME(vi32)), FNAME(vf));
}
static inline __attribute__((always_inline, target(FTARGET))) void FNAME(cvt_i4)(const uint8_t *p, FNAME(vf) * lo,
                                                                                 FNAME(vf) * hi) {
    FNAME(vu8) b;
    memcpy(&b, p, sizeof b);
    /* NOTE: here the direct widening of the masked bytes vectorises, and measured faster on the
     * device host than going through 16 bits (0.7 vs 1.2 ms per Qwen3 layer at T=1) */
    *lo = __builtin_convertvector(__builtin_convertvector(b & 15, FNAME(vi32)) - 8, FNAME(vf));
    *hi = __builtin_convertvector(__builtin_convertvector(b >> 4, FNAME(vi32)) - 8, FNAME(vf));
}
static inline __attribute__((always_inline, target(FTARGET))) float FNAME(hsum)(FNAME(vf) v) {
    float s = 0.0f;
    for (int i = 0; i < FL; i++) s += v[i];
    return s;
}

/* res[j] = row . xs[j] for j < m <= FM; needs c % (2 FL) == 0 and (quantised) g % (2 FL) == 0.
 * Always inlined with a constant m (see FNAME(row_dots)) so the accumulators live in registers:
 * with a run-time m they live on the stack and every FMA waits on a store-to-load round trip. */
static inline __attribute__((always_inline, target(FTARGET))) void FNAME(row_dots_vec)(
    const uint8_t *row, int wdtype, int c, int g, const float *const *xs, const int m, float *res) {
    FNAME(vf) a[FM], b[FM];
    for (int j = 0; j < m; j++) a[j] = b[j] = (FNAME(vf)){0};
    if (wdtype == 0 || wdtype == 3) {
        for (int i = 0; i < c; i += 2 * FL) {
            FNAME(vf) w0 = wdtype == 0 ? FNAME(cvt_bf16)(row + 2 * i) : FNAME(ldf)((const float *)row + i);
            FNAME(vf) w1 = wdtype == 0 ? FNAME(cvt_bf16)(row + 2 * i + 2 * FL) : FNAME(ldf)((const float *)row + i + FL);
            for (int j = 0; j < m; j++) {
                a[j] += w0 * FNAME(ldf)(xs[j] + i);
                b[j] += w1 * FNAME(ldf)(xs[j] + i + FL);
            }
        }
    } else if (wdtype == 1) {
        const float *sc = (const float *)(row + c);
        for (int i = 0; i < c; i += 2 * FL) {
            const float s = sc[i / g];
            FNAME(vf) w0 = FNAME(cvt_i8)(row + i) * s, w1 = FNAME(cvt_i8)(row + i + FL) * s;
            for (int j = 0; j < m; j++) {
                a[j] += w0 * FNAME(ldf)(xs[j] + i);
                b[j] += w1 * FNAME(ldf)(xs[j] + i + FL);
            }
        }
    } else {
        const float *sc = (const float *)(row + c / 2);
        const int h = g / 2;
        for (int gi = 0; gi < c / g; gi++) {
            const float s = sc[gi];
            for (int jj = 0; jj < h; jj += FL) {
                FNAME(vf) lo, hi;
                FNAME(cvt_i4)(row + gi * h + jj, &lo, &hi);
                lo *= s, hi *= s;
                const int e = gi * g + jj;
                for (int j = 0; j < m; j++) {
                    a[j] += lo * FNAME(ldf)(xs[j] + e);
                    b[j] += hi * FNAME(ldf)(xs[j] + e + h);
                }
            }
        }
    }
    for (int j = 0; j < m; j++) res[j] = FNAME(hsum)(a[j] + b[j]);
}

/* res[j] = row . xs[j] for any m: the vector path where the shape allows, else convert + dot */
__attribute__((target(FTARGET))) static void FNAME(row_dots)(const uint8_t *row, int wdtype, int c, int g,
                                                             const float *const *xs, int m, float *res, float *buf) {
    const int vec = c % 32 == 0 && (wdtype == 0 || wdtype == 3 || g % 32 == 0);
    if (vec) {
        for (int j0 = 0; j0 < m; j0 += FM) {
            const float *const *x = xs + j0;
            float *r = res + j0;
            switch (m - j0 < FM ? m - j0 : FM) {
                case 1: FNAME(row_dots_vec)(row, wdtype, c, g, x, 1, r); break;
                case 2: FNAME(row_dots_vec)(row, wdtype, c, g, x, 2, r); break;
                case 3: FNAME(row_dots_vec)(row, wdtype, c, g, x, 3, r); break;
#if FM > 4
                case 4: FNAME(row_dots_vec)(row, wdtype, c, g, x, 4, r); break;
                case 5: FNAME(row_dots_vec)(row, wdtype, c, g, x, 5, r); break;
                case 6: FNAME(row_dots_vec)(row, wdtype, c, g, x, 6, r); break;
                case 7: FNAME(row_dots_vec)(row, wdtype, c, g, x, 7, r); break;
#endif
                default: FNAME(row_dots_vec)(row, wdtype, c, g, x, FM, r); break;
            }
        }
        return;
    }
    row_to_f32(row, wdtype, c, g, buf);
    for (int j = 0; j < m; j++) res[j] = dot(buf, xs[j], c);
}
