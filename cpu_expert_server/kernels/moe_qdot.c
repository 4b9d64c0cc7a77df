/* Dot products on narrow data, one variant per ISA (included by moe_gemv.c, which picks a variant
 * at run time from the CPU's flags; each function carries its own target attribute, so one
 * library serves every x86-64 CPU).
 *
 * Quantised weights (the tiled format, packing.py: blocks of 16 rows, per step of 64 input
 * features 16 rows x 64 int8 or 16 rows x 32 int4 bytes, then the block's scales [groups][16])
 * x int8 activations, quantised per token (or per intermediate row) in the weights' groups. One
 * call computes a whole block, 16 output rows, for m tokens:
 *   per step and row an integer accumulator gathers 64 products (AVX512-VNNI vpdpbusd: int8
 *   weights made u8 by flipping the top bit (q + 128), int4 nibbles are already u8 (q + 8);
 *   AVX2: |x| (u8) x sign-transferred w (s8) with vpmaddubsw + vpmaddwd, nibble (u8) x x (s8));
 *   at a group's end the 16 rows' accumulators reduce to one vector of 16 row sums, the bias
 *   (128 or 8 times the group's sum of x) comes off as one broadcast, and the group's 16 weight
 *   scales times the token's activation scale apply as one vector multiply-add.
 * Weights stay bytes in the inner loop (2-3 instructions per 64 weights); a group's scale
 * handling is ~50 instructions per 16 rows, not per row.
 * bf16 weights x bf16 activations: vdpbf16ps (AVX512_BF16), 32 products per instruction.
 */

#define VNNI_TARGET "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni"

/* software prefetch of the weight stream: hint 0 = T0 (L1), 1 = T1 (L2), 2 = T2, 3 = NTA */
static int g_pfhint;
static inline __attribute__((always_inline)) void pf_line(const void *p) {
    switch (g_pfhint) {
        case 1: _mm_prefetch((const char *)p, _MM_HINT_T1); break;
        case 2: _mm_prefetch((const char *)p, _MM_HINT_T2); break;
        case 3: _mm_prefetch((const char *)p, _MM_HINT_NTA); break;
        default: _mm_prefetch((const char *)p, _MM_HINT_T0); break;
    }
}
#define QAVX2_TARGET "avx2,fma"

/* the rule of packing.tiled: quantised rows with G % 64 == 0 in a matrix of R % 16 == 0 rows */
static inline int q_tiled(int wdtype, long rows, int g) {
    return (wdtype == 1 || wdtype == 2) && g % 64 == 0 && rows % 16 == 0;
}

/* row r (0..15) of a tiled block -> fp32 [c] */
static inline __attribute__((always_inline)) void tile_row_to_f32(const uint8_t *blk, int r, int wdtype, int c,
                                                                  int g, float *restrict buf) {
    const int u4 = wdtype == 2, step = u4 ? 512 : 1024;
    const float *sc = (const float *)(blk + (u4 ? (size_t)8 * c : (size_t)16 * c));
    for (int ks = 0; ks < c / 64; ks++) {
        const float s = sc[(ks * 64 / g) * 16 + r];
        const uint8_t *w = blk + (size_t)ks * step + (size_t)r * (u4 ? 32 : 64);
        float *b = buf + ks * 64;
        if (u4) {
            for (int j = 0; j < 32; j++) {
                b[j] = (float)((int)(w[j] & 15) - 8) * s;
                b[j + 32] = (float)((int)(w[j] >> 4) - 8) * s;
            }
        } else {
            for (int j = 0; j < 64; j++) b[j] = (float)(int8_t)w[j] * s;
        }
    }
}

/* row r of a quantised matrix starting at `rows` (tiled: r's block found from r) -> fp32 [c] */
static inline __attribute__((always_inline)) void qrow_to_f32(const uint8_t *rows, long rowbytes, long r, int tiled,
                                                              int wdtype, int c, int g, float *restrict buf) {
    if (tiled)
        tile_row_to_f32(rows + (size_t)(r / 16) * 16 * rowbytes, (int)(r % 16), wdtype, c, g, buf);
    else
        row_to_f32(rows + (size_t)r * rowbytes, wdtype, c, g, buf);
}

/* r_ / 16 tiled int4 blocks -> nibbles 0..15 in int8's tiled order (per k step 16 rows x 64
 * bytes), out [r_ / 16][c / 64][16][64] (the AMX int8 tiles' A operand) */
static void tiles_unpack_u4(const uint8_t *blk, long rowbytes, int r_, int c, uint8_t *out) {
    for (int bl = 0; bl < r_ / 16; bl++) {
        const uint8_t *src = blk + (size_t)bl * 16 * rowbytes;
        uint8_t *dst = out + (size_t)bl * 16 * c;
        for (int i = 0; i < 8 * c; i += 32) /* 32 bytes = one row of one k step */
            for (int j = 0; j < 32; j++) dst[2 * i + j] = src[i + j] & 15, dst[2 * i + 32 + j] = src[i + j] >> 4;
    }
}

/* One token's quantised activations in the weights' groups (quant_act fills them). */
typedef struct {
    const int8_t *q;  /* [c] */
    const float *s;   /* [c/g] scale */
    const int32_t *n; /* [c/g] sum of q */
} QAct;

/* ---- AVX512-VNNI ---- */

/* 16 vectors of 16 int32 -> one vector whose lane r is the sum of a[r]'s lanes */
static inline __attribute__((always_inline, target(VNNI_TARGET))) __m512i hsum16(const __m512i *a) {
    __m512i b[8], c[4];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2 * i], a[2 * i + 1]),
                                _mm512_unpackhi_epi32(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* per 128-bit lane: the 4 rows' partial sums, in row order */
        c[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(b[2 * i], b[2 * i + 1]),
                                _mm512_unpackhi_epi64(b[2 * i], b[2 * i + 1]));
    const __m512i d0 = _mm512_add_epi32(_mm512_shuffle_i32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                        _mm512_shuffle_i32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i d1 = _mm512_add_epi32(_mm512_shuffle_i32x4(c[2], c[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                        _mm512_shuffle_i32x4(c[2], c[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(d0, d1, _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i32x4(d0, d1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* The address `pf` bytes ahead of w in a thread's stream of blocks: past the end of this block
 * (its scales included) the stream goes on at nxt, the next block the thread will read (in
 * phase 2 that is another expert's block, not the bytes after this one; NULL: the bytes
 * after this one, as in phase 1, where an item's blocks and the next item's are contiguous). */
static inline __attribute__((always_inline)) const uint8_t *pf_at(const uint8_t *w, int pf, const uint8_t *end,
                                                                  const uint8_t *nxt) {
    const uint8_t *p = w + pf;
    return nxt && p >= end ? nxt + (p - end) : p;
}

/* the prefetch of one k step (step bytes at w), pf bytes ahead; the redirection only in the
 * steps whose prefetch crosses the block's end (kept out of the inner loop otherwise: on AVX2
 * the int4 loop lost ~10% to it) */
static inline __attribute__((always_inline)) void pf_step(const uint8_t *w, int step, int pf, const uint8_t *end,
                                                          const uint8_t *nxt) {
    if (nxt && w + pf + step > end)
        for (int l = 0; l < step; l += 64) pf_line(pf_at(w + l, pf, end, nxt));
    else
        for (int l = 0; l < step; l += 64) pf_line(w + pf + l);
}

/* the first two reduction steps of hsum8x2 and hsum8_512: 8 vectors -> 2, dword j of each
 * 128-bit lane of c[i] holding that lane's sum over a[4i + j] */
static inline __attribute__((always_inline, target(VNNI_TARGET))) void lane_sums4(const __m512i *a, __m512i *c) {
    __m512i b[4];
    for (int i = 0; i < 4; i++) /* per 128-bit lane: a[2i]'s pair sums in dwords 0, 2, a[2i + 1]'s in 1, 3 */
        b[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2 * i], a[2 * i + 1]),
                                _mm512_unpackhi_epi32(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 2; i++) /* per 128-bit lane: a[4i .. 4i + 3]'s partial sums over that lane */
        c[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(b[2 * i], b[2 * i + 1]),
                                _mm512_unpackhi_epi64(b[2 * i], b[2 * i + 1]));
}

/* 8 vectors, a[p] holding partial sums of row 2p in lanes 0..7 and of row 2p + 1 in lanes 8..15 ->
 * one vector whose lane r is row r's sum (the int4 loop's accumulators; 22 instructions where
 * hsum16 of 16 vectors takes 45) */
static inline __attribute__((always_inline, target(VNNI_TARGET))) __m512i hsum8x2(const __m512i *a) {
    __m512i c[2];
    lane_sums4(a, c);
    /* 128-bit lanes 0 + 1 of c[i] are rows 8i, 8i + 2, 8i + 4, 8i + 6; lanes 2 + 3 the odd rows */
    const __m512i s = _mm512_add_epi32(_mm512_shuffle_i32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm512_shuffle_i32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* s: rows 0 2 4 6 | 1 3 5 7 | 8 10 12 14 | 9 11 13 15 */
    const __m512i order = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
    return _mm512_permutexvar_epi32(order, s);
}

/* The int4 block loop for groups of 64: M (1 or 2) tokens
 * share each load and unpacking of the weights. A 64-byte load holds rows r and r + 1 of a k step (32
 * bytes each: low nibbles features 0..31, high nibbles 32..63). Both nibbles are taken as 16
 * times their value (v & 0xF0, and (v << 4) & 0xF0): one accumulator per row pair, no shuffle of
 * the weights; the activations' halves are broadcast to both 256-bit halves instead (one load
 * each). The accumulator is 16 times the integer sum, exactly (|sum| <= 16 * 15 * 127 * g, below
 * 2^31 for any g < 70000), and the reduction shifts it back, so the integer sums and everything
 * after them are those of the previous loop: the same results bit for bit. */

/* one k step of M tokens into acc[j][0..8) */
static inline __attribute__((always_inline, target(VNNI_TARGET))) void u4_step(__m512i acc[2][8], const uint8_t *w,
                                                                             const QAct *x, const int M, int ks) {
    const __m512i hi4 = _mm512_set1_epi8((char)0xF0);
    __m512i xa[2], xb[2];
    for (int j = 0; j < M; j++) {
        xa[j] = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(x[j].q + ks * 64)));
        xb[j] = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(x[j].q + ks * 64 + 32)));
    }
#pragma GCC unroll 8
    for (int p = 0; p < 8; p++) {
        const __m512i v = _mm512_loadu_si512(w + p * 64); /* rows 2p, 2p + 1 */
        const __m512i lo = _mm512_and_si512(_mm512_slli_epi16(v, 4), hi4);
        const __m512i hi = _mm512_and_si512(v, hi4);
        for (int j = 0; j < M; j++)
            acc[j][p] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[j][p], lo, xa[j]), hi, xb[j]);
    }
}

static inline __attribute__((always_inline, target(VNNI_TARGET))) void blk_vnni_u4m(const uint8_t *blk, const int M,
                                                                                  int c, const QAct *x, float *res,
                                                                                  int pf, const uint8_t *nxt,
                                                                                  int first) {
    const float *wsc = (const float *)(blk + (size_t)8 * c);
    const uint8_t *end = (const uint8_t *)(wsc + (c / 64) * 16);
    for (int ks = 0; ks < c / 64; ks++) { /* group ks = k step ks */
        const uint8_t *w = blk + (size_t)ks * 512;
        if (pf && first) pf_step(w, 512, pf, end, nxt);
        __m512i acc[2][8];
        for (int j = 0; j < M; j++)
#pragma GCC unroll 8
            for (int p = 0; p < 8; p++) acc[j][p] = _mm512_setzero_si512();
        u4_step(acc, w, x, M, ks);
        const __m512 ws = _mm512_loadu_ps(wsc + ks * 16);
        for (int j = 0; j < M; j++) {
            const __m512i d = _mm512_sub_epi32(_mm512_srai_epi32(hsum8x2(acc[j]), 4), _mm512_set1_epi32(8 * x[j].n[ks]));
            const __m512 s = _mm512_mul_ps(ws, _mm512_set1_ps(x[j].s[ks]));
            _mm512_storeu_ps(res + j * 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), s, _mm512_loadu_ps(res + j * 16)));
        }
    }
}

/* res[j][0..16) = block rows . x_j for j < m; u4: int4 block, else int8. pf: prefetch distance in
 * bytes (0 = none), nxt: see pf_at. Inlined with a constant u4 (blk_vnni), so the accumulators
 * stay in registers. int4 with groups of 64 takes blk_vnni_u4 instead (this loop with
 * EXPERTMESH_QDOT_PAIR=0, to time against). */
static inline __attribute__((always_inline, target(VNNI_TARGET))) void blk_vnni_body(const uint8_t *blk, const int u4,
                                                                                   const int kpg2, int c, int g,
                                                                                   const QAct *x, int m, float *res,
                                                                                   int pf, const uint8_t *nxt) {
    /* kpg2: the caller's g is 128, a constant trip count of 2 (GCC then keeps the accumulators
     * in registers; with a variable count it copies them every step and spills some) */
    const int kpg = kpg2 ? 2 : g / 64, step = u4 ? 512 : 1024;
    const float *wsc = (const float *)(blk + (u4 ? (size_t)8 * c : (size_t)16 * c));
    const uint8_t *end = (const uint8_t *)(wsc + (c / g) * 16);
    const __m512i flip = _mm512_set1_epi8((char)0x80), lo4 = _mm512_set1_epi8(15);
    const int bias = u4 ? 8 : 128;
    if (pf) /* the block's scales: one line per group, read only at each group's end */
        for (int l = 0; l < c / g; l++) _mm_prefetch((const char *)(wsc + l * 16), _MM_HINT_T0);
    for (int j = 0; j < m; j++) _mm512_storeu_ps(res + j * 16, _mm512_setzero_ps());
    for (int gi = 0; gi < c / g; gi++) {
        const __m512 ws = _mm512_loadu_ps(wsc + gi * 16);
        for (int j = 0; j < m; j++) {
            __m512i acc[16];
#pragma GCC unroll 16
            for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_si512();
            for (int kk = 0; kk < kpg; kk++) {
                const int ks = gi * kpg + kk;
                const uint8_t *w = blk + (size_t)ks * step;
                if (pf && j == 0) pf_step(w, step, pf, end, nxt);
                const __m512i xv = _mm512_loadu_si512(x[j].q + ks * 64);
                if (u4) {
#pragma GCC unroll 8
                    for (int r = 0; r < 16; r += 2) {
                        const __m512i v = _mm512_loadu_si512(w + r * 32); /* rows r, r + 1 */
                        const __m512i lo = _mm512_and_si512(v, lo4);
                        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
                        /* row r: its 32 low nibbles (features 0..31), then its 32 high (32..63) */
                        acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_shuffle_i64x2(lo, hi, 0x44), xv);
                        acc[r + 1] = _mm512_dpbusd_epi32(acc[r + 1], _mm512_shuffle_i64x2(lo, hi, 0xEE), xv);
                    }
                } else {
#pragma GCC unroll 16
                    for (int r = 0; r < 16; r++)
                        acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_xor_si512(_mm512_loadu_si512(w + r * 64), flip), xv);
                }
            }
            const __m512i d = _mm512_sub_epi32(hsum16(acc), _mm512_set1_epi32(bias * x[j].n[gi]));
            const __m512 s = _mm512_mul_ps(ws, _mm512_set1_ps(x[j].s[gi]));
            _mm512_storeu_ps(res + j * 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), s, _mm512_loadu_ps(res + j * 16)));
        }
    }
}

/* 8 vectors, a[r] holding partial sums of row r in all 16 lanes -> a vector holding row r's sum
 * in lanes r and r + 8 (the int8 pair loop's half blocks, blended into one vector after) */
static inline __attribute__((always_inline, target(VNNI_TARGET))) __m512i hsum8_512(const __m512i *a) {
    __m512i c[2];
    lane_sums4(a, c);
    /* e: 128-bit lanes c0 (0 + 1), c0 (2 + 3), c1 (0 + 1), c1 (2 + 3); f: lane 0 rows 0..3, lane 2 rows 4..7 */
    const __m512i e = _mm512_add_epi32(_mm512_shuffle_i32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm512_shuffle_i32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i f = _mm512_add_epi32(e, _mm512_shuffle_i32x4(e, e, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm512_shuffle_i32x4(f, f, _MM_SHUFFLE(2, 0, 2, 0));
}

/* The int8 block loop for two tokens: each weight row is loaded and made u8 once for
 * both tokens, half a block (8 rows) at a time so the 16 accumulators stay in registers. The
 * integer sums are those of blk_vnni_body's, so the results are the same bit for bit. */
static inline __attribute__((always_inline, target(VNNI_TARGET))) void blk_vnni_i8x2(const uint8_t *blk,
                                                                                   const int kpg2, int c, int g,
                                                                                   const QAct *x, float *res, int pf,
                                                                                   const uint8_t *nxt, int first) {
    const int kpg = kpg2 ? 2 : g / 64; /* as blk_vnni_body's */
    const float *wsc = (const float *)(blk + (size_t)16 * c);
    const uint8_t *end = (const uint8_t *)(wsc + (c / g) * 16);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int gi = 0; gi < c / g; gi++) {
        __m512i sum[2][2]; /* [token][half] */
        for (int half = 0; half < 2; half++) {
            __m512i acc[2][8];
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++) acc[0][r] = acc[1][r] = _mm512_setzero_si512();
            for (int kk = 0; kk < kpg; kk++) {
                const int ks = gi * kpg + kk;
                const uint8_t *w = blk + (size_t)ks * 1024;
                if (pf && first && half == 0) pf_step(w, 1024, pf, end, nxt);
                const __m512i x0 = _mm512_loadu_si512(x[0].q + ks * 64), x1 = _mm512_loadu_si512(x[1].q + ks * 64);
#pragma GCC unroll 8
                for (int r = 0; r < 8; r++) {
                    const __m512i v = _mm512_xor_si512(_mm512_loadu_si512(w + (8 * half + r) * 64), flip);
                    acc[0][r] = _mm512_dpbusd_epi32(acc[0][r], v, x0);
                    acc[1][r] = _mm512_dpbusd_epi32(acc[1][r], v, x1);
                }
            }
            sum[0][half] = hsum8_512(acc[0]);
            sum[1][half] = hsum8_512(acc[1]);
        }
        const __m512 ws = _mm512_loadu_ps(wsc + gi * 16);
        for (int j = 0; j < 2; j++) {
            const __m512i t = _mm512_mask_blend_epi32((__mmask16)0xFF00, sum[j][0], sum[j][1]);
            const __m512i d = _mm512_sub_epi32(t, _mm512_set1_epi32(128 * x[j].n[gi]));
            const __m512 s = _mm512_mul_ps(ws, _mm512_set1_ps(x[j].s[gi]));
            _mm512_storeu_ps(res + j * 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), s, _mm512_loadu_ps(res + j * 16)));
        }
    }
}

/* the int4 pair loop over m tokens, two at a time; groups of 64 (int4's default) only */
__attribute__((target(VNNI_TARGET))) static void blk_vnni_u4(const uint8_t *blk, int c, const QAct *x, int m,
                                                             float *res, int pf, const uint8_t *nxt) {
    const float *wsc = (const float *)(blk + (size_t)8 * c);
    if (pf) /* the block's scales: one line per group */
        for (int l = 0; l < c / 64; l++) _mm_prefetch((const char *)(wsc + l * 16), _MM_HINT_T0);
    for (int j = 0; j < m; j++) _mm512_storeu_ps(res + j * 16, _mm512_setzero_ps());
    for (int j = 0; j < m; j += 2) {
        if (m - j >= 2)
            blk_vnni_u4m(blk, 2, c, x + j, res + j * 16, pf, nxt, j == 0);
        else
            blk_vnni_u4m(blk, 1, c, x + j, res + j * 16, pf, nxt, j == 0);
    }
}

/* int8 over m >= 2 tokens: pairs, then a last token alone (the scales already prefetched) */
__attribute__((target(VNNI_TARGET))) static void blk_vnni_i8(const uint8_t *blk, int c, int g, const QAct *x, int m,
                                                             float *res, int pf, const uint8_t *nxt) {
    const float *wsc = (const float *)(blk + (size_t)16 * c);
    if (pf)
        for (int l = 0; l < c / g; l++) _mm_prefetch((const char *)(wsc + l * 16), _MM_HINT_T0);
    for (int j = 0; j < m; j++) _mm512_storeu_ps(res + j * 16, _mm512_setzero_ps());
    int j = 0;
    for (; j + 2 <= m; j += 2) {
        if (g == 128)
            blk_vnni_i8x2(blk, 1, c, g, x + j, res + j * 16, pf, nxt, j == 0);
        else
            blk_vnni_i8x2(blk, 0, c, g, x + j, res + j * 16, pf, nxt, j == 0);
    }
    if (j < m && g == 128)
        blk_vnni_body(blk, 0, 1, c, g, x + j, 1, res + j * 16, 0, NULL);
    else if (j < m)
        blk_vnni_body(blk, 0, 0, c, g, x + j, 1, res + j * 16, 0, NULL);
}

static int g_qpair = 1; /* EXPERTMESH_QDOT_PAIR, read per call by moe_decode_tiles */

__attribute__((target(VNNI_TARGET))) static void blk_vnni(const uint8_t *blk, int u4, int c, int g, const QAct *x,
                                                          int m, float *res, int pf, const uint8_t *nxt) {
    if (u4 && g == 64 && g_qpair)
        blk_vnni_u4(blk, c, x, m, res, pf, nxt);
    else if (!u4 && m >= 2 && g_qpair)
        blk_vnni_i8(blk, c, g, x, m, res, pf, nxt);
    else if (!u4 && g == 128 && g_qpair) /* int8's default group */
        blk_vnni_body(blk, 0, 1, c, g, x, m, res, pf, nxt);
    else if (u4)
        blk_vnni_body(blk, 1, 0, c, g, x, m, res, pf, nxt);
    else
        blk_vnni_body(blk, 0, 0, c, g, x, m, res, pf, nxt);
}

/* ---- AVX2 (8 rows per pass) ---- */

/* 8 vectors of 8 int32 -> one vector whose lane r is the sum of a[r]'s lanes */
static inline __attribute__((always_inline, target(QAVX2_TARGET))) __m256i hsum8(const __m256i *a) {
    const __m256i g0 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
    const __m256i g1 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[4], a[5]), _mm256_hadd_epi32(a[6], a[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(g0, g1, 0x20), _mm256_permute2x128_si256(g0, g1, 0x31));
}

static inline __attribute__((always_inline, target(QAVX2_TARGET))) void blk_avx2_body(const uint8_t *blk,
                                                                                     const int u4, int c, int g,
                                                                                     const QAct *x, int m,
                                                                                     float *res, int pf) {
    const int kpg = g / 64, step = u4 ? 512 : 1024;
    const float *wsc = (const float *)(blk + (u4 ? (size_t)8 * c : (size_t)16 * c));
    const __m256i ones = _mm256_set1_epi16(1), lo4 = _mm256_set1_epi8(15);
    const int bias = u4 ? 8 : 0; /* the sign trick needs no bias */
    if (pf)
        for (int l = 0; l < c / g; l++) _mm_prefetch((const char *)(wsc + l * 16), _MM_HINT_T0);
    memset(res, 0, sizeof(float) * 16 * (size_t)m);
    for (int gi = 0; gi < c / g; gi++) {
        for (int j = 0; j < m; j++) {
            for (int half = 0; half < 2; half++) {
                __m256i acc[8];
#pragma GCC unroll 8
                for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_si256();
                for (int kk = 0; kk < kpg; kk++) {
                    const int ks = gi * kpg + kk;
                    const uint8_t *w = blk + (size_t)ks * step;
                    if (pf && j == 0 && half == 0)
                        for (int l = 0; l < step; l += 64) pf_line(w + pf + l);
                    const __m256i x0 = _mm256_loadu_si256((const __m256i *)(x[j].q + ks * 64));
                    const __m256i x1 = _mm256_loadu_si256((const __m256i *)(x[j].q + ks * 64 + 32));
                    if (u4) {
#pragma GCC unroll 8
                        for (int r = 0; r < 8; r++) {
                            const __m256i v = _mm256_loadu_si256((const __m256i *)(w + (8 * half + r) * 32));
                            const __m256i lo = _mm256_and_si256(v, lo4);
                            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
                            /* <= 2 * 2 * 15 * 127 per int16: no saturation */
                            const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1));
                            acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(p, ones));
                        }
                    } else {
                        const __m256i a0 = _mm256_abs_epi8(x0), a1 = _mm256_abs_epi8(x1);
#pragma GCC unroll 8
                        for (int r = 0; r < 8; r++) {
                            const uint8_t *wr = w + (8 * half + r) * 64;
                            const __m256i w0 = _mm256_loadu_si256((const __m256i *)wr);
                            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wr + 32));
                            /* |x| * sign(w, x) = x * w, <= 2 * 127 * 127 per int16: no saturation */
                            const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(w0, x0)), ones);
                            const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(w1, x1)), ones);
                            acc[r] = _mm256_add_epi32(acc[r], _mm256_add_epi32(p0, p1));
                        }
                    }
                }
                const __m256i d = _mm256_sub_epi32(hsum8(acc), _mm256_set1_epi32(bias * x[j].n[gi]));
                const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(wsc + gi * 16 + 8 * half), _mm256_set1_ps(x[j].s[gi]));
                float *o = res + j * 16 + 8 * half;
                _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), s, _mm256_loadu_ps(o)));
            }
        }
    }
}

/* nxt (the prefetch chained into the next block) is not used on AVX2: any change to this loop
 * (even the redirection test once per step) cost the 2-core CI machine's int4 decode 5-10%, where
 * the dots, not the bandwidth, bound it */
__attribute__((target(QAVX2_TARGET))) static void blk_avx2(const uint8_t *blk, int u4, int c, int g, const QAct *x,
                                                           int m, float *res, int pf, const uint8_t *nxt) {
    (void)nxt;
    if (u4)
        blk_avx2_body(blk, 1, c, g, x, m, res, pf);
    else
        blk_avx2_body(blk, 0, c, g, x, m, res, pf);
}

/* one group of g activations -> q [g] int8 (symmetric, scale amax / 127), its scale, and the sum
 * of q. Round half away from zero (torch rounds half to even: ties differ, ~never with real data). */
static inline __attribute__((always_inline)) float quant_group(const float *xg, int g, int8_t *q, int32_t *n) {
    float amax = 0.0f;
    for (int i = 0; i < g; i++) amax = fmaxf(amax, fabsf(xg[i]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int sum = 0;
    for (int i = 0; i < g; i++) {
        const float y = xg[i] * inv;
        int v = (int)(y + (y >= 0.0f ? 0.5f : -0.5f));
        v = v > 127 ? 127 : (v < -127 ? -127 : v);
        q[i] = (int8_t)v;
        sum += v;
    }
    *n = sum;
    return amax / 127.0f;
}

/* x [c] fp32 -> q [c] int8, sc [c/g] scales, n [c/g] sums of q (the tiled decode kernels) */
static void quant_act_n(const float *x, int c, int g, int8_t *q, float *sc, int32_t *n) {
    for (int gi = 0; gi < c / g; gi++) sc[gi] = quant_group(x + (size_t)gi * g, g, q + (size_t)gi * g, n + gi);
}

/* quant_act_n in AVX-512 (the decode kernel's activations, on every thread's critical
 * path at small T), from fp32 or bf16 (xbf16) x; g % 16 == 0. The same operations as quant_group
 * in the same order (the product rounded before the half is added), so the same bytes. */
static inline __attribute__((always_inline, target(VNNI_TARGET))) __m512 ld16f(const void *x, int xbf16, size_t i) {
    if (xbf16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i))), 16));
    return _mm512_loadu_ps((const float *)x + i);
}

__attribute__((target(VNNI_TARGET))) static void quant_act_n_512(const void *x, int xbf16, int c, int g, int8_t *q,
                                                                 float *sc, int32_t *n) {
    const __m512 zero = _mm512_setzero_ps(), half = _mm512_set1_ps(0.5f), nhalf = _mm512_set1_ps(-0.5f);
    const __m512i lim = _mm512_set1_epi32(127), nlim = _mm512_set1_epi32(-127);
    for (int gi = 0; gi < c / g; gi++) {
        const size_t o = (size_t)gi * g;
        __m512 m = zero;
        for (int i = 0; i < g; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(ld16f(x, xbf16, o + i)));
        const float amax = _mm512_reduce_max_ps(m);
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m512 vi = _mm512_set1_ps(inv);
        __m512i sum = _mm512_setzero_si512();
        for (int i = 0; i < g; i += 16) {
            __m512 y = _mm512_mul_ps(ld16f(x, xbf16, o + i), vi);
            __asm__("" : "+v"(y)); /* no fused multiply-add: quant_group rounds the product first */
            const __mmask16 ge = _mm512_cmp_ps_mask(y, zero, _CMP_GE_OQ);
            __m512i v = _mm512_cvttps_epi32(_mm512_add_ps(y, _mm512_mask_blend_ps(ge, nhalf, half)));
            v = _mm512_max_epi32(_mm512_min_epi32(v, lim), nlim);
            _mm_storeu_si128((__m128i *)(q + o + i), _mm512_cvtepi32_epi8(v));
            sum = _mm512_add_epi32(sum, v);
        }
        n[gi] = _mm512_reduce_add_epi32(sum);
        sc[gi] = amax / 127.0f;
    }
}

/* the same with cs [c/g] = scale * sum(q) (the AMX int8 kernel) */
static void quant_act(const float *x, int c, int g, int8_t *q, float *sc, float *cs) {
    for (int gi = 0; gi < c / g; gi++) {
        int32_t n;
        sc[gi] = quant_group(x + (size_t)gi * g, g, q + (size_t)gi * g, &n);
        cs[gi] = sc[gi] * (float)n;
    }
}

/* fp32 -> bf16, round to nearest even (inputs are finite) */
static inline __attribute__((always_inline)) uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline __attribute__((always_inline)) void row_to_bf16(const float *x, int c, uint16_t *out) {
    for (int i = 0; i < c; i++) out[i] = to_bf16(x[i]);
}

#define BF16_TARGET "avx512f,avx512bw,avx512vl,avx512bf16,fma"

/* res[j] = row . xb[j], bf16 row and bf16 activations, c % 64 == 0 */
static inline __attribute__((always_inline, target(BF16_TARGET))) void bf16_m(const uint8_t *row, int c,
                                                                              const uint16_t *const *xb,
                                                                              const int m, float *res) {
    __m512 a[MAXM], b[MAXM];
    for (int j = 0; j < m; j++) a[j] = b[j] = _mm512_setzero_ps();
    for (int i = 0; i < c; i += 64) {
        const __m512i w0 = _mm512_loadu_si512(row + 2 * i), w1 = _mm512_loadu_si512(row + 2 * i + 64);
        for (int j = 0; j < m; j++) {
            a[j] = _mm512_dpbf16_ps(a[j], (__m512bh)w0, (__m512bh)_mm512_loadu_si512(xb[j] + i));
            b[j] = _mm512_dpbf16_ps(b[j], (__m512bh)w1, (__m512bh)_mm512_loadu_si512(xb[j] + i + 32));
        }
    }
    for (int j = 0; j < m; j++) res[j] = _mm512_reduce_add_ps(_mm512_add_ps(a[j], b[j]));
}

__attribute__((target(BF16_TARGET))) static void dots_bf16(const uint8_t *row, int c, const uint16_t *const *xb,
                                                            int m, float *res) {
    for (int j0 = 0; j0 < m; j0 += MAXM) {
        const uint16_t *const *x = xb + j0;
        float *r = res + j0;
        switch (m - j0 < MAXM ? m - j0 : MAXM) {
            case 1: bf16_m(row, c, x, 1, r); break;
            case 2: bf16_m(row, c, x, 2, r); break;
            case 3: bf16_m(row, c, x, 3, r); break;
            case 4: bf16_m(row, c, x, 4, r); break;
            case 5: bf16_m(row, c, x, 5, r); break;
            case 6: bf16_m(row, c, x, 6, r); break;
            case 7: bf16_m(row, c, x, 7, r); break;
            default: bf16_m(row, c, x, 8, r); break;
        }
    }
}
