/*
 * The SIMD Philox4x32-10 loops, written once and instantiated per instruction set: included
 * (deliberately without an include guard) by philox4x32_avx2.h and philox4x32_avx512.h, each
 * of which first defines
 *
 *   RT_SIMD_NAME(f)        f's name on its path (f##_avx2)    RT_SIMD_TARGET  its target attribute
 *   RT_V, RT_W             the vector type and its 32-bit lanes
 *   RT_CHAINS              vectors in flight per step         RT_ORDER        the lanes' counters
 *   RT_SET1, RT_ADD, RT_XOR, RT_XOR3 (a ^ (b ^ c): a, the product, comes last), RT_MULHILO,
 *   RT_LOAD_ORDERED(p, order), RT_UNPACK{LO,HI}{32,64}, RT_STORE(p, v)
 *
 * and gets philox_rounds and philox_block for its path; the macros are undefined at the end.
 * Lane 4 * j + k of a vector holds counter k * RT_W / 4 + j (RT_ORDER), so that the 4 x 4
 * transposes within each 128-bit lane store the words of the vector's counters in order.
 */

/* Rounds first .. PHILOX_ROUNDS - 1 of Philox4x32-10 on RT_CHAINS vectors of counters, in
   place; (r0, r1) is round `first`'s key. `first` is a constant at each call, so the loop
   unrolls whole. Halfway, part `part` of ahead's prefetches (ahead may be NULL). */
RT_SIMD_TARGET static inline __attribute__((always_inline)) void RT_SIMD_NAME(philox_rounds)(
    RT_V *x0, RT_V *x1, RT_V *x2, RT_V *x3, uint32_t r0, uint32_t r1, int first,
    const rt_ahead *ahead, int part) {
    const RT_V multiplier0 = RT_SET1(0xD2511F53u), multiplier1 = RT_SET1(0xCD9E8D57u);
#pragma GCC unroll 10
    for (int round = first; round < PHILOX_ROUNDS; round++) {
        const RT_V key0 = RT_SET1(r0), key1 = RT_SET1(r1);
        if (ahead && round == PHILOX_ROUNDS / 2) rt_ahead_step(ahead, part);
#pragma GCC unroll 8
        for (int v = 0; v < RT_CHAINS; v++) {
            RT_V low0, low1;
            RT_V high0 = RT_MULHILO(x0[v], multiplier0, &low0);
            RT_V high1 = RT_MULHILO(x2[v], multiplier1, &low1);
            x0[v] = RT_XOR3(high1, x1[v], key0);
            x2[v] = RT_XOR3(high0, x3[v], key1);
            x1[v] = low1;
            x3[v] = low0;
        }
        r0 += PHILOX_KEY_STEP0;
        r1 += PHILOX_KEY_STEP1;
    }
}

/* words[4 * i + j] = word j of Philox4x32-10 at counter (lo[i], hi[i], c2, c3), i < m, RT_W
   counters per vector, RT_CHAINS vectors per step: lo and hi hold m rounded up to a step's
   RT_W * RT_CHAINS entries, and words room for m rounded up to RT_W counters (the padding is
   computed and written). lo == NULL: the counters are hi[0] * 2^32 + hi[1] + i, with
   hi[1] + m - 1 < 2^32 (rounds 1 and 2 then start from philox_consecutive_start). ahead (or
   NULL): memory to prefetch, a share per step in RT_AHEAD_PARTS parts. */
RT_SIMD_TARGET static void RT_SIMD_NAME(philox_block)(int m, const uint32_t *restrict lo,
                                                      const uint32_t *restrict hi, uint32_t c2,
                                                      uint32_t c3, uint32_t k0, uint32_t k1,
                                                      uint32_t *restrict words,
                                                      const rt_ahead *ahead) {
    const RT_V order = RT_ORDER;
    const RT_V multiplier0 = RT_SET1(0xD2511F53u), multiplier1 = RT_SET1(0xCD9E8D57u);
    const RT_V first_lo = RT_ADD(RT_SET1(lo ? 0 : hi[1]), order);
    const philox_consecutive run = philox_consecutive_start(lo ? 0 : hi[0], c2, c3, k0, k1);
    const RT_V round1_key3 = RT_SET1(run.round1_key3), round2_key1 = RT_SET1(run.round2_key1);
    const RT_V round2_key3 = RT_SET1(run.round2_key3), round2_low0 = RT_SET1(run.round2_low0);
    for (int start = 0; start < m; start += RT_W * RT_CHAINS) {
        const int part = RT_AHEAD_PARTS * (start / (RT_W * RT_CHAINS));
        if (ahead) rt_ahead_step(ahead, part);
        RT_V x0[RT_CHAINS], x1[RT_CHAINS], x2[RT_CHAINS], x3[RT_CHAINS];
        if (lo) {
#pragma GCC unroll 8
            for (int v = 0; v < RT_CHAINS; v++) {
                x0[v] = RT_LOAD_ORDERED(lo + start + RT_W * v, order);
                x1[v] = RT_LOAD_ORDERED(hi + start + RT_W * v, order);
                x2[v] = RT_SET1(c2);
                x3[v] = RT_SET1(c3);
            }
            RT_SIMD_NAME(philox_rounds)(x0, x1, x2, x3, k0, k1, 0, ahead, part + 1);
        } else {
#pragma GCC unroll 8
            for (int v = 0; v < RT_CHAINS; v++) {
                RT_V counter = RT_ADD(first_lo, RT_SET1(start + RT_W * v));
                RT_V low0, low1;
                RT_V high0 = RT_MULHILO(counter, multiplier0, &low0); /* round 1 */
                RT_V high1 = RT_MULHILO(RT_XOR(high0, round1_key3), multiplier1, &low1);
                x0[v] = RT_XOR(high1, round2_key1); /* round 2 */
                x1[v] = low1;
                x2[v] = RT_XOR(low0, round2_key3);
                x3[v] = round2_low0;
            }
            RT_SIMD_NAME(philox_rounds)(x0, x1, x2, x3, run.round3_k0, run.round3_k1, 2, ahead,
                                        part + 1);
        }
#pragma GCC unroll 8
        for (int v = 0; v < RT_CHAINS; v++) {
            if (start + RT_W * v >= m) break;
            RT_V t0 = RT_UNPACKLO32(x0[v], x1[v]), t1 = RT_UNPACKHI32(x0[v], x1[v]);
            RT_V t2 = RT_UNPACKLO32(x2[v], x3[v]), t3 = RT_UNPACKHI32(x2[v], x3[v]);
            uint32_t *out = words + 4 * (start + RT_W * v);
            RT_STORE(out, RT_UNPACKLO64(t0, t2));
            RT_STORE(out + RT_W, RT_UNPACKHI64(t0, t2));
            RT_STORE(out + 2 * RT_W, RT_UNPACKLO64(t1, t3));
            RT_STORE(out + 3 * RT_W, RT_UNPACKHI64(t1, t3));
        }
    }
}

#undef RT_SIMD_NAME
#undef RT_SIMD_TARGET
#undef RT_V
#undef RT_W
#undef RT_CHAINS
#undef RT_ORDER
#undef RT_SET1
#undef RT_ADD
#undef RT_XOR
#undef RT_XOR3
#undef RT_MULHILO
#undef RT_LOAD_ORDERED
#undef RT_UNPACKLO32
#undef RT_UNPACKHI32
#undef RT_UNPACKLO64
#undef RT_UNPACKHI64
#undef RT_STORE
