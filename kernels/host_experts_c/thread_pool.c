/* The pool's workers spin a short while for the next task before sleeping on a condition variable:
 * a decode step calls once per MoE layer, tens of microseconds apart, and a futex wake-up costs as
 * much as a layer's expert at one token; spinning longer would take the cores from torch's threads.
 * Barriers spin the same way, then yield.
 *
 * Started workers can be pinned, one a CPU (ferry_pool_create's cpus): a worker the scheduler moves
 * between cores loses its L1/L2 and, beside the three processes' threads on the same core, waits for
 * its time slice while the whole pool waits for it at the barrier. The caller (worker 0: the worker's
 * launching thread, or the CUDA driver's thread that runs a graph's host node) is left where it is:
 * pinning it would pin its other work too. */
#define _GNU_SOURCE
#include "thread_pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

#define SPIN_NS 50000 /* how long an idle worker spins before it sleeps */

struct ferry_pool {
    int size;
    int pinned;             /* started workers pinned to their CPU */
    pthread_t *threads;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    atomic_uint generation; /* bumped for every task */
    atomic_int running;     /* workers still inside the current task */
    atomic_int stop;
    ferry_task task;
    void *arg;
    atomic_int arrived;     /* the barrier's count and its phase */
    atomic_uint phase;
};

typedef struct {
    ferry_pool *pool;
    int index;
} worker_arg;

/* pin a started thread to one CPU; 0 when done, an errno where refused (a CPU outside the cgroup's set) */
static int pin_thread(pthread_t thread, int cpu) {
#if defined(__linux__)
    if (cpu < 0 || cpu >= CPU_SETSIZE) return 22; /* EINVAL */
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    return pthread_setaffinity_np(thread, sizeof set, &set);
#else
    (void)thread;
    (void)cpu;
    return 95; /* EOPNOTSUPP: no affinity call here, the workers stay unpinned */
#endif
}

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* wait until *word != seen: spin for SPIN_NS, then yield (sleep = 0) or return -1 to let the caller sleep */
static int spin_until_changed(atomic_uint *word, unsigned seen, int may_sleep) {
    long long deadline = now_ns() + SPIN_NS;
    for (unsigned i = 1;; i++) {
        if (atomic_load_explicit(word, memory_order_acquire) != seen) return 0;
        CPU_RELAX();
        if ((i & 255) == 0 && now_ns() > deadline) {
            if (may_sleep) return -1;
            sched_yield();
        }
    }
}

static void *worker_main(void *p) {
    worker_arg *w = p;
    ferry_pool *pool = w->pool;
    int index = w->index;
    free(w);
    unsigned seen = 0;
    for (;;) {
        if (spin_until_changed(&pool->generation, seen, 1) != 0) {
            pthread_mutex_lock(&pool->lock);
            while (atomic_load(&pool->generation) == seen && !atomic_load(&pool->stop))
                pthread_cond_wait(&pool->wake, &pool->lock);
            pthread_mutex_unlock(&pool->lock);
        }
        if (atomic_load(&pool->stop)) return NULL;
        seen = atomic_load_explicit(&pool->generation, memory_order_acquire);
        pool->task(pool->arg, index, pool->size);
        atomic_fetch_sub_explicit(&pool->running, 1, memory_order_release);
    }
}

ferry_pool *ferry_pool_create(int threads, const int *cpus, int ncpus) {
    if (threads < 1) return NULL;
    ferry_pool *pool = calloc(1, sizeof *pool);
    if (!pool) return NULL;
    pool->size = threads;
    pthread_mutex_init(&pool->lock, NULL);
    pthread_cond_init(&pool->wake, NULL);
    pool->threads = calloc((size_t)threads, sizeof(pthread_t));
    for (int i = 1; i < threads; i++) {
        worker_arg *w = pool->threads ? malloc(sizeof *w) : NULL;
        if (w) *w = (worker_arg){pool, i};
        if (!w || pthread_create(&pool->threads[i], NULL, worker_main, w) != 0) {
            free(w);
            pool->size = i; /* the workers started so far, so destroy joins exactly them */
            ferry_pool_destroy(pool);
            return NULL;
        }
        if (ncpus > 0 && cpus && pin_thread(pool->threads[i], cpus[(i - 1) % ncpus]) == 0) pool->pinned++;
    }
    return pool;
}

int ferry_pool_pinned(const ferry_pool *pool) { return pool->pinned; }

void ferry_pool_destroy(ferry_pool *pool) {
    if (!pool) return;
    pthread_mutex_lock(&pool->lock);
    atomic_store(&pool->stop, 1);
    atomic_fetch_add(&pool->generation, 1);
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->lock);
    for (int i = 1; i < pool->size; i++) pthread_join(pool->threads[i], NULL);
    pthread_cond_destroy(&pool->wake);
    pthread_mutex_destroy(&pool->lock);
    free(pool->threads);
    free(pool);
}

int ferry_pool_size(const ferry_pool *pool) { return pool->size; }

void ferry_pool_run(ferry_pool *pool, ferry_task task, void *arg) {
    if (pool->size == 1) {
        task(arg, 0, 1);
        return;
    }
    pool->task = task;
    pool->arg = arg;
    atomic_store(&pool->arrived, 0);
    atomic_store(&pool->running, pool->size - 1);
    pthread_mutex_lock(&pool->lock); /* a worker that is about to sleep sees the bump or the signal */
    atomic_fetch_add_explicit(&pool->generation, 1, memory_order_release);
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->lock);
    task(arg, 0, pool->size);
    for (unsigned i = 1; atomic_load_explicit(&pool->running, memory_order_acquire) > 0; i++) {
        CPU_RELAX();
        if ((i & 1023) == 0) sched_yield();
    }
}

void ferry_pool_barrier(ferry_pool *pool) {
    if (pool->size == 1) return;
    unsigned phase = atomic_load_explicit(&pool->phase, memory_order_acquire);
    if (atomic_fetch_add_explicit(&pool->arrived, 1, memory_order_acq_rel) + 1 == pool->size) {
        atomic_store_explicit(&pool->arrived, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&pool->phase, 1, memory_order_release);
        return;
    }
    spin_until_changed(&pool->phase, phase, 0);
}
