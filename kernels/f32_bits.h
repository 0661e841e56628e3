/*
 * Bit casts between a float and its IEEE-754 binary32 bits, shared by cpu_dropout.c and
 * keyed_fill.c (memcpy: no aliasing questions, and the compiler makes it a register move).
 * Copied next to the .c file and hashed into the cache key by the Python loaders.
 */
#ifndef RT_F32_BITS_H
#define RT_F32_BITS_H

#include <stdint.h>
#include <string.h>

static inline float bits_to_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t f32_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

#endif /* RT_F32_BITS_H */
