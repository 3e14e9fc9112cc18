/* The host's share of decode layers handed over by polling instead of a host node
 * (services/worker/offload/host_compute/decode_share.py): in the step's CUDA graph, after the pairs and the input are
 * in pinned memory, the GPU writes the layer's number + 1 to `go` (a stream memory operation) and waits
 * until `done` holds the same number; a thread of ours that spins on `go` computes the layer's task
 * (ferry_host_node) and answers in `done`. No CUDA driver thread to wake and no host node's round trip:
 * two words over PCIe. The thread spins for `spin_ns` after its last layer, then naps between looks,
 * longer and longer (up to 1 ms), so an idle server costs about 1 % of a core. */
#ifndef FERRY_HOST_POLLER_H
#define FERRY_HOST_POLLER_H

#include <stdint.h>

#include "host_node.h"

typedef struct {
    uint32_t go;        /* written by the GPU: a layer's number + 1; cleared here once taken */
    uint32_t pad0[15];  /* a cache line each: the GPU's writes and the host's never share one */
    uint32_t done;      /* written here: the number taken, once its sum is in pinned memory */
    uint32_t pad1[15];
} ferry_poll_flags;

typedef struct ferry_poller ferry_poller;

/* a thread answering `flags` (pinned, sizeof(ferry_poll_flags) bytes, zeroed) with tasks[go - 1]; NULL if the
 * thread could not start. A number past ntasks is answered with zeros and task 0's status set (-4). */
ferry_poller *ferry_poller_create(ferry_host_node_task **tasks, int64_t ntasks, ferry_poll_flags *flags,
                                  int64_t spin_ns);
/* stops and joins the thread (a layer it has taken is finished first) */
void ferry_poller_destroy(ferry_poller *poller);
/* layers answered since creation */
int64_t ferry_poller_rounds(const ferry_poller *poller);
unsigned long ferry_poll_flags_size(void);

#endif
