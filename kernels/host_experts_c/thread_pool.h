/* A small pool of pthreads for the host expert kernel. Not OpenMP: a second OpenMP team beside
 * torch's stalls both on a host with fewer cores than their threads.
 * The calling thread is worker 0, so a pool of one thread starts no thread at all.
 *
 * A call is a list of items in two phases, each item claimed by whichever worker asks first, and it
 * returns when every item is done, not when every worker has come by: on a server host the pool's
 * threads share cores with the serving processes and the CUDA driver's threads, and a worker woken
 * late or preempted leaves its items to the others instead of holding the whole layer up. */
#ifndef FERRY_THREAD_POOL_H
#define FERRY_THREAD_POOL_H

#include <stdint.h>

typedef struct ferry_pool ferry_pool;
/* one item: `phase` 0 or 1, `item` its index within the phase; `worker` the index (< the pool's size) of
 * the thread running it, for scratch of its own */
typedef void (*ferry_item_fn)(void *arg, int worker, int phase, int64_t item);

/* `threads` workers, the caller one of them; with ncpus > 0 the threads' CPUs, the caller's first: started
 * worker i (1..threads - 1) is pinned to cpus[1 + (i - 1) % (ncpus - 1)] (to cpus[0] if ncpus is 1), and a
 * worker the kernel refuses to pin runs unpinned (ferry_pool_pinned counts); cpus[0] is where a caller that
 * asks is pinned */
ferry_pool *ferry_pool_create(int threads, const int *cpus, int ncpus);
int ferry_pool_pinned(const ferry_pool *pool);
/* pin the calling thread to cpus[0] (once a thread: later calls return at once); 0 where done or there is no
 * such CPU, an errno where refused. Only for a thread that does nothing else: a graph's host nodes, a poller */
int ferry_pool_pin_caller(ferry_pool *pool);
/* 1 once a caller was pinned, an errno if refused, 0 before any asked */
int ferry_pool_caller_pinned(const ferry_pool *pool);
/* how long an idle worker spins before it sleeps, from its next idle wait on */
void ferry_pool_set_spin(ferry_pool *pool, int64_t ns);
void ferry_pool_destroy(ferry_pool *pool);
int ferry_pool_size(const ferry_pool *pool);
/* fn(arg, w, 0, i) for every i < n0, then, once all of those are done, fn(arg, w, 1, i) for every i < n1,
 * each item once, on whichever workers claim it (the caller too); returns when all are done. One call at
 * a time; n0 + n1 < 2^32. */
void ferry_pool_run_items(ferry_pool *pool, ferry_item_fn fn, void *arg, int64_t n0, int64_t n1);

#endif
