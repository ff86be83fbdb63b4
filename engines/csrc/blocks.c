/* Block-quantized matrix products for 1..16 rows whose result for a row does not depend on the
 * other rows: Y[m, n] = sum_k A[m, k] * W[n, k], W quantized in llama.cpp's blocks of 32 along K.
 *
 * A column n holds its K / 32 = nb blocks' scales first, then their codes (GGUF's bits, laid out
 * so that eight blocks' scales load at once):
 *
 *   Q8_0: fp16 d[nb], uint8 u[nb][32]             w = d * (u - 128)     34 bytes a block (8.5 bits)
 *   Q4_0: fp16 d[nb], uint8 qs[nb][16]            w = d * (c - 8)       18 bytes a block (4.5 bits)
 *   Q4_1: fp16 d[nb], fp16 m[nb], uint8 qs[nb][16] w = d * c + m        20 bytes a block (5.0 bits)
 *   (4-bit codes: qs[j] & 15 is element j, qs[j] >> 4 element j + 16, as GGUF stores them)
 *
 * Each row of A is quantized once per call per block of 32, as llama.cpp does for its Q8_0 x Q8_0
 * and Q4_1 x Q8_1 products: da = max|a| / 127, qa = rint(a / da) in -127..127 (sa = da * sum qa for
 * Q4_1's minimum), da in float32. A weight block times an activation block is an exact int32 sum;
 * the float work per (row, column) is one fixed sequence, the same whatever M, whichever rows share
 * a call and whichever thread runs the column. That is what makes a verify call of gamma + 1 rows
 * give each row the bits a 1-row call gives it:
 *
 *   per (m, n):  acc[4][8] = 0, bias[8] = 0                       // four sets of 8 float lanes
 *                for b in 0 .. nb - 1:                            // blocks in order
 *                    p[i]   = sum of the products 4i .. 4i+3 of block b (int32, exact)
 *                    acc[b % 4][i] = fma(float(p[i]), d_w[n,b] * d_a[m,b], acc[b % 4][i])
 *                    bias[b % 8]   = fma(m_w[n,b], s_a[m,b], bias[b % 8])      // Q4_1 only
 *                l[i] = (acc[0][i] + acc[1][i]) + (acc[2][i] + acc[3][i])
 *                y = tree(l) + tree(bias),  tree(l) = ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7))
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

static const int BLOCK_BYTES[SD_FORMATS] = {34, 18, 20};
static const int SCALE_BYTES[SD_FORMATS] = {2, 2, 4};  /* d, or d and m */
static const int OFFSET[SD_FORMATS] = {128, 8, 0};     /* what the unsigned code carries above the signed value */

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

/* -- activations: one row at a time, the same arithmetic for every path ------------------------ */

void sd_quantize_rows(int format, const float *a, int64_t m, int64_t k, int8_t *qa, float *da, float *sa, int32_t *nc) {
    const int64_t nb = k / SD_QK;
    for (int64_t r = 0; r < m; r++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *x = a + r * k + b * SD_QK;
            int8_t *q = qa + r * k + b * SD_QK;
            float amax = 0.0f;
            for (int i = 0; i < SD_QK; i++) amax = fmaxf(amax, fabsf(x[i]));
            float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            int32_t s = 0;
            for (int i = 0; i < SD_QK; i++) {
                q[i] = (int8_t)nearbyintf(x[i] * id);
                s += q[i];
            }
            for (int l = 0; l < 8; l++)  /* -offset * the lane's codes: what u * q over-counts */
                nc[(r * nb + b) * 8 + l] = -OFFSET[format] * (q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3]);
            for (int l = 0; l < 8; l++) da[(r * nb + b) * 8 + l] = d;  /* 8 copies: a kernel loads a block's lanes at once */
            sa[r * nb + b] = d * (float)s;
        }
    }
}

static float tree(const float l[8]) { return ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7])); }

static float finish(float acc[4][8], const float bias[8]) {
    float l[8];
    for (int i = 0; i < 8; i++) l[i] = (acc[0][i] + acc[1][i]) + (acc[2][i] + acc[3][i]);
    return tree(l) + tree(bias);
}

/* -- the portable path ------------------------------------------------------------------------ */

static void cols_portable(const sd_args *x, int64_t n0, int64_t n1) {
    const int fmt = x->format;
    const int64_t nb = x->k / SD_QK, stride = nb * BLOCK_BYTES[fmt];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *col = x->w + n * stride, *codes = col + nb * SCALE_BYTES[fmt];
        for (int64_t r = 0; r < x->m; r++) {
            float acc[4][8] = {{0}}, bias[8] = {0};
            for (int64_t b = 0; b < nb; b++) {
                const int8_t *q = x->qa + r * x->k + b * SD_QK;
                const int32_t *nc = x->nc + (r * nb + b) * 8;
                uint8_t u[32];
                if (fmt == SD_Q8_0) {
                    memcpy(u, codes + b * 32, 32);
                } else {
                    for (int j = 0; j < 16; j++) u[j] = codes[b * 16 + j] & 15, u[j + 16] = codes[b * 16 + j] >> 4;
                }
                const float scale = fp16(col + 2 * b) * x->da[(r * nb + b) * 8];
                for (int l = 0; l < 8; l++) {
                    int32_t p = nc[l];
                    for (int i = 4 * l; i < 4 * l + 4; i++) p += (int32_t)u[i] * q[i];
                    acc[b & 3][l] = fmaf((float)p, scale, acc[b & 3][l]);
                }
                if (fmt == SD_Q4_1) bias[b & 7] = fmaf(fp16(col + 2 * (nb + b)), x->sa[r * nb + b], bias[b & 7]);
            }
            x->y[r * x->n + n] = finish(acc, bias);
        }
    }
}

/* -- AVX2 and AVX-512 VNNI -------------------------------------------------------------------- */

#ifdef SD_X86
#define ISA_AVX2 target("avx2,fma,f16c")
#define ISA_VNNI target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni")
#define AVX2 __attribute__((ISA_AVX2, always_inline)) static inline
#define VNNI __attribute__((ISA_VNNI, always_inline)) static inline

AVX2 __m256i nibbles(const uint8_t *qs) {
    __m128i b = _mm_loadu_si128((const __m128i *)qs);
    __m128i lo = _mm_and_si128(b, _mm_set1_epi8(15)), hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15));
    return _mm256_set_m128i(hi, lo);
}

/* int32 x 8: lane i = sum over products 4i..4i+3 of (u - offset) * q, exact either way */
AVX2 __m256i dot_avx2(int fmt, __m256i u, __m256i q, __m256i nc) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (fmt == SD_Q8_0) {  /* u - 128 as int8, then |w| times q carrying w's sign: |pair| <= 2 * 128 * 127 */
        __m256i w = _mm256_xor_si256(u, _mm256_set1_epi8((char)0x80));
        return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(q, w)), ones);
    }
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(u, q), ones), nc);  /* codes <= 15: no saturation */
}

/* tree() of blocks.c's sequence on a register: ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)) */
AVX2 float tree_avx2(__m256 l) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(l), _mm256_extractf128_ps(l, 1));  /* l0+l4, l1+l5, l2+l6, l3+l7 */
    __m128 s = _mm_add_ps(h, _mm_movehdup_ps(h));                                    /* h0+h1, _, h2+h3, _ */
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehl_ps(s, s)));
}

AVX2 float finish_avx2(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 bias) {
    return tree_avx2(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3))) + tree_avx2(bias);
}

/* Q4_1's minimum term over the blocks, 8 lanes by b % 8: m_w[b] * s_a[b] */
AVX2 __m256 minimum_term(const uint8_t *mins, const float *sa, int64_t nb) {
    __m256 acc = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mins + 2 * b))), _mm256_loadu_ps(sa + b), acc);
    if (b < nb) {  /* the tail in lanes 0 .. nb - b - 1, the rest multiplied by 0 */
        uint16_t m[8] = {0};
        float s[8] = {0};
        memcpy(m, mins + 2 * b, 2 * (size_t)(nb - b));
        memcpy(s, sa + b, sizeof(float) * (size_t)(nb - b));
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)m)), _mm256_loadu_ps(s), acc);
    }
    return acc;
}

/* One column, ROWS rows from r0 (ROWS a constant where this is inlined: the accumulators stay in
 * registers); each weight block is loaded once for all ROWS rows. */
/* One column, ROWS rows from r0 (ROWS and the format constants where this is inlined: the
 * accumulators stay in registers); each weight block is loaded once for all ROWS rows. */
#define ROW_POINTERS                                                                                               \
    const int64_t nb = x->k / SD_QK;                                                                             \
    const uint8_t *col = x->w + n * nb * BLOCK_BYTES[fmt], *codes = col + nb * SCALE_BYTES[fmt];                  \
    const int8_t *qr[4];                                                                                         \
    const float *dr[4];                                                                                          \
    const int32_t *cr[4];                                                                                        \
    _Pragma("GCC unroll 4") for (int t = 0; t < rows; t++) {                                                  \
        qr[t] = x->qa + (r0 + t) * x->k;                                                                         \
        dr[t] = x->da + (r0 + t) * nb * 8;                                                                       \
        cr[t] = x->nc + (r0 + t) * nb * 8;                                                                       \
    }

#define BLOCK_STEP(b, j)                                                                                           \
    do {                                                                                                         \
        const __m256i u = fmt == SD_Q8_0 ? _mm256_loadu_si256((const __m256i *)(codes + (b) * 32)) : nibbles(codes + (b) * 16); \
        const __m256 dw = _mm256_set1_ps(_cvtsh_ss(*(const uint16_t *)(col + 2 * (b))));                          \
        _Pragma("GCC unroll 4") for (int t = 0; t < rows; t++) {                                              \
            const __m256i q = _mm256_loadu_si256((const __m256i *)(qr[t] + (b) * SD_QK));                        \
            const __m256i nc = fmt == SD_Q4_1 ? _mm256_setzero_si256() : _mm256_loadu_si256((const __m256i *)(cr[t] + (b) * 8)); \
            const __m256 p = _mm256_cvtepi32_ps(dot_avx2(fmt, u, q, nc));                                       \
            acc[t][j] = _mm256_fmadd_ps(p, _mm256_mul_ps(dw, _mm256_loadu_ps(dr[t] + (b) * 8)), acc[t][j]);      \
        }                                                                                                        \
    } while (0)

AVX2 void tile_avx2(const sd_args *x, const int fmt, int64_t n, int64_t r0, const int rows) {
    ROW_POINTERS
    __m256 acc[4][4];
    _Pragma("GCC unroll 4") for (int t = 0; t < rows; t++) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4) {
        BLOCK_STEP(b, 0);
        BLOCK_STEP(b + 1, 1);
        BLOCK_STEP(b + 2, 2);
        BLOCK_STEP(b + 3, 3);
    }
    if (b < nb) BLOCK_STEP(b, 0);
    if (b + 1 < nb) BLOCK_STEP(b + 1, 1);
    if (b + 2 < nb) BLOCK_STEP(b + 2, 2);
    _Pragma("GCC unroll 4") for (int t = 0; t < rows; t++) {
        const int64_t r = r0 + t;
        const __m256 bias = fmt == SD_Q4_1 ? minimum_term(col + 2 * nb, x->sa + r * nb, nb) : _mm256_setzero_ps();
        x->y[r * x->n + n] = finish_avx2(acc[t][0], acc[t][1], acc[t][2], acc[t][3], bias);
    }
}


/* AVX-512 VNNI: two blocks an instruction, blocks (4c, 4c + 1) in one register (acc sets 0 | 1)
 * and (4c + 2, 4c + 3) in another (sets 2 | 3): the same lanes and sums as the sequence above.
 * ``mask``: the bytes of a pair that exist (the second block of a tail pair may not). */
/* minimum_term with masked loads for the tail (no copies: it runs once per row and column) */
VNNI __m256 minimum_term_512(const uint8_t *mins, const float *sa, int64_t nb) {
    __m256 acc = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mins + 2 * b))), _mm256_loadu_ps(sa + b), acc);
    if (b < nb) {
        const __mmask8 tail = (__mmask8)((1u << (nb - b)) - 1);
        const __m256 m = _mm256_cvtph_ps(_mm_maskz_loadu_epi16(tail, mins + 2 * b));
        acc = _mm256_mask3_fmadd_ps(m, _mm256_maskz_loadu_ps(tail, sa + b), acc, tail);
    }
    return acc;
}

VNNI __m512i codes_pair(int fmt, const uint8_t *codes, int64_t b, __mmask64 mask) {
    if (fmt == SD_Q8_0) return _mm512_maskz_loadu_epi8(mask, codes + b * 32);
    __m256i qs = _mm256_maskz_loadu_epi8((__mmask32)mask, codes + b * 16);  /* qs_b | qs_b+1 */
    __m256i lo = _mm256_and_si256(qs, _mm256_set1_epi8(15)), hi = _mm256_and_si256(_mm256_srli_epi16(qs, 4), _mm256_set1_epi8(15));
    __m512i x = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);      /* lo_b, lo_b+1, hi_b, hi_b+1 */
    return _mm512_shuffle_i64x2(x, x, _MM_SHUFFLE(3, 1, 2, 0));             /* lo_b, hi_b, lo_b+1, hi_b+1 */
}

#define PAIR_STEP(b, j, two)                                                                                       \
    do {                                                                                                         \
        const __mmask64 bytes = (two) ? ~(__mmask64)0 : 0xffffffffu;                                            \
        const __mmask16 lanes = (two) ? 0xffff : 0x00ff;                                                         \
        const __m512i u = codes_pair(fmt, codes, (b), fmt == SD_Q8_0 ? bytes : (two) ? 0xffffffffu : 0xffffu);  \
        const __m128i d2 = _mm_cvtsi32_si128((two) ? *(const int32_t *)(col + 2 * (b)) : *(const uint16_t *)(col + 2 * (b))); \
        const __m512 dw = _mm512_permutexvar_ps(spread, _mm512_castps256_ps512(_mm256_cvtph_ps(d2)));         \
        _Pragma("GCC unroll 4") for (int t = 0; t < rows; t++) {                                              \
            const __m512i q = _mm512_maskz_loadu_epi8(bytes, qr[t] + (b) * SD_QK);                               \
            const __m512i nc = fmt == SD_Q4_1 ? _mm512_setzero_si512() : _mm512_maskz_loadu_epi32(lanes, cr[t] + (b) * 8); \
            const __m512 p = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(nc, u, q));                                 \
            const __m512 sc = _mm512_mul_ps(dw, _mm512_maskz_loadu_ps(lanes, dr[t] + (b) * 8));                  \
            acc[t][j] = _mm512_mask3_fmadd_ps(p, sc, acc[t][j], lanes);                                          \
        }                                                                                                        \
    } while (0)

VNNI void tile_vnni(const sd_args *x, const int fmt, int64_t n, int64_t r0, const int rows) {
    ROW_POINTERS
    const __m512i spread = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);  /* lanes 0-7: scale 0; 8-15: scale 1 */
    __m512 acc[4][2];
    _Pragma("GCC unroll 4") for (int t = 0; t < rows; t++) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4) {
        PAIR_STEP(b, 0, 1);
        PAIR_STEP(b + 2, 1, 1);
    }
    if (nb - b == 1) PAIR_STEP(b, 0, 0);
    if (nb - b >= 2) PAIR_STEP(b, 0, 1);
    if (nb - b == 3) PAIR_STEP(b + 2, 1, 0);
    _Pragma("GCC unroll 4") for (int t = 0; t < rows; t++) {
        const int64_t r = r0 + t;
        const __m256 bias = fmt == SD_Q4_1 ? minimum_term_512(col + 2 * nb, x->sa + r * nb, nb) : _mm256_setzero_ps();
        __m256 a0 = _mm512_castps512_ps256(acc[t][0]), a1 = _mm512_extractf32x8_ps(acc[t][0], 1);
        __m256 a2 = _mm512_castps512_ps256(acc[t][1]), a3 = _mm512_extractf32x8_ps(acc[t][1], 1);
        x->y[r * x->n + n] = finish_avx2(a0, a1, a2, a3, bias);
    }
}

/* Every (format, rows) pair spelled out, so each inlined tile knows both as constants. */
#define COLS(ATTR, TARGET, NAME, TILE)                                                                             \
    ATTR void NAME##_f(const sd_args *x, int64_t n0, int64_t n1, const int fmt) {     \
        for (int64_t n = n0; n < n1; n++) {                                                                      \
            int64_t r0 = 0;                                                                                      \
            for (; r0 + 4 <= x->m; r0 += 4) TILE(x, fmt, n, r0, 4);                                              \
            switch (x->m - r0) {                                                                                 \
            case 3: TILE(x, fmt, n, r0, 3); break;                                                               \
            case 2: TILE(x, fmt, n, r0, 2); break;                                                               \
            case 1: TILE(x, fmt, n, r0, 1); break;                                                               \
            default: break;                                                                                      \
            }                                                                                                    \
        }                                                                                                        \
    }                                                                                                            \
    __attribute__((TARGET)) static void NAME(const sd_args *x, int64_t n0, int64_t n1) {                          \
        switch (x->format) {                                                                                     \
        case SD_Q8_0: NAME##_f(x, n0, n1, SD_Q8_0); break;                                                       \
        case SD_Q4_0: NAME##_f(x, n0, n1, SD_Q4_0); break;                                                       \
        default: NAME##_f(x, n0, n1, SD_Q4_1); break;                                                            \
        }                                                                                                        \
    }
COLS(AVX2, ISA_AVX2, cols_avx2, tile_avx2)
COLS(VNNI, ISA_VNNI, cols_vnni, tile_vnni)
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

void sd_matmul_cols(const sd_args *x, int64_t n0, int64_t n1) {
#ifdef SD_X86
    if (x->isa == SD_ISA_VNNI) {
        cols_vnni(x, n0, n1);
        return;
    }
    if (x->isa == SD_ISA_AVX2) {
        cols_avx2(x, n0, n1);
        return;
    }
#endif
    cols_portable(x, n0, n1);
}

int sd_check(int format, int64_t m, int64_t k, int64_t n) {
    if (format < 0 || format >= SD_FORMATS) return SD_ERR_FORMAT;
    if (k <= 0 || k % SD_QK) return SD_ERR_K;
    if (m < 0 || n <= 0) return SD_ERR_SHAPE;
    return 0;
}

/* One whole product, single-threaded, scratch allocated here: the entry point the tests call
 * through ctypes (the ONNX Runtime op splits the columns over its threads instead). */
int sd_matmul(int format, int isa, const float *a, int64_t m, int64_t k, const uint8_t *w, int64_t n, float *y) {
    int err = sd_check(format, m, k, n);
    if (err) return err;
    if (!sd_isa_available(isa)) return SD_ERR_ISA;
    sd_scratch s = {0};
    if (sd_reserve(&s, m, k)) err = SD_ERR_MEMORY;
    if (!err) {
        sd_quantize_rows(format, a, m, k, s.qa, s.da, s.sa, s.nc);
        sd_args x = {format, isa, m, k, n, s.qa, s.da, s.sa, s.nc, w, y};
        sd_matmul_cols(&x, 0, n);
    }
    sd_release(&s);
    return err;
}

int sd_reserve(sd_scratch *s, int64_t m, int64_t k) {
    if (m * k <= s->capacity) return 0;
    const int64_t nb = k / SD_QK;
    sd_release(s);
    s->qa = malloc((size_t)(m * k) + 32);
    s->da = malloc(sizeof(float) * 8 * (size_t)(m * nb + 1));
    s->sa = malloc(sizeof(float) * (size_t)(m * nb + 1));
    s->nc = malloc(sizeof(int32_t) * 8 * (size_t)(m * nb + 1));
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
