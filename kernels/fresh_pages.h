/*
 * A fresh output's pages, mapped a piece at a time just ahead of the loop that writes them:
 * included by cpu_dropout.c and keyed_fill.c (each defines _DEFAULT_SOURCE first, for madvise
 * and mincore). Copied next to the .c file and hashed into the cache key by the Python loaders.
 *
 * A new large allocation (its own mmap) has no pages until written: a loop writing it takes a
 * page fault per page, and one MADV_POPULATE_WRITE over many pages costs a fraction of those
 * faults. The kernel zeroes the pages as it maps them. Mapped all at once before the loop, the
 * zeroed lines leave the caches (written back to memory) before the loop overwrites them; mapped
 * POPULATE_STEP bytes at a time just ahead of it, they are still in the core's L2 when it does,
 * as in a copy into fresh memory (a 32 MiB bf16 dropout: 1.40-1.57x a clone's time before,
 * 1.20-1.42x after). Elsewhere than Linux, or where the kernel refuses MADV_POPULATE_WRITE
 * (before 5.14), nothing is mapped and the loop faults the pages in.
 *
 * A fresh output's whole 2 MiB pieces are also marked MADV_HUGEPAGE, once for the output before
 * any thread maps a page (fresh_output), so that where transparent huge pages are "madvise"
 * (the usual default) or "always", each is one 2 MiB page: one fault
 * instead of 512 (a 32 MiB bf16 dropout: 1.23-1.25x a clone's time before, 0.70-0.74x after).
 * torch's CPU allocator does the same for its allocations under THP_MEM_ALLOC_ENABLE=1. Only
 * pages the loop is about to write are marked, so no memory is taken that would not be; with
 * transparent huge pages "never" the mark does nothing. A huge page's fault can take longer
 * than 512 small ones (the OS compacting memory for it, or a VM's host backing it anew), so
 * the loader turns the mark off where RNG_TRACKER_CPU_HUGE_PAGES=0 (rt_set_huge_pages).
 */
#ifndef RT_FRESH_PAGES_H
#define RT_FRESH_PAGES_H

#include <stddef.h>
#include <stdint.h>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 and later */
#endif
#endif

/* spans of at least this many bytes are mapped ahead, POPULATE_STEP bytes at a time: a piece
   the core's L2 holds */
#ifndef POPULATE_BYTES
#define POPULATE_BYTES (1 << 20)
#endif
#define POPULATE_STEP (256 << 10)
#define HUGE_BYTES (2 << 20) /* a transparent huge page on x86-64 and 4 KiB-page arm64 */

typedef struct {
    char *next, *end; /* whole pages still to map; next == end: none */
} page_span;

static int huge_pages = 1; /* whether fresh spans are marked MADV_HUGEPAGE */

/* Mark fresh spans for huge pages (on != 0) or not: set once, when the library is loaded. */
int64_t rt_set_huge_pages(int64_t on) {
    huge_pages = on != 0;
    return 0;
}

/* The whole pages inside [begin, end): a loop's part of an output to map ahead, or none where
   the part is under POPULATE_BYTES (a few faults cost less than the calls). */
static page_span page_span_of(void *begin, void *end) {
    page_span none = {NULL, NULL};
#if defined(__linux__)
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE); /* 4 KiB, 16 or 64 KiB on arm64 */
    uintptr_t first = ((uintptr_t)begin + page - 1) & ~(page - 1);
    uintptr_t last = (uintptr_t)end & ~(page - 1);
    if (last > first && last - first >= POPULATE_BYTES) {
        page_span span = {(char *)first, (char *)last};
        return span;
    }
#else
    (void)begin;
    (void)end;
#endif
    return none;
}

/* Whether the output [begin, end) is fresh: at least POPULATE_BYTES of whole pages, the first
   of them not yet mapped (a mapped one means reused memory, where mapping ahead would cost a
   page-table walk for nothing). A fresh output's whole 2 MiB pieces are marked for huge pages
   here, once for the output: before any thread maps a page, and over the pieces that straddle
   the threads' parts too. */
static int fresh_output(void *begin, void *end) {
    page_span span = page_span_of(begin, end);
#if defined(__linux__)
    unsigned char resident = 1;
    if (span.next == span.end || mincore(span.next, 1, &resident) != 0 || (resident & 1))
        return 0;
#ifdef MADV_HUGEPAGE
    const uintptr_t huge = HUGE_BYTES;
    uintptr_t huge_first = ((uintptr_t)span.next + huge - 1) & ~(huge - 1);
    uintptr_t huge_last = (uintptr_t)span.end & ~(huge - 1);
    if (huge_pages && huge_last > huge_first)
        (void)madvise((void *)huge_first, huge_last - huge_first, MADV_HUGEPAGE);
#endif
    return 1;
#else
    (void)span;
    return 0;
#endif
}

/* Map the span's pages up to `until`, POPULATE_STEP bytes per call, before the loop writes
   there. */
static inline void map_ahead(page_span *span, const void *until) {
#if defined(__linux__)
    while (span->next < span->end && (const char *)until > span->next) {
        char *stop =
            span->end - span->next > POPULATE_STEP ? span->next + POPULATE_STEP : span->end;
        (void)madvise(span->next, (size_t)(stop - span->next), MADV_POPULATE_WRITE);
        span->next = stop;
    }
#else
    (void)span;
    (void)until;
#endif
}

#endif /* RT_FRESH_PAGES_H */
