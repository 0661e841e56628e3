/*
 * Philox4x32-10 in AVX2 intrinsics, 8 counters per vector: included by cpu_dropout.c and
 * keyed_fill.c, and word for word philox4x32.h's generator. The loops are philox4x32_simd.h's;
 * this file gives them their AVX2 operations.
 *
 * Defines the AVX2 functions where RT_X86_SIMD (cpu_isa.h); the including file calls them
 * only where rt_cpu_runs(RT_ISA_AVX2) says the CPU runs AVX2. Copied next to the .c file and
 * hashed into the cache key by the Python loaders.
 */
#ifndef RT_PHILOX4X32_AVX2_H
#define RT_PHILOX4X32_AVX2_H

#include <stdint.h>

#include "cpu_isa.h"
#include "philox4x32.h"

#define AVX2_CHAINS 4 /* independent vectors in flight: hides the multiplies' latency */
#define PHILOX_AVX2_STEP (8 * AVX2_CHAINS) /* counters per step of philox_block_avx2 */

#if RT_X86_SIMD
/* (high, low) 32-bit halves of the 64-bit products a * multiplier, lane by lane (8 lanes). */
RT_AVX2 static inline __m256i mulhilo_avx2(__m256i a, __m256i multiplier, __m256i *low) {
    __m256i even = _mm256_mul_epu32(a, multiplier);                       /* lanes 0, 2, 4, 6 */
    __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), multiplier); /* lanes 1, 3, 5, 7 */
    *low = _mm256_mullo_epi32(a, multiplier);
    return _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

/* philox_rounds_avx2 and philox_block_avx2 (philox4x32_simd.h) */
#define RT_SIMD_NAME(f) f##_avx2
#define RT_SIMD_TARGET RT_AVX2
#define RT_V __m256i
#define RT_W 8
#define RT_CHAINS AVX2_CHAINS
#define RT_ORDER _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7)
#define RT_SET1(x) _mm256_set1_epi32((int)(x))
#define RT_ADD _mm256_add_epi32
#define RT_XOR _mm256_xor_si256
#define RT_XOR3(a, b, c) _mm256_xor_si256(a, _mm256_xor_si256(b, c))
#define RT_MULHILO mulhilo_avx2
#define RT_LOAD_ORDERED(p, order) \
    _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)(p)), order)
#define RT_UNPACKLO32 _mm256_unpacklo_epi32
#define RT_UNPACKHI32 _mm256_unpackhi_epi32
#define RT_UNPACKLO64 _mm256_unpacklo_epi64
#define RT_UNPACKHI64 _mm256_unpackhi_epi64
#define RT_STORE(p, v) _mm256_storeu_si256((__m256i *)(p), v)
#include "philox4x32_simd.h"
#endif

#endif /* RT_PHILOX4X32_AVX2_H */
