/* int8/int4 experts on AMX int8 tiles, any T (included by moe_gemv.c after moe_amx.c).
 *
 * Activations are quantised per token (and per intermediate row) in the weights' groups, as in
 * the decode kernel's integer path, so each group's integer tile product is scaled once per
 * (row, token) by weight scale * activation scale. Tiles (16 rows x 64 bytes): A = 16 weight rows
 * x 64 int8 (int8 rows read in place; int4 rows unpacked to nibbles 0..15 in a per-thread
 * scratch), B = 16 input quads x 16 tokens x 4 int8, C = 16 x 16 int32, stored after each group
 * and folded into fp32 accumulators. int8: TDPBSSD (s8 x s8); int4: TDPBUSD (u8 nibble = q + 8,
 * x s8), whose bias 8 * sum(x) comes off per token and group. Needs RB == 16, G % 64 == 0.
 */

/* per token tile: B tiles [k steps][16 quads][16 tokens] uint32, and per group the 16 tokens'
 * scales and integer corrections */
typedef struct {
    uint32_t *b; /* [tiles][ksteps][256] */
    float *ts;   /* [tiles][groups][16] */
    int32_t *tc; /* [tiles][groups][16] */
    int ksteps, groups;
} QTiles;

static void qtiles_alloc(QTiles *q, int ntiles, int c, int g) {
    q->ksteps = c / 64, q->groups = c / g;
    q->b = calloc((size_t)ntiles * q->ksteps * 256 + 1, 4);
    q->ts = calloc((size_t)ntiles * q->groups * 16 + 1, 4);
    q->tc = calloc((size_t)ntiles * q->groups * 16 + 1, 4);
}

static void qtiles_free(QTiles *q) { free(q->b), free(q->ts), free(q->tc); }

/* token slot j of tile tl <- one quantised activation row (q8 [c], sc / cs [c/g] from quant_act) */
static void qtiles_put(const QTiles *q, int tl, int j, int c, int g, int bias, const int8_t *q8, const float *sc,
                       const float *cs) {
    const uint32_t *src = (const uint32_t *)q8;
    uint32_t *dst = q->b + (size_t)tl * q->ksteps * 256 + j;
    for (int p = 0; p < c / 4; p++) dst[(size_t)(p / 16) * 256 + (p % 16) * 16] = src[p];
    for (int gi = 0; gi < c / g; gi++) {
        const size_t o = ((size_t)tl * q->groups + gi) * 16 + j;
        q->ts[o] = sc[gi];
        /* sum(q) = cs / sc: an integer of at most 127 * G, recovered exactly by rounding */
        q->tc[o] = sc[gi] > 0.0f ? bias * (int32_t)lrintf(cs[gi] / sc[gi]) : 0;
    }
}

/* issue 14q: tiled int4 blocks (packing.py; 16 rows x 32 bytes per k step) -> nibbles 0..15 in
 * int8's tiled order (16 rows x 64 bytes per k step), r_ / 16 whole blocks */
__attribute__((target(AMX_TARGET))) static void unpack_nibbles(const uint8_t *rows, long rowbytes, int r_, int c,
                                                               uint8_t *out) {
    const __m256i lo4 = _mm256_set1_epi8(15);
    for (int bl = 0; bl < r_ / 16; bl++) {
        const uint8_t *src = rows + (size_t)bl * 16 * rowbytes;
        uint8_t *dst = out + (size_t)bl * 16 * c;
        for (int i = 0; i < 8 * c; i += 32) { /* 32 bytes = one row of one k step */
            const __m256i b = _mm256_loadu_si256((const __m256i *)(src + i));
            _mm256_storeu_si256((__m256i *)(dst + 2 * i), _mm256_and_si256(b, lo4));
            _mm256_storeu_si256((__m256i *)(dst + 2 * i + 32), _mm256_and_si256(_mm256_srli_epi16(b, 4), lo4));
        }
    }
}

/* acc[4][16][16] (fp32, C tile order: a0 x t0, a1 x t0, a0 x t1, a1 x t1) += the scaled group
 * products. a0/a1: 16 rows each, tiled (issue 14q: k step ks = 16 rows x 64 bytes at
 * a + ks * 1024); wsc[32]: the 32 rows' scales (group gi at wsc[r][16 * gi], the tiled layout); b0/b1: first k step of each token tile; ts/tc: the tiles' [groups][16] scales and
 * corrections. */
__attribute__((target(AMX_TARGET))) static void amx_q_block(const uint8_t *a0, const uint8_t *a1,
                                                            const float *const *wsc, const uint32_t *b0,
                                                            const uint32_t *b1, int two, const float *ts0,
                                                            const float *ts1, const int32_t *tc0, const int32_t *tc1,
                                                            int groups, int kpg, int u4, int32_t *cb, float *acc) {
    memset(acc, 0, sizeof(float) * 1024);
    for (int gi = 0; gi < groups; gi++) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        COMPILER_FENCE();
        for (int kk = 0; kk < kpg; kk++) {
            const size_t ks = (size_t)gi * kpg + kk;
            if (ks + AMX_PREFETCH < (size_t)groups * kpg)
                for (int r = 0; r < 16; r++) {
                    _mm_prefetch((const char *)(a0 + (ks + AMX_PREFETCH) * 1024 + r * 64), _MM_HINT_T0);
                    _mm_prefetch((const char *)(a1 + (ks + AMX_PREFETCH) * 1024 + r * 64), _MM_HINT_T0);
                }
            _tile_loadd(4, a0 + ks * 1024, 64);
            _tile_loadd(5, a1 + ks * 1024, 64);
            _tile_loadd(6, b0 + ks * 256, 64);
            if (two) _tile_loadd(7, b1 + ks * 256, 64);
            if (u4) {
                _tile_dpbusd(0, 4, 6);
                _tile_dpbusd(1, 5, 6);
                if (two) {
                    _tile_dpbusd(2, 4, 7);
                    _tile_dpbusd(3, 5, 7);
                }
            } else {
                _tile_dpbssd(0, 4, 6);
                _tile_dpbssd(1, 5, 6);
                if (two) {
                    _tile_dpbssd(2, 4, 7);
                    _tile_dpbssd(3, 5, 7);
                }
            }
        }
        _tile_stored(0, cb, 64);
        _tile_stored(1, cb + 256, 64);
        if (two) {
            _tile_stored(2, cb + 512, 64);
            _tile_stored(3, cb + 768, 64);
        }
        COMPILER_FENCE();
        for (int t = 0; t < 2 + 2 * two; t++) {
            const int u = t / 2, half = t % 2; /* token tile, weight half (a0 / a1) */
            const __m512 xs = _mm512_loadu_ps((u ? ts1 : ts0) + gi * 16);
            const __m512i xc = _mm512_loadu_si512((u ? tc1 : tc0) + gi * 16);
            for (int r = 0; r < 16; r++) {
                const __m512 s = _mm512_mul_ps(xs, _mm512_set1_ps(wsc[half * 16 + r][16 * gi]));
                const __m512 d = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_loadu_si512(cb + t * 256 + r * 16), xc));
                float *a = acc + t * 256 + r * 16;
                _mm512_storeu_ps(a, _mm512_fmadd_ps(d, s, _mm512_loadu_ps(a)));
            }
        }
    }
}

/* Same arguments as moe_amx, wdtype 1 (int8) or 2 (int4) with G % 64 == 0; act [T*K, I] fp32
 * scratch. Returns 0, -1 for a bad slot id, -2 for a shape the tiles do not cover. */
__attribute__((target(AMX_TARGET))) int moe_amx_q(const float *x, const int64_t *slot_ids, const float *weights,
                                                  int t_, int k_, int s_, const uint8_t *w13, long row13,
                                                  const uint8_t *w2, long row2, int h_, int i_, int rb, int wdtype,
                                                  int g13, int g2, float *act, float *out, int nthreads) {
    if (rb != 16 || g13 % 64 || g2 % 64 || (wdtype != 1 && wdtype != 2)) return -2;
    Sorted so;
    if (sort_pairs(slot_ids, weights, t_, k_, s_, &so)) return -1;
    int *tile0 = malloc(sizeof(int) * ((size_t)so.na + 1));
    int ntiles = 0;
    for (int a = 0; a < so.na; a++) {
        tile0[a] = ntiles;
        ntiles += (so.start[so.active[a] + 1] - so.start[so.active[a]] + 15) / 16;
    }
    tile0[so.na] = ntiles;
    int *tile_expert = malloc(sizeof(int) * ((size_t)ntiles + 1));
    for (int a = 0; a < so.na; a++)
        for (int tl = tile0[a]; tl < tile0[a + 1]; tl++) tile_expert[tl] = a;
    const int u4 = wdtype == 2, bias = u4 ? 8 : 0;
    const long body13 = u4 ? h_ / 2 : h_, body2 = u4 ? i_ / 2 : i_;
    QTiles qx, qa;
    const int ng13 = h_ / g13;
    int8_t *xq = malloc((size_t)t_ * h_ + 1);
    float *xsc = malloc(sizeof(float) * ((size_t)t_ * ng13 + 1)), *xcs = malloc(sizeof(float) * ((size_t)t_ * ng13 + 1));
    qtiles_alloc(&qx, ntiles, h_, g13);
    qtiles_alloc(&qa, ntiles, i_, g2);
    memset(out, 0, sizeof(float) * (size_t)t_ * h_);
    const int nblk = i_ / 16, cmax = h_ > i_ ? h_ : i_;
    const long items1 = (long)so.na * nblk;
#pragma omp parallel num_threads(nthreads)
    {
        amx_config();
        int32_t *cb = aligned_alloc(64, sizeof(int32_t) * 1024);
        float *acc = aligned_alloc(64, sizeof(float) * 1024);
        int8_t *q8 = malloc((size_t)cmax);
        float *sc = malloc(sizeof(float) * (size_t)cmax), *cs = malloc(sizeof(float) * (size_t)cmax);
        uint8_t *nib = u4 ? malloc(32 * (size_t)cmax) : NULL;
        const float *wsc[32];
        /* each token quantised once, then copied into the B tiles of its experts */
#pragma omp for schedule(static)
        for (int t = 0; t < t_; t++)
            quant_act(x + (size_t)t * h_, h_, g13, xq + (size_t)t * h_, xsc + (size_t)t * ng13, xcs + (size_t)t * ng13);
#pragma omp for schedule(static)
        for (int tl = 0; tl < ntiles; tl++) {
            const int a = tile_expert[tl], s = so.active[a];
            for (int j = 0; j < 16; j++) {
                const int q = so.start[s] + (tl - tile0[a]) * 16 + j;
                if (q >= so.start[s + 1]) break;
                const size_t t = (size_t)so.tok[q];
                qtiles_put(&qx, tl, j, h_, g13, bias, xq + t * h_, xsc + t * ng13, xcs + t * ng13);
            }
        }
        COMPILER_FENCE();
        /* phase 1: gate/up of one (expert, 16-feature block) -> act (fp32) */
#pragma omp for schedule(dynamic, 4)
        for (long it = 0; it < items1; it++) {
            const int a = (int)(it / nblk), b = (int)(it % nblk), s = so.active[a];
            const uint8_t *base = w13 + ((size_t)s * 2 * i_ + (size_t)b * 32) * row13;
            for (int r = 0; r < 32; r++) wsc[r] = (const float *)(base + (r / 16) * 16 * row13 + 16 * body13) + r % 16;
            const uint8_t *a0 = base, *a1 = base + 16 * row13;
            if (u4) {
                unpack_nibbles(base, row13, 32, h_, nib);
                a0 = nib, a1 = nib + (size_t)16 * h_;
            }
            const int m = so.start[s + 1] - so.start[s];
            for (int tl = tile0[a]; tl < tile0[a + 1]; tl += 2) {
                const int two = tl + 1 < tile0[a + 1];
                const size_t t1 = two ? tl + 1 : tl;
                amx_q_block(a0, a1, wsc, qx.b + (size_t)tl * qx.ksteps * 256, qx.b + t1 * qx.ksteps * 256, two,
                            qx.ts + (size_t)tl * qx.groups * 16, qx.ts + t1 * qx.groups * 16,
                            qx.tc + (size_t)tl * qx.groups * 16, qx.tc + t1 * qx.groups * 16, qx.groups, g13 / 64,
                            u4, cb, acc);
                for (int u = 0; u < 1 + two; u++) {
                    const int j0 = (tl + u - tile0[a]) * 16;
                    const float *cg = acc + u * 512, *cu = cg + 256; /* [16 rows][16 tokens] */
                    for (int j = 0; j < 16 && j0 + j < m; j++) {
                        float *dst = act + (size_t)(so.start[s] + j0 + j) * i_ + b * 16;
                        for (int r = 0; r < 16; r++) {
                            const float gt = cg[r * 16 + j];
                            dst[r] = gt / (1.0f + expf(-gt)) * cu[r * 16 + j];
                        }
                    }
                }
            }
        }
        /* implicit barrier: act is complete; quantise it into phase 2's B tiles */
#pragma omp for schedule(static)
        for (int tl = 0; tl < ntiles; tl++) {
            const int a = tile_expert[tl], s = so.active[a];
            for (int j = 0; j < 16; j++) {
                const int q = so.start[s] + (tl - tile0[a]) * 16 + j;
                if (q >= so.start[s + 1]) break;
                quant_act(act + (size_t)q * i_, i_, g2, q8, sc, cs);
                qtiles_put(&qa, tl, j, i_, g2, bias, q8, sc, cs);
            }
        }
        COMPILER_FENCE();
        /* phase 2: 32 output rows over every expert */
#pragma omp for schedule(dynamic, 1)
        for (int hb = 0; hb < h_ / 32; hb++) {
            for (int a = 0; a < so.na; a++) {
                const int s = so.active[a];
                const uint8_t *base = w2 + ((size_t)s * h_ + (size_t)hb * 32) * row2;
                for (int r = 0; r < 32; r++) wsc[r] = (const float *)(base + (r / 16) * 16 * row2 + 16 * body2) + r % 16;
                const uint8_t *a0 = base, *a1 = base + 16 * row2;
                if (u4) {
                    unpack_nibbles(base, row2, 32, i_, nib);
                    a0 = nib, a1 = nib + (size_t)16 * i_;
                }
                const int m = so.start[s + 1] - so.start[s];
                for (int tl = tile0[a]; tl < tile0[a + 1]; tl += 2) {
                    const int two = tl + 1 < tile0[a + 1];
                    const size_t t1 = two ? tl + 1 : tl;
                    amx_q_block(a0, a1, wsc, qa.b + (size_t)tl * qa.ksteps * 256, qa.b + t1 * qa.ksteps * 256,
                                two, qa.ts + (size_t)tl * qa.groups * 16, qa.ts + t1 * qa.groups * 16,
                                qa.tc + (size_t)tl * qa.groups * 16, qa.tc + t1 * qa.groups * 16, qa.groups, g2 / 64,
                                u4, cb, acc);
                    for (int u = 0; u < 1 + two; u++) {
                        const int j0 = (tl + u - tile0[a]) * 16;
                        for (int j = 0; j < 16 && j0 + j < m; j++) {
                            const int q = so.start[s] + j0 + j;
                            float *o = out + (size_t)so.tok[q] * h_ + (size_t)hb * 32;
                            const float w = so.wt[q];
                            for (int r = 0; r < 16; r++) {
                                o[r] += w * acc[u * 512 + r * 16 + j];
                                o[16 + r] += w * acc[u * 512 + 256 + r * 16 + j];
                            }
                        }
                    }
                }
            }
        }
        amx_release();
        free(cb), free(acc), free(q8), free(sc), free(cs), free(nib);
    }
    qtiles_free(&qx), qtiles_free(&qa);
    free(xq), free(xsc), free(xcs);
    free(tile0), free(tile_expert);
    sorted_free(&so);
    return 0;
}
