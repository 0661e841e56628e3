/*
 * Philox4x32-10, the counter-based generator every rng_tracker kernel draws from: the one C
 * definition, included by cpu_dropout.c and keyed_fill.c (and equal, word for word, to
 * rng_tracker.kernels.philox.philox4x32 and Triton's tl.philox).
 *
 * Also rt_ahead, the memory a caller asks the Philox loops of every path to prefetch;
 * philox_consecutive, what the SIMD loops share across a run of consecutive counters; the
 * block loops' type, philox_block_fn, with its portable instance; and philox_runs, a block loop
 * over 64-bit consecutive counters. All functions are static inline, so each kernel's loops
 * keep them inlined and vectorised.
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

/* An rt_ahead of `bytes` from each stream, shared out over the parts of a Philox loop that
   makes `counters` counters `step` at a time (RT_AHEAD_PARTS parts per step), whole 64-byte
   lines per part. */
static inline rt_ahead rt_ahead_over(const char *read0, const char *read1, char *write, int bytes,
                                     int counters, int step) {
    const int parts = RT_AHEAD_PARTS * ((counters + step - 1) / step);
    rt_ahead a = {{read0, read1}, write, bytes, ((bytes + parts - 1) / parts + 63) & ~63};
    return a;
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

/* A Philox loop over a block of counters, one per instruction-set path (philox_block_portable
   below; philox_block_avx2 and _avx512 in philox4x32_simd.h): words[4 * i + j] = word j of
   Philox4x32-10 at counter (lo[i], hi[i], c2, c3), i < m. lo and hi hold m rounded up to the
   path's step of counters (the padding is computed and ignored); lo == NULL: the counters are
   consecutive, hi[0] * 2^32 + hi[1] + i, with hi[1] + m - 1 < 2^32. ahead (or NULL): memory to
   prefetch meanwhile. words has room for m rounded up to the path's vector of counters. */
typedef void (*philox_block_fn)(int m, const uint32_t *restrict lo, const uint32_t *restrict hi,
                                uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1,
                                uint32_t *restrict words, const rt_ahead *ahead);

/* The portable philox_block_fn: structure of arrays, rounds outermost, so the compiler may
   vectorise the inner loops; it writes exactly m counters' words. It ignores `ahead`: at a
   quarter of the AVX2 path's speed, memory is a small part of its time. Its step is
   PHILOX_PORTABLE_STEP counters: wider would only cost a small tensor more padding. */
#define PHILOX_PORTABLE_STEP 32
static inline void philox_block_portable(int m, const uint32_t *restrict lo,
                                         const uint32_t *restrict hi, uint32_t c2, uint32_t c3,
                                         uint32_t k0, uint32_t k1, uint32_t *restrict words,
                                         const rt_ahead *ahead) {
    enum { STEP = PHILOX_PORTABLE_STEP };
    (void)ahead;
    for (int start = 0; start < m; start += STEP) {
        uint32_t x0[STEP], x1[STEP], x2[STEP], x3[STEP];
        if (lo) {
            for (int i = 0; i < STEP; i++) {
                x0[i] = lo[start + i];
                x1[i] = hi[start + i];
            }
        } else {
            for (int i = 0; i < STEP; i++) {
                x0[i] = hi[1] + (uint32_t)(start + i);
                x1[i] = hi[0];
            }
        }
        for (int i = 0; i < STEP; i++) {
            x2[i] = c2;
            x3[i] = c3;
        }
        int stored = m - start < STEP ? m - start : STEP;
        philox4x32_10_lanes(STEP, x0, x1, x2, x3, k0, k1, stored, words + 4 * start);
    }
}

/* words[4 * i + j] = word j of Philox4x32-10 at counter (first + i as two 32-bit words, c2, c3),
   i < m, by `block` on runs of consecutive counters that end where the low word would carry
   into the high one. words has room for m rounded up to `block`'s vector of counters. */
static inline __attribute__((always_inline)) void philox_runs(int m, uint64_t first, uint32_t c2,
                                                              uint32_t c3, uint32_t k0,
                                                              uint32_t k1,
                                                              uint32_t *restrict words,
                                                              philox_block_fn block) {
    int done = 0;
    while (done < m) {
        uint64_t start = first + (uint64_t)done;
        uint64_t room = 0x100000000u - (uint32_t)start;
        int run = (uint64_t)(m - done) < room ? m - done : (int)room;
        const uint32_t hi[2] = {(uint32_t)(start >> 32), (uint32_t)start};
        block(run, NULL, hi, c2, c3, k0, k1, words + 4 * done, NULL);
        done += run;
    }
}

#endif /* RT_PHILOX4X32_H */
