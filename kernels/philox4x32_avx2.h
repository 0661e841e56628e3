/*
 * Philox4x32-10 in AVX2 intrinsics, 8 counters per vector: the one definition, included by
 * cpu_dropout.c and keyed_fill.c, and word for word philox4x32.h's generator.
 *
 * Defines RT_X86_SIMD (1 where GCC or clang compile for x86) and, there, RT_AVX2 (the
 * per-function target attribute) and the AVX2 functions. The including file compiles its hot
 * loop once per instruction set and calls the AVX2 one only where rt_cpu_runs(RT_ISA_AVX2)
 * says the CPU runs it. Copied next to the .c file and hashed into the cache key by the
 * Python loaders.
 */
#ifndef RT_PHILOX4X32_AVX2_H
#define RT_PHILOX4X32_AVX2_H

#include <stdint.h>

#include "philox4x32.h"

/* Instruction-set paths: the codes the loaders pass (0 lets the kernel pick the fastest). */
enum { RT_ISA_AUTO = 0, RT_ISA_PORTABLE = 1, RT_ISA_AVX2 = 2 };

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define RT_X86_SIMD 1
#include <immintrin.h>
#define RT_AVX2 __attribute__((target("avx2")))
#else
#define RT_X86_SIMD 0
#endif

/* Whether this CPU (and OS) runs the instruction set `isa` (an RT_ISA_* code). */
static inline int rt_cpu_runs(int64_t isa) {
    if (isa == RT_ISA_PORTABLE) return 1;
#if RT_X86_SIMD
    __builtin_cpu_init();
    if (isa == RT_ISA_AVX2) return __builtin_cpu_supports("avx2") != 0;
#endif
    return 0;
}

/* The fastest instruction set this CPU runs. */
static inline int64_t rt_cpu_best(void) {
    return rt_cpu_runs(RT_ISA_AVX2) ? RT_ISA_AVX2 : RT_ISA_PORTABLE;
}

#define AVX2_CHAINS 4 /* independent vectors in flight: hides the multiplies' latency */
#define PHILOX_AVX2_STEP (8 * AVX2_CHAINS) /* counters per step of philox_block_avx2 */

/* Memory a caller needs next, requested while Philox computes: each step of
   philox_block_avx2 prefetches its share, so the lines arrive spread over the arithmetic
   (requested all at once, most wait behind the core's few outstanding misses). */
typedef struct {
    const char *read[2]; /* to be read (either may be NULL) */
    char *write;         /* to be written (NULL: none, or written around the caches) */
    int bytes;           /* of each stream */
    int step_bytes;      /* of each stream per step: a multiple of 64 */
} rt_ahead;

#if RT_X86_SIMD
/* (high, low) 32-bit halves of the 64-bit products a * multiplier, lane by lane (8 lanes). */
RT_AVX2 static inline __m256i mulhilo_avx2(__m256i a, __m256i multiplier, __m256i *low) {
    __m256i even = _mm256_mul_epu32(a, multiplier);                       /* lanes 0, 2, 4, 6 */
    __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), multiplier); /* lanes 1, 3, 5, 7 */
    *low = _mm256_mullo_epi32(a, multiplier);
    return _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

/* Rounds first .. PHILOX_ROUNDS - 1 of Philox4x32-10 on AVX2_CHAINS vectors of counters, in
   place; (r0, r1) is round `first`'s key. `first` is a constant at each call, so the loop
   unrolls whole. */
RT_AVX2 static inline __attribute__((always_inline)) void philox_rounds_avx2(
    __m256i *x0, __m256i *x1, __m256i *x2, __m256i *x3, uint32_t r0, uint32_t r1, int first) {
    const __m256i multiplier0 = _mm256_set1_epi32((int)0xD2511F53u);
    const __m256i multiplier1 = _mm256_set1_epi32((int)0xCD9E8D57u);
#pragma GCC unroll 10
    for (int round = first; round < PHILOX_ROUNDS; round++) {
        const __m256i key0 = _mm256_set1_epi32((int)r0), key1 = _mm256_set1_epi32((int)r1);
#pragma GCC unroll 8
        for (int v = 0; v < AVX2_CHAINS; v++) {
            __m256i low0, low1;
            __m256i keyed1 = _mm256_xor_si256(x1[v], key0), keyed3 = _mm256_xor_si256(x3[v], key1);
            __m256i high0 = mulhilo_avx2(x0[v], multiplier0, &low0);
            __m256i high1 = mulhilo_avx2(x2[v], multiplier1, &low1);
            x0[v] = _mm256_xor_si256(high1, keyed1);
            x2[v] = _mm256_xor_si256(high0, keyed3);
            x1[v] = low1;
            x3[v] = low0;
        }
        r0 += PHILOX_KEY_STEP0;
        r1 += PHILOX_KEY_STEP1;
    }
}

/* Step `step`'s share of a's prefetches. */
RT_AVX2 static inline __attribute__((always_inline)) void rt_ahead_step(const rt_ahead *a,
                                                                        int step) {
    const int first = step * a->step_bytes;
    const int end = first + a->step_bytes < a->bytes ? first + a->step_bytes : a->bytes;
    for (int b = first; b < end; b += 64) {
        if (a->read[0]) __builtin_prefetch(a->read[0] + b, 0, 3);
        if (a->read[1]) __builtin_prefetch(a->read[1] + b, 0, 3);
        if (a->write) __builtin_prefetch(a->write + b, 1, 3);
    }
}

/* words[4 * i + j] = word j of Philox4x32-10 at counter (lo[i], hi[i], c2, c3), i < m, 8
   counters per vector, AVX2_CHAINS vectors per step: lo and hi hold m rounded up to
   PHILOX_AVX2_STEP entries, and words room for m rounded up to 8 counters (the padding is
   computed and written). Counters are loaded into lanes 0, 2, 4, 6, 1, 3, 5, 7 of
   a vector, so that the 4 x 4 transposes within each 128-bit half store the words of
   counters 0..7 in order. ahead (or NULL): memory to prefetch, a share per step. */
RT_AVX2 static void philox_block_avx2(int m, const uint32_t *restrict lo,
                                      const uint32_t *restrict hi, uint32_t c2, uint32_t c3,
                                      uint32_t k0, uint32_t k1, uint32_t *restrict words,
                                      const rt_ahead *ahead) {
    const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    const __m256i multiplier0 = _mm256_set1_epi32((int)0xD2511F53u);
    const __m256i multiplier1 = _mm256_set1_epi32((int)0xCD9E8D57u);
    const uint32_t k0_2 = k0 + PHILOX_KEY_STEP0, k1_2 = k1 + PHILOX_KEY_STEP1;
    /* lo == NULL: the counters are hi[0] * 2^32 + hi[1] + i (hi[1] + m - 1 < 2^32), so words
       1, 2 and 3 are the same in every lane until round 1 multiplies word 0: rounds 1 and 2
       then need one vector product each, the other being the same scalar in every lane */
    const __m256i first_lo = _mm256_add_epi32(_mm256_set1_epi32(lo ? 0 : (int)hi[1]), order);
    const uint64_t product1 = (uint64_t)0xCD9E8D57u * c2;                 /* round 1 */
    const uint32_t word0 = (uint32_t)(product1 >> 32) ^ (lo ? 0 : hi[0]) ^ k0;
    const uint64_t product0 = (uint64_t)0xD2511F53u * word0;              /* round 2 */
    const __m256i round1_key3 = _mm256_set1_epi32((int)(c3 ^ k1));
    const __m256i round2_key1 = _mm256_set1_epi32((int)((uint32_t)product1 ^ k0_2));
    const __m256i round2_key3 = _mm256_set1_epi32((int)((uint32_t)(product0 >> 32) ^ k1_2));
    const __m256i round2_low0 = _mm256_set1_epi32((int)(uint32_t)product0);
    for (int start = 0; start < m; start += PHILOX_AVX2_STEP) {
        if (ahead) rt_ahead_step(ahead, start / PHILOX_AVX2_STEP);
        __m256i x0[AVX2_CHAINS], x1[AVX2_CHAINS], x2[AVX2_CHAINS], x3[AVX2_CHAINS];
        if (lo) {
#pragma GCC unroll 8
            for (int v = 0; v < AVX2_CHAINS; v++) {
                x0[v] = _mm256_permutevar8x32_epi32(
                    _mm256_loadu_si256((const __m256i *)(lo + start + 8 * v)), order);
                x1[v] = _mm256_permutevar8x32_epi32(
                    _mm256_loadu_si256((const __m256i *)(hi + start + 8 * v)), order);
                x2[v] = _mm256_set1_epi32((int)c2);
                x3[v] = _mm256_set1_epi32((int)c3);
            }
            philox_rounds_avx2(x0, x1, x2, x3, k0, k1, 0);
        } else {
#pragma GCC unroll 8
            for (int v = 0; v < AVX2_CHAINS; v++) {
                __m256i counter = _mm256_add_epi32(first_lo, _mm256_set1_epi32(start + 8 * v));
                __m256i low0, low1;
                __m256i high0 = mulhilo_avx2(counter, multiplier0, &low0); /* round 1 */
                __m256i word2 = _mm256_xor_si256(high0, round1_key3);
                __m256i high1 = mulhilo_avx2(word2, multiplier1, &low1);  /* round 2 */
                x0[v] = _mm256_xor_si256(high1, round2_key1);
                x1[v] = low1;
                x2[v] = _mm256_xor_si256(low0, round2_key3);
                x3[v] = round2_low0;
            }
            philox_rounds_avx2(x0, x1, x2, x3, k0_2 + PHILOX_KEY_STEP0, k1_2 + PHILOX_KEY_STEP1, 2);
        }
#pragma GCC unroll 8
        for (int v = 0; v < AVX2_CHAINS; v++) {
            if (start + 8 * v >= m) break;
            __m256i t0 = _mm256_unpacklo_epi32(x0[v], x1[v]);
            __m256i t1 = _mm256_unpackhi_epi32(x0[v], x1[v]);
            __m256i t2 = _mm256_unpacklo_epi32(x2[v], x3[v]);
            __m256i t3 = _mm256_unpackhi_epi32(x2[v], x3[v]);
            __m256i *out = (__m256i *)(words + 4 * (start + 8 * v));
            _mm256_storeu_si256(out, _mm256_unpacklo_epi64(t0, t2));
            _mm256_storeu_si256(out + 1, _mm256_unpackhi_epi64(t0, t2));
            _mm256_storeu_si256(out + 2, _mm256_unpacklo_epi64(t1, t3));
            _mm256_storeu_si256(out + 3, _mm256_unpackhi_epi64(t1, t3));
        }
    }
}
#endif

#endif /* RT_PHILOX4X32_AVX2_H */
