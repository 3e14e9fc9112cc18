/* The host kernel's thread pool (kernels/host_experts_c/thread_pool.c) under calls back to back:
 * every item of every call runs exactly once, on that call's arguments, on a worker index of the
 * pool's and never on two threads at once, phase 1 only after all of phase 0, and none after its call
 * returned. Most calls have 0 to 6 items, many of them empty, so that a worker still looking at an ended
 * call meets the next one being set up (a ticket that counted up to a separate total let such a worker
 * claim past the end: items ran twice); every 32nd has up to 40 + 36, and some items yield their
 * core midway, so that claims interleave even where the machine has as many cores as threads.
 * Usage: thread_pool_stress THREADS CALLS; prints the calls done so far every 1000 calls (a line each, so
 * that a caller can tell a slow machine from a hung pool), then "ok", or the first bad call and exits 1. */
#define _GNU_SOURCE
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "thread_pool.h"

#define MAX_ITEMS 64
#define MAX_THREADS 64

typedef struct {
    long id;
    int64_t n[2];
    atomic_int runs[2][MAX_ITEMS];   /* each item's runs */
    atomic_long ran[2];               /* items run, per phase */
    atomic_int busy[MAX_THREADS];     /* a worker index inside an item now */
    atomic_int returned;              /* set once the call has returned */
    atomic_int bad_index, shared_index, early, late;
} call_arg;

static int threads;

static void item(void *p, int worker, int phase, int64_t i) {
    call_arg *a = p;
    if (atomic_load(&a->returned)) atomic_store(&a->late, 1);
    if (worker < 0 || worker >= threads) {
        atomic_store(&a->bad_index, 1);
        return;
    }
    if (atomic_fetch_add(&a->busy[worker], 1) != 0) atomic_store(&a->shared_index, 1);
    if (phase == 1 && atomic_load(&a->ran[0]) != a->n[0]) atomic_store(&a->early, 1);
    if (a->id % 32 == 31 && i % 5 == 0) sched_yield(); /* in the large calls: another worker may claim meanwhile */
    atomic_fetch_add(&a->runs[phase][i], 1);
    atomic_fetch_add(&a->ran[phase], 1);
    atomic_fetch_sub(&a->busy[worker], 1);
}

int main(int argc, char **argv) {
    if (argc != 3) return 2;
    threads = atoi(argv[1]);
    long calls = atol(argv[2]);
    if (threads < 1 || threads > MAX_THREADS) return 2;
    ferry_pool *pool = ferry_pool_create(threads, NULL, 0);
    if (!pool) return 2;
    call_arg *prev = NULL;
    for (long c = 0; c < calls; c++) {
        call_arg *a = calloc(1, sizeof *a); /* fresh each call: a stale worker's run shows on no later call */
        a->id = c;
        a->n[0] = c % 32 == 31 ? c % 41 : c % 5;
        a->n[1] = c % 32 == 31 ? (c * 7) % 37 : (c * 7) % 4;
        ferry_pool_run_items(pool, item, a, a->n[0], a->n[1]);
        atomic_store(&a->returned, 1);
        int bad = a->ran[0] != a->n[0] || a->ran[1] != a->n[1] || a->bad_index || a->shared_index || a->early;
        for (int ph = 0; ph < 2; ph++)
            for (int64_t i = 0; i < a->n[ph]; i++) bad |= atomic_load(&a->runs[ph][i]) != 1;
        if (prev && atomic_load(&prev->late)) { /* the call before ran an item after it had returned */
            printf("call %ld ran an item after it returned\n", c - 1);
            return 1;
        }
        if (bad) {
            printf("call %ld of %ld+%ld items: ran %ld+%ld, bad index %d, index shared %d, phase 1 early %d\n", c,
                   (long)a->n[0], (long)a->n[1], (long)a->ran[0], (long)a->ran[1], (int)a->bad_index,
                   (int)a->shared_index, (int)a->early);
            return 1;
        }
        free(prev); /* kept one call longer, to see a run after its return */
        prev = a;
        if (c % 1000 == 999) {
            printf("%ld\n", c + 1);
            fflush(stdout);
        }
    }
    ferry_pool_destroy(pool);
    if (prev && atomic_load(&prev->late)) {
        printf("the last call ran an item after it returned\n");
        return 1;
    }
    free(prev);
    printf("ok\n");
    return 0;
}
