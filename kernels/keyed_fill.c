/*
 * Keyed init on CPU: element values that are a pure function of (key, name, global index).
 *
 * Element g of a parameter's logical tensor takes word g % 4 of
 * Philox4x32-10(key, counter (lo32(g / 4), hi32(g / 4), name_lo, name_hi)). uniform maps the
 * word to u = (w >> 8) * 2^-24 in [0, 1) and writes u * scale + shift; normal pairs words
 * (0, 1) and (2, 3) of the block by Box-Muller (lanes 0 and 2 the cosine, 1 and 3 the sine)
 * and writes z * scale + shift; truncated normal maps the word's u to u' = lo + (u + 2^-25) * width
 * inside [Phi(alpha), Phi(beta)] and writes clamp(mean + std * sqrt(2) * erfinv(2u' - 1), a, b)
 * (inverse-CDF sampling: no rejection loop, so no data-dependent control flow across ranks;
 * erfinv by Giles' single-precision polynomials). All in fp32 with fixed branch-free formulas for ln, cos and sin (no libm), no FMA
 * (-ffp-contract=off):
 * an element's bits do not depend on where in the local tensor it sits.
 *
 * Only the local shard is written: its element at local multi-index (i_0, ..., i_{n-1}) has
 * g = sum_d index_d[i_d] * gstride_d, where index_d lists the global indices this rank holds
 * along dim d. Runs of consecutive elements are filled in batches, by one function per
 * instruction set (portable; AVX2 and AVX-512 where the CPU has them: Philox in intrinsics,
 * the value loops vectorised by the compiler), each the same fp32 operations, so the same bits.
 * A new tensor's pages are mapped a piece at a time just ahead of the fill (fresh_pages.h).
 * Built and loaded by rng_tracker/kernels/_keyed_fill.py through _c_build.py (plain C11,
 * ctypes).
 */
#ifndef _DEFAULT_SOURCE
#define _DEFAULT_SOURCE /* madvise, mincore */
#endif
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "f32_bits.h"
#include "fresh_pages.h"
#include "philox4x32.h"
#include "philox4x32_avx2.h"
#include "philox4x32_avx512.h"

#define RT_KEYED_ABI 4
#define RT_MAX_DIMS 64

int64_t rt_keyed_abi_version(void) { return RT_KEYED_ABI; }

/* ln(x) for a normal float x > 0, branch-free (so loops of it vectorise): x = 2^e * m with m in
   [sqrt(1/2), sqrt(2)), ln(m) = 2 atanh(t), t = (m - 1) / (m + 1), |t| < 0.172, by its series
   to t^9 (error below 1e-8). A fixed formula, so the same bits wherever x sits. */
static inline float keyed_log(float x) {
    uint32_t bits = f32_to_bits(x);
    int32_t e = (int32_t)((bits >> 23) & 0xffu) - 127;
    float m = bits_to_f32((bits & 0x7fffffu) | 0x3f800000u);
    uint32_t big = (uint32_t)(m > 1.41421356f);
    m = bits_to_f32(f32_to_bits(m) - (big << 23)); /* m / 2, exactly */
    e += (int32_t)big;
    float t = (m - 1.0f) / (m + 1.0f), t2 = t * t;
    float series = 2.0f + t2 * (0.66666667f + t2 * (0.4f + t2 * (0.28571429f + t2 * 0.22222222f)));
    return t * series + (float)e * 0.69314718f;
}

/* cos and sin of 2 pi u, u in [0, 1): the nearest quarter turn k, the rest r in [-pi/4, pi/4]
   by Taylor series to r^9 / r^8 (errors below 4e-7), rotated by k quarter turns. */
static inline void keyed_sincos(float u, float *c_out, float *s_out) {
    float q = u * 4.0f;
    int k = (int)(q + 0.5f);
    float r = (q - (float)k) * 1.57079633f, r2 = r * r;
    float s = r * (1.0f + r2 * (-0.16666667f + r2 * (0.0083333333f + r2 * (-1.9841270e-4f +
                                                                                r2 * 2.7557319e-6f))));
    float c = 1.0f + r2 * (-0.5f + r2 * (0.041666667f + r2 * (-0.0013888889f + r2 * 2.4801587e-5f)));
    /* rotate by k quarter turns with bit selects (no branches): odd k swaps cos and sin,
       k = 1, 2 negate the cosine, k = 2, 3 the sine */
    uint32_t swap = 0u - (uint32_t)(k & 1), cb = f32_to_bits(c), sb = f32_to_bits(s);
    uint32_t cos_bits = (cb & ~swap) | (sb & swap), sin_bits = (sb & ~swap) | (cb & swap);
    cos_bits ^= (uint32_t)((k + 1) & 2) << 30;
    sin_bits ^= (uint32_t)(k & 2) << 30;
    *c_out = bits_to_f32(cos_bits);
    *s_out = bits_to_f32(sin_bits);
}

/* condition ? x : y by bit masks, so the loops that use it stay branch-free and vectorise. */
static inline float keyed_select(int condition, float x, float y) {
    uint32_t mask = 0u - (uint32_t)condition;
    return bits_to_f32((f32_to_bits(x) & mask) | (f32_to_bits(y) & ~mask));
}

/* erfinv(x) for x in (-1, 1): M. Giles' single-precision polynomials ("Approximating the erfinv
   function", GPU Computing Gems, 2011), both branches computed and one selected so loops of it
   vectorise; relative error about 4e-7. */
static inline float keyed_erfinv(float x) {
    float w = -keyed_log((1.0f - x) * (1.0f + x));
    float c = w - 2.5f;
    float central = 2.81022636e-08f;
    central = 3.43273939e-07f + central * c;
    central = -3.5233877e-06f + central * c;
    central = -4.39150654e-06f + central * c;
    central = 0.00021858087f + central * c;
    central = -0.00125372503f + central * c;
    central = -0.00417768164f + central * c;
    central = 0.246640727f + central * c;
    central = 1.50140941f + central * c;
    float t = sqrtf(w) - 3.0f;
    float tail = -0.000200214257f;
    tail = 0.000100950558f + tail * t;
    tail = 0.00134934322f + tail * t;
    tail = -0.00367342844f + tail * t;
    tail = 0.00573950773f + tail * t;
    tail = -0.0076224613f + tail * t;
    tail = 0.00943887047f + tail * t;
    tail = 1.00167406f + tail * t;
    tail = 2.83297682f + tail * t;
    return keyed_select(w < 5.0f, central, tail) * x;
}

/* Parameters of a fill: uniform and normal use scale and shift; truncated normal the rest. */
typedef struct {
    float scale, shift;           /* uniform: u * scale + shift; normal: z * scale + shift */
    float lo, width, mean, std, a, b; /* truncated normal */
} fill_params;

static inline float truncated(uint32_t word, float lo, float width, float mean, float std,
                              float a, float b) {
    float u = ((float)(word >> 8) + 0.5f) * 0x1p-24f; /* (0, 1), never 0 or 1 */
    float q = lo + u * width;
    float z = 1.41421356f * keyed_erfinv(2.0f * q - 1.0f);
    float v = z * std + mean;
    v = keyed_select(v < a, a, v);
    return keyed_select(v > b, b, v);
}

/* u * scale + shift, u = (word >> 8) * 2^-24 in [0, 1). */
static inline float uniform(uint32_t word, float scale, float shift) {
    return (float)(word >> 8) * 0x1p-24f * scale + shift;
}

/* v[0], v[1] = the normal pair of words w[0] (radius) and w[1] (angle), by Box-Muller, times
   scale plus shift. */
static inline void box_muller(const uint32_t w[2], float scale, float shift, float v[2]) {
    float u1 = (float)((w[0] >> 8) + 1u) * 0x1p-24f; /* (0, 1]: log is finite */
    float u2 = (float)(w[1] >> 8) * 0x1p-24f;
    float radius = sqrtf(-2.0f * keyed_log(u1));
    float c, s;
    keyed_sincos(u2, &c, &s);
    v[0] = radius * c * scale + shift;
    v[1] = radius * s * scale + shift;
}

static void values(int kind, const uint32_t w[4], const fill_params *p, float v[4]) {
    float scale = p->scale, shift = p->shift;
    if (kind == 0) {
        for (int j = 0; j < 4; j++) v[j] = uniform(w[j], scale, shift);
        return;
    }
    if (kind == 2) {
        for (int j = 0; j < 4; j++)
            v[j] = truncated(w[j], p->lo, p->width, p->mean, p->std, p->a, p->b);
        return;
    }
    for (int pair = 0; pair < 2; pair++) box_muller(w + 2 * pair, scale, shift, v + 2 * pair);
}

#define CHUNK 64 /* Philox blocks per batch (256 elements): one step of the AVX-512 Philox */
#define CHUNK_PAD 16 /* blocks a SIMD Philox writes past the batch: its vector's counters */

/* out[0 .. n) = the values of global elements g0 .. g0 + n, batch by batch, each batch's
   pages of a fresh output mapped just before it writes them (fresh); inlined into one function
   per instruction set, where the compiler vectorises the value loops for it. */
static inline __attribute__((always_inline)) void fill_run(float *out, uint64_t g0, int64_t n,
                                                           int kind, uint32_t c2, uint32_t c3,
                                                           uint32_t k0, uint32_t k1,
                                                           const fill_params *p,
                                                           page_span *fresh,
                                                           philox_block_fn philox) {
    float scale = p->scale, shift = p->shift;
    uint32_t words[4 * (CHUNK + CHUNK_PAD)];
    float vals[4 * CHUNK];
    uint64_t end = g0 + (uint64_t)n, last = (end - 1) >> 2;
    for (uint64_t block = g0 >> 2; block <= last; block += CHUNK) {
        int m = (int)((last - block + 1) < CHUNK ? (last - block + 1) : CHUNK);
        philox_runs(m, block, c2, c3, k0, k1, words, philox);
        if (kind == 0) {
            for (int i = 0; i < 4 * m; i++) vals[i] = uniform(words[i], scale, shift);
        } else if (kind == 2) {
            float lo = p->lo, width = p->width, mean = p->mean, std = p->std, a = p->a, b = p->b;
            for (int i = 0; i < 4 * m; i++) vals[i] = truncated(words[i], lo, width, mean, std, a, b);
        } else {
            for (int i = 0; i < 2 * m; i++) box_muller(words + 2 * i, scale, shift, vals + 2 * i);
        }
        uint64_t lo = block * 4 > g0 ? block * 4 : g0;
        uint64_t hi = (block + (uint64_t)m) * 4 < end ? (block + (uint64_t)m) * 4 : end;
        map_ahead(fresh, out + (hi - g0));
        for (uint64_t g = lo; g < hi; g++) out[g - g0] = vals[g - block * 4];
    }
}

typedef void (*fill_run_fn)(float *out, uint64_t g0, int64_t n, int kind, uint32_t c2,
                            uint32_t c3, uint32_t k0, uint32_t k1, const fill_params *p,
                            page_span *fresh);

static void fill_run_portable(float *out, uint64_t g0, int64_t n, int kind, uint32_t c2,
                              uint32_t c3, uint32_t k0, uint32_t k1, const fill_params *p,
                              page_span *fresh) {
    fill_run(out, g0, n, kind, c2, c3, k0, k1, p, fresh, philox_block_portable);
}

#if RT_X86_SIMD
RT_AVX2 static void fill_run_avx2(float *out, uint64_t g0, int64_t n, int kind, uint32_t c2,
                                  uint32_t c3, uint32_t k0, uint32_t k1, const fill_params *p,
                                  page_span *fresh) {
    fill_run(out, g0, n, kind, c2, c3, k0, k1, p, fresh, philox_block_avx2);
}

RT_AVX512 static void fill_run_avx512(float *out, uint64_t g0, int64_t n, int kind, uint32_t c2,
                                      uint32_t c3, uint32_t k0, uint32_t k1,
                                      const fill_params *p, page_span *fresh) {
    fill_run(out, g0, n, kind, c2, c3, k0, k1, p, fresh, philox_block_avx512);
}
#endif

/* Whether this CPU (and OS) runs the instruction set `isa` (an RT_ISA_* code). */
int64_t rt_keyed_isa_supported(int64_t isa) { return rt_cpu_runs(isa); }

/* Fill out (the local shard, contiguous) for kind 0 (uniform), 1 (normal) or 2 (truncated
   normal); params holds the 8 floats of fill_params in order. index holds the per-dim index
   lists one after another; sizes[d] is the length of dim d's list. isa: RT_ISA_AUTO (the fastest
   this CPU runs) or an RT_ISA_* code to force; every path writes the same bits. Returns 0; or,
   writing nothing, -1 for a number of dims or a kind it does not take, -2 for an instruction
   set this CPU does not run. */
int64_t rt_keyed_fill(float *out, int64_t ndims, const int64_t *sizes, const int64_t *index,
                      const int64_t *gstride, uint64_t key, uint64_t name, int64_t kind,
                      const float *params, int64_t isa) {
    if (ndims < 0 || ndims > RT_MAX_DIMS || kind < 0 || kind > 2) return -1;
    if (isa != RT_ISA_AUTO && !rt_cpu_runs(isa)) return -2;
    if (isa == RT_ISA_AUTO) isa = rt_cpu_best();
    fill_run_fn run = fill_run_portable;
#if RT_X86_SIMD
    if (isa == RT_ISA_AVX2) run = fill_run_avx2;
    if (isa == RT_ISA_AVX512) run = fill_run_avx512;
#endif
    fill_params p = {params[0], params[1], params[2], params[3],
                     params[4], params[5], params[6], params[7]};
    const int64_t *lists[RT_MAX_DIMS + 1];
    int64_t at[RT_MAX_DIMS + 1];
    int64_t numel = 1, offset = 0;
    for (int64_t d = 0; d < ndims; d++) {
        lists[d] = index + offset;
        offset += sizes[d];
        numel *= sizes[d];
    }
    if (numel == 0) return 0;
    uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
    uint32_t c2 = (uint32_t)name, c3 = (uint32_t)(name >> 32);
    if (ndims == 0) {
        uint32_t w[4];
        float v[4];
        philox4x32_10(0, 0, c2, c3, k0, k1, w);
        values((int)kind, w, &p, v);
        out[0] = v[0];
        return 0;
    }
    int64_t last = ndims - 1, row = sizes[last];
    const int64_t *columns = lists[last];
    int64_t column_stride = gstride[last];
    for (int64_t d = 0; d < ndims; d++) at[d] = 0;
    page_span fresh = {NULL, NULL}; /* a new tensor's pages: mapped ahead */
    if (fresh_output(out, out + numel)) fresh = page_span_of(out, out + numel);
    uint64_t cached = UINT64_MAX;
    uint32_t w[4];
    float v[4];
    for (int64_t start = 0; start < numel; start += row) {
        int64_t row_base = 0;
        for (int64_t d = 0; d < last; d++) row_base += lists[d][at[d]] * gstride[d];
        if (column_stride == 1 && columns[row - 1] - columns[0] == row - 1) { /* one run */
            run(out + start, (uint64_t)(row_base + columns[0]), row, (int)kind, c2, c3, k0, k1,
                &p, &fresh);
            goto next_row;
        }
        for (int64_t i = 0; i < row; i++) {
            map_ahead(&fresh, out + start + i + 1); /* a piece at a time, as the row reaches it */
            uint64_t g = (uint64_t)(row_base + columns[i] * column_stride);
            uint64_t block = g >> 2;
            if (block != cached) {
                philox4x32_10((uint32_t)block, (uint32_t)(block >> 32), c2, c3, k0, k1,
                              w);
                values((int)kind, w, &p, v);
                cached = block;
            }
            out[start + i] = v[g & 3];
        }
    next_row:
        for (int64_t d = last - 1; d >= 0; d--) { /* odometer over the outer dims */
            if (++at[d] < sizes[d]) break;
            at[d] = 0;
        }
    }
    return 0;
}
