/* Block-quantized matrix products for 1..16 rows whose result for a row does not depend on the
 * other rows: Y[m, n] = sum_k A[m, k] * W[n, k], W stored in GGUF's own blocks of 32 along K.
 *
 *   Q8_0: { fp16 d; int8 q[32] }            w = d * q                      34 bytes (8.5 bits)
 *   Q4_0: { fp16 d; uint8 qs[16] }           w = d * (c - 8)                18 bytes (4.5 bits)
 *   Q4_1: { fp16 d; fp16 m; uint8 qs[16] }   w = d * c + m                  20 bytes (5.0 bits)
 *   (4-bit codes: qs[j] & 15 is element j, qs[j] >> 4 element j + 16, as GGUF stores them)
 *
 * Each row of A is quantized once per call per block of 32, as llama.cpp does for its Q8_0 x Q8_0
 * and Q4_1 x Q8_1 products: da = max|a| / 127, qa = rint(a / da) in -127..127 (and sa = da * sum qa
 * for Q4_1's minimum), with da kept in float32. A weight block times an
 * activation block is an exact int32 sum; the float work per (row, column) is one fixed sequence
 * (below), the same whatever M, whichever rows share a call and whichever thread runs the column.
 * That is what makes a verify call of gamma + 1 rows give each row the bits a 1-row call gives it.
 *
 *   per (m, n):  acc[8] = 0                                  // 8 float lanes
 *                for b in 0 .. K/32 - 1:                      // blocks in order
 *                    p[8]   = int32 partial sums of the block's 32 products, lane i = products 4i..4i+3
 *                    acc[i] = fma(float(p[i]), d_w[n,b] * d_a[m,b], acc[i])
 *                    bias   = fma(m_w[n,b], s_a[m,b], bias)  // Q4_1 only
 *                y = ((acc0 + acc4) + (acc1 + acc5)) + ((acc2 + acc6) + (acc3 + acc7)) + bias
 *
 * The portable, AVX2 and AVX-512 VNNI paths run that sequence (the integer sums are exact, so all
 * three give the same bits); which one runs is chosen once, from the CPU.
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

int sd_block_bytes(int format) { return format >= 0 && format < SD_FORMATS ? BLOCK_BYTES[format] : -1; }

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

void sd_quantize_rows(const float *a, int64_t m, int64_t k, int8_t *qa, float *da, float *sa) {
    int64_t nb = k / SD_QK;
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
            da[r * nb + b] = d;
            sa[r * nb + b] = d * (float)s;
        }
    }
}

/* -- the portable path ------------------------------------------------------------------------ */

static void codes32(int format, const uint8_t *blk, int8_t *out) {
    if (format == SD_Q8_0) {
        memcpy(out, blk + 2, 32);
        return;
    }
    const uint8_t *qs = blk + (format == SD_Q4_1 ? 4 : 2);
    for (int j = 0; j < 16; j++) {
        out[j] = (int8_t)(qs[j] & 15);
        out[j + 16] = (int8_t)(qs[j] >> 4);
    }
}

static float finish(const float acc[8], float bias) {
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + bias;
}

static void cols_portable(const sd_args *x, int64_t n0, int64_t n1) {
    const int64_t nb = x->k / SD_QK, bytes = BLOCK_BYTES[x->format];
    int8_t w[32];
    for (int64_t n = n0; n < n1; n++) {
        for (int64_t r = 0; r < x->m; r++) {
            float acc[8] = {0}, bias = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = x->w + (n * nb + b) * bytes;
                const int8_t *q = x->qa + r * x->k + b * SD_QK;
                codes32(x->format, blk, w);
                float scale = fp16(blk) * x->da[r * nb + b];
                for (int lane = 0; lane < 8; lane++) {
                    int32_t p = 0;
                    for (int i = 4 * lane; i < 4 * lane + 4; i++) p += (int32_t)w[i] * q[i];
                    if (x->format == SD_Q4_0) {  /* (c - 8) * q summed: the -8 per product folded in */
                        int32_t s4 = q[4 * lane] + q[4 * lane + 1] + q[4 * lane + 2] + q[4 * lane + 3];
                        p -= 8 * s4;
                    }
                    acc[lane] = fmaf((float)p, scale, acc[lane]);
                }
                if (x->format == SD_Q4_1) bias = fmaf(fp16(blk + 2), x->sa[r * nb + b], bias);
            }
            x->y[r * x->n + n] = finish(acc, bias);
        }
    }
}

/* -- AVX2 ------------------------------------------------------------------------------------- */

#ifdef SD_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")))

/* 32 codes of a block as bytes: Q8_0 signed, Q4 unsigned 0..15 */
#define LOAD_CODES(format, blk) \
    ((format) == SD_Q8_0 ? _mm256_loadu_si256((const __m256i *)((blk) + 2)) : nibbles((blk) + ((format) == SD_Q4_1 ? 4 : 2)))

AVX2 static inline __m256i nibbles(const uint8_t *qs) {
    __m128i b = _mm_loadu_si128((const __m128i *)qs);
    __m128i lo = _mm_and_si128(b, _mm_set1_epi8(15)), hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15));
    return _mm256_set_m128i(hi, lo);
}

/* The weights' signed values: Q8_0's codes, Q4_0's c - 8 (Q4_1's codes are unsigned already).
 * The products run as |w| times q carrying w's sign (the sign trick: one operand must be unsigned). */
AVX2 static inline __m256i signed_codes(int format, __m256i w) {
    return format == SD_Q4_0 ? _mm256_sub_epi8(w, _mm256_set1_epi8(8)) : w;
}
#define UNSIGNED_SIDE(format, sw) ((format) == SD_Q4_1 ? (sw) : _mm256_sign_epi8((sw), (sw)))
#define SIGNED_SIDE(format, sw, q) ((format) == SD_Q4_1 ? (q) : _mm256_sign_epi8((q), (sw)))

/* int32 x 8, lane i = the sum of products 4i..4i+3: exact either way (|pair| <= 2 * 128 * 127) */
AVX2 static inline __m256i dot_avx2(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
VNNI static inline __m256i dot_vnni(__m256i u, __m256i s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }

AVX2 static inline float finish_avx2(__m256 acc, float bias) {
    float l[8];
    _mm256_storeu_ps(l, acc);
    return finish(l, bias);
}

/* One body, two instruction sets: a weight block is loaded once per TILE rows; each row's
 * arithmetic is the sequence at the top of this file whatever the tile holds. */
#define TILE 4
#define COLS(NAME, TARGET, DOT)                                                                         \
    TARGET static void NAME(const sd_args *x, int64_t n0, int64_t n1) {                                 \
        const int64_t nb = x->k / SD_QK, bytes = BLOCK_BYTES[x->format];                                \
        const int fmt = x->format;                                                                      \
        for (int64_t n = n0; n < n1; n++) {                                                             \
            const uint8_t *col = x->w + n * nb * bytes;                                                 \
            for (int64_t r0 = 0; r0 < x->m; r0 += TILE) {                                               \
                const int rows = (int)(x->m - r0 < TILE ? x->m - r0 : TILE);                            \
                __m256 acc[TILE];                                                                       \
                float bias[TILE];                                                                       \
                for (int t = 0; t < TILE; t++) { acc[t] = _mm256_setzero_ps(); bias[t] = 0.0f; }        \
                for (int64_t b = 0; b < nb; b++) {                                                      \
                    const uint8_t *blk = col + b * bytes;                                               \
                    const __m256i sw = signed_codes(fmt, LOAD_CODES(fmt, blk)), u = UNSIGNED_SIDE(fmt, sw); \
                    const float dw = _cvtsh_ss(*(const uint16_t *)blk);                                 \
                    const float mw = fmt == SD_Q4_1 ? _cvtsh_ss(*(const uint16_t *)(blk + 2)) : 0.0f;   \
                    for (int t = 0; t < rows; t++) {                                                    \
                        const int64_t r = r0 + t;                                                       \
                        __m256i q = _mm256_loadu_si256((const __m256i *)(x->qa + r * x->k + b * SD_QK)); \
                        __m256 p = _mm256_cvtepi32_ps(DOT(u, SIGNED_SIDE(fmt, sw, q)));                 \
                        acc[t] = _mm256_fmadd_ps(p, _mm256_set1_ps(dw * x->da[r * nb + b]), acc[t]);    \
                        if (fmt == SD_Q4_1) bias[t] = fmaf(mw, x->sa[r * nb + b], bias[t]);             \
                    }                                                                                   \
                }                                                                                       \
                for (int t = 0; t < rows; t++) x->y[(r0 + t) * x->n + n] = finish_avx2(acc[t], bias[t]); \
            }                                                                                           \
        }                                                                                               \
    }
COLS(cols_avx2, AVX2, dot_avx2)
COLS(cols_vnni, VNNI, dot_vnni)
#endif

/* -- dispatch --------------------------------------------------------------------------------- */

int sd_isa_available(int isa) {
    if (isa == SD_ISA_PORTABLE) return 1;
#ifdef SD_X86
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (isa == SD_ISA_AVX2) return avx2;
    if (isa == SD_ISA_VNNI) return avx2 && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
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
    int64_t nb = k / SD_QK;
    int8_t *qa = malloc((size_t)(m * k + 1));
    float *da = malloc(sizeof(float) * (size_t)(m * nb + 1)), *sa = malloc(sizeof(float) * (size_t)(m * nb + 1));
    if (!qa || !da || !sa) err = SD_ERR_MEMORY;
    if (!err) {
        sd_quantize_rows(a, m, k, qa, da, sa);
        sd_args x = {format, isa, m, k, n, qa, da, sa, w, y};
        sd_matmul_cols(&x, 0, n);
    }
    free(qa); free(da); free(sa);
    return err;
}
