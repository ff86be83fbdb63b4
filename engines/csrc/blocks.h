/* Block-quantized matrix products, row-invariant (blocks.c says how). */
#ifndef SPECDEC_BLOCKS_H
#define SPECDEC_BLOCKS_H
#include <stdint.h>

#define SD_QK 32 /* weights and activations are quantized in blocks of 32 along K */

enum { SD_Q8_0 = 0, SD_Q4_0 = 1, SD_Q4_1 = 2, SD_FORMATS = 3 };        /* the manifest's format numbers */
enum { SD_ISA_PORTABLE = 0, SD_ISA_AVX2 = 1, SD_ISA_VNNI = 2, SD_ISAS = 3 };
enum { SD_ERR_FORMAT = 1, SD_ERR_K = 2, SD_ERR_SHAPE = 3, SD_ERR_ISA = 4, SD_ERR_MEMORY = 5 };

typedef struct {
    int format, isa;
    int64_t m, k, n;
    const int8_t *qa;   /* [m, k] activations' codes */
    const float *da;    /* [m, k / 32] their scales */
    const float *sa;    /* [m, k / 32] scale * sum of codes (Q4_1's minimum term) */
    const int32_t *nc;  /* [m, k / 32] -offset * sum of codes (blocks.c) */
    const uint8_t *w;   /* [ceil(n / 16), k / 32, 16 * block bytes]: panels of 16 columns (blocks.c);
                           gated: [2 * n / 16, ...], the gate's and the up projection's panels in turn */
    float *y;           /* [m, n] */
    int gated;          /* y = silu(x @ gate) * (x @ up) (a gated MLP's first half), n % 16 == 0 */
} sd_args;

typedef struct {        /* the activations' codes and scales for up to capacity / k rows */
    int8_t *qa;
    float *da, *sa;
    int32_t *nc;
    int64_t capacity;
} sd_scratch;

int sd_check(int format, int64_t m, int64_t k, int64_t n);
int sd_isa_available(int isa);
int sd_best_isa(void);
const char *sd_isa_name(int isa);
void sd_quantize_rows(int format, int isa, const float *a, int64_t m, int64_t k, int8_t *qa, float *da, float *sa, int32_t *nc);
int sd_reserve(sd_scratch *s, int64_t m, int64_t k);
void sd_release(sd_scratch *s);
int64_t sd_panels(int64_t n);
void sd_matmul_panels(const sd_args *x, int64_t p0, int64_t p1);
int sd_matmul(int format, int isa, int gated, const float *a, int64_t m, int64_t k, const uint8_t *w, int64_t n, float *y);
#endif
