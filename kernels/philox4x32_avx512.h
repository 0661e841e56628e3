/*
 * Philox4x32-10 in AVX-512 intrinsics, 16 counters per vector: included by cpu_dropout.c and
 * keyed_fill.c, and word for word philox4x32.h's generator (the tests compare every path).
 * The loops are philox4x32_simd.h's; this file gives them their AVX-512 operations.
 *
 * Against the AVX2 loop, a round is 12 operations per 16 counters where AVX2 needs 16 per 8: a
 * two-source permute gathers the high halves of the even and odd products, and one ternary
 * logic op does each three-way xor. Measured choices (AMD Zen 4, which runs a 512-bit op as
 * two 256-bit halves): the low halves by vpmulld, not a second permute; 4 vectors in flight
 * (8 make Philox alone 10 % faster, but the dropout kernel no faster: its prefetches of the next
 * block, spread over half as many steps, came too late unless split into more parts).
 * Defined where RT_X86_SIMD (cpu_isa.h); the including file calls it only where
 * rt_cpu_runs(RT_ISA_AVX512) says the CPU runs AVX-512. Copied next to the .c file and hashed
 * into the cache key by the Python loaders.
 */
#ifndef RT_PHILOX4X32_AVX512_H
#define RT_PHILOX4X32_AVX512_H

#include <stdint.h>

#include "cpu_isa.h"
#include "philox4x32.h"

#define AVX512_CHAINS 4 /* independent vectors in flight: hides the multiplies' latency */
#define PHILOX_AVX512_STEP (16 * AVX512_CHAINS) /* counters per step of philox_block_avx512 */

#if RT_X86_SIMD
/* (high, low) 32-bit halves of the 64-bit products a * multiplier, lane by lane (16 lanes). */
RT_AVX512 static inline __m512i mulhilo_avx512(__m512i a, __m512i multiplier, __m512i *low) {
    const __m512i high_halves =
        _mm512_setr_epi32(1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    __m512i even = _mm512_mul_epu32(a, multiplier);                       /* lanes 0, 2, ... */
    __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), multiplier); /* lanes 1, 3, ... */
    *low = _mm512_mullo_epi32(a, multiplier);
    return _mm512_permutex2var_epi32(even, high_halves, odd);
}

/* philox_rounds_avx512 and philox_block_avx512 (philox4x32_simd.h) */
#define RT_SIMD_NAME(f) f##_avx512
#define RT_SIMD_TARGET RT_AVX512
#define RT_V __m512i
#define RT_W 16
#define RT_CHAINS AVX512_CHAINS
#define RT_ORDER _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15)
#define RT_SET1(x) _mm512_set1_epi32((int)(x))
#define RT_ADD _mm512_add_epi32
#define RT_XOR _mm512_xor_si512
#define RT_XOR3(a, b, c) _mm512_ternarylogic_epi32(a, b, c, 0x96)
#define RT_MULHILO mulhilo_avx512
#define RT_LOAD_ORDERED(p, order) _mm512_permutexvar_epi32(order, _mm512_loadu_si512(p))
#define RT_UNPACKLO32 _mm512_unpacklo_epi32
#define RT_UNPACKHI32 _mm512_unpackhi_epi32
#define RT_UNPACKLO64 _mm512_unpacklo_epi64
#define RT_UNPACKHI64 _mm512_unpackhi_epi64
#define RT_STORE(p, v) _mm512_storeu_si512(p, v)
#include "philox4x32_simd.h"
#endif

#endif /* RT_PHILOX4X32_AVX512_H */
