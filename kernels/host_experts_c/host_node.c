/* ferry_host_node: one decode layer's host pairs (host_node.h). */
#include "host_node.h"

#include <string.h>
#include <time.h>

int ferry_host_kernel_compute(void *handle, const ferry_job *job);
int ferry_host_kernel_pin_caller(void *handle);

static int64_t hist_bound(int b) { return 50000LL << b; } /* 50 µs, 100 µs, ... 6.4 ms */

void ferry_host_node_hist_bounds(int64_t *bounds) {
    for (int b = 0; b < FERRY_NODE_HIST - 1; b++) bounds[b] = hist_bound(b);
}

void ferry_host_node(void *arg) {
    ferry_host_node_task *t = arg;
    if (t->pin_caller) ferry_host_kernel_pin_caller(t->kernel); /* once a thread; refused: it runs where it is */
    int64_t tokens = t->meta[0], n = t->meta[1];
    t->calls++;
    int bad = tokens < 0 || tokens > t->max_tokens || n < 0 || n > t->max_pairs;
    for (int64_t q = 0; !bad && q < n; q++)
        bad = t->job.pair_token[q] < 0 || t->job.pair_token[q] >= tokens || t->job.pair_expert[q] < 0 ||
              t->job.pair_expert[q] >= t->num_experts;
    if (bad) { /* nothing computed: the layer gets zeros from the host, and the step an error after it */
        if (!t->status) t->status = FERRY_ERANGE;
        memset(t->job.out, 0, (size_t)(t->max_tokens * t->job.hidden) * sizeof(float));
        return;
    }
    t->job.tokens = tokens;
    t->job.n_pairs = n;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int err = ferry_host_kernel_compute(t->kernel, &t->job);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (n > 0) {
        int64_t ns = (int64_t)(t1.tv_sec - t0.tv_sec) * 1000000000LL + (t1.tv_nsec - t0.tv_nsec);
        int b = 0;
        while (b < FERRY_NODE_HIST - 1 && ns > hist_bound(b)) b++;
        t->busy_ns += ns;
        t->busy_calls++;
        t->busy_hist[b]++;
    }
    if (err) { /* refused: zeros rather than the previous layer's sum, and the error for the step's end */
        if (!t->status) t->status = err;
        memset(t->job.out, 0, (size_t)(t->max_tokens * t->job.hidden) * sizeof(float));
        return;
    }
    t->pairs += n;
}
