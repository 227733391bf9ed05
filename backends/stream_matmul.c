/* StreamMatMul and StreamMatMulQ4: y[M, N] = a[M, K] @ W[K, N] for ONNX Runtime on CPU, the weight (float32,
 * or int4 codes and their scales) read once per call for all rows, each row computed the same whatever the
 * others (stream_kernels.h; cpu_matmul.py says why and when rlxrt uses them). Panels of 32 columns are
 * shared out over ONNX Runtime's intra-op threads.
 *
 * The ONNX Runtime C ABI is declared here, only as far as this file uses it: OrtApi is a table of function
 * pointers that only ever grows, and each slot below is its index in that table (onnxruntime_c_api.h, ORT
 * 1.17+); OrtCustomOp's layout is the header's, at struct version 16 (errors returned from KernelComputeV2).
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if !defined(_WIN32)
#include <pthread.h>
#endif

#if defined(_WIN32)
#define EXPORT __declspec(dllexport)
#else
#define EXPORT __attribute__((visibility("default")))
#endif

/* ---- the ONNX Runtime ABI ---------------------------------------------------------------------------- */

typedef void Status; /* OrtStatus*: NULL is success */
typedef const void *const *Api;

enum { FLOAT = 1, UINT8 = 2, ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2, API_VERSION = 17 };
enum { /* OrtApi slots */
  CREATE_STATUS = 0, CREATE_CUSTOM_OP_DOMAIN = 26, CUSTOM_OP_DOMAIN_ADD = 27, ADD_CUSTOM_OP_DOMAIN = 28,
  GET_TENSOR_MUTABLE_DATA = 51, GET_TENSOR_ELEMENT_TYPE = 60, GET_DIMENSIONS_COUNT = 61, GET_DIMENSIONS = 62,
  GET_TENSOR_TYPE_AND_SHAPE = 65, KERNEL_INFO_GET_ATTRIBUTE_INT64 = 86, KERNEL_CONTEXT_GET_INPUT = 90,
  KERNEL_CONTEXT_GET_OUTPUT = 91, RELEASE_TENSOR_TYPE_AND_SHAPE_INFO = 99, KERNEL_CONTEXT_PARALLEL_FOR = 274,
};

typedef struct {
  const void *(*GetApi)(uint32_t version);
  const char *(*GetVersionString)(void);
} ApiBase;

typedef struct CustomOp CustomOp;
struct CustomOp {
  uint32_t version;
  void *(*CreateKernel)(const CustomOp *, const void *api, const void *info);
  const char *(*GetName)(const CustomOp *);
  const char *(*GetExecutionProviderType)(const CustomOp *);
  int (*GetInputType)(const CustomOp *, size_t);
  size_t (*GetInputTypeCount)(const CustomOp *);
  int (*GetOutputType)(const CustomOp *, size_t);
  size_t (*GetOutputTypeCount)(const CustomOp *);
  void (*KernelCompute)(void *kernel, void *context);
  void (*KernelDestroy)(void *kernel);
  int (*GetInputCharacteristic)(const CustomOp *, size_t);
  int (*GetOutputCharacteristic)(const CustomOp *, size_t);
  int (*GetInputMemoryType)(const CustomOp *, size_t);
  int (*GetVariadicInputMinArity)(const CustomOp *);
  int (*GetVariadicInputHomogeneity)(const CustomOp *);
  int (*GetVariadicOutputMinArity)(const CustomOp *);
  int (*GetVariadicOutputHomogeneity)(const CustomOp *);
  Status *(*CreateKernelV2)(const CustomOp *, const void *api, const void *info, void **kernel);
  Status *(*KernelComputeV2)(void *kernel, void *context);
  void *rest[7]; /* shape inference, op versions, in-place and alias maps: unused */
};

#define CALL(api, slot, type) ((type)(api)[slot])
typedef Status *(*CreateStatusFn)(int code, const char *msg);

static Status *fail(Api api, int code, const char *msg) { return CALL(api, CREATE_STATUS, CreateStatusFn)(code, msg); }

/* ---- the kernel -------------------------------------------------------------------------------------- */

#include "stream_kernels.h"

static Variant variant;

/* which variant the kernel runs in this process (for rlxrt's Python side, through ctypes) */
EXPORT const char *rlxrt_stream_matmul_isa(void) { return (variant.panels ? variant : choose_variant()).name; }

#define PANELS_PER_TASK 4
typedef struct { const float *a, *w; const uint8_t *codes; const float *scales; float *y; int64_t M, K, N, P; } Job;

static void task(void *data, size_t i) {
  const Job *j = data;
  int64_t first = (int64_t)i * PANELS_PER_TASK, last = first + PANELS_PER_TASK;
  variant.panels(j->a, j->w, j->codes, j->scales, j->y, j->M, j->K, j->N, first, last < j->P ? last : j->P);
}

/* ---- the custom op ----------------------------------------------------------------------------------- */

typedef struct { Api api; int64_t n; int q4; } Kernel;

typedef Status *(*GetInputFn)(const void *, size_t, const void **);
typedef Status *(*GetOutputFn)(void *, size_t, const int64_t *, size_t, void **);
typedef Status *(*TypeShapeFn)(const void *, void **);
typedef Status *(*ElementTypeFn)(const void *, int *);
typedef Status *(*DimCountFn)(const void *, size_t *);
typedef Status *(*DimsFn)(const void *, int64_t *, size_t);
typedef void (*ReleaseFn)(void *);
typedef Status *(*DataFn)(const void *, void **);
typedef Status *(*AttrIntFn)(const void *, const char *, int64_t *);
typedef Status *(*ParallelForFn)(const void *, void (*)(void *, size_t), size_t, size_t, void *);

/* the element type and shape (at most 8 dims) of a tensor value */
static Status *shape_of(Api api, const void *value, int *type, int64_t *dims, size_t *rank) {
  void *info = NULL;
  Status *s = CALL(api, GET_TENSOR_TYPE_AND_SHAPE, TypeShapeFn)(value, &info);
  if (!s) s = CALL(api, GET_TENSOR_ELEMENT_TYPE, ElementTypeFn)(info, type);
  if (!s) s = CALL(api, GET_DIMENSIONS_COUNT, DimCountFn)(info, rank);
  if (!s && *rank > 8) s = fail(api, ORT_INVALID_ARGUMENT, "StreamMatMul: an input has more than 8 dimensions");
  if (!s) s = CALL(api, GET_DIMENSIONS, DimsFn)(info, dims, *rank);
  if (info) CALL(api, RELEASE_TENSOR_TYPE_AND_SHAPE_INFO, ReleaseFn)(info);
  return s;
}

/* the inputs' data, checked against the op's layout: a [..., K] float, then float panels [P, K, 32] or int4
 * codes [P, K, 16] and scales [P, K / 32, 32] */
static Status *compute(void *kernel_data, void *context) {
  const Kernel *kernel = kernel_data;
  Api api = kernel->api;
  const void *in[3] = {NULL, NULL, NULL};
  int64_t dims[3][8];
  size_t rank[3] = {0, 0, 0};
  int type[3] = {0, 0, 0};
  Status *s = NULL;
  for (size_t i = 0; i < (kernel->q4 ? 3u : 2u) && !s; i++) {
    s = CALL(api, KERNEL_CONTEXT_GET_INPUT, GetInputFn)(context, i, &in[i]);
    if (!s) s = shape_of(api, in[i], &type[i], dims[i], &rank[i]);
  }
  if (s) return s;
  const int64_t *w = dims[1], *a_dims = dims[0];
  size_t a_rank = rank[0];
  int64_t N = kernel->n, K = rank[1] == 3 ? w[1] : -1, P = rank[1] == 3 ? w[0] : -1;
  if (type[0] != FLOAT || type[1] != (kernel->q4 ? UINT8 : FLOAT) || (kernel->q4 && type[2] != FLOAT))
    return fail(api, ORT_INVALID_ARGUMENT, kernel->q4 ? "StreamMatMulQ4: inputs must be float32, uint8, float32"
                                                      : "StreamMatMul: both inputs must be float32");
  if (rank[1] != 3 || w[2] != (kernel->q4 ? 16 : PANEL) || P * PANEL < N || (P - 1) * PANEL >= N)
    return fail(api, ORT_INVALID_ARGUMENT, kernel->q4 ? "StreamMatMulQ4: codes must be [ceil(n/32), K, 16]"
                                                      : "StreamMatMul: the weight must be panels [ceil(n/32), K, 32]");
  if (kernel->q4 && (K % 32 || rank[2] != 3 || dims[2][0] != P || dims[2][1] != K / 32 || dims[2][2] != PANEL))
    return fail(api, ORT_INVALID_ARGUMENT, "StreamMatMulQ4: K must be a multiple of 32 and scales [P, K/32, 32]");
  if (a_rank < 1 || a_dims[a_rank - 1] != K)
    return fail(api, ORT_INVALID_ARGUMENT, "StreamMatMul: the input's last dimension must equal the weight's K");
  int64_t M = 1, y_dims[8];
  for (size_t i = 0; i + 1 < a_rank; i++) { M *= a_dims[i]; y_dims[i] = a_dims[i]; }
  y_dims[a_rank - 1] = N;
  void *y_value = NULL, *data[3] = {NULL, NULL, NULL}, *y = NULL;
  s = CALL(api, KERNEL_CONTEXT_GET_OUTPUT, GetOutputFn)(context, 0, y_dims, a_rank, &y_value);
  for (size_t i = 0; i < (kernel->q4 ? 3u : 2u) && !s; i++)
    s = CALL(api, GET_TENSOR_MUTABLE_DATA, DataFn)(in[i], &data[i]);
  if (!s) s = CALL(api, GET_TENSOR_MUTABLE_DATA, DataFn)(y_value, &y);
  if (s || M == 0 || N == 0) return s;
  Job job = {data[0], kernel->q4 ? NULL : data[1], kernel->q4 ? data[1] : NULL, data[2], y, M, K, N, P};
  size_t tasks = (size_t)((P + PANELS_PER_TASK - 1) / PANELS_PER_TASK);
  return CALL(api, KERNEL_CONTEXT_PARALLEL_FOR, ParallelForFn)(context, task, tasks, 0, &job);
}

static Status *create(const CustomOp *op, const void *api, const void *info, void **out) {
  Kernel *kernel = malloc(sizeof *kernel);
  if (!kernel) return fail(api, ORT_FAIL, "StreamMatMul: out of memory");
  kernel->api = api;
  kernel->q4 = op->GetInputTypeCount(op) == 3;
  Status *s = CALL((Api)api, KERNEL_INFO_GET_ATTRIBUTE_INT64, AttrIntFn)(info, "n", &kernel->n);
  if (!s && kernel->n < 0) s = fail(api, ORT_INVALID_ARGUMENT, "StreamMatMul: attribute n must be >= 0");
  if (s) { free(kernel); return s; }
  *out = kernel;
  return NULL;
}

static void destroy(void *kernel) { free(kernel); }
static const char *name(const CustomOp *op) { (void)op; return "StreamMatMul"; }
static const char *name_q4(const CustomOp *op) { (void)op; return "StreamMatMulQ4"; }
static const char *provider(const CustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static int float_type(const CustomOp *op, size_t i) { (void)op; (void)i; return FLOAT; }
static int q4_type(const CustomOp *op, size_t i) { (void)op; return i == 1 ? UINT8 : FLOAT; }
static size_t two(const CustomOp *op) { (void)op; return 2; }
static size_t three(const CustomOp *op) { (void)op; return 3; }
static size_t one(const CustomOp *op) { (void)op; return 1; }
static int zero(const CustomOp *op, size_t i) { (void)op; (void)i; return 0; } /* required; default memory */

/* x @ float32 panels, and x @ int4 codes with their scales */
static CustomOp ops[2] = {
  {.version = 16, .GetName = name, .GetExecutionProviderType = provider, .GetInputType = float_type,
   .GetInputTypeCount = two, .GetOutputType = float_type, .GetOutputTypeCount = one, .KernelDestroy = destroy,
   .GetInputCharacteristic = zero, .GetOutputCharacteristic = zero, .GetInputMemoryType = zero,
   .CreateKernelV2 = create, .KernelComputeV2 = compute},
  {.version = 16, .GetName = name_q4, .GetExecutionProviderType = provider, .GetInputType = q4_type,
   .GetInputTypeCount = three, .GetOutputType = float_type, .GetOutputTypeCount = one, .KernelDestroy = destroy,
   .GetInputCharacteristic = zero, .GetOutputCharacteristic = zero, .GetInputMemoryType = zero,
   .CreateKernelV2 = create, .KernelComputeV2 = compute},
};

static const void *stream_matmul_api; /* the OrtApi table, set before the domain is made */
typedef Status *(*CreateDomainFn)(const char *, void **);
typedef Status *(*DomainAddFn)(void *, const CustomOp *);
typedef Status *(*AddDomainFn)(void *, void *);

static void *domain;    /* one domain for the process: every session's options point at it */
static const char *domain_error;

static void make_domain(void) {
  Api api = (Api)stream_matmul_api;
  variant = choose_variant();
  if (CALL(api, CREATE_CUSTOM_OP_DOMAIN, CreateDomainFn)("ai.rlxrt", &domain) ||
      CALL(api, CUSTOM_OP_DOMAIN_ADD, DomainAddFn)(domain, &ops[0]) ||
      CALL(api, CUSTOM_OP_DOMAIN_ADD, DomainAddFn)(domain, &ops[1]))
    domain_error = "rlxrt's StreamMatMul: onnxruntime refused its custom-op domain";
}

EXPORT Status *RegisterCustomOps(void *options, const ApiBase *base) {
  Api api = base->GetApi(API_VERSION);
  if (!api) return fail(base->GetApi(1), ORT_FAIL, "rlxrt's StreamMatMul needs onnxruntime 1.17 or newer");
  stream_matmul_api = api;
#if defined(_WIN32)
  if (!domain && !domain_error) make_domain();
#else
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, make_domain);
#endif
  if (domain_error) return fail(api, ORT_FAIL, domain_error);
  return CALL(api, ADD_CUSTOM_OP_DOMAIN, AddDomainFn)(options, domain);
}
