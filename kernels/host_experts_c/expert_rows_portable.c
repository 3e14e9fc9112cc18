/* The portable rows: plain C that any compiler vectorises (SSE2 on x86-64, NEON on aarch64), and the
 * twin the AVX-512 rows are tested against. Each row is decoded a tile of columns at a time into
 * float32 (exactly as kernels/quantized_experts.py dequantizes: float32 math, then one rounding to the
 * compute dtype), then multiplied with every token's activations into 16 partial sums a token: 16
 * independent sums let the compiler vectorise without reassociating a single float sum, which it
 * may not do without -ffast-math. */
#include <math.h>

#include "expert_job.h"
#include "packed_rows.h"

#define TILE 64    /* columns decoded at a time: a multiple of 32 (the activations' padding) */
#define LANES 16
#define MAX_TOKENS 8

float ferry_e4m3_value[256];
const float ferry_e2m1_value[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

uint16_t ferry_e2m1_bf16[32];
float ferry_e8m0_value[256];

void ferry_tables_init(void) {
    for (int c = 0; c < 16; c++) ferry_e2m1_bf16[c] = ferry_f32_to_bf16(ferry_e2m1_value[c]);
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
