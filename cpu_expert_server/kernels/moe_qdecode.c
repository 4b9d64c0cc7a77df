/* Decode-shaped MoE over tiled int8/int4 experts with int8 activations (included by moe_gemv.c,
 * whose moe_decode hands the integer dot kinds here; the block kernels are in moe_qdot.c).
 *
 * Shapes: T tokens, K top-k, H hidden, I intermediate, n = T*K (token, expert) pairs; w13 rows
 * come interleaved in blocks of 16 gate then 16 up rows (RB = 16), so the gate and up halves of
 * 16 intermediate features are two consecutive tiled blocks.
 *
 * Each token's activations are quantised (per group of the weights); phase 1 runs (expert,
 * 16-feature block) items and writes silu(gate) * up; the intermediate rows are quantised once
 * per pair; phase 2 runs 16-row output blocks, each streaming every active expert's rows of that
 * block (one writer per output element, no atomics). How the items are split over the threads
 * is the work split below: by default (mode 5, measured) phase 1 one item at a time with the next
 * one claimed ahead, phase 2 one block at a time from a shared counter, small activations
 * quantised by every thread without a barrier.
 */
#include <omp.h>
#include <sched.h>

/* bytes ahead of the rows being read that the block kernels prefetch: the hardware prefetchers
 * stop at 4 KiB pages, one block step is 512-1024 bytes; EXPERTMESH_QDOT_PF overrides (0 = off) */
#ifndef QDOT_PREFETCH
#define QDOT_PREFETCH 2048
#endif
/* on AVX512-VNNI (with the pair loops): 4 KiB ahead, up to 8% faster than 2 KiB at
 * T = 4 and 16 and within the noise at T = 1 on the lent host (benchmarks/RESULTS.md); AVX2 keeps
 * 2 KiB (its int4 is bound by the dots, not the bandwidth) */
#ifndef QDOT_PREFETCH_VNNI
#define QDOT_PREFETCH_VNNI 4096
#endif

typedef void (*BlkFn)(const uint8_t *, int, int, int, const QAct *, int, float *, int, const uint8_t *);

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

/* row r of x [rows, c] fp32 quantised into row r of a (v512: the AVX-512 quantisation, same bytes) */
static void qrows_put(const QRows *a, const float *x, int r, int v512) {
    const size_t ng = (size_t)(a->c / a->g);
    if (v512)
        quant_act_n_512(x + (size_t)r * a->c, 0, a->c, a->g, a->q + (size_t)r * a->c, a->s + r * ng, a->n + r * ng);
    else
        quant_act_n(x + (size_t)r * a->c, a->c, a->g, a->q + (size_t)r * a->c, a->s + r * ng, a->n + r * ng);
}

static QAct qrows_at(const QRows *a, int r) {
    const size_t ng = (size_t)(a->c / a->g);
    return (QAct){a->q + (size_t)r * a->c, a->s + r * ng, a->n + r * ng};
}

/* Work split (EXPERTMESH_QDOT_SPLIT overrides QDOT_SPLIT_DEFAULT; benchmarks time them side by
 * side): 0 = static: a thread's phase 1 items are one contiguous run of the experts' rows, its
 * phase 2 blocks one contiguous range (the original split); 1 = dynamic: phase 1 items in chunks of 4 and
 * phase 2 output blocks in pairs handed out as threads free up (a T=1 profile showed 20-90 us
 * per phase between the first and the last thread of the static split); 2 = "fused":
 * phase 1 items and phase 2 output blocks one at a time from the shared counter (dynamic, 1),
 * and at small sizes the barriers around the two activation quantisations are gone: every thread
 * quantises the few tokens (T <= QDOT_PRIVATE_T) and, after phase 1, the few intermediate rows
 * (n * I <= QDOT_PRIVATE_ACT) itself, so the threads that wake first start streaming at once;
 * 3 = as 2 with phase 1 guided (large contiguous runs first, single items at the end);
 * 4 = "flow": no barrier between the phases (qdecode_flow below);
 * 5 = "stream": as 3, but phase 1 hands out one item at a time and each thread claims
 * its next item as it starts the current one, so its prefetch runs from one item's end into the
 * next's start (guided's first chunks are a whole static share: on the lent host the first and
 * the last thread finished phase 1 30 us apart at T=1 and 250 us at Qwen3 T=16).
 * Same results bit for bit in every mode: each row is quantised the same way whoever does it,
 * and each output element is summed in the same order. */
/* Measured (benchmarks/RESULTS.md): 12 int8/int4 cells (two models, T = 1/4/16) timed round robin on the
 * lent 16-core host: time vs the static split, geometric mean, 1: 0.906, 2: 0.925, 3: 0.887,
 * 4: 0.904. The default is mode 5 (benchmarks/RESULTS.md). */
#ifndef QDOT_SPLIT_DEFAULT
#define QDOT_SPLIT_DEFAULT 5
#endif
#define QDOT_AHEAD_MIN 2 /* mode 5 claims no item ahead once fewer than this many per thread remain */
#define QDOT_PRIVATE_T 4
#define QDOT_PRIVATE_ACT 16384
static int qdot_split(void) {
    const char *e = getenv("EXPERTMESH_QDOT_SPLIT");
    return e ? atoi(e) : QDOT_SPLIT_DEFAULT;
}

/* token t's activations (bf16 or fp32) -> int8 row t of qx; xrow: fp32 scratch [H] */
static void qdecode_quant_x(const void *x, int xbf16, int t, int h_, int g13, const QRows *qx, float *xrow, int v512) {
    if (v512) {
        const size_t ng = (size_t)(h_ / g13);
        const void *xt = xbf16 ? (const void *)((const uint16_t *)x + (size_t)t * h_)
                               : (const void *)((const float *)x + (size_t)t * h_);
        quant_act_n_512(xt, xbf16, h_, g13, qx->q + (size_t)t * h_, qx->s + (size_t)t * ng, qx->n + (size_t)t * ng);
        return;
    }
    const float *xt = (const float *)x + (size_t)t * h_;
    if (xbf16) {
        const uint16_t *xb = (const uint16_t *)x + (size_t)t * h_;
        for (int c = 0; c < h_; c++) {
            const uint32_t u = (uint32_t)xb[c] << 16;
            memcpy(xrow + c, &u, sizeof u);
        }
        xt = xrow;
    }
    const size_t ng = (size_t)(h_ / g13);
    quant_act_n(xt, h_, g13, qx->q + (size_t)t * h_, qx->s + (size_t)t * ng, qx->n + (size_t)t * ng);
}

/* the gate block of phase 1 item `it` (its up block follows it) */
static inline const uint8_t *qdecode_p1_rows(const Sorted *so, const uint8_t *w13, long row13, int i_, int nblk,
                                             long it) {
    return w13 + ((size_t)so->active[it / nblk] * 2 * i_ + (size_t)(it % nblk) * 32) * row13;
}

/* phase 1 item `it`: the gate and up blocks of one (expert, 16-feature block) -> act; nxt: the
 * next item's rows, where the prefetch runs on after the up block (NULL: the bytes after it) */
static void qdecode_p1(const Sorted *so, const QRows *qx, BlkFn blk, const uint8_t *w13, long row13, int h_, int i_,
                       int u4, int g13, int pf, QAct *xa, float *rg, float *ru, float *act, int nblk, long it,
                       const uint8_t *nxt) {
    const int s = so->active[it / nblk], b = (int)(it % nblk);
    const int q0 = so->start[s], m = so->start[s + 1] - q0;
    const uint8_t *gate = qdecode_p1_rows(so, w13, row13, i_, nblk, it);
    for (int j = 0; j < m; j++) xa[j] = qrows_at(qx, so->tok[q0 + j]);
    blk(gate, u4, h_, g13, xa, m, rg, pf, NULL);
    blk(gate + 16 * row13, u4, h_, g13, xa, m, ru, pf, nxt);
    for (int j = 0; j < m; j++) {
        float *a = act + (size_t)(q0 + j) * i_ + b * 16;
        for (int r = 0; r < 16; r++) {
            const float gt = rg[j * 16 + r];
            a[r] = gt / (1.0f + expf(-gt)) * ru[j * 16 + r]; /* silu(gate) * up */
        }
    }
}

/* Mode 4 ("flow"): no barrier between the phases. One shared counter hands out the
 * phase 1 items (expert-major) and then the phase 2 items (expert, QDOT_FLOW_HB output blocks);
 * the thread that finishes an expert's last phase 1 item quantises that expert's intermediate
 * rows and flags it ready; a phase 2 item waits for its expert's flag (by then every phase 1
 * item is handed out, so it waits only on running work) and writes the expert's unweighted
 * outputs y [pairs, H]; after one barrier each output block sums its experts' y in the order of
 * the other modes (same results bit for bit). */
#define QDOT_FLOW_HB 4
typedef struct {
    long next;   /* the shared counter */
    int *done1;  /* [na] phase 1 items finished per active expert */
    int *ready;  /* [na] intermediate rows quantised */
    float *y;    /* [start[S], H] */
} Flow;

static void qdecode_flow(const Sorted *so, Flow *fl, const QRows *qx, QRows *qa, BlkFn blk, const uint8_t *w13,
                         long row13, const uint8_t *w2, long row2, int h_, int i_, int u4, int g13, int g2, int pf,
                         int v512, QAct *xa, float *rg, float *ru, float *act, int nblk, long items1) {
    const int hblk = h_ / 16, nh2 = (hblk + QDOT_FLOW_HB - 1) / QDOT_FLOW_HB;
    const long items = items1 + (long)so->na * nh2;
    for (;;) {
        const long it = __atomic_fetch_add(&fl->next, 1, __ATOMIC_RELAXED);
        if (it >= items) break;
        if (it < items1) {
            qdecode_p1(so, qx, blk, w13, row13, h_, i_, u4, g13, pf, xa, rg, ru, act, nblk, it, NULL);
            const int ai = (int)(it / nblk), s = so->active[ai];
            if (__atomic_add_fetch(&fl->done1[ai], 1, __ATOMIC_ACQ_REL) == nblk) {
                for (int p = so->start[s]; p < so->start[s + 1]; p++) qrows_put(qa, act, p, v512);
                __atomic_store_n(&fl->ready[ai], 1, __ATOMIC_RELEASE);
            }
            continue;
        }
        const int ai = (int)((it - items1) / nh2), hc = (int)((it - items1) % nh2);
        for (int spin = 1; !__atomic_load_n(&fl->ready[ai], __ATOMIC_ACQUIRE); spin++) {
            _mm_pause();
            if (spin % 256 == 0) sched_yield(); /* oversubscribed hosts: let the producer run */
        }
        const int s = so->active[ai], q0 = so->start[s], m = so->start[s + 1] - q0;
        for (int j = 0; j < m; j++) xa[j] = qrows_at(qa, q0 + j);
        const int hb1 = (hc + 1) * QDOT_FLOW_HB < hblk ? (hc + 1) * QDOT_FLOW_HB : hblk;
        for (int hb = hc * QDOT_FLOW_HB; hb < hb1; hb++) {
            blk(w2 + ((size_t)s * h_ + (size_t)hb * 16) * row2, u4, i_, g2, xa, m, rg, pf, NULL);
            for (int j = 0; j < m; j++) memcpy(fl->y + (size_t)(q0 + j) * h_ + (size_t)hb * 16, rg + j * 16, 64);
        }
    }
}

/* mode 4's sum of output block hb: every active expert's y rows, weighted, in expert order */
static void qdecode_flow_sum(const Sorted *so, const float *y, float *o32, void *out, int obf16, int t_, int h_,
                             int hb) {
    for (int ai = 0; ai < so->na; ai++) {
        const int s = so->active[ai], q0 = so->start[s], m = so->start[s + 1] - q0;
        for (int j = 0; j < m; j++) {
            float *o = o32 + (size_t)so->tok[q0 + j] * h_ + (size_t)hb * 16;
            const float w = so->wt[q0 + j], *v = y + (size_t)(q0 + j) * h_ + (size_t)hb * 16;
            for (int r = 0; r < 16; r++) o[r] += w * v[r];
        }
    }
    if (obf16)
        for (int t = 0; t < t_; t++)
            for (int c = hb * 16; c < hb * 16 + 16; c++)
                ((uint16_t *)out)[(size_t)t * h_ + c] = to_bf16(o32[(size_t)t * h_ + c]);
}

/* phase 2 for output blocks [hb0, hb1): every active expert's rows of them, summed into o32 [T, H]
 * fp32, then written to out in bf16 when obf16 (the blocks are final). chain: the prefetch runs
 * on from an expert's last block of the range into the next expert's first (pf_at) */
static void qdecode_p2(const Sorted *so, const QRows *qa, BlkFn blk, const uint8_t *w2, long row2, int h_, int i_,
                       int u4, int g2, int pf, int chain, QAct *xa, float *rg, float *o32, void *out, int obf16,
                       int t_, int hb0, int hb1) {
    for (int ai = 0; ai < so->na; ai++) {
        const int s = so->active[ai], q0 = so->start[s], m = so->start[s + 1] - q0;
        const uint8_t *nxt =
            chain && ai + 1 < so->na ? w2 + ((size_t)so->active[ai + 1] * h_ + (size_t)hb0 * 16) * row2 : NULL;
        for (int j = 0; j < m; j++) xa[j] = qrows_at(qa, q0 + j);
        for (int hb = hb0; hb < hb1; hb++) {
            blk(w2 + ((size_t)s * h_ + (size_t)hb * 16) * row2, u4, i_, g2, xa, m, rg, pf, hb + 1 < hb1 ? NULL : nxt);
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

/* Benchmark switches, read per call: EXPERTMESH_QDOT_CHAIN=0/1 phase 2's prefetch
 * chained into the next expert's block (qdecode_p2; default on: int4 1-5% faster in 5 of 6 cells
 * on the lent host, benchmarks/RESULTS.md); EXPERTMESH_QDOT_CLAIM=N: in the dynamic modes (2, 3,
 * 5) a thread that finishes phase 1 while others still run claims up to N phase 2 output blocks
 * from the shared counter and prefetches their rows into its L2 while it waits at the barrier
 * (memory bandwidth otherwise idle in the phase 1 tail); it computes them first after it. Off by
 * default: with 2 claims int4 was 3% faster at Qwen3 T=1 but 5% slower at T=4 and T=16, the
 * geometric mean within 1% of none. */
#ifndef QDOT_CHAIN_DEFAULT
#define QDOT_CHAIN_DEFAULT 1
#endif
#ifndef QDOT_CLAIM_DEFAULT
#define QDOT_CLAIM_DEFAULT 0
#endif
#define QDOT_CLAIM_MAX 16
static int env_int(const char *name, int dflt) {
    const char *e = getenv(name);
    return e ? atoi(e) : dflt;
}

/* the active experts' rows of output block hb towards this core's L2, expert by expert until
 * every thread is done with phase 1 (*done1 == nt: the bandwidth is phase 2's again, and the
 * barrier waits for no prefetching) */
static void qdecode_pf2(const Sorted *so, const uint8_t *w2, long row2, int h_, int hb, const int *done1, int nt) {
    for (int ai = 0; ai < so->na && __atomic_load_n(done1, __ATOMIC_ACQUIRE) < nt; ai++) {
        const uint8_t *b = w2 + ((size_t)so->active[ai] * h_ + (size_t)hb * 16) * row2;
        for (long l = 0; l < 16 * row2; l += 64) _mm_prefetch((const char *)(b + l), _MM_HINT_T1);
    }
}

static int qdot_prefetch(int vnni) {
    const char *e = getenv("EXPERTMESH_QDOT_PF"), *h = getenv("EXPERTMESH_QDOT_PFHINT");
    g_pfhint = h ? atoi(h) : 0;
    return e ? atoi(e) : vnni ? QDOT_PREFETCH_VNNI : QDOT_PREFETCH;
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
    const int pf = qdot_prefetch(vnni);
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
    /* the activations' quantisation in AVX-512 where the dots are VNNI (EXPERTMESH_QDOT_Q512=0: the
     * scalar one; benchmarks) */
    const int v512 = vnni && env_int("EXPERTMESH_QDOT_Q512", 1);
    const int chain = env_int("EXPERTMESH_QDOT_CHAIN", QDOT_CHAIN_DEFAULT);
    g_qpair = env_int("EXPERTMESH_QDOT_PAIR", 1); /* blk_vnni's pair loops (moe_qdot.c) */
    const int claim_n = env_int("EXPERTMESH_QDOT_CLAIM", QDOT_CLAIM_DEFAULT);
    const int claim = claim_n < 0 ? 0 : claim_n > QDOT_CLAIM_MAX ? QDOT_CLAIM_MAX : claim_n;
    int next2 = 0, done1 = 0; /* the dynamic modes' phase 2 counter; threads done with phase 1 */
    long next1 = 0;           /* mode 5's phase 1 counter */
    static const omp_sched_t sched1[6] = {omp_sched_static, omp_sched_dynamic, omp_sched_dynamic, omp_sched_guided,
                                          omp_sched_dynamic};
    static const int chunk1[6] = {0, 4, 1, 1, 1, 1};
    const int sm = split < 0 || split > 5 ? 0 : split;
    /* fused modes: private quantisations where they are cheaper than a barrier (mode 4 quantises
     * the intermediate rows per expert as they complete) */
    const int priv_x = sm >= 2 && t_ <= QDOT_PRIVATE_T;
    const int priv_a = (sm == 2 || sm == 3 || sm == 5) && (long)so.start[s_] * i_ <= QDOT_PRIVATE_ACT;
    Flow fl = {0, NULL, NULL, NULL};
    if (sm == 4) {
        fl.done1 = calloc((size_t)so.na + 1, sizeof(int));
        fl.ready = calloc((size_t)so.na + 1, sizeof(int));
        fl.y = malloc(sizeof(float) * (size_t)(so.start[s_] > 0 ? so.start[s_] : 1) * h_);
    }
    omp_set_schedule(sched1[sm], chunk1[sm]); /* phase 1 */
    if (prof) ts1 = omp_get_wtime();
    int nthr = 1;
#pragma omp parallel num_threads(nthreads)
    {
        const int tid0 = omp_get_thread_num();
        if (prof && tid0 == 0) ts2 = omp_get_wtime(), nthr = omp_get_num_threads();
        QAct *xa = malloc(sizeof(QAct) * np);
        float *rg = malloc(sizeof(float) * 16 * np), *ru = malloc(sizeof(float) * 16 * np);
        float *xrow = malloc(sizeof(float) * (size_t)h_);
        QRows qxp, qap; /* this thread's own copies (fused mode, small sizes) */
        const QRows *qxs = &qx, *qas = &qa;
        if (priv_x) {
            qrows_alloc(&qxp, t_, h_, g13);
            for (int t = 0; t < t_; t++) qdecode_quant_x(x, xbf16, t, h_, g13, &qxp, xrow, v512);
            qxs = &qxp;
        } else {
#pragma omp for schedule(static)
            for (int t = 0; t < t_; t++) qdecode_quant_x(x, xbf16, t, h_, g13, &qx, xrow, v512);
        }
        if (prof && tid0 == 0) ts3 = omp_get_wtime();
        if (sm == 4) {
            qdecode_flow(&so, &fl, qxs, &qa, blk, w13, row13, w2, row2, h_, i_, u4, g13, g2, pf, v512, xa, rg, ru, act,
                         nblk, items1);
            if (prof && tid0 < QPROF_THREADS) g_t1[tid0] = omp_get_wtime();
            if (prof && tid0 < QPROF_THREADS) g_t2[tid0] = g_t1[tid0];
#pragma omp barrier
            if (prof && tid0 == 0) ts5 = omp_get_wtime();
#pragma omp for schedule(static)
            for (int hb = 0; hb < hblk; hb++) qdecode_flow_sum(&so, fl.y, o32, out, obf16, t_, h_, hb);
        } else {
            /* phase 1: the gate and up blocks of one (expert, 16-feature block) -> act */
            if (sm == 5) {
                /* one item at a time from the shared counter, the next one claimed when the
                 * current one starts (while more than QDOT_AHEAD_MIN per thread remain), so the
                 * prefetch runs from one item's end into the next */
                const long ahead_to = items1 - (long)QDOT_AHEAD_MIN * omp_get_num_threads();
                long cur = __atomic_fetch_add(&next1, 1, __ATOMIC_RELAXED);
                while (cur < items1) {
                    const long nx = cur < ahead_to ? __atomic_fetch_add(&next1, 1, __ATOMIC_RELAXED) : items1;
                    const uint8_t *nxt = nx < items1 ? qdecode_p1_rows(&so, w13, row13, i_, nblk, nx) : NULL;
                    qdecode_p1(&so, qxs, blk, w13, row13, h_, i_, u4, g13, pf, xa, rg, ru, act, nblk, cur, nxt);
                    cur = nx < items1 ? nx : __atomic_fetch_add(&next1, 1, __ATOMIC_RELAXED);
                }
            } else {
#pragma omp for schedule(runtime) nowait
                for (long it = 0; it < items1; it++)
                    qdecode_p1(&so, qxs, blk, w13, row13, h_, i_, u4, g13, pf, xa, rg, ru, act, nblk, it, NULL);
            }
            if (prof && tid0 < QPROF_THREADS) g_t1[tid0] = omp_get_wtime();
            int claimed[QDOT_CLAIM_MAX], nc = 0;
            if (claim && sm >= 2) {
                const int nt = omp_get_num_threads();
                __atomic_add_fetch(&done1, 1, __ATOMIC_ACQ_REL);
                while (nc < claim && __atomic_load_n(&done1, __ATOMIC_ACQUIRE) < nt) {
                    const int hb = __atomic_fetch_add(&next2, 1, __ATOMIC_RELAXED);
                    if (hb >= hblk) break;
                    claimed[nc++] = hb;
                    qdecode_pf2(&so, w2, row2, h_, hb, &done1, nt);
                }
            }
#pragma omp barrier
            /* act is complete */
            /* only the first start[S] rows are pairs of local experts (sorted order) */
            if (priv_a) {
                qrows_alloc(&qap, so.start[s_], i_, g2);
                for (int p = 0; p < so.start[s_]; p++) qrows_put(&qap, act, p, v512);
                qas = &qap;
            } else {
#pragma omp for schedule(static)
                for (int p = 0; p < so.start[s_]; p++) qrows_put(&qa, act, p, v512);
                /* implicit barrier: every pair's intermediate is quantised */
            }
            if (prof && tid0 == 0) ts5 = omp_get_wtime();
            if (sm >= 2) {
                /* one output block at a time from the shared counter (the claimed ones first) */
                for (int c = 0; c < nc; c++)
                    qdecode_p2(&so, qas, blk, w2, row2, h_, i_, u4, g2, pf, chain, xa, rg, o32, out, obf16, t_,
                               claimed[c], claimed[c] + 1);
                for (;;) {
                    const int hb = __atomic_fetch_add(&next2, 1, __ATOMIC_RELAXED);
                    if (hb >= hblk) break;
                    qdecode_p2(&so, qas, blk, w2, row2, h_, i_, u4, g2, pf, chain, xa, rg, o32, out, obf16, t_, hb,
                               hb + 1);
                }
            } else if (sm == 1) {
#pragma omp for schedule(dynamic, 1) nowait
                for (int hc = 0; hc < (hblk + 1) / 2; hc++)
                    qdecode_p2(&so, qas, blk, w2, row2, h_, i_, u4, g2, pf, chain, xa, rg, o32, out, obf16, t_,
                               2 * hc, 2 * hc + 2 < hblk ? 2 * hc + 2 : hblk);
            } else {
                const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
                qdecode_p2(&so, qas, blk, w2, row2, h_, i_, u4, g2, pf, chain, xa, rg, o32, out, obf16, t_,
                           (int)((long)hblk * tid / nt), (int)((long)hblk * (tid + 1) / nt));
            }
            if (prof && tid0 < QPROF_THREADS) g_t2[tid0] = omp_get_wtime();
        }
        if (priv_x) qrows_free(&qxp);
        if (priv_a) qrows_free(&qap);
        free(xa), free(rg), free(ru), free(xrow);
    }
    free(fl.done1), free(fl.ready), free(fl.y);
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
