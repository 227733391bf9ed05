/* StreamMatMul and StreamMatMulQ4: y[M, N] = a[M, K] @ W[K, N] for ONNX Runtime on CPU, the weight (float32,
 * or int4 codes and their scales) read once per call for all rows, each row computed the same whatever the
 * others (stream_kernels.h; cpu_kernels.py says why and when rlxrt uses them). Panels of 32 columns are
 * shared out over ONNX Runtime's intra-op threads.
 *
 * The ONNX Runtime C ABI is declared here, only as far as this file uses it: OrtApi is a table of function
 * pointers that only ever grows, and each slot below is its index in that table (onnxruntime_c_api.h, ORT
 * 1.17+); OrtCustomOp's layout is the header's, at struct version 16 (errors returned from KernelComputeV2).
 */
#include <float.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
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

enum { FLOAT = 1, UINT8 = 2, INT32 = 6, ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2, API_VERSION = 17 };
enum { /* OrtApi slots */
  CREATE_STATUS = 0, CREATE_CUSTOM_OP_DOMAIN = 26, CUSTOM_OP_DOMAIN_ADD = 27, ADD_CUSTOM_OP_DOMAIN = 28,
  GET_TENSOR_MUTABLE_DATA = 51, GET_TENSOR_ELEMENT_TYPE = 60, GET_DIMENSIONS_COUNT = 61, GET_DIMENSIONS = 62,
  GET_TENSOR_TYPE_AND_SHAPE = 65, KERNEL_INFO_GET_ATTRIBUTE_FLOAT = 85, KERNEL_INFO_GET_ATTRIBUTE_INT64 = 86, KERNEL_CONTEXT_GET_INPUT = 90,
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

#include "stream_int8.h"

static Int8Variant int8;

/* the same for the int8-activation kernel (avx512vnni or generic) */
EXPORT const char *rlxrt_stream_matmul_int8_isa(void) { return (int8.panel ? int8 : choose_int8()).name; }

enum { FLOAT_PANELS, INT4_PANELS, INT8_ACTIVATIONS }; /* StreamMatMul, StreamMatMulQ4, StreamMatMulQx8 */
#define PANELS_PER_TASK 4
typedef struct {
  int kind, bits;
  const float *a, *w, *scales, *shift; /* shift: a StreamMatMulQ4 or Qx8 one's optional fourth input, or NULL */
  const uint8_t *codes;
  Quantised x;
  float *y;
  int64_t M, K, N, P;
} Job;

static void task(void *data, size_t i) {
  const Job *j = data;
  int64_t first = (int64_t)i * PANELS_PER_TASK, last = first + PANELS_PER_TASK;
  last = last < j->P ? last : j->P;
  if (j->kind != INT8_ACTIVATIONS) {
    variant.panels(j->a, j->w, j->codes, j->scales, j->y, j->M, j->K, j->N, first, last);
    for (int64_t p = first; j->shift && p < last; p++)
      variant.shift(j->x.xs, j->shift + p * (j->K / 32) * PANEL, j->M, j->K / 32, j->y + p * PANEL, j->N,
                    j->N - p * PANEL < PANEL ? j->N - p * PANEL : PANEL);
    return;
  }
  int64_t panel_bytes = j->K / 4 * 2 * (j->bits == 4 ? 32 : 64);
  for (int64_t p = first; p < last; p++) {
    int64_t width = j->N - p * PANEL < PANEL ? j->N - p * PANEL : PANEL;
    int8.panel(j->x, j->codes + p * panel_bytes, j->scales + p * (j->K / 32) * PANEL,
               j->shift ? j->shift + p * (j->K / 32) * PANEL : NULL, j->bits, j->M, j->K, j->y + p * PANEL, j->N, width);
  }
}

/* the activations of rows [16 i, 16 i + 16) quantised (each row on its own, so any split gives the same bits) */
#define QUANTISE_ROWS 16
static void quantise_task(void *data, size_t i) {
  const Job *j = data;
  int64_t first = (int64_t)i * QUANTISE_ROWS, rows = j->M - first < QUANTISE_ROWS ? j->M - first : QUANTISE_ROWS;
  int64_t blocks = first * (j->K / 32);
  int8.quantise(j->a + first * j->K, rows, j->K, (int8_t *)j->x.q + first * j->K, (float *)j->x.d + blocks,
                (int32_t *)j->x.sums + blocks, j->x.xs ? (float *)j->x.xs + blocks : NULL);
}

/* ---- the custom op ----------------------------------------------------------------------------------- */

typedef struct { Api api; int64_t n, bits; int kind; } Kernel;

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

#include "stream_attention.h"
#include "stream_batch.h"
#include "stream_scan.h"
#include "stream_rows.h"

static const char *const NAMES[] = {"StreamMatMul", "StreamMatMulQ4", "StreamMatMulQx8"};

/* whether the weights' shapes are what the op's layout says (dims of inputs 1 and 2, K from the weight) */
static int layout_ok(const Kernel *kernel, const int64_t (*dims)[8], const size_t *rank, int64_t *K, int64_t *P) {
  const int64_t *w = dims[1];
  int64_t N = kernel->n;
  if (kernel->kind == FLOAT_PANELS) {
    *P = w[0], *K = w[1];
    return rank[1] == 3 && w[2] == PANEL;
  }
  *P = w[0], *K = kernel->kind == INT4_PANELS ? w[1] : w[1] * 4;
  int codes_ok = kernel->kind == INT4_PANELS ? rank[1] == 3 && w[2] == 16
                                             : rank[1] == 4 && w[2] == 2 && w[3] == (kernel->bits == 4 ? 32 : 64);
  return codes_ok && *K % 32 == 0 && rank[2] == 3 && dims[2][0] == *P && dims[2][1] == *K / 32 &&
         dims[2][2] == PANEL && *P * PANEL >= N && (*P - 1) * PANEL < N;
}

/* y = a @ the weight: inputs checked against the op's layout (cpu_kernels.py writes them), the panels shared
 * out over ONNX Runtime's intra-op threads; int8 activations are quantised first, each row on its own */
static Status *compute(void *kernel_data, void *context) {
  const Kernel *kernel = kernel_data;
  Api api = kernel->api;
  size_t inputs = kernel->kind == FLOAT_PANELS ? 2 : 4, rank[4] = {0, 0, 0, 0};
  const void *in[4] = {NULL, NULL, NULL, NULL};
  int64_t dims[4][8], K = -1, P = -1;
  int type[4] = {0, 0, 0, 0};
  Status *s = NULL;
  for (size_t i = 0; i < inputs && !s; i++) {
    s = CALL(api, KERNEL_CONTEXT_GET_INPUT, GetInputFn)(context, i, &in[i]);
    if (!s && in[i]) s = shape_of(api, in[i], &type[i], dims[i], &rank[i]); /* input 3 (a shift) is optional */
  }
  if (s) return s;
  if (type[0] != FLOAT || type[1] != (kernel->kind == FLOAT_PANELS ? FLOAT : UINT8) || (inputs >= 3 && type[2] != FLOAT))
    return fail(api, ORT_INVALID_ARGUMENT, "StreamMatMul: the inputs' element types are not the op's");
  if (!layout_ok(kernel, (const int64_t (*)[8])dims, rank, &K, &P))
    return fail(api, ORT_INVALID_ARGUMENT, "StreamMatMul: the weight's shape is not the op's packed layout");
  if (in[3] && (type[3] != FLOAT || rank[3] != 3 || dims[3][0] != P || dims[3][1] != K / 32 || dims[3][2] != PANEL))
    return fail(api, ORT_INVALID_ARGUMENT, kernel->kind == INT4_PANELS ?
                "StreamMatMulQ4: the shift must be float32 [P, K / 32, 32], as the scales" :
                "StreamMatMulQx8: the shift must be float32 [P, K / 32, 32], as the scales");
  const int64_t *a_dims = dims[0];
  size_t a_rank = rank[0];
  /* a quantised weight's K is padded to whole blocks of 32 (its padding codes weigh 0): the input may be up to
   * 31 columns shorter, and is then read through a zero-padded copy */
  int64_t Ka = a_rank < 1 ? -1 : a_dims[a_rank - 1];
  if (Ka != K && (kernel->kind == FLOAT_PANELS || in[3] || Ka <= K - 32 || Ka > K))
    return fail(api, ORT_INVALID_ARGUMENT, "StreamMatMul: the input's last dimension must equal the weight's K");
  int64_t M = 1, N = kernel->n, y_dims[8];
  for (size_t i = 0; i + 1 < a_rank; i++) { M *= a_dims[i]; y_dims[i] = a_dims[i]; }
  y_dims[a_rank - 1] = N;
  void *y_value = NULL, *data[4] = {NULL, NULL, NULL, NULL}, *y = NULL;
  s = CALL(api, KERNEL_CONTEXT_GET_OUTPUT, GetOutputFn)(context, 0, y_dims, a_rank, &y_value);
  for (size_t i = 0; i < inputs && !s; i++)
    if (in[i]) s = CALL(api, GET_TENSOR_MUTABLE_DATA, DataFn)(in[i], &data[i]);
  if (!s) s = CALL(api, GET_TENSOR_MUTABLE_DATA, DataFn)(y_value, &y);
  if (s || M == 0 || N == 0) return s;
  Job job = {kernel->kind, (int)kernel->bits, data[0], kernel->kind == FLOAT_PANELS ? data[1] : NULL, data[2],
             data[3], kernel->kind == FLOAT_PANELS ? NULL : data[1], {NULL, NULL, NULL, NULL}, y, M, K, N, P};
  void *scratch = NULL, *padded = NULL;
  _Alignas(64) char small[32768], small_padded[16384]; /* a batched step's activations: no allocation */
  if (Ka != K) {
    size_t bytes = (size_t)(M * K) * sizeof(float);
    padded = bytes <= sizeof small_padded ? small_padded : malloc(bytes);
    if (!padded) return fail(api, ORT_FAIL, "StreamMatMul: out of memory");
    float *rows = padded;
    for (int64_t r = 0; r < M; r++) {
      memcpy(rows + r * K, job.a + r * Ka, (size_t)Ka * sizeof(float));
      memset(rows + r * K + Ka, 0, (size_t)(K - Ka) * sizeof(float));
    }
    job.a = rows;
  }
  if (kernel->kind == INT4_PANELS && in[3]) { /* the rows' block sums, for the shift */
    size_t bytes = (size_t)(M * K / 32) * sizeof(float);
    scratch = bytes <= sizeof small ? small : malloc(bytes);
    if (!scratch) {
      if (padded != small_padded) free(padded);
      return fail(api, ORT_FAIL, "StreamMatMul: out of memory");
    }
    float *xs = scratch;
    for (int64_t i = 0; i < M * (K / 32); i++) xs[i] = block_sum(job.a + i * 32);
    job.x.xs = xs;
  }
  if (kernel->kind == INT8_ACTIVATIONS) {
    size_t bytes = (size_t)(M * K) + (size_t)(M * K / 32) * 12;
    scratch = bytes <= sizeof small ? small : malloc(bytes);
    if (!scratch) {
      if (padded != small_padded) free(padded);
      return fail(api, ORT_FAIL, "StreamMatMul: out of memory");
    }
    float *d = (float *)((char *)scratch + M * K);
    int32_t *sums = (int32_t *)(d + M * K / 32);
    float *xs = in[3] ? (float *)(sums + M * K / 32) : NULL; /* block sums: only for a shift */
    job.x = (Quantised){scratch, d, sums, xs};
    size_t parts = (size_t)((M + QUANTISE_ROWS - 1) / QUANTISE_ROWS);
    if (parts > 1) s = CALL(api, KERNEL_CONTEXT_PARALLEL_FOR, ParallelForFn)(context, quantise_task, parts, 0, &job);
    else int8.quantise(job.a, M, K, (int8_t *)scratch, d, sums, xs);
  }
  size_t tasks = (size_t)((P + PANELS_PER_TASK - 1) / PANELS_PER_TASK);
  if (!s) s = CALL(api, KERNEL_CONTEXT_PARALLEL_FOR, ParallelForFn)(context, task, tasks, 0, &job);
  if (scratch && scratch != small) free(scratch);
  if (padded && padded != small_padded) free(padded);
  return s;
}

static const CustomOp ops[3];

static Status *create(const CustomOp *op, const void *api, const void *info, void **out) {
  Kernel *kernel = malloc(sizeof *kernel);
  if (!kernel) return fail(api, ORT_FAIL, "StreamMatMul: out of memory");
  kernel->api = api;
  kernel->kind = (int)(op - ops);
  kernel->bits = 4;
  Status *s = CALL((Api)api, KERNEL_INFO_GET_ATTRIBUTE_INT64, AttrIntFn)(info, "n", &kernel->n);
  if (!s && kernel->n < 0) s = fail(api, ORT_INVALID_ARGUMENT, "StreamMatMul: attribute n must be >= 0");
  if (!s && kernel->kind == INT8_ACTIVATIONS) {
    s = CALL((Api)api, KERNEL_INFO_GET_ATTRIBUTE_INT64, AttrIntFn)(info, "bits", &kernel->bits);
    if (!s && kernel->bits != 4 && kernel->bits != 8)
      s = fail(api, ORT_INVALID_ARGUMENT, "StreamMatMulQx8: attribute bits must be 4 or 8");
  }
  if (s) { free(kernel); return s; }
  *out = kernel;
  return NULL;
}

static void destroy(void *kernel) { free(kernel); }
static const char *name(const CustomOp *op) { return NAMES[op - ops]; }
static const char *provider(const CustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static int input_type(const CustomOp *op, size_t i) { return i == 1 && op != ops ? UINT8 : FLOAT; }
static int float_type(const CustomOp *op, size_t i) { (void)op; (void)i; return FLOAT; }
static size_t input_count(const CustomOp *op) { return op == ops ? 2 : 4; }
static int shift_optional(const CustomOp *op, size_t i) { return op != ops && i == 3 ? 1 : 0; } /* 1: optional */
static size_t one(const CustomOp *op) { (void)op; return 1; }
static int zero(const CustomOp *op, size_t i) { (void)op; (void)i; return 0; } /* required; default memory */

#define OP {.version = 16, .GetName = name, .GetExecutionProviderType = provider, .GetInputType = input_type,    \
            .GetInputTypeCount = input_count, .GetOutputType = float_type, .GetOutputTypeCount = one,           \
            .KernelDestroy = destroy, .GetInputCharacteristic = shift_optional, .GetOutputCharacteristic = zero,\
            .GetInputMemoryType = zero, .CreateKernelV2 = create, .KernelComputeV2 = compute}
/* x @ float32 panels; x @ int4 codes with their scales (and an optional shift); x as int8 @ 4- or 8-bit codes
 * with their scales (and an optional shift) */
static const CustomOp ops[3] = {OP, OP, OP};

static const CustomOp attention_op = {
  .version = 16, .GetName = attention_name, .GetExecutionProviderType = provider,
  .GetInputType = attention_input_type, .GetInputTypeCount = nine, .GetOutputType = float_type,
  .GetOutputTypeCount = three_out, .KernelDestroy = destroy, .GetInputCharacteristic = optional_kv,
  .GetOutputCharacteristic = zero, .GetInputMemoryType = zero, .CreateKernelV2 = attention_create,
  .KernelComputeV2 = attention_compute};

static const CustomOp batch_op = {
  .version = 16, .GetName = batch_name, .GetExecutionProviderType = provider,
  .GetInputType = batch_input_type, .GetInputTypeCount = eight, .GetOutputType = float_type,
  .GetOutputTypeCount = three_out, .KernelDestroy = destroy, .GetInputCharacteristic = optional_kv,
  .GetOutputCharacteristic = zero, .GetInputMemoryType = zero, .CreateKernelV2 = attention_create,
  .KernelComputeV2 = batch_compute};

static const CustomOp scan_op = {
  .version = 16, .GetName = scan_name, .GetExecutionProviderType = provider,
  .GetInputType = scan_input_type, .GetInputTypeCount = four, .GetOutputType = float_type,
  .GetOutputTypeCount = one, .KernelDestroy = destroy, .GetInputCharacteristic = zero,
  .GetOutputCharacteristic = zero, .GetInputMemoryType = zero, .CreateKernelV2 = scan_create,
  .KernelComputeV2 = scan_compute};

#define ROWS_OP {.version = 16, .GetName = rows_name, .GetExecutionProviderType = provider,                      \
                 .GetInputType = float_type, .GetInputTypeCount = rows_inputs, .GetOutputType = float_type,      \
                 .GetOutputTypeCount = rows_outputs, .KernelDestroy = destroy, .GetInputCharacteristic = zero,   \
                 .GetOutputCharacteristic = zero, .GetInputMemoryType = zero, .CreateKernelV2 = rows_create,     \
                 .KernelComputeV2 = rows_compute}
/* StreamNorm, StreamSkipNorm, StreamSwiGLU */
static const CustomOp rows_ops[3] = {ROWS_OP, ROWS_OP, ROWS_OP};

static const void *stream_matmul_api; /* the OrtApi table, set before the domain is made */
typedef Status *(*CreateDomainFn)(const char *, void **);
typedef Status *(*DomainAddFn)(void *, const CustomOp *);
typedef Status *(*AddDomainFn)(void *, void *);

static void *domain;    /* one domain for the process: every session's options point at it */
static const char *domain_error;

static void make_domain(void) {
  Api api = (Api)stream_matmul_api;
  variant = choose_variant();
  int8 = choose_int8();
  attention_head = choose_attention();
  choose_rows();
  if (CALL(api, CREATE_CUSTOM_OP_DOMAIN, CreateDomainFn)("ai.rlxrt", &domain) ||
      CALL(api, CUSTOM_OP_DOMAIN_ADD, DomainAddFn)(domain, &ops[0]) ||
      CALL(api, CUSTOM_OP_DOMAIN_ADD, DomainAddFn)(domain, &ops[1]) ||
      CALL(api, CUSTOM_OP_DOMAIN_ADD, DomainAddFn)(domain, &ops[2]) ||
      CALL(api, CUSTOM_OP_DOMAIN_ADD, DomainAddFn)(domain, &attention_op) ||
      CALL(api, CUSTOM_OP_DOMAIN_ADD, DomainAddFn)(domain, &batch_op) ||
      CALL(api, CUSTOM_OP_DOMAIN_ADD, DomainAddFn)(domain, &scan_op) ||
      CALL(api, CUSTOM_OP_DOMAIN_ADD, DomainAddFn)(domain, &rows_ops[0]) ||
      CALL(api, CUSTOM_OP_DOMAIN_ADD, DomainAddFn)(domain, &rows_ops[1]) ||
      CALL(api, CUSTOM_OP_DOMAIN_ADD, DomainAddFn)(domain, &rows_ops[2]))
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
