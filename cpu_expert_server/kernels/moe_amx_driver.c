/* Prefill-shaped MoE on AMX tiles: one call per layer runs both GEMMs of every active expert, on
 * bf16 tiles (moe_amx) or int8 tiles (moe_amx_q); included by moe_gemv.c after moe_amx.c and
 * moe_amx_int8.c, whose tile blocks this driver runs.
 *
 * Shapes as moe_gemv.c; a token tile = up to 16 (token, expert) pairs of one expert, zero-padded.
 *   gather:  each active expert's tokens -> its token tiles (B layout), over all of H
 *   phase 1: blocks (expert, 16 gate + 16 up rows): silu(gate) * up -> phase 2's B tiles (bf16:
 *            written straight into the pair layout; int8: fp32 rows, then quantised per pair)
 *   phase 2: blocks (expert, 32 output rows) -> out += weight * result; each thread owns a range of
 *            output rows over all experts, so every output element has one writer (no atomics)
 * Blocks are walked expert-major, so consecutive blocks of a thread are adjacent rows and an
 * expert's B tiles stay in L2 across its blocks; how the blocks are split and prefetched depends on
 * the call's shape (below, "Work split").
 */
#include <omp.h>

typedef struct {
    Sorted so;
    int ntiles;
    int *tile0;  /* [na + 1] first token tile of each active expert */
    int *tile_a; /* [ntiles] active expert (index into so.active) of each tile */
} TilePlan;

static void plan_free(TilePlan *p) { free(p->tile0), free(p->tile_a), sorted_free(&p->so); }

/* Returns -1 (nothing allocated) for a slot id outside [-1, S). */
static int plan_tiles(const int64_t *slot_ids, const float *weights, int t_, int k_, int s_, TilePlan *p) {
    if (sort_pairs(slot_ids, weights, t_, k_, s_, &p->so)) return -1;
    const Sorted *so = &p->so;
    p->tile0 = malloc(sizeof(int) * ((size_t)so->na + 1));
    p->ntiles = 0;
    for (int a = 0; a < so->na; a++) {
        p->tile0[a] = p->ntiles;
        p->ntiles += (so->start[so->active[a] + 1] - so->start[so->active[a]] + 15) / 16;
    }
    p->tile0[so->na] = p->ntiles;
    p->tile_a = malloc(sizeof(int) * ((size_t)p->ntiles + 1));
    for (int a = 0; a < so->na; a++)
        for (int tl = p->tile0[a]; tl < p->tile0[a + 1]; tl++) p->tile_a[tl] = a;
    return 0;
}

/* first sorted pair of token tile tl, and how many of its 16 slots hold pairs */
static inline int tile_first(const TilePlan *p, int tl, int *n) {
    const int s = p->so.active[p->tile_a[tl]];
    const int q0 = p->so.start[s] + (tl - p->tile0[p->tile_a[tl]]) * 16, end = p->so.start[s + 1];
    *n = end - q0 < 16 ? end - q0 : 16;
    return q0;
}

/* B tiles of one side (bf16: a k step = 16 pairs; int8: 16 quads, plus group scales) */
static void btiles_alloc(QTiles *q, int kind, int use, int ntiles, int c, int g) {
    if (kind == TILES_BF16) {
        memset(q, 0, sizeof *q);
        q->ksteps = c / 32, q->groups = 1;
        q->mem = q->b = kept_buffer(use, ((size_t)ntiles * q->ksteps * 256 + 16) * 4, &q->owned);
    } else {
        qtiles_alloc(q, use, ntiles, c, g);
    }
}

/* token tile tl of q <- the 16 rows src[j] (bf16 pairs or int8 quads as 32-bit words, ksteps * 16
 * words each; padding slots point at a zero row), k step by k step: each 1 KiB step is written
 * whole while it sits in L1 (token by token, a 64 KiB tile's lines were written 16 times over
 * from L2: the gather was ~1.2 ms of a 21 ms Qwen3 T=512 call) */
__attribute__((target(AMX_TARGET))) static void btiles_fill_steps(const QTiles *q, int tl, const uint32_t *const *src,
                                                                  int ks0, int ks1) {
    uint32_t *dst = q->b + ((size_t)tl * q->ksteps + ks0) * 256;
    for (int ks = ks0; ks < ks1; ks++, dst += 256) {
        /* a k step is the 16 rows' words (ks - ks0) * 16 .. + 15, transposed (in registers: one
         * word at a time it was 512 scalar loads and stores a step) */
        const float *rows[16];
        for (int j = 0; j < 16; j++) rows[j] = (const float *)(src[j] + (ks - ks0) * 16);
        transpose16_rows(rows, (float *)dst);
    }
}

__attribute__((target(AMX_TARGET))) static void btiles_fill(const QTiles *q, int tl, const uint32_t *const *src) {
    btiles_fill_steps(q, tl, src, 0, q->ksteps);
}

/* quant_act in AVX-512 (quant_act_n_512 rounds as quant_group: the same bytes), from fp32 x or
 * bf16 (xbf16: the same bytes as from the row widened to fp32, which is exact). quant_act itself
 * is built for the baseline x86-64: with it, the pass that quantised the intermediates took
 * 0.5-0.6 ms of a 7 ms T=512 call (Qwen3 int4, profile build). The emulated build keeps it (AVX2
 * machines). */
__attribute__((target(AMX_TARGET))) static void quant_act_amx(const void *x, int xbf16, int c, int g, int8_t *q,
                                                              float *sc, float *cs) {
#ifdef EXPERTMESH_AMX_EMULATE
    float *f = xbf16 ? malloc(sizeof(float) * (size_t)c) : NULL;
    if (f) row_to_f32(x, 0, c, 1, f);
    quant_act(f ? f : x, c, g, q, sc, cs);
    free(f);
#else
    int32_t n[c / g];
    quant_act_n_512(x, xbf16, c, g, q, sc, n);
    for (int gi = 0; gi < c / g; gi++) cs[gi] = sc[gi] * (float)n[gi];
#endif
}

/* What a call runs on: kind of tiles, the packed weights, per-thread scratch. */
typedef struct {
    int kind, wdtype, h, i, g13, g2;
    const uint8_t *w13, *w2;
    long row13, row2;
} AmxCall;

typedef struct {
    float *c;          /* [(AMX_MT + 1) / 2][1024] block result (a pair of token tiles: 1024) */
    int32_t *cb;       /* [4][1024] int tiles of four groups (q_block) */
    float *tmp;        /* [max(H, I)] */
    uint16_t *wq;      /* [32, max(H, I)] quantised rows as bf16 (bf16 tiles only) */
    uint8_t *nib;      /* [32, max(H, I)] int4 nibbles (fused unpack: its first 4 KiB) */
} Scratch;

static void scratch_alloc(Scratch *sc, const AmxCall *cl) {
    const size_t cmax = (size_t)(cl->h > cl->i ? cl->h : cl->i);
    const int quant = cl->wdtype == 1 || cl->wdtype == 2;
    sc->c = aligned_alloc(64, sizeof(float) * 1024 * (AMX_MT > 2 ? (AMX_MT + 1) / 2 : 1));
    sc->cb = aligned_alloc(64, sizeof(int32_t) * 4096);
    sc->tmp = malloc(sizeof(float) * cmax);
    /* whole blocks dequantised to bf16: int8, and int4 unless it goes step by step (a_rows) */
    const int u4_steps = cl->wdtype == 2 && AMX_U4_FUSED && q_tiled(2, 2L * cl->i, cl->g13) && q_tiled(2, cl->h, cl->g2);
    sc->wq = cl->kind == TILES_BF16 && quant && !u4_steps ? malloc(sizeof(uint16_t) * 32 * cmax) : NULL;
    /* 32 rows of nibbles, and at least the ring a fused unpack uses (q_block_multi's: 16 KiB);
     * bf16 tiles: the 8 KiB of a tiled int4 block's dequantised steps */
    sc->nib = cl->kind == TILES_U8 ? aligned_alloc(64, 32 * cmax > 4096L * AMX_MT_PER ? 32 * cmax : 4096L * AMX_MT_PER)
              : cl->kind == TILES_BF16 && cl->wdtype == 2 ? aligned_alloc(64, 8192)
                                                          : NULL;
}

static void scratch_free(Scratch *sc) { free(sc->c), free(sc->cb), free(sc->tmp), free(sc->wq), free(sc->nib); }

/* nibbles 0..15 -> the A bytes AMX_U4_S16 asks for (unpack_u4_step's), in place */
static void u4_to_s16(uint8_t *nib, size_t n) {
    for (size_t k = 0; AMX_U4_S16 && k < n; k++) nib[k] = (uint8_t)((nib[k] << 4) ^ 0x80);
}

/* 32 packed rows from base (c inputs, group g) -> where the A tiles read them (in place, or
 * bf16-dequantised / int4-unpacked into this thread's scratch) and their int8 group scales */
__attribute__((target(AMX_TARGET))) static ARows a_rows(const AmxCall *cl, const uint8_t *base, long rowbytes,
                                                        int c, int g, Scratch *sc) {
    ARows ar = {{base, base + 16 * rowbytes}, rowbytes, 64, {NULL, NULL}, 1, 0, {NULL, NULL}, NULL, 1};
    if (cl->kind == TILES_BF16 && cl->wdtype == 2 && q_tiled(2, 32, g) && AMX_U4_FUSED) {
        /* tiled int4: dequantised one k step at a time in tile_steps (AMX_U4_FUSED 0: the whole
         * block first, below), scales after each block's weights as [groups][16] */
        ar.u4[0] = base, ar.u4[1] = base + 16 * rowbytes, ar.ub = sc->nib;
        ar.s[0] = (const float *)(base + 8L * c), ar.s[1] = (const float *)(base + 16 * rowbytes + 8L * c);
        ar.sg = 16, ar.sr = 1, ar.kpg = g / 64;
        return ar;
    }
    if (cl->kind == TILES_BF16) {
        if (cl->wdtype != 0) {
            rows_to_bf16(base, rowbytes, 32, c, cl->wdtype, g, sc->tmp, sc->wq);
            ar.a[0] = (const uint8_t *)sc->wq, ar.a[1] = (const uint8_t *)(sc->wq + (size_t)16 * c), ar.sa = 2L * c;
        }
        return ar;
    }
    const long body = cl->kind == TILES_U8 ? c / 2 : c;
    if (q_tiled(cl->wdtype, 32, g)) {
        /* tiled blocks (packing.py): k step ks of block h at a[h] + ks * 1024 (int8 read
         * in place; int4 unpacked to the same order), rows 64 bytes apart, scales after each
         * block's weights as [groups][16] */
        ar.sa = 64, ar.kstep = 1024, ar.sg = 16, ar.sr = 1;
        ar.s[0] = (const float *)(base + 16 * body), ar.s[1] = (const float *)(base + 16 * rowbytes + 16 * body);
        if (cl->kind == TILES_U8 && AMX_U4_FUSED) {
            ar.u4[0] = base, ar.u4[1] = base + 16 * rowbytes, ar.ub = sc->nib;
        } else if (cl->kind == TILES_U8) {
            tiles_unpack_u4(base, rowbytes, 32, c, sc->nib);
            u4_to_s16(sc->nib, (size_t)32 * c);
            ar.a[0] = sc->nib, ar.a[1] = sc->nib + (size_t)16 * c;
        }
        return ar;
    }
    /* row format: C int8 (or C/2 bytes of int4) then C/G fp32 scales per row */
    ar.s[0] = (const float *)(base + body), ar.s[1] = (const float *)(base + 16 * rowbytes + body);
    ar.sr = rowbytes / 4;
    if (cl->kind == TILES_U8) {
        unpack_nibbles(base, rowbytes, 32, c, g, sc->nib);
        u4_to_s16(sc->nib, (size_t)32 * c);
        ar.a[0] = sc->nib, ar.a[1] = sc->nib + (size_t)16 * c, ar.sa = c;
    }
    return ar;
}

/* the fp32 result of the 32 rows of ar x token tiles tl .. tl + n - 1 into sc->c (token tile tl + u's
 * [32 rows][16 tokens] at sc->c + u * 512), for the first n of the left tiles that one pass takes
 * (1, 2, or up to AMX_MT: q_block_multi); returns n */
__attribute__((target(AMX_TARGET))) static int run_block(int kind, const ARows *ar, const QTiles *q, int tl, int left,
                                                         const Prefetch *pf, Scratch *sc) {
    /* int4: signed bytes (AMX_U4_S16) take the int8 tiles' instruction */
    const int qkind = kind == TILES_U8 && AMX_U4_S16 ? TILES_S8 : kind, two = left > 1;
    if (kind != TILES_BF16 && q_multi_ok(q, left)) {
        /* one tile more than a pass takes: two passes (n - 1, 2), not a one-tile pass after */
        const int n = left <= AMX_MT ? left : left == AMX_MT + 1 ? AMX_MT - 1 : AMX_MT;
        if (qkind == TILES_S8)
            q_block_multi(TILES_S8, ar, q, tl, n, pf, sc->cb, sc->nib, sc->c);
        else
            q_block_multi(TILES_U8, ar, q, tl, n, pf, sc->cb, sc->nib, sc->c);
        return n;
    }
    if (kind == TILES_BF16) {
        const uint32_t *b0 = q->b + (size_t)tl * q->ksteps * 256;
        tile_steps(TILES_BF16, ar, b0, b0 + (size_t)q->ksteps * 256, two, 0, q->ksteps, pf, q->ksteps, sc->c);
    } else if (qkind == TILES_S8) {
        q_block(TILES_S8, ar, q, tl, two ? tl + 1 : tl, two, pf, sc->cb, sc->c);
    } else {
        q_block(TILES_U8, ar, q, tl, two ? tl + 1 : tl, two, pf, sc->cb, sc->c);
    }
    return 1 + two;
}

/* Work split and prefetch, per call. Prefill-shaped calls (>= 2 token tiles per active expert on
 * average) split both phases statically (each thread a contiguous range of items: the tiles' time
 * is a large part of a block's, and blocks cost alike; then stealing, below) with no row prefetch
 * for bf16 (the hardware streams rows while the tiles run) and the rows prefetched 2 k steps ahead
 * for int8 (10.9 vs 12.0 ms, Qwen3 T=512, next block to L2 before); decode-shaped calls
 * (blocks are nearly pure row streaming) prefetch the rows 8 k steps ahead and split as AMX_LEAN
 * (below) says. Measured in bench_cpu_prefill.py runs
 * (benchmarks/RESULTS.md); AMX_SPLIT (0 dynamic, 1 static), AMX_PF (PF_*: every
 * call) and AMX_PF_PREFILL_BF16 / _Q (prefill-shaped calls) force one for benchmark builds. */
#ifndef AMX_SPLIT
#define AMX_SPLIT -1
#endif
#ifndef AMX_PF
#define AMX_PF -1
#endif
#ifndef AMX_PF_PREFILL_BF16
#define AMX_PF_PREFILL_BF16 PF_NONE
#endif
#ifndef AMX_PF_PREFILL_Q
#define AMX_PF_PREFILL_Q PF_NEAR
#endif

/* Decode-shaped calls, AMX_LEAN 1: both phases split as the static calls do, ranges with
 * stealing, phase 2's items sized to give each thread about four. AMX_LEAN 0: dynamic chunks of 4
 * phase-1 blocks (512 KiB at Qwen3 widths) and of one output block over every active expert, which
 * left a thread up to a chunk behind the others at each barrier. Measured in bench_cpu_prefill.py
 * (T 1 and 8, a server holding 64 or 128 experts) and at full size: benchmarks/RESULTS.md. */
#ifndef AMX_LEAN
#define AMX_LEAN 1
#endif

/* Static calls (prefill-shaped): each thread starts on a contiguous range of expert-major items.
 * AMX_BAL 0 = equal item counts; c > 0 = equal cost, an item of expert a costing c + its token tiles
 * (its rows' streaming in units of one token tile's work, plus the tiles). AMX_STEAL 1: a thread
 * that ends its range takes items from the front of the others' (the lent host's threads finish
 * an equal phase 1 up to 1.35x apart, in a loads-only build too: slow cores, not uneven work), and
 * phase 2 goes by expert too: items (expert, AMX_CHUNK2 output blocks) store each pair's result in
 * a pair buffer that a last pass sums per token (in the same order as the direct sum: experts
 * ascending, so the results do not change). */
#ifndef AMX_BAL
#define AMX_BAL 0
#endif
#ifndef AMX_STEAL
#define AMX_STEAL 1
#endif
#ifndef AMX_CHUNK2
#define AMX_CHUNK2 8
#endif

/* one call's shared state, read by every thread */
typedef struct {
    const AmxCall *cl;
    const TilePlan *pl;
    const QTiles *bx, *ba;
    float *act, *out;
    int qk, pf;
    float *pb; /* [n pairs, H] phase 2's results (AMX_STEAL), or NULL: summed into out directly */
    /* phase 1's items: bpi blocks of 16 features each, ipe a expert; bpi > 1 (int8 tiles, see
     * AMX_Q2_FUSED): an item is one group of phase 2's activations, quantised into phase 2's B
     * tiles by the item itself */
    int bpi, ipe;
    int bias;
    float smul;
    const uint32_t *zrow;
    uint16_t *out16; /* the answer in bf16 [T, H] (out then only phase 2's fp32 scratch), or NULL */
} Ctx;

/* AMX_Q2_FUSED 1: with int8 tiles and phase 2's groups of at most 128 features, a phase-1 item is
 * the blocks of one such group, and it quantises its results per pair straight into phase 2's B
 * tiles; 0: one block an item, the results written as fp32 rows that a pass between the phases
 * quantises (a 12.6 MB round trip and a barrier at Qwen3 widths, T=512). Bit-equal: quant_act
 * scales each group on its own. */
#ifndef AMX_Q2_FUSED
#define AMX_Q2_FUSED 1
#endif

/* the first item before which the items' cost sums to >= target (see AMX_BAL) */
static long cost_item(const TilePlan *pl, int per_expert, int c0, long target) {
    long cum = 0;
    for (int a = 0; a < pl->so.na; a++) {
        const long per = c0 + pl->tile0[a + 1] - pl->tile0[a];
        if (cum + per * per_expert > target) return (long)a * per_expert + (target - cum + per - 1) / per;
        cum += per * per_expert;
    }
    return (long)pl->so.na * per_expert;
}

/* thread id's items [*lo, *hi) of nth, over na * per_expert expert-major items */
static void expert_range(const TilePlan *pl, int per_expert, int c0, int id, int nth, long *lo, long *hi) {
    const long items = (long)pl->so.na * per_expert;
    if (c0 <= 0) {
        *lo = items * id / nth, *hi = items * (id + 1) / nth;
        return;
    }
    const long total = ((long)c0 * pl->so.na + pl->ntiles) * per_expert;
    *lo = cost_item(pl, per_expert, c0, total * id / nth);
    *hi = cost_item(pl, per_expert, c0, total * (id + 1) / nth);
}

/* per thread: the next unclaimed item of its range (one cache line each: owners and thieves
 * claim with an atomic add) */
typedef struct {
    long next, hi;
    char pad[48];
} Cursor;

static Cursor *cursors(const TilePlan *pl, int per_expert, int n) {
    Cursor *cur = aligned_alloc(64, sizeof(Cursor) * (size_t)n);
    for (int r = 0; r < n; r++) expert_range(pl, per_expert, AMX_BAL, r, n, &cur[r].next, &cur[r].hi);
    return cur;
}

/* the next item for thread id: from its own range, then from the others' in turn; -1 when all are
 * claimed. *v: the range it takes from (starts at id). */
static long take(Cursor *cur, int n, int id, int *v) {
    for (;;) {
        const long it = __atomic_fetch_add(&cur[*v].next, 1, __ATOMIC_RELAXED);
        if (it < cur[*v].hi) return it;
        *v = (*v + 1) % n;
        if (*v == id) return -1;
    }
}

/* fp32 [n pairs, H] pair buffer, kept per calling thread (kept_buffer) */
static float *pair_buffer(size_t floats, int *owned) { return kept_buffer(KEEP_PB, sizeof(float) * floats, owned); }

/* phase 1, block it = (active expert a, features b*16 .. b*16 + 15); gq (a fused item's): the
 * silu results [token tile of a][16 features][16 tokens] at gq + tile * stride, for the item to
 * quantise */
__attribute__((target(AMX_TARGET))) static void phase1_block(const Ctx *cx, long it, Scratch *sc, float *gq,
                                                             size_t stride) {
    const AmxCall *cl = cx->cl;
    const TilePlan *pl = cx->pl;
    const Sorted *so = &pl->so;
    const int i_ = cl->i, nblk1 = i_ / 16;
    const int a = (int)(it / nblk1), b = (int)(it % nblk1), s = so->active[a];
    const uint8_t *base = cl->w13 + ((size_t)s * 2 * i_ + (size_t)b * 32) * cl->row13;
    Prefetch pf = {cx->pf, NULL, 32 * cl->row13 / 64};
    if (it + 1 < (long)so->na * nblk1) {
        const int a2 = (int)((it + 1) / nblk1), b2 = (int)((it + 1) % nblk1);
        pf.p = cl->w13 + ((size_t)so->active[a2] * 2 * i_ + (size_t)b2 * 32) * cl->row13;
    }
    const ARows ar = a_rows(cl, base, cl->row13, cl->h, cl->g13, sc);
    for (int tl = pl->tile0[a], nt; tl < pl->tile0[a + 1]; tl += nt) {
        nt = run_block(cl->kind, &ar, cx->bx, tl, pl->tile0[a + 1] - tl,
                       tl == pl->tile0[a] ? &pf : &(Prefetch){PF_NONE, NULL, 0}, sc);
        for (int u = 0; u < nt; u++) {
            float *g = sc->c + u * 512; /* [16 gate rows][16 tokens], then the up rows */
            silu_mul_tile(g, g + 256);
            if (gq) {
                memcpy(gq + (size_t)(tl + u - pl->tile0[a]) * stride, g, 1024);
                continue;
            }
            if (!cx->qk) {
                /* padding tokens have zero B columns: silu(0) * 0 = 0 stays a valid pad */
                tile_to_bf16_pairs(g, b * 16, cx->ba->b + (size_t)(tl + u) * cx->ba->ksteps * 256);
                continue;
            }
            int n;
            const int q0 = tile_first(pl, tl + u, &n);
            float gt[256] __attribute__((aligned(64)));
            transpose16(g, gt);
            for (int j = 0; j < n; j++) memcpy(cx->act + (size_t)(q0 + j) * i_ + b * 16, gt + j * 16, 64);
        }
    }
}

/* phase-1 item it (cx->bpi blocks of expert it / ipe), quantising its group of phase 2's
 * activations per pair when fused (bpi > 1); gq: this thread's [tiles][bpi][256] scratch */
__attribute__((target(AMX_TARGET))) static void phase1_item(const Ctx *cx, long it, Scratch *sc, float *gq) {
    const int bpi = cx->bpi, nblk1 = cx->cl->i / 16;
    const int a = (int)(it / cx->ipe), gi = (int)(it % cx->ipe);
    if (bpi == 1) {
        phase1_block(cx, it, sc, NULL, 0);
        return;
    }
    for (int bb = 0; bb < bpi; bb++)
        phase1_block(cx, (long)a * nblk1 + (long)gi * bpi + bb, sc, gq + (size_t)bb * 256, (size_t)bpi * 256);
    const TilePlan *pl = cx->pl;
    const QTiles *ba = cx->ba;
    const int g = bpi * 16, spg = g / 64; /* features and k steps of the group */
    int8_t q8[16][128] __attribute__((aligned(64)));
    for (int tl = pl->tile0[a]; tl < pl->tile0[a + 1]; tl++) {
        int n;
        tile_first(pl, tl, &n);
        const float *gt = gq + (size_t)(tl - pl->tile0[a]) * bpi * 256;
        float rows[8][256] __attribute__((aligned(64))); /* block bb's [16 tokens][16 features] */
        for (int bb = 0; bb < bpi; bb++) transpose16(gt + bb * 256, rows[bb]);
        const uint32_t *src[16];
        for (int j = 0; j < 16; j++) {
            if (j >= n) { /* padding: a zero row with zero scales, as the unfused path's */
                src[j] = cx->zrow;
                qtiles_scale1(ba, tl, j, gi, 0, 0.0f, 0.0f, 0.0f);
                continue;
            }
            float f[128] __attribute__((aligned(64)));
            for (int bb = 0; bb < bpi; bb++) memcpy(f + bb * 16, rows[bb] + j * 16, 64);
            float s, cs;
            quant_act_amx(f, 0, g, g, q8[j], &s, &cs);
            qtiles_scale1(ba, tl, j, gi, cx->bias, cx->smul, s, cs);
            src[j] = (const uint32_t *)q8[j];
        }
        btiles_fill_steps(ba, tl, src, gi * spg, (gi + 1) * spg);
    }
}

/* phase 2 of active expert a, output rows [hb0 * 32, hb1 * 32): out += weight * result (pb: each
 * pair's result stored at its row of the pair buffer); next: the rows to prefetch after the last
 * block (NULL: none) */
__attribute__((target(AMX_TARGET))) static void phase2_rows(const Ctx *cx, int a, long hb0, long hb1,
                                                            const uint8_t *next, Scratch *sc) {
    const AmxCall *cl = cx->cl;
    const TilePlan *pl = cx->pl;
    const Sorted *so = &pl->so;
    const int h_ = cl->h, s = so->active[a];
    for (long hb = hb0; hb < hb1; hb++) {
        const uint8_t *base = cl->w2 + ((size_t)s * h_ + (size_t)hb * 32) * cl->row2;
        Prefetch pf = {cx->pf, hb + 1 < hb1 ? base + 32 * cl->row2 : next, 32 * cl->row2 / 64};
        const ARows ar = a_rows(cl, base, cl->row2, cl->i, cl->g2, sc);
        for (int tl = pl->tile0[a], nt; tl < pl->tile0[a + 1]; tl += nt) {
            nt = run_block(cl->kind, &ar, cx->ba, tl, pl->tile0[a + 1] - tl,
                           tl == pl->tile0[a] ? &pf : &(Prefetch){PF_NONE, NULL, 0}, sc);
            for (int u = 0; u < nt; u++) {
                int n;
                const int q0 = tile_first(pl, tl + u, &n);
                float ct[2][256] __attribute__((aligned(64))); /* token-major: output rows 0-15, 16-31 */
                transpose16(sc->c + u * 512, ct[0]);
                transpose16(sc->c + u * 512 + 256, ct[1]);
                for (int j = 0; j < n; j++) {
                    if (cx->pb) {
                        float *o = cx->pb + (size_t)(q0 + j) * h_ + (size_t)hb * 32;
                        memcpy(o, ct[0] + j * 16, 64);
                        memcpy(o + 16, ct[1] + j * 16, 64);
                        continue;
                    }
                    float *o = cx->out + (size_t)so->tok[q0 + j] * h_ + (size_t)hb * 32;
                    const float w = so->wt[q0 + j];
                    for (int r = 0; r < 16; r++) {
                        o[r] += w * ct[0][j * 16 + r];
                        o[16 + r] += w * ct[1][j * 16 + r];
                    }
                }
            }
        }
    }
}

/* the next expert's first rows of [hb0, ...) (phase 2's prefetch across experts) */
static const uint8_t *rows2(const Ctx *cx, int a, long hb0) {
    return a < cx->pl->so.na ? cx->cl->w2 + ((size_t)cx->pl->so.active[a] * cx->cl->h + (size_t)hb0 * 32) * cx->cl->row2
                             : NULL;
}

/* out[t] = sum over t's pairs (experts ascending) of weight * pair result; tq0 [T + 1], tq: the
 * pairs of each token */
__attribute__((target(AMX_TARGET))) static void sum_pairs(const Ctx *cx, const int *tq0, const int *tq, int t,
                                                          float *row) {
    const int h_ = cx->cl->h;
    float *o = cx->out16 ? row : cx->out + (size_t)t * h_;
    memset(o, 0, sizeof(float) * (size_t)h_);
    for (int e = tq0[t]; e < tq0[t + 1]; e++) {
        const float w = cx->pl->so.wt[tq[e]], *p = cx->pb + (size_t)tq[e] * h_;
        for (int c = 0; c < h_; c++) o[c] += w * p[c];
    }
    if (cx->out16) row_to_bf16_amx(o, h_, cx->out16 + (size_t)t * h_);
}

#ifdef AMX_PROFILE
/* seconds per stage, summed over calls (thread 0 after each barrier): gather, phase 1, phase-2
 * B tiles, phase 2 (with the pair sums); before the threads start (sort, allocations); the whole
 * call; then the threads' work in phase 1 and in phase 2, mean and slowest (the imbalance the
 * barriers wait out); the gather's first part (the tokens' quantisation, from thread 0's start);
 * how far apart the threads entered the parallel region (latest - earliest) */
static double amx_prof[12];
static double amx_busy[3][512];
void moe_amx_profile(double *out) {
    memcpy(out, amx_prof, sizeof amx_prof);
    memset(amx_prof, 0, sizeof amx_prof);
}
/* after a barrier */
#define PROF(k, t0)                                 \
    do {                                            \
        if (omp_get_thread_num() == 0) {            \
            const double now = omp_get_wtime();     \
            amx_prof[k] += now - t0;                \
            t0 = now;                               \
        }                                           \
    } while (0)
#define PROF_AT(k, t0) (amx_prof[k] += omp_get_wtime() - (t0))
#else
#define PROF(k, t0) ((void)(t0))
#define PROF_AT(k, t0) ((void)(t0))
#endif

/* AMX_U4_BF16: where int4 weights go on bf16 tiles, dequantised one k step at a time
 * (dequant_u4_bf16_step), with bf16 activations, rather than on int8 tiles with activations
 * quantised per group: 0 never, 1 prefill-shaped calls (below), 2 every call. The bf16 tiles take
 * twice the tile products but no group fold (each group's integer sums stored, converted and
 * scaled: 1.0-1.9 ms of a 6-7 ms Qwen3 T=512 call) and no activation quantisation. */
#ifndef AMX_U4_BF16
#define AMX_U4_BF16 0
#endif
static int u4_on_bf16(const AmxCall *cl, int prefill) {
    return cl->kind == TILES_U8 && (AMX_U4_BF16 == 2 || (AMX_U4_BF16 == 1 && prefill)) &&
           q_tiled(2, 2L * cl->i, cl->g13) && q_tiled(2, cl->h, cl->g2);
}

/* Both entry points. x [T, H] fp32 (x16: bf16, x then unused), out [T, H] fp32; out16: the answer
 * rounded to bf16 [T, H] (out then scratch); act [T*K, I] fp32 scratch of the int8 tiles' unfused
 * path (NULL: kept per thread, allocated when that path runs). The bf16 forms are read and
 * written by the call's own threads in its own passes: converted around the call instead, on
 * the server's bf16 calls, they took two more parallel regions and 12 MB of traffic at T=512. */
__attribute__((target(AMX_TARGET))) static int amx_moe(const AmxCall *cl, const float *x, const uint16_t *x16,
                                                       const int64_t *slot_ids, const float *weights, int t_, int k_,
                                                       int s_, float *act, float *out, uint16_t *out16, int nthreads) {
    const double t_call = omp_get_wtime();
    TilePlan pl;
    if (plan_tiles(slot_ids, weights, t_, k_, s_, &pl)) return -1;
    const Sorted *so = &pl.so;
    AmxCall u4bf;
    if (u4_on_bf16(cl, pl.ntiles >= 2 * so->na)) {
        u4bf = *cl, u4bf.kind = TILES_BF16;
        cl = &u4bf;
    }
    const int h_ = cl->h, i_ = cl->i, kind = cl->kind, qk = kind != TILES_BF16;
    /* int4 on TDPBUSD: the nibbles' + 8 comes off as 8 * sum(x); as 16 q (AMX_U4_S16) the 16 goes into
     * the token scales */
    const int bias = kind == TILES_U8 && !AMX_U4_S16 ? 8 : 0, ng13 = h_ / cl->g13;
    const float smul = kind == TILES_U8 && AMX_U4_S16 ? 1.0f / 16 : 1.0f;
    QTiles bx, ba; /* B tiles of phase 1 (over H) and phase 2 (over I) */
    btiles_alloc(&bx, kind, KEEP_BX, pl.ntiles, h_, cl->g13);
    btiles_alloc(&ba, kind, KEEP_BA, pl.ntiles, i_, cl->g2);
    /* each token converted once (bf16, or int8 with group scales), then copied to its tiles */
    uint16_t *xh = qk || x16 ? NULL : malloc(sizeof(uint16_t) * ((size_t)t_ * h_ + 1));
    int8_t *xq = qk ? malloc((size_t)t_ * h_ + 1) : NULL;
    float *xsc = qk ? malloc(sizeof(float) * ((size_t)t_ * ng13 + 1)) : NULL;
    float *xcs = qk ? malloc(sizeof(float) * ((size_t)t_ * ng13 + 1)) : NULL;
    const uint32_t *zrow = calloc((size_t)(h_ > i_ ? h_ : i_) / 2 + 16, 4); /* padding slots' row */
    const int nblk1 = i_ / 16, nblk2 = h_ / 32;
    const int bpi = qk && AMX_Q2_FUSED && cl->g2 <= 128 ? cl->g2 / 16 : 1, ipe1 = nblk1 / bpi;
    int own_act = 0; /* the unfused path's fp32 intermediates: the caller's, else kept here */
    if (qk && bpi == 1 && !act) {
        act = kept_buffer(KEEP_ACT, sizeof(float) * (size_t)(t_ * k_ > 0 ? t_ * k_ : 1) * (size_t)i_, &own_act);
    }
    const int prefill = pl.ntiles >= 2 * so->na, lean = AMX_LEAN && !prefill;
    const int split_static = AMX_SPLIT >= 0 ? AMX_SPLIT : prefill || lean;
    const int pf = AMX_PF >= 0 ? AMX_PF : !prefill ? PF_ROWS : qk ? AMX_PF_PREFILL_Q : AMX_PF_PREFILL_BF16;
    /* stealing (AMX_STEAL): phase-1 items, and phase-2 items (expert, chunk of output blocks) */
    const int npairs = so->na ? so->start[so->active[so->na - 1] + 1] : 0;
    const int steal = AMX_STEAL && split_static && npairs > 0;
    int chunk2 = AMX_CHUNK2 < nblk2 ? AMX_CHUNK2 : nblk2;
    if (lean) { /* about four items a thread, no more than AMX_CHUNK2 blocks each */
        const long fit = (long)so->na * nblk2 / (4L * nthreads);
        chunk2 = fit < 1 ? 1 : fit < chunk2 ? (int)fit : chunk2;
    }
    const int nch2 = (nblk2 + chunk2 - 1) / chunk2;
    int pb_owned = 0;
    float *pb = steal ? pair_buffer((size_t)npairs * h_, &pb_owned) : NULL;
    Cursor *cur1 = pb ? cursors(&pl, ipe1, nthreads) : NULL, *cur2 = pb ? cursors(&pl, nch2, nthreads) : NULL;
    int *tq0 = NULL, *tq = NULL; /* pb: each token's pairs, experts ascending */
    if (pb) {
        tq0 = calloc((size_t)t_ + 1, sizeof(int)), tq = malloc(sizeof(int) * (size_t)npairs);
        for (int q = 0; q < npairs; q++) tq0[so->tok[q] + 1]++;
        for (int t = 0; t < t_; t++) tq0[t + 1] += tq0[t];
        int *fill = malloc(sizeof(int) * ((size_t)t_ + 1));
        memcpy(fill, tq0, sizeof(int) * (size_t)t_);
        for (int q = 0; q < npairs; q++) tq[fill[so->tok[q]]++] = q; /* q ascending = experts ascending */
        free(fill);
    }
    int tmax = 0; /* the most token tiles of one expert (a fused item's scratch) */
    for (int a = 0; a < so->na; a++) tmax = pl.tile0[a + 1] - pl.tile0[a] > tmax ? pl.tile0[a + 1] - pl.tile0[a] : tmax;
    const Ctx cx = {cl, &pl, &bx, &ba, act, out, qk, pf, pb, bpi, ipe1, bias, smul, zrow, out16};
#pragma omp parallel num_threads(nthreads)
    {
        amx_config();
        Scratch sc;
        scratch_alloc(&sc, cl);
        const int id = omp_get_thread_num(), nth = omp_get_num_threads();
        double t0 = omp_get_wtime();
        if (id == 0) PROF_AT(4, t_call);
#ifdef AMX_PROFILE
        amx_busy[2][id & 511] = t0;
        const double tg = t0;
#endif
#pragma omp for schedule(static)
        for (int t = 0; t < t_; t++) {
            if (!pb) memset(out + (size_t)t * h_, 0, sizeof(float) * (size_t)h_);
            if (qk)
                quant_act_amx(x16 ? (const void *)(x16 + (size_t)t * h_) : (const void *)(x + (size_t)t * h_), !!x16,
                              h_, cl->g13, xq + (size_t)t * h_, xsc + (size_t)t * ng13, xcs + (size_t)t * ng13);
            else if (!x16)
                row_to_bf16_amx(x + (size_t)t * h_, h_, xh + (size_t)t * h_);
        }
#ifdef AMX_PROFILE
        if (id == 0) {
            amx_prof[10] += omp_get_wtime() - tg;
            double lo = amx_busy[2][0], hi = lo;
            for (int r = 1; r < nth && r < 512; r++) {
                lo = amx_busy[2][r] < lo ? amx_busy[2][r] : lo;
                hi = amx_busy[2][r] > hi ? amx_busy[2][r] : hi;
            }
            amx_prof[11] += hi - lo;
        }
#endif
#pragma omp for schedule(static)
        for (int tl = 0; tl < pl.ntiles; tl++) {
            int n;
            const int q0 = tile_first(&pl, tl, &n);
            const uint32_t *src[16];
            for (int j = 0; j < 16; j++) {
                const size_t t = j < n ? (size_t)so->tok[q0 + j] : 0;
                src[j] = j >= n ? zrow
                         : qk   ? (const uint32_t *)(xq + t * h_)
                                : (const uint32_t *)((x16 ? x16 : xh) + t * h_);
                if (qk && j < n) qtiles_scales(&bx, tl, j, h_, cl->g13, bias, smul, xsc + t * ng13, xcs + t * ng13);
                if (qk && j >= n) qtiles_pad_scales(&bx, tl, j);
            }
            btiles_fill(&bx, tl, src);
        }
        COMPILER_FENCE();
        PROF(0, t0);
        /* phase 1: blocks (expert, 16 features), expert-major */
        double tb = omp_get_wtime();
        float *gq = bpi > 1 ? aligned_alloc(64, sizeof(float) * 256 * (size_t)bpi * (tmax ? tmax : 1)) : NULL;
        if (pb) {
            int v = id;
            for (long it; (it = take(cur1, nthreads, id, &v)) >= 0;) phase1_item(&cx, it, &sc, gq);
        } else if (split_static) {
            long lo, hi;
            expert_range(&pl, ipe1, AMX_BAL, id, nth, &lo, &hi);
            for (long it = lo; it < hi; it++) phase1_item(&cx, it, &sc, gq);
        } else {
#pragma omp for schedule(dynamic, 4) nowait
            for (long it = 0; it < (long)so->na * ipe1; it++) phase1_item(&cx, it, &sc, gq);
        }
        free(gq);
#ifdef AMX_PROFILE
        amx_busy[0][id & 511] = omp_get_wtime() - tb;
#endif
        COMPILER_FENCE();
#pragma omp barrier
        PROF(1, t0);
        if (qk && bpi == 1) {
            /* the pairs' intermediate rows quantised into phase 2's B tiles (fused: done) */
            int8_t *q8 = malloc((size_t)16 * i_);
            float *qs = malloc(sizeof(float) * (size_t)i_), *qc = malloc(sizeof(float) * (size_t)i_);
#pragma omp for schedule(static)
            for (int tl = 0; tl < pl.ntiles; tl++) {
                int n;
                const int q0 = tile_first(&pl, tl, &n);
                const uint32_t *src[16];
                for (int j = 0; j < 16; j++) {
                    src[j] = j < n ? (const uint32_t *)(q8 + (size_t)j * i_) : zrow;
                    if (j >= n) {
                        qtiles_pad_scales(&ba, tl, j);
                        continue;
                    }
                    quant_act_amx(act + (size_t)(q0 + j) * i_, 0, i_, cl->g2, q8 + (size_t)j * i_, qs, qc);
                    qtiles_scales(&ba, tl, j, i_, cl->g2, bias, smul, qs, qc);
                }
                btiles_fill(&ba, tl, src);
            }
            free(q8), free(qs), free(qc);
        }
        COMPILER_FENCE();
        PROF(2, t0);
        /* phase 2: output blocks of each expert */
        tb = omp_get_wtime();
        if (pb) {
            int v = id;
            for (long it; (it = take(cur2, nthreads, id, &v)) >= 0;) {
                const int a = (int)(it / nch2);
                const long hb0 = (it % nch2) * chunk2, hb1 = hb0 + chunk2 < nblk2 ? hb0 + chunk2 : nblk2;
                phase2_rows(&cx, a, hb0, hb1, hb1 < nblk2 ? rows2(&cx, a, hb1) : rows2(&cx, a + 1, 0), &sc);
            }
        } else if (split_static) {
            /* each thread a range of output rows over every expert: one writer per output */
            const int per = (nblk2 + nth - 1) / nth;
            const long hb0 = (long)id * per < nblk2 ? (long)id * per : nblk2;
            const long hb1 = (long)(id + 1) * per < nblk2 ? (long)(id + 1) * per : nblk2;
            for (int a = 0; a < so->na && hb0 < hb1; a++) phase2_rows(&cx, a, hb0, hb1, rows2(&cx, a + 1, hb0), &sc);
        } else {
#pragma omp for schedule(dynamic, 1) nowait
            for (int hb = 0; hb < nblk2; hb++)
                for (int a = 0; a < so->na; a++) phase2_rows(&cx, a, hb, hb + 1, rows2(&cx, a + 1, hb), &sc);
        }
#ifdef AMX_PROFILE
        amx_busy[1][id & 511] = omp_get_wtime() - tb;
#else
        (void)tb;
#endif
        COMPILER_FENCE();
#pragma omp barrier
        if (pb) {
            float *row = out16 ? malloc(sizeof(float) * (size_t)h_) : NULL;
#pragma omp for schedule(static)
            for (int t = 0; t < t_; t++) sum_pairs(&cx, tq0, tq, t, row);
            free(row);
        } else if (out16) {
#pragma omp for schedule(static)
            for (int t = 0; t < t_; t++) row_to_bf16_amx(out + (size_t)t * h_, h_, out16 + (size_t)t * h_);
        }
        PROF(3, t0);
#ifdef AMX_PROFILE
        if (id == 0) {
            for (int ph = 0; ph < 2; ph++) {
                double sum = 0.0, mx = 0.0;
                for (int r = 0; r < nth && r < 512; r++) {
                    sum += amx_busy[ph][r];
                    mx = amx_busy[ph][r] > mx ? amx_busy[ph][r] : mx;
                }
                amx_prof[6 + 2 * ph] += sum / nth, amx_prof[7 + 2 * ph] += mx;
            }
        }
#endif
        amx_release();
        scratch_free(&sc);
    }
    qtiles_free(&bx), qtiles_free(&ba);
    free(xh), free(xq), free(xsc), free(xcs), free((void *)zrow), free(cur1), free(cur2), free(tq0), free(tq);
    if (pb_owned) free(pb);
    if (own_act) free(act);
    plan_free(&pl);
    PROF_AT(5, t_call);
    return 0;
}

/* the shapes each kind of tiles covers (else -2), then amx_moe: q = 0 bf16 tiles, 1 int8 tiles */
__attribute__((target(AMX_TARGET))) static int amx_entry(int q, const float *x, const uint16_t *x16,
                                                         const int64_t *slot_ids, const float *weights, int t_, int k_,
                                                         int s_, const uint8_t *w13, long row13, const uint8_t *w2,
                                                         long row2, int h_, int i_, int rb, int wdtype, int g13, int g2,
                                                         float *act, float *out, uint16_t *out16, int nthreads) {
    if (!q && (rb != 16 || h_ % 32 || i_ % 32)) return -2;
    if (q && (rb != 16 || g13 % 64 || g2 % 64 || h_ % g13 || i_ % g2 || (wdtype != 1 && wdtype != 2))) return -2;
    const int kind = !q ? TILES_BF16 : wdtype == 1 ? TILES_S8 : TILES_U8;
    const AmxCall cl = {kind, wdtype, h_, i_, g13, g2, w13, w2, row13, row2};
    return amx_moe(&cl, x, x16, slot_ids, weights, t_, k_, s_, q ? act : NULL, out, out16, nthreads);
}

/* bf16 tiles (weights bf16, or int8/int4 dequantised per block). Same arguments as moe_decode
 * without act/caps/qact. Returns 0, -1 for a bad slot id, -2 for a shape the tiles do not cover. */
int moe_amx(const float *x, const int64_t *slot_ids, const float *weights, int t_, int k_, int s_,
            const uint8_t *w13, long row13, const uint8_t *w2, long row2, int h_, int i_, int rb, int wdtype, int g13,
            int g2, float *out, int nthreads) {
    return amx_entry(0, x, NULL, slot_ids, weights, t_, k_, s_, w13, row13, w2, row2, h_, i_, rb, wdtype, g13, g2,
                     NULL, out, NULL, nthreads);
}

/* int8 tiles: wdtype 1 (int8) or 2 (int4) with G % 64 == 0, activations quantised per token and
 * group; act [T*K, I] fp32 scratch. Returns as moe_amx. */
int moe_amx_q(const float *x, const int64_t *slot_ids, const float *weights, int t_, int k_, int s_,
              const uint8_t *w13, long row13, const uint8_t *w2, long row2, int h_, int i_, int rb, int wdtype,
              int g13, int g2, float *act, float *out, int nthreads) {
    return amx_entry(1, x, NULL, slot_ids, weights, t_, k_, s_, w13, row13, w2, row2, h_, i_, rb, wdtype, g13, g2,
                     act, out, NULL, nthreads);
}

/* moe_amx (a[21] == 0) or moe_amx_q (a[21] == 1) with every argument in one int64 block (the
 * fast paths' call, backend.forward_into; after the benchmark's cache flush each torch conversion
 * and ctypes argument costs microseconds), bf16 read and written by the call itself:
 * a[0] x [T, H], a[1] x is bf16 (else fp32), a[2] slot ids [T, K], a[3] they are int32 (else
 * int64), a[4] weights [T, K] fp32, a[5] T, a[6] K, a[7] S, a[8] w13, a[9] row13, a[10] w2,
 * a[11] row2, a[12] H, a[13] I, a[14] RB, a[15] wdtype, a[16] g13, a[17] g2, a[18] out [T, H],
 * a[19] out is bf16 (else fp32: written in place), a[20] threads. Returns as moe_amx. */
int moe_amx_a(const int64_t *a) {
    const int t_ = (int)a[5], k_ = (int)a[6], h_ = (int)a[12], i_ = (int)a[13], n = t_ * k_;
    const size_t th = (size_t)(t_ > 0 ? t_ : 1) * (size_t)h_;
    float *o32 = NULL;
    int own_o = 0;
    const float *x = a[1] ? NULL : (const float *)a[0];
    const uint16_t *x16 = a[1] ? (const uint16_t *)a[0] : NULL;
    int64_t *wide = a[3] ? widen_ids((const int32_t *)a[2], n) : NULL;
    const int64_t *ids = wide ? wide : (const int64_t *)a[2];
    /* a bf16 answer: fp32 scratch for phase 2 (the pair buffer's path writes bf16 directly) */
    float *out = a[19] ? (o32 = kept_buffer(KEEP_O32, sizeof(float) * th, &own_o)) : (float *)a[18];
    uint16_t *out16 = a[19] ? (uint16_t *)a[18] : NULL;
    const int rc = amx_entry((int)a[21], x, x16, ids, (const float *)a[4], t_, k_, (int)a[7], (const uint8_t *)a[8],
                             (long)a[9], (const uint8_t *)a[10], (long)a[11], h_, i_, (int)a[14], (int)a[15],
                             (int)a[16], (int)a[17], NULL, out, out16, (int)a[20]);
    if (own_o) free(o32);
    free(wide);
    return rc;
}
