/* One call of the host expert kernel (services/worker/offload/host_compute/host_expert_kernel.py fills it through
 * ctypes; every field is 8 bytes wide so the two sides cannot disagree on padding).
 *
 * Weights are read where they lie, in the host banks: expert e's family f starts at
 * f.base + e * f.expert_stride. Plain banks are rows of float32 or bf16 values; quantized banks are
 * the byte rows of plan/expert_formats.py, whose parts (codes, scales, row scales) sit at the offsets
 * given here, so this file never needs to know how the layout is priced. GGUF banks are rows of the
 * file's blocks (gguf_blocks.h), each family of its own block type. Packed banks
 * (kernels/expert_pack.py) keep a family's values in two blocks, its sign-and-mantissa bytes at
 * base and its exponent codes at hi, with a per-expert exponent base and escape list
 * (packed_rows.h decodes them). */
#ifndef FERRY_EXPERT_JOB_H
#define FERRY_EXPERT_JOB_H

#include <stdint.h>

enum ferry_format {
    FERRY_F32 = 0, FERRY_BF16 = 1, FERRY_FP8_BLOCK = 2, FERRY_NVFP4 = 3, FERRY_PACKED = 4, FERRY_MXFP4 = 5,
    FERRY_GGUF = 6 /* a GGUF file's blocks, their type a family's (ggml_type: gguf-mixed's differ by layer) */
};
/* the fp4 formats: e2m1 codes two a byte (element 2j in the low nibble) under a scale a group */
#define FERRY_FP4_GROUP(format) ((format) == FERRY_MXFP4 ? 32 : 16)
/* the compute dtype: the torch path multiplies in it, so its roundings are the contract */
enum ferry_act { FERRY_ACT_F32 = 0, FERRY_ACT_BF16 = 1 };
enum ferry_isa { FERRY_ISA_AUTO = 0, FERRY_ISA_PORTABLE = 1, FERRY_ISA_AVX512_BF16 = 2 };
/* the experts' activation of gate and up, kernels/expert_epilogue.py's codes (activation_code) */
enum ferry_activation { FERRY_SILU = 0, FERRY_CLAMPED_SWIGLU = 1, FERRY_GELU_TANH = 2 };

typedef struct {
    const uint8_t *base;   /* expert 0's row of this family in the layer's bank */
    int64_t expert_stride; /* bytes from one expert to the next */
    int64_t rows, cols;    /* outputs, inputs */
    int64_t part_rows;     /* rows per projection: fp8 block rows restart at every part */
    int64_t q_offset;      /* bytes from the expert's row start to its values or codes */
    int64_t scale_offset;  /* fp8: float32 [block rows, col_blocks]; nvfp4: e4m3 [rows, cols / 16];
                              mxfp4: e8m0 [rows, cols / 32] */
    int64_t gscale_offset; /* nvfp4: float32 [rows] */
    int64_t col_blocks;    /* fp8: ceil(cols / 128) */
    /* packed only: base is expert 0's lo bytes of this family and expert_stride a packed row (V bytes) */
    const uint8_t *hi;          /* expert 0's exponent codes of this family, two a byte (low nibble first) */
    int64_t hi_stride;          /* bytes from one expert's codes to the next (V / 2) */
    const int32_t *exp_base;    /* expert 0's exponent base of this family; expert e's is exp_base[2 e] */
    const int64_t *esc_offsets; /* [E + 1]: expert e's escapes are esc_offsets[e] .. esc_offsets[e + 1] */
    const int32_t *esc_index;   /* positions in the expert's V values, ascending within an expert */
    const uint16_t *esc_bits;   /* their bf16 bits, kept whole */
    int64_t first_value;        /* this family's first value in the expert's row of V (0 or V13) */
    /* the expert's biases, one a row, added to its rows' outputs (ferry_bias_at): bytes from the expert's row
     * start, -1 none. bf16 banks keep them as bf16 (rows after the weights: bias_rows), every other format
     * as float32 (quantized rows' bias part); packed banks hold none */
    int64_t bias_offset;
    int64_t ggml_type; /* GGUF: the rows' block type (enum ferry_ggml_type, gguf_blocks.h) */
} ferry_family;

typedef struct {
    int64_t format, act, isa;
    int64_t tokens, hidden, inter;
    const void *x; /* [tokens, hidden] in the compute dtype */
    int64_t n_pairs;
    const int64_t *pair_token, *pair_expert;
    const float *pair_weight;
    ferry_family w13, w2;
    float *out; /* float32 [tokens, hidden], overwritten */
    /* FERRY_CLAMPED_SWIGLU's parameters (gpt-oss, kernels/expert_epilogue.py): g = min(gate, limit),
     * u = clamp(up, -limit, limit), (u + 1) * g * sigmoid(alpha * g); the other activations ignore them */
    double swiglu_limit, swiglu_alpha;
    /* enum ferry_activation: silu(gate) * up, the clamped SwiGLU, or gelu_tanh(gate) * up (Gemma's experts);
     * a job with any other code is refused, never computed as SiLU */
    int64_t activation;
} ferry_job;

/* The rows one instruction set computes: y[t * y_stride + (r - r0)] = sum_c w[r, c] * a[t * a_stride + c]
 * for rows r0 <= r < r1 of family f of the expert whose bytes start at `expert`, n tokens.
 * `a` is bf16 (uint16 bits) when the ISA computes in bf16 pairs and act is bf16, else float32, with
 * its columns zero-padded to a multiple of 32 (a_stride). In bf16 compute, every weight is rounded
 * to bf16 first, as the torch path's reader does. `prefetch`: how many bytes ahead of the weights it
 * multiplies the rows ask the CPU to fetch (0: none; the portable rows ignore it). */
typedef void (*ferry_rows_fn)(const ferry_family *f, int format, int act, const uint8_t *expert,
                              const void *a, int64_t a_stride, int n, int64_t r0, int64_t r1,
                              float *y, int64_t y_stride, int64_t prefetch);

void ferry_rows_portable(const ferry_family *f, int format, int act, const uint8_t *expert, const void *a,
                         int64_t a_stride, int n, int64_t r0, int64_t r1, float *y, int64_t y_stride,
                         int64_t prefetch);
#if defined(__x86_64__)
void ferry_rows_avx512(const ferry_family *f, int format, int act, const uint8_t *expert, const void *a,
                       int64_t a_stride, int n, int64_t r0, int64_t r1, float *y, int64_t y_stride,
                       int64_t prefetch);
#endif

/* Rows r0..r1 of family f (any format but packed) of the expert whose bytes start at `expert` as float32
 * [r1 - r0, cols], decoded by each ISA's own code for float32 compute, the code its rows multiply with: the
 * tests' window on the decode (ferry_host_decode_rows), held bit for bit to the twin's dequantization. */
void ferry_decode_rows_portable(const ferry_family *f, int format, const uint8_t *expert, int64_t r0, int64_t r1,
                                float *out);
#if defined(__x86_64__)
void ferry_decode_rows_avx512(const ferry_family *f, int format, const uint8_t *expert, int64_t r0, int64_t r1,
                              float *out);
#endif

/* A packed family's rows r0..r1 of one expert as bf16 bits [r1 - r0, cols], decoded by each ISA's
 * own code, the very code its rows multiply with: the tests' window on the decode (ferry_host_decode_packed). */
void ferry_packed_bits_portable(const ferry_family *f, const uint8_t *expert, int64_t r, int64_t c0, int n,
                                uint16_t *bits);
#if defined(__x86_64__)
void ferry_packed_rows_avx512(const ferry_family *f, const uint8_t *expert, int64_t r0, int64_t r1, uint16_t *bits);
#endif

/* Exact value tables, shared by both ISAs so they decode alike. */
extern float ferry_e4m3_value[256]; /* e4m3fn code -> value (0x7F/0xFF: 480, as the torch path decodes) */
extern const float ferry_e2m1_value[16];
extern float ferry_e8m0_value[256]; /* e8m0 byte s -> 2^(s - 127) (0: the subnormal 2^-127; 255: inf) */
extern uint16_t ferry_e2m1_bf16[32]; /* the same as bf16 bits, for one vpermw; 16-31 repeat 0-15 */
extern uint16_t ferry_gguf_mxfp4_bf16[32]; /* GGUF MXFP4's values (ggml's, halved: code 8 is +0) as bf16 bits, as above */
void ferry_tables_init(void);

static inline float ferry_bf16_to_f32(uint16_t b) {
    union { uint32_t u; float f; } v = {(uint32_t)b << 16};
    return v.f;
}

/* float32 -> bf16 bits, round to nearest even (torch's rounding); NaN stays NaN */
static inline uint16_t ferry_f32_to_bf16(float f) {
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((v.u >> 16) | 0x40);
    return (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
}

static inline float ferry_round_bf16(float f) { return ferry_bf16_to_f32(ferry_f32_to_bf16(f)); }

/* row r's bias of family f (format `format`) for the expert whose bytes start at `expert`, as stored */
static inline float ferry_bias_at(const ferry_family *f, int format, const uint8_t *expert, int64_t r) {
    const uint8_t *at = expert + f->bias_offset;
    if (format == FERRY_BF16) {
        uint16_t b;
        __builtin_memcpy(&b, at + 2 * r, 2);
        return ferry_bf16_to_f32(b);
    }
    float v;
    __builtin_memcpy(&v, at + 4 * r, 4); /* a part's offset need not be 4-aligned */
    return v;
}

#endif
