/* What the host kernel's spinning threads share (thread_pool.c, host_poller.c): a pause for the core's
 * sibling while a thread spins on a word, and a monotonic clock in nanoseconds to bound the spin. */
#ifndef FERRY_SPIN_H
#define FERRY_SPIN_H

#include <time.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

static inline long long ferry_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

#endif
