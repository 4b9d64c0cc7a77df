/* Decode-shaped MoE on the CPU: one pass over each active expert's rows, weights bf16/int8/int4.
 *
 * Shapes: T tokens, K top-k, S local slots, H hidden, I intermediate, RB interleave block,
 * G quantisation group. Every weight row is "dequantised" once into an fp32 buffer that stays in
 * L1, then dotted with each of the expert's tokens, so DRAM sees each active row exactly once.
 *
 * Row formats (one row = one output feature, C input features):
 *   wdtype 0 bf16: C uint16 (the top half of an fp32);  wdtype 3 fp32: C floats
 *   wdtype 1 int8: C int8, then C/G fp32 scales                         w = q * s
 *   wdtype 2 int4: C/2 bytes, then C/G fp32 scales; in a group of G the low nibble of byte j
 *                  holds element j and the high nibble element j + G/2   w = (nib - 8) * s
 * w13 rows come interleaved: blocks of RB gate rows then the RB matching up rows, so a thread
 * that owns one block has silu(gate) * up for its RB features without waiting on others.
 *
 * Threads: phase 1 splits (expert, row block) pairs, phase 2 splits output rows; each output
 * element is written by one thread, so there are no atomics. Built with -fopenmp.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline void row_to_f32(const uint8_t *row, int wdtype, int c, int g, float *restrict buf) {
    if (wdtype == 0) {
        const uint16_t *w = (const uint16_t *)row;
        uint32_t *b = (uint32_t *)buf;
        for (int i = 0; i < c; i++) b[i] = (uint32_t)w[i] << 16;
    } else if (wdtype == 3) {
        memcpy(buf, row, sizeof(float) * (size_t)c);
    } else if (wdtype == 1) {
        const int8_t *q = (const int8_t *)row;
        const float *sc = (const float *)(row + c);
        for (int gi = 0; gi < c / g; gi++) {
            const float s = sc[gi];
            const int8_t *qg = q + gi * g;
            float *bg = buf + gi * g;
            for (int i = 0; i < g; i++) bg[i] = (float)qg[i] * s;
        }
    } else {
        const float *sc = (const float *)(row + c / 2);
        const int h = g / 2;
        for (int gi = 0; gi < c / g; gi++) {
            const float s = sc[gi];
            const uint8_t *qg = row + gi * h;
            float *bg = buf + gi * g;
            for (int j = 0; j < h; j++) {
                bg[j] = (float)((int)(qg[j] & 15) - 8) * s;
                bg[j + h] = (float)((int)(qg[j] >> 4) - 8) * s;
            }
        }
    }
}

static inline float dot(const float *restrict a, const float *restrict b, int n) {
    float acc = 0.0f;
    for (int i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

/* ---- vector path: GCC vector extensions (AVX-512 where -march=native has it, 2x AVX2 elsewhere).
 * Weights are converted 32 at a time in registers and FMAed into MAXM tokens' accumulators at
 * once, two independent chains per token so the FMA latency does not bound the row rate. */
#define MAXM 8
typedef float v16f __attribute__((vector_size(64)));
typedef uint16_t v16u16 __attribute__((vector_size(32)));
typedef uint32_t v16u32 __attribute__((vector_size(64)));
typedef int32_t v16i32 __attribute__((vector_size(64)));
typedef int16_t v16i16 __attribute__((vector_size(32)));
typedef int8_t v16i8 __attribute__((vector_size(16)));
typedef uint8_t v16u8 __attribute__((vector_size(16)));

static inline v16f ldf(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline v16f cvt_bf16(const uint8_t *p) {
    v16u16 u;
    memcpy(&u, p, sizeof u);
    v16u32 w = __builtin_convertvector(u, v16u32) << 16;
    v16f f;
    memcpy(&f, &w, sizeof f);
    return f;
}
/* NOTE: int8 -> int32 goes through 16 bits: GCC 12/13 scalarise a direct 8 -> 32 bit
 * __builtin_convertvector of loaded bytes (one movsbl per byte: int8 ran at ~10 GB/s) */
static inline v16f widen(v16i8 q) {
    return __builtin_convertvector(__builtin_convertvector(__builtin_convertvector(q, v16i16), v16i32), v16f);
}
static inline v16f cvt_i8(const uint8_t *p) {
    v16i8 q;
    memcpy(&q, p, sizeof q);
    return widen(q);
}
static inline void cvt_i4(const uint8_t *p, v16f *lo, v16f *hi) {
    v16u8 b;
    memcpy(&b, p, sizeof b);
    /* NOTE: here the direct widening of the masked bytes vectorises, and measured faster on the
     * device host than going through widen() (0.7 vs 1.2 ms per Qwen3 layer at T=1) */
    *lo = __builtin_convertvector(__builtin_convertvector(b & 15, v16i32) - 8, v16f);
    *hi = __builtin_convertvector(__builtin_convertvector(b >> 4, v16i32) - 8, v16f);
}
static inline float hsum(v16f v) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

/* res[j] = row . xs[j] for j < m <= MAXM; needs c % 32 == 0 and (quantised) g % 32 == 0.
 * Always inlined with a constant m (see row_dots) so the accumulators live in registers: with a
 * run-time m they live on the stack and every FMA waits on a store-to-load round trip. */
static inline __attribute__((always_inline)) void row_dots_vec(const uint8_t *row, int wdtype, int c, int g,
                                                               const float *const *xs, const int m,
                                                               float *res) {
    v16f a[MAXM], b[MAXM];
    for (int j = 0; j < m; j++) a[j] = b[j] = (v16f){0};
    if (wdtype == 0 || wdtype == 3) {
        for (int i = 0; i < c; i += 32) {
            v16f w0 = wdtype == 0 ? cvt_bf16(row + 2 * i) : ldf((const float *)row + i);
            v16f w1 = wdtype == 0 ? cvt_bf16(row + 2 * i + 32) : ldf((const float *)row + i + 16);
            for (int j = 0; j < m; j++) {
                a[j] += w0 * ldf(xs[j] + i);
                b[j] += w1 * ldf(xs[j] + i + 16);
            }
        }
    } else if (wdtype == 1) {
        const float *sc = (const float *)(row + c);
        for (int i = 0; i < c; i += 32) {
            const float s = sc[i / g];
            v16f w0 = cvt_i8(row + i) * s, w1 = cvt_i8(row + i + 16) * s;
            for (int j = 0; j < m; j++) {
                a[j] += w0 * ldf(xs[j] + i);
                b[j] += w1 * ldf(xs[j] + i + 16);
            }
        }
    } else {
        const float *sc = (const float *)(row + c / 2);
        const int h = g / 2;
        for (int gi = 0; gi < c / g; gi++) {
            const float s = sc[gi];
            for (int jj = 0; jj < h; jj += 16) {
                v16f lo, hi;
                cvt_i4(row + gi * h + jj, &lo, &hi);
                lo *= s, hi *= s;
                const int e = gi * g + jj;
                for (int j = 0; j < m; j++) {
                    a[j] += lo * ldf(xs[j] + e);
                    b[j] += hi * ldf(xs[j] + e + h);
                }
            }
        }
    }
    for (int j = 0; j < m; j++) res[j] = hsum(a[j] + b[j]);
}

/* res[j] = row . xs[j] for any m: the vector path where the shape allows, else convert + dot */
static void row_dots(const uint8_t *row, int wdtype, int c, int g, const float *const *xs, int m, float *res,
                     float *buf) {
    const int vec = c % 32 == 0 && (wdtype == 0 || wdtype == 3 || g % 32 == 0);
    if (vec) {
        for (int j0 = 0; j0 < m; j0 += MAXM) {
            const float *const *x = xs + j0;
            float *r = res + j0;
            switch (m - j0 < MAXM ? m - j0 : MAXM) {
                case 1: row_dots_vec(row, wdtype, c, g, x, 1, r); break;
                case 2: row_dots_vec(row, wdtype, c, g, x, 2, r); break;
                case 3: row_dots_vec(row, wdtype, c, g, x, 3, r); break;
                case 4: row_dots_vec(row, wdtype, c, g, x, 4, r); break;
                case 5: row_dots_vec(row, wdtype, c, g, x, 5, r); break;
                case 6: row_dots_vec(row, wdtype, c, g, x, 6, r); break;
                case 7: row_dots_vec(row, wdtype, c, g, x, 7, r); break;
                default: row_dots_vec(row, wdtype, c, g, x, 8, r); break;
            }
        }
        return;
    }
    row_to_f32(row, wdtype, c, g, buf);
    for (int j = 0; j < m; j++) res[j] = dot(buf, xs[j], c);
}

/* x [T, H] fp32; slot_ids [T, K] int64 (-1 = not here); weights [T, K] fp32; out [T, H] fp32.
 * w13 [S, 2I, row13 bytes], w2 [S, H, row2 bytes]; act scratch [T*K, I] fp32.
 * Returns 0, or -1 when a slot id is out of range (nothing written then). */
int moe_decode(const float *x, const int64_t *slot_ids, const float *weights, int t_, int k_, int s_,
               const uint8_t *w13, long row13, const uint8_t *w2, long row2, int h_, int i_, int rb,
               int wdtype, int g13, int g2, float *act, float *out, int nthreads) {
    const int n = t_ * k_;
    int *count = calloc((size_t)s_ + 1, sizeof(int));
    int *start = malloc(((size_t)s_ + 1) * sizeof(int));
    int *tok = malloc((size_t)(n > 0 ? n : 1) * sizeof(int));
    float *wt = malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    int *active = malloc(((size_t)s_ + 1) * sizeof(int));
    for (int p = 0; p < n; p++) {
        const int64_t s = slot_ids[p];
        if (s >= s_ || s < -1) {
            free(count), free(start), free(tok), free(wt), free(active);
            return -1;
        }
        if (s >= 0) count[s]++;
    }
    /* counting sort of (token, weight) by slot, k-major within a slot like the reference */
    int na = 0, acc = 0;
    for (int s = 0; s < s_; s++) {
        start[s] = acc;
        acc += count[s];
        if (count[s]) active[na++] = s;
        count[s] = 0;
    }
    start[s_] = acc;
    for (int kk = 0; kk < k_; kk++)
        for (int t = 0; t < t_; t++) {
            const int64_t s = slot_ids[t * k_ + kk];
            if (s < 0) continue;
            const int q = start[s] + count[s]++;
            tok[q] = t;
            wt[q] = weights[t * k_ + kk];
        }
    memset(out, 0, sizeof(float) * (size_t)t_ * h_);
    const int nblk = i_ / rb;
    const long items1 = (long)na * nblk;
#pragma omp parallel num_threads(nthreads)
    {
        float *buf = malloc(sizeof(float) * (size_t)(h_ > i_ ? h_ : i_));
        const float **xs = malloc(sizeof(float *) * (size_t)(n > 0 ? n : 1));
        float *res = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
#pragma omp for schedule(static)
        for (long it = 0; it < items1; it++) {
            const int s = active[it / nblk], b = (int)(it % nblk);
            const uint8_t *base = w13 + ((size_t)s * 2 * i_ + (size_t)b * 2 * rb) * row13;
            const int m = start[s + 1] - start[s];
            for (int j = 0; j < m; j++) xs[j] = x + (size_t)tok[start[s] + j] * h_;
            for (int r = 0; r < 2 * rb; r++) {
                row_dots(base + (size_t)r * row13, wdtype, h_, g13, xs, m, res, buf);
                for (int j = 0; j < m; j++) {
                    float *a = &act[(size_t)(start[s] + j) * i_ + b * rb + (r % rb)];
                    if (r < rb)
                        *a = res[j];
                    else
                        *a = (*a / (1.0f + expf(-*a))) * res[j]; /* silu(gate) * up */
                }
            }
        }
        /* implicit barrier: all of act is ready */
#pragma omp for schedule(static)
        for (int h = 0; h < h_; h++) {
            for (int ai = 0; ai < na; ai++) {
                const int s = active[ai];
                const int m = start[s + 1] - start[s];
                for (int j = 0; j < m; j++) xs[j] = act + (size_t)(start[s] + j) * i_;
                row_dots(w2 + ((size_t)s * h_ + h) * row2, wdtype, i_, g2, xs, m, res, buf);
                for (int j = 0; j < m; j++) out[(size_t)tok[start[s] + j] * h_ + h] += wt[start[s] + j] * res[j];
            }
        }
        free(buf);
        free(xs);
        free(res);
    }
    free(count), free(start), free(tok), free(wt), free(active);
    return 0;
}

/* Dequantise rows [R, row bytes] of one format into fp32 [R, C] (the prefill path's GEMM input). */
void dequant_rows(const uint8_t *rows, long rowbytes, int r_, int c, int wdtype, int g, float *out,
                  int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int r = 0; r < r_; r++) row_to_f32(rows + (size_t)r * rowbytes, wdtype, c, g, out + (size_t)r * c);
}
