/* GGUF block rows (services/worker/expert_formats/gguf_blocks.py): where a row's blocks lie and the exact
 * scalar values both instruction sets decode them with, so the two find the same bytes and the same scales.
 *
 * A row of `cols` values is cols / block blocks of `bytes` bytes, the file's bytes unchanged (kernels/gguf_blocks.py,
 * the twin, tabulates every type). The rows decode 32 values at a time, a "group": a whole block of the 32-value
 * types, a sub-block of the 256-value ones (each of their scales covers 32 values, Q6_K's two scales 16 each), so
 * a row is always a whole number of groups. Each value is the twin's float32 formula, its products and sums rounded
 * one at a time in its order (the build's -ffp-contract=off keeps them unfused). */
#ifndef FERRY_GGUF_BLOCKS_H
#define FERRY_GGUF_BLOCKS_H

#include <stdint.h>
#include <string.h>

/* ferry_family.ggml_type: kernels/gguf_blocks.py's BLOCKS order (host_expert_kernel.py's GGML_TYPES) */
enum ferry_ggml_type {
    FERRY_Q8_0 = 0, FERRY_Q4_0, FERRY_Q4_1, FERRY_Q5_0, FERRY_Q5_1, FERRY_Q4_K, FERRY_Q5_K, FERRY_Q6_K,
    FERRY_IQ4_NL, FERRY_IQ4_XS, FERRY_GGUF_MXFP4, FERRY_GGML_TYPES
};

#define FERRY_GGUF_GROUP 32 /* values a group */

static const int32_t ferry_gguf_block_values[FERRY_GGML_TYPES] = {32, 32, 32, 32, 32, 256, 256, 256, 32, 256, 32};
static const int32_t ferry_gguf_block_bytes[FERRY_GGML_TYPES] = {34, 18, 20, 22, 24, 144, 176, 210, 18, 136, 17};
/* IQ4_NL's and IQ4_XS's grid (ggml's kvalues_iq4nl); MXFP4's doubled e2m1 values (kvalues_mxfp4) */
static const float ferry_iq4_grid[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const float ferry_mxfp4_doubled[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline int64_t ferry_gguf_row_bytes(int type, int64_t cols) {
    return cols / ferry_gguf_block_values[type] * ferry_gguf_block_bytes[type];
}

/* group g's block in a row, and the group's place in it (0 for the 32-value types) */
static inline const uint8_t *ferry_gguf_block(int type, const uint8_t *row, int64_t g, int *sub) {
    int per = ferry_gguf_block_values[type] / FERRY_GGUF_GROUP;
    *sub = (int)(g % per);
    return row + g / per * ferry_gguf_block_bytes[type];
}

/* an fp16 (little-endian) as float32, exactly: subnormals, infinities and NaNs included */
static inline float ferry_gguf_half(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | p[1] << 8);
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 0x3FF;
    if (exp == 0) { /* zero or subnormal: man x 2^-24, exact in float32 */
        float v = (float)man * 0x1p-24f;
        return sign ? -v : v;
    }
    union { uint32_t u; float f; } v = {sign | (exp == 31 ? 0x7F800000u : (exp + 112) << 23) | man << 13};
    return v.f;
}

static inline uint32_t ferry_gguf_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4); /* little-endian host (host_expert_weights.py refuses others) */
    return v;
}

/* MXFP4's e8m0 byte as ggml_e8m0_to_fp32_half: 2^(e - 128), e < 2 the float32 subnormals 2^-128 and 2^-127 */
static inline float ferry_gguf_e8m0_half(uint8_t e) {
    union { uint32_t u; float f; } v = {e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23};
    return v.f;
}

/* Q4_K / Q5_K: sub-block j's 6-bit scale and min from the block's 12 scale bytes (kernels/gguf_blocks.k_scales) */
static inline void ferry_gguf_k_scale(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 0x3F;
        *mn = s[4 + j] & 0x3F;
    } else {
        *sc = (s[4 + j] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
        *mn = (s[4 + j] >> 4) | ((s[j] >> 2) & 0x30);
    }
}

/* IQ4_XS: sub-block j's 6-bit scale minus 32 (kernels/gguf_blocks.iq4_xs_scales) */
static inline int ferry_gguf_iq4_xs_scale(const uint8_t *block, int j) {
    int high = (block[2] | block[3] << 8) >> (2 * j) & 3;
    return (((block[4 + j / 2] >> 4 * (j & 1)) & 0x0F) | high << 4) - 32;
}

#endif
