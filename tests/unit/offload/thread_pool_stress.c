/* The host kernel's thread pool (kernels/host_experts_c/thread_pool.c) under calls back to back:
 * every item of every call runs exactly once, on that call's arguments, phase 1 only after all of
 * phase 0, and the call returns only once all are done. Calls of 0 to 6 items, many of them empty,
 * so that a worker still looking at an ended call meets the next one being set up (a ticket that
 * counted up to a separate total let such a worker claim past the end: items ran twice).
 * Usage: thread_pool_stress THREADS CALLS; prints "ok", or the first bad call and exits 1. */
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "thread_pool.h"

typedef struct {
    int64_t n0, n1;
    atomic_long ran[2];      /* items run, per phase */
    atomic_long mask[2];     /* which items, per phase */
    atomic_int twice, early; /* an item run twice; a phase 1 item run before phase 0 was done */
} call_arg;

static void item(void *p, int worker, int phase, int64_t i) {
    call_arg *a = p;
    (void)worker;
    if (phase == 1 && atomic_load(&a->ran[0]) != a->n0) atomic_store(&a->early, 1);
    if (atomic_fetch_or(&a->mask[phase], 1L << i) & (1L << i)) atomic_store(&a->twice, 1);
    atomic_fetch_add(&a->ran[phase], 1);
}

int main(int argc, char **argv) {
    if (argc != 3) return 2;
    int threads = atoi(argv[1]);
    long calls = atol(argv[2]);
    ferry_pool *pool = ferry_pool_create(threads, NULL, 0);
    if (!pool) return 2;
    for (long c = 0; c < calls; c++) {
        call_arg *a = calloc(1, sizeof *a); /* fresh each call: a stale worker's run shows on no later call */
        a->n0 = c % 5;
        a->n1 = (c * 7) % 4;
        ferry_pool_run_items(pool, item, a, a->n0, a->n1);
        int bad = a->ran[0] != a->n0 || a->ran[1] != a->n1 || a->twice || a->early ||
                  a->mask[0] != (1L << a->n0) - 1 || a->mask[1] != (1L << a->n1) - 1;
        if (bad) {
            printf("call %ld of %ld+%ld items: ran %ld+%ld, twice %d, phase 1 early %d\n", c, (long)a->n0,
                   (long)a->n1, (long)a->ran[0], (long)a->ran[1], (int)a->twice, (int)a->early);
            return 1;
        }
        free(a);
    }
    ferry_pool_destroy(pool);
    printf("ok\n");
    return 0;
}
