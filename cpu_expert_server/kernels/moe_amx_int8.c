/* int8/int4 experts on AMX int8 tiles (included by moe_gemv.c after moe_amx.c; run by
 * moe_amx_driver.c).
 *
 * Activations are quantised per token (and per intermediate row) in the weights' groups, as in
 * the decode kernel's integer path, so each group's integer tile product is scaled once per
 * (row, token) by weight scale * activation scale. A = int8 rows read in place, or int4 rows
 * unpacked in a per-thread scratch to 16 q as int8 (AMX_U4_S16, moe_amx.c; the 1/16 rides in the
 * token scales); B = 16 input quads x 16 tokens x 4 int8; C = 16 x 16 int32, stored after each
 * group and folded into the fp32 block result. Both on TDPBSSD (s8 x s8); the AMX_U4_S16=0 build
 * keeps int4 as nibbles q + 8 on TDPBUSD (u8 x s8), whose bias 8 * sum(x) comes off per token and
 * group. Needs RB == 16, G % 64 == 0.
 */

/* per token tile: B tiles [k steps][16 quads][16 tokens] uint32, and per group the 16 tokens'
 * scales and integer corrections */
typedef struct {
    uint32_t *b; /* [tiles][ksteps][256] */
    float *ts;   /* [tiles][groups][16] */
    int32_t *tc; /* [tiles][groups][16] */
    int ksteps, groups;
    void *mem; /* what b, ts, tc are carved from: a kept buffer (kept_buffer), or owned when set */
    int owned;
} QTiles;

/* Buffers kept per calling thread across calls, one per use (KEEP_*), each up to AMX_KEEP_MAX
 * bytes: a prefill call's scratch is tens of MB (Qwen3 widths at T = 512: 33 MB of pair results,
 * 13 MB of token tiles, and 13 MB of intermediates where they are not quantised inside phase 1),
 * which glibc maps fresh on many calls, so its
 * pages fault in again, one thread at a time, every call. A larger one is the call's own (*owned:
 * the caller frees it). AMX_KEEP 0 allocates every call (benchmark builds). */
#ifndef AMX_KEEP
#define AMX_KEEP 1
#endif
#ifndef AMX_KEEP_MAX
#define AMX_KEEP_MAX (64L << 20)
#endif
enum { KEEP_PB, KEEP_ACT, KEEP_BX, KEEP_BA, KEEP_O32, KEEP_N };
static void *kept_buffer(int use, size_t bytes, int *owned) {
    static __thread void *buf[KEEP_N];
    static __thread size_t cap[KEEP_N];
    bytes = (bytes + 63) & ~(size_t)63;
    *owned = !AMX_KEEP || bytes > (size_t)AMX_KEEP_MAX;
    if (*owned) return aligned_alloc(64, bytes ? bytes : 64);
    if (bytes > cap[use]) {
        free(buf[use]);
        buf[use] = aligned_alloc(64, bytes);
        cap[use] = buf[use] ? bytes : 0;
    }
    return buf[use];
}

/* NOTE: not zeroed (the gathers write every token slot, padding included): calloc would clear
 * tens of MB on one thread (2.6 ms of a 24 ms call, Qwen3 widths T=512) */
static void qtiles_alloc(QTiles *q, int use, int ntiles, int c, int g) {
    q->ksteps = c / 64, q->groups = c / g;
    const size_t nb = ((size_t)ntiles * q->ksteps * 256 + 16) * 4, ns = ((size_t)ntiles * q->groups * 16 + 16) * 4;
    uint8_t *m = kept_buffer(use, nb + 2 * ns, &q->owned);
    q->mem = m;
    q->b = (uint32_t *)m, q->ts = (float *)(m + nb), q->tc = (int32_t *)(m + nb + ns);
}

static void qtiles_free(QTiles *q) {
    if (q->owned) free(q->mem);
}

/* token slot j of tile tl: the group scales (times mul) and integer corrections of one quantised
 * activation row (sc / cs [c/g] from quant_act; its int8 values go in with btiles_fill) */
static void qtiles_scale1(const QTiles *q, int tl, int j, int gi, int bias, float mul, float sc, float cs) {
    const size_t o = ((size_t)tl * q->groups + gi) * 16 + j;
    q->ts[o] = sc * mul;
    /* sum(q) = cs / sc: an integer of at most 127 * G, recovered exactly by rounding; only the
     * unsigned tiles' fold reads it (bias 8): the others skip a division and a rounding per
     * token slot and group */
    q->tc[o] = bias && sc > 0.0f ? bias * (int32_t)lrintf(cs / sc) : 0;
}

static void qtiles_scales(const QTiles *q, int tl, int j, int c, int g, int bias, float mul, const float *sc,
                          const float *cs) {
    for (int gi = 0; gi < c / g; gi++) qtiles_scale1(q, tl, j, gi, bias, mul, sc[gi], cs[gi]);
}

/* token slot j of tile tl: a padding slot's scales (its values: a zero row in btiles_fill) */
static void qtiles_pad_scales(const QTiles *q, int tl, int j) {
    for (int gi = 0; q->ts && gi < q->groups; gi++) {
        const size_t o = ((size_t)tl * q->groups + gi) * 16 + j;
        q->ts[o] = 0.0f, q->tc[o] = 0;
    }
}

/* int4 rows (packed) -> nibbles 0..15 in natural element order, [r, c] bytes (g % 64 == 0) */
__attribute__((target(AMX_TARGET))) static void unpack_nibbles(const uint8_t *rows, long rowbytes, int r_, int c,
                                                               int g, uint8_t *out) {
    const __m256i lo4 = _mm256_set1_epi8(15);
    for (int r = 0; r < r_; r++) {
        const uint8_t *src = rows + (size_t)r * rowbytes;
        uint8_t *dst = out + (size_t)r * c;
        for (int gi = 0; gi < c / g; gi++)
            for (int j = 0; j < g / 2; j += 32) {
                const __m256i b = _mm256_loadu_si256((const __m256i *)(src + gi * (g / 2) + j));
                _mm256_storeu_si256((__m256i *)(dst + gi * g + j), _mm256_and_si256(b, lo4));
                _mm256_storeu_si256((__m256i *)(dst + gi * g + g / 2 + j),
                                    _mm256_and_si256(_mm256_srli_epi16(b, 4), lo4));
            }
    }
}

/* AMX_QDIAG (bench_cpu_prefill.py diagnostic builds, results WRONG): 1 the groups' sums stored but
 * not folded; 2 the tiles summing every group, folded once per block (a per-row format's cost);
 * 3 a fold without the token scales (convert, multiply-add by the row's scale) */
#ifndef AMX_QDIAG
#define AMX_QDIAG 0
#endif

/* AMX_FOLD_LAG 1: group g's sums are folded after group g + 1's tile products are issued (two
 * buffers of sums), so that the vector fold can run while the tile unit computes; 0: each group
 * folded as soon as its sums are stored, before the next group's products. At T=512 the lag was
 * faster in 3 of 4 same-host comparisons (4-9%; benchmarks/RESULTS.md). */
#ifndef AMX_FOLD_LAG
#define AMX_FOLD_LAG 1
#endif

/* AMX_FOLD_NG 2 (with the lag): two groups folded a pass, each result row loaded and stored once
 * for both (four buffers of sums: the pair being folded, the group being stored); 1: one. Before
 * the fold's loops were specialised, 2, 4 or 8 groups a pass were 6-16% slower at T=512; after, 2
 * was within the noise of 1 (benchmarks/RESULTS.md), so the default stays 1. */
#ifndef AMX_FOLD_NG
#define AMX_FOLD_NG 1
#endif

/* An opaque copy of a vector: -ffast-math lets GCC reassociate cvt(C) * (xs * w) per inlining
 * context (as (cvt(C) * xs) * w in some), and a pass's two groups' additions, which rounded the
 * same fold differently in builds that must agree bit for bit; what is pinned is computed as
 * written in every build. */
#ifdef EXPERTMESH_AMX_EMULATE
#define PIN_VEC(v) __asm__("" : "+m"(v))
#else
#define PIN_VEC(v) __asm__("" : "+v"(v))
#endif

/* One fold pass's groups: their C tiles' sums, the weight scales of row 0 of each A tile (rows sr
 * apart) and each token tile's scales and corrections */
typedef struct {
    const int32_t *cb[2];
    const float *s[2][2]; /* [group][A tile] */
    v16f_a xs[2][2];      /* [group][token tile] */
    v16i_a xc[2][2];
} FoldPass;

/* q_fold's rows, specialised by the caller on its loop invariants: ng groups (1 or 2), nt token
 * tiles (1 or 2), add (0: the pass's first group sets acc). Locals and constants only: on ARows'
 * fields (read through a pointer that the stores to acc might alias) GCC reloaded and recomputed
 * each row's scale address for every row and half, and kept the tests of two and gi inside the
 * loop. */
static inline __attribute__((always_inline, target(AMX_TARGET))) void q_fold_rows(int kind, const FoldPass *fp,
                                                                                  long sr, int ng, int nt, int add,
                                                                                  float *acc) {
    for (int r = 0; r < 16; r++)
        for (int half = 0; half < 2; half++) {
            float w[2]; /* one load for both token tiles */
            for (int k = 0; k < ng; k++) w[k] = fp->s[k][half][r * sr];
            for (int u = 0; u < nt; u++) {
                const int t = 2 * u + half; /* C tile: a0 x b0, a1 x b0, a0 x b1, a1 x b1 */
                v16f_a a = {0};
                if (add) memcpy(&a, acc + t * 256 + r * 16, 64);
                for (int k = 0; k < ng; k++) {
                    v16i_a ci;
                    memcpy(&ci, fp->cb[k] + t * 256 + r * 16, 64);
                    if (kind == TILES_U8) ci -= fp->xc[k][u];
#if AMX_QDIAG == 3
                    a += __builtin_convertvector(ci, v16f_a) * w[k];
#else
                    v16f_a sc = fp->xs[k][u] * w[k];
                    PIN_VEC(sc);
                    a += __builtin_convertvector(ci, v16f_a) * sc;
#endif
                    if (k + 1 < ng) PIN_VEC(a);
                }
                memcpy(acc + t * 256 + r * 16, &a, 64);
            }
        }
}

/* groups gi .. gi + ng - 1's integer sums (cb[k]: C tiles as tile_store wrote them) into acc, in
 * order: acc (+)= (C_int - token correction) * weight scale * token scale; group 0 sets acc */
static inline __attribute__((always_inline, target(AMX_TARGET))) void q_fold(int kind, const ARows *ar,
                                                                             const QTiles *q, size_t tl, size_t t1,
                                                                             int two, int gi, int ng,
                                                                             const int32_t *const *cb, float *acc) {
    FoldPass fp;
    memset(fp.xc, 0, sizeof fp.xc);
    for (int k = 0; k < ng; k++) {
        fp.cb[k] = cb[k];
        fp.s[k][0] = ar->s[0] + (gi + k) * ar->sg, fp.s[k][1] = ar->s[1] + (gi + k) * ar->sg;
        for (int u = 0; u < 1 + two; u++) { /* token tile u's scales and corrections */
            const size_t o = ((u ? t1 : tl) * q->groups + gi + k) * 16;
            memcpy(&fp.xs[k][u], q->ts + o, 64);
            if (kind == TILES_U8) memcpy(&fp.xc[k][u], q->tc + o, 64);
        }
    }
#if AMX_QDIAG == 1
    if (gi) return;
#endif
    const long sr = ar->sr;
#define Q_FOLD_ROWS(NG)                                    \
    if (two && gi)                                         \
        q_fold_rows(kind, &fp, sr, NG, 2, 1, acc);         \
    else if (two)                                          \
        q_fold_rows(kind, &fp, sr, NG, 2, 0, acc);         \
    else if (gi)                                           \
        q_fold_rows(kind, &fp, sr, NG, 1, 1, acc);         \
    else                                                   \
        q_fold_rows(kind, &fp, sr, NG, 1, 0, acc);
    if (AMX_FOLD_NG == 2 && ng == 2) {
        Q_FOLD_ROWS(2)
    } else {
        Q_FOLD_ROWS(1)
    }
#undef Q_FOLD_ROWS
}

/* One block on int8 tiles, result as tile_steps' c but fp32 and scaled: acc[4][16][16] = sum over
 * groups of (C_int - token correction) * weight scale (ar->s) * token scale, the groups added in
 * order. q: the token tiles' B buffer, tl / t1 the two tiles (t1 == tl when two == 0); cb: four
 * groups' integer sums (4 x 4 KiB). kind TILES_U8 takes the correction off (TDPBUSD on nibbles);
 * TILES_S8 has none. */
static inline __attribute__((always_inline, target(AMX_TARGET))) void q_block(int kind, const ARows *ar,
                                                                              const QTiles *q, size_t tl, size_t t1,
                                                                              int two, const Prefetch *pf, int32_t *cb,
                                                                              float *acc) {
    const uint32_t *b0 = q->b + tl * q->ksteps * 256, *b1 = q->b + t1 * q->ksteps * 256;
#if AMX_QDIAG == 2
    const int groups = 1, per = q->ksteps;
#else
    const int groups = q->groups, per = q->ksteps / q->groups;
#endif
    const int ng = AMX_FOLD_LAG && AMX_FOLD_NG == 2 && !AMX_QDIAG ? 2 : 1;
    int folded = 0; /* groups folded so far; group g's sums are in cb + (g & 3) * 1024 */
    for (int gi = 0; gi < groups; gi++) {
        int32_t *c = cb + (gi & 3) * 1024;
        if (AMX_FOLD_LAG) {
            tile_steps(kind, ar, b0, b1, two, gi * per, (gi + 1) * per, pf, q->ksteps, NULL);
            if (gi - folded >= ng) { /* the stored groups before gi, folded while gi's products run */
                const int32_t *cf[2] = {cb + (folded & 3) * 1024, cb + ((folded + 1) & 3) * 1024};
                q_fold(kind, ar, q, tl, t1, two, folded, ng, cf, acc);
                folded += ng;
            }
            tile_store(two, c);
        } else {
            tile_steps(kind, ar, b0, b1, two, gi * per, (gi + 1) * per, pf, q->ksteps, c);
            const int32_t *cf[2] = {c, c};
            q_fold(kind, ar, q, tl, t1, two, gi, 1, cf, acc);
        }
    }
    while (AMX_FOLD_LAG && folded < groups) { /* the last one or two */
        const int n = groups - folded >= ng ? ng : 1;
        const int32_t *cf[2] = {cb + (folded & 3) * 1024, cb + ((folded + 1) & 3) * 1024};
        q_fold(kind, ar, q, tl, t1, two, folded, n, cf, acc);
        folded += n;
    }
}

/* AMX_MT: the most token tiles of one expert that a grouped int8-tile block (groups of at most
 * AMX_MT_PER k steps) runs in one pass, group-outer: each group's A rows are unpacked (int4) into
 * a two-group ring once and read by every pair of token tiles, the pairs' sums folded with the
 * same one-unit lag. Pair by pair (q_block; AMX_MT 2), every pair unpacked the rows again, and an
 * expert of 3 tiles ran its third as a one-tile pass at the full unpack cost: the vector units
 * (unpack and fold) bound a grouped block, not the tiles. 4 and 8 measured alike at T = 512 and
 * 2048 (benchmarks/RESULTS.md); 4 keeps the pass's results in 8 KiB. */
#ifndef AMX_MT
#define AMX_MT 4
#endif
#define AMX_MT_PER 4

static inline int q_multi_ok(const QTiles *q, int left) {
    return AMX_MT > 2 && !AMX_QDIAG && AMX_FOLD_LAG && left > 2 && q->groups > 1 &&
           q->ksteps / q->groups <= AMX_MT_PER;
}

/* group gi's k steps of both A tiles unpacked into ring (step s of A tile h at s * 2048 + h * 1024),
 * the packed rows prefetched as tile_steps does */
static inline __attribute__((always_inline, target(AMX_TARGET))) void q_unpack_group(const ARows *ar, int gi,
                                                                                    int per, int ksteps,
                                                                                    const Prefetch *pf,
                                                                                    uint8_t *ring) {
    for (int s = 0; s < per; s++) {
        const int ks = gi * per + s;
        prefetch_part(pf, ar->u4[0], ar->u4[1], 32, 512, ks, ksteps);
        unpack_u4_step(ar->u4[0] + (size_t)ks * 512, ring + (size_t)s * 2048);
        unpack_u4_step(ar->u4[1] + (size_t)ks * 512, ring + (size_t)s * 2048 + 1024);
    }
    COMPILER_FENCE();
}

/* q_block_multi's unit u = (group u / pairs, pair u % pairs) of token tiles tl0 .. tl0 + nt - 1: its
 * sums (in cb's slot u & 3) folded into its pair's acc */
static inline __attribute__((always_inline, target(AMX_TARGET))) void q_fold_unit(int kind, const ARows *ar,
                                                                                 const QTiles *q, int tl0, int nt,
                                                                                 long u, const int32_t *cb,
                                                                                 float *acc) {
    const int np = (nt + 1) / 2, gi = (int)(u / np), p = (int)(u % np), tl = tl0 + 2 * p, two = 2 * p + 1 < nt;
    const int32_t *cf[2] = {cb + (u & 3) * 1024, cb + (u & 3) * 1024};
    q_fold(kind, ar, q, tl, two ? tl + 1 : tl, two, gi, 1, cf, acc + (size_t)p * 1024);
}

/* q_block over nt token tiles tl0 .. tl0 + nt - 1 (3 or more but for small AMX_MT builds),
 * group-outer (see AMX_MT): acc
 * [pairs][4][256], pair p's as q_block's acc at acc + p * 1024 (token tile u's rows at acc + u *
 * 512); ring: 2 * AMX_MT_PER * 2 KiB. The same sums folded in the same order per pair as q_block's:
 * bit-equal. */
static inline __attribute__((always_inline, target(AMX_TARGET))) void q_block_multi(
    int kind, const ARows *ar, const QTiles *q, int tl0, int nt, const Prefetch *pf, int32_t *cb, uint8_t *ring,
    float *acc) {
    const int groups = q->groups, per = q->ksteps / groups, np = (nt + 1) / 2, u4 = ar->u4[0] != NULL;
    const Prefetch none = {PF_NONE, NULL, 0};
    ARows v = *ar; /* u4: the ring's steps, read from step 0 */
    v.u4[0] = v.u4[1] = NULL, v.sa = 64, v.kstep = 2048;
    if (u4) q_unpack_group(ar, 0, per, q->ksteps, pf, ring);
    long last = -1; /* the stored unit not yet folded: gi * np + p */
    for (int gi = 0; gi < groups; gi++) {
        uint8_t *rg = ring + (size_t)(gi & 1) * per * 2048;
        v.a[0] = rg, v.a[1] = rg + 1024;
        for (int p = 0; p < np; p++) {
            const int tl = tl0 + 2 * p, two = 2 * p + 1 < nt;
            const uint32_t *b0 = q->b + (size_t)tl * q->ksteps * 256, *b1 = two ? b0 + (size_t)q->ksteps * 256 : b0;
            if (u4)
                tile_steps(kind, &v, b0 + (size_t)gi * per * 256, b1 + (size_t)gi * per * 256, two, 0, per, &none,
                           per, NULL);
            else
                tile_steps(kind, ar, b0, b1, two, gi * per, (gi + 1) * per, p ? &none : pf, q->ksteps, NULL);
            if (u4 && p == np - 1 && gi + 1 < groups) /* the next group's rows, while the tiles run */
                q_unpack_group(ar, gi + 1, per, q->ksteps, pf, ring + (size_t)((gi + 1) & 1) * per * 2048);
            if (last >= 0) q_fold_unit(kind, ar, q, tl0, nt, last, cb, acc);
            last = (long)gi * np + p;
            tile_store(two, cb + (last & 3) * 1024);
        }
    }
    q_fold_unit(kind, ar, q, tl0, nt, last, cb, acc);
}
