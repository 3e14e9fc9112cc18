/* The portable rows: plain C that any compiler vectorises (SSE2 on x86-64, NEON on aarch64), and the
 * twin the AVX-512 rows are tested against. Each row is decoded a tile of columns at a time into
 * float32 (exactly as kernels/quantized_experts.py dequantizes: float32 math, then one rounding to the
 * compute dtype), then multiplied with every token's activations into 16 partial sums a token: 16
 * independent sums let the compiler vectorise without reassociating a single float sum, which it
 * may not do without -ffast-math. */
#include <math.h>

#include "expert_job.h"
#include "gguf_blocks.h"
#include "packed_rows.h"

#define TILE 64    /* columns decoded at a time: a multiple of 32 (the activations' padding) */
#define LANES 16
#define MAX_TOKENS 8

float ferry_e4m3_value[256];
const float ferry_e2m1_value[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

uint16_t ferry_e2m1_bf16[32];
uint16_t ferry_gguf_mxfp4_bf16[32];
float ferry_e8m0_value[256];

void ferry_tables_init(void) {
    for (int c = 0; c < 32; c++) ferry_e2m1_bf16[c] = ferry_f32_to_bf16(ferry_e2m1_value[c & 15]);
    for (int c = 0; c < 32; c++) ferry_gguf_mxfp4_bf16[c] = ferry_f32_to_bf16(0.5f * ferry_mxfp4_doubled[c & 15]);
    for (int c = 0; c < 256; c++) ferry_e8m0_value[c] = ldexpf(1.0f, c - 127);
    for (int c = 0; c < 256; c++) {
        int e = (c >> 3) & 15, m = c & 7;
        /* subnormals (e = 0) are m x 2^-9; 0x7F reads as 480 like the torch path's float16 trick */
        float v = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + (float)m / 8.0f, e - 7);
        ferry_e4m3_value[c] = (c & 0x80) ? -v : v;
    }
}

/* bf16 bits of columns c0..c0+n of packed row r (packed_rows.h): every value from lo and its code,
 * then the tile's escapes from the list */
void ferry_packed_bits_portable(const ferry_family *f, const uint8_t *expert, int64_t r, int64_t c0, int n,
                                uint16_t *bits) {
    ferry_packed_row p;
    ferry_packed_row_at(f, expert, r, c0, c0 + n, -1, &p);
    for (int k = 0; k < n / 2; k++) { /* a code byte a pair of values (n is even: even rows), no branch */
        uint8_t codes = p.hi[k];
        bits[2 * k] = ferry_packed_bits(p.lo[2 * k], codes & 15, p.base);
        bits[2 * k + 1] = ferry_packed_bits(p.lo[2 * k + 1], codes >> 4, p.base);
    }
    for (int64_t k = p.esc; k < p.esc_end; k++) bits[p.esc_index[k] - p.pos] = p.esc_bits[k];
}

/* group g (values 32 g .. 32 g + 31) of a GGUF row of block type `type` into w, in float32: the twin's
 * formulas (kernels/gguf_blocks.py), each product and sum rounded in its order */
static void gguf_group(int type, const uint8_t *row, int64_t g, float *w) {
    int j;
    const uint8_t *b = ferry_gguf_block(type, row, g, &j);
    switch (type) {
    case FERRY_Q8_0: {
        float d = ferry_gguf_half(b);
        for (int i = 0; i < 32; i++) w[i] = d * (float)(int8_t)b[2 + i];
        break;
    }
    case FERRY_Q4_0:
    case FERRY_IQ4_NL:
    case FERRY_GGUF_MXFP4: { /* 16 bytes: the low nibbles are values 0-15, the high 16-31 */
        const uint8_t *qs = b + (type == FERRY_GGUF_MXFP4 ? 1 : 2);
        float d = type == FERRY_GGUF_MXFP4 ? ferry_gguf_e8m0_half(b[0]) : ferry_gguf_half(b);
        for (int i = 0; i < 32; i++) {
            int q = (i < 16 ? qs[i] : qs[i - 16] >> 4) & 0x0F;
            w[i] = type == FERRY_Q4_0 ? d * ((float)q - 8.0f)
                   : type == FERRY_IQ4_NL ? d * ferry_iq4_grid[q] : d * ferry_mxfp4_doubled[q];
        }
        break;
    }
    case FERRY_Q4_1: {
        float d = ferry_gguf_half(b), m = ferry_gguf_half(b + 2);
        for (int i = 0; i < 32; i++) w[i] = d * (float)((i < 16 ? b[4 + i] : b[4 + i - 16] >> 4) & 0x0F) + m;
        break;
    }
    case FERRY_Q5_0:
    case FERRY_Q5_1: { /* Q4_0's nibbles under a fifth bit a value (bit i of the word: value i) */
        int one = type == FERRY_Q5_1;
        float d = ferry_gguf_half(b), m = one ? ferry_gguf_half(b + 2) : 0.0f;
        uint32_t qh = ferry_gguf_u32(b + 2 + 2 * one);
        const uint8_t *qs = b + 6 + 2 * one;
        for (int i = 0; i < 32; i++) {
            int q = ((i < 16 ? qs[i] : qs[i - 16] >> 4) & 0x0F) | (int)((qh >> i) & 1) << 4;
            w[i] = one ? d * (float)q + m : d * ((float)q - 16.0f);
        }
        break;
    }
    case FERRY_Q4_K:
    case FERRY_Q5_K: { /* sub-block j: nibble j % 2 of 32 bytes, 32 (j / 2) into the codes; Q5_K: bit j of qh */
        int sc, mn, five = type == FERRY_Q5_K;
        ferry_gguf_k_scale(b + 4, j, &sc, &mn);
        float ds = ferry_gguf_half(b) * (float)sc, dm = ferry_gguf_half(b + 2) * (float)mn;
        const uint8_t *qs = b + (five ? 48 : 16) + 32 * (j / 2), *qh = b + 16;
        for (int i = 0; i < 32; i++) {
            int q = (qs[i] >> 4 * (j & 1)) & 0x0F;
            if (five) q |= ((qh[i] >> j) & 1) << 4;
            w[i] = ds * (float)q - dm;
        }
        break;
    }
    case FERRY_Q6_K: { /* group j of its block: half h = j / 4, quarter t = j % 4 of the half's 128 values */
        int h = j / 4, t = j % 4;
        const uint8_t *ql = b + 64 * h + 32 * (t & 1), *qh = b + 128 + 32 * h;
        float d = ferry_gguf_half(b + 208);
        float s0 = d * (float)(int8_t)b[192 + 2 * j], s1 = d * (float)(int8_t)b[193 + 2 * j];
        for (int i = 0; i < 32; i++) {
            int q = ((ql[i] >> 4 * (t >> 1)) & 0x0F) | ((qh[i] >> 2 * t) & 3) << 4;
            w[i] = (i < 16 ? s0 : s1) * ((float)q - 32.0f);
        }
        break;
    }
    default: { /* IQ4_XS: sub-block j's 16 bytes in Q4_0's nibble order, under d (scale - 32) */
        float dl = ferry_gguf_half(b) * (float)ferry_gguf_iq4_xs_scale(b, j);
        const uint8_t *qs = b + 8 + 16 * j;
        for (int i = 0; i < 32; i++) w[i] = dl * ferry_iq4_grid[(i < 16 ? qs[i] : qs[i - 16] >> 4) & 0x0F];
        break;
    }
    }
}

/* weights w[0..n) of row r from column c0 (n <= TILE), in float32 after the compute dtype's rounding */
static void decode_tile(const ferry_family *f, int format, int act, const uint8_t *expert, int64_t r,
                        int64_t c0, int n, float *w) {
    const uint8_t *q = expert + f->q_offset;
    if (format == FERRY_F32) {
        const float *row = (const float *)q + r * f->cols + c0;
        for (int j = 0; j < n; j++) w[j] = row[j];
    } else if (format == FERRY_BF16) {
        const uint16_t *row = (const uint16_t *)q + r * f->cols + c0;
        for (int j = 0; j < n; j++) w[j] = ferry_bf16_to_f32(row[j]);
        return; /* already bf16 */
    } else if (format == FERRY_PACKED) {
        uint16_t bits[TILE];
        ferry_packed_bits_portable(f, expert, r, c0, n, bits);
        for (int j = 0; j < n; j++) w[j] = ferry_bf16_to_f32(bits[j]);
        return; /* bf16 values, as the plain bf16 rows read them */
    } else if (format == FERRY_FP8_BLOCK) {
        int64_t part = r / f->part_rows;
        int64_t block_row = part * ((f->part_rows + 127) / 128) + (r % f->part_rows) / 128;
        const float *scales = (const float *)(expert + f->scale_offset) + block_row * f->col_blocks;
        const uint8_t *row = q + r * f->cols + c0;
        for (int j = 0; j < n; j++) w[j] = ferry_e4m3_value[row[j]] * scales[(c0 + j) / 128];
    } else if (format == FERRY_GGUF) { /* c0 and n are whole groups: rows are whole blocks */
        int type = (int)f->ggml_type;
        const uint8_t *row = q + r * ferry_gguf_row_bytes(type, f->cols);
        for (int g = 0; g < n / FERRY_GGUF_GROUP; g++)
            gguf_group(type, row, c0 / FERRY_GGUF_GROUP + g, w + FERRY_GGUF_GROUP * g);
    } else { /* nvfp4, mxfp4: code 2j in the low nibble; e2m1 x group scale is exact, nvfp4's row scale rounds */
        int group = FERRY_FP4_GROUP(format);
        const uint8_t *row = q + r * (f->cols / 2) + c0 / 2;
        const uint8_t *groups = expert + f->scale_offset + r * (f->cols / group);
        const float *scale_value = format == FERRY_MXFP4 ? ferry_e8m0_value : ferry_e4m3_value;
        float row_scale = format == FERRY_NVFP4 ? ((const float *)(expert + f->gscale_offset))[r] : 1.0f;
        for (int j = 0; j < n; j++) {
            uint8_t byte = row[j / 2];
            float e2m1 = ferry_e2m1_value[(j & 1) ? byte >> 4 : byte & 15];
            w[j] = e2m1 * scale_value[groups[(c0 + j) / group]] * row_scale; /* x 1.0f: exact */
        }
    }
    if (act == FERRY_ACT_BF16)
        for (int j = 0; j < n; j++) w[j] = ferry_round_bf16(w[j]);
}

void ferry_rows_portable(const ferry_family *f, int format, int act, const uint8_t *expert, const void *a,
                         int64_t a_stride, int n, int64_t r0, int64_t r1, float *y, int64_t y_stride,
                         int64_t prefetch) {
    (void)prefetch; /* a fallback: correct, not tuned */
    const float *x = (const float *)a; /* the portable rows always take float32 activations */
    float w[TILE];
    for (int64_t r = r0; r < r1; r++) {
        float acc[MAX_TOKENS][LANES] = {{0}};
        for (int64_t c0 = 0; c0 < f->cols; c0 += TILE) {
            int len = f->cols - c0 < TILE ? (int)(f->cols - c0) : TILE;
            decode_tile(f, format, act, expert, r, c0, len, w);
            /* up to a whole number of lanes: the activations are padded with zeros to a multiple of 32 */
            int lanes_len = (len + LANES - 1) / LANES * LANES;
            for (int j = len; j < lanes_len; j++) w[j] = 0.0f;
            for (int t = 0; t < n; t++) {
                const float *xt = x + t * a_stride + c0;
                for (int k = 0; k < lanes_len; k += LANES)
                    for (int l = 0; l < LANES; l++) acc[t][l] += w[k + l] * xt[k + l];
            }
        }
        for (int t = 0; t < n; t++) {
            float s = 0.0f;
            for (int l = 0; l < LANES; l++) s += acc[t][l];
            y[t * y_stride + (r - r0)] = s;
        }
    }
}

void ferry_decode_rows_portable(const ferry_family *f, int format, const uint8_t *expert, int64_t r0, int64_t r1,
                                float *out) {
    for (int64_t r = r0; r < r1; r++) /* the rows' tiles, as ferry_rows_portable cuts them */
        for (int64_t c0 = 0; c0 < f->cols; c0 += TILE) {
            int n = f->cols - c0 < TILE ? (int)(f->cols - c0) : TILE;
            decode_tile(f, format, FERRY_ACT_F32, expert, r, c0, n, out + (r - r0) * f->cols + c0);
        }
}
