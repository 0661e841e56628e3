/*
 * Philox4x32-10, the counter-based generator every rng_tracker kernel draws from: the one C
 * definition, included by cpu_dropout.c and keyed_fill.c (and equal, word for word, to
 * rng_tracker.kernels.philox.philox4x32 and Triton's tl.philox).
 *
 * Also rt_ahead, the memory a caller asks the Philox loops of every path to prefetch, and
 * philox_consecutive, what the SIMD loops share across a run of consecutive counters. All
 * functions are static inline, so each kernel's loops keep them inlined and vectorised.
 * The Python loaders copy this header next to the .c file they compile and hash it into the
 * library's cache key.
 */
#ifndef RT_PHILOX4X32_H
#define RT_PHILOX4X32_H

#include <stdint.h>

#define PHILOX_ROUNDS 10
#define PHILOX_KEY_STEP0 0x9E3779B9u /* Weyl increments of the two key words per round */
#define PHILOX_KEY_STEP1 0xBB67AE85u

/* One round on the counter words (x0, x1, x2, x3) under the round key (k0, k1), in place. */
static inline void philox4x32_round(uint32_t *x0, uint32_t *x1, uint32_t *x2, uint32_t *x3,
                                    uint32_t k0, uint32_t k1) {
    uint64_t product0 = (uint64_t)0xD2511F53u * *x0;
    uint64_t product1 = (uint64_t)0xCD9E8D57u * *x2;
    uint32_t next0 = (uint32_t)(product1 >> 32) ^ *x1 ^ k0;
    uint32_t next2 = (uint32_t)(product0 >> 32) ^ *x3 ^ k1;
    *x1 = (uint32_t)product1;
    *x3 = (uint32_t)product0;
    *x0 = next0;
    *x2 = next2;
}

/* words[0 .. 4) = Philox4x32-10 of the counter (x0, x1, x2, x3) under the key (k0, k1). */
static inline void philox4x32_10(uint32_t x0, uint32_t x1, uint32_t x2, uint32_t x3,
                                 uint32_t k0, uint32_t k1, uint32_t *words) {
    for (int round = 0; round < PHILOX_ROUNDS; round++) {
        philox4x32_round(&x0, &x1, &x2, &x3, k0, k1);
        k0 += PHILOX_KEY_STEP0;
        k1 += PHILOX_KEY_STEP1;
    }
    words[0] = x0;
    words[1] = x1;
    words[2] = x2;
    words[3] = x3;
}

/* Memory a caller needs next, requested while Philox computes: each step of a SIMD Philox
   (philox_block_avx2, _avx512) prefetches its share in RT_AHEAD_PARTS parts, one before its
   rounds and one halfway through them, so the lines arrive spread over the arithmetic
   (requested all at once, most wait behind the core's few outstanding misses). */
#define RT_AHEAD_PARTS 2 /* not a setting: the SIMD loops issue parts `part` and `part + 1` */
typedef struct {
    const char *read[2]; /* to be read (either may be NULL) */
    char *write;         /* to be written (NULL: none, or written around the caches) */
    int bytes;           /* of each stream */
    int step_bytes;      /* of each stream per part of a step: a multiple of 64 */
} rt_ahead;

/* Part `step` of a's prefetches (parts count RT_AHEAD_PARTS per Philox step). */
static inline __attribute__((always_inline)) void rt_ahead_step(const rt_ahead *a, int step) {
    const int first = step * a->step_bytes;
    const int end = first + a->step_bytes < a->bytes ? first + a->step_bytes : a->bytes;
    for (int b = first; b < end; b += 64) {
        if (a->read[0]) __builtin_prefetch(a->read[0] + b, 0, 3);
        if (a->read[1]) __builtin_prefetch(a->read[1] + b, 0, 3);
        if (a->write) __builtin_prefetch(a->write + b, 1, 3);
    }
}

/* What rounds 1 and 2 share across a run of consecutive counters (hi * 2^32 + lo + i, no carry
   into hi) under c2, c3 and the key (k0, k1): words 1, 2 and 3 are the same for every counter
   until round 1 multiplies word 0, so round 1 needs one product per counter (word 0's) and
   round 2 one (word 2's); the rest are these scalars. The SIMD Philox loops start from them. */
typedef struct {
    uint32_t round1_key3; /* round 1: word 2 = high(M0 * word 0) ^ this */
    uint32_t round2_key1; /* round 2: word 0 = high(M1 * word 2) ^ this */
    uint32_t round2_key3; /* round 2: word 2 = low(M0 * word 0 of the counter) ^ this */
    uint32_t round2_low0; /* round 2: word 3 */
    uint32_t round3_k0, round3_k1; /* the key of round 3, where the full rounds resume */
} philox_consecutive;

static inline philox_consecutive philox_consecutive_start(uint32_t hi, uint32_t c2, uint32_t c3,
                                                          uint32_t k0, uint32_t k1) {
    const uint32_t k0_2 = k0 + PHILOX_KEY_STEP0, k1_2 = k1 + PHILOX_KEY_STEP1;
    const uint64_t product1 = (uint64_t)0xCD9E8D57u * c2;    /* round 1 */
    const uint32_t word0 = (uint32_t)(product1 >> 32) ^ hi ^ k0;
    const uint64_t product0 = (uint64_t)0xD2511F53u * word0; /* round 2 */
    philox_consecutive start = {c3 ^ k1,
                                (uint32_t)product1 ^ k0_2,
                                (uint32_t)(product0 >> 32) ^ k1_2,
                                (uint32_t)product0,
                                k0_2 + PHILOX_KEY_STEP0,
                                k1_2 + PHILOX_KEY_STEP1};
    return start;
}

/* Philox4x32-10 of n counters at once, held as a structure of arrays (counter i is (x0[i],
   x1[i], x2[i], x3[i]), overwritten), rounds outermost so that the loop over the counters
   vectorises; then words[4 * i + j] = word j of counter i for the first `stored` counters. */
static inline void philox4x32_10_lanes(int n, uint32_t *restrict x0, uint32_t *restrict x1,
                                       uint32_t *restrict x2, uint32_t *restrict x3, uint32_t k0,
                                       uint32_t k1, int stored, uint32_t *restrict words) {
    for (int round = 0; round < PHILOX_ROUNDS; round++) {
        for (int i = 0; i < n; i++) philox4x32_round(&x0[i], &x1[i], &x2[i], &x3[i], k0, k1);
        k0 += PHILOX_KEY_STEP0;
        k1 += PHILOX_KEY_STEP1;
    }
    for (int i = 0; i < stored; i++) {
        words[4 * i] = x0[i];
        words[4 * i + 1] = x1[i];
        words[4 * i + 2] = x2[i];
        words[4 * i + 3] = x3[i];
    }
}

#endif /* RT_PHILOX4X32_H */
