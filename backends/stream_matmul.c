/* StreamMatMul: y[M, N] = a[M, K] @ w[K, N] for ONNX Runtime on CPU, the weight read once per call for all
 * rows (see cpu_matmul.py for why and when rlxrt uses it).
 *
 * The weight arrives packed as column panels, w_panels[P, K, 32] with P = ceil(N / 32) (zero-padded), so a
 * panel is 32 * K floats read front to back. For each panel, rows go through in chunks of up to 6: a chunk
 * keeps 2 x 16-float accumulators per row and adds a[r, k] * w[k, 32 columns] for k = 0 .. K-1 in order.
 * Every row is computed by that same sequence whatever the chunk it falls in, so a row's output is bitwise
 * the same alone or among others. Panels are shared out over ONNX Runtime's intra-op threads.
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

enum { FLOAT = 1, ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2, API_VERSION = 17 };
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

#define PANEL 32
#define CHUNK 6

/* One variant per vector width V (floats): each handles a panel as strips of 2V columns, a chunk of up to 6
 * rows at a time with 2 accumulators a row: 12 accumulators, 2 weight vectors and a broadcast fit the 16
 * registers of AVX2 and SSE. */
#define VARIANT(NAME, V, TARGET)                                                                             \
  typedef float NAME##_vec __attribute__((vector_size(V * 4)));                                              \
  TARGET static inline __attribute__((always_inline)) NAME##_vec NAME##_load(const float *p) {               \
    NAME##_vec v;                                                                                            \
    memcpy(&v, p, sizeof v);                                                                                 \
    return v;                                                                                                \
  }                                                                                                          \
  /* rows r < R of a (row stride K) times the strip w [K, 2V] (row stride PANEL) into y (row stride ldy) */  \
  TARGET static inline __attribute__((always_inline)) void NAME##_rows(                                      \
      int R, const float *a, const float *w, int64_t K, float *y, int64_t ldy) {                             \
    NAME##_vec lo[CHUNK], hi[CHUNK];                                                                         \
    for (int r = 0; r < R; r++) lo[r] = hi[r] = (NAME##_vec){0};                                             \
    for (int64_t k = 0; k < K; k++) {                                                                        \
      NAME##_vec w0 = NAME##_load(w + PANEL * k), w1 = NAME##_load(w + PANEL * k + V);                       \
      for (int r = 0; r < R; r++) {                                                                          \
        float x = a[r * K + k];                                                                              \
        lo[r] += x * w0;                                                                                     \
        hi[r] += x * w1;                                                                                     \
      }                                                                                                      \
    }                                                                                                        \
    for (int r = 0; r < R; r++) {                                                                            \
      memcpy(y + r * ldy, &lo[r], sizeof lo[r]);                                                             \
      memcpy(y + r * ldy + V, &hi[r], sizeof hi[r]);                                                         \
    }                                                                                                        \
  }                                                                                                          \
  /* panels [first, last) of y = a @ w for all M rows */                                                     \
  TARGET static void NAME##_panels(const float *a, const float *w, float *y, int64_t M, int64_t K,           \
                                   int64_t N, int64_t first, int64_t last) {                                 \
    float tail[CHUNK * PANEL];                                                                               \
    for (int64_t p = first; p < last; p++) {                                                                 \
      int64_t col = p * PANEL, width = N - col < PANEL ? N - col : PANEL;                                    \
      for (int64_t m = 0; m < M; m += CHUNK) {                                                               \
        int64_t rows = M - m < CHUNK ? M - m : CHUNK;                                                        \
        float *out = width == PANEL ? y + m * N + col : tail;                                                \
        int64_t ldy = width == PANEL ? N : PANEL;                                                            \
        for (int strip = 0; strip < PANEL; strip += 2 * V) {                                                 \
          const float *am = a + m * K, *ws = w + p * K * PANEL + strip;                                      \
          switch (rows) { /* constant row counts: the accumulators stay in registers */                      \
            case 1: NAME##_rows(1, am, ws, K, out + strip, ldy); break;                                      \
            case 2: NAME##_rows(2, am, ws, K, out + strip, ldy); break;                                      \
            case 3: NAME##_rows(3, am, ws, K, out + strip, ldy); break;                                      \
            case 4: NAME##_rows(4, am, ws, K, out + strip, ldy); break;                                      \
            case 5: NAME##_rows(5, am, ws, K, out + strip, ldy); break;                                      \
            default: NAME##_rows(6, am, ws, K, out + strip, ldy); break;                                     \
          }                                                                                                  \
        }                                                                                                    \
        if (width < PANEL)                                                                                   \
          for (int64_t r = 0; r < rows; r++)                                                                 \
            memcpy(y + (m + r) * N + col, tail + r * PANEL, width * sizeof(float));                          \
      }                                                                                                      \
    }                                                                                                        \
  }

typedef void (*PanelsFn)(const float *, const float *, float *, int64_t, int64_t, int64_t, int64_t, int64_t);

VARIANT(generic, 4, )
#if defined(__x86_64__) && defined(__GNUC__)
VARIANT(avx2, 8, __attribute__((target("avx2,fma"))))
VARIANT(avx512, 16, __attribute__((target("avx512f,fma"))))
#endif

/* the widest variant this CPU runs, or the one RLXRT_STREAM_MATMUL_ISA names (generic, avx2, avx512: the
 * tests run each variant this CPU can) */
static PanelsFn choose_panels(void) {
  const char *isa = getenv("RLXRT_STREAM_MATMUL_ISA");
  if (isa && !strcmp(isa, "generic")) return generic_panels;
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (isa && !strcmp(isa, "avx2")) return avx2_panels;
  if (__builtin_cpu_supports("avx512f")) return avx512_panels;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return avx2_panels;
#endif
  return generic_panels;
}

static PanelsFn panels;

/* which variant the kernel runs in this process (for rlxrt's Python side, through ctypes) */
EXPORT const char *rlxrt_stream_matmul_isa(void) {
  PanelsFn chosen = panels ? panels : choose_panels();
#if defined(__x86_64__) && defined(__GNUC__)
  if (chosen == avx512_panels) return "avx512";
  if (chosen == avx2_panels) return "avx2";
#endif
  return chosen == generic_panels ? "generic" : "unknown";
}

#define PANELS_PER_TASK 4
typedef struct { const float *a, *w; float *y; int64_t M, K, N, P; } Job;

static void task(void *data, size_t i) {
  const Job *j = data;
  int64_t first = (int64_t)i * PANELS_PER_TASK, last = first + PANELS_PER_TASK;
  panels(j->a, j->w, j->y, j->M, j->K, j->N, first, last < j->P ? last : j->P);
}

/* ---- the custom op ----------------------------------------------------------------------------------- */

typedef struct { Api api; int64_t n; } Kernel;

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

static Status *compute(void *kernel_data, void *context) {
  const Kernel *kernel = kernel_data;
  Api api = kernel->api;
  const void *a_value = NULL, *w_value = NULL;
  int64_t a_dims[8], w_dims[8];
  size_t a_rank = 0, w_rank = 0;
  int a_type = 0, w_type = 0;
  Status *s = CALL(api, KERNEL_CONTEXT_GET_INPUT, GetInputFn)(context, 0, &a_value);
  if (!s) s = CALL(api, KERNEL_CONTEXT_GET_INPUT, GetInputFn)(context, 1, &w_value);
  if (!s) s = shape_of(api, a_value, &a_type, a_dims, &a_rank);
  if (!s) s = shape_of(api, w_value, &w_type, w_dims, &w_rank);
  if (s) return s;
  int64_t N = kernel->n, K = w_rank == 3 ? w_dims[1] : -1, P = w_rank == 3 ? w_dims[0] : -1;
  if (a_type != FLOAT || w_type != FLOAT)
    return fail(api, ORT_INVALID_ARGUMENT, "StreamMatMul: both inputs must be float32");
  if (w_rank != 3 || w_dims[2] != PANEL || P * PANEL < N || (P - 1) * PANEL >= N)
    return fail(api, ORT_INVALID_ARGUMENT, "StreamMatMul: the weight must be panels [ceil(n/32), K, 32]");
  if (a_rank < 1 || a_dims[a_rank - 1] != K)
    return fail(api, ORT_INVALID_ARGUMENT, "StreamMatMul: the input's last dimension must equal the weight's K");
  int64_t M = 1, y_dims[8];
  for (size_t i = 0; i + 1 < a_rank; i++) { M *= a_dims[i]; y_dims[i] = a_dims[i]; }
  y_dims[a_rank - 1] = N;
  void *y_value = NULL, *a = NULL, *w = NULL, *y = NULL;
  s = CALL(api, KERNEL_CONTEXT_GET_OUTPUT, GetOutputFn)(context, 0, y_dims, a_rank, &y_value);
  if (!s) s = CALL(api, GET_TENSOR_MUTABLE_DATA, DataFn)(a_value, &a);
  if (!s) s = CALL(api, GET_TENSOR_MUTABLE_DATA, DataFn)(w_value, &w);
  if (!s) s = CALL(api, GET_TENSOR_MUTABLE_DATA, DataFn)(y_value, &y);
  if (s || M == 0 || N == 0) return s;
  Job job = {a, w, y, M, K, N, P};
  size_t tasks = (size_t)((P + PANELS_PER_TASK - 1) / PANELS_PER_TASK);
  return CALL(api, KERNEL_CONTEXT_PARALLEL_FOR, ParallelForFn)(context, task, tasks, 0, &job);
}

static Status *create(const CustomOp *op, const void *api, const void *info, void **out) {
  (void)op;
  Kernel *kernel = malloc(sizeof *kernel);
  if (!kernel) return fail(api, ORT_FAIL, "StreamMatMul: out of memory");
  kernel->api = api;
  Status *s = CALL((Api)api, KERNEL_INFO_GET_ATTRIBUTE_INT64, AttrIntFn)(info, "n", &kernel->n);
  if (!s && kernel->n < 0) s = fail(api, ORT_INVALID_ARGUMENT, "StreamMatMul: attribute n must be >= 0");
  if (s) { free(kernel); return s; }
  *out = kernel;
  return NULL;
}

static void destroy(void *kernel) { free(kernel); }
static const char *name(const CustomOp *op) { (void)op; return "StreamMatMul"; }
static const char *provider(const CustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static int float_type(const CustomOp *op, size_t i) { (void)op; (void)i; return FLOAT; }
static size_t two(const CustomOp *op) { (void)op; return 2; }
static size_t one(const CustomOp *op) { (void)op; return 1; }
static int zero(const CustomOp *op, size_t i) { (void)op; (void)i; return 0; } /* required; default memory */

static CustomOp stream_matmul = {
  .version = 16, .GetName = name, .GetExecutionProviderType = provider, .GetInputType = float_type,
  .GetInputTypeCount = two, .GetOutputType = float_type, .GetOutputTypeCount = one, .KernelDestroy = destroy,
  .GetInputCharacteristic = zero, .GetOutputCharacteristic = zero, .GetInputMemoryType = zero,
  .CreateKernelV2 = create, .KernelComputeV2 = compute,
};

static const void *stream_matmul_api; /* the OrtApi table, set before the domain is made */
typedef Status *(*CreateDomainFn)(const char *, void **);
typedef Status *(*DomainAddFn)(void *, const CustomOp *);
typedef Status *(*AddDomainFn)(void *, void *);

static void *domain;    /* one domain for the process: every session's options point at it */
static const char *domain_error;

static void make_domain(void) {
  Api api = (Api)stream_matmul_api;
  panels = choose_panels();
  if (CALL(api, CREATE_CUSTOM_OP_DOMAIN, CreateDomainFn)("ai.rlxrt", &domain) ||
      CALL(api, CUSTOM_OP_DOMAIN_ADD, DomainAddFn)(domain, &stream_matmul))
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
