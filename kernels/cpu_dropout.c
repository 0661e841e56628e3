/*
 * Fused dropout on CPU, bitwise equal to rng_tracker.kernels.reference.
 *
 *   out = residual + where(keep, (x + bias) * scale, 0)   in fp32, rounded once to x's dtype
 *
 * Element l of the local tensor sits at global flat index g under the affine index map
 * g = offset + sum_d i_d * stride_d (i_d: l's index in merged dim d, outermost first). It is
 * kept iff word g % 4 of Philox4x32-10(key, counter (lo32(c), hi32(c), c2, c3)) with
 * c = base + g / 4 is >= threshold. Work runs in blocks: the block's distinct counters
 * first, then Philox over them (SIMD lanes, one counter per lane), then one pass that applies
 * the words.
 *
 * Instruction sets: the whole chunk loop is compiled once per path - "portable" (the
 * compiler's baseline for the target, any architecture) and, on x86-64 with GCC or clang,
 * "avx2" (per-function target attribute; Philox and the fp32/bf16 apply pass in AVX2
 * intrinsics, fp16's apply vectorised by the compiler) and "avx512" (Philox in AVX-512, the
 * apply pass avx2's). The path is picked at run time from
 * the CPU's features (__builtin_cpu_supports), or forced by the caller (tests compare every
 * path bitwise). Every path does the same integer and fp32 arithmetic, element by element, so
 * the output bits do not depend on the path.
 *
 * Built (with the headers it includes) by rng_tracker/kernels/_cpu_kernel.py through
 * _c_build.py with the system C compiler and loaded with ctypes; plain C11 and pthreads, no
 * torch headers. Compile with -ffp-contract=off: a fused multiply-add of residual +
 * value * scale would round once where the reference rounds twice. On Linux, a large output's
 * fresh pages are mapped a piece at a time, just ahead of the loop (fresh_pages.h).
 */
#ifndef _DEFAULT_SOURCE
#define _DEFAULT_SOURCE /* madvise, mincore */
#endif
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "f32_bits.h"
#include "fresh_pages.h"
#include "philox4x32.h"
#include "philox4x32_avx2.h"
#include "philox4x32_avx512.h"

#define RT_ABI_VERSION 2
#define RT_MAX_DIMS 64
#define BLOCK 1024 /* elements per block: a multiple of 4 * LANES */
#define LANES 64   /* counters per SIMD step, padded up to: the widest path's needs */
_Static_assert(LANES % PHILOX_AVX2_STEP == 0 && LANES % PHILOX_AVX512_STEP == 0,
               "a block's counters pad to every SIMD Philox's step");
/* outputs in reused memory (pages already mapped) of at least this many bytes are written with
   non-temporal stores: beyond the caches, they skip reading the output's lines before writing
   them (a third of the traffic); a fresh output is written through the cache (fresh_pages.h) */
#define STREAM_BYTES (16 << 20)
/* a thread whose part of x has at least this many bytes prefetches each next block while it
   computes (above the largest per-core L2 in use, 2 MiB): smaller parts are in the caches, where
   prefetches only add instructions (~5 % of a call) */
#define AHEAD_BYTES (2 << 20)

enum { RT_F32 = 0, RT_F16 = 1, RT_BF16 = 2 };

int64_t rt_abi_version(void) { return RT_ABI_VERSION; }

/* ---- fp16 / bf16 <-> fp32, with the rounding torch's CPU casts use ---- */

/* Both conversions compute every case and pick one with bit masks, so the loops that call them
   have no branches and vectorise (a branch around an fp operation would not: it may trap). */

static inline uint32_t pick(int condition, uint32_t if_true, uint32_t if_false) {
    uint32_t mask = -(uint32_t)(condition != 0);
    return (if_true & mask) | (if_false & ~mask);
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t body = (uint32_t)(h & 0x7fffu) << 13; /* exponent and mantissa, fp32-aligned */
    uint32_t exponent = body & 0x0f800000u;
    uint32_t normal = body + 0x38000000u;   /* exponent + 112 */
    uint32_t inf_nan = body + 0x70000000u;  /* exponent 31 -> 255, payload kept */
    /* zero or subnormal: (1 + m / 2^10) * 2^-14 - 2^-14 = m * 2^-24, exactly */
    uint32_t subnormal = f32_to_bits(bits_to_f32(body + 0x38800000u) - 0x1p-14f);
    uint32_t magnitude =
        pick(exponent == 0x0f800000u, inf_nan, pick(exponent == 0, subnormal, normal));
    return bits_to_f32(sign | magnitude);
}

static inline uint16_t f32_to_f16(float f) {
    uint32_t u = f32_to_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t magnitude = u & 0x7fffffffu;
    /* NaN: quiet, the payload's top bits kept (as F16C does) */
    uint32_t nan = 0x7e00u | ((magnitude >> 13) & 0x3ffu);
    /* below 2^-14, fp16's smallest normal: adding 0.5 puts the subnormal's 10 bits at the
       bottom of the sum, rounded to nearest even by the fp32 addition itself */
    uint32_t subnormal = f32_to_bits(bits_to_f32(magnitude) + 0.5f) - 0x3f000000u;
    /* rebias the exponent (127 -> 15), round to nearest even on the 13 dropped bits; a carry
       out of the mantissa rounds up into the exponent (65520 -> inf) */
    uint32_t normal = (magnitude - 0x38000000u + 0xfffu + ((magnitude >> 13) & 1u)) >> 13;
    uint32_t half = pick(magnitude > 0x7f800000u, nan,
                         pick(magnitude >= 0x47800000u, 0x7c00u, /* >= 2^16, inf: inf */
                              pick(magnitude < 0x38800000u, subnormal, normal)));
    return (uint16_t)(sign | half);
}

static inline uint16_t f32_to_bf16(float f, uint16_t nan_bits) {
    uint32_t u = f32_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return nan_bits;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float load(const void *restrict p, int64_t i, int dtype) {
    if (dtype == RT_F32) return ((const float *)p)[i];
    if (dtype == RT_F16) return f16_to_f32(((const uint16_t *)p)[i]);
    return bits_to_f32((uint32_t)((const uint16_t *)p)[i] << 16);
}

static inline void store(void *restrict p, int64_t i, float v, int dtype, uint16_t bf16_nan) {
    if (dtype == RT_F32) ((float *)p)[i] = v;
    else if (dtype == RT_F16) ((uint16_t *)p)[i] = f32_to_f16(v);
    else ((uint16_t *)p)[i] = f32_to_bf16(v, bf16_nan);
}

/* ---- the index map, walked as an odometer over the merged dims ---- */

typedef struct {
    int ndims;
    int64_t extent[RT_MAX_DIMS], stride[RT_MAX_DIMS], index[RT_MAX_DIMS];
    int64_t g; /* global index of the current element */
} odometer;

static void odometer_start(odometer *o, const int64_t *map, int ndims, int64_t local) {
    o->ndims = ndims;
    o->g = map[0];
    for (int d = ndims - 1; d >= 0; d--) {
        o->extent[d] = map[1 + 2 * d];
        o->stride[d] = map[2 + 2 * d];
        o->index[d] = local % o->extent[d];
        local /= o->extent[d];
        o->g += o->index[d] * o->stride[d];
    }
}

/* Advance by `step` elements; step divides the innermost extent unless there is one dim. */
static inline void odometer_step(odometer *o, int64_t step) {
    int d = o->ndims - 1;
    o->index[d] += step;
    o->g += step * o->stride[d];
    while (d > 0 && o->index[d] >= o->extent[d]) {
        o->g -= o->index[d] * o->stride[d];
        o->index[d] = 0;
        d--;
        o->index[d] += 1;
        o->g += o->stride[d];
    }
}

/* ---- one call ---- */

typedef struct {
    const void *x, *bias, *residual;
    void *out;
    int dtype;
    int64_t numel, hidden;
    const int64_t *map; /* offset, extent0, stride0, extent1, stride1, ... */
    int ndims, aligned;
    uint32_t k0, k1, c2, c3, threshold;
    int keep_none; /* threshold 2**32 (p = 1): no word is kept */
    uint64_t base;
    float scale;
    uint16_t bf16_nan;
    int isa;    /* RT_ISA_PORTABLE, RT_ISA_AVX2 or RT_ISA_AVX512 */
    int fresh;  /* the output is a new mapping: its pages are mapped ahead of the loop */
    int stream; /* write the output with non-temporal stores (where the path has them) */
    int in_place; /* out is x: each block is made in `staged`, then copied over x */
} job;

typedef struct {
    const job *job;
    int64_t begin, end; /* local elements; begin is a multiple of BLOCK */
} chunk;

/* out[i] for i in [0, n): inlined with constant dtype/has_bias/has_residual, so each of the
   nine variants is its own branch-free loop the compiler can vectorise (for the path's ISA). */
static inline __attribute__((always_inline)) void apply(
    int n, const uint32_t *restrict word, uint32_t threshold, float scale,
    const void *restrict x, const void *restrict bias, const void *restrict residual,
    void *restrict out, int dtype, int has_bias, int has_residual, uint16_t bf16_nan) {
    for (int i = 0; i < n; i++) {
        float value = load(x, i, dtype);
        if (has_bias) value = value + load(bias, i, dtype);
        /* dropped: +0.0, by masking the bits (a branch around the multiply would not vectorise) */
        value = bits_to_f32(pick(word[i] >= threshold, f32_to_bits(value * scale), 0));
        if (has_residual) value = load(residual, i, dtype) + value;
        store(out, i, value, dtype, bf16_nan);
    }
}

typedef void (*apply_fn)(int n, const uint32_t *restrict word, uint32_t threshold, float scale,
                         const void *restrict x, const void *restrict bias,
                         const void *restrict residual, void *restrict out, int dtype,
                         int has_bias, int has_residual, uint16_t bf16_nan);

/* apply_avx2 and apply_portable: the three bias/residual variants of `fn` for one dtype. */
#define RT_APPLY_VARIANTS(fn, dtype)                                                          \
    if (has_bias)                                                                             \
        fn(n, word, threshold, scale, x, bias, residual, out, dtype, 1, 1, bf16_nan);         \
    else if (has_residual)                                                                    \
        fn(n, word, threshold, scale, x, NULL, residual, out, dtype, 0, 1, bf16_nan);         \
    else                                                                                      \
        fn(n, word, threshold, scale, x, NULL, NULL, out, dtype, 0, 0, bf16_nan);

#if RT_X86_SIMD
/* The 16 elements of p from index i as two fp32 vectors (bf16: its bits are fp32's top half).
   fp32: elements 0-7 and 8-15. bf16: 0-3, 8-11 and 4-7, 12-15, the order in which unpacking
   16-bit halves works within 128-bit lanes; packing the results back undoes it for free. */
RT_AVX2 static inline __attribute__((always_inline)) void load16_avx2(const void *restrict p,
                                                                      int i, int dtype,
                                                                      __m256 *a, __m256 *b) {
    if (dtype == RT_F32) {
        *a = _mm256_loadu_ps((const float *)p + i);
        *b = _mm256_loadu_ps((const float *)p + i + 8);
        return;
    }
    const __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    *a = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), raw));
    *b = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), raw));
}

/* The 16 keep words from index i, in load16_avx2's order for dtype. */
RT_AVX2 static inline __attribute__((always_inline)) void words16_avx2(
    const uint32_t *restrict word, int i, int dtype, __m256i *a, __m256i *b) {
    const __m256i low = _mm256_loadu_si256((const __m256i *)(word + i));
    const __m256i high = _mm256_loadu_si256((const __m256i *)(word + i + 8));
    *a = dtype == RT_F32 ? low : _mm256_permute2x128_si256(low, high, 0x20);
    *b = dtype == RT_F32 ? high : _mm256_permute2x128_si256(low, high, 0x31);
}

/* f32_to_bf16 on 8 lanes that hold no NaN, each result in the low 16 bits of its lane. */
RT_AVX2 static inline __attribute__((always_inline)) __m256i round_bf16_finite_avx2(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
}

/* f32_to_bf16 on 8 lanes: NaN lanes take the bits `nan`. */
RT_AVX2 static inline __attribute__((always_inline)) __m256i round_bf16_avx2(__m256 v,
                                                                             __m256i nan) {
    const __m256i magnitude =
        _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7fffffff));
    const __m256i is_nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(round_bf16_finite_avx2(v), nan, is_nan);
}

/* apply() on 8 elements (their x, bias, residual and keep words loaded): the same fp32
   operations in the same order. */
RT_AVX2 static inline __attribute__((always_inline)) __m256 value8_avx2(
    __m256 value, __m256 bias, __m256 residual, __m256i w, __m256i threshold, __m256 scale,
    int has_bias, int has_residual) {
    if (has_bias) value = _mm256_add_ps(value, bias);
    const __m256i keep = _mm256_cmpeq_epi32(_mm256_max_epu32(w, threshold), w); /* w >= t */
    value = _mm256_and_ps(_mm256_mul_ps(value, scale), _mm256_castsi256_ps(keep));
    if (has_residual) value = _mm256_add_ps(residual, value);
    return value;
}

/* apply() for fp32 or bf16 (a constant at each call), 16 elements per step. */
RT_AVX2 static inline __attribute__((always_inline)) void apply_avx2_variant(
    int n, const uint32_t *restrict word, uint32_t threshold, float scale,
    const void *restrict x, const void *restrict bias, const void *restrict residual,
    void *restrict out, int dtype, int has_bias, int has_residual, uint16_t bf16_nan) {
    const __m256i t = _mm256_set1_epi32((int)threshold), nan = _mm256_set1_epi32(bf16_nan);
    const __m256 s = _mm256_set1_ps(scale);
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 xa, xb, ba = s, bb = s, ra = s, rb = s; /* bias, residual: set where used */
        __m256i wa, wb;
        load16_avx2(x, i, dtype, &xa, &xb);
        if (has_bias) load16_avx2(bias, i, dtype, &ba, &bb);
        if (has_residual) load16_avx2(residual, i, dtype, &ra, &rb);
        words16_avx2(word, i, dtype, &wa, &wb);
        __m256 a = value8_avx2(xa, ba, ra, wa, t, s, has_bias, has_residual);
        __m256 b = value8_avx2(xb, bb, rb, wb, t, s, has_bias, has_residual);
        if (dtype == RT_F32) {
            _mm256_storeu_ps((float *)out + i, a);
            _mm256_storeu_ps((float *)out + i + 8, b);
        } else { /* packing a's and b's 16-bit results restores the elements' order */
            __m256i packed;
            /* a lane of (a, b) is unordered iff a or b holds a NaN there */
            if (_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q))) /* rare: NaN lanes */
                packed = _mm256_packus_epi32(round_bf16_avx2(a, nan), round_bf16_avx2(b, nan));
            else
                packed = _mm256_packus_epi32(round_bf16_finite_avx2(a), round_bf16_finite_avx2(b));
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), packed);
        }
    }
    const int size = dtype == RT_F32 ? 4 : 2; /* the tail, fewer than 16 elements */
    apply(n - i, word + i, threshold, scale, (const char *)x + i * size,
          has_bias ? (const char *)bias + i * size : NULL,
          has_residual ? (const char *)residual + i * size : NULL, (char *)out + i * size, dtype,
          has_bias, has_residual, bf16_nan);
}
#endif

/* An apply_fn that runs `wide` (a per-dtype apply inlined with constant arguments) on fp32 and
   bf16 and the compiler's vectorisation of apply() on fp16. */
#define RT_APPLY_PATH(name, attributes, wide)                                                  \
    attributes static void name(int n, const uint32_t *restrict word, uint32_t threshold,      \
                                float scale, const void *restrict x,                           \
                                const void *restrict bias, const void *restrict residual,      \
                                void *restrict out, int dtype, int has_bias, int has_residual, \
                                uint16_t bf16_nan) {                                           \
        if (dtype == RT_F32) {                                                                 \
            RT_APPLY_VARIANTS(wide, RT_F32)                                                    \
        } else if (dtype == RT_BF16) {                                                         \
            RT_APPLY_VARIANTS(wide, RT_BF16)                                                   \
        } else {                                                                               \
            RT_APPLY_VARIANTS(apply, RT_F16)                                                   \
        }                                                                                      \
    }

RT_APPLY_PATH(apply_portable, , apply)
#if RT_X86_SIMD
RT_APPLY_PATH(apply_avx2, RT_AVX2, apply_avx2_variant)
#endif

/* lo/hi[k .. k + n) = the 32-bit halves of the consecutive counters first, first + 1, ... */
static inline __attribute__((always_inline)) void consecutive(uint32_t *restrict lo,
                                                              uint32_t *restrict hi, int n,
                                                              uint64_t first) {
    for (int i = 0; i < n; i++) {
        uint64_t c = first + (uint64_t)i;
        lo[i] = (uint32_t)c;
        hi[i] = (uint32_t)(c >> 32);
    }
}

typedef void (*stream_fn)(char *restrict target, const char *restrict staged, int64_t bytes);

/* target[0 .. bytes) = staged[0 .. bytes), through the cache: an in-place call's block, whose
   lines the apply pass has just read */
static void copy_block(char *restrict target, const char *restrict staged, int64_t bytes) {
    memcpy(target, staged, (size_t)bytes);
}

static inline __attribute__((always_inline)) void run_chunk(const chunk *c, int dtype,
                                                            int has_bias, int has_residual,
                                                            philox_block_fn philox, int philox_step,
                                                            stream_fn stream_out,
                                                            apply_fn apply_block) {
    const job *j = c->job;
    const int64_t size = dtype == RT_F32 ? 4 : 2;
    char *const out_begin = (char *)j->out + c->begin * size;
    page_span fresh = {NULL, NULL};
    if (j->fresh) fresh = page_span_of(out_begin, out_begin + (c->end - c->begin) * size);
    const stream_fn stream = j->in_place ? copy_block : j->stream ? stream_out : NULL;
    _Alignas(64) char staged[4 * BLOCK];
    uint32_t lo[BLOCK + LANES], hi[BLOCK + LANES]; /* a block's counters, padded to LANES */
    uint32_t words[4 * BLOCK + 4 * LANES], word[BLOCK];
    odometer o;
    odometer_start(&o, j->map, j->ndims, c->begin);
    const int last = j->ndims - 1;
    const int ahead_on = (c->end - c->begin) * size >= AHEAD_BYTES;
    int64_t column = has_bias ? c->begin % j->hidden : 0;
    for (int64_t start = c->begin; start < c->end; start += BLOCK) {
        int n = (int)(c->end - start < BLOCK ? c->end - start : BLOCK);
        const uint32_t *keep_word = words;
        int groups = 0;
        const uint32_t *counter_lo = lo;
        if (j->aligned) { /* elements 4k..4k+3 of the block are group k: one counter each */
            int wanted = (n + 3) / 4;
            uint64_t first = j->base + (uint64_t)(o.g >> 2);
            int64_t row = last > 0 ? (o.extent[last] - o.index[last]) / 4 : wanted;
            if (row >= wanted && (uint64_t)(uint32_t)first + (uint64_t)wanted <= 0x100000000u) {
                /* one run of consecutive counters, no carry into the high word: generated in
                   the Philox loop itself */
                counter_lo = NULL;
                hi[0] = (uint32_t)(first >> 32);
                hi[1] = (uint32_t)first;
                groups = wanted;
                odometer_step(&o, 4 * (int64_t)wanted);
            }
            while (groups < wanted) { /* runs of consecutive counters along the innermost dim */
                int64_t run = wanted - groups;
                if (last > 0 && (o.extent[last] - o.index[last]) / 4 < run)
                    run = (o.extent[last] - o.index[last]) / 4;
                consecutive(lo + groups, hi + groups, (int)run, j->base + (uint64_t)(o.g >> 2));
                groups += (int)run;
                odometer_step(&o, 4 * run);
            }
        }
        uint16_t slot[BLOCK];
        uint8_t lane[BLOCK];
        if (!j->aligned) { /* one counter per run of elements in the same global group */
            int64_t previous = -1;
            for (int e = 0; e < n; e++) {
                int64_t group = o.g >> 2;
                if (group != previous) {
                    uint64_t counter = j->base + (uint64_t)group;
                    lo[groups] = (uint32_t)counter;
                    hi[groups++] = (uint32_t)(counter >> 32);
                    previous = group;
                }
                slot[e] = (uint16_t)(groups - 1);
                lane[e] = (uint8_t)(o.g & 3);
                odometer_step(&o, 1);
            }
        }
        if (counter_lo)
            for (int k = groups; k % LANES; k++) lo[k] = hi[k] = 0; /* padding */
        /* the next block's x, residual and output, fetched while this block's words are made:
           on one core the memory then overlaps the arithmetic instead of following it */
        rt_ahead ahead = {{NULL, NULL}, NULL, 0, 0};
        const int64_t next = start + BLOCK;
        if (ahead_on && next + BLOCK <= c->end) /* a whole next block, in this part */
            ahead = rt_ahead_over((const char *)j->x + next * size,
                                  has_residual ? (const char *)j->residual + next * size : NULL,
                                  stream ? NULL : (char *)j->out + next * size,
                                  (int)(BLOCK * size), groups, philox_step);
        philox(groups, counter_lo, hi, j->c2, j->c3, j->k0, j->k1, words,
               ahead.bytes ? &ahead : NULL);
        if (!j->aligned) {
            for (int e = 0; e < n; e++) word[e] = words[4 * slot[e] + lane[e]];
            keep_word = word;
        }
        if (j->keep_none) memset(word, 0, sizeof word), keep_word = word;
        const char *x = (const char *)j->x + start * size;
        const char *residual = has_residual ? (const char *)j->residual + start * size : NULL;
        char *target = (char *)j->out + start * size;
        map_ahead(&fresh, target + n * size);
        /* streaming: the block is written to `staged` (in L1), then copied out with
           non-temporal stores, so a large output is not read into the cache first; in place,
           copied over x once the block is read (apply's pointers must not alias) */
        char *out = stream ? staged : target;
        if (!has_bias) {
            apply_block(n, keep_word, j->threshold, j->scale, x, NULL, residual, out, dtype, 0,
                        has_residual, j->bf16_nan);
        } else {
            /* runs of the block that lie in one row, so the bias is read contiguously */
            for (int e = 0; e < n;) {
                int run = (int)(j->hidden - column < n - e ? j->hidden - column : n - e);
                apply_block(run, keep_word + e, j->threshold, j->scale, x + e * size,
                            (const char *)j->bias + column * size, residual + e * size,
                            out + e * size, dtype, 1, has_residual, j->bf16_nan);
                e += run;
                column += run;
                if (column == j->hidden) column = 0;
            }
        }
        if (stream) stream(target, staged, n * size);
    }
}

#define RT_VARIANTS(dtype, philox, step, stream, apply)                                  \
    if (c->job->bias) run_chunk(c, dtype, 1, 1, philox, step, stream, apply);            \
    else if (c->job->residual) run_chunk(c, dtype, 0, 1, philox, step, stream, apply);   \
    else run_chunk(c, dtype, 0, 0, philox, step, stream, apply);

#define RT_CHUNK_PATH(name, attributes, philox, step, stream, apply)                     \
    attributes static void name(const chunk *c) {                                        \
        switch (c->job->dtype) {                                                         \
        case RT_F32: RT_VARIANTS(RT_F32, philox, step, stream, apply) break;             \
        case RT_F16: RT_VARIANTS(RT_F16, philox, step, stream, apply) break;             \
        default: RT_VARIANTS(RT_BF16, philox, step, stream, apply) break;                \
        }                                                                                \
    }

RT_CHUNK_PATH(run_chunk_portable, , philox_block_portable, PHILOX_PORTABLE_STEP, NULL,
              apply_portable)
#if RT_X86_SIMD
/* target[0 .. bytes) = staged[0 .. bytes) with non-temporal stores where target is 32-byte
   aligned (a torch allocation and a block's start are), plain stores for the rest. */
RT_AVX2 static void stream_out_avx2(char *restrict target, const char *restrict staged,
                                    int64_t bytes) {
    int64_t head = (int64_t)((32 - ((uintptr_t)target & 31)) & 31);
    if (head > bytes) head = bytes;
    memcpy(target, staged, (size_t)head);
    int64_t i = head;
    for (; i + 32 <= bytes; i += 32)
        _mm256_stream_si256((__m256i *)(target + i),
                            _mm256_loadu_si256((const __m256i *)(staged + i)));
    memcpy(target + i, staged + i, (size_t)(bytes - i));
}
RT_CHUNK_PATH(run_chunk_avx2, RT_AVX2, philox_block_avx2, PHILOX_AVX2_STEP, stream_out_avx2,
              apply_avx2)
RT_CHUNK_PATH(run_chunk_avx512, RT_AVX512, philox_block_avx512, PHILOX_AVX512_STEP,
              stream_out_avx2, apply_avx2)
#endif

/* Whether this CPU (and OS) runs the instruction set `isa` (an RT_ISA_* code). */
int64_t rt_isa_supported(int64_t isa) { return rt_cpu_runs(isa); }

/* The fastest instruction set this CPU runs. */
int64_t rt_isa_best(void) { return rt_cpu_best(); }

static void *run_chunk_any(void *arg) {
    const chunk *c = (const chunk *)arg;
    switch (c->job->isa) {
#if RT_X86_SIMD
    case RT_ISA_AVX512: run_chunk_avx512(c); break;
    case RT_ISA_AVX2: run_chunk_avx2(c); break;
#endif
    default: run_chunk_portable(c); return NULL;
    }
#if RT_X86_SIMD
    if (c->job->stream) _mm_sfence(); /* the streamed stores are visible before the join */
#endif
    return NULL;
}

enum { /* the slots of rt_fused_dropout's args */
    ARG_DTYPE, ARG_NUMEL, ARG_HIDDEN, ARG_ALIGNED, ARG_KEY, ARG_BASE, ARG_C2, ARG_C3,
    ARG_THRESHOLD, ARG_SCALE_BITS, ARG_BF16_NAN, ARG_THREADS, ARG_ISA, ARG_NDIMS, ARG_MAP
};

/*
 * x, bias (hidden elements, or NULL; only with a residual), residual (or NULL), out:
 * contiguous, numel elements of `dtype`; out is x itself (in place) or overlaps none of them. args: the ARG_* values (key and base as int64 bit
 * patterns, scale as its fp32 bits), then the index map from ARG_MAP: offset and ndims
 * (extent, stride) pairs. Splits the work over up to `threads` threads (the caller's thread
 * included). ARG_ISA: RT_ISA_AUTO (the fastest this CPU runs) or an RT_ISA_* code to force.
 * Returns 0; or, writing nothing, -1 for arguments it cannot take, -2 for a forced instruction
 * set this CPU does not run.
 */
int64_t rt_fused_dropout(const void *x, const void *bias, const void *residual, void *out,
                         const int64_t *args) {
    int64_t dtype = args[ARG_DTYPE], numel = args[ARG_NUMEL], hidden = args[ARG_HIDDEN];
    int64_t ndims = args[ARG_NDIMS], threads = args[ARG_THREADS], isa = args[ARG_ISA];
    uint64_t threshold = (uint64_t)args[ARG_THRESHOLD], key = (uint64_t)args[ARG_KEY];
    if (numel == 0) return 0; /* empty tensors may have NULL data */
    if (dtype < RT_F32 || dtype > RT_BF16 || numel < 0 || ndims < 1 || ndims > RT_MAX_DIMS ||
        (bias && (!residual || hidden < 1)) || threshold > 0x100000000u)
        return -1;
    if (isa != RT_ISA_AUTO && !rt_isa_supported(isa)) return -2;
    if (isa == RT_ISA_AUTO) isa = rt_isa_best();
    const int64_t bytes = numel * (dtype == RT_F32 ? 4 : 2);
    /* decided once, before the threads: a fresh output is written through the cache, which
       holds its pages zeroed (map_ahead); reused memory of STREAM_BYTES and more is streamed */
    const int in_place = out == x;
    const int fresh = !in_place && fresh_output(out, (char *)out + bytes);
    job j = {x, bias, residual, out, (int)dtype, numel, hidden, args + ARG_MAP, (int)ndims,
             args[ARG_ALIGNED] != 0, (uint32_t)key, (uint32_t)(key >> 32),
             (uint32_t)args[ARG_C2], (uint32_t)args[ARG_C3],
             threshold > 0xffffffffu ? 0xffffffffu : (uint32_t)threshold,
             threshold > 0xffffffffu, (uint64_t)args[ARG_BASE],
             bits_to_f32((uint32_t)args[ARG_SCALE_BITS]), (uint16_t)args[ARG_BF16_NAN], (int)isa,
             fresh, !fresh && !in_place && bytes >= STREAM_BYTES, in_place};
    int64_t blocks = (numel + BLOCK - 1) / BLOCK;
    if (threads > blocks) threads = blocks;
    if (threads < 1) threads = 1;
    if (threads > 256) threads = 256;
    chunk chunks[256];
    pthread_t workers[256];
    int started[256] = {0};
    for (int64_t t = 0; t < threads; t++) {
        chunks[t].job = &j;
        chunks[t].begin = blocks * t / threads * BLOCK;
        int64_t end = blocks * (t + 1) / threads * BLOCK;
        chunks[t].end = end < numel ? end : numel;
    }
    for (int64_t t = 1; t < threads; t++)
        started[t] = pthread_create(&workers[t], NULL, run_chunk_any, &chunks[t]) == 0;
    run_chunk_any(&chunks[0]);
    for (int64_t t = 1; t < threads; t++) {
        if (started[t]) pthread_join(workers[t], NULL);
        else run_chunk_any(&chunks[t]); /* no thread to be had: this one does the work */
    }
    return 0;
}
