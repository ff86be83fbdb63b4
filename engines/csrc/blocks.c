/* Block-quantized matrix products for 1..16 rows whose result for a row does not depend on the
 * other rows: Y[m, n] = sum_k A[m, k] * W[n, k], W quantized in llama.cpp's blocks of 32 along K.
 *
 * W is stored in panels of 16 columns (N padded to a multiple of 16 with zero columns). A panel
 * holds its nb = K / 32 blocks in order; a panel block is the 16 columns' scales, then (Q4_1)
 * their minimums, then their codes, four consecutive K positions of one column per 32-bit lane:
 *
 *   Q8_0: fp16 d[16], u[8][16][4]  with u = q + 128, u[c][j][i] = column j's code 4c + i     34 bytes a weight block
 *   Q4_0: fp16 d[16], qs[4][16][4] with code = nibble - 8                                    18 bytes
 *   Q4_1: fp16 d[16], fp16 m[16], qs[4][16][4], w = d * nibble + m                           20 bytes
 *   (4-bit: qs[c][j][i] & 15 is column j's code 8c + i, qs[c][j][i] >> 4 its code 8c + 4 + i)
 *
 * so one 64-byte load is 4 K positions (Q8_0) or 8 (4-bit) of 16 columns: a dot-product
 * instruction multiplies it by four activation codes broadcast to every lane, and each lane sums
 * one column's products. The bytes a block costs are GGUF's (8.5, 4.5, 5.0 bits a weight).
 *
 * Each row of A is quantized once per call per block of 32, as llama.cpp does for its Q8_0 x Q8_0
 * and Q4_1 x Q8_1 products: da = max|a| / 127, qa = rint(a / da) in -127..127 (sa = da * sum qa for
 * Q4_1's minimum), da in float32. A weight block times an activation block is an exact int32 sum;
 * the float work per (row, column) is one fixed sequence, the same whatever M, whichever rows share
 * a call and whichever thread runs the column. That is what makes a verify call of gamma + 1 rows
 * give each row the bits a 1-row call gives it:
 *
 *   per (m, n):  acc = 0, bias = 0
 *                for b in 0 .. nb - 1:                                   // blocks in order
 *                    p    = sum over the block of (code - offset) * qa   // int32, exact
 *                    acc  = fma(float(p), d_w[n, b] * d_a[m, b], acc)
 *                    bias = fma(m_w[n, b], s_a[m, b], bias)             // Q4_1 only
 *                y = acc + bias
 *
 * The portable, AVX2 and AVX-512 VNNI paths run that sequence (so all three give the same bits);
 * which one runs is chosen once, from the CPU.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SD_X86 1
#endif

#define PANEL 16
static const int PANEL_BYTES[SD_FORMATS] = {PANEL * 34, PANEL * 18, PANEL * 20};  /* one block of a panel */
static const int SCALE_BYTES[SD_FORMATS] = {PANEL * 2, PANEL * 2, PANEL * 4};    /* d, or d and m */
static const int OFFSET[SD_FORMATS] = {128, 8, 0};  /* what the unsigned code carries above the signed value */

static inline float fp16(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023, bits;
    if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) {  /* subnormal: renormalise */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 1024));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 1023) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* -- activations: per row and block, the same arithmetic for every path ----------------------- */

/* one block's codes from its scale's reciprocal; returns the sum of the codes */
typedef int32_t (*block_codes)(const float *x, float id, int8_t *q);

static int32_t codes_portable(const float *x, float id, int8_t *q) {
    int32_t s = 0;
    for (int i = 0; i < SD_QK; i++) s += q[i] = (int8_t)nearbyintf(x[i] * id);
    return s;
}

static float amax_portable(const float *x) {
    float amax = 0.0f;
    for (int i = 0; i < SD_QK; i++) amax = fmaxf(amax, fabsf(x[i]));
    return amax;
}

#ifdef SD_X86
/* the same values: max is exact in any order, x * id rounds alike, cvtps rounds to nearest even as
 * nearbyintf does in the default mode, and the codes' sum is an exact integer */
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq"))) static float amax_512(const float *x) {
    const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x)), b = _mm512_abs_ps(_mm512_loadu_ps(x + 16));
    return _mm512_reduce_max_ps(_mm512_max_ps(a, b));
}

__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq"))) static int32_t codes_512(const float *x, float id, int8_t *q) {
    const __m512 v = _mm512_set1_ps(id);
    const __m512i a = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x), v));
    const __m512i b = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 16), v));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(a));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtsepi32_epi8(b));
    return _mm512_reduce_add_epi32(_mm512_add_epi32(a, b));
}
#endif

void sd_quantize_rows(int format, int isa, const float *a, int64_t m, int64_t k, int8_t *qa, float *da, float *sa, int32_t *nc) {
    const int64_t nb = k / SD_QK;
    float (*amax_of)(const float *) = amax_portable;
    block_codes codes = codes_portable;
#ifdef SD_X86
    if (isa == SD_ISA_VNNI) amax_of = amax_512, codes = codes_512;
#endif
    (void)isa;
    for (int64_t r = 0; r < m; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *x = a + r * k + b * SD_QK;
            const float d = amax_of(x) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            const int32_t s = codes(x, id, qa + r * k + b * SD_QK);
            nc[r * nb + b] = -OFFSET[format] * s;  /* what sum(u * q) over-counts */
            da[r * nb + b] = d;
            sa[r * nb + b] = d * (float)s;
        }
    }
}

/* -- the portable path ------------------------------------------------------------------------ */

/* column j's code at K position i of a panel block (unsigned, with the format's offset) */
static inline int code_at(int fmt, const uint8_t *codes, int j, int i) {
    if (fmt == SD_Q8_0) return codes[(i / 4) * 64 + j * 4 + i % 4];
    const uint8_t byte = codes[(i / 8) * 64 + j * 4 + i % 4];
    return i % 8 < 4 ? byte & 15 : byte >> 4;
}

/* row r times column j of panel p: blocks.c's sequence */
static float column_portable(const sd_args *x, int64_t p, int j, int64_t r) {
    const int fmt = x->format;
    const int64_t nb = x->k / SD_QK;
    const uint8_t *panel = x->w + p * nb * PANEL_BYTES[fmt];
    float acc = 0.0f, bias = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = panel + b * PANEL_BYTES[fmt], *codes = blk + SCALE_BYTES[fmt];
        const int8_t *q = x->qa + r * x->k + b * SD_QK;
        int32_t dot = x->nc[r * nb + b];
        for (int i = 0; i < SD_QK; i++) dot += code_at(fmt, codes, j, i) * q[i];
        acc = fmaf((float)dot, fp16(blk + 2 * j) * x->da[r * nb + b], acc);
        if (fmt == SD_Q4_1) bias = fmaf(fp16(blk + 2 * (PANEL + j)), x->sa[r * nb + b], bias);
    }
    return acc + bias;
}

/* exp(x) for the gate, one fixed sequence (Cody-Waite reduction, Cephes' polynomial, no fused
 * multiply-add) that the vector paths repeat lane by lane: the same bits on every path. x is
 * clamped to [-87, 88], where 2^n stays a normal float. */
#define EXP_LO -87.0f
#define EXP_HI 88.0f
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f
static const float EXP_P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

static float exp_portable(float x) {
    x = fminf(fmaxf(x, EXP_LO), EXP_HI);
    const float n = nearbyintf(x * LOG2E);
    const float r = (x - n * LN2_HI) - n * LN2_LO;
    float poly = EXP_P[0];
    for (int i = 1; i < 6; i++) poly = poly * r + EXP_P[i];
    const float e = ((poly * r) * r + r) + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float two;
    memcpy(&two, &bits, 4);
    return e * two;
}

/* the gated MLP's product: silu(g) * u = (g * (1 / (1 + exp(-g)))) * u */
static float gated_portable(float g, float u) { return (g * (1.0f / (1.0f + exp_portable(-g)))) * u; }

static void panels_portable(const sd_args *x, int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p++)
        for (int j = 0; j < PANEL && p * PANEL + j < x->n; j++)
            for (int64_t r = 0; r < x->m; r++)
                x->y[r * x->n + p * PANEL + j] = x->gated ? gated_portable(column_portable(x, 2 * p, j, r), column_portable(x, 2 * p + 1, j, r))
                                                          : column_portable(x, p, j, r);
}

/* -- AVX2 and AVX-512 VNNI -------------------------------------------------------------------- */

#ifdef SD_X86
#define ISA_AVX2 target("avx2,fma,f16c")
#define ISA_VNNI target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni")
#define AVX2 __attribute__((ISA_AVX2, always_inline)) static inline
#define VNNI __attribute__((ISA_VNNI, always_inline)) static inline
#define TILE 8 /* rows a panel's blocks are applied to per pass, their accumulators in registers */
/* The weights stream from memory once per call; a core's hardware prefetchers alone keep too few
 * lines in flight for that (measured: 1 row ~15 % and 4 rows ~35 % slower without this). */
#define AHEAD 1536 /* bytes: ~3 panel blocks */
#define PREFETCH(blk) _Pragma("GCC unroll 16") for (int i = 0; i < PANEL_BYTES[fmt]; i += 64) _mm_prefetch((const char *)(blk) + AHEAD + i, _MM_HINT_T0)

/* a tile's pointers: panel p's blocks, and rows r0 .. r0 + rows - 1's codes, scales, sums and code sums */
#define TILE_POINTERS                                                                                            \
    const int64_t nb = x->k / SD_QK;                                                                             \
    const uint8_t *panel = x->w + p * nb * PANEL_BYTES[fmt];                                                     \
    const int8_t *qr[TILE];                                                                                      \
    const float *dr[TILE], *sr[TILE];                                                                            \
    const int32_t *cr[TILE];                                                                                     \
    _Pragma("GCC unroll 8") for (int t = 0; t < rows; t++) {                                                     \
        qr[t] = x->qa + (r0 + t) * x->k;                                                                         \
        dr[t] = x->da + (r0 + t) * nb;                                                                           \
        sr[t] = x->sa + (r0 + t) * nb;                                                                           \
        cr[t] = x->nc + (r0 + t) * nb;                                                                           \
    }

/* four activation codes (K positions at i .. i + 3 of row t's block b) as one 32-bit lane
 * (memcpy: an unaligned load, without reading int8 storage through an int32 lvalue) */
static inline int32_t quad(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}
#define QUAD(t, b, i) quad(qr[t] + (b) * SD_QK + (i))

/* AVX2: 8 columns (half a panel, ``half`` 0 or 1) per register. u8 x s8 pair products summed
 * to int32 lanes by maddubs + madd: Q8_0's |code - 128| <= 128 times |q| <= 127, pairs <= 32512;
 * 4-bit codes <= 15: neither saturates int16. */
AVX2 __m256i dot8_avx2(int fmt, __m256i u, int32_t quad) {
    const __m256i q = _mm256_set1_epi32(quad), ones = _mm256_set1_epi16(1);
    if (fmt == SD_Q8_0) {  /* u - 128 as int8, then |w| times q carrying w's sign */
        const __m256i w = _mm256_xor_si256(u, _mm256_set1_epi8((char)0x80));
        return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(q, w)), ones);
    }
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), ones);
}

/* rows r0.. of panel p's columns 8 * half .. 8 * half + min(live, 8) - 1, to out[t * ldo + i] */
AVX2 void tile_avx2(const sd_args *x, const int fmt, int64_t p, int half, int64_t r0, const int rows, float *out, int64_t ldo, int64_t live) {
    if (live <= 0) return;  /* the last panel's padding */
    if (live > 8) live = 8;
    TILE_POINTERS
    const __m256i low = _mm256_set1_epi8(15);
    __m256 acc[TILE], bias[TILE];
    _Pragma("GCC unroll 8") for (int t = 0; t < rows; t++) acc[t] = bias[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = panel + b * PANEL_BYTES[fmt], *codes = blk + SCALE_BYTES[fmt] + 32 * half;
        if (!half) PREFETCH(blk);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * half)));
        __m256i dot[TILE];
        _Pragma("GCC unroll 8") for (int t = 0; t < rows; t++) dot[t] = _mm256_set1_epi32(fmt == SD_Q8_0 ? 0 : cr[t][b]);
        if (fmt == SD_Q8_0) {
            _Pragma("GCC unroll 8") for (int c = 0; c < 8; c++) {
                const __m256i u = _mm256_loadu_si256((const __m256i *)(codes + 64 * c));
                _Pragma("GCC unroll 8") for (int t = 0; t < rows; t++) dot[t] = _mm256_add_epi32(dot[t], dot8_avx2(fmt, u, QUAD(t, b, 4 * c)));
            }
        } else {
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(codes + 64 * c));
                const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                _Pragma("GCC unroll 8") for (int t = 0; t < rows; t++) {
                    dot[t] = _mm256_add_epi32(dot[t], dot8_avx2(fmt, lo, QUAD(t, b, 8 * c)));
                    dot[t] = _mm256_add_epi32(dot[t], dot8_avx2(fmt, hi, QUAD(t, b, 8 * c + 4)));
                }
            }
        }
        const __m256 mw = fmt == SD_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 2 * PANEL + 16 * half))) : dw;
        _Pragma("GCC unroll 8") for (int t = 0; t < rows; t++) {
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[t]), _mm256_mul_ps(dw, _mm256_set1_ps(dr[t][b])), acc[t]);
            if (fmt == SD_Q4_1) bias[t] = _mm256_fmadd_ps(mw, _mm256_set1_ps(sr[t][b]), bias[t]);
        }
    }
    _Pragma("GCC unroll 8") for (int t = 0; t < rows; t++) {
        float lanes[8];
        _mm256_storeu_ps(lanes, fmt == SD_Q4_1 ? _mm256_add_ps(acc[t], bias[t]) : acc[t]);
        memcpy(out + t * ldo, lanes, sizeof(float) * (size_t)live);
    }
}

/* AVX-512 VNNI: a whole panel (16 columns) per register, vpdpbusd on u8 codes x s8 activations
 * (the offset taken back by starting each dot at nc). With one or two rows, two partial dots per
 * row (exact int32 sums, so their split does not touch the bits) halve the dependency chain. */
VNNI void tile_vnni(const sd_args *x, const int fmt, int64_t p, int64_t r0, const int rows, float *out, int64_t ldo, int64_t live) {
    const int CHAINS = rows <= 2 ? 2 : 1;
    TILE_POINTERS
    const __m512i low = _mm512_set1_epi8(15);
    __m512 acc[TILE], bias[TILE];
    _Pragma("GCC unroll 8") for (int t = 0; t < rows; t++) acc[t] = bias[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = panel + b * PANEL_BYTES[fmt], *codes = blk + SCALE_BYTES[fmt];
        PREFETCH(blk);
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        __m512i even[TILE], odd[TILE];  /* odd: a second chain where few rows give too little to overlap */
        _Pragma("GCC unroll 8") for (int t = 0; t < rows; t++) even[t] = _mm512_set1_epi32(cr[t][b]), odd[t] = _mm512_setzero_si512();
        if (fmt == SD_Q8_0) {
            _Pragma("GCC unroll 4") for (int c = 0; c < 8; c += 2) {
                const __m512i u0 = _mm512_loadu_si512(codes + 64 * c), u1 = _mm512_loadu_si512(codes + 64 * (c + 1));
                _Pragma("GCC unroll 8") for (int t = 0; t < rows; t++) {
                    even[t] = _mm512_dpbusd_epi32(even[t], u0, _mm512_set1_epi32(QUAD(t, b, 4 * c)));
                    if (CHAINS == 2) odd[t] = _mm512_dpbusd_epi32(odd[t], u1, _mm512_set1_epi32(QUAD(t, b, 4 * c + 4)));
                    else even[t] = _mm512_dpbusd_epi32(even[t], u1, _mm512_set1_epi32(QUAD(t, b, 4 * c + 4)));
                }
            }
        } else {
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
                const __m512i v = _mm512_loadu_si512(codes + 64 * c);
                const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                _Pragma("GCC unroll 8") for (int t = 0; t < rows; t++) {
                    even[t] = _mm512_dpbusd_epi32(even[t], lo, _mm512_set1_epi32(QUAD(t, b, 8 * c)));
                    if (CHAINS == 2) odd[t] = _mm512_dpbusd_epi32(odd[t], hi, _mm512_set1_epi32(QUAD(t, b, 8 * c + 4)));
                    else even[t] = _mm512_dpbusd_epi32(even[t], hi, _mm512_set1_epi32(QUAD(t, b, 8 * c + 4)));
                }
            }
        }
        const __m512 mw = fmt == SD_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 2 * PANEL))) : dw;
        _Pragma("GCC unroll 8") for (int t = 0; t < rows; t++) {
            const __m512 dot = _mm512_cvtepi32_ps(CHAINS == 2 ? _mm512_add_epi32(even[t], odd[t]) : even[t]);
            acc[t] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dw, _mm512_set1_ps(dr[t][b])), acc[t]);
            if (fmt == SD_Q4_1) bias[t] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sr[t][b]), bias[t]);
        }
    }
    const __mmask16 store = (__mmask16)((1u << live) - 1);
    _Pragma("GCC unroll 8") for (int t = 0; t < rows; t++)
        _mm512_mask_storeu_ps(out + t * ldo, store, fmt == SD_Q4_1 ? _mm512_add_ps(acc[t], bias[t]) : acc[t]);
}

/* exp_portable and gated_portable, 8 or 16 lanes at once: the same operations in the same order */
#define GATED_VECTOR(ATTR, NAME, V, PS, EPI, ROUND)                                                             \
    ATTR V NAME(V g, V u) {                                                                                      \
        const V x = PS(min)(PS(max)(PS(sub)(PS(setzero)(), g), PS(set1)(EXP_LO)), PS(set1)(EXP_HI));            \
        const V n = ROUND(PS(mul)(x, PS(set1)(LOG2E)));                                                          \
        const V r = PS(sub)(PS(sub)(x, PS(mul)(n, PS(set1)(LN2_HI))), PS(mul)(n, PS(set1)(LN2_LO)));             \
        V poly = PS(set1)(EXP_P[0]);                                                                             \
        for (int i = 1; i < 6; i++) poly = PS(add)(PS(mul)(poly, r), PS(set1)(EXP_P[i]));                        \
        const V e = PS(add)(PS(add)(PS(mul)(PS(mul)(poly, r), r), r), PS(set1)(1.0f));                           \
        const V two = EPI(n);                                                                                    \
        const V one = PS(set1)(1.0f);                                                                            \
        return PS(mul)(PS(mul)(g, PS(div)(one, PS(add)(one, PS(mul)(e, two)))), u);                              \
    }
#define PS256(op) _mm256_##op##_ps
#define PS512(op) _mm512_##op##_ps
#define ROUND256(v) _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define ROUND512(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define TWO256(n) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23))
#define TWO512(n) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23))
GATED_VECTOR(AVX2, gated_avx2, __m256, PS256, TWO256, ROUND256)
GATED_VECTOR(VNNI, gated_512, __m512, PS512, TWO512, ROUND512)

/* rows of a gated panel's two halves (g, u: [rows][16]) to out[t * ldo + i], i < live */
AVX2 void gated_rows_avx2(const float *g, const float *u, int rows, float *out, int64_t ldo, int64_t live) {
    for (int t = 0; t < rows; t++) {
        float lanes[PANEL];
        _mm256_storeu_ps(lanes, gated_avx2(_mm256_loadu_ps(g + t * PANEL), _mm256_loadu_ps(u + t * PANEL)));
        _mm256_storeu_ps(lanes + 8, gated_avx2(_mm256_loadu_ps(g + t * PANEL + 8), _mm256_loadu_ps(u + t * PANEL + 8)));
        memcpy(out + t * ldo, lanes, sizeof(float) * (size_t)live);
    }
}

VNNI void gated_rows_512(const float *g, const float *u, int rows, float *out, int64_t ldo, int64_t live) {
    const __mmask16 store = (__mmask16)((1u << live) - 1);
    for (int t = 0; t < rows; t++)
        _mm512_mask_storeu_ps(out + t * ldo, store, gated_512(_mm512_loadu_ps(g + t * PANEL), _mm512_loadu_ps(u + t * PANEL)));
}

/* Output panel p, rows r0 .. r0 + R - 1: the product's panel p, or (gated: the weights hold the
 * gate's and the up projection's panels in turn) silu(its panel 2p) * its panel 2p + 1. */
#define PANEL_ROWS(TILE_FN, GATED_FN, R)                                                                        \
    do {                                                                                                         \
        float *out = x->y + r0 * x->n + p * PANEL;                                                               \
        const int64_t live = x->n - p * PANEL < PANEL ? x->n - p * PANEL : PANEL;                                \
        if (!x->gated) {                                                                                         \
            TILE_FN(p, R, out, x->n, live);                                                              \
        } else {                                                                                                 \
            float g[TILE * PANEL], u[TILE * PANEL];                                                              \
            TILE_FN(2 * p, R, g, PANEL, PANEL);                                                                  \
            TILE_FN(2 * p + 1, R, u, PANEL, PANEL);                                                              \
            GATED_FN(g, u, R, out, x->n, live);                                                                  \
        }                                                                                                        \
    } while (0)

/* Every (format, rows) pair spelled out, so each inlined tile knows both as constants. */
#define PANELS(ATTR, TARGET, NAME, TILE_FN, GATED_FN)                                                           \
    ATTR void NAME##_f(const sd_args *x, int64_t p0, int64_t p1, const int fmt) {                                \
        for (int64_t p = p0; p < p1; p++) {                                                                      \
            int64_t r0 = 0;                                                                                      \
            for (; r0 + TILE <= x->m; r0 += TILE) PANEL_ROWS(TILE_FN, GATED_FN, 8);                              \
            switch (x->m - r0) {                                                                                 \
            case 7: PANEL_ROWS(TILE_FN, GATED_FN, 7); break;                                                     \
            case 6: PANEL_ROWS(TILE_FN, GATED_FN, 6); break;                                                     \
            case 5: PANEL_ROWS(TILE_FN, GATED_FN, 5); break;                                                     \
            case 4: PANEL_ROWS(TILE_FN, GATED_FN, 4); break;                                                     \
            case 3: PANEL_ROWS(TILE_FN, GATED_FN, 3); break;                                                     \
            case 2: PANEL_ROWS(TILE_FN, GATED_FN, 2); break;                                                     \
            case 1: PANEL_ROWS(TILE_FN, GATED_FN, 1); break;                                                     \
            default: break;                                                                                      \
            }                                                                                                    \
        }                                                                                                        \
    }                                                                                                            \
    __attribute__((TARGET)) static void NAME(const sd_args *x, int64_t p0, int64_t p1) {                          \
        switch (x->format) {                                                                                     \
        case SD_Q8_0: NAME##_f(x, p0, p1, SD_Q8_0); break;                                                       \
        case SD_Q4_0: NAME##_f(x, p0, p1, SD_Q4_0); break;                                                       \
        default: NAME##_f(x, p0, p1, SD_Q4_1); break;                                                            \
        }                                                                                                        \
    }
/* AVX2 has 16 registers: at most 4 rows a pass, 8 columns at a time */
#define AVX2_HALF(P, R, OUT, LDO, LIVE, H)                                                                       \
    ((R) > 4 ? (tile_avx2(x, fmt, P, H, r0, 4, (OUT) + 8 * (H), LDO, (LIVE) - 8 * (H)),                         \
                tile_avx2(x, fmt, P, H, r0 + 4, (R) - 4, (OUT) + 4 * (LDO) + 8 * (H), LDO, (LIVE) - 8 * (H)))     \
             : tile_avx2(x, fmt, P, H, r0, R, (OUT) + 8 * (H), LDO, (LIVE) - 8 * (H)))
#define AVX2_TILE(P, R, OUT, LDO, LIVE) (AVX2_HALF(P, R, OUT, LDO, LIVE, 0), AVX2_HALF(P, R, OUT, LDO, LIVE, 1))
#define VNNI_TILE(P, R, OUT, LDO, LIVE) tile_vnni(x, fmt, P, r0, R, OUT, LDO, LIVE)
PANELS(AVX2, ISA_AVX2, panels_avx2, AVX2_TILE, gated_rows_avx2)
PANELS(VNNI, ISA_VNNI, panels_vnni, VNNI_TILE, gated_rows_512)
#endif

/* -- dispatch --------------------------------------------------------------------------------- */

int sd_isa_available(int isa) {
    if (isa == SD_ISA_PORTABLE) return 1;
#ifdef SD_X86
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (isa == SD_ISA_AVX2) return avx2;
    if (isa == SD_ISA_VNNI)
        return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni");
#endif
    return 0;
}

int sd_best_isa(void) {
    for (int isa = SD_ISAS - 1; isa > 0; isa--)
        if (sd_isa_available(isa)) return isa;
    return SD_ISA_PORTABLE;
}

const char *sd_isa_name(int isa) {
    static const char *names[SD_ISAS] = {"portable", "avx2", "avx512-vnni"};
    return isa >= 0 && isa < SD_ISAS ? names[isa] : "unknown";
}

int64_t sd_panels(int64_t n) { return (n + PANEL - 1) / PANEL; }

void sd_matmul_panels(const sd_args *x, int64_t p0, int64_t p1) {
#ifdef SD_X86
    if (x->isa == SD_ISA_VNNI) {
        panels_vnni(x, p0, p1);
        return;
    }
    if (x->isa == SD_ISA_AVX2) {
        panels_avx2(x, p0, p1);
        return;
    }
#endif
    panels_portable(x, p0, p1);
}

int sd_check(int format, int64_t m, int64_t k, int64_t n) {
    if (format < 0 || format >= SD_FORMATS) return SD_ERR_FORMAT;
    if (k <= 0 || k % SD_QK) return SD_ERR_K;
    if (m < 0 || n <= 0) return SD_ERR_SHAPE;
    return 0;
}

/* One whole product, single-threaded, scratch allocated here: the entry point the tests call
 * through ctypes (the ONNX Runtime op splits the panels over its threads instead). */
int sd_matmul(int format, int isa, int gated, const float *a, int64_t m, int64_t k, const uint8_t *w, int64_t n, float *y) {
    int err = sd_check(format, m, k, n);
    if (err) return err;
    if (!sd_isa_available(isa)) return SD_ERR_ISA;
    sd_scratch s = {0};
    if (sd_reserve(&s, m, k)) err = SD_ERR_MEMORY;
    if (!err) {
        sd_quantize_rows(format, isa, a, m, k, s.qa, s.da, s.sa, s.nc);
        sd_args x = {format, isa, m, k, n, s.qa, s.da, s.sa, s.nc, w, y, gated};
        sd_matmul_panels(&x, 0, sd_panels(n));
    }
    sd_release(&s);
    return err;
}

int sd_reserve(sd_scratch *s, int64_t m, int64_t k) {
    if (m * k <= s->capacity) return 0;
    const int64_t nb = k / SD_QK;
    sd_release(s);
    s->qa = malloc((size_t)(m * k) + 64);
    s->da = malloc(sizeof(float) * (size_t)(m * nb + 1));
    s->sa = malloc(sizeof(float) * (size_t)(m * nb + 1));
    s->nc = malloc(sizeof(int32_t) * (size_t)(m * nb + 1));
    if (!s->qa || !s->da || !s->sa || !s->nc) {
        sd_release(s);
        return -1;
    }
    s->capacity = m * k;
    return 0;
}

void sd_release(sd_scratch *s) {
    free(s->qa); free(s->da); free(s->sa); free(s->nc);
    s->qa = NULL, s->da = NULL, s->sa = NULL, s->nc = NULL, s->capacity = 0;
}
