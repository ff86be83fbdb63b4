/* ai.specdec's GroupQueryAttention: com.microsoft's op (batch 1, no attention bias) run by
 * attention.c, whose rows do not depend on the call's other rows.
 *
 *   inputs   0 query [1, S, H D] or packed qkv [1, S, (H + 2 Hkv) D]   1 key, 2 value (absent when packed)
 *            3 past_key, 4 past_value [1, Hkv, T, D]   5 seqlens_k int32 [1] (= total - 1)
 *            6 total_sequence_length int32 []          7 cos_cache, 8 sin_cache [P, R/2] (do_rotary)
 *   outputs  0 output [1, S, H D]   1 present_key, 2 present_value [1, Hkv, T, D] (the past buffers
 *            themselves where the caller binds them so, as specdec's engines do; else a copy)
 *   attributes num_heads, kv_num_heads, scale (0: 1 / sqrt D), local_window_size (-1: none),
 *            do_rotary, rotary_interleaved, softcap (0: none)
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "ort_abi.h"

typedef struct {
    int64_t heads, kv_heads, window, rotary, interleaved;
    float scale, softcap;
} Attention;

static int64_t attr_int(const OrtKernelInfo *info, const char *name, int64_t fallback) {
    int64_t v;
    OrtStatus *st = ATTR_INT64(API)(info, name, &v);
    if (st) { RELEASE_STATUS(API)(st); return fallback; }
    return v;
}

static float attr_float(const OrtKernelInfo *info, const char *name, float fallback) {
    float v;
    OrtStatus *st = ATTR_FLOAT(API)(info, name, &v);
    if (st) { RELEASE_STATUS(API)(st); return fallback; }
    return v;
}

static void *create(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info) {
    (void)op; (void)api;
    Attention *a = calloc(1, sizeof(Attention));
    if (!a) return NULL;
    a->heads = attr_int(info, "num_heads", 0);
    a->kv_heads = attr_int(info, "kv_num_heads", 0);
    a->window = attr_int(info, "local_window_size", -1);
    a->rotary = attr_int(info, "do_rotary", 0);
    a->interleaved = attr_int(info, "rotary_interleaved", 0);
    a->scale = attr_float(info, "scale", 0.0f);
    a->softcap = attr_float(info, "softcap", 0.0f);
    return a;
}

static void destroy(void *p) { free(p); }

typedef struct {
    const sd_attention *x;
    const float *key_buf, *value_buf;
    float *out;
} Heads;

static void run_head(void *p, size_t h) {
    const Heads *t = p;
    enum { STACK = 4096 };
    float scores_stack[STACK], q[512];
    float *scores = t->x->total <= STACK ? scores_stack : malloc(sizeof(float) * (size_t)t->x->total);
    if (!scores || t->x->d > 512) return;  /* refused in compute() before */
    sd_attention_heads(t->x, t->key_buf, t->value_buf, t->out, (int64_t)h, (int64_t)h + 1, scores, q);
    if (scores != scores_stack) free(scores);
}

/* -1: ONNX Runtime refused a call; -2: shapes this op does not take (compute leaves the output). */
static int compute(Attention *a, OrtKernelContext *ctx) {
    void *in[9];
    int64_t dims[9][8];
    size_t rank[9];
    for (size_t i = 0; i < 9; i++)
        if (sd_input(ctx, i, &in[i], dims[i], &rank[i])) return -1;
    if (!in[0] || !in[3] || !in[4] || !in[5] || rank[0] != 3 || rank[3] != 4 || dims[0][0] != 1 || dims[3][0] != 1) return -2;
    sd_attention x = {0};
    x.s = dims[0][1];
    x.heads = a->heads;
    x.kv_heads = a->kv_heads;
    x.t = dims[3][2];
    x.d = dims[3][3];
    x.total = (int64_t)((const int32_t *)in[5])[0] + 1;
    x.scale = a->scale != 0.0f ? a->scale : 1.0f / sqrtf((float)x.d);
    x.softcap = a->softcap;
    x.window = a->window > 0 ? a->window : 0;
    const float *q = in[0];
    if (in[1]) {  /* separate q, k, v */
        x.q = q, x.k = in[1], x.v = in[2];
        x.q_stride = x.heads * x.d, x.k_stride = x.v_stride = x.kv_heads * x.d;
    } else {      /* packed: each row is q | k | v */
        x.q_stride = x.k_stride = x.v_stride = (x.heads + 2 * x.kv_heads) * x.d;
        x.q = q, x.k = q + x.heads * x.d, x.v = q + (x.heads + x.kv_heads) * x.d;
    }
    if (a->rotary) {
        if (!in[7] || !in[8] || rank[7] != 2) return -2;
        x.rotary = 1, x.interleaved = (int)a->interleaved;
        x.cos = in[7], x.sin = in[8], x.rot_half = dims[7][1], x.cache_rows = dims[7][0];
    }
    if (sd_attention_check(&x) || x.d > 512 || dims[0][2] != (in[1] ? x.heads * x.d : x.q_stride)) return -2;

    OrtValue *out, *pk, *pv;
    void *po, *ppk, *ppv;
    int64_t odims[3] = {1, x.s, x.heads * x.d};
    CHECK(GET_OUTPUT(API)(ctx, 0, odims, 3, &out));
    CHECK(GET_OUTPUT(API)(ctx, 1, dims[3], 4, &pk));
    CHECK(GET_OUTPUT(API)(ctx, 2, dims[4], 4, &pv));
    CHECK(MUTABLE_DATA(API)(out, &po));
    CHECK(MUTABLE_DATA(API)(pk, &ppk));
    CHECK(MUTABLE_DATA(API)(pv, &ppv));
    size_t bytes = sizeof(float) * (size_t)(x.kv_heads * x.t * x.d);
    if (ppk != in[3]) memcpy(ppk, in[3], bytes);  /* not bound in place: the present buffers start as the past */
    if (ppv != in[4]) memcpy(ppv, in[4], bytes);
    sd_attention_write(&x, ppk, ppv);
    Heads t = {&x, ppk, ppv, po};
    sd_parallel(ctx, run_head, (size_t)x.heads, &t);
    return 0;
}

static void compute_op(void *p, OrtKernelContext *ctx) {
    int err = p ? compute(p, ctx) : -1;
    (void)err;  /* version 8's KernelCompute returns nothing; export only emits shapes this op takes */
}

static const char *name(const OrtCustomOp *op) { (void)op; return "GroupQueryAttention"; }
static const char *provider(const OrtCustomOp *op) { (void)op; return NULL; }
static int input_type(const OrtCustomOp *op, size_t i) { (void)op; return i == 5 || i == 6 ? T_INT32 : T_FLOAT; }
static size_t nine(const OrtCustomOp *op) { (void)op; return 9; }
static int output_type(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return T_FLOAT; }
static size_t three(const OrtCustomOp *op) { (void)op; return 3; }
static int input_kind(const OrtCustomOp *op, size_t i) { (void)op; return i == 1 || i == 2 || i == 7 || i == 8 ? OPTIONAL : REQUIRED; }
static int output_kind(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return REQUIRED; }

OrtCustomOp SD_ATTENTION_OP = {
    OP_VERSION, create, name, provider, input_type, nine, output_type, three, compute_op, destroy, input_kind, output_kind,
};
