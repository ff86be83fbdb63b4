/* specdec's custom-op library for ONNX Runtime, domain "ai.specdec": the two ops whose rows do
 * not depend on the call's other rows (a verify call of gamma + 1 rows gives each row the bits
 * a 1-row call gives it).
 *
 *   MatMulBlocks(A: float32 [..., K], B: uint8 [ceil(N / 16), K / 32 * 16 * block bytes]) -> Y: float32 [..., N]
 *       attributes: K, N, format (blocks.h: 0 Q8_0, 1 Q4_0, 2 Q4_1), gated (optional, 0): 1 makes
 *       Y = silu(A @ gate) * (A @ up), B holding 2N columns: the two projections' panels in turn
 *   GroupQueryAttention: com.microsoft's inputs, outputs and attributes (batch 1, no attention
 *       bias), over the same in-place buffers (attention.c)
 *
 * ONNX Runtime's Python wheel ships no C headers, so the few parts of its C ABI this library uses
 * are declared here: OrtApiBase, the OrtCustomOp struct as of API version 8, and the OrtApi
 * functions it calls, by their slot in OrtApi. ONNX Runtime only ever appends to both structs
 * (never reorders), so a slot number holds in every release that has it; ParallelFor is asked for
 * by the API version that added it and used only when the runtime has it (else one thread).
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "blocks.h"
#include "ort_abi.h"

const OrtApi *API;
const OrtApi *API_THREADS;
int ISA;

int sd_input(const OrtKernelContext *ctx, size_t i, void **data, int64_t *dims, size_t *rank) {
    const OrtValue *v;
    OrtShape *shape;
    *data = NULL;
    *rank = 0;
    CHECK(GET_INPUT(API)(ctx, i, &v));
    if (!v) return 0;
    CHECK(TYPE_AND_SHAPE(API)(v, &shape));
    OrtStatus *st = DIMS_COUNT(API)(shape, rank);
    if (!st && *rank > 8) *rank = 0;
    if (!st && *rank) st = DIMS(API)(shape, dims, *rank);
    RELEASE_SHAPE(API)(shape);
    if (st) { RELEASE_STATUS(API)(st); return -1; }
    CHECK(MUTABLE_DATA(API)((OrtValue *)v, data));
    return 0;
}

void sd_parallel(OrtKernelContext *ctx, void (*fn)(void *, size_t), size_t total, void *usr) {
    OrtStatus *st = API_THREADS && total > 1 ? PARALLEL_FOR(API_THREADS)(ctx, fn, total, 0, usr) : NULL;
    if (st) RELEASE_STATUS(API)(st);
    if (st || !API_THREADS || total <= 1)
        for (size_t i = 0; i < total; i++) fn(usr, i);
}

typedef struct {
    int64_t k, n;
    int format, gated;
    pthread_mutex_t lock;  /* guards the scratch (a session may run calls concurrently) */
    sd_scratch scratch;    /* grown to the largest call's rows, kept for the next */
} Kernel;

static void *create_kernel(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info) {
    (void)op; (void)api;
    Kernel *kr = calloc(1, sizeof(Kernel));
    int64_t fmt = -1;
    if (!kr) return NULL;
    if (ATTR_INT64(API)(info, "K", &kr->k) || ATTR_INT64(API)(info, "N", &kr->n) || ATTR_INT64(API)(info, "format", &fmt)) {
        free(kr);  /* a missing attribute: the graph was not made by specdec-export */
        return NULL;
    }
    kr->format = (int)fmt;
    int64_t gated = 0;
    OrtStatus *st = ATTR_INT64(API)(info, "gated", &gated);  /* optional: absent is 0 */
    if (st) RELEASE_STATUS(API)(st);
    kr->gated = st ? 0 : (int)gated;
    if (kr->gated && kr->n % 16) {  /* the two halves alternate by panels of 16 */
        free(kr);
        return NULL;
    }
    pthread_mutex_init(&kr->lock, NULL);
    return kr;
}

static void destroy_kernel(void *p) {
    Kernel *kr = p;
    if (!kr) return;
    pthread_mutex_destroy(&kr->lock);
    sd_release(&kr->scratch);
    free(kr);
}

typedef struct { const sd_args *x; int64_t chunk; } Split;

static void run_chunk(void *p, size_t i) {
    const Split *s = p;
    const int64_t panels = sd_panels(s->x->n), p0 = (int64_t)i * s->chunk;
    sd_matmul_panels(s->x, p0, p0 + s->chunk < panels ? p0 + s->chunk : panels);
}

/* Y = A @ B; -1 where ONNX Runtime refused a call (its status is dropped: KernelCompute of
 * version 8 returns nothing), -2 where A's last axis is not K. */
static int compute(Kernel *kr, OrtKernelContext *ctx) {
    void *pa, *pb, *py;
    int64_t dims[8], wdims[8];
    size_t rank, wrank;
    OrtValue *y;
    if (sd_input(ctx, 0, &pa, dims, &rank) || sd_input(ctx, 1, &pb, wdims, &wrank)) return -1;
    if (!rank || dims[rank - 1] != kr->k) return -2;
    int64_t m = 1;
    for (size_t i = 0; i + 1 < rank; i++) m *= dims[i];
    dims[rank - 1] = kr->n;
    CHECK(GET_OUTPUT(API)(ctx, 0, dims, rank, &y));
    CHECK(MUTABLE_DATA(API)(y, &py));
    if (m == 0) return 0;

    pthread_mutex_lock(&kr->lock);
    sd_scratch *sc = &kr->scratch;
    int err = sd_reserve(sc, m, kr->k);
    if (!err) {
        sd_quantize_rows(kr->format, ISA, pa, m, kr->k, sc->qa, sc->da, sc->sa, sc->nc);
        sd_args x = {kr->format, ISA, m, kr->k, kr->n, sc->qa, sc->da, sc->sa, sc->nc, pb, py, kr->gated};
        /* one task a panel: ONNX Runtime hands each thread one contiguous run of them (balanced to a
         * panel, where chunks of 4 left a thread a quarter-chunk idle on 576 columns), and each
         * thread streams its panels' blocks once for all m rows */
        Split s = {&x, 1};
        sd_parallel(ctx, run_chunk, (size_t)((sd_panels(kr->n) + s.chunk - 1) / s.chunk), &s);
    }
    pthread_mutex_unlock(&kr->lock);
    return err;
}

static void kernel_compute(void *p, OrtKernelContext *ctx) {
    Kernel *kr = p;
    int err = kr ? compute(kr, ctx) : -1;
    (void)err;  /* nothing to return it through; specdec's load check catches a bundle this fails on */
}

static const char *op_name(const OrtCustomOp *op) { (void)op; return "MatMulBlocks"; }
static const char *op_provider(const OrtCustomOp *op) { (void)op; return NULL; }  /* the CPU provider */
static int input_type(const OrtCustomOp *op, size_t i) { (void)op; return i == 0 ? T_FLOAT : T_UINT8; }
static size_t two(const OrtCustomOp *op) { (void)op; return 2; }
static int output_type(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return T_FLOAT; }
static size_t one(const OrtCustomOp *op) { (void)op; return 1; }
static int required(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return 0; }

static OrtCustomOp MATMUL_BLOCKS = {
    OP_VERSION, create_kernel, op_name, op_provider, input_type, two, output_type, one,
    kernel_compute, destroy_kernel, required, required,
};

/* What ONNX Runtime calls when a session registers this library. */
EXPORT OrtStatus *RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base) {
    static OrtCustomOpDomain *domain;  /* one for the process: sessions share it, it outlives them */
    static pthread_mutex_t once = PTHREAD_MUTEX_INITIALIZER;
    OrtStatus *st = NULL;
    pthread_mutex_lock(&once);
    if (!domain) {
        API = base->GetApi(API_BASE);
        API_THREADS = base->GetApi(API_PARALLEL);  /* ORT >= 1.17; else one thread */
        ISA = sd_best_isa();
        if (API && !(st = CREATE_DOMAIN(API)("ai.specdec", &domain)) &&
            ((st = DOMAIN_ADD(API)(domain, &MATMUL_BLOCKS)) || (st = DOMAIN_ADD(API)(domain, &SD_ATTENTION_OP))))
            domain = NULL;
    }
    pthread_mutex_unlock(&once);
    if (!API) return NULL;  /* older than version 8: nothing can be said through it */
    return st ? st : ADD_DOMAIN(API)(options, domain);
}

/* For specdec's load check and `specdec check`: which instruction set the products run on. */
EXPORT const char *specdec_kernel_isa(void) { return sd_isa_name(sd_best_isa()); }
