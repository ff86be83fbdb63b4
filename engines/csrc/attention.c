/* Attention over a preallocated KV buffer whose result for a query row does not depend on the
 * other rows of the call: ONNX Runtime's GroupQueryAttention (batch 1, no bias) with one fixed
 * float sequence per (row, head), the same for a 1-token call and a verify call of gamma + 1.
 *
 *   qkv [1, S, (H + 2 Hkv) D] (packed) or q, k, v;  buffers [1, Hkv, T, D];  total = seqlens_k + 1
 *   new rows s = 0..S-1 sit at position p = total - S + s (rotary by p, written to the buffers)
 *
 *   per (row s, head h, kv head g = h / (H / Hkv)), over j = first .. p (first = p - window + 1 or 0):
 *       score_j = scale * dot(q, k_j)           dot: 8 lanes over d in order, lanes summed as blocks.c
 *       score_j = softcap * tanh(score_j / softcap)        (softcap > 0)
 *       w_j     = exp(score_j - max score)                 in order of j; sum = w_first + ... + w_p
 *       out[d]  = sum over j in order of (w_j / sum) * v_j[d]
 *
 * Rotary (do_rotary) rotates each head's first 2 * cos_cache.shape[1] values, halves or
 * interleaved pairs: x' = x cos - y sin, y' = y cos + x sin.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "attention.h"

static float dot8(const float *a, const float *b, int64_t d) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= d; i += 8)
        for (int l = 0; l < 8; l++) acc[l] += a[i + l] * b[i + l];
    for (int l = 0; i < d; i++, l++) acc[l] += a[i] * b[i];
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

static void rotate(float *x, const float *cos, const float *sin, int64_t half, int interleaved) {
    for (int64_t i = 0; i < half; i++) {
        float *a = interleaved ? x + 2 * i : x + i, *b = interleaved ? x + 2 * i + 1 : x + i + half;
        float xa = *a, xb = *b;
        *a = xa * cos[i] - xb * sin[i];
        *b = xb * cos[i] + xa * sin[i];
    }
}

int sd_attention_check(const sd_attention *x) {
    if (x->heads <= 0 || x->kv_heads <= 0 || x->heads % x->kv_heads) return SD_ATT_HEADS;
    if (x->total < x->s || x->total > x->t || x->s < 0) return SD_ATT_TOTAL;
    if (x->rotary && (x->rot_half <= 0 || 2 * x->rot_half > x->d || x->total > x->cache_rows)) return SD_ATT_ROTARY;
    return 0;
}

/* The new rows' keys and values: rotated, and written at [total - S, total) of the buffers
 * (which hold rows [0, total - S) of the calls before). */
void sd_attention_write(const sd_attention *x, float *key_buf, float *value_buf) {
    const int64_t d = x->d, start = x->total - x->s;
    for (int64_t s = 0; s < x->s; s++) {
        const int64_t p = start + s;
        for (int64_t g = 0; g < x->kv_heads; g++) {
            float *k = key_buf + (g * x->t + p) * d, *v = value_buf + (g * x->t + p) * d;
            memcpy(k, x->k + s * x->k_stride + g * d, sizeof(float) * (size_t)d);
            memcpy(v, x->v + s * x->v_stride + g * d, sizeof(float) * (size_t)d);
            if (x->rotary) rotate(k, x->cos + p * x->rot_half, x->sin + p * x->rot_half, x->rot_half, x->interleaved);
        }
    }
}

/* Output rows for heads [h0, h1) (the op splits heads over threads); ``scores``: total floats. */
void sd_attention_heads(const sd_attention *x, const float *key_buf, const float *value_buf, float *out, int64_t h0, int64_t h1,
                        float *scores, float *q) {
    const int64_t d = x->d, start = x->total - x->s, group = x->heads / x->kv_heads;
    for (int64_t s = 0; s < x->s; s++) {
        const int64_t p = start + s, first = x->window > 0 && p - x->window + 1 > 0 ? p - x->window + 1 : 0;
        for (int64_t h = h0; h < h1; h++) {
            const int64_t g = h / group;
            const float *kb = key_buf + g * x->t * d, *vb = value_buf + g * x->t * d;
            memcpy(q, x->q + s * x->q_stride + h * d, sizeof(float) * (size_t)d);
            if (x->rotary) rotate(q, x->cos + p * x->rot_half, x->sin + p * x->rot_half, x->rot_half, x->interleaved);
            float top = -INFINITY;
            for (int64_t j = first; j <= p; j++) {
                float sc = x->scale * dot8(q, kb + j * d, d);
                if (x->softcap > 0.0f) sc = x->softcap * tanhf(sc / x->softcap);
                scores[j] = sc;
                top = fmaxf(top, sc);
            }
            float sum = 0.0f;
            for (int64_t j = first; j <= p; j++) {
                scores[j] = expf(scores[j] - top);
                sum += scores[j];
            }
            const float inv = 1.0f / sum;
            float *o = out + s * x->heads * d + h * d;
            memset(o, 0, sizeof(float) * (size_t)d);
            for (int64_t j = first; j <= p; j++) {
                const float w = scores[j] * inv, *v = vb + j * d;
                for (int64_t i = 0; i < d; i++) o[i] += w * v[i];
            }
        }
    }
}
