/* The host expert kernel's entry points (ctypes: services/worker/offload/host_compute/host_expert_kernel.py).
 *
 * One call computes one MoE layer's listed (token, expert, router weight) pairs for a few tokens,
 * the contract of HostExperts.compute (host_experts.py): per expert, gate/up rows for all of its
 * tokens at once (every weight read once), the gate/up biases where the experts have them, the activation
 * (SiLU(gate) * up, gpt-oss's clamped SwiGLU or Gemma's gelu_tanh(gate) * up), down and its bias, then per token the pairs' weighted
 * rows summed in the order the pairs are listed, into float32 [T, H]. In bf16 compute the values
 * are rounded to bf16 where the torch path rounds them (its F.linear outputs, the bias sums, each op of
 * the activation), so the two agree to float32 sums' order; in float32 compute nothing is rounded but the sums.
 *
 * Work split, as items the pool's threads claim (thread_pool.h): phase 0's items are CHUNK intermediate
 * rows of one expert (its gate rows and their up rows together, so an item finishes its h values
 * alone); phase 1, once all of phase 0 is done, has blocks of output rows, each item the block's rows of
 * every expert's down projection and the weighted sum of exactly those rows, so no atomics. Items
 * are small enough that each thread sees several (DOWN_ITEMS_PER_THREAD): a thread that wakes late or
 * is preempted leaves the rest to the others. Each row's sum runs in the same order whichever thread
 * takes it, so the split changes no bit. */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "expert_job.h"
#include "gguf_blocks.h"
#include "thread_pool.h"

#define MAX_TOKENS 8 /* tokens the rows take at once; an expert with more is read again for the rest */
#define CHUNK 64     /* intermediate rows a thread computes between two combines */
#define PAD 32       /* activations' columns are padded to this: one bf16 vector */
#define PORTABLE_TILE 64 /* expert_rows_portable.c's TILE: the decode hook cuts rows as its rows do */
#define DOWN_ITEMS_PER_THREAD 4 /* phase 1's blocks of output rows a thread, where the rows allow */
#define DOWN_ROWS_MIN 16         /* the smallest block, and its multiple: a 64-byte line of float32 outputs,
                                  * so two threads' blocks share no line of y or out */

enum { FERRY_OK = 0, FERRY_EINVAL = -1, FERRY_EISA = -2, FERRY_ENOMEM = -3 };

typedef struct {
    ferry_pool *pool;
    pthread_mutex_t busy; /* one call at a time: the scratch is the handle's */
    void *scratch;
    size_t capacity;
    int64_t prefetch; /* bytes the rows fetch ahead of the weights (ferry_rows_fn), 0 none */
} ferry_kernel;

typedef struct {
    const ferry_job *job;
    ferry_rows_fn rows;
    int a_bf16;             /* activations and h are bf16 bits (dpbf16 rows), else float32 */
    int64_t used;           /* experts listed */
    const int64_t *expert;  /* [used] in order of first appearance */
    const int64_t *first;   /* [used + 1]: slots of expert u are first[u] .. first[u + 1] */
    const int64_t *slot_token;
    const int64_t *pair_slot;
    int64_t hpad, ipad;
    void *xa;               /* [slots, hpad] */
    void *ha;               /* [slots, ipad] */
    float *y;               /* [slots, hidden] */
    float *gate_up;         /* [workers, 2, MAX_TOKENS, CHUNK] */
    int64_t prefetch;       /* the kernel's, for this call */
    int64_t chunks;         /* phase 0's items an expert: ceil(inter / CHUNK) */
    int64_t down_rows;      /* output rows a phase 1 item */
} plan;

static int avx512_bf16_available(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512bf16");
#else
    return 0;
#endif
}

int ferry_host_isa_available(int isa) {
    return isa == FERRY_ISA_PORTABLE || (isa == FERRY_ISA_AVX512_BF16 && avx512_bf16_available());
}

/* cpus, ncpus: the pool's threads' CPUs, the caller's first (ferry_pool_create); ncpus 0 leaves them unpinned */
void *ferry_host_kernel_create(int threads, const int *cpus, int ncpus) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, ferry_tables_init);
    ferry_kernel *k = calloc(1, sizeof *k);
    if (!k) return NULL;
    if (!(k->pool = ferry_pool_create(threads, cpus, ncpus))) {
        free(k);
        return NULL;
    }
    pthread_mutex_init(&k->busy, NULL);
    return k;
}

int ferry_host_kernel_pinned(void *handle) { return ferry_pool_pinned(((ferry_kernel *)handle)->pool); }

/* the calling thread onto the caller's CPU (ferry_pool_pin_caller): host_node.c's and the poller's threads */
int ferry_host_kernel_pin_caller(void *handle) { return ferry_pool_pin_caller(((ferry_kernel *)handle)->pool); }

int ferry_host_kernel_caller_pinned(void *handle) { return ferry_pool_caller_pinned(((ferry_kernel *)handle)->pool); }

void ferry_host_kernel_set_spin(void *handle, int64_t ns) { ferry_pool_set_spin(((ferry_kernel *)handle)->pool, ns); }

/* read by each call as it starts: set it between calls (a graph's host node reads it too) */
void ferry_host_kernel_set_prefetch(void *handle, int64_t bytes) { ((ferry_kernel *)handle)->prefetch = bytes; }

void ferry_host_kernel_destroy(void *handle) {
    ferry_kernel *k = handle;
    if (!k) return;
    pthread_mutex_lock(&k->busy); /* a call still running (a graph's host node) finishes first */
    pthread_mutex_unlock(&k->busy);
    ferry_pool_destroy(k->pool);
    pthread_mutex_destroy(&k->busy);
    free(k->scratch);
    free(k);
}

static inline float silu(float g) { return g / (1.0f + expf(-g)); }

/* torch's gelu with the tanh approximation, as its CPU kernel computes it in float32 (bf16 inputs too, rounded
 * once after): 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), the cube and the products in that order */
static inline float gelu_tanh(float g) {
    const float beta = 0.7978845608028654f, kappa = 0.044715f; /* sqrt(2 / pi) */
    float inner = beta * (g + kappa * (g * g * g));
    return 0.5f * g * (1.0f + tanhf(inner));
}

/* h for rows i0.. of slots s0..s0+n from their gate and up rows (g, u: [n, CHUNK]) of the expert whose w13
 * bytes start at `w`: the biases added, then the activation. In bf16 compute every step is rounded to bf16
 * where the torch path (the reference twin) rounds it: the linear outputs, each bias (to bf16, as the twin
 * adds it) and each sum, then each op of the activation, as torch computes a bf16 op in float32 and rounds
 * it; a python scalar (alpha) stays float32 in a product, a clamp's bound is rounded to bf16 first. */
static void combine(const plan *p, const uint8_t *w, int64_t s0, int n, int64_t i0, int len, const float *g,
                    const float *u) {
    const ferry_job *job = p->job;
    int bf16 = job->act == FERRY_ACT_BF16, bias = job->w13.bias_offset >= 0, format = (int)job->format;
    int activation = (int)job->activation;
    float limit = (float)job->swiglu_limit, alpha = (float)job->swiglu_alpha;
    if (bf16) limit = ferry_round_bf16(limit);
    for (int j = 0; j < len; j++) {
        float bg = 0.0f, bu = 0.0f;
        if (bias) {
            bg = ferry_bias_at(&job->w13, format, w, i0 + j);
            bu = ferry_bias_at(&job->w13, format, w, job->inter + i0 + j);
            if (bf16) bg = ferry_round_bf16(bg), bu = ferry_round_bf16(bu);
        }
        for (int t = 0; t < n; t++) {
            float gate = g[t * CHUNK + j], up = u[t * CHUNK + j], h;
            if (bf16) gate = ferry_round_bf16(gate), up = ferry_round_bf16(up);
            if (bias) {
                gate += bg, up += bu;
                if (bf16) gate = ferry_round_bf16(gate), up = ferry_round_bf16(up);
            }
            if (activation == FERRY_CLAMPED_SWIGLU) { /* torch's clamp: min(max(x, lo), hi) */
                gate = fminf(gate, limit);
                up = fminf(fmaxf(up, -limit), limit);
                if (bf16) {
                    float sig = ferry_round_bf16(1.0f / (1.0f + expf(-ferry_round_bf16(gate * alpha))));
                    h = ferry_round_bf16(ferry_round_bf16(up + 1.0f) * ferry_round_bf16(gate * sig));
                } else {
                    h = (up + 1.0f) * (gate * (1.0f / (1.0f + expf(-(gate * alpha)))));
                }
            } else if (activation == FERRY_GELU_TANH) { /* torch's gelu of a bf16 tensor: rounded once */
                h = bf16 ? ferry_round_bf16(ferry_round_bf16(gelu_tanh(gate)) * up) : gelu_tanh(gate) * up;
            } else if (bf16) { /* bf16 SiLU, a bf16 product */
                h = ferry_round_bf16(ferry_round_bf16(silu(gate)) * up);
            } else {
                h = silu(gate) * up;
            }
            int64_t at = (s0 + t) * p->ipad + i0 + j;
            if (p->a_bf16) ((uint16_t *)p->ha)[at] = ferry_f32_to_bf16(h); /* exact: h is bf16 already */
            else ((float *)p->ha)[at] = h;
        }
    }
}

static const uint8_t *expert_bytes(const ferry_family *f, int64_t expert) {
    return f->base + expert * f->expert_stride;
}

/* phase 0's item: h for intermediate rows c .. c + CHUNK of one used expert, all its tokens */
static void gate_up_item(const plan *p, int worker, int64_t item) {
    const ferry_job *job = p->job;
    int64_t e = item / p->chunks, c = item % p->chunks * CHUNK, inter = job->inter;
    int len = inter - c < CHUNK ? (int)(inter - c) : CHUNK;
    float *g = p->gate_up + (size_t)worker * 2 * MAX_TOKENS * CHUNK, *u = g + MAX_TOKENS * CHUNK;
    size_t asize = p->a_bf16 ? 2 : 4;
    const uint8_t *w = expert_bytes(&job->w13, p->expert[e]);
    for (int64_t s0 = p->first[e]; s0 < p->first[e + 1]; s0 += MAX_TOKENS) {
        int n = p->first[e + 1] - s0 < MAX_TOKENS ? (int)(p->first[e + 1] - s0) : MAX_TOKENS;
        const void *a = (const uint8_t *)p->xa + (size_t)s0 * p->hpad * asize;
        p->rows(&job->w13, (int)job->format, (int)job->act, w, a, p->hpad, n, c, c + len, g, CHUNK, p->prefetch);
        p->rows(&job->w13, (int)job->format, (int)job->act, w, a, p->hpad, n, inter + c, inter + c + len, u, CHUNK,
                p->prefetch);
        combine(p, w, s0, n, c, len, g, u);
    }
}

/* phase 1's item: output rows r0 .. r0 + down_rows of every used expert's down projection, then those rows
 * of every token: the pairs' weighted rows in the order they are listed */
static void down_item(const plan *p, int64_t item) {
    const ferry_job *job = p->job;
    int64_t hidden = job->hidden, r0 = item * p->down_rows;
    int64_t r1 = hidden - r0 < p->down_rows ? hidden : r0 + p->down_rows;
    size_t asize = p->a_bf16 ? 2 : 4;
    for (int64_t e = 0; e < p->used; e++) {
        const uint8_t *w = expert_bytes(&job->w2, p->expert[e]);
        for (int64_t s0 = p->first[e]; s0 < p->first[e + 1]; s0 += MAX_TOKENS) {
            int n = p->first[e + 1] - s0 < MAX_TOKENS ? (int)(p->first[e + 1] - s0) : MAX_TOKENS;
            const void *a = (const uint8_t *)p->ha + (size_t)s0 * p->ipad * asize;
            p->rows(&job->w2, (int)job->format, (int)job->act, w, a, p->ipad, n, r0, r1, p->y + s0 * hidden + r0,
                    hidden, p->prefetch);
        }
    }
    int bf16 = job->act == FERRY_ACT_BF16, format = (int)job->format;
    for (int64_t t = 0; t < job->tokens; t++) memset(job->out + t * hidden + r0, 0, (size_t)(r1 - r0) * sizeof(float));
    for (int64_t q = 0; q < job->n_pairs; q++) {
        float *o = job->out + job->pair_token[q] * hidden;
        const float *y = p->y + p->pair_slot[q] * hidden;
        float weight = job->pair_weight[q];
        if (job->w2.bias_offset < 0) {
            for (int64_t r = r0; r < r1; r++) o[r] += (bf16 ? ferry_round_bf16(y[r]) : y[r]) * weight;
            continue;
        }
        /* the down bias joins the (rounded) output before the router weight, as the twin adds it */
        const uint8_t *w = expert_bytes(&job->w2, job->pair_expert[q]);
        for (int64_t r = r0; r < r1; r++) {
            float b = ferry_bias_at(&job->w2, format, w, r);
            float v = bf16 ? ferry_round_bf16(ferry_round_bf16(y[r]) + ferry_round_bf16(b)) : y[r] + b;
            o[r] += v * weight;
        }
    }
}

static void run_item(void *arg, int worker, int phase, int64_t item) {
    if (phase == 0) gate_up_item(arg, worker, item);
    else down_item(arg, item);
}

static size_t aligned(size_t bytes) { return (bytes + 63) & ~(size_t)63; }

/* a GGUF family: a block type the rows decode, rows of whole blocks */
static int gguf_rows_valid(const ferry_family *f) {
    return f->ggml_type >= 0 && f->ggml_type < FERRY_GGML_TYPES && f->cols % ferry_gguf_block_values[f->ggml_type] == 0;
}

static int valid(const ferry_job *job) {
    if (job->format < FERRY_F32 || job->format > FERRY_GGUF || job->act < 0 || job->act > 1) return 0;
    if (job->format == FERRY_GGUF && !(gguf_rows_valid(&job->w13) && gguf_rows_valid(&job->w2))) return 0;
    if (job->tokens < 0 || job->hidden < 1 || job->inter < 1 || job->n_pairs < 0) return 0;
    if (job->activation < FERRY_SILU || job->activation > FERRY_GELU_TANH) return 0; /* no silent SiLU */
    if (job->activation == FERRY_CLAMPED_SWIGLU &&
        (!(job->swiglu_limit > 0.0) || !isfinite(job->swiglu_limit) || !isfinite(job->swiglu_alpha)))
        return 0;
    if ((job->w13.bias_offset < 0) != (job->w2.bias_offset < 0)) return 0; /* both projections' biases or neither */
    if (job->format == FERRY_PACKED && job->w13.bias_offset >= 0) return 0;  /* packed banks hold no biases */
    if ((job->format == FERRY_NVFP4 || job->format == FERRY_MXFP4) &&
        (job->hidden % FERRY_FP4_GROUP(job->format) || job->inter % FERRY_FP4_GROUP(job->format)))
        return 0;
    /* packed rows must start on a code byte (packed_rows.h) */
    if (job->format == FERRY_PACKED && (job->hidden % 2 || job->inter % 2)) return 0;
    for (int64_t q = 0; q < job->n_pairs; q++)
        if (job->pair_token[q] < 0 || job->pair_token[q] >= job->tokens || job->pair_expert[q] < 0) return 0;
    return 1;
}

/* experts in order of first appearance, each with its distinct tokens as consecutive slots */
static void group_pairs(const ferry_job *job, int64_t *expert, int64_t *first, int64_t *slot_token,
                        int64_t *pair_slot, int64_t *pair_use, int64_t *token_slot, int64_t *used_out) {
    int64_t used = 0, slots = 0;
    for (int64_t q = 0; q < job->n_pairs; q++) {
        int64_t u = 0;
        while (u < used && expert[u] != job->pair_expert[q]) u++;
        if (u == used) expert[used++] = job->pair_expert[q];
        pair_use[q] = u;
    }
    for (int64_t t = 0; t < job->tokens; t++) token_slot[t] = -1;
    for (int64_t u = 0; u < used; u++) {
        first[u] = slots;
        for (int64_t q = 0; q < job->n_pairs; q++) {
            if (pair_use[q] != u) continue;
            int64_t t = job->pair_token[q];
            if (token_slot[t] < 0) {
                token_slot[t] = slots;
                slot_token[slots++] = t;
            }
            pair_slot[q] = token_slot[t];
        }
        for (int64_t s = first[u]; s < slots; s++) token_slot[slot_token[s]] = -1;
    }
    first[used] = slots;
    *used_out = used;
}

/* each slot's token, in the rows' dtype, its columns zero-padded */
static void gather_activations(const ferry_job *job, const plan *p, int64_t slots) {
    for (int64_t s = 0; s < slots; s++) {
        int64_t t = p->slot_token[s], h = job->hidden;
        if (p->a_bf16) {
            uint16_t *dst = (uint16_t *)p->xa + s * p->hpad;
            memcpy(dst, (const uint16_t *)job->x + t * h, (size_t)h * 2);
            memset(dst + h, 0, (size_t)(p->hpad - h) * 2);
        } else {
            float *dst = (float *)p->xa + s * p->hpad;
            if (job->act == FERRY_ACT_BF16)
                for (int64_t c = 0; c < h; c++) dst[c] = ferry_bf16_to_f32(((const uint16_t *)job->x)[t * h + c]);
            else
                memcpy(dst, (const float *)job->x + t * h, (size_t)h * 4);
            memset(dst + h, 0, (size_t)(p->hpad - h) * 4);
        }
    }
}

int ferry_host_kernel_compute(void *handle, const ferry_job *job) {
    ferry_kernel *k = handle;
    if (!k || !valid(job)) return FERRY_EINVAL;
    int isa = (int)job->isa;
    if (isa == FERRY_ISA_AUTO) isa = avx512_bf16_available() ? FERRY_ISA_AVX512_BF16 : FERRY_ISA_PORTABLE;
    if (!ferry_host_isa_available(isa)) return FERRY_EISA;
    if (job->n_pairs == 0) {
        memset(job->out, 0, (size_t)(job->tokens * job->hidden) * sizeof(float));
        return FERRY_OK;
    }
    plan p = {.job = job, .prefetch = k->prefetch < 0 ? 0 : k->prefetch};
#if defined(__x86_64__)
    p.rows = isa == FERRY_ISA_AVX512_BF16 ? ferry_rows_avx512 : ferry_rows_portable;
#else
    p.rows = ferry_rows_portable;
#endif
    /* the AVX-512 rows multiply bf16 pairs in bf16 compute; every other case takes float32 */
    p.a_bf16 = isa == FERRY_ISA_AVX512_BF16 && job->act == FERRY_ACT_BF16;
    p.hpad = (job->hidden + PAD - 1) / PAD * PAD;
    p.ipad = (job->inter + PAD - 1) / PAD * PAD;
    int64_t P = job->n_pairs, workers = ferry_pool_size(k->pool);
    size_t asize = p.a_bf16 ? 2 : 4, ints = aligned((size_t)P * 8), firsts = aligned((size_t)(P + 1) * 8);
    size_t sizes[] = {ints, firsts, ints, ints, ints, aligned((size_t)job->tokens * 8),
                      aligned((size_t)P * p.hpad * asize), aligned((size_t)P * p.ipad * asize),
                      aligned((size_t)P * job->hidden * 4), aligned((size_t)workers * 2 * MAX_TOKENS * CHUNK * 4)};
    size_t total = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) total += sizes[i];
    pthread_mutex_lock(&k->busy);
    if (total > k->capacity) { /* kept between calls: a fresh block a call would page-fault every time */
        void *grown = NULL;
        if (posix_memalign(&grown, 64, total) != 0) {
            pthread_mutex_unlock(&k->busy);
            return FERRY_ENOMEM;
        }
        free(k->scratch);
        k->scratch = grown;
        k->capacity = total;
    }
    uint8_t *at = k->scratch;
    void *part[sizeof sizes / sizeof *sizes];
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) part[i] = at, at += sizes[i];
    int64_t *expert = part[0], *pair_use = part[4], *token_slot = part[5];
    group_pairs(job, expert, part[1], part[2], part[3], pair_use, token_slot, &p.used);
    p.expert = expert, p.first = part[1], p.slot_token = part[2], p.pair_slot = part[3];
    p.xa = part[6], p.ha = part[7], p.y = part[8], p.gate_up = part[9];
    gather_activations(job, &p, p.first[p.used]);
    if (p.ipad > job->inter) { /* h's padding columns: zeros, so the down rows' last vector adds nothing */
        for (int64_t s = 0; s < p.first[p.used]; s++)
            memset((uint8_t *)p.ha + ((size_t)s * p.ipad + job->inter) * asize, 0, (size_t)(p.ipad - job->inter) * asize);
    }
    /* blocks of output rows: DOWN_ITEMS_PER_THREAD a thread, rounded up to a multiple of DOWN_ROWS_MIN rows */
    int64_t per = (job->hidden + DOWN_ITEMS_PER_THREAD * workers - 1) / (DOWN_ITEMS_PER_THREAD * workers);
    p.down_rows = (per + DOWN_ROWS_MIN - 1) / DOWN_ROWS_MIN * DOWN_ROWS_MIN;
    p.chunks = (job->inter + CHUNK - 1) / CHUNK;
    ferry_pool_run_items(k->pool, run_item, &p, p.used * p.chunks, (job->hidden + p.down_rows - 1) / p.down_rows);
    pthread_mutex_unlock(&k->busy);
    return FERRY_OK;
}

/* The tests' window on the packed decode: rows r0..r1 of family f of expert `expert` as bf16 bits
 * [r1 - r0, cols], decoded by the instruction set's own code (the code its rows multiply with),
 * to be held bit for bit to kernels/expert_pack.py's unpack_expert_reference. */
int ferry_host_decode_packed(const ferry_family *f, int isa, int64_t expert, int64_t r0, int64_t r1, uint16_t *out) {
    if (isa == FERRY_ISA_AUTO) isa = avx512_bf16_available() ? FERRY_ISA_AVX512_BF16 : FERRY_ISA_PORTABLE;
    if (!ferry_host_isa_available(isa)) return FERRY_EISA;
    if (expert < 0 || r0 < 0 || r1 > f->rows || r0 > r1 || f->cols % 2) return FERRY_EINVAL;
    const uint8_t *w = expert_bytes(f, expert);
#if defined(__x86_64__)
    if (isa == FERRY_ISA_AVX512_BF16) {
        ferry_packed_rows_avx512(f, w, r0, r1, out);
        return FERRY_OK;
    }
#endif
    for (int64_t r = r0; r < r1; r++) /* the portable rows' tiles, as decode_tile cuts them */
        for (int64_t c0 = 0; c0 < f->cols; c0 += PORTABLE_TILE) {
            int n = f->cols - c0 < PORTABLE_TILE ? (int)(f->cols - c0) : PORTABLE_TILE;
            ferry_packed_bits_portable(f, w, r, c0, n, out + (r - r0) * f->cols + c0);
        }
    return FERRY_OK;
}

/* The tests' window on the other formats' decode: rows r0..r1 of family f (in `format`, any but packed) of expert
 * `expert` as float32 [r1 - r0, cols], decoded by the instruction set's own code for float32 compute, to be held
 * bit for bit to the twin's dequantization (kernels/gguf_blocks.py, kernels/quantized_experts.py). */
int ferry_host_decode_rows(const ferry_family *f, int format, int isa, int64_t expert, int64_t r0, int64_t r1,
                           float *out) {
    if (isa == FERRY_ISA_AUTO) isa = avx512_bf16_available() ? FERRY_ISA_AVX512_BF16 : FERRY_ISA_PORTABLE;
    if (!ferry_host_isa_available(isa)) return FERRY_EISA;
    if (format < FERRY_F32 || format > FERRY_GGUF || format == FERRY_PACKED) return FERRY_EINVAL;
    if (format == FERRY_GGUF && !gguf_rows_valid(f)) return FERRY_EINVAL;
    if (expert < 0 || r0 < 0 || r1 > f->rows || r0 > r1) return FERRY_EINVAL;
    const uint8_t *w = expert_bytes(f, expert);
#if defined(__x86_64__)
    if (isa == FERRY_ISA_AVX512_BF16) {
        ferry_decode_rows_avx512(f, format, w, r0, r1, out);
        return FERRY_OK;
    }
#endif
    ferry_decode_rows_portable(f, format, w, r0, r1, out);
    return FERRY_OK;
}
