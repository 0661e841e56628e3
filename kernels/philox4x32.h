/*
 * Philox4x32-10, the counter-based generator every rng_tracker kernel draws from: the one C
 * definition, included by cpu_dropout.c and keyed_fill.c (and equal, word for word, to
 * rng_tracker.kernels.philox.philox4x32 and Triton's tl.philox).
 *
 * All functions are static inline, so each kernel's loops keep them inlined and vectorised.
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
