/* The int8-activation kernel's panels alone (backends/stream_int8.h), codes in cache, one thread: GMAC/s and a
 * hash of every output, so that two versions of the kernel can be compared for speed and for the same bits.
 *
 *     gcc -O3 -ffp-contract=fast -Ibackends -o /tmp/int8_panels scripts/int8_panels.c -lm
 *     /tmp/int8_panels M K N [repeats=20] [bits=4] [shift=0]
 *
 * M rows of random activations times an N-column weight of random codes (4- or 8-bit) and scales, K a multiple
 * of 32 and N of 32; the best of the repeats is printed. Build it from each version's header to compare them.
 */
#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define PANEL 32
#define AI static inline __attribute__((always_inline))
#include "stream_int8.h"

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s M K N [repeats] [bits] [shift]\n", argv[0]);
    return 2;
  }
  int64_t M = atoi(argv[1]), K = atoi(argv[2]), N = atoi(argv[3]), P = N / PANEL;
  int repeats = argc > 4 ? atoi(argv[4]) : 20, bits = argc > 5 ? atoi(argv[5]) : 4, shifted = argc > 6 && atoi(argv[6]);
  if (M < 1 || K < 32 || K % 32 || N < PANEL || N % PANEL || (bits != 4 && bits != 8) || K * 32 > UNPACKED_BYTES) {
    fprintf(stderr, "M >= 1, K a multiple of 32 up to %d, N a multiple of 32, bits 4 or 8\n", UNPACKED_BYTES / 32);
    return 2;
  }
  Int8Variant kernel = choose_int8();
  srand(1);
  float *a = malloc(M * K * sizeof(float)), *d = malloc(M * K / 32 * sizeof(float)), *xs = malloc(M * K / 32 * sizeof(float));
  int8_t *q = malloc(M * K);
  int32_t *sums = malloc(M * K / 32 * sizeof(int32_t));
  int64_t panel_bytes = bits == 4 ? K * 16 : K * 32;
  uint8_t *codes = malloc(P * panel_bytes);
  float *s = malloc(P * K * sizeof(float)), *shift = malloc(P * K * sizeof(float)), *y = malloc(M * N * sizeof(float));
  for (int64_t i = 0; i < M * K; i++) a[i] = (rand() / (float)RAND_MAX - 0.5f) * (float)(1 + i % 7);
  for (int64_t i = 0; i < P * panel_bytes; i++) codes[i] = (uint8_t)rand();
  for (int64_t i = 0; i < P * K; i++) s[i] = rand() / (float)RAND_MAX * 0.01f, shift[i] = rand() / (float)RAND_MAX * 0.01f;
  kernel.quantise(a, M, K, q, d, sums, xs);
  Quantised x = {q, d, sums, xs};
  double best = 1e30;
  for (int r = 0; r < repeats; r++) {
    double t = now();
    for (int64_t p = 0; p < P; p++)
      kernel.panel(x, codes + p * panel_bytes, s + p * K, shifted ? shift + p * K : NULL, bits, M, K, y + p * PANEL, N,
                   PANEL);
    t = now() - t;
    best = t < best ? t : best;
  }
  uint64_t h = 1469598103934665603ULL;
  for (int64_t i = 0; i < M * N; i++) {
    uint32_t u;
    memcpy(&u, y + i, 4);
    h = (h ^ u) * 1099511628211ULL;
  }
  printf("%s M=%lld K=%lld N=%lld bits=%d shift=%d: %.3f ms, %.1f GMAC/s, outputs hash %016llx\n", kernel.name,
         (long long)M, (long long)K, (long long)N, bits, shifted, best * 1e3, (double)(M * K * N) / best / 1e9,
         (unsigned long long)h);
  free(a), free(d), free(xs), free(q), free(sums), free(codes), free(s), free(shift), free(y);
  return 0;
}
