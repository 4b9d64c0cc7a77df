/* MoE experts on the CPU: decode-shaped calls (few tokens per expert) stream each active expert's
 * rows once; weights bf16/fp32/int8/int4.
 *
 * Shapes: T tokens, K top-k, S local slots, H hidden, I intermediate, RB interleave block,
 * G quantisation group, n = T*K (token, expert) pairs.
 *
 * Row formats (one row = one output feature, C input features):
 *   wdtype 0 bf16: C uint16 (the top half of an fp32);  wdtype 3 fp32: C floats
 *   wdtype 1 int8: C int8, then C/G fp32 scales                         w = q * s
 *   wdtype 2 int4: C/2 bytes, then C/G fp32 scales; in a group of G the low nibble of byte j
 *                  holds element j and the high nibble element j + G/2   w = (nib - 8) * s
 * int8/int4 matrices with G % 64 == 0 and a multiple of 16 rows are tiled instead (packing.py,
 * moe_qdot.c q_tiled): blocks of 16 rows stored step by step of 64 inputs, then their scales.
 * w13 rows come interleaved: blocks of RB gate rows then the RB matching up rows, so a thread
 * that owns one block has silu(gate) * up for its RB features without waiting on others.
 *
 * Dot products, chosen at run time from `caps` (the CPU's flags, read by the caller):
 *   int8/int4 with G % 64 == 0 and qact: activations quantised to int8 per group, integer dots
 *     over whole 16-row blocks (moe_qdecode.c, moe_qdot.c: AVX512-VNNI or AVX2); bf16 with
 *     AVX512_BF16: vdpbf16ps on bf16 activations;
 *   otherwise fp32: each weight converted in registers and FMAed (AVX-512, AVX2 or SSE2 code
 *     from the same vector-extension source, per-function target attributes); tiled rows are
 *     first dequantised to an fp32 row.
 * On CPUs with AMX, bf16 calls go to moe_amx() (moe_amx.c) at every T, and int8/int4 ones past
 * decode sizes to moe_amx_q() (moe_amx_int8.c); the backend picks (backend.py _use_amx).
 *
 * Threads: phase 1 splits (expert, row block) pairs, phase 2 splits output rows; each output
 * element is written by one thread, so there are no atomics. Built with -fopenmp and without
 * -march: one library serves every x86-64 CPU.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CAP_AVX2 1   /* avx2 + fma */
#define CAP_AVX512 2 /* avx512 f/bw/vl */
#define CAP_VNNI 4   /* avx512_vnni */
#define CAP_BF16 8   /* avx512_bf16 */
#define CAP_AMX 16   /* amx_tile + amx_bf16 + amx_int8, permission granted (moe_amx_init) */

static inline __attribute__((always_inline)) void row_to_f32(const uint8_t *row, int wdtype, int c, int g,
                                                             float *restrict buf) {
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

/* ---- vector path: GCC vector extensions, one register wide per ISA (moe_fdot_body.c) */
#define MAXM 8 /* tokens per pass over a row where registers are 512 bits wide */
#define FNAME(x) x##_avx512
#define FTARGET "avx512f,avx512bw,avx512vl,avx2,fma"
#define FL 16
#define FM MAXM
#include "moe_fdot_body.c"
#undef FNAME
#undef FTARGET
#undef FL
#undef FM
#define FNAME(x) x##_avx2
#define FTARGET "avx2,fma"
#define FL 8
#define FM 4
#include "moe_fdot_body.c"
#undef FNAME
#undef FTARGET
#undef FL
#undef FM
#define FNAME(x) x##_generic
#define FTARGET "sse2"
#define FL 4
#define FM 4
#include "moe_fdot_body.c"
#undef FNAME
#undef FTARGET
#undef FL
#undef FM

#include "moe_qdot.c"

/* (token, k) pairs sorted by slot with a counting sort, k-major within a slot like the reference */
typedef struct {
    int *start;  /* [S + 1] first pair of each slot */
    int *tok;    /* [n] token of each sorted pair */
    float *wt;   /* [n] routing weight */
    int *active; /* [na] slots with pairs */
    int na;
} Sorted;

static void sorted_free(Sorted *o) { free(o->start), free(o->tok), free(o->wt), free(o->active); }

/* Returns -1 (nothing allocated) when a slot id is outside [-1, S). */
static int sort_pairs(const int64_t *slot_ids, const float *weights, int t_, int k_, int s_, Sorted *o) {
    const int n = t_ * k_;
    for (int p = 0; p < n; p++)
        if (slot_ids[p] >= s_ || slot_ids[p] < -1) return -1;
    int *count = calloc((size_t)s_ + 1, sizeof(int));
    o->start = malloc(((size_t)s_ + 1) * sizeof(int));
    o->tok = malloc((size_t)(n > 0 ? n : 1) * sizeof(int));
    o->wt = malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    o->active = malloc(((size_t)s_ + 1) * sizeof(int));
    for (int p = 0; p < n; p++)
        if (slot_ids[p] >= 0) count[slot_ids[p]]++;
    int acc = 0;
    o->na = 0;
    for (int s = 0; s < s_; s++) {
        o->start[s] = acc;
        acc += count[s];
        if (count[s]) o->active[o->na++] = s;
        count[s] = 0;
    }
    o->start[s_] = acc;
    for (int kk = 0; kk < k_; kk++)
        for (int t = 0; t < t_; t++) {
            const int64_t s = slot_ids[t * k_ + kk];
            if (s < 0) continue;
            const int q = o->start[s] + count[s]++;
            o->tok[q] = t;
            o->wt[q] = weights[t * k_ + kk];
        }
    free(count);
    return 0;
}

#include "moe_qdecode.c"

/* row r of a quantised matrix (tiled or not) -> fp32, compiled per ISA (the loops vectorise) */
#define QROW_ARGS const uint8_t *rows, long rowbytes, long r, int tiled, int wdtype, int c, int g, float *buf
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma"))) static void qrow_to_f32_avx512(QROW_ARGS) {
    qrow_to_f32(rows, rowbytes, r, tiled, wdtype, c, g, buf);
}
__attribute__((target("avx2,fma"))) static void qrow_to_f32_avx2(QROW_ARGS) {
    qrow_to_f32(rows, rowbytes, r, tiled, wdtype, c, g, buf);
}
static void qrow_to_f32_any(int fisa, QROW_ARGS) {
    if (fisa == 2)
        qrow_to_f32_avx512(rows, rowbytes, r, tiled, wdtype, c, g, buf);
    else if (fisa == 1)
        qrow_to_f32_avx2(rows, rowbytes, r, tiled, wdtype, c, g, buf);
    else
        qrow_to_f32(rows, rowbytes, r, tiled, wdtype, c, g, buf);
}

enum { DOT_F32, DOT_QAVX2, DOT_QVNNI, DOT_BF16 };

/* One side's activations ([rows, C], one row per token or per pair) in the form the dot wants. */
typedef struct {
    const float *f; /* fp32 [rows, C] */
    uint16_t *b;    /* bf16 [rows, C] */
    int c, g;
} Acts;

static void acts_alloc(Acts *a, int kind, const float *f, int rows, int c, int g) {
    memset(a, 0, sizeof *a);
    a->f = f, a->c = c, a->g = g;
    if (kind == DOT_BF16) a->b = malloc(sizeof(uint16_t) * (size_t)rows * c);
}

static void acts_free(Acts *a) { free(a->b); }

static void acts_prep_row(const Acts *a, int r) {
    if (a->b) row_to_bf16(a->f + (size_t)r * a->c, a->c, a->b + (size_t)r * a->c);
}

/* per-thread pointer arrays to the m activation rows of one expert */
typedef struct {
    const float **f;
    const uint16_t **b;
} Rows;

static void rows_set(Rows *rw, const Acts *a, const int *idx, int m) {
    for (int j = 0; j < m; j++) {
        const size_t r = (size_t)idx[j];
        rw->f[j] = a->f + r * a->c;
        if (a->b) rw->b[j] = a->b + r * a->c;
    }
}

static void dots(int kind, int fisa, const uint8_t *row, int wdtype, const Acts *a, const Rows *rw, int m,
                 float *res, float *buf) {
    if (kind == DOT_BF16) {
        dots_bf16(row, a->c, rw->b, m, res);
        return;
    }
    if (fisa == 2)
        row_dots_avx512(row, wdtype, a->c, a->g, rw->f, m, res, buf);
    else if (fisa == 1)
        row_dots_avx2(row, wdtype, a->c, a->g, rw->f, m, res, buf);
    else
        row_dots_generic(row, wdtype, a->c, a->g, rw->f, m, res, buf);
}

static int dot_kind(int caps, int wdtype, int h_, int i_, int g13, int g2, int qact) {
    if ((wdtype == 1 || wdtype == 2) && qact && g13 % 64 == 0 && g2 % 64 == 0) {
        if ((caps & CAP_AVX512) && (caps & CAP_VNNI)) return DOT_QVNNI;
        if (caps & CAP_AVX2) return DOT_QAVX2;
    }
    if (wdtype == 0 && (caps & CAP_AVX512) && (caps & CAP_BF16) && h_ % 64 == 0 && i_ % 64 == 0) return DOT_BF16;
    return DOT_F32;
}

/* Which dot products moe_decode would use (for logs and tests): a DOT_* value. */
int moe_dot_kind(int caps, int wdtype, int h_, int i_, int g13, int g2, int qact) {
    return dot_kind(caps, wdtype, h_, i_, g13, g2, qact);
}

/* moe_decode for the integer dot kinds only, with bf16 or fp32 activations in (xbf16) and out
 * (obf16) and its own scratch: no conversions around the call. Returns -2 when the format and
 * CPU do not take integer dots (moe_dot_kind), else as moe_decode. */
int moe_decode_q(const void *x, int xbf16, const int64_t *slot_ids, const float *weights, int t_, int k_, int s_,
                 const uint8_t *w13, long row13, const uint8_t *w2, long row2, int h_, int i_, int wdtype, int g13,
                 int g2, void *out, int obf16, int nthreads, int caps) {
    const int kind = dot_kind(caps, wdtype, h_, i_, g13, g2, 1);
    if (kind != DOT_QVNNI && kind != DOT_QAVX2) return -2;
    return moe_decode_tiles(x, xbf16, slot_ids, weights, t_, k_, s_, w13, row13, w2, row2, h_, i_, wdtype == 2, g13,
                            g2, NULL, out, obf16, nthreads, kind == DOT_QVNNI);
}

/* n int32 slot ids (the wire's) widened to int64 (malloc'd: the caller frees) */
static int64_t *widen_ids(const int32_t *ids, int n) {
    int64_t *wide = malloc(sizeof(int64_t) * (size_t)(n > 0 ? n : 1));
    for (int p = 0; p < n; p++) wide[p] = ids[p];
    return wide;
}

/* moe_decode_q with its 20 arguments in one int64 block, in order (ctypes converts one
 * argument instead of 20 per call; under a cold cache each conversion costs microseconds), then
 * a[20]: the slot ids are int32 (the wire's), widened here rather than by a torch call */
int moe_decode_qa(const int64_t *a) {
    int64_t *wide = a[20] ? widen_ids((const int32_t *)a[2], (int)a[4] * (int)a[5]) : NULL;
    const int64_t *ids = wide ? wide : (const int64_t *)a[2];
    const int rc = moe_decode_q((const void *)a[0], (int)a[1], ids, (const float *)a[3], (int)a[4], (int)a[5], (int)a[6],
                                (const uint8_t *)a[7], (long)a[8], (const uint8_t *)a[9], (long)a[10], (int)a[11],
                                (int)a[12], (int)a[13], (int)a[14], (int)a[15], (void *)a[16], (int)a[17], (int)a[18],
                                (int)a[19]);
    free(wide);
    return rc;
}

/* x [T, H] fp32; slot_ids [T, K] int64 (-1 = not here); weights [T, K] fp32; out [T, H] fp32.
 * w13 [S, 2I, row13 bytes], w2 [S, H, row2 bytes]; act scratch [T*K, I] fp32.
 * Returns 0, or -1 when a slot id is out of range (nothing written then). */
int moe_decode(const float *x, const int64_t *slot_ids, const float *weights, int t_, int k_, int s_,
               const uint8_t *w13, long row13, const uint8_t *w2, long row2, int h_, int i_, int rb,
               int wdtype, int g13, int g2, float *act, float *out, int nthreads, int caps, int qact) {
    const int kind = dot_kind(caps, wdtype, h_, i_, g13, g2, qact);
    if (kind == DOT_QVNNI || kind == DOT_QAVX2) /* tiled int8/int4 (G % 64 == 0 implies it) */
        return moe_decode_tiles(x, 0, slot_ids, weights, t_, k_, s_, w13, row13, w2, row2, h_, i_, wdtype == 2, g13,
                                g2, act, out, 0, nthreads, kind == DOT_QVNNI);
    const int n = t_ * k_;
    Sorted so;
    if (sort_pairs(slot_ids, weights, t_, k_, s_, &so)) return -1;
    const int fisa = (caps & CAP_AVX512) ? 2 : (caps & CAP_AVX2) ? 1 : 0;
    /* tiled quantised matrices: each row is dequantised to fp32 first, then dotted as fp32 */
    const int t13 = q_tiled(wdtype, 2L * i_, g13), t2 = q_tiled(wdtype, h_, g2);
    Acts ax, aa;
    acts_alloc(&ax, kind, x, t_, h_, wdtype == 1 || wdtype == 2 ? g13 : 1);
    acts_alloc(&aa, kind, act, n, i_, wdtype == 1 || wdtype == 2 ? g2 : 1);
    int *pairs = malloc(sizeof(int) * (size_t)(n > 0 ? n : 1)); /* identity: act rows of a slot */
    for (int p = 0; p < n; p++) pairs[p] = p;
    memset(out, 0, sizeof(float) * (size_t)t_ * h_);
    const int nblk = i_ / rb;
    const long items1 = (long)so.na * nblk;
    const int prep = kind != DOT_F32;
#pragma omp parallel num_threads(nthreads)
    {
        float *buf = malloc(sizeof(float) * (size_t)(h_ > i_ ? h_ : i_));
        float *rowf = malloc(sizeof(float) * (size_t)(h_ > i_ ? h_ : i_)); /* a tiled row in fp32 */
        const size_t np = (size_t)(n > 0 ? n : 1);
        Rows rw = {malloc(sizeof(void *) * np), malloc(sizeof(void *) * np)};
        float *res = malloc(sizeof(float) * np);
        if (prep) {
#pragma omp for schedule(static)
            for (int t = 0; t < t_; t++) acts_prep_row(&ax, t);
        }
        /* NOTE: dynamic: a team's threads may wake late (libgomp spins only briefly once more
         * threads than CPUs exist: the host link's thread has a team of its own beside the
         * server's), and a static share waits for its slowest thread; each thread's writes
         * stay its own, so the result does not depend on the order */
#pragma omp for schedule(dynamic, 1)
        for (long it = 0; it < items1; it++) {
            const int s = so.active[it / nblk], b = (int)(it % nblk);
            const uint8_t *base = w13 + ((size_t)s * 2 * i_ + (size_t)b * 2 * rb) * row13;
            const int m = so.start[s + 1] - so.start[s];
            rows_set(&rw, &ax, so.tok + so.start[s], m);
            for (int r = 0; r < 2 * rb; r++) {
                if (t13) {
                    qrow_to_f32_any(fisa, w13 + (size_t)s * 2 * i_ * row13, row13, (long)b * 2 * rb + r, 1, wdtype, h_,
                                    g13, rowf);
                    dots(kind, fisa, (const uint8_t *)rowf, 3, &ax, &rw, m, res, buf);
                } else {
                    dots(kind, fisa, base + (size_t)r * row13, wdtype, &ax, &rw, m, res, buf);
                }
                for (int j = 0; j < m; j++) {
                    float *a = &act[(size_t)(so.start[s] + j) * i_ + b * rb + (r % rb)];
                    if (r < rb)
                        *a = res[j];
                    else
                        *a = (*a / (1.0f + expf(-*a))) * res[j]; /* silu(gate) * up */
                }
            }
        }
        /* implicit barrier: all of act is ready */
        if (prep) {
#pragma omp for schedule(static)
            for (int p = 0; p < n; p++) acts_prep_row(&aa, p);
        }
#pragma omp for schedule(dynamic, 16)
        for (int h = 0; h < h_; h++) {
            for (int ai = 0; ai < so.na; ai++) {
                const int s = so.active[ai];
                const int m = so.start[s + 1] - so.start[s];
                rows_set(&rw, &aa, pairs + so.start[s], m);
                if (t2) {
                    qrow_to_f32_any(fisa, w2 + (size_t)s * h_ * row2, row2, h, 1, wdtype, i_, g2, rowf);
                    dots(kind, fisa, (const uint8_t *)rowf, 3, &aa, &rw, m, res, buf);
                } else {
                    dots(kind, fisa, w2 + ((size_t)s * h_ + h) * row2, wdtype, &aa, &rw, m, res, buf);
                }
                for (int j = 0; j < m; j++)
                    out[(size_t)so.tok[so.start[s] + j] * h_ + h] += so.wt[so.start[s] + j] * res[j];
            }
        }
        free(buf), free(rowf), free(res);
        free(rw.f), free(rw.b);
    }
    acts_free(&ax), acts_free(&aa), free(pairs);
    sorted_free(&so);
    return 0;
}

/* Dequantise one matrix's rows [R, row bytes] (tiled or not) into fp32 [R, C] (the prefill
 * path's GEMM input). */
void dequant_rows(const uint8_t *rows, long rowbytes, int r_, int c, int wdtype, int g, float *out, int nthreads,
                  int caps) {
    const int fisa = (caps & CAP_AVX512) ? 2 : (caps & CAP_AVX2) ? 1 : 0, tiled = q_tiled(wdtype, r_, g);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int r = 0; r < r_; r++) qrow_to_f32_any(fisa, rows, rowbytes, r, tiled, wdtype, c, g, out + (size_t)r * c);
}

#include "moe_amx.c"
#include "moe_amx_int8.c"
#include "moe_amx_driver.c"
#include "moe_hostlink.c"
