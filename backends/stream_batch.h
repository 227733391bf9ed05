/* StreamAttentionBatch: StreamAttention over several sequences in one call, each in a slot of its own of the KV
 * buffers (included by stream_matmul.c after stream_attention.h).
 *
 * Inputs: the packed q|k|v of T new tokens [1, T, (H + 2 KV) D] (or q [1, T, H D] with k and v [1, T, KV D]),
 * the KV buffers [B, KV, cap, D] (bound as both past and present), sequences [N, 3] int32 and the rotary tables.
 * Row n of sequences is (slot, first position, count): the next `count` tokens of the call belong to the sequence
 * in slot `slot`, at positions first .. first + count - 1. Each sequence is computed exactly as StreamAttention
 * computes a call of its tokens alone over its slot, so a token's output is bitwise the same whatever the other
 * sequences of the call: a batch is T rows to every other op of the graph, which computes a row the same among
 * any others. A slot appears at most once a call.
 */
typedef struct { const Attention *tasks; const int64_t *starts; int failed; } BatchJob;

/* task i: sequence n where starts[n] <= i < starts[n + 1], then its kv group and pass (att_passes) */
static void batch_task(void *data, size_t i) {
  BatchJob *job = data;
  int64_t n = 0;
  while (job->starts[n + 1] <= (int64_t)i) n++;
  const Attention *t = &job->tasks[n];
  int64_t passes = att_passes(t), local = (int64_t)i - job->starts[n];
  float *scores = scratch(&scores_scratch, ATT_ROWS * ((size_t)t->cap + ATT_LANES));
  if (scores) attention_head(t, local / passes, local % passes, scores);
  else __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED);
}

/* whether sequences [N, 3] fit T tokens, B slots of cap positions and the rotary tables, no slot twice */
static int sequences_ok(const int32_t *seq, int64_t N, int64_t T, int64_t B, int64_t cap, int64_t table) {
  int64_t total = 0;
  for (int64_t n = 0; n < N; n++) {
    int64_t slot = seq[3 * n], first = seq[3 * n + 1], count = seq[3 * n + 2];
    if (slot < 0 || slot >= B || first < 0 || count < 1 || first + count > cap || first + count > table) return 0;
    for (int64_t m = 0; m < n; m++)
      if (seq[3 * m] == slot) return 0;
    total += count;
  }
  return total == T;
}

#define BATCH_STACK 64 /* sequences a call describes without allocating */

static Status *batch_compute(void *kernel_data, void *context) {
  const AttKernel *kernel = kernel_data;
  Api api = kernel->api;
  const void *in[8] = {NULL};
  int64_t dims[8][8];
  size_t rank[8] = {0};
  int type[8] = {0};
  Status *s = op_inputs(api, context, 8, in, type, dims, rank);
  if (s) return s;
  int packed = !in[1] && !in[2];
  int64_t H = kernel->heads, KV = kernel->kv_heads, T = rank[0] == 3 ? dims[0][1] : -1;
  int64_t B = rank[3] == 4 ? dims[3][0] : -1, D = rank[3] == 4 ? dims[3][3] : -1, cap = rank[3] == 4 ? dims[3][2] : -1;
  int64_t width = packed ? (H + 2 * KV) * D : H * D, N = rank[5] == 2 ? dims[5][0] : -1;
  int ok = rank[0] == 3 && dims[0][0] == 1 && dims[0][2] == width && type[0] == FLOAT && (packed || (in[1] && in[2]));
  for (int i = 1; i <= 2 && ok && !packed; i++)
    ok = rank[i] == 3 && dims[i][0] == 1 && dims[i][1] == T && dims[i][2] == KV * D && type[i] == FLOAT;
  for (int i = 3; i <= 4 && ok; i++)
    ok = rank[i] == 4 && dims[i][0] == B && dims[i][1] == KV && dims[i][2] == cap && dims[i][3] == D && type[i] == FLOAT;
  ok = ok && D % ATT_LANES == 0 && D <= 256 && H % KV == 0 && type[5] == INT32 && N >= 1 && dims[5][1] == 3 &&
       type[6] == FLOAT && rank[6] == 2 && dims[6][1] == D / 2 && type[7] == FLOAT && rank[7] == 2 &&
       dims[7][0] == dims[6][0];
  if (!ok) return fail(api, ORT_INVALID_ARGUMENT, "StreamAttentionBatch: the inputs are not q|k|v [1, T, W], KV "
                                                  "buffers [B, KV, cap, D], sequences [N, 3] and the rotary tables");
  void *data[8] = {NULL};
  if ((s = op_data(api, 8, in, data))) return s;
  const int32_t *seq = data[5];
  if (!sequences_ok(seq, N, T, B, cap, dims[6][0]))
    return fail(api, ORT_INVALID_ARGUMENT, "StreamAttentionBatch: sequences must cover the call's tokens, each in "
                                           "a slot of its own, inside the KV buffer");
  void *out = NULL, *pk = NULL, *pv = NULL;
  s = att_outputs(api, context, T, H * D, dims[3], data[3], data[4], (size_t)(B * KV * cap * D) * sizeof(float), &out,
                  &pk, &pv);
  if (s) return s;
  const float *x = data[0], *cos_cache = data[6], *sin_cache = data[7];
  float *queries = scratch(&queries_scratch, (size_t)(T * H * D));
  Attention stack[BATCH_STACK], *tasks = N <= BATCH_STACK ? stack : malloc((size_t)N * sizeof(Attention));
  int64_t stack_starts[BATCH_STACK + 1];
  int64_t *starts = N <= BATCH_STACK ? stack_starts : malloc((size_t)(N + 1) * sizeof(int64_t));
  if (!queries || !tasks || !starts) {
    if (tasks && tasks != stack) free(tasks);
    if (starts && starts != stack_starts) free(starts);
    return fail(api, ORT_FAIL, "StreamAttentionBatch: out of memory");
  }
  starts[0] = 0;
  int64_t offset = 0;
  for (int64_t n = 0; n < N; n++) {
    int64_t slot = seq[3 * n], first = seq[3 * n + 1], S = seq[3 * n + 2];
    float *keys = (float *)pk + slot * KV * cap * D, *values = (float *)pv + slot * KV * cap * D;
    for (int64_t i = offset; i < offset + S; i++) { /* as attention_compute, over this sequence's slot */
      const float *row = x + i * width;
      const float *k = packed ? row + H * D : (const float *)data[1] + i * KV * D;
      const float *v = packed ? row + (H + KV) * D : (const float *)data[2] + i * KV * D;
      int64_t p = first + i - offset;
      for (int64_t g = 0; g < KV; g++) {
        put_key(k + g * D, cos_cache, sin_cache, p, D, cap, keys + g * cap * D);
        memcpy(values + (g * cap + p) * D, v + g * D, (size_t)D * sizeof(float));
      }
      for (int64_t h = 0; h < H; h++) rotate(row + h * D, cos_cache, sin_cache, p, D, queries + (i * H + h) * D);
    }
    tasks[n] = (Attention){queries + offset * H * D, keys, values, (float *)out + offset * H * D, S, H, KV, D, cap,
                           first, kernel->window, kernel->scale};
    starts[n + 1] = starts[n] + KV * att_passes(&tasks[n]);
    offset += S;
  }
  BatchJob job = {tasks, starts, 0};
  s = CALL(api, KERNEL_CONTEXT_PARALLEL_FOR, ParallelForFn)(context, batch_task, (size_t)starts[N], 0, &job);
  if (!s && job.failed) s = fail(api, ORT_FAIL, "StreamAttentionBatch: out of memory");
  if (tasks != stack) free(tasks);
  if (starts != stack_starts) free(starts);
  return s;
}

static const char *batch_name(const CustomOp *op) { (void)op; return "StreamAttentionBatch"; }
static int batch_input_type(const CustomOp *op, size_t i) { (void)op; return i == 5 ? INT32 : FLOAT; }
static size_t eight(const CustomOp *op) { (void)op; return 8; }
