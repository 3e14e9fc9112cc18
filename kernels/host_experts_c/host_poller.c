/* ferry_poller: the polled hand-off of decode layers to the host (host_poller.h). */
#define _GNU_SOURCE
#include "host_poller.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "spin.h"


/* once idle past spin_ns, the thread naps between looks, each nap twice the last from NAP_MIN_NS up to
 * NAP_MAX_NS: an idle server wakes it ~1,000 times a second (about 1 % of a core), and the first layer after
 * a pause waits up to a nap (plus the kernel's timer slack, ~50 µs) */
#define NAP_MIN_NS 20000
#define NAP_MAX_NS 1000000

int ferry_host_kernel_pin_caller(void *handle);

struct ferry_poller {
    pthread_t thread;
    ferry_host_node_task **tasks;
    int64_t ntasks, spin_ns;
    ferry_poll_flags *flags;
    atomic_int stop;
    atomic_llong rounds;
};

/* one layer: its task, or for a number no task has, zeros and the error on task 0 (the step then fails) */
static void answer(ferry_poller *p, uint32_t go) {
    if (go <= p->ntasks) {
        ferry_host_node(p->tasks[go - 1]);
        return;
    }
    ferry_host_node_task *t = p->tasks[0];
    if (!t->status) t->status = FERRY_ERANGE;
    memset(t->job.out, 0, (size_t)(t->max_tokens * t->job.hidden) * sizeof(float));
}

static void *poll_main(void *arg) {
    ferry_poller *p = arg;
    ferry_host_kernel_pin_caller(p->tasks[0]->kernel); /* it runs nothing but the pool's calls: the caller's CPU */
    uint32_t *go = &p->flags->go, *done = &p->flags->done;
    long long last = ferry_now_ns(), nap = 0;
    for (unsigned i = 1; !atomic_load_explicit(&p->stop, memory_order_relaxed); i++) {
        uint32_t layer = __atomic_load_n(go, __ATOMIC_ACQUIRE); /* the GPU's write follows its copies */
        if (!layer) {
            if (nap) { /* idle: a nap every look, each longer */
                struct timespec ts = {0, (long)nap};
                nanosleep(&ts, NULL);
                nap = nap * 2 < NAP_MAX_NS ? nap * 2 : NAP_MAX_NS;
            } else if ((i & 255) == 0 && ferry_now_ns() - last > p->spin_ns) {
                nap = NAP_MIN_NS;
            } else {
                CPU_RELAX();
            }
            continue;
        }
        nap = 0;
        __atomic_store_n(go, 0, __ATOMIC_RELAXED); /* before the answer: the GPU writes the next go after it */
        answer(p, layer);
        atomic_fetch_add_explicit(&p->rounds, 1, memory_order_relaxed);
        __atomic_store_n(done, layer, __ATOMIC_RELEASE); /* the sum is in pinned memory before this */
        last = ferry_now_ns();
    }
    return NULL;
}

ferry_poller *ferry_poller_create(ferry_host_node_task **tasks, int64_t ntasks, ferry_poll_flags *flags,
                                  int64_t spin_ns) {
    if (!tasks || ntasks < 1 || !flags) return NULL;
    ferry_poller *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->tasks = malloc((size_t)ntasks * sizeof *tasks);
    if (!p->tasks) {
        free(p);
        return NULL;
    }
    memcpy(p->tasks, tasks, (size_t)ntasks * sizeof *tasks);
    p->ntasks = ntasks;
    p->spin_ns = spin_ns < 0 ? 0 : spin_ns;
    p->flags = flags;
    if (pthread_create(&p->thread, NULL, poll_main, p) != 0) {
        free(p->tasks);
        free(p);
        return NULL;
    }
    return p;
}

void ferry_poller_destroy(ferry_poller *p) {
    if (!p) return;
    atomic_store(&p->stop, 1);
    pthread_join(p->thread, NULL);
    free(p->tasks);
    free(p);
}

int64_t ferry_poller_rounds(const ferry_poller *p) { return atomic_load(&p->rounds); }

unsigned long ferry_poll_flags_size(void) { return sizeof(ferry_poll_flags); }
