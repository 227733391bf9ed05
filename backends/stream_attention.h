/* StreamAttention: ONNX Runtime's GroupQueryAttention as rlxrt's fused graphs use it (rotary inside, one KV
 * buffer per tensor bound as both past and present, causal, an optional local window), computed so that a
 * query row's output is bitwise the same whatever the other rows of the call: ONNX Runtime's many-row path
 * differs from its one-row path by ~1e-7, which is all that kept a verification from equalling one-row steps
 * bit for bit once the MatMuls are rlxrt's.
 *
 * The keys are kept in blocks of 16 positions, each block dimension by dimension: key j's dimension d sits at
 * 16 D (j / 16) + w d + j % 16 of its kv head's cap x D floats, w = min(16, cap - 16 (j / 16)) (a last block of
 * a capacity that is not a multiple of 16 is narrower), so that 16 keys' d-th dimensions are one vector load;
 * the values are row by row, [cap, D]. ONNX Runtime's GroupQueryAttention keeps the keys row by row: a KV buffer
 * is read by the op that wrote it (cpu_kernels.keys_in_order gives a buffer's keys row by row).
 *
 * New token i of S sits at position p = seqlens_k + 1 - S + i. Its key (rotated) and value are written at p;
 * then for each query head h (kv head h / (H / KV)) and row i, over the keys j = lo .. p (lo = p - window + 1
 * with a window, else 0), in this order:
 *     s_j = scale * q_h . k_j    (16 keys a lane each, one multiply-add a dimension, in order: with AVX-512 a
 *                                fused one)
 *     m = max s_j,  e_j = exp(s_j - m),  z = sum e_j,  out = (sum e_j * v_j) / z
 * Rotary (rotate-half): x'[d] = x[d] cos - x[d + D/2] sin, x'[d + D/2] = x[d + D/2] cos + x[d] sin.
 */
#define ATT_LANES 16
typedef float att_vec __attribute__((vector_size(ATT_LANES * 4)));

typedef struct {
  const float *q;        /* rotated queries [S, H, D] */
  const float *keys, *values; /* the present buffers [KV, CAP, D], the keys in blocks (above) */
  float *out;            /* [S, H * D] */
  int64_t S, H, KV, D, cap, first, window;
  float scale;
} Attention;

/* exp(x) for x <= 0 (x - max of the scores), 16 lanes: x = n ln2 + r, |r| <= ln2 / 2, e^r by its Taylor
 * polynomial to r^7 (relative error < 2e-7), times 2^n through the exponent bits; below -87 it is 0 */
typedef int32_t att_ivec __attribute__((vector_size(ATT_LANES * 4)));

#define ATT_EXP(NAME, TARGET)                                                                                \
  TARGET AI att_vec NAME##_exp(att_vec x) {                                                                  \
    att_ivec keep = x >= -87.0f, bits, xb, floor_b;                                                          \
    att_vec floor = (att_vec){0} - 87.0f, lo, n, r, p, out;                                                  \
    memcpy(&xb, &x, sizeof x);                                                                               \
    memcpy(&floor_b, &floor, sizeof floor);                                                                  \
    xb = (xb & keep) | (floor_b & ~keep);                                                                    \
    memcpy(&lo, &xb, sizeof lo);                                                                             \
    n = (lo * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* nearest integer: 1.5 * 2^23 */           \
    r = lo - n * 0.693145751953125f - n * 1.428606765330187e-06f;                                            \
    p = (att_vec){0} + 1.0f / 5040.0f;                                                                       \
    p = p * r + 1.0f / 720.0f;                                                                               \
    p = p * r + 1.0f / 120.0f;                                                                               \
    p = p * r + 1.0f / 24.0f;                                                                                \
    p = p * r + 1.0f / 6.0f;                                                                                 \
    p = p * r + 0.5f;                                                                                        \
    p = p * r + 1.0f;                                                                                        \
    p = p * r + 1.0f;                                                                                        \
    bits = (__builtin_convertvector(n, att_ivec) + 127) << 23;                                               \
    memcpy(&out, &bits, sizeof out);                                                                         \
    out = p * out;                                                                                           \
    memcpy(&bits, &out, sizeof out);                                                                         \
    bits &= keep; /* below -87: 0 */                                                                         \
    memcpy(&out, &bits, sizeof out);                                                                         \
    return out;                                                                                              \
  }

/* Rows are (token i, head h) pairs of one kv group, taken 4 at a time: their raw scores over each row's own key
 * range go to scores[r] (SCORES: one dot product per row and key), then each row's softmax, then the weighted
 * values of all 4 rows in walks over the value rows (up to ATT_CHUNKS chunks of 16 lanes a walk). A row's sums
 * run over its keys in ascending order, one sum per 16 lanes, whatever rows and chunks share its walk. */
#define ATT_ROWS 4

/* Chunks of 16 value lanes one walk over the value rows carries for every row: its R * C sums stay in registers
 * (R * C <= 16), and each value row is read once a walk rather than once a chunk. */
#define ATT_CHUNKS 4

/* acc[s][c] += e_s[j] * v[j][16 c ..] for rows s < R and chunks c < C over keys j = from .. to (R and C
 * constants where inlined) */
#define ATT_PV(NAME, TARGET)                                                                                 \
  TARGET AI void NAME##_pv(int R, int C, const float *v, int64_t D, int64_t from, int64_t to, float *const *e, \
                           const int64_t *lo, att_vec (*acc)[ATT_CHUNKS]) {                                  \
    for (int64_t j = from; j <= to; j++)                                                                     \
      for (int c = 0; c < C; c++) {                                                                          \
        att_vec x;                                                                                           \
        memcpy(&x, v + j * D + c * ATT_LANES, sizeof x);                                                     \
        for (int s = 0; s < R; s++) acc[s][c] += e[s][j - lo[s]] * x;                                        \
      }                                                                                                      \
  }                                                                                                          \
  /* NAME##_pv with R and C made constants */                                                                \
  TARGET AI void NAME##_walk(int R, int C, const float *v, int64_t D, int64_t from, int64_t to,              \
                             float *const *e, const int64_t *lo, att_vec (*acc)[ATT_CHUNKS]) {               \
    switch (R * 8 + C) {                                                                                     \
      case 9: NAME##_pv(1, 1, v, D, from, to, e, lo, acc); break;                                            \
      case 10: NAME##_pv(1, 2, v, D, from, to, e, lo, acc); break;                                           \
      case 11: NAME##_pv(1, 3, v, D, from, to, e, lo, acc); break;                                           \
      case 12: NAME##_pv(1, 4, v, D, from, to, e, lo, acc); break;                                           \
      case 17: NAME##_pv(2, 1, v, D, from, to, e, lo, acc); break;                                           \
      case 18: NAME##_pv(2, 2, v, D, from, to, e, lo, acc); break;                                           \
      case 19: NAME##_pv(2, 3, v, D, from, to, e, lo, acc); break;                                           \
      case 20: NAME##_pv(2, 4, v, D, from, to, e, lo, acc); break;                                           \
      case 25: NAME##_pv(3, 1, v, D, from, to, e, lo, acc); break;                                           \
      case 26: NAME##_pv(3, 2, v, D, from, to, e, lo, acc); break;                                           \
      case 27: NAME##_pv(3, 3, v, D, from, to, e, lo, acc); break;                                           \
      case 28: NAME##_pv(3, 4, v, D, from, to, e, lo, acc); break;                                           \
      case 33: NAME##_pv(4, 1, v, D, from, to, e, lo, acc); break;                                           \
      case 34: NAME##_pv(4, 2, v, D, from, to, e, lo, acc); break;                                           \
      case 35: NAME##_pv(4, 3, v, D, from, to, e, lo, acc); break;                                           \
      default: NAME##_pv(4, 4, v, D, from, to, e, lo, acc); break;                                           \
    }                                                                                                        \
  }

#define ATT_VARIANT(NAME, TARGET, SCORES)                                                                    \
  ATT_EXP(NAME, TARGET)                                                                                      \
  ATT_PV(NAME, TARGET)                                                                                       \
  TARGET static void NAME##_group(const Attention *t, int64_t g, int64_t pass, float *scratch_rows) {        \
    int64_t G = t->H / t->KV, R = t->S * G, stride = t->cap + ATT_LANES;                                     \
    const float *keys = t->keys + g * t->cap * t->D, *values = t->values + g * t->cap * t->D;                \
    for (int64_t r0 = pass * ATT_ROWS; r0 < R && r0 < (pass + 1) * ATT_ROWS; r0 += ATT_ROWS) {                \
      int rows = (int)(R - r0 < ATT_ROWS ? R - r0 : ATT_ROWS);                                               \
      const float *q[ATT_ROWS] = {0};                                                                        \
      int64_t lo[ATT_ROWS] = {0}, hi[ATT_ROWS] = {0}, shared_lo = 0, shared_hi = INT64_MAX;                  \
      float *scores[ATT_ROWS], total[ATT_ROWS];                                                              \
      for (int s = 0; s < rows; s++) {                                                                       \
        int64_t i = (r0 + s) / G, h = g * G + (r0 + s) % G;                                                  \
        hi[s] = t->first + i;                                                                                \
        lo[s] = t->window > 0 && hi[s] - t->window + 1 > 0 ? hi[s] - t->window + 1 : 0;                      \
        q[s] = t->q + (i * t->H + h) * t->D;                                                                 \
        scores[s] = scratch_rows + s * stride;                                                               \
        shared_lo = lo[s] > shared_lo ? lo[s] : shared_lo;                                                   \
        shared_hi = hi[s] < shared_hi ? hi[s] : shared_hi;                                                   \
      }                                                                                                      \
      SCORES(t, keys, rows, q, lo, hi, scores);                                                              \
      for (int s = 0; s < rows; s++) { /* softmax numerators in place, and their sum */                      \
        int64_t n = hi[s] - lo[s] + 1, padded = (n + ATT_LANES - 1) / ATT_LANES * ATT_LANES;                 \
        float *sc = scores[s];                                                                               \
        for (int64_t j = n; j < padded; j++) sc[j] = -INFINITY; /* exp gives 0 */                            \
        att_vec top = (att_vec){0} - INFINITY, sum = {0};                                                    \
        for (int64_t j = 0; j < padded; j += ATT_LANES) {                                                    \
          att_vec x;                                                                                         \
          memcpy(&x, sc + j, sizeof x);                                                                      \
          top = lane_max(top, x);                                                                            \
        }                                                                                                    \
        att_vec m = (att_vec){0} + tree_max(top);                                                            \
        for (int64_t j = 0; j < padded; j += ATT_LANES) {                                                    \
          att_vec x;                                                                                         \
          memcpy(&x, sc + j, sizeof x);                                                                      \
          x = NAME##_exp(x - m);                                                                             \
          memcpy(sc + j, &x, sizeof x);                                                                      \
          sum += x;                                                                                          \
        }                                                                                                    \
        total[s] = tree_sum(sum);                                                                            \
      }                                                                                                      \
      int shared = shared_lo <= shared_hi; /* keys every row reads (none if windows keep them apart) */      \
      int C;                                                                                                 \
      for (int64_t c0 = 0; c0 < t->D; c0 += C * ATT_LANES) { /* up to ATT_CHUNKS chunks of the values a walk */\
        C = (t->D - c0) / ATT_LANES < ATT_CHUNKS ? (int)((t->D - c0) / ATT_LANES) : ATT_CHUNKS;              \
        att_vec acc[ATT_ROWS][ATT_CHUNKS];                                                                   \
        const float *v = values + c0;                                                                        \
        for (int s = 0; s < rows; s++) { /* a row's keys before the shared ones */                           \
          for (int c = 0; c < C; c++) acc[s][c] = (att_vec){0};                                              \
          NAME##_walk(1, C, v, t->D, lo[s], shared ? shared_lo - 1 : hi[s], &scores[s], &lo[s], &acc[s]);    \
        }                                                                                                    \
        if (shared) /* the shared keys, each value row loaded once for all rows */                           \
          NAME##_walk(rows, C, v, t->D, shared_lo, shared_hi, scores, lo, acc);                              \
        for (int s = 0; s < rows; s++) { /* the keys after them, then the row's output */                    \
          int64_t i = (r0 + s) / G, h = g * G + (r0 + s) % G;                                                \
          if (shared) NAME##_walk(1, C, v, t->D, shared_hi + 1, hi[s], &scores[s], &lo[s], &acc[s]);         \
          for (int c = 0; c < C; c++) {                                                                      \
            att_vec r = acc[s][c] / total[s];                                                                \
            memcpy(t->out + (i * t->H + h) * t->D + c0 + c * ATT_LANES, &r, sizeof r);                       \
          }                                                                                                  \
        }                                                                                                    \
      }                                                                                                      \
    }                                                                                                        \
  }

/* a vector's lanes summed pairwise, a fixed tree */
static inline float tree_sum(att_vec v) {
  for (int width = ATT_LANES / 2; width > 0; width /= 2)
    for (int l = 0; l < width; l++) v[l] += v[l + width];
  return v[0];
}

/* the larger of each pair of lanes (b where a is not greater, so a NaN score never wins), and of all lanes */
static inline att_vec lane_max(att_vec a, att_vec b) {
  att_ivec take = b > a, ai, bi;
  memcpy(&ai, &a, sizeof a);
  memcpy(&bi, &b, sizeof b);
  ai = (bi & take) | (ai & ~take);
  memcpy(&a, &ai, sizeof a);
  return a;
}

static inline float tree_max(att_vec v) {
  for (int width = ATT_LANES / 2; width > 0; width /= 2)
    for (int l = 0; l < width; l++) v[l] = v[l + width] > v[l] ? v[l + width] : v[l];
  return v[0];
}

/* the lowest and highest key of the rows' ranges */
static inline void key_span(int rows, const int64_t *lo, const int64_t *hi, int64_t *first, int64_t *last) {
  *first = lo[0], *last = hi[0];
  for (int s = 1; s < rows; s++) {
    *first = lo[s] < *first ? lo[s] : *first;
    *last = hi[s] > *last ? hi[s] : *last;
  }
}

/* the lanes of a block's keys j0 .. j0 + 15 that are row s's own: from .. to (empty where from > to) */
static inline void own_lanes(int64_t lo, int64_t hi, int64_t j0, int64_t *from, int64_t *to) {
  *from = lo - j0 > 0 ? lo - j0 : 0;
  *to = hi - j0 < ATT_LANES - 1 ? hi - j0 : ATT_LANES - 1;
}

/* raw scores, 16 keys a lane: each lane adds q[d] * key[d] over d = 0 .. D-1 in order */
static void generic_scores(const Attention *t, const float *keys, int rows, const float **q, const int64_t *lo,
                           const int64_t *hi, float **scores) {
  int64_t first, last;
  key_span(rows, lo, hi, &first, &last);
  for (int64_t j0 = first / ATT_LANES * ATT_LANES; j0 <= last; j0 += ATT_LANES) {
    const float *block = keys + j0 * t->D;
    int64_t w = t->cap - j0 < ATT_LANES ? t->cap - j0 : ATT_LANES, n = last - j0 + 1 < w ? last - j0 + 1 : w;
    for (int s = 0; s < rows; s++) {
      int64_t from, to;
      own_lanes(lo[s], hi[s], j0, &from, &to);
      if (from > to) continue;
      att_vec acc = {0};
      for (int64_t d = 0; d < t->D; d++) {
        att_vec k = {0};
        memcpy(&k, block + d * w, (size_t)n * sizeof(float));
        acc += q[s][d] * k;
      }
      for (int64_t l = from; l <= to; l++) scores[s][j0 + l - lo[s]] = t->scale * acc[l];
    }
  }
}

typedef void (*HeadFn)(const Attention *, int64_t, int64_t, float *);

/* a call's passes of ATT_ROWS rows over one kv group: each one task of its own, so that a call of few kv
 * groups and many rows (a verification, a prompt's chunk) keeps every thread busy */
static inline int64_t att_passes(const Attention *t) { return (t->S * (t->H / t->KV) + ATT_ROWS - 1) / ATT_ROWS; }

ATT_VARIANT(att_generic, , generic_scores)
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define AVX512 __attribute__((target("avx512f,fma")))

/* the raw scores of R rows (a constant where inlined) for B whole blocks of 16 keys from j0 (B * R chains of
 * fused multiply-adds at once, so that none waits on its last), stored in the lanes of each row's own keys */
#define ATT_BLOCKS 4
AVX512 AI void avx512_blocks(int R, int B, const Attention *t, const float *keys, const float **q, const int64_t *lo,
                             const int64_t *hi, float **scores, int64_t j0) {
  const float *block = keys + j0 * t->D;
  __m512 acc[ATT_ROWS][ATT_BLOCKS];
  for (int s = 0; s < R; s++)
    for (int b = 0; b < B; b++) acc[s][b] = _mm512_setzero_ps();
  for (int64_t d = 0; d < t->D; d++) {
    __m512 k[ATT_BLOCKS];
    for (int b = 0; b < B; b++) k[b] = _mm512_loadu_ps(block + (b * t->D + d) * ATT_LANES);
    for (int s = 0; s < R; s++) {
      __m512 x = _mm512_set1_ps(q[s][d]);
      for (int b = 0; b < B; b++) acc[s][b] = _mm512_fmadd_ps(x, k[b], acc[s][b]);
    }
  }
  __m512 scale = _mm512_set1_ps(t->scale);
  for (int s = 0; s < R; s++)
    for (int b = 0; b < B; b++) {
      int64_t from, to, at = j0 + b * ATT_LANES;
      own_lanes(lo[s], hi[s], at, &from, &to);
      if (from > to) continue;
      __mmask16 lanes = (__mmask16)((((uint32_t)2 << to) - 1) & ~(((uint32_t)1 << from) - 1));
      _mm512_mask_storeu_ps(scores[s] + at - lo[s], lanes, _mm512_mul_ps(scale, acc[s][b]));
    }
}

/* scores of R rows (R a constant where inlined) for 16 keys at a time, one key a lane: each dimension of a block's
 * keys is one load, and every row adds q[d] * key[d] over d = 0 .. D-1 in order (one fused multiply-add a
 * dimension), so a key's score depends neither on its lane nor on the other rows, nor on the blocks taken with
 * its own */
AVX512 AI void avx512_scores_rows(int R, const Attention *t, const float *keys, const float **q, const int64_t *lo,
                                  const int64_t *hi, float **scores) {
  int64_t first, last;
  key_span(R, lo, hi, &first, &last);
  int64_t j0 = first / ATT_LANES * ATT_LANES, whole = (last + 1) / ATT_LANES * ATT_LANES; /* whole: blocks end */
  for (; j0 + ATT_BLOCKS * ATT_LANES <= whole; j0 += ATT_BLOCKS * ATT_LANES)
    avx512_blocks(R, ATT_BLOCKS, t, keys, q, lo, hi, scores, j0);
  for (; j0 < whole; j0 += ATT_LANES) avx512_blocks(R, 1, t, keys, q, lo, hi, scores, j0);
  if (j0 > last) return;
  /* the last keys, fewer than a block: the lanes past the last key read nothing */
  int64_t w = t->cap - j0 < ATT_LANES ? t->cap - j0 : ATT_LANES, n = last - j0 + 1;
  __mmask16 keys_in = (__mmask16)(((uint32_t)1 << n) - 1);
  const float *block = keys + j0 * t->D;
  __m512 acc[ATT_ROWS];
  for (int s = 0; s < R; s++) acc[s] = _mm512_setzero_ps();
  for (int64_t d = 0; d < t->D; d++) {
    __m512 k = _mm512_maskz_loadu_ps(keys_in, block + d * w);
    for (int s = 0; s < R; s++) acc[s] = _mm512_fmadd_ps(_mm512_set1_ps(q[s][d]), k, acc[s]);
  }
  __m512 scale = _mm512_set1_ps(t->scale);
  for (int s = 0; s < R; s++) {
    int64_t from, to;
    own_lanes(lo[s], hi[s], j0, &from, &to);
    if (from > to) continue;
    __mmask16 lanes = (__mmask16)((((uint32_t)2 << to) - 1) & ~(((uint32_t)1 << from) - 1));
    _mm512_mask_storeu_ps(scores[s] + j0 - lo[s], lanes, _mm512_mul_ps(scale, acc[s]));
  }
}

AVX512 static void avx512_scores(const Attention *t, const float *keys, int rows, const float **q, const int64_t *lo,
                                 const int64_t *hi, float **scores) {
  switch (rows) { /* constant row counts: the accumulators stay in registers */
    case 1: avx512_scores_rows(1, t, keys, q, lo, hi, scores); break;
    case 2: avx512_scores_rows(2, t, keys, q, lo, hi, scores); break;
    case 3: avx512_scores_rows(3, t, keys, q, lo, hi, scores); break;
    default: avx512_scores_rows(4, t, keys, q, lo, hi, scores); break;
  }
}

ATT_VARIANT(att_avx512, AVX512, avx512_scores)
#endif

static HeadFn choose_attention(void) {
#if defined(__x86_64__) && defined(__GNUC__)
  const char *isa = getenv("RLXRT_CPU_KERNELS_ISA");
  __builtin_cpu_init();
  if (!(isa && strcmp(isa, "avx512")) && __builtin_cpu_supports("avx512f")) return att_avx512_group;
#endif
  return att_generic_group;
}

/* x (D floats) rotated for position p into y (may be x) */
static void rotate(const float *x, const float *cos_cache, const float *sin_cache, int64_t p, int64_t D, float *y) {
  int64_t half = D / 2;
  const float *c = cos_cache + p * half, *s = sin_cache + p * half;
  for (int64_t d = 0; d < half; d++) {
    float a = x[d], b = x[d + half];
    y[d] = a * c[d] - b * s[d];
    y[d + half] = b * c[d] + a * s[d];
  }
}

/* key x (D floats) rotated for position p into its place in a kv head's keys (blocks of 16, above) */
static void put_key(const float *x, const float *cos_cache, const float *sin_cache, int64_t p, int64_t D, int64_t cap,
                    float *keys) {
  float y[256]; /* D <= 256 */
  int64_t j0 = p / ATT_LANES * ATT_LANES, w = cap - j0 < ATT_LANES ? cap - j0 : ATT_LANES;
  float *at = keys + j0 * D + (p - j0);
  rotate(x, cos_cache, sin_cache, p, D, y);
  for (int64_t d = 0; d < D; d++) at[d * w] = y[d];
}

/* ---- the op (included by stream_matmul.c after its ABI declarations) --------------------------------- */

typedef struct { Api api; int64_t heads, kv_heads, window; float scale; } AttKernel;
typedef Status *(*AttrFloatFn)(const void *, const char *, float *);

static HeadFn attention_head;

typedef struct { const Attention *t; int failed; } AttentionJob;

static void attention_task(void *data, size_t i) {
  AttentionJob *job = data;
  int64_t passes = att_passes(job->t);
  float *scores = scratch(&scores_scratch, ATT_ROWS * ((size_t)job->t->cap + ATT_LANES)); /* whole vectors */
  if (scores) attention_head(job->t, (int64_t)i / passes, (int64_t)i % passes, scores);
  else __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED);
}

/* the op's n inputs with their element types and shapes (an absent optional input stays NULL) */
static Status *op_inputs(Api api, void *context, size_t n, const void **in, int *type, int64_t (*dims)[8],
                         size_t *rank) {
  Status *s = NULL;
  for (size_t i = 0; i < n && !s; i++) {
    s = CALL(api, KERNEL_CONTEXT_GET_INPUT, GetInputFn)(context, i, &in[i]);
    if (!s && in[i]) s = shape_of(api, in[i], &type[i], dims[i], &rank[i]);
  }
  return s;
}

/* the data of the n inputs that are present */
static Status *op_data(Api api, size_t n, const void **in, void **data) {
  Status *s = NULL;
  for (size_t i = 0; i < n && !s; i++)
    if (in[i]) s = CALL(api, GET_TENSOR_MUTABLE_DATA, DataFn)(in[i], &data[i]);
  return s;
}

/* the attention output [1, T, width] and the present KV buffers (shaped as the past ones, which they start as
 * when not bound as one buffer with them); their data in out, pk, pv */
static Status *att_outputs(Api api, void *context, int64_t T, int64_t width, const int64_t *k_dims,
                           const void *past_k, const void *past_v, size_t bytes, void **out, void **pk, void **pv) {
  int64_t out_dims[3] = {1, T, width};
  void *value[3] = {NULL, NULL, NULL};
  Status *s = CALL(api, KERNEL_CONTEXT_GET_OUTPUT, GetOutputFn)(context, 0, out_dims, 3, &value[0]);
  if (!s) s = CALL(api, KERNEL_CONTEXT_GET_OUTPUT, GetOutputFn)(context, 1, k_dims, 4, &value[1]);
  if (!s) s = CALL(api, KERNEL_CONTEXT_GET_OUTPUT, GetOutputFn)(context, 2, k_dims, 4, &value[2]);
  if (!s) s = CALL(api, GET_TENSOR_MUTABLE_DATA, DataFn)(value[0], out);
  if (!s) s = CALL(api, GET_TENSOR_MUTABLE_DATA, DataFn)(value[1], pk);
  if (!s) s = CALL(api, GET_TENSOR_MUTABLE_DATA, DataFn)(value[2], pv);
  if (s) return s;
  if (*pk != past_k) memcpy(*pk, past_k, bytes); /* not bound as one buffer: present starts as past */
  if (*pv != past_v) memcpy(*pv, past_v, bytes);
  return NULL;
}

static Status *attention_compute(void *kernel_data, void *context) {
  const AttKernel *kernel = kernel_data;
  Api api = kernel->api;
  const void *in[9] = {NULL};
  int64_t dims[9][8];
  size_t rank[9] = {0};
  int type[9] = {0};
  Status *s = op_inputs(api, context, 9, in, type, dims, rank);
  if (s) return s;
  int packed = !in[1] && !in[2];
  int64_t H = kernel->heads, KV = kernel->kv_heads, S = rank[0] == 3 ? dims[0][1] : -1;
  int64_t D = rank[3] == 4 ? dims[3][3] : -1, cap = rank[3] == 4 ? dims[3][2] : -1;
  int64_t width = packed ? (H + 2 * KV) * D : H * D;
  int ok = rank[0] == 3 && dims[0][0] == 1 && dims[0][2] == width && type[0] == FLOAT && (packed || (in[1] && in[2]));
  for (int i = 1; i <= 2 && ok && !packed; i++)
    ok = rank[i] == 3 && dims[i][0] == 1 && dims[i][1] == S && dims[i][2] == KV * D && type[i] == FLOAT;
  for (int i = 3; i <= 4 && ok; i++)
    ok = rank[i] == 4 && dims[i][0] == 1 && dims[i][1] == KV && dims[i][2] == cap && dims[i][3] == D && type[i] == FLOAT;
  ok = ok && D % ATT_LANES == 0 && D <= 256 && H % KV == 0 && type[5] == INT32 && type[7] == FLOAT &&
       rank[7] == 2 && dims[7][1] == D / 2 && type[8] == FLOAT && rank[8] == 2 && dims[8][0] == dims[7][0];
  if (!ok) return fail(api, ORT_INVALID_ARGUMENT, "StreamAttention: the inputs are not GroupQueryAttention's as "
                                                  "rlxrt's fused graph feeds them");
  void *data[9] = {NULL};
  if ((s = op_data(api, 9, in, data))) return s;
  int64_t last = *(const int32_t *)data[5], first = last + 1 - S;
  if (first < 0 || last >= cap || last >= dims[7][0])
    return fail(api, ORT_INVALID_ARGUMENT, "StreamAttention: seqlens_k puts the new tokens outside the KV buffer");
  void *out = NULL, *pk = NULL, *pv = NULL;
  s = att_outputs(api, context, S, H * D, dims[3], data[3], data[4], (size_t)(KV * cap * D) * sizeof(float), &out,
                  &pk, &pv);
  if (s) return s;
  const float *x = data[0], *cos_cache = data[7], *sin_cache = data[8];
  float *queries = scratch(&queries_scratch, (size_t)(S * H * D));
  if (!queries) return fail(api, ORT_FAIL, "StreamAttention: out of memory");
  for (int64_t i = 0; i < S; i++) {
    const float *row = x + i * width;
    const float *k = packed ? row + H * D : (const float *)data[1] + i * KV * D;
    const float *v = packed ? row + (H + KV) * D : (const float *)data[2] + i * KV * D;
    for (int64_t g = 0; g < KV; g++) {
      put_key(k + g * D, cos_cache, sin_cache, first + i, D, cap, (float *)pk + g * cap * D);
      memcpy((float *)pv + (g * cap + first + i) * D, v + g * D, (size_t)D * sizeof(float));
    }
    for (int64_t h = 0; h < H; h++) rotate(row + h * D, cos_cache, sin_cache, first + i, D, queries + (i * H + h) * D);
  }
  Attention task = {queries, pk, pv, out, S, H, KV, D, cap, first, kernel->window, kernel->scale};
  AttentionJob job = {&task, 0};
  size_t count = (size_t)(KV * att_passes(&task)); /* a task a kv group and pass */
  s = CALL(api, KERNEL_CONTEXT_PARALLEL_FOR, ParallelForFn)(context, attention_task, count, 0, &job);
  if (!s && job.failed) s = fail(api, ORT_FAIL, "StreamAttention: out of memory");
  return s;
}

static Status *attention_create(const CustomOp *op, const void *api, const void *info, void **out) {
  (void)op;
  AttKernel *kernel = malloc(sizeof *kernel);
  if (!kernel) return fail(api, ORT_FAIL, "StreamAttention: out of memory");
  kernel->api = api;
  Status *s = CALL((Api)api, KERNEL_INFO_GET_ATTRIBUTE_INT64, AttrIntFn)(info, "num_heads", &kernel->heads);
  if (!s) s = CALL((Api)api, KERNEL_INFO_GET_ATTRIBUTE_INT64, AttrIntFn)(info, "kv_num_heads", &kernel->kv_heads);
  if (!s) s = CALL((Api)api, KERNEL_INFO_GET_ATTRIBUTE_INT64, AttrIntFn)(info, "local_window_size", &kernel->window);
  if (!s) s = CALL((Api)api, KERNEL_INFO_GET_ATTRIBUTE_FLOAT, AttrFloatFn)(info, "scale", &kernel->scale);
  if (!s && (kernel->heads < 1 || kernel->kv_heads < 1))
    s = fail(api, ORT_INVALID_ARGUMENT, "StreamAttention: num_heads and kv_num_heads must be >= 1");
  if (s) { free(kernel); return s; }
  *out = kernel;
  return NULL;
}

static const char *attention_name(const CustomOp *op) { (void)op; return "StreamAttention"; }
static int attention_input_type(const CustomOp *op, size_t i) { (void)op; return i == 5 || i == 6 ? INT32 : FLOAT; }
static size_t nine(const CustomOp *op) { (void)op; return 9; }
static size_t three_out(const CustomOp *op) { (void)op; return 3; }
static int optional_kv(const CustomOp *op, size_t i) { (void)op; return i == 1 || i == 2 ? 1 : 0; }
