/* StreamScan: the gated state of an MTP head over several sequences in one call (included by stream_matmul.c
 * after stream_batch.h).
 *
 * Inputs: log a and b of T rows [1, T, R], the state before each sequence [N, R] and sequences [N, 3] int32 as
 * StreamAttentionBatch takes them (only the counts are read: the rows of sequence n follow those of n - 1).
 * Output: the state after each row [1, T, R], s_t = exp(log a_t) * s_{t-1} + b_t from the sequence's own start
 * state, one row after the other: a row's state is bitwise the same whatever the other sequences of the call.
 */
static Status *scan_compute(void *kernel_data, void *context) {
  const AttKernel *kernel = kernel_data;
  Api api = kernel->api;
  const void *in[4] = {NULL};
  int64_t dims[4][8];
  size_t rank[4] = {0};
  int type[4] = {0};
  Status *s = op_inputs(api, context, 4, in, type, dims, rank);
  if (s) return s;
  int64_t T = rank[0] == 3 ? dims[0][1] : -1, R = rank[0] == 3 ? dims[0][2] : -1, N = rank[3] == 2 ? dims[3][0] : -1;
  int ok = rank[0] == 3 && dims[0][0] == 1 && rank[1] == 3 && dims[1][0] == 1 && dims[1][1] == T && dims[1][2] == R &&
           rank[2] == 2 && dims[2][0] == N && dims[2][1] == R && rank[3] == 2 && dims[3][1] == 3 && N >= 1 &&
           type[0] == FLOAT && type[1] == FLOAT && type[2] == FLOAT && type[3] == INT32;
  if (!ok) return fail(api, ORT_INVALID_ARGUMENT, "StreamScan: the inputs are log a and b [1, T, R], states [N, R] "
                                                  "and sequences [N, 3]");
  void *data[4] = {NULL};
  if ((s = op_data(api, 4, in, data))) return s;
  const int32_t *seq = data[3];
  int64_t total = 0;
  for (int64_t n = 0; n < N && ok; n++) {
    ok = seq[3 * n + 2] >= 1;
    total += seq[3 * n + 2];
  }
  if (!ok || total != T) return fail(api, ORT_INVALID_ARGUMENT, "StreamScan: the sequences' counts must add up to the rows");
  int64_t out_dims[3] = {1, T, R};
  void *value = NULL, *out = NULL;
  s = CALL(api, KERNEL_CONTEXT_GET_OUTPUT, GetOutputFn)(context, 0, out_dims, 3, &value);
  if (!s) s = CALL(api, GET_TENSOR_MUTABLE_DATA, DataFn)(value, &out);
  if (s) return s;
  const float *log_a = data[0], *b = data[1], *start = data[2];
  float *y = out;
  for (int64_t n = 0, t = 0; n < N; n++) {
    const float *prev = start + n * R;
    for (int64_t i = 0; i < seq[3 * n + 2]; i++, t++) {
      for (int64_t r = 0; r < R; r++) y[t * R + r] = expf(log_a[t * R + r]) * prev[r] + b[t * R + r];
      prev = y + t * R;
    }
  }
  return NULL;
}

static Status *scan_create(const CustomOp *op, const void *api, const void *info, void **out) {
  (void)op;
  (void)info;
  AttKernel *kernel = malloc(sizeof *kernel);
  if (!kernel) return fail(api, ORT_FAIL, "StreamScan: out of memory");
  kernel->api = api;
  *out = kernel;
  return NULL;
}

static const char *scan_name(const CustomOp *op) { (void)op; return "StreamScan"; }
static int scan_input_type(const CustomOp *op, size_t i) { (void)op; return i == 3 ? INT32 : FLOAT; }
static size_t four(const CustomOp *op) { (void)op; return 4; }
