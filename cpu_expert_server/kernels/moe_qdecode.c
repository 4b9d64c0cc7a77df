/* Decode-shaped MoE over tiled int8/int4 experts with int8 activations (included by moe_gemv.c,
 * whose moe_decode hands the integer dot kinds here; the block kernels are in moe_qdot.c).
 *
 * Shapes: T tokens, K top-k, H hidden, I intermediate, n = T*K (token, expert) pairs; w13 rows
 * come interleaved in blocks of 16 gate then 16 up rows (RB = 16), so the gate and up halves of
 * 16 intermediate features are two consecutive tiled blocks.
 *
 * Each token's activations are quantised once (per group of the weights); phase 1 splits
 * (expert, 16-feature block) items statically, so a thread's items are one contiguous run of
 * the experts' rows, and writes silu(gate) * up; the intermediate rows are quantised once per
 * pair; phase 2 gives each thread a contiguous range of 16-row output blocks and streams every
 * active expert's rows of that range (one writer per output element, no atomics).
 */
#include <omp.h>

/* bytes ahead of the rows being read that the block kernels prefetch: the hardware prefetchers
 * stop at 4 KiB pages, one block step is 512-1024 bytes; EXPERTMESH_QDOT_PF overrides (0 = off) */
#ifndef QDOT_PREFETCH
#define QDOT_PREFETCH 2048
#endif

typedef void (*BlkFn)(const uint8_t *, int, int, int, const QAct *, int, float *, int);

/* quantised activation rows [rows, c] in groups of g */
typedef struct {
    int8_t *q;
    float *s;
    int32_t *n;
    int c, g;
} QRows;

static void qrows_alloc(QRows *a, int rows, int c, int g) {
    const size_t r = (size_t)(rows > 0 ? rows : 1);
    a->c = c, a->g = g;
    a->q = malloc(r * c);
    a->s = malloc(sizeof(float) * r * (c / g));
    a->n = malloc(sizeof(int32_t) * r * (c / g));
}

static void qrows_free(QRows *a) { free(a->q), free(a->s), free(a->n); }

static void qrows_put(const QRows *a, const float *x, int r) {
    const size_t ng = (size_t)(a->c / a->g);
    quant_act_n(x + (size_t)r * a->c, a->c, a->g, a->q + (size_t)r * a->c, a->s + r * ng, a->n + r * ng);
}

static QAct qrows_at(const QRows *a, int r) {
    const size_t ng = (size_t)(a->c / a->g);
    return (QAct){a->q + (size_t)r * a->c, a->s + r * ng, a->n + r * ng};
}

/* EXPERTMESH_QDOT_SPLIT (benchmarks): 0 = the static split described above (the default, the one
 * measured in RESULTS.md), 1 = dynamic: phase 1 items in chunks of 4 and phase 2 output blocks in
 * pairs handed out as threads free up (the T=1 profile showed 20-90 us per phase between the first
 * and the last thread of the static split; untimed on the device so far). Same results bit for
 * bit: each output element is summed in the same order either way. */
static int qdot_split(void) {
    const char *e = getenv("EXPERTMESH_QDOT_SPLIT");
    return e ? atoi(e) : 0;
}

/* phase 2 for output blocks [hb0, hb1): every active expert's rows of them, summed into o32 [T, H]
 * fp32, then written to out in bf16 when obf16 (the blocks are final) */
static void qdecode_p2(const Sorted *so, const QRows *qa, BlkFn blk, const uint8_t *w2, long row2, int h_, int i_,
                       int u4, int g2, int pf, QAct *xa, float *rg, float *o32, void *out, int obf16, int t_, int hb0,
                       int hb1) {
    for (int ai = 0; ai < so->na; ai++) {
        const int s = so->active[ai], q0 = so->start[s], m = so->start[s + 1] - q0;
        for (int j = 0; j < m; j++) xa[j] = qrows_at(qa, q0 + j);
        for (int hb = hb0; hb < hb1; hb++) {
            blk(w2 + ((size_t)s * h_ + (size_t)hb * 16) * row2, u4, i_, g2, xa, m, rg, pf);
            for (int j = 0; j < m; j++) {
                float *o = o32 + (size_t)so->tok[q0 + j] * h_ + (size_t)hb * 16;
                const float w = so->wt[q0 + j];
                for (int r = 0; r < 16; r++) o[r] += w * rg[j * 16 + r];
            }
        }
    }
    if (obf16)
        for (int t = 0; t < t_; t++)
            for (int c = hb0 * 16; c < hb1 * 16; c++)
                ((uint16_t *)out)[(size_t)t * h_ + c] = to_bf16(o32[(size_t)t * h_ + c]);
}

static int qdot_prefetch(void) {
    const char *e = getenv("EXPERTMESH_QDOT_PF"), *h = getenv("EXPERTMESH_QDOT_PFHINT");
    g_pfhint = h ? atoi(h) : 0;
    return e ? atoi(e) : QDOT_PREFETCH;
}

/* Where the time of the last call went (EXPERTMESH_QDOT_PROFILE=1, for benchmarks): seconds of
 * [0] sort + allocation, [1] entering the parallel region, [2] x quantisation, [3] / [4] the
 * first / last thread's phase 1, [5] the intermediate's quantisation after the last thread,
 * [6] / [7] the first / last thread's phase 2, [8] the rest up to the return. */
#define QPROF_THREADS 256
static double g_prof[9], g_t1[QPROF_THREADS], g_t2[QPROF_THREADS];

void moe_qdot_profile(double *out) { memcpy(out, g_prof, sizeof g_prof); }

/* Same arguments as moe_decode (u4: int4, else int8; both matrices tiled, G % 64 == 0, RB == 16),
 * except: x is bf16 when xbf16 (else fp32); out is written in bf16 when obf16 (else fp32); act may
 * be NULL (scratch allocated here). vnni: the AVX512-VNNI block kernel, else AVX2. Returns 0, or
 * -1 for a bad slot id. */
static int moe_decode_tiles(const void *x, int xbf16, const int64_t *slot_ids, const float *weights, int t_, int k_,
                            int s_, const uint8_t *w13, long row13, const uint8_t *w2, long row2, int h_, int i_,
                            int u4, int g13, int g2, float *act, void *out, int obf16, int nthreads, int vnni) {
    const int prof = getenv("EXPERTMESH_QDOT_PROFILE") != NULL;
    const double ts0 = prof ? omp_get_wtime() : 0.0;
    double ts1 = 0.0, ts2 = 0.0, ts3 = 0.0, ts5 = 0.0;
    const int n = t_ * k_;
    Sorted so;
    if (sort_pairs(slot_ids, weights, t_, k_, s_, &so)) return -1;
    const BlkFn blk = vnni ? blk_vnni : blk_avx2;
    const int pf = qdot_prefetch();
    QRows qx, qa;
    qrows_alloc(&qx, t_, h_, g13);
    qrows_alloc(&qa, n, i_, g2);
    float *act_own = act ? NULL : malloc(sizeof(float) * (size_t)(n > 0 ? n : 1) * i_);
    if (!act) act = act_own;
    float *o32 = obf16 ? malloc(sizeof(float) * (size_t)(t_ > 0 ? t_ : 1) * h_) : (float *)out;
    memset(o32, 0, sizeof(float) * (size_t)t_ * h_);
    const int nblk = i_ / 16, hblk = h_ / 16;
    const long items1 = (long)so.na * nblk;
    const size_t np = (size_t)(n > 0 ? n : 1);
    const int split = qdot_split();
    omp_set_schedule(split ? omp_sched_dynamic : omp_sched_static, split ? 4 : 0); /* phase 1 */
    if (prof) ts1 = omp_get_wtime();
    int nthr = 1;
#pragma omp parallel num_threads(nthreads)
    {
        const int tid0 = omp_get_thread_num();
        if (prof && tid0 == 0) ts2 = omp_get_wtime(), nthr = omp_get_num_threads();
        QAct *xa = malloc(sizeof(QAct) * np);
        float *rg = malloc(sizeof(float) * 16 * np), *ru = malloc(sizeof(float) * 16 * np);
        float *xrow = malloc(sizeof(float) * (size_t)h_);
#pragma omp for schedule(static)
        for (int t = 0; t < t_; t++) {
            const float *xt = (const float *)x + (size_t)t * h_;
            if (xbf16) {
                const uint16_t *xb = (const uint16_t *)x + (size_t)t * h_;
                for (int c = 0; c < h_; c++) {
                    const uint32_t u = (uint32_t)xb[c] << 16;
                    memcpy(xrow + c, &u, sizeof u);
                }
                xt = xrow;
            }
            quant_act_n(xt, h_, g13, qx.q + (size_t)t * h_, qx.s + (size_t)t * (h_ / g13), qx.n + (size_t)t * (h_ / g13));
        }
        if (prof && tid0 == 0) ts3 = omp_get_wtime();
        /* phase 1: the gate and up blocks of one (expert, 16-feature block) -> act */
#pragma omp for schedule(runtime) nowait
        for (long it = 0; it < items1; it++) {
            const int s = so.active[it / nblk], b = (int)(it % nblk);
            const int q0 = so.start[s], m = so.start[s + 1] - q0;
            const uint8_t *gate = w13 + ((size_t)s * 2 * i_ + (size_t)b * 32) * row13;
            for (int j = 0; j < m; j++) xa[j] = qrows_at(&qx, so.tok[q0 + j]);
            blk(gate, u4, h_, g13, xa, m, rg, pf);
            blk(gate + 16 * row13, u4, h_, g13, xa, m, ru, pf);
            for (int j = 0; j < m; j++) {
                float *a = act + (size_t)(q0 + j) * i_ + b * 16;
                for (int r = 0; r < 16; r++) {
                    const float gt = rg[j * 16 + r];
                    a[r] = gt / (1.0f + expf(-gt)) * ru[j * 16 + r]; /* silu(gate) * up */
                }
            }
        }
        if (prof && tid0 < QPROF_THREADS) g_t1[tid0] = omp_get_wtime();
#pragma omp barrier
        /* act is complete */
        /* only the first start[S] rows are pairs of local experts (sorted order) */
#pragma omp for schedule(static)
        for (int p = 0; p < so.start[s_]; p++) qrows_put(&qa, act, p);
        if (prof && tid0 == 0) ts5 = omp_get_wtime();
        /* implicit barrier: every pair's intermediate is quantised */
        if (split) {
#pragma omp for schedule(dynamic, 1) nowait
            for (int hc = 0; hc < (hblk + 1) / 2; hc++)
                qdecode_p2(&so, &qa, blk, w2, row2, h_, i_, u4, g2, pf, xa, rg, o32, out, obf16, t_, 2 * hc,
                           2 * hc + 2 < hblk ? 2 * hc + 2 : hblk);
        } else {
            const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
            qdecode_p2(&so, &qa, blk, w2, row2, h_, i_, u4, g2, pf, xa, rg, o32, out, obf16, t_,
                       (int)((long)hblk * tid / nt), (int)((long)hblk * (tid + 1) / nt));
        }
        if (prof && tid0 < QPROF_THREADS) g_t2[tid0] = omp_get_wtime();
        free(xa), free(rg), free(ru), free(xrow);
    }
    if (obf16) free(o32);
    free(act_own);
    qrows_free(&qx), qrows_free(&qa);
    sorted_free(&so);
    if (prof) {
        double p1lo = 1e30, p1hi = 0.0, p2lo = 1e30, p2hi = 0.0;
        for (int i = 0; i < nthr && i < QPROF_THREADS; i++) {
            p1lo = fmin(p1lo, g_t1[i]), p1hi = fmax(p1hi, g_t1[i]);
            p2lo = fmin(p2lo, g_t2[i]), p2hi = fmax(p2hi, g_t2[i]);
        }
        const double ts7 = omp_get_wtime();
        const double v[9] = {ts1 - ts0, ts2 - ts1, ts3 - ts2, p1lo - ts3, p1hi - ts3, ts5 - p1hi,
                             p2lo - ts5, p2hi - ts5, ts7 - p2hi};
        memcpy(g_prof, v, sizeof v);
    }
    return 0;
}
