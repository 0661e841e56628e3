/*
 * The instruction sets the C kernels compile their hot loops for, and which of them this CPU
 * runs: included by philox4x32_avx2.h and philox4x32_avx512.h (and through them by
 * cpu_dropout.c and keyed_fill.c).
 *
 * Defines RT_X86_SIMD (1 where GCC or clang compile for x86) and, there, the per-function
 * target attributes RT_AVX2 and RT_AVX512. A kernel compiles its hot loop once per instruction
 * set and calls a path only where rt_cpu_runs says the CPU (and OS) runs it; every path does
 * the same integer and fp32 arithmetic, so the bits do not depend on the path. Copied next to
 * the .c file and hashed into the cache key by the Python loaders.
 */
#ifndef RT_CPU_ISA_H
#define RT_CPU_ISA_H

#include <stdint.h>

/* Instruction-set paths: the codes the loaders pass (0 lets the kernel pick the fastest). */
enum { RT_ISA_AUTO = 0, RT_ISA_PORTABLE = 1, RT_ISA_AVX2 = 2, RT_ISA_AVX512 = 3 };

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define RT_X86_SIMD 1
#include <cpuid.h>
#include <immintrin.h>
#define RT_AVX2 __attribute__((target("avx2")))
#define RT_AVX512 __attribute__((target("avx2,avx512f")))
#else
#define RT_X86_SIMD 0
#endif

#if RT_X86_SIMD
/* Whether the OS saves the register state `mask` selects in XCR0 (0x6: the SSE and AVX
   registers; 0xe6: also AVX-512's masks and upper registers). Checked here as well as by the
   compiler's builtins, since an older runtime of theirs checked only the CPU: a path whose
   registers the OS does not save would fault on its first instruction. */
static inline int rt_os_saves(uint32_t mask) {
    unsigned int eax, ebx, ecx, edx;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & bit_OSXSAVE)) return 0;
    uint32_t low, high;
    __asm__ volatile("xgetbv" : "=a"(low), "=d"(high) : "c"(0));
    (void)high;
    return (low & mask) == mask;
}
#endif

/* The fastest instruction set this CPU and OS run, found once per library: a kernel call asks
   for it every time, and the CPUID behind the answer costs a virtual machine's exit (15 us per
   call where it was asked each time). The race of two first calls stores the same value. */
static inline int64_t rt_cpu_best(void) {
    static int64_t best = RT_ISA_AUTO;
    int64_t found = __atomic_load_n(&best, __ATOMIC_RELAXED);
    if (found != RT_ISA_AUTO) return found;
    found = RT_ISA_PORTABLE;
#if RT_X86_SIMD
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && rt_os_saves(0x6)) {
        found = RT_ISA_AVX2;
        if (__builtin_cpu_supports("avx512f") && rt_os_saves(0xe6)) found = RT_ISA_AVX512;
    }
#endif
    __atomic_store_n(&best, found, __ATOMIC_RELAXED);
    return found;
}

/* Whether this CPU and OS run the instruction set `isa` (an RT_ISA_* code): each path runs
   wherever a wider one does. */
static inline int rt_cpu_runs(int64_t isa) {
    return isa >= RT_ISA_PORTABLE && isa <= rt_cpu_best();
}

#endif /* RT_CPU_ISA_H */
