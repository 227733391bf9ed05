/* StreamMatMulQx8: y[M, N] = a[M, K] @ W[K, N] with W in 4- or 8-bit blocks of 32 rows and the activations
 * quantised to int8, as MatMulNBits computes at accuracy level 4, but each row the same alone or among others
 * (ONNX Runtime's level-4 kernel computes a (k+1)-row call differently from one-row calls).
 *
 * Activations, per row and block of 32: d = max |a| / 127, q = round(a / d) (to nearest even), sum_q.
 * Weights: codes c (0..15 with zero 8, or 0..255 with zero 128) and a float scale s per column and block:
 *     y[r, n] = sum over blocks b in order of (s[b, n] * d[r, b]) * (sum_k c[k, n] q[r, k] - zero * sum_q[r, b])
 * with exact int32 dot products and one fused multiply-add per block into a float32 accumulator. With a shift
 * (a GGUF Q4_1 weight: W = scale * code + minimum, exported as the codes against zero 8 plus the rows' block sums
 * times shift[b, n] = minimum + 8 scale), each block then adds shift[b, n] * xs[r, b] with a second one, xs the
 * sum of the block's floats (block_sum), so the three nodes that add it in the graph go.
 *
 * Layout, per panel of 32 columns and quad of 4 rows k..k+3 (so one 32-bit lane holds a column's 4 codes):
 * two groups of 16 columns, code t = 4 * column + (k % 4) of a group; 8-bit: 64 bytes a group, byte t;
 * 4-bit: 32 bytes a group, byte i holding code i (low nibble) and code i + 32 (high). Scales and shifts
 * [P, K / 32, 32].
 */
#define QCHUNK 6 /* rows a pass over a panel's codes takes when a call has more than QWIDE (fastest of 4-8) */
#define QWIDE 12 /* a call of up to this many rows takes one pass */
#define UNPACKED_BYTES 65536 /* a panel of 4-bit codes unpacked, up to K = 2048 (on the stack) */
#ifndef QAHEAD
#define QAHEAD 128 /* lines of codes a pass prefetches ahead of the quad it reads (docs/kernels.md) */
#endif

/* a [M, K] quantised: q, and per row and block of 32 its d, the sum of its q, and the sum of its floats (xs, for a
 * weight's shift: a Q4_1 block's minimum and offset, applied as xs times a float per column and block) */
typedef struct { const int8_t *q; const float *d; const int32_t *sums; const float *xs; } Quantised;

/* the sum of a block's 32 floats in a fixed order: x[j] + x[j + 16] first, then halves of 8, 4, 2, 1 */
static inline float block_sum(const float *x) {
  float p[16];
  for (int j = 0; j < 16; j++) p[j] = x[j] + x[j + 16];
  for (int width = 8; width > 0; width /= 2)
    for (int j = 0; j < width; j++) p[j] += p[j + width];
  return p[0];
}

/* a [M, K] as int8 blocks of 32 into q [M, K], d and sums [M, K / 32]; a block holding a NaN or an infinity
 * gets d = NaN, so that its row's outputs are NaN rather than numbers made of nothing */
static void generic_quantise(const float *a, int64_t M, int64_t K, int8_t *q, float *d, int32_t *sums, float *xs) {
  for (int64_t i = 0; i < M * (K / 32); i++) {
    const float *x = a + i * 32;
    float top = 0.0f;
    if (xs) xs[i] = block_sum(x); /* only a call with a shift reads them */
    int finite = 1;
    for (int j = 0; j < 32; j++) {
      top = fabsf(x[j]) > top ? fabsf(x[j]) : top;
      finite &= fabsf(x[j]) <= FLT_MAX;
    }
    float scale = finite ? top / 127.0f : NAN, inverse = finite && top > 0.0f ? 127.0f / top : 0.0f;
    int32_t total = 0;
    for (int j = 0; j < 32; j++) {
      int32_t v = (int32_t)nearbyintf(x[j] * inverse);
      q[i * 32 + j] = (int8_t)v;
      total += v;
    }
    d[i] = scale;
    sums[i] = total;
  }
}

/* the dot products of one block (8 quads) for one row: generic C */
static void generic_qpanel(Quantised x, const uint8_t *c, const float *s, const float *shift, int bits, int64_t M,
                           int64_t K, float *y, int64_t ldy, int64_t width) {
  int64_t group_bytes = bits == 4 ? 32 : 64, zero = bits == 4 ? 8 : 128;
  for (int64_t r = 0; r < M; r++) {
    float acc[PANEL] = {0};
    for (int64_t b = 0; b < K / 32; b++) {
      int32_t dot[PANEL] = {0};
      for (int quad = 0; quad < 8; quad++)
        for (int g = 0; g < 2; g++) {
          const uint8_t *bytes = c + ((b * 8 + quad) * 2 + g) * group_bytes;
          for (int t = 0; t < 64; t++) {
            int code = bits == 8 ? bytes[t] : t < 32 ? bytes[t] & 15 : bytes[t - 32] >> 4;
            dot[g * 16 + t / 4] += code * x.q[r * K + b * 32 + quad * 4 + t % 4];
          }
        }
      float dr = x.d[r * (K / 32) + b];
      for (int n = 0; n < PANEL; n++) {
        acc[n] = fmaf(s[b * PANEL + n] * dr, (float)(dot[n] - (int32_t)zero * x.sums[r * (K / 32) + b]), acc[n]);
        if (shift) acc[n] = fmaf(shift[b * PANEL + n], x.xs[r * (K / 32) + b], acc[n]);
      }
    }
    memcpy(y + r * ldy, acc, width * sizeof(float));
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,fma")))

/* one group's 64 codes of a quad as bytes */
VNNI AI __m512i vnni_codes(const uint8_t *bytes, int bits) {
  if (bits == 8) return _mm512_loadu_si512(bytes);
  __m256i raw = _mm256_loadu_si256((const __m256i *)bytes);
  __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1);
  return _mm512_and_si512(both, _mm512_set1_epi8(15));
}

/* rows r < R (R a constant, at most QWIDE) of a panel, codes at c in the layout of ``bits`` (4: two to a byte;
 * 8: a byte each), their zero ``zero``. Per block of 32: the 2 R dot products (both groups of 16 columns) stay
 * in registers, started at -zero * sum_q, so that they end as the exact sum_k c q - zero sum_q; the float32 sums
 * go to memory and back once a block (as registers they spilled: now 0.6-0.8x the time at 4-224 rows,
 * docs/kernels.md). Every row gets the same operations in the same order whatever R. ``next``: the next panel's
 * 4-bit codes where this pass reads codes unpacked before it (vnni_unpacked), prefetched a line a quad with its
 * scales and shift, so that they arrive while this pass computes rather than while the next panel unpacks them. */
VNNI AI void vnni_rows(int R, Quantised x, const uint8_t *c, const float *s, const float *shift, int bits,
                       int32_t zero, int64_t K, float *y, int64_t ldy, const uint8_t *next) {
  int64_t group_bytes = bits == 4 ? 32 : 64, blocks = K / 32;
  _Alignas(64) float acc[QWIDE][2][16];
  for (int r = 0; r < R; r++) memset(acc[r], 0, sizeof acc[r]);
  for (int64_t b = 0; b < blocks; b++) {
    __m512i dot[QWIDE][2];
    const uint8_t *at = c + b * 16 * group_bytes;
#pragma GCC unroll 12
    for (int r = 0; r < R; r++) dot[r][0] = dot[r][1] = _mm512_set1_epi32(-zero * x.sums[r * blocks + b]);
#pragma GCC unroll 8
    for (int quad = 0; quad < 8; quad++) {
      const uint8_t *g0 = at + quad * 2 * group_bytes, *g1 = g0 + group_bytes;
      __builtin_prefetch(g0 + 64 * QAHEAD, 0, 3);
      __builtin_prefetch(g1 + 64 * QAHEAD, 0, 3);
      __m512i c0 = vnni_codes(g0, bits), c1 = vnni_codes(g1, bits);
#pragma GCC unroll 12
      for (int r = 0; r < R; r++) {
        int32_t four;
        memcpy(&four, x.q + r * K + b * 32 + quad * 4, 4);
        __m512i q4 = _mm512_set1_epi32(four);
        dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], c0, q4);
        dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], c1, q4);
      }
    }
    if (next) {
      for (int line = 0; line < 8; line++) __builtin_prefetch(next + (b * 8 + line) * 64, 0, 3);
      __builtin_prefetch(s + K + b * PANEL, 0, 3);
      __builtin_prefetch(s + K + b * PANEL + 16, 0, 3);
      if (shift) __builtin_prefetch(shift + K + b * PANEL, 0, 3), __builtin_prefetch(shift + K + b * PANEL + 16, 0, 3);
    }
    __m512 s0 = _mm512_loadu_ps(s + b * PANEL), s1 = _mm512_loadu_ps(s + b * PANEL + 16);
#pragma GCC unroll 12
    for (int r = 0; r < R; r++) {
      __m512 dr = _mm512_set1_ps(x.d[r * blocks + b]);
      __m512 a0 = _mm512_fmadd_ps(_mm512_mul_ps(s0, dr), _mm512_cvtepi32_ps(dot[r][0]), _mm512_load_ps(acc[r][0]));
      __m512 a1 = _mm512_fmadd_ps(_mm512_mul_ps(s1, dr), _mm512_cvtepi32_ps(dot[r][1]), _mm512_load_ps(acc[r][1]));
      if (shift) {
        __m512 xs = _mm512_set1_ps(x.xs[r * blocks + b]);
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(shift + b * PANEL), xs, a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(shift + b * PANEL + 16), xs, a1);
      }
      _mm512_store_ps(acc[r][0], a0);
      _mm512_store_ps(acc[r][1], a1);
    }
  }
  for (int r = 0; r < R; r++) memcpy(y + r * ldy, acc[r], sizeof acc[r]);
}

/* generic_quantise with 16 floats at a time: the same maximum (a NaN skipped, as there), the same float32
 * products, rounded to nearest even by the conversion (the default rounding, as nearbyintf), so the same q, d
 * and sums bit for bit */
VNNI static void vnni_quantise(const float *a, int64_t M, int64_t K, int8_t *q, float *d, int32_t *sums, float *xs) {
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t i = 0; i < M * (K / 32); i++) {
    __m512 x0 = _mm512_loadu_ps(a + i * 32), x1 = _mm512_loadu_ps(a + i * 32 + 16);
    if (xs) xs[i] = block_sum(a + i * 32);
    /* vmaxps returns its second operand where either is a NaN: the running maximum survives a NaN */
    __m512 top_v = _mm512_max_ps(_mm512_abs_ps(x1), _mm512_max_ps(_mm512_abs_ps(x0), zero));
    float top = _mm512_reduce_max_ps(top_v);
    const __m512 most = _mm512_set1_ps(FLT_MAX);
    int finite = !(_mm512_cmp_ps_mask(_mm512_abs_ps(x0), most, _CMP_NLE_UQ) |
                   _mm512_cmp_ps_mask(_mm512_abs_ps(x1), most, _CMP_NLE_UQ)); /* none NaN or above FLT_MAX */
    float scale = finite ? top / 127.0f : NAN, inverse = finite && top > 0.0f ? 127.0f / top : 0.0f;
    __m512 inv = _mm512_set1_ps(inverse);
    __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
    _mm_storeu_si128((__m128i *)(q + i * 32), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128((__m128i *)(q + i * 32 + 16), _mm512_cvtepi32_epi8(q1));
    d[i] = scale;
    sums[i] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  }
}

/* a panel's 4-bit codes as bytes, quad by quad (the layout of 8-bit codes), so that many rows read them
 * without each chunk of rows unpacking them again */
VNNI static void vnni_unpack(const uint8_t *c, int64_t K, uint8_t *out) {
  for (int64_t group = 0; group < K / 4 * 2; group++)
    _mm512_storeu_si512(out + group * 64, vnni_codes(c + group * 32, 4));
}

/* vnni_rows with the row count, and (inlined where ``bits`` is a constant) the layout, known to the compiler:
 * the loops unroll and the dot products stay in registers */
VNNI AI void vnni_chunk(int rows, Quantised x, const uint8_t *c, const float *s, const float *shift, int bits,
                        int32_t zero, int64_t K, float *y, int64_t ldy) {
  switch (rows) {
    case 1: vnni_rows(1, x, c, s, shift, bits, zero, K, y, ldy, NULL); break;
    case 2: vnni_rows(2, x, c, s, shift, bits, zero, K, y, ldy, NULL); break;
    case 3: vnni_rows(3, x, c, s, shift, bits, zero, K, y, ldy, NULL); break;
    case 4: vnni_rows(4, x, c, s, shift, bits, zero, K, y, ldy, NULL); break;
    case 5: vnni_rows(5, x, c, s, shift, bits, zero, K, y, ldy, NULL); break;
    case 6: vnni_rows(6, x, c, s, shift, bits, zero, K, y, ldy, NULL); break;
    case 7: vnni_rows(7, x, c, s, shift, bits, zero, K, y, ldy, NULL); break;
    case 8: vnni_rows(8, x, c, s, shift, bits, zero, K, y, ldy, NULL); break;
    case 9: vnni_rows(9, x, c, s, shift, bits, zero, K, y, ldy, NULL); break;
    case 10: vnni_rows(10, x, c, s, shift, bits, zero, K, y, ldy, NULL); break;
    case 11: vnni_rows(11, x, c, s, shift, bits, zero, K, y, ldy, NULL); break;
    default: vnni_rows(12, x, c, s, shift, bits, zero, K, y, ldy, NULL); break;
  }
}

VNNI __attribute__((noinline)) static void vnni_qpanel(Quantised x, const uint8_t *c, const float *s,
                                                       const float *shift, int bits, int64_t M, int64_t K, float *y,
                                                       int64_t ldy, int64_t width) {
  float tail[QWIDE * PANEL];
  _Alignas(64) uint8_t bytes[UNPACKED_BYTES];
  int32_t zero = bits == 4 ? 8 : 128;
  int64_t chunk = M <= QWIDE ? QWIDE : QCHUNK;
  /* the same codes, unpacked once: vnni_panel sends these calls to vnni_unpacked, but without this branch the
   * one-pass calls compiled 2-4 % slower at 8-12 rows (code layout; docs/kernels.md, stop 69) */
  if (bits == 4 && M > chunk && K * 32 <= (int64_t)sizeof bytes) {
    vnni_unpack(c, K, bytes);
    c = bytes;
    bits = 8;
  }
  for (int64_t m = 0; m < M; m += chunk) {
    int rows = (int)(M - m < chunk ? M - m : chunk);
    Quantised xm = {x.q + m * K, x.d + m * (K / 32), x.sums + m * (K / 32),
                    x.xs ? x.xs + m * (K / 32) : NULL};
    float *out = width == PANEL ? y + m * ldy : tail;
    int64_t ld = width == PANEL ? ldy : PANEL;
    if (bits == 4) vnni_chunk(rows, xm, c, s, shift, 4, zero, K, out, ld);
    else vnni_chunk(rows, xm, c, s, shift, 8, zero, K, out, ld);
    if (width < PANEL)
      for (int r = 0; r < rows; r++) memcpy(y + (m + r) * ldy, tail + r * PANEL, width * sizeof(float));
  }
}

/* a panel of a call of more than QWIDE rows over 4-bit codes: unpacked once to bytes, then chunks of QCHUNK rows,
 * the first reading the next panel's codes ahead; what vnni_qpanel computes, bit for bit. A function of its own,
 * after vnni_qpanel, so that vnni_qpanel's one-pass calls compile where they were (moving them moved an 8-row
 * pass by 6 %). */
VNNI __attribute__((noinline)) static void vnni_unpacked(Quantised x, const uint8_t *c, const float *s,
                                                         const float *shift, int64_t M, int64_t K, float *y,
                                                         int64_t ldy, int64_t width) {
  float tail[QCHUNK * PANEL];
  _Alignas(64) uint8_t bytes[UNPACKED_BYTES];
  vnni_unpack(c, K, bytes);
  for (int64_t m = 0; m < M; m += QCHUNK) {
    int rows = (int)(M - m < QCHUNK ? M - m : QCHUNK);
    Quantised xm = {x.q + m * K, x.d + m * (K / 32), x.sums + m * (K / 32), x.xs ? x.xs + m * (K / 32) : NULL};
    float *out = width == PANEL ? y + m * ldy : tail;
    int64_t ld = width == PANEL ? ldy : PANEL;
    if (m == 0) vnni_rows(QCHUNK, xm, bytes, s, shift, 8, 8, K, out, ld, c + K * 16);
    else vnni_chunk(rows, xm, bytes, s, shift, 8, 8, K, out, ld);
    if (width < PANEL)
      for (int r = 0; r < rows; r++) memcpy(y + (m + r) * ldy, tail + r * PANEL, width * sizeof(float));
  }
}

/* vnni_qpanel, or vnni_unpacked where it applies */
VNNI static void vnni_panel(Quantised x, const uint8_t *c, const float *s, const float *shift, int bits, int64_t M,
                            int64_t K, float *y, int64_t ldy, int64_t width) {
  if (bits == 4 && M > QWIDE && K * 32 <= UNPACKED_BYTES) vnni_unpacked(x, c, s, shift, M, K, y, ldy, width);
  else vnni_qpanel(x, c, s, shift, bits, M, K, y, ldy, width);
}
#endif

typedef void (*QPanelFn)(Quantised, const uint8_t *, const float *, const float *, int, int64_t, int64_t, float *,
                         int64_t, int64_t);
typedef void (*QuantiseFn)(const float *, int64_t, int64_t, int8_t *, float *, int32_t *, float *);
typedef struct { QPanelFn panel; QuantiseFn quantise; const char *name; } Int8Variant;

/* VNNI where the CPU has it (and RLXRT_CPU_KERNELS_ISA does not say generic), else generic C */
static Int8Variant choose_int8(void) {
  Int8Variant generic = {generic_qpanel, generic_quantise, "generic"};
  const char *isa = getenv("RLXRT_CPU_KERNELS_ISA");
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (!(isa && !strcmp(isa, "generic")) && __builtin_cpu_supports("avx512vnni") &&
      __builtin_cpu_supports("avx512bw"))
    return (Int8Variant){vnni_panel, vnni_quantise, "avx512vnni"};
#endif
  (void)isa;
  return generic;
}
