/* A small pool of pthreads for the host expert kernel. Not OpenMP: a second OpenMP team beside
 * torch's stalls both on a host with fewer cores than their threads (bench/NOTES.md, issue 25).
 * The calling thread is worker 0, so a pool of one thread starts no thread at all. */
#ifndef FERRY_THREAD_POOL_H
#define FERRY_THREAD_POOL_H

typedef struct ferry_pool ferry_pool;
typedef void (*ferry_task)(void *arg, int worker, int workers);

/* `threads` workers, the caller one of them; with ncpus > 0 started worker i (1..threads - 1) is pinned to
 * cpus[(i - 1) % ncpus], and a worker the kernel refuses to pin runs unpinned (ferry_pool_pinned counts) */
ferry_pool *ferry_pool_create(int threads, const int *cpus, int ncpus);
int ferry_pool_pinned(const ferry_pool *pool);
void ferry_pool_destroy(ferry_pool *pool);
int ferry_pool_size(const ferry_pool *pool);
/* task(arg, w, n) on every worker w < n, the caller as worker 0; returns when all have returned */
void ferry_pool_run(ferry_pool *pool, ferry_task task, void *arg);
/* inside a task: every worker waits here until all have arrived */
void ferry_pool_barrier(ferry_pool *pool);

#endif
