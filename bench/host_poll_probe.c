/* bench/host_handoff_latency.py's host side of a polled hand-off: a thread spins on a word in pinned
 * memory that the GPU writes (cuStreamWriteValue32), clears it and answers in a second word the GPU
 * waits on (cuStreamWaitValue32), with nothing computed: the round trip a decode layer's host share
 * would pay instead of a host node's. Built by the bench with the machine's C compiler. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

typedef struct {
    uint32_t go;          /* written by the GPU: the round's number, 0 when none is waiting */
    uint32_t pad0[15];    /* one cache line each: the GPU's write and the host's do not share one */
    uint32_t done;        /* written here: the round answered */
    uint32_t pad1[15];
    uint32_t stop;        /* written by the bench: the thread returns */
    uint32_t pad2[15];
    uint64_t rounds;      /* answered, for the bench to check */
} probe_flags;

static void *poll_main(void *p) {
    probe_flags *f = p;
    while (!__atomic_load_n(&f->stop, __ATOMIC_ACQUIRE)) {
        uint32_t go = __atomic_load_n(&f->go, __ATOMIC_ACQUIRE);
        if (!go) {
            CPU_RELAX();
            continue;
        }
        __atomic_store_n(&f->go, 0, __ATOMIC_RELAXED);
        f->rounds++;
        __atomic_store_n(&f->done, go, __ATOMIC_RELEASE);
    }
    return NULL;
}

/* the polling thread on `f` (pinned host memory of sizeof(probe_flags) bytes); 0 when started */
int probe_start(probe_flags *f, pthread_t *thread) { return pthread_create(thread, NULL, poll_main, f); }

void probe_stop(probe_flags *f, pthread_t *thread) {
    __atomic_store_n(&f->stop, 1, __ATOMIC_RELEASE);
    pthread_join(*thread, NULL);
}

unsigned long probe_size(void) { return sizeof(probe_flags); }
