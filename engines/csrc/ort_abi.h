/* The parts of ONNX Runtime's C ABI this library uses, declared here: the Python wheel ships no C
 * headers. OrtApiBase, the OrtCustomOp struct as of API version 8, and the OrtApi functions by
 * their slot in OrtApi. ONNX Runtime only ever appends to both structs (never reorders), so a slot
 * holds in every release that has it; ParallelFor (slot 274) came with API version 17 (ORT 1.17).
 */
#ifndef SPECDEC_ORT_ABI_H
#define SPECDEC_ORT_ABI_H
#include <stddef.h>
#include <stdint.h>

#define EXPORT __attribute__((visibility("default")))

typedef struct OrtStatus OrtStatus;
typedef struct OrtApi OrtApi;  /* read as an array of function pointers, by slot */
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtValue OrtValue;
typedef struct OrtTensorTypeAndShapeInfo OrtShape;

typedef struct {
    const OrtApi *(*GetApi)(uint32_t version);
    const char *(*GetVersionString)(void);
} OrtApiBase;

typedef struct OrtCustomOp {
    uint32_t version;
    void *(*CreateKernel)(const struct OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info);
    const char *(*GetName)(const struct OrtCustomOp *op);
    const char *(*GetExecutionProviderType)(const struct OrtCustomOp *op);
    int (*GetInputType)(const struct OrtCustomOp *op, size_t index);
    size_t (*GetInputTypeCount)(const struct OrtCustomOp *op);
    int (*GetOutputType)(const struct OrtCustomOp *op, size_t index);
    size_t (*GetOutputTypeCount)(const struct OrtCustomOp *op);
    void (*KernelCompute)(void *kernel, OrtKernelContext *context);
    void (*KernelDestroy)(void *kernel);
    int (*GetInputCharacteristic)(const struct OrtCustomOp *op, size_t index);
    int (*GetOutputCharacteristic)(const struct OrtCustomOp *op, size_t index);
} OrtCustomOp;

enum { OP_VERSION = 8, API_BASE = 8, API_PARALLEL = 17 };
enum { T_FLOAT = 1, T_UINT8 = 2, T_INT32 = 6, REQUIRED = 0, OPTIONAL = 1 };

/* OrtApi slots (zero-based) and their signatures */
#define FN(api, slot, type) ((type)((void *const *)(api))[slot])
#define CREATE_STATUS(api) FN(api, 0, OrtStatus *(*)(int, const char *))
#define CREATE_DOMAIN(api) FN(api, 26, OrtStatus *(*)(const char *, OrtCustomOpDomain **))
#define DOMAIN_ADD(api) FN(api, 27, OrtStatus *(*)(OrtCustomOpDomain *, const OrtCustomOp *))
#define ADD_DOMAIN(api) FN(api, 28, OrtStatus *(*)(OrtSessionOptions *, OrtCustomOpDomain *))
#define MUTABLE_DATA(api) FN(api, 51, OrtStatus *(*)(OrtValue *, void **))
#define DIMS_COUNT(api) FN(api, 61, OrtStatus *(*)(const OrtShape *, size_t *))
#define DIMS(api) FN(api, 62, OrtStatus *(*)(const OrtShape *, int64_t *, size_t))
#define TYPE_AND_SHAPE(api) FN(api, 65, OrtStatus *(*)(const OrtValue *, OrtShape **))
#define ATTR_FLOAT(api) FN(api, 85, OrtStatus *(*)(const OrtKernelInfo *, const char *, float *))
#define ATTR_INT64(api) FN(api, 86, OrtStatus *(*)(const OrtKernelInfo *, const char *, int64_t *))
#define GET_INPUT(api) FN(api, 90, OrtStatus *(*)(const OrtKernelContext *, size_t, const OrtValue **))
#define GET_OUTPUT(api) FN(api, 91, OrtStatus *(*)(OrtKernelContext *, size_t, const int64_t *, size_t, OrtValue **))
#define RELEASE_STATUS(api) FN(api, 93, void (*)(OrtStatus *))
#define RELEASE_SHAPE(api) FN(api, 99, void (*)(OrtShape *))
#define PARALLEL_FOR(api) FN(api, 274, OrtStatus *(*)(const OrtKernelContext *, void (*)(void *, size_t), size_t, size_t, void *))

extern const OrtApi *API;          /* version 8: every slot below 170 */
extern const OrtApi *API_THREADS;  /* the version with ParallelFor, or NULL (then one thread) */
extern int ISA;
extern OrtCustomOp SD_ATTENTION_OP;  /* ort_attention.c */                    /* blocks.h: the instruction set the products run on */

#define CHECK(call) do { OrtStatus *st_ = (call); if (st_) { RELEASE_STATUS(API)(st_); return -1; } } while (0)

/* Input ``i``'s data and shape (rank <= 8); NULL data for an absent optional input. -1: refused. */
int sd_input(const OrtKernelContext *ctx, size_t i, void **data, int64_t *dims, size_t *rank);
/* fn(usr, i) for i in [0, total), on ONNX Runtime's intra-op threads where it has them. */
void sd_parallel(OrtKernelContext *ctx, void (*fn)(void *, size_t), size_t total, void *usr);
#endif
