/* StreamNorm, StreamSkipNorm and StreamSwiGLU: the row-wise ops between a fused graph's MatMuls (included by
 * stream_matmul.c after stream_attention.h, whose 16-lane vectors and exp they use).
 *
 *   StreamNorm(x, gamma) -> y:                 y = x / sqrt(mean(x^2) + epsilon) * gamma over the last axis
 *   StreamSkipNorm(x, skip, gamma) -> y, sum:  sum = x + skip, then y as above over sum
 *   StreamSwiGLU(gate, up) -> y:               y = gate * sigmoid(gate) * up
 *
 * ONNX Runtime's SimplifiedLayerNormalization, SkipSimplifiedLayerNormalization and the Sigmoid, Mul, Mul of a
 * SwiGLU cost 10-30 us a node on a batched step of 8 rows (its norm ~1 us a row of 576, and each node wakes the
 * intra-op threads); these run a few rows inline on the calling thread and share out many. Each row is
 * computed by the same code whatever the rows around it (a row's last columns, when its length is not a
 * multiple of 16, go through one zero-padded vector), so a row's output is bitwise the same alone or in a
 * batch.
 */
#define ROWS_PER_TASK_ELEMENTS 16384 /* elements a task of a shared-out call takes, in whole rows */
#define ROWS_INLINE_ELEMENTS 32768   /* calls up to this many elements run on the calling thread */

typedef void (*NormRowFn)(const float *x, const float *skip, const float *gamma, float *y, float *sum, int64_t K,
                          float epsilon);
typedef void (*SwigluRowFn)(const float *gate, const float *up, float *y, int64_t K);

/* n <= 16 floats from p as a vector padded with zeros, and back */
AI att_vec load_part(const float *p, int64_t n) {
  att_vec v = {0};
  if (n == ATT_LANES) memcpy(&v, p, sizeof v);
  else memcpy(&v, p, (size_t)n * sizeof(float));
  return v;
}
AI void store_part(float *p, att_vec v, int64_t n) {
  if (n == ATT_LANES) memcpy(p, &v, sizeof v);
  else memcpy(p, &v, (size_t)n * sizeof(float));
}

/* 1 / x: a division in the generic variant; with AVX-512 the 14-bit estimate and one Newton step (~1 ulp),
 * which takes a fraction of a division's time */
AI att_vec generic_recip(att_vec x) { return 1.0f / x; }
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
__attribute__((target("avx512f,fma"))) AI att_vec avx512_recip(att_vec x) {
  __m512 v, r;
  memcpy(&v, &x, sizeof v);
  r = _mm512_rcp14_ps(v);
  r = _mm512_fmadd_ps(r, _mm512_fnmadd_ps(v, r, _mm512_set1_ps(1.0f)), r); /* r + r (1 - v r) */
  memcpy(&x, &r, sizeof x);
  return x;
}
#endif

#define ROWS_VARIANT(NAME, TARGET, RECIP)                                                                    \
  /* one row: s = x (+ skip, written to sum), y = s * (1 / sqrt(sum of s^2 / K + epsilon)) * gamma */         \
  TARGET static void NAME##_norm_row(const float *x, const float *skip, const float *gamma, float *y,        \
                                     float *sum, int64_t K, float epsilon) {                                 \
    att_vec squares = {0};                                                                                   \
    for (int64_t k = 0; k < K; k += ATT_LANES) {                                                             \
      int64_t n = K - k < ATT_LANES ? K - k : ATT_LANES;                                                     \
      att_vec a = load_part(x + k, n);                                                                       \
      if (skip) {                                                                                            \
        a += load_part(skip + k, n);                                                                         \
        store_part(sum + k, a, n);                                                                           \
      }                                                                                                      \
      squares += a * a;                                                                                      \
    }                                                                                                        \
    float inv = 1.0f / sqrtf(tree_sum(squares) / (float)K + epsilon);                                        \
    const float *s = skip ? sum : x;                                                                         \
    for (int64_t k = 0; k < K; k += ATT_LANES) {                                                             \
      int64_t n = K - k < ATT_LANES ? K - k : ATT_LANES;                                                     \
      store_part(y + k, load_part(s + k, n) * inv * load_part(gamma + k, n), n);                             \
    }                                                                                                        \
  }                                                                                                          \
  /* one row of gate * sigmoid(gate) * up; sigmoid from e = exp(-|g|): 1 / (1 + e) for g >= 0, else e / (1 + e) */ \
  TARGET static void NAME##_swiglu_row(const float *gate, const float *up, float *y, int64_t K) {            \
    for (int64_t k = 0; k < K; k += ATT_LANES) {                                                             \
      int64_t n = K - k < ATT_LANES ? K - k : ATT_LANES;                                                     \
      att_vec g = load_part(gate + k, n), one = (att_vec){0} + 1.0f, magnitude, e, near, sig;                \
      att_ivec bits, negative = g < 0.0f, pick;                                                              \
      memcpy(&bits, &g, sizeof g);                                                                           \
      bits &= 0x7fffffff;                                                                                    \
      memcpy(&magnitude, &bits, sizeof bits);                                                                \
      e = NAME##_exp(-magnitude);                                                                            \
      near = RECIP(one + e);                                                                                 \
      att_vec far = e * near;                                                                                \
      att_ivec near_bits, far_bits;                                                                          \
      memcpy(&near_bits, &near, sizeof near);                                                                \
      memcpy(&far_bits, &far, sizeof far);                                                                   \
      pick = (far_bits & negative) | (near_bits & ~negative);                                                \
      memcpy(&sig, &pick, sizeof sig);                                                                       \
      store_part(y + k, g * sig * load_part(up + k, n), n);                                                  \
    }                                                                                                        \
  }

ROWS_VARIANT(att_generic, , generic_recip)
#if defined(__x86_64__) && defined(__GNUC__)
ROWS_VARIANT(att_avx512, AVX512, avx512_recip)
#endif

static NormRowFn norm_row;
static SwigluRowFn swiglu_row;

static void choose_rows(void) {
  norm_row = att_generic_norm_row;
  swiglu_row = att_generic_swiglu_row;
#if defined(__x86_64__) && defined(__GNUC__)
  if (attention_head == att_avx512_group) { /* the same choice as the attention's */
    norm_row = att_avx512_norm_row;
    swiglu_row = att_avx512_swiglu_row;
  }
#endif
}

enum { ROWS_NORM, ROWS_SKIP_NORM, ROWS_SWIGLU };
typedef struct { Api api; int kind; float epsilon; } RowsKernel;
typedef struct {
  int kind;
  const float *a, *b, *gamma;
  float *y, *sum;
  int64_t rows, K, per_task;
  float epsilon;
} RowsJob;

static void rows_run(const RowsJob *j, int64_t first, int64_t last) {
  for (int64_t r = first; r < last; r++) {
    int64_t at = r * j->K;
    if (j->kind == ROWS_SWIGLU) swiglu_row(j->a + at, j->b + at, j->y + at, j->K);
    else norm_row(j->a + at, j->b ? j->b + at : NULL, j->gamma, j->y + at, j->sum ? j->sum + at : NULL, j->K,
                  j->epsilon);
  }
}

static void rows_task(void *data, size_t i) {
  const RowsJob *j = data;
  int64_t first = (int64_t)i * j->per_task, last = first + j->per_task;
  rows_run(j, first, last < j->rows ? last : j->rows);
}

static const char *const ROWS_NAMES[] = {"StreamNorm", "StreamSkipNorm", "StreamSwiGLU"};

static Status *rows_compute(void *kernel_data, void *context) {
  const RowsKernel *kernel = kernel_data;
  Api api = kernel->api;
  size_t n_in = kernel->kind == ROWS_SKIP_NORM ? 3 : 2;
  const void *in[3] = {NULL};
  int64_t dims[3][8];
  size_t rank[3] = {0};
  int type[3] = {0};
  Status *s = op_inputs(api, context, n_in, in, type, dims, rank);
  if (s) return s;
  int ok = rank[0] >= 1 && type[0] == FLOAT && type[1] == FLOAT && (n_in < 3 || type[2] == FLOAT);
  int64_t K = ok ? dims[0][rank[0] - 1] : 0, rows = 1;
  for (size_t i = 0; ok && i + 1 < rank[0]; i++) rows *= dims[0][i];
  size_t same = kernel->kind == ROWS_NORM ? 0 : 1; /* the input shaped as x: skip, or up */
  if (ok && same) ok = rank[1] == rank[0];
  for (size_t i = 0; ok && same && i < rank[0]; i++) ok = dims[1][i] == dims[0][i];
  size_t g = n_in - 1; /* gamma, for the norms */
  if (ok && kernel->kind != ROWS_SWIGLU) ok = rank[g] == 1 && dims[g][0] == K && K > 0;
  if (!ok) {
    const char *why[] = {"StreamNorm: the inputs are not float32 x [..., K] and gamma [K]",
                         "StreamSkipNorm: the inputs are not float32 x [..., K], skip shaped as x and gamma [K]",
                         "StreamSwiGLU: the inputs are not float32 gate and up of one shape"};
    return fail(api, ORT_INVALID_ARGUMENT, why[kernel->kind]);
  }
  void *data[3] = {NULL}, *out[2] = {NULL, NULL}, *y = NULL, *sum = NULL;
  if ((s = op_data(api, n_in, in, data))) return s;
  s = CALL(api, KERNEL_CONTEXT_GET_OUTPUT, GetOutputFn)(context, 0, dims[0], rank[0], &out[0]);
  if (!s && kernel->kind == ROWS_SKIP_NORM)
    s = CALL(api, KERNEL_CONTEXT_GET_OUTPUT, GetOutputFn)(context, 1, dims[0], rank[0], &out[1]);
  if (!s) s = CALL(api, GET_TENSOR_MUTABLE_DATA, DataFn)(out[0], &y);
  if (!s && out[1]) s = CALL(api, GET_TENSOR_MUTABLE_DATA, DataFn)(out[1], &sum);
  if (s || rows == 0 || K == 0) return s;
  int64_t per_task = ROWS_PER_TASK_ELEMENTS / K > 0 ? ROWS_PER_TASK_ELEMENTS / K : 1;
  RowsJob job = {kernel->kind, data[0], kernel->kind == ROWS_NORM ? NULL : data[1],
                 kernel->kind == ROWS_SWIGLU ? NULL : data[g], y, sum, rows, K, per_task, kernel->epsilon};
  if (rows * K <= ROWS_INLINE_ELEMENTS) {
    rows_run(&job, 0, rows);
    return NULL;
  }
  size_t tasks = (size_t)((rows + per_task - 1) / per_task);
  return CALL(api, KERNEL_CONTEXT_PARALLEL_FOR, ParallelForFn)(context, rows_task, tasks, 0, &job);
}

static const CustomOp rows_ops[3];

static Status *rows_create(const CustomOp *op, const void *api, const void *info, void **out) {
  RowsKernel *kernel = malloc(sizeof *kernel);
  if (!kernel) return fail(api, ORT_FAIL, "StreamNorm: out of memory");
  kernel->api = api;
  kernel->kind = (int)(op - rows_ops);
  kernel->epsilon = 0.0f;
  Status *s = NULL;
  if (kernel->kind != ROWS_SWIGLU)
    s = CALL((Api)api, KERNEL_INFO_GET_ATTRIBUTE_FLOAT, AttrFloatFn)(info, "epsilon", &kernel->epsilon);
  if (!s && !(kernel->epsilon >= 0.0f)) s = fail(api, ORT_INVALID_ARGUMENT, "StreamNorm: epsilon must be >= 0");
  if (s) { free(kernel); return s; }
  *out = kernel;
  return NULL;
}

static const char *rows_name(const CustomOp *op) { return ROWS_NAMES[op - rows_ops]; }
static size_t rows_inputs(const CustomOp *op) { return op - rows_ops == ROWS_SKIP_NORM ? 3 : 2; }
static size_t rows_outputs(const CustomOp *op) { return op - rows_ops == ROWS_SKIP_NORM ? 2 : 1; }
