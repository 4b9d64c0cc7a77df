/* Prefill-shaped MoE with AMX bf16 tiles: one call per layer runs every active expert's two GEMMs
 * (included by moe_gemv.c; called only when the CPU has AMX and moe_amx_init() succeeded).
 *
 * Tiles (all 16 rows x 64 bytes): A = 16 weight rows x 32 inputs, read in place from the packed
 * rows (bf16; int8/int4 rows are first dequantised to bf16 in a per-thread scratch); B = 16 input
 * pairs x 16 tokens in the VNNI pair layout, built once per call from the tokens gathered per
 * expert; C = 16 rows x 16 tokens fp32. Per A pair (16 gate + 16 up rows, one interleave block
 * with RB = 16) two token tiles at a time: 4 C, 2 A, 2 B = the 8 tile registers.
 * Phase 1 splits (expert, row block) items and writes silu(gate) * up as bf16 straight into the B
 * layout of phase 2; phase 2 splits output rows in blocks of 32 over all experts, so every output
 * element has one writer. Needs RB == 16, H % 32 == 0, I % 32 == 0.
 */
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_TARGET "amx-tile,amx-bf16,amx-int8,avx512f,avx512bw,avx512vl,fma"
/* k steps to prefetch A rows ahead: each tile row is its own stream (one 4 KiB page per row at
 * H = 2048), 32 at once, more than the hardware prefetchers follow */
#ifndef AMX_PREFETCH
#define AMX_PREFETCH 8
#endif

/* a row to bf16 for B tiles (target: the conversion loop vectorises) */
__attribute__((target(AMX_TARGET))) static void row_to_bf16_amx(const float *x, int c, uint16_t *out) {
    row_to_bf16(x, c, out);
}

/* Linux keeps AMX state off until the process asks (arch_prctl, kernel >= 5.16). 0 = granted. */
int moe_amx_init(void) { return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) ? -1 : 0; }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) TileCfg;

__attribute__((target(AMX_TARGET))) static void amx_config(void) {
    TileCfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

__attribute__((target(AMX_TARGET))) static void amx_release(void) { _tile_release(); }

/* NOTE: GCC's tile intrinsics are asm statements without a memory clobber: fence the compiler
 * around them wherever C code reads what a tile store wrote or writes what a tile load reads */
#define COMPILER_FENCE() __asm__ volatile("" ::: "memory")

/* rows of one format -> bf16 [r, c] (quantised rows for the tiles) */
__attribute__((target(AMX_TARGET))) static void rows_to_bf16(const uint8_t *rows, long rowbytes, int r_, int c, int wdtype, int g, float *tmp,
                         uint16_t *out) {
    for (int r = 0; r < r_; r++) {
        /* issue 14q: tiled int8/int4 (r_ = 32 rows = two whole blocks here) */
        qrow_to_f32(rows, rowbytes, r, q_tiled(wdtype, r_, g), wdtype, c, g, tmp);
        row_to_bf16(tmp, c, out + (size_t)r * c);
    }
}

/* C[0..3] = sum over k steps of A (rows at a0 / a1, stride sa bytes) x B tiles b0 / b1 (1 KiB per
 * k step each, consecutive k steps 1 KiB apart); two = whether b1 is used; stores to c (4 x 16 x 16). */
__attribute__((target(AMX_TARGET))) static void amx_block(const uint8_t *a0, const uint8_t *a1, long sa,
                                                          const uint32_t *b0, const uint32_t *b1, int two,
                                                          int ksteps, float *c) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    COMPILER_FENCE();
    for (int ks = 0; ks < ksteps; ks++) {
        if (ks + AMX_PREFETCH < ksteps)
            for (int r = 0; r < 16; r++) {
                _mm_prefetch((const char *)(a0 + r * sa + (size_t)(ks + AMX_PREFETCH) * 64), _MM_HINT_T0);
                _mm_prefetch((const char *)(a1 + r * sa + (size_t)(ks + AMX_PREFETCH) * 64), _MM_HINT_T0);
            }
        _tile_loadd(4, a0 + (size_t)ks * 64, sa);
        _tile_loadd(5, a1 + (size_t)ks * 64, sa);
        _tile_loadd(6, b0 + (size_t)ks * 256, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 5, 6);
        if (two) {
            _tile_loadd(7, b1 + (size_t)ks * 256, 64);
            _tile_dpbf16ps(2, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c, 64);
    _tile_stored(1, c + 256, 64);
    if (two) {
        _tile_stored(2, c + 512, 64);
        _tile_stored(3, c + 768, 64);
    }
    COMPILER_FENCE();
}

/* Same arguments as moe_decode (act unused). Returns 0, -1 for a bad slot id, -2 for a shape the
 * tiles do not cover. */
__attribute__((target(AMX_TARGET))) int moe_amx(const float *x, const int64_t *slot_ids, const float *weights,
                                                int t_, int k_, int s_, const uint8_t *w13, long row13,
                                                const uint8_t *w2, long row2, int h_, int i_, int rb, int wdtype,
                                                int g13, int g2, float *out, int nthreads) {
    if (rb != 16 || h_ % 32 || i_ % 32) return -2;
    Sorted so;
    if (sort_pairs(slot_ids, weights, t_, k_, s_, &so)) return -1;
    /* token tiles: expert a's pairs fill tiles tile0[a] .. tile0[a + 1] - 1, padded with zeros */
    int *tile0 = malloc(sizeof(int) * ((size_t)so.na + 1));
    int ntiles = 0;
    for (int a = 0; a < so.na; a++) {
        tile0[a] = ntiles;
        ntiles += (so.start[so.active[a] + 1] - so.start[so.active[a]] + 15) / 16;
    }
    tile0[so.na] = ntiles;
    const int kx = h_ / 32, ka = i_ / 32; /* k steps along H and I */
    uint32_t *xb = calloc((size_t)ntiles * kx * 256 + 1, 4); /* [tiles][kx][16 pairs][16 tok] */
    uint32_t *ab = calloc((size_t)ntiles * ka * 256 + 1, 4); /* [tiles][ka][16 pairs][16 tok] */
    int *tile_expert = malloc(sizeof(int) * ((size_t)ntiles + 1));
    for (int a = 0; a < so.na; a++)
        for (int tl = tile0[a]; tl < tile0[a + 1]; tl++) tile_expert[tl] = a;
    memset(out, 0, sizeof(float) * (size_t)t_ * h_);
    const int quant = wdtype == 1 || wdtype == 2;
    const int nblk = i_ / 16;
    const long items1 = (long)so.na * nblk;
#pragma omp parallel num_threads(nthreads)
    {
        amx_config();
        float *c = aligned_alloc(64, sizeof(float) * 1024);
        float *tmp = malloc(sizeof(float) * (size_t)(h_ > i_ ? h_ : i_));
        uint16_t *wq = quant ? malloc(sizeof(uint16_t) * 32 * (size_t)(h_ > i_ ? h_ : i_)) : NULL;
        uint16_t *xr = malloc(sizeof(uint16_t) * (size_t)h_);
        /* gather: token rows -> bf16 pair layout, one token tile per iteration */
#pragma omp for schedule(static)
        for (int tl = 0; tl < ntiles; tl++) {
            const int a = tile_expert[tl], s = so.active[a];
            for (int j = 0; j < 16; j++) {
                const int q = so.start[s] + (tl - tile0[a]) * 16 + j;
                if (q >= so.start[s + 1]) break; /* padding stays zero */
                row_to_bf16_amx(x + (size_t)so.tok[q] * h_, h_, xr);
                const uint32_t *xp = (const uint32_t *)xr;
                uint32_t *dst = xb + (size_t)tl * kx * 256 + j;
                for (int p = 0; p < h_ / 2; p++) dst[(size_t)(p / 16) * 256 + (p % 16) * 16] = xp[p];
            }
        }
        COMPILER_FENCE();
        /* phase 1: gate/up for one (expert, 16-feature block) */
#pragma omp for schedule(dynamic, 4)
        for (long it = 0; it < items1; it++) {
            const int a = (int)(it / nblk), b = (int)(it % nblk), s = so.active[a];
            const uint8_t *base = w13 + ((size_t)s * 2 * i_ + (size_t)b * 32) * row13;
            const uint8_t *a0 = base, *a1 = base + 16 * row13;
            long sa = row13;
            if (quant) {
                rows_to_bf16(base, row13, 32, h_, wdtype, g13, tmp, wq);
                a0 = (const uint8_t *)wq, a1 = (const uint8_t *)(wq + (size_t)16 * h_), sa = 2L * h_;
            }
            const int m = so.start[s + 1] - so.start[s];
            for (int tl = tile0[a]; tl < tile0[a + 1]; tl += 2) {
                const int two = tl + 1 < tile0[a + 1];
                const uint32_t *b0 = xb + (size_t)tl * kx * 256;
                amx_block(a0, a1, sa, b0, b0 + (size_t)kx * 256, two, kx, c);
                for (int u = 0; u < 1 + two; u++) {
                    const float *cg = c + u * 512, *cu = cg + 256; /* [16 rows][16 tokens] */
                    const int jn = m - (tl + u - tile0[a]) * 16;
                    uint16_t *dst = (uint16_t *)(ab + (size_t)(tl + u) * ka * 256);
                    for (int r = 0; r < 16; r++) {
                        const int f = b * 16 + r; /* intermediate feature */
                        uint16_t *d = dst + (size_t)(f / 32) * 512 + ((f % 32) / 2) * 32 + (f % 2);
                        for (int j = 0; j < 16 && j < jn; j++) {
                            const float gt = cg[r * 16 + j];
                            d[j * 2] = to_bf16(gt / (1.0f + expf(-gt)) * cu[r * 16 + j]);
                        }
                    }
                }
            }
        }
        /* implicit barrier: ab is complete */
        COMPILER_FENCE();
        /* phase 2: 32 output rows over every expert */
#pragma omp for schedule(dynamic, 1)
        for (int hb = 0; hb < h_ / 32; hb++) {
            for (int a = 0; a < so.na; a++) {
                const int s = so.active[a];
                const uint8_t *base = w2 + ((size_t)s * h_ + (size_t)hb * 32) * row2;
                const uint8_t *a0 = base, *a1 = base + 16 * row2;
                long sa = row2;
                if (quant) {
                    rows_to_bf16(base, row2, 32, i_, wdtype, g2, tmp, wq);
                    a0 = (const uint8_t *)wq, a1 = (const uint8_t *)(wq + (size_t)16 * i_), sa = 2L * i_;
                }
                const int m = so.start[s + 1] - so.start[s];
                for (int tl = tile0[a]; tl < tile0[a + 1]; tl += 2) {
                    const int two = tl + 1 < tile0[a + 1];
                    const uint32_t *b0 = ab + (size_t)tl * ka * 256;
                    amx_block(a0, a1, sa, b0, b0 + (size_t)ka * 256, two, ka, c);
                    for (int u = 0; u < 1 + two; u++) {
                        const int j0 = (tl + u - tile0[a]) * 16;
                        for (int j = 0; j < 16 && j0 + j < m; j++) {
                            const int q = so.start[s] + j0 + j;
                            float *o = out + (size_t)so.tok[q] * h_ + (size_t)hb * 32;
                            const float w = so.wt[q];
                            for (int r = 0; r < 16; r++) {
                                o[r] += w * c[u * 512 + r * 16 + j];
                                o[16 + r] += w * c[u * 512 + 256 + r * 16 + j];
                            }
                        }
                    }
                }
            }
        }
        amx_release();
        free(c), free(tmp), free(wq), free(xr);
    }
    free(tile0), free(xb), free(ab), free(tile_expert);
    sorted_free(&so);
    return 0;
}
