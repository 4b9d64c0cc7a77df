/* int8/int4 experts on AMX int8 tiles (included by moe_gemv.c after moe_amx.c; run by
 * moe_amx_driver.c).
 *
 * Activations are quantised per token (and per intermediate row) in the weights' groups, as in
 * the decode kernel's integer path, so each group's integer tile product is scaled once per
 * (row, token) by weight scale * activation scale. A = int8 rows read in place, or int4 rows
 * unpacked to nibbles 0..15 in a per-thread scratch; B = 16 input quads x 16 tokens x 4 int8;
 * C = 16 x 16 int32, stored after each group and folded into the fp32 block result. int8: TDPBSSD
 * (s8 x s8); int4: TDPBUSD (u8 nibble = q + 8, x s8), whose bias 8 * sum(x) comes off per token
 * and group. Needs RB == 16, G % 64 == 0.
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
 * 13 MB of intermediates, 13 MB of token tiles), which glibc maps fresh on many calls, so its
 * pages fault in again, one thread at a time, every call. A larger one is the call's own (*owned:
 * the caller frees it). AMX_KEEP 0 allocates every call (benchmark builds). */
#ifndef AMX_KEEP
#define AMX_KEEP 1
#endif
#ifndef AMX_KEEP_MAX
#define AMX_KEEP_MAX (64L << 20)
#endif
enum { KEEP_PB, KEEP_ACT, KEEP_BX, KEEP_BA, KEEP_X32, KEEP_O32, KEEP_N };
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

/* token slot j of tile tl: the group scales and integer corrections of one quantised activation
 * row (sc / cs [c/g] from quant_act; its int8 values go in with btiles_fill) */
static void qtiles_scales(const QTiles *q, int tl, int j, int c, int g, int bias, const float *sc, const float *cs) {
    for (int gi = 0; gi < c / g; gi++) {
        const size_t o = ((size_t)tl * q->groups + gi) * 16 + j;
        q->ts[o] = sc[gi];
        /* sum(q) = cs / sc: an integer of at most 127 * G, recovered exactly by rounding */
        q->tc[o] = sc[gi] > 0.0f ? bias * (int32_t)lrintf(cs[gi] / sc[gi]) : 0;
    }
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

/* One block on int8 tiles, result as tile_steps' c but fp32 and scaled: acc[4][16][16] = sum over
 * groups of (C_int - token correction) * weight scale (ar->s) * token scale. q: the token tiles' B
 * buffer, tl / t1 the two tiles (t1 == tl when two == 0). */
static inline __attribute__((always_inline, target(AMX_TARGET))) void q_block(int kind, const ARows *ar,
                                                                              const QTiles *q, size_t tl, size_t t1,
                                                                              int two, const Prefetch *pf, int32_t *cb,
                                                                              float *acc) {
    memset(acc, 0, sizeof(float) * 1024);
    const int kpg = q->ksteps / q->groups;
    const uint32_t *b0 = q->b + tl * q->ksteps * 256, *b1 = q->b + t1 * q->ksteps * 256;
    for (int gi = 0; gi < q->groups; gi++) {
        tile_steps(kind, ar, b0, b1, two, gi * kpg, (gi + 1) * kpg, pf, q->ksteps, cb);
        for (int t = 0; t < 2 + 2 * two; t++) {
            const int u = t / 2, half = t % 2; /* token tile, weight half (a0 / a1) */
            const size_t o = ((u ? t1 : tl) * q->groups + gi) * 16;
            v16f_a xs;
            v16i_a xc;
            memcpy(&xs, q->ts + o, 64);
            memcpy(&xc, q->tc + o, 64);
            for (int r = 0; r < 16; r++) {
                v16i_a ci;
                v16f_a a;
                memcpy(&ci, cb + t * 256 + r * 16, 64);
                memcpy(&a, acc + t * 256 + r * 16, 64);
                a += __builtin_convertvector(ci - xc, v16f_a) * (xs * ar->s[half][gi * ar->sg + r * ar->sr]);
                memcpy(acc + t * 256 + r * 16, &a, 64);
            }
        }
    }
}
