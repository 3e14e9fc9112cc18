/* The host's share of a decode layer, run as a host node of the step's CUDA graph
 * (services/worker/offload/host_compute/decode_share.py): the device has written the pairs the host
 * computes and copied them, with the layer's input, into pinned memory; this function computes them
 * into pinned memory the graph then copies back. It runs on the CUDA driver's callback thread, with
 * no Python and no CUDA call; errors are kept in `status` for the host to read after the step. */
#ifndef FERRY_HOST_NODE_H
#define FERRY_HOST_NODE_H

#include <stdint.h>

#include "expert_job.h"

#define FERRY_ERANGE (-4) /* a task's status: pairs (or a polled layer number) out of range */
#define FERRY_NODE_HIST 9 /* buckets of a call's wall time: 50 µs doubling to 6.4 ms, then the rest */

typedef struct {
    void *kernel;        /* a ferry_host_kernel_create handle */
    ferry_job job;       /* all but tokens and n_pairs set once; x, out and the pair arrays are pinned */
    const int64_t *meta; /* pinned [2], written by the device: the step's token rows, the host's pairs */
    int64_t num_experts; /* a pair's expert must be below it (the C rows read the banks by it unchecked) */
    int64_t max_tokens, max_pairs; /* the buffers' sizes */
    int64_t pin_caller;  /* 1: the thread that runs it is pinned to the pool's caller CPU (the driver's thread or
                          * the poller: they run nothing else), 0 where it is the caller's own thread */
    int64_t status;      /* 0, or the first error: FERRY_E* of host_experts.c, FERRY_ERANGE for pairs out of range */
    int64_t calls, pairs; /* since boot */
    int64_t busy_ns, busy_calls; /* since boot: the wall time of the calls that computed pairs, and their
                                  * number (what the split's price of a host expert is checked against) */
    int64_t busy_hist[FERRY_NODE_HIST]; /* those calls by wall time: at most ferry_host_node_hist_bounds()[i] ns, the
                                          * last bucket the rest (the tail a mean hides; /metrics) */
} ferry_host_node_task;

void ferry_host_node(void *task);
/* the buckets' upper bounds in ns, FERRY_NODE_HIST - 1 of them (the last bucket has none) */
void ferry_host_node_hist_bounds(int64_t *bounds);

#endif
