/* The pool's workers spin a short while for the next call before sleeping on a condition variable:
 * a decode step calls once per MoE layer, tens of microseconds apart, and a futex wake-up costs as
 * much as a layer's expert at one token; spinning longer would take the cores from torch's threads.
 *
 * A call's items are claimed one at a time from a ticket, the call's number in its high 32 bits and
 * the count of its items not yet claimed in its low 32: a worker claims one by moving the ticket from
 * (c, left) to (c, left - 1), so a worker still looking at an ended call (woken late, or preempted
 * between its look and its claim) finds none left or fails its move, and it reads the call's
 * arguments only once its claim holds: the call cannot end while a claimed item is not done, so they
 * stay valid until then. (A ticket counting up to a separate total would not do: a worker could
 * read the ended call's ticket and the next call's larger total, and claim past the end.) The caller
 * returns once the count of done items reaches the call's, whichever workers did them.
 *
 * Started workers can be pinned, one a CPU (ferry_pool_create's cpus): a worker the scheduler moves
 * between cores loses its L1/L2. The caller (worker 0) is pinned only where it asks
 * (ferry_pool_pin_caller): the CUDA driver's thread that runs a decode graph's host nodes, or the
 * polling thread, does nothing but the pool's calls, and on the serving processes' cores it would
 * wait behind them for its turn while the GPU waits for the layer; the worker's Python thread, which
 * also calls (a prefill's share, the tests), is never pinned here.
 *
 * Idle workers spin `spin_ns` (ferry_pool_set_spin) before they sleep. */
#define _GNU_SOURCE
#include "thread_pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "spin.h"


#define SPIN_NS 50000 /* how long an idle worker spins before it sleeps, unless ferry_pool_set_spin says */

/* where a thread may lose its core between two steps of the protocol: nothing here; the stress test's
 * build (tests/unit/offload/test_thread_pool.py) yields there, to widen the windows a race would need */
#ifndef FERRY_POOL_RACE_POINT
#define FERRY_POOL_RACE_POINT() ((void)0)
#endif

struct ferry_pool {
    int size;
    int pinned;             /* started workers pinned to their CPU */
    int caller_cpu;         /* cpus[0], where a caller that asks is pinned; -1: none */
    atomic_int caller_pinned; /* 1 once a caller was pinned there, an errno if refused, 0 before any asked */
    atomic_llong spin_ns;   /* how long an idle worker spins before it sleeps */
    pthread_t *threads;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    atomic_uint generation; /* bumped for every call: what sleeping workers wait on */
    atomic_int stop;
    /* the claims' line, away from the one idle workers spin on (the pool is allocated on a line) */
    _Alignas(64) _Atomic uint64_t ticket; /* (call << 32) | the count of that call's items not yet claimed */
    atomic_llong done;       /* items of the current call done */
    /* phase 0's items and both phases': read before a claim only as a hint (a worker with no claim may
     * see the next call's), and for certain once the claim holds */
    atomic_llong n0, total;
    uint32_t call;           /* the current call's number (the caller's alone to write) */
    ferry_item_fn fn;        /* the current call's, written before its ticket is published */
    void *arg;
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

/* wait until *word != seen: 0 once it has changed, -1 after spin_ns of spinning (the caller then sleeps) */
static int spin_until_changed(atomic_uint *word, unsigned seen, long long spin_ns) {
    long long deadline = ferry_now_ns() + spin_ns;
    for (unsigned i = 1;; i++) {
        if (atomic_load_explicit(word, memory_order_acquire) != seen) return 0;
        CPU_RELAX();
        if ((i & 255) == 0 && ferry_now_ns() > deadline) return -1;
    }
}

/* claim and run the items of call `call` until none is left unclaimed (or a later call has begun) */
static void claim_items(ferry_pool *pool, uint32_t call, int worker) {
    for (unsigned spins = 1;; spins++) {
        uint64_t t = atomic_load_explicit(&pool->ticket, memory_order_acquire);
        if ((uint32_t)(t >> 32) != call) return;
        uint32_t left = (uint32_t)t;
        if (left == 0) return;
        FERRY_POOL_RACE_POINT();
        int64_t n0 = atomic_load_explicit(&pool->n0, memory_order_relaxed);
        int64_t i = atomic_load_explicit(&pool->total, memory_order_relaxed) - left;
        if (i >= n0 && atomic_load_explicit(&pool->done, memory_order_acquire) < n0) {
            /* the next item is of phase 1, which cannot start yet: wait without holding it, so that a
             * worker preempted here holds nothing up (a hint: checked again once claimed) */
            CPU_RELAX();
            if ((spins & 1023) == 0) sched_yield();
            continue;
        }
        if (!atomic_compare_exchange_weak_explicit(&pool->ticket, &t, t - 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        /* the claim holds: the call's arguments stay valid until this item is done */
        n0 = atomic_load_explicit(&pool->n0, memory_order_relaxed);
        i = atomic_load_explicit(&pool->total, memory_order_relaxed) - left;
        if (i >= n0) /* phase 1 starts once every phase 0 item is done (claims go in order, so all are taken) */
            for (unsigned s = 1; atomic_load_explicit(&pool->done, memory_order_acquire) < n0; s++) {
                CPU_RELAX();
                if ((s & 1023) == 0) sched_yield();
            }
        pool->fn(pool->arg, worker, i < n0 ? 0 : 1, i < n0 ? i : i - n0);
        atomic_fetch_add_explicit(&pool->done, 1, memory_order_release);
    }
}

static void *worker_main(void *p) {
    worker_arg *w = p;
    ferry_pool *pool = w->pool;
    int index = w->index;
    free(w);
    unsigned seen = 0;
    for (;;) {
        if (spin_until_changed(&pool->generation, seen, atomic_load_explicit(&pool->spin_ns, memory_order_relaxed)) != 0) {
            pthread_mutex_lock(&pool->lock);
            while (atomic_load(&pool->generation) == seen && !atomic_load(&pool->stop))
                pthread_cond_wait(&pool->wake, &pool->lock);
            pthread_mutex_unlock(&pool->lock);
        }
        if (atomic_load(&pool->stop)) return NULL;
        /* the ticket is published before the generation is bumped: this one's call, or a later one's */
        seen = atomic_load_explicit(&pool->generation, memory_order_acquire);
        uint64_t t = atomic_load_explicit(&pool->ticket, memory_order_acquire);
        claim_items(pool, (uint32_t)(t >> 32), index);
    }
}

ferry_pool *ferry_pool_create(int threads, const int *cpus, int ncpus) {
    if (threads < 1) return NULL;
    ferry_pool *pool = NULL;
    if (posix_memalign((void **)&pool, 64, sizeof *pool) != 0) return NULL;
    memset(pool, 0, sizeof *pool);
    pool->size = threads;
    pool->caller_cpu = ncpus > 0 && cpus ? cpus[0] : -1;
    atomic_store(&pool->spin_ns, SPIN_NS);
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
        /* the workers round robin over the CPUs after the caller's (over the one CPU if that is all) */
        int cpu = ncpus > 1 ? cpus[1 + (i - 1) % (ncpus - 1)] : ncpus == 1 ? cpus[0] : -1;
        if (cpus && cpu >= 0 && pin_thread(pool->threads[i], cpu) == 0) pool->pinned++;
    }
    return pool;
}

int ferry_pool_pinned(const ferry_pool *pool) { return pool->pinned; }

/* the CPU this thread last asked for as a caller, and the answer (1 or an errno): a thread that calls every
 * layer asks the OS once, not a system call a layer; a second pool on the same CPU (the tests') learns the
 * answer without asking again */
static _Thread_local int caller_asked_cpu = -1, caller_answer = 0;

int ferry_pool_pin_caller(ferry_pool *pool) {
    int cpu = pool->caller_cpu;
    if (cpu < 0) return 0;
    if (caller_asked_cpu != cpu) {
        int err = pin_thread(pthread_self(), cpu);
        caller_asked_cpu = cpu;
        caller_answer = err ? err : 1;
    }
    if (atomic_load_explicit(&pool->caller_pinned, memory_order_relaxed) != caller_answer)
        atomic_store(&pool->caller_pinned, caller_answer);
    return caller_answer == 1 ? 0 : caller_answer;
}

int ferry_pool_caller_pinned(const ferry_pool *pool) { return atomic_load(&((ferry_pool *)pool)->caller_pinned); }

void ferry_pool_set_spin(ferry_pool *pool, int64_t ns) {
    atomic_store_explicit(&pool->spin_ns, ns < 0 ? 0 : ns, memory_order_relaxed);
}

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

void ferry_pool_run_items(ferry_pool *pool, ferry_item_fn fn, void *arg, int64_t n0, int64_t n1) {
    if (pool->size == 1 || n0 < 0 || n1 < 0 || n0 + n1 > UINT32_MAX) { /* no ticket holds these: the caller alone */
        for (int64_t i = 0; i < n0; i++) fn(arg, 0, 0, i);
        for (int64_t i = 0; i < n1; i++) fn(arg, 0, 1, i);
        return;
    }
    pool->fn = fn;
    pool->arg = arg;
    atomic_store_explicit(&pool->n0, n0, memory_order_relaxed);
    atomic_store_explicit(&pool->total, n0 + n1, memory_order_relaxed);
    FERRY_POOL_RACE_POINT();
    atomic_store_explicit(&pool->done, 0, memory_order_relaxed);
    uint32_t call = ++pool->call;
    atomic_store_explicit(&pool->ticket, (uint64_t)call << 32 | (uint64_t)(n0 + n1), memory_order_release);
    pthread_mutex_lock(&pool->lock); /* a worker that is about to sleep sees the bump or the signal */
    atomic_fetch_add_explicit(&pool->generation, 1, memory_order_release);
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->lock);
    claim_items(pool, call, 0);
    for (unsigned i = 1; atomic_load_explicit(&pool->done, memory_order_acquire) < n0 + n1; i++) {
        CPU_RELAX();
        if ((i & 1023) == 0) sched_yield();
    }
}
