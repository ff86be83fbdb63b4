/* Row-invariant attention over a preallocated KV buffer (attention.c says how). */
#ifndef SPECDEC_ATTENTION_H
#define SPECDEC_ATTENTION_H
#include <stdint.h>

enum { SD_ATT_HEADS = 1, SD_ATT_TOTAL = 2, SD_ATT_ROTARY = 3 };

typedef struct {
    int64_t s, heads, kv_heads, d, t, total;  /* new rows, heads, kv heads, head size, buffer rows, rows in use after the call */
    const float *q, *k, *v;                    /* row r's head h at q + r * q_stride + h * d (k, v: kv heads) */
    int64_t q_stride, k_stride, v_stride;
    float scale, softcap;                      /* softcap 0: none */
    int64_t window;                            /* 0: none; else a row sees its last ``window`` positions */
    int rotary, interleaved;
    const float *cos, *sin;                    /* [cache_rows, rot_half] */
    int64_t rot_half, cache_rows;
} sd_attention;

int sd_attention_check(const sd_attention *x);
void sd_attention_write(const sd_attention *x, float *key_buf, float *value_buf);
void sd_attention_heads(const sd_attention *x, const float *key_buf, const float *value_buf, float *out, int64_t h0, int64_t h1,
                        float *scores, float *q);
#endif
