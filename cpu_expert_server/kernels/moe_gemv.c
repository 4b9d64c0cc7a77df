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
#pragma omp for schedule(static)
        for (long it = 0; it < items1; it++) {
            const int s = active[it / nblk], b = (int)(it % nblk);
            const uint8_t *base = w13 + ((size_t)s * 2 * i_ + (size_t)b * 2 * rb) * row13;
            const int m = start[s + 1] - start[s];
            for (int r = 0; r < 2 * rb; r++) {
                row_to_f32(base + (size_t)r * row13, wdtype, h_, g13, buf);
                for (int j = 0; j < m; j++) {
                    const float *xt = x + (size_t)tok[start[s] + j] * h_;
                    const float v = dot(buf, xt, h_);
                    if (r < rb) {
                        act[(size_t)(start[s] + j) * i_ + b * rb + r] = v;
                    } else {
                        float *a = &act[(size_t)(start[s] + j) * i_ + b * rb + (r - rb)];
                        *a = (*a / (1.0f + expf(-*a))) * v; /* silu(gate) * up */
                    }
                }
            }
        }
        /* implicit barrier: all of act is ready */
#pragma omp for schedule(static)
        for (int h = 0; h < h_; h++) {
            for (int ai = 0; ai < na; ai++) {
                const int s = active[ai];
                row_to_f32(w2 + ((size_t)s * h_ + h) * row2, wdtype, i_, g2, buf);
                for (int q = start[s]; q < start[s + 1]; q++)
                    out[(size_t)tok[q] * h_ + h] += wt[q] * dot(buf, act + (size_t)q * i_, i_);
            }
        }
        free(buf);
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
