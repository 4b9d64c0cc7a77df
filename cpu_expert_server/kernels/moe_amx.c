/* AMX tiles for prefill-shaped MoE (included by moe_gemv.c; the driver that runs them is
 * moe_amx_driver.c, the int8 tiles moe_amx_int8.c). Called only when the CPU has AMX and
 * moe_amx_init() succeeded.
 *
 * Tiles (all 16 rows x 64 bytes): A = 16 weight rows x 64 bytes of one k step, read in place from
 * the packed rows; B = one token tile (16 tokens) of one k step in the VNNI layout (bf16: 16 input
 * pairs x 16 tokens x 2; int8: 16 quads x 16 tokens x 4), 1 KiB per k step, k steps consecutive;
 * C = 16 rows x 16 tokens, fp32 (bf16) or int32 (int8). A block is 32 weight rows (two A tiles,
 * one gate/up interleave block with RB = 16 in phase 1) against two token tiles: 4 C, 2 A, 2 B =
 * the 8 tile registers, and every A tile load feeds two products, every B load two.
 *
 * EXPERTMESH_AMX_EMULATE (tests only): the tile instructions become plain C on per-thread arrays
 * and the target drops to AVX2, so the tile logic runs and is checked on any x86-64 CI machine.
 */
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

/* fp32 vectors of one C tile row (16 tokens); AVX-512 registers under AMX_TARGET */
typedef float v16f_a __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i_a __attribute__((vector_size(64), aligned(4)));
typedef uint32_t v16u_a __attribute__((vector_size(64), aligned(4)));

#ifdef EXPERTMESH_AMX_EMULATE
#define AMX_TARGET "avx2,fma"
typedef struct {
    uint8_t b[16][64];
} EmuTile;
static __thread EmuTile emu_tile[8];
static void emu_load(int t, const void *p, long stride) {
    for (int r = 0; r < 16; r++) memcpy(emu_tile[t].b[r], (const uint8_t *)p + r * stride, 64);
}
static void emu_store(int t, void *p, long stride) {
    for (int r = 0; r < 16; r++) memcpy((uint8_t *)p + r * stride, emu_tile[t].b[r], 64);
}
static float emu_bf16(const uint8_t *p) {
    uint32_t u = (uint32_t)(p[0] | p[1] << 8) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
/* C[m][n] += sum over k of A[m][k] * B[k / per][n][k % per], per = 2 (bf16) or 4 (int8) */
static void emu_dp(int c, int a, int b, int kind /* 0 bf16, 1 s8 x s8, 2 u8 x s8 */) {
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 16; n++) {
            uint8_t *cp = emu_tile[c].b[m] + 4 * n;
            if (kind == 0) {
                float s;
                memcpy(&s, cp, 4);
                for (int k = 0; k < 32; k++)
                    s += emu_bf16(emu_tile[a].b[m] + 2 * k) * emu_bf16(emu_tile[b].b[k / 2] + 4 * n + 2 * (k % 2));
                memcpy(cp, &s, 4);
            } else {
                int32_t s;
                memcpy(&s, cp, 4);
                for (int k = 0; k < 64; k++) {
                    const int av = kind == 1 ? (int8_t)emu_tile[a].b[m][k] : emu_tile[a].b[m][k];
                    s += av * (int8_t)emu_tile[b].b[k / 4][4 * n + k % 4];
                }
                memcpy(cp, &s, 4);
            }
        }
}
#define TILE_LOAD(t, p, stride) emu_load(t, p, stride)
#define TILE_STORE(t, p, stride) emu_store(t, p, stride)
#define TILE_ZERO(t) memset(&emu_tile[t], 0, sizeof(EmuTile))
#define TILE_BF16(c, a, b) emu_dp(c, a, b, 0)
#define TILE_SS(c, a, b) emu_dp(c, a, b, 1)
#define TILE_US(c, a, b) emu_dp(c, a, b, 2)
int moe_amx_init(void) { return 0; }
static void amx_config(void) {}
static void amx_release(void) {}
#else
#define AMX_TARGET "amx-tile,amx-bf16,amx-int8,avx512f,avx512bw,avx512vl,avx512bf16,fma"
#define TILE_LOAD(t, p, stride) _tile_loadd(t, p, stride)
#define TILE_STORE(t, p, stride) _tile_stored(t, p, stride)
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_BF16(c, a, b) _tile_dpbf16ps(c, a, b)
#define TILE_SS(c, a, b) _tile_dpbssd(c, a, b)
#define TILE_US(c, a, b) _tile_dpbusd(c, a, b)

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
#endif

/* NOTE: GCC's tile intrinsics are asm statements without a memory clobber: fence the compiler
 * around them wherever C code reads what a tile store wrote or writes what a tile load reads */
#define COMPILER_FENCE() __asm__ volatile("" ::: "memory")

/* Software prefetch of the weight rows, per block: PF_ROWS each of the block's 32 rows
 * AMX_PF_DIST k steps ahead, to L1 (the rows are 32 streams, 4 KiB apart at H = 2048, more than
 * the hardware prefetchers follow); PF_NEAR the same AMX_PF_NEAR k steps ahead; PF_NEXT the next
 * block's rows, spread over this block's k steps as one linear stream, to L2. The driver picks per
 * call (moe_amx_driver.c). */
#ifndef AMX_PF_DIST
#define AMX_PF_DIST 8
#endif
#ifndef AMX_PF_NEAR
#define AMX_PF_NEAR 2
#endif
/* cache levels the two modes prefetch to (bench variants try others) */
#ifndef AMX_PF_ROWS_HINT
#define AMX_PF_ROWS_HINT _MM_HINT_T0
#endif
#ifndef AMX_PF_NEXT_HINT
#define AMX_PF_NEXT_HINT _MM_HINT_T1
#endif
enum { PF_NONE, PF_NEXT, PF_ROWS, PF_NEAR };
typedef struct {
    int mode;
    const uint8_t *p; /* PF_NEXT: the next block's first byte (NULL: none) */
    long lines;       /* its 64-byte lines */
} Prefetch;

static inline __attribute__((always_inline)) void prefetch_part(const Prefetch *pf, const uint8_t *a0,
                                                                const uint8_t *a1, long sa, long kstep, int ks,
                                                                int ksteps) {
    const int dist = pf->mode == PF_NEAR ? AMX_PF_NEAR : AMX_PF_DIST;
    if ((pf->mode == PF_ROWS || pf->mode == PF_NEAR) && ks + dist < ksteps)
        for (int r = 0; r < 16; r += sa < 64 ? (int)(64 / sa) : 1) { /* one per line (int4: 2 rows) */
            _mm_prefetch((const char *)(a0 + r * sa + (size_t)(ks + dist) * kstep), AMX_PF_ROWS_HINT);
            _mm_prefetch((const char *)(a1 + r * sa + (size_t)(ks + dist) * kstep), AMX_PF_ROWS_HINT);
        }
    if (pf->mode != PF_NEXT || !pf->p) return;
    const long per = (pf->lines + ksteps - 1) / ksteps;
    for (long l = ks * per; l < (ks + 1) * per && l < pf->lines; l++)
        _mm_prefetch((const char *)(pf->p + l * 64), AMX_PF_NEXT_HINT);
}

enum { TILES_BF16, TILES_S8, TILES_U8 };

/* AMX_DIAG (bench_cpu_prefill.py diagnostic builds, results WRONG): 1 tile loads without the tile
 * products (the weight streaming alone), 2 A tiles from an L1 buffer instead of the weights (the
 * tile work alone, B as usual), 3 A and B from L1 (the tiles' own rate inside the kernel) */
#ifndef AMX_DIAG
#define AMX_DIAG 0
#endif
#if AMX_DIAG >= 2
static __thread uint8_t amx_diag_buf[4096] __attribute__((aligned(64)));
#endif

/* Where a block's 32 weight rows are for the A tiles: k step ks of rows 16h .. 16h + 15 starts at
 * a[h] + ks * kstep, rows sa bytes apart (the packed row format: kstep 64, sa = row bytes; a
 * layout with 1 KiB tiles would give kstep 1024, sa 64). int8 tiles: the scale of row 16h + r in
 * group gi is s[h][gi * sg + r * sr]. */
typedef struct {
    const uint8_t *a[2];
    long sa, kstep;
    const float *s[2];
    long sg, sr;
    /* tiled int4 blocks unpacked step by step (AMX_U4_FUSED): rows 16h .. 16h + 15's packed k
     * step ks at u4[h] + ks * 512, unpacked into ub (4 KiB: two steps of the two A tiles) just
     * before its tile loads; NULL: a[] already holds what the tiles read */
    const uint8_t *u4[2];
    uint8_t *ub;
    int kpg; /* int4 k steps per group (bf16 tiles' dequantisation: the scale of step ks is
                s[h][(ks / kpg) * sg + r * sr]) */
} ARows;

/* AMX_U4_FUSED 1: a tiled int4 block is unpacked one k step at a time into a 4 KiB buffer that
 * stays in L1, right before the step's tile loads; 0: the whole block (32 rows x C: 64 KiB at
 * C = 2048, in L2) is unpacked before its first step and the tiles read it back from L2 */
#ifndef AMX_U4_FUSED
#define AMX_U4_FUSED 1
#endif

/* AMX_U4_S16 1: int4 unpacks to 16 q as signed bytes ((n << 4) ^ 0x80 for the stored nibble n =
 * q + 8) for TDPBSSD, and the token scales carry the 1/16 (exact: a power of two). The fold of each
 * group's sums then has no per-token correction to take off, where TDPBUSD on nibbles 0..15 gave
 * sum((q + 8) x) and 8 * sum(x) came off every (row, token, group). The sums are the same
 * integers times 16, so the results are bit-equal while 16 * |sum| < 2^24 (always in a group of
 * 64 or 128; a per-row group of 2048 inputs would need |sum| > 2^20, far past int8 activations
 * on random signs, and then rounds in a float's last bit). 0: nibbles 0..15 on TDPBUSD. */
#ifndef AMX_U4_S16
#define AMX_U4_S16 1
#endif

/* One packed int4 k step of 16 tiled rows (16 x 32 bytes: the low nibble of byte j is feature j,
 * the high nibble feature j + 32) -> the A tile's 16 rows x 64 bytes (tiles_unpack_u4's order,
 * moe_qdot.c): nibbles 0..15, or 16 q (AMX_U4_S16) */
static inline __attribute__((always_inline, target(AMX_TARGET))) void unpack_u4_step(const uint8_t *src,
                                                                                     uint8_t *dst) {
#if AMX_U4_S16 && !defined(EXPERTMESH_AMX_EMULATE)
    /* a row's 32 bytes in both halves of a register; 16-bit lanes of the low half shift left by 4
     * (the low nibble lands in the byte's high half), then (x & 0xf0) ^ 0x80 in one instruction:
     * 4 instructions a row where the 256-bit steps below take 8 (the emulated build's path) */
    const __m512i shift = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(4), 0);
    const __m512i hi4 = _mm512_set1_epi8((char)0xf0), flip = _mm512_set1_epi8((char)0x80);
    for (int r = 0; r < 16; r++) {
        const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(src + 32 * r)));
        _mm512_store_si512(dst + 64 * r, _mm512_ternarylogic_epi32(_mm512_sllv_epi16(v, shift), hi4, flip, 0x6a));
    }
#elif AMX_U4_S16
    const __m256i hi4 = _mm256_set1_epi8((char)0xf0), flip = _mm256_set1_epi8((char)0x80);
    for (int r = 0; r < 16; r++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(src + 32 * r));
        /* the low nibble shifted up within its 16-bit lane lands in the byte's high half */
        _mm256_store_si256((__m256i *)(dst + 64 * r),
                           _mm256_xor_si256(_mm256_and_si256(_mm256_slli_epi16(v, 4), hi4), flip));
        _mm256_store_si256((__m256i *)(dst + 64 * r + 32), _mm256_xor_si256(_mm256_and_si256(v, hi4), flip));
    }
#else
    const __m256i lo4 = _mm256_set1_epi8(15);
    for (int r = 0; r < 16; r++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(src + 32 * r));
        _mm256_store_si256((__m256i *)(dst + 64 * r), _mm256_and_si256(v, lo4));
        _mm256_store_si256((__m256i *)(dst + 64 * r + 32), _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4));
    }
#endif
}

/* One packed int4 k step of 16 tiled rows (as unpack_u4_step's) dequantised to bf16 for the bf16
 * tiles: features 0..31 (the low nibbles) -> dst, rows 64 bytes apart (one bf16 k step's A tile),
 * features 32..63 (the high nibbles) -> dst + 1024; w = bf16((n - 8) * s[r]), rounded to nearest
 * even. Each row's 16 possible values are computed once (a table of 16 bf16, duplicated to 32
 * words) and its 64 nibbles looked up in it with two word permutes: 6 vector instructions a row. */
static inline __attribute__((always_inline, target(AMX_TARGET))) void dequant_u4_bf16_step(const uint8_t *src,
                                                                                           const float *s,
                                                                                           uint8_t *dst) {
#ifndef EXPERTMESH_AMX_EMULATE
    const __m512 q = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    for (int r = 0; r < 16; r++) {
        const __m512 v = _mm512_mul_ps(q, _mm512_set1_ps(s[r]));
        const __m512i tbl = (__m512i)_mm512_cvtne2ps_pbh(v, v); /* word n and n + 16: T[n] */
        /* byte j -> word j: the permute reads its low 5 bits, n_lo + 16 * (n_hi & 1) */
        const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(src + 32 * r)));
        _mm512_store_si512(dst + 64 * r, _mm512_permutexvar_epi16(w, tbl));
        _mm512_store_si512(dst + 1024 + 64 * r, _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), tbl));
    }
#else
    for (int r = 0; r < 16; r++)
        for (int j = 0; j < 32; j++) {
            const uint8_t b = src[32 * r + j];
            const uint16_t lo = to_bf16((float)((int)(b & 15) - 8) * s[r]), hi = to_bf16((float)((int)(b >> 4) - 8) * s[r]);
            memcpy(dst + 64 * r + 2 * j, &lo, 2);
            memcpy(dst + 1024 + 64 * r + 2 * j, &hi, 2);
        }
#endif
}

/* C tiles 0..3 (0..1 unless two) -> c, 4 x 16 x 16 */
static inline __attribute__((always_inline, target(AMX_TARGET))) void tile_store(int two, void *c) {
    uint8_t *cb = c;
    TILE_STORE(0, cb, 64);
    TILE_STORE(1, cb + 1024, 64);
    if (two) {
        TILE_STORE(2, cb + 2048, 64);
        TILE_STORE(3, cb + 3072, 64);
    }
    COMPILER_FENCE();
}

/* One block: C tiles 0..3 = A (the 32 rows of ar: a0 = rows 0-15, a1 = rows 16-31) x B(b0, b1; 1 KiB
 * per k step), k steps [k0, k1), C tiles stored to c (4 x 16 x 16: a0 x b0, a1 x b0, a0 x b1, a1 x b1;
 * NULL: left in the tiles), two = whether b1 is used. Always inlined with a constant kind. */
static inline __attribute__((always_inline, target(AMX_TARGET))) void tile_steps(
    int kind, const ARows *ar, const uint32_t *b0, const uint32_t *b1, int two, int k0, int k1, const Prefetch *pf,
    int ksteps, void *c) {
#if AMX_DIAG >= 2
    /* diagnostic builds only (wrong results): A tiles from one L1-resident buffer, no weight reads */
    const uint8_t *a0 = amx_diag_buf, *a1 = amx_diag_buf + 1024;
    const long sa = 64, kstep = 0;
    (void)ar;
#if AMX_DIAG == 3
    b0 = b1 = (const uint32_t *)(amx_diag_buf + 2048) - (size_t)k0 * 256; /* B from L1 too */
#endif
#else
    const uint8_t *a0 = ar->a[0], *a1 = ar->a[1];
    const long sa = ar->sa, kstep = ar->kstep;
#endif
    TILE_ZERO(0);
    TILE_ZERO(1);
    TILE_ZERO(2);
    TILE_ZERO(3);
    COMPILER_FENCE();
    for (int ks = k0; ks < k1; ks++) {
#if AMX_DIAG < 2
        if (kind == TILES_BF16 && ar->u4[0]) {
            /* tiled int4 on bf16 tiles: int4 step ks / 2 holds bf16 steps ks and ks + 1; dequantised
             * at the even one into one of two 4 KiB buffers (A tile h's bf16 step j at h * 2048 +
             * j * 1024), so step ks + 2's writes never meet loads that may still read step ks's */
            const int s4 = ks >> 1;
            uint8_t *u = ar->ub + (size_t)(s4 & 1) * 4096;
            if (!(ks & 1) || ks == k0) {
                prefetch_part(pf, ar->u4[0], ar->u4[1], 32, 512, s4, ksteps / 2);
                const long so = (long)(s4 / ar->kpg) * ar->sg;
                dequant_u4_bf16_step(ar->u4[0] + (size_t)s4 * 512, ar->s[0] + so, u);
                dequant_u4_bf16_step(ar->u4[1] + (size_t)s4 * 512, ar->s[1] + so, u + 2048);
                COMPILER_FENCE();
            }
            TILE_LOAD(4, u + (ks & 1) * 1024, 64);
            TILE_LOAD(5, u + 2048 + (ks & 1) * 1024, 64);
        } else if (kind != TILES_BF16 && ar->u4[0]) {
            /* the packed rows: 16 rows x 32 bytes per step, contiguous */
            prefetch_part(pf, ar->u4[0], ar->u4[1], 32, 512, ks, ksteps);
            uint8_t *u = ar->ub + (size_t)(ks & 1) * 2048; /* two buffers: step ks + 1 is written
                                                              while step ks's loads may still read */
            unpack_u4_step(ar->u4[0] + (size_t)ks * 512, u);
            unpack_u4_step(ar->u4[1] + (size_t)ks * 512, u + 1024);
            COMPILER_FENCE();
            TILE_LOAD(4, u, 64);
            TILE_LOAD(5, u + 1024, 64);
        } else
#endif
        {
            prefetch_part(pf, a0, a1, sa, kstep, ks, ksteps);
            TILE_LOAD(4, a0 + (size_t)ks * kstep, sa);
            TILE_LOAD(5, a1 + (size_t)ks * kstep, sa);
        }
#if AMX_DIAG == 3
        TILE_LOAD(6, b0 + (size_t)k0 * 256, 64);
        if (two) TILE_LOAD(7, b1 + (size_t)k0 * 256, 64);
#else
        TILE_LOAD(6, b0 + (size_t)ks * 256, 64);
        if (two) TILE_LOAD(7, b1 + (size_t)ks * 256, 64);
#endif
#if AMX_DIAG == 1
        continue; /* diagnostic: the loads without the products */
#endif
#define TILE_PRODUCTS(OP) \
    OP(0, 4, 6);          \
    OP(1, 5, 6);          \
    if (two) {            \
        OP(2, 4, 7);      \
        OP(3, 5, 7);      \
    }
        if (kind == TILES_BF16) {
            TILE_PRODUCTS(TILE_BF16)
        } else if (kind == TILES_S8) {
            TILE_PRODUCTS(TILE_SS)
        } else {
            TILE_PRODUCTS(TILE_US)
        }
#undef TILE_PRODUCTS
    }
    if (c) tile_store(two, c);
}

/* m ? a : b per lane (m from a vector comparison: all ones or zero) */
static inline __attribute__((always_inline)) v16f_a fsel(v16i_a m, v16f_a a, v16f_a b) {
    v16i_a ai, bi;
    memcpy(&ai, &a, 64);
    memcpy(&bi, &b, 64);
    ai = (ai & m) | (bi & ~m);
    memcpy(&a, &ai, 64);
    return a;
}

/* exp(x) for the silu epilogue: 2^n * e^r, |r| <= ln2 / 2, degree-6 Taylor (rel err ~2e-7; the
 * result is rounded to bf16 or int8 next); x is clamped to +-87, where silu is -0 or x anyway */
static inline __attribute__((always_inline)) v16f_a exp_v(v16f_a x) {
    x = fsel(x < -87.0f, (v16f_a){0} - 87.0f, x);
    x = fsel(x > 87.0f, (v16f_a){0} + 87.0f, x);
    /* round to nearest through a positive truncation (no float trick that -ffast-math folds) */
    const v16i_a n = __builtin_convertvector(x * 1.44269504f + 128.5f, v16i_a) - 128;
    const v16f_a nf = __builtin_convertvector(n, v16f_a);
    const v16f_a r = x - nf * 0.693145752f - nf * 1.42860677e-6f;
    v16f_a p = (v16f_a){0} + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const v16i_a e = (n + 127) << 23;
    v16f_a scale;
    memcpy(&scale, &e, sizeof scale);
    return p * scale;
}

/* gate rows g and up rows u of a C tile pair ([16 rows][16 tokens] each) -> silu(g) * u in g */
static inline __attribute__((always_inline)) void silu_mul_tile(float *g, const float *u) {
    for (int r = 0; r < 16; r++) {
        v16f_a gv, uv;
        memcpy(&gv, g + r * 16, 64);
        memcpy(&uv, u + r * 16, 64);
        gv = gv / (1.0f + exp_v(-gv)) * uv;
        memcpy(g + r * 16, &gv, 64);
    }
}

/* AMX_VT 1: a block's results leave their [16 rows][16 tokens] C layout for the token-major rows
 * of the intermediates and the pair buffer through a 16 x 16 transpose in registers (64 shuffles);
 * 0: one scalar load and store per value (512 instructions a tile) */
#ifndef AMX_VT
#define AMX_VT 1
#endif

/* dst[j][r] = rows[r][j], 16 x 16 32-bit values (dst 64-byte aligned) */
static inline __attribute__((always_inline, target(AMX_TARGET))) void transpose16_rows(const float *const *rows,
                                                                                       float *dst) {
#if AMX_VT && !defined(EXPERTMESH_AMX_EMULATE)
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(rows[i]);
    for (int i = 0; i < 16; i += 2) { /* lane-wise pairs of rows: a0 b0 a1 b1 / a2 b2 a3 b3 */
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* lane-wise quads of rows: a0 b0 c0 d0 ... a3 b3 c3 d3 */
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    }
    /* r[4q + k] lane L: rows 4q .. 4q + 3 of column k + 4L; gather the four quads per column */
    for (int k = 0; k < 4; k++) {
        t[k] = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x88);
        t[k + 4] = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xdd);
        t[k + 8] = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x88);
        t[k + 12] = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xdd);
    }
    for (int k = 0; k < 4; k++) {
        _mm512_store_ps(dst + 16 * k, _mm512_shuffle_f32x4(t[k], t[k + 8], 0x88));
        _mm512_store_ps(dst + 16 * (k + 8), _mm512_shuffle_f32x4(t[k], t[k + 8], 0xdd));
        _mm512_store_ps(dst + 16 * (k + 4), _mm512_shuffle_f32x4(t[k + 4], t[k + 12], 0x88));
        _mm512_store_ps(dst + 16 * (k + 12), _mm512_shuffle_f32x4(t[k + 4], t[k + 12], 0xdd));
    }
#else
    for (int r = 0; r < 16; r++)
        for (int j = 0; j < 16; j++) memcpy(dst + j * 16 + r, rows[r] + j, 4); /* bit patterns, not floats */
#endif
}

/* dst[j][r] = src[r][j], 16 x 16 fp32 */
static inline __attribute__((always_inline, target(AMX_TARGET))) void transpose16(const float *src, float *dst) {
    const float *rows[16];
    for (int i = 0; i < 16; i++) rows[i] = src + 16 * i;
    transpose16_rows(rows, dst);
}

/* fp32 [16 rows][16 tokens] -> bf16 rows (f0, f0 + 1), (f0 + 2, f0 + 3), ... of one token tile of a
 * bf16 B buffer (k step = 16 pairs x 16 tokens); f0 % 16 == 0 */
static inline __attribute__((always_inline)) void tile_to_bf16_pairs(const float *v, int f0, uint32_t *bt) {
    for (int r = 0; r < 16; r += 2) {
        v16u_a lo, hi;
        memcpy(&lo, v + r * 16, 64);
        memcpy(&hi, v + (r + 1) * 16, 64);
        /* round to nearest even, as to_bf16 */
        lo = (lo + 0x7fffu + ((lo >> 16) & 1u)) >> 16;
        hi = (hi + 0x7fffu + ((hi >> 16) & 1u)) >> 16;
        const v16u_a pair = lo | (hi << 16);
        const int f = f0 + r;
        memcpy(bt + (size_t)(f / 32) * 256 + ((f % 32) / 2) * 16, &pair, 64);
    }
}

/* a row to bf16 for B tiles (target: the conversion loop vectorises) */
__attribute__((target(AMX_TARGET))) static void row_to_bf16_amx(const float *x, int c, uint16_t *out) {
    row_to_bf16(x, c, out);
}

/* rows of one format -> bf16 [r, c] (quantised rows for the bf16 tiles) */
__attribute__((target(AMX_TARGET))) static void rows_to_bf16(const uint8_t *rows, long rowbytes, int r_, int c,
                                                             int wdtype, int g, float *tmp, uint16_t *out) {
    for (int r = 0; r < r_; r++) {
        /* tiled int8/int4 (r_ = 32 rows = two whole blocks here) */
        qrow_to_f32(rows, rowbytes, r, q_tiled(wdtype, r_, g), wdtype, c, g, tmp);
        row_to_bf16(tmp, c, out + (size_t)r * c);
    }
}

/* The tiles' arithmetic rate, for the benchmark's peak: per thread `iters` steps of 4 tile products
 * (bf16 TDPBF16PS, 16 x 16 x 32 multiply-adds each; int8 TDPBSSD, 16 x 16 x 64) on 4 independent
 * accumulators, with the 2 A and 2 B tiles loaded once (reload = 0) or reloaded from L1 every step
 * as the kernel's inner loop does (reload = 1). Returns the seconds of the slowest thread. */
__attribute__((target(AMX_TARGET))) double moe_amx_peak(int int8, int reload, long iters, int nthreads) {
    double worst = 0.0;
#pragma omp parallel num_threads(nthreads) reduction(max : worst)
    {
        amx_config();
        uint8_t *buf = aligned_alloc(64, 4096);
        for (int k = 0; k < 4096; k++) buf[k] = (uint8_t)(k * 37 % 61); /* small finite bf16 / int8 values */
        TILE_ZERO(0);
        TILE_ZERO(1);
        TILE_ZERO(2);
        TILE_ZERO(3);
        TILE_LOAD(4, buf, 64);
        TILE_LOAD(5, buf + 1024, 64);
        TILE_LOAD(6, buf + 2048, 64);
        TILE_LOAD(7, buf + 3072, 64);
        COMPILER_FENCE();
#pragma omp barrier
        const double t0 = omp_get_wtime();
        for (long it = 0; it < iters; it++) {
            if (reload) {
                TILE_LOAD(4, buf, 64);
                TILE_LOAD(5, buf + 1024, 64);
                TILE_LOAD(6, buf + 2048, 64);
                TILE_LOAD(7, buf + 3072, 64);
            }
            if (int8) {
                TILE_SS(0, 4, 6);
                TILE_SS(1, 5, 6);
                TILE_SS(2, 4, 7);
                TILE_SS(3, 5, 7);
            } else {
                TILE_BF16(0, 4, 6);
                TILE_BF16(1, 5, 6);
                TILE_BF16(2, 4, 7);
                TILE_BF16(3, 5, 7);
            }
        }
        TILE_STORE(0, buf, 64); /* keeps the products live */
        COMPILER_FENCE();
        worst = omp_get_wtime() - t0;
        amx_release();
        free(buf);
    }
    return worst;
}
