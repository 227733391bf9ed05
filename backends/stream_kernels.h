/* The arithmetic of StreamMatMul (stream_matmul.c): y[M, N] = a[M, K] @ W[K, N], W as column panels of 32.
 *
 * float32: panels [P, K, 32], P = ceil(N / 32), zero-padded.
 * int4:    codes [P, K, 16] bytes, byte j of row k holding column j (low nibble) and column j + 16 (high);
 *          scales [P, K / 32, 32] floats, one per column and block of 32 rows; W[k, n] = (code - 8) * scale,
 *          dequantised in float32 (exact: code - 8 is a small integer, then one rounding) and multiplied in
 *          float32, as MatMulNBits does at accuracy level 0.
 *
 * One variant per vector width V (floats): a panel is handled as strips of 2V columns, a chunk of up to
 * CHUNK rows at a time with 2 accumulators a row: 6 rows where there are 16 vector registers (AVX2, SSE: 12
 * accumulators, 2 weight vectors and a broadcast), 12 with AVX-512's 32, so that a verification of up to 12
 * rows reads each weight strip once and never leaves a lone row to a latency-bound pass of its own. A row
 * gets a[r, k] * W[k, strip] added for k = 0 .. K-1 in order whatever chunk it falls in, so its output is
 * bitwise the same alone or among other rows.
 */
#define PANEL 32
#define CHUNK 12 /* the most rows of any variant */
#define WIDE 4 /* strips of 2V columns a lone row takes at once */
#define WIDE_MIN_K 256
/* ... where K is at least this: a lone row over 4 strips at once took less time than one strip at a
 * time for K >= 256 and slower for K = 128 (docs/kernels.md) */
#ifndef AHEAD
#define AHEAD 96 /* weight rows a chunk of rows prefetches ahead of the one it multiplies by (docs/kernels.md) */
#endif
#define AI static inline __attribute__((always_inline))

/* per-thread buffers, grown once (the decode loop allocates nothing) and freed when their thread ends */
typedef struct { float *data; size_t len; } Scratch;
static _Thread_local Scratch scores_scratch, queries_scratch, panel_scratch;
#if !defined(_WIN32)
static pthread_key_t scratch_key; /* its value: this thread's scratch, to free at the thread's exit */
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static void free_scratch(void *unused) {
  (void)unused;
  free(scores_scratch.data), free(queries_scratch.data), free(panel_scratch.data);
  scores_scratch = queries_scratch = panel_scratch = (Scratch){NULL, 0};
}
static void make_scratch_key(void) { pthread_key_create(&scratch_key, free_scratch); }
#endif

static float *scratch(Scratch *buf, size_t floats) {
  if (floats > buf->len) {
    float *grown = realloc(buf->data, floats * sizeof(float));
    if (!grown) return NULL;
    buf->data = grown, buf->len = floats;
#if !defined(_WIN32)
    pthread_once(&scratch_once, make_scratch_key);
    pthread_setspecific(scratch_key, buf); /* any non-NULL value: the destructor runs at thread exit */
#endif
  }
  return buf->data;
}

#define VARIANT(NAME, V, TARGET, ROWS)                                                                       \
  typedef float NAME##_vec __attribute__((vector_size(V * 4)));                                              \
  typedef int32_t NAME##_ivec __attribute__((vector_size(V * 4)));                                           \
  typedef uint8_t NAME##_bytes __attribute__((vector_size(V)));                                              \
  TARGET AI NAME##_vec NAME##_load(const float *p) {                                                         \
    NAME##_vec v;                                                                                            \
    memcpy(&v, p, sizeof v);                                                                                 \
    return v;                                                                                                \
  }                                                                                                          \
  /* columns col .. col+V-1 of one int4 row: bytes col % 16 .., nibble col / 16 */                           \
  TARGET AI NAME##_vec NAME##_dequant(const uint8_t *row, int col, NAME##_vec scale) {                       \
    NAME##_bytes b;                                                                                          \
    memcpy(&b, row + col % 16, sizeof b);                                                                    \
    b = (b >> (col / 16 * 4)) & 15;                                                                          \
    NAME##_vec code = __builtin_convertvector(__builtin_convertvector(b, NAME##_ivec), NAME##_vec);          \
    return (code - 8.0f) * scale;                                                                            \
  }                                                                                                          \
  TARGET AI void NAME##_store(int R, NAME##_vec *lo, NAME##_vec *hi, float *y, int64_t ldy) {                \
    for (int r = 0; r < R; r++) {                                                                            \
      memcpy(y + r * ldy, &lo[r], sizeof lo[r]);                                                             \
      memcpy(y + r * ldy + V, &hi[r], sizeof hi[r]);                                                         \
    }                                                                                                        \
  }                                                                                                          \
  /* rows r < R of a (row stride K) times the float strip at w (row stride PANEL) into y */                  \
  TARGET AI void NAME##_rows(int R, const float *a, const float *w, int64_t K, float *y, int64_t ldy) {      \
    NAME##_vec lo[CHUNK], hi[CHUNK];                                                                         \
    for (int r = 0; r < R; r++) lo[r] = hi[r] = (NAME##_vec){0};                                             \
    for (int64_t k = 0; k < K; k++) {                                                                        \
      __builtin_prefetch(w + PANEL * (k + AHEAD), 0, 3);                                                    \
      __builtin_prefetch(w + PANEL * (k + AHEAD) + V, 0, 3);                                                \
      NAME##_vec w0 = NAME##_load(w + PANEL * k), w1 = NAME##_load(w + PANEL * k + V);                       \
      for (int r = 0; r < R; r++) {                                                                          \
        float x = a[r * K + k];                                                                              \
        lo[r] += x * w0;                                                                                     \
        hi[r] += x * w1;                                                                                     \
      }                                                                                                      \
    }                                                                                                        \
    NAME##_store(R, lo, hi, y, ldy);                                                                         \
  }                                                                                                          \
  /* one row times S strips of 2V columns at once, strip s at ws[s] into y[s]: the 2 accumulators of one     \
   * strip alone are too few to hide the FMA latency. Each column still sums k = 0 .. K-1 in order, so the   \
   * row comes out bitwise as in a chunk of rows. */                                                         \
  TARGET AI void NAME##_wide(int S, const float *a, const float *const *ws, int64_t K, float *const *y) {    \
    NAME##_vec acc[WIDE][2];                                                                                 \
    for (int s = 0; s < S; s++) acc[s][0] = acc[s][1] = (NAME##_vec){0};                                     \
    for (int64_t k = 0; k < K; k++)                                                                          \
      for (int s = 0; s < S; s++) {                                                                          \
        acc[s][0] += a[k] * NAME##_load(ws[s] + PANEL * k);                                                  \
        acc[s][1] += a[k] * NAME##_load(ws[s] + PANEL * k + V);                                              \
      }                                                                                                      \
    for (int s = 0; s < S; s++) {                                                                            \
      memcpy(y[s], &acc[s][0], sizeof acc[s][0]);                                                            \
      memcpy(y[s] + V, &acc[s][1], sizeof acc[s][1]);                                                        \
    }                                                                                                        \
  }                                                                                                          \
  /* the full float panels of [first, last) for one row, WIDE strips at a time; returns the first panel left \
   * (a partial last one, or last). (Two rows already have 4 accumulators a strip: measured slower so.) */   \
  TARGET static int64_t NAME##_wide_panels(const float *a, const float *w, float *y, int64_t K, int64_t N,   \
                                           int64_t first, int64_t last) {                                    \
    int64_t full = N / PANEL < last ? N / PANEL : last;                                                      \
    const float *ws[WIDE];                                                                                   \
    float *ys[WIDE];                                                                                         \
    int n = 0;                                                                                               \
    for (int64_t p = first; p < full; p++)                                                                   \
      for (int strip = 0; strip < PANEL; strip += 2 * V) {                                                   \
        ws[n] = w + p * K * PANEL + strip;                                                                   \
        ys[n] = y + p * PANEL + strip;                                                                       \
        if (++n < WIDE && !(p == full - 1 && strip + 2 * V == PANEL)) continue;                              \
        switch (n) { /* constant counts: the accumulators stay in registers */                               \
          case 1: NAME##_wide(1, a, ws, K, ys); break;                                                       \
          case 2: NAME##_wide(2, a, ws, K, ys); break;                                                       \
          case 3: NAME##_wide(3, a, ws, K, ys); break;                                                       \
          default: NAME##_wide(WIDE, a, ws, K, ys); break;                                                   \
        }                                                                                                    \
        n = 0;                                                                                               \
      }                                                                                                      \
    return first > full ? first : full;                                                                      \
  }                                                                                                          \
  /* the same for strip ``col`` of an int4 panel: codes (row stride 16), scales (block stride PANEL) */      \
  TARGET AI void NAME##_q4rows(int R, const float *a, const uint8_t *c, const float *s, int col, int64_t K,  \
                               float *y, int64_t ldy) {                                                      \
    NAME##_vec lo[CHUNK], hi[CHUNK];                                                                         \
    for (int r = 0; r < R; r++) lo[r] = hi[r] = (NAME##_vec){0};                                             \
    for (int64_t b = 0; b < K / 32; b++) {                                                                   \
      NAME##_vec s0 = NAME##_load(s + b * PANEL + col), s1 = NAME##_load(s + b * PANEL + col + V);           \
      for (int64_t k = b * 32; k < b * 32 + 32; k++) {                                                       \
        __builtin_prefetch(c + 16 * (k + 4 * AHEAD), 0, 3); /* the same bytes ahead as a float row's */     \
        NAME##_vec w0 = NAME##_dequant(c + 16 * k, col, s0), w1 = NAME##_dequant(c + 16 * k, col + V, s1);   \
        for (int r = 0; r < R; r++) {                                                                        \
          float x = a[r * K + k];                                                                            \
          lo[r] += x * w0;                                                                                   \
          hi[r] += x * w1;                                                                                   \
        }                                                                                                    \
      }                                                                                                      \
    }                                                                                                        \
    NAME##_store(R, lo, hi, y, ldy);                                                                         \
  }                                                                                                          \
  /* an int4 panel (codes c, scales s) as the float panel the q4 rows multiply by, value for value */        \
  TARGET static void NAME##_dequant_panel(const uint8_t *c, const float *s, int64_t K, float *out) {          \
    for (int64_t k = 0; k < K; k++)                                                                          \
      for (int col = 0; col < PANEL; col += V) {                                                             \
        NAME##_vec w = NAME##_dequant(c + 16 * k, col, NAME##_load(s + k / 32 * PANEL + col));               \
        memcpy(out + k * PANEL + col, &w, sizeof w);                                                         \
      }                                                                                                      \
  }                                                                                                          \
  /* y[r, n] += sum over blocks b in order of xs[r, b] * shift[b, n] for the panel's ``width`` columns (a GGUF     \
   * Q4_1 weight's shift, StreamMatMulQ4's fourth input): after the panel, whatever its path, each row alone */  \
  TARGET static void NAME##_shift(const float *xs, const float *shift, int64_t M, int64_t blocks, float *y,     \
                                  int64_t ldy, int64_t width) {                                                \
    for (int64_t r = 0; r < M; r++) {                                                                          \
      NAME##_vec t[PANEL / V];                                                                                 \
      for (int v = 0; v < PANEL / V; v++) t[v] = (NAME##_vec){0};                                              \
      for (int64_t b = 0; b < blocks; b++)                                                                     \
        for (int v = 0; v < PANEL / V; v++) t[v] += xs[r * blocks + b] * NAME##_load(shift + b * PANEL + v * V); \
      float sum[PANEL];                                                                                        \
      memcpy(sum, t, sizeof sum);                                                                              \
      for (int64_t n = 0; n < width; n++) y[r * ldy + n] += sum[n];                                            \
    }                                                                                                          \
  }                                                                                                            \
  /* panels [first, last) of y for all M rows; codes and scales NULL for float panels at w. An int4 panel     \
   * that more rows than a chunk read is dequantised once, into this thread's scratch */                     \
  TARGET static void NAME##_panels(const float *a, const float *w, const uint8_t *codes, const float *scales, \
                                   float *y, int64_t M, int64_t K, int64_t N, int64_t first, int64_t last) { \
    float tail[CHUNK * PANEL];                                                                               \
    if (!codes && M == 1 && K >= WIDE_MIN_K) first = NAME##_wide_panels(a, w, y, K, N, first, last);         \
    for (int64_t p = first; p < last; p++) {                                                                 \
      int64_t col = p * PANEL, width = N - col < PANEL ? N - col : PANEL;                                    \
      const float *wp = codes ? NULL : w + p * K * PANEL;                                                    \
      float *room = codes && M > ROWS ? scratch(&panel_scratch, (size_t)(K * PANEL)) : NULL;                 \
      if (room) {                                                                                            \
        NAME##_dequant_panel(codes + p * K * 16, scales + p * (K / 32) * PANEL, K, room);                    \
        wp = room;                                                                                           \
      }                                                                                                      \
      for (int64_t m = 0; m < M; m += ROWS) {                                                                \
        int rows = (int)(M - m < ROWS ? M - m : ROWS);                                                       \
        float *out = width == PANEL ? y + m * N + col : tail;                                                \
        int64_t ldy = width == PANEL ? N : PANEL;                                                            \
        const float *am = a + m * K;                                                                         \
        for (int strip = 0; strip < PANEL; strip += 2 * V) {                                                 \
          if (!wp) {                                                                                         \
            const uint8_t *c = codes + p * K * 16;                                                           \
            const float *s = scales + p * (K / 32) * PANEL;                                                  \
            switch (rows) { /* constant row counts: the accumulators stay in registers */                    \
              case 1: NAME##_q4rows(1, am, c, s, strip, K, out + strip, ldy); break;                         \
              case 2: NAME##_q4rows(2, am, c, s, strip, K, out + strip, ldy); break;                         \
              case 3: NAME##_q4rows(3, am, c, s, strip, K, out + strip, ldy); break;                         \
              case 4: NAME##_q4rows(4, am, c, s, strip, K, out + strip, ldy); break;                         \
              case 5: NAME##_q4rows(5, am, c, s, strip, K, out + strip, ldy); break;                         \
              case 6: NAME##_q4rows(6, am, c, s, strip, K, out + strip, ldy); break;                         \
              case 7: NAME##_q4rows(7, am, c, s, strip, K, out + strip, ldy); break;                         \
              case 8: NAME##_q4rows(8, am, c, s, strip, K, out + strip, ldy); break;                         \
              case 9: NAME##_q4rows(9, am, c, s, strip, K, out + strip, ldy); break;                         \
              case 10: NAME##_q4rows(10, am, c, s, strip, K, out + strip, ldy); break;                       \
              case 11: NAME##_q4rows(11, am, c, s, strip, K, out + strip, ldy); break;                       \
              default: NAME##_q4rows(ROWS, am, c, s, strip, K, out + strip, ldy); break;                     \
            }                                                                                                \
          } else {                                                                                           \
            const float *ws = wp + strip;                                                                    \
            switch (rows) {                                                                                  \
              case 1: NAME##_rows(1, am, ws, K, out + strip, ldy); break;                                    \
              case 2: NAME##_rows(2, am, ws, K, out + strip, ldy); break;                                    \
              case 3: NAME##_rows(3, am, ws, K, out + strip, ldy); break;                                    \
              case 4: NAME##_rows(4, am, ws, K, out + strip, ldy); break;                                    \
              case 5: NAME##_rows(5, am, ws, K, out + strip, ldy); break;                                    \
              case 6: NAME##_rows(6, am, ws, K, out + strip, ldy); break;                                    \
              case 7: NAME##_rows(7, am, ws, K, out + strip, ldy); break;                                    \
              case 8: NAME##_rows(8, am, ws, K, out + strip, ldy); break;                                    \
              case 9: NAME##_rows(9, am, ws, K, out + strip, ldy); break;                                    \
              case 10: NAME##_rows(10, am, ws, K, out + strip, ldy); break;                                  \
              case 11: NAME##_rows(11, am, ws, K, out + strip, ldy); break;                                  \
              default: NAME##_rows(ROWS, am, ws, K, out + strip, ldy); break;                                \
            }                                                                                                \
          }                                                                                                  \
        }                                                                                                    \
        if (width < PANEL)                                                                                   \
          for (int64_t r = 0; r < rows; r++)                                                                 \
            memcpy(y + (m + r) * N + col, tail + r * PANEL, width * sizeof(float));                          \
      }                                                                                                      \
    }                                                                                                        \
  }

typedef void (*PanelsFn)(const float *, const float *, const uint8_t *, const float *, float *, int64_t, int64_t,
                         int64_t, int64_t, int64_t);

VARIANT(generic, 4, , 6)
#if defined(__x86_64__) && defined(__GNUC__)
VARIANT(avx2, 8, __attribute__((target("avx2,fma"))), 6)
VARIANT(avx512, 16, __attribute__((target("avx512f,avx512bw,fma"))), 12)
#endif

typedef void (*ShiftFn)(const float *, const float *, int64_t, int64_t, float *, int64_t, int64_t);
typedef struct { PanelsFn panels; ShiftFn shift; const char *name; } Variant;

/* the widest variant this CPU runs, or the one RLXRT_CPU_KERNELS_ISA names (generic, avx2, avx512: the
 * tests run each variant this CPU can) */
static Variant choose_variant(void) {
  const char *isa = getenv("RLXRT_CPU_KERNELS_ISA");
  Variant generic = {generic_panels, generic_shift, "generic"};
  if (isa && !strcmp(isa, "generic")) return generic;
#if defined(__x86_64__) && defined(__GNUC__)
  Variant avx2 = {avx2_panels, avx2_shift, "avx2"}, avx512 = {avx512_panels, avx512_shift, "avx512"};
  __builtin_cpu_init();
  int has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa && !strcmp(isa, "avx2") && has_avx2) return avx2;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return avx512;
  if (has_avx2) return avx2;
#endif
  return generic;
}
