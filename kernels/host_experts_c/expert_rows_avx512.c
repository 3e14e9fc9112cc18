/* The AVX-512 BF16 rows (Zen 4, Sapphire Rapids and later), chosen at load when the CPU has them.
 *
 * bf16 compute: the weights, as bf16 pairs, and the activations, as bf16 pairs, go through
 * _mm512_dpbf16_ps: 32 products a instruction, each exact in float32, accumulated in float32. Plain
 * bf16 banks are read as they lie; every other format is decoded to float32 (the reference's
 * dequantization, bit for bit) and rounded to bf16 pairs once, as the torch path's reader does.
 * float32 compute: the weights widened to float32 (bf16 by a shift) and FMAs with float32 activations.
 *
 * Every function carries the target attribute rather than the file a -mavx512 flag, so one build
 * serves every x86-64: nothing here runs unless cpuid said the CPU has the instructions. */
#if defined(__x86_64__)
#include <immintrin.h>

#include "expert_job.h"
#include "gguf_blocks.h"
#include "packed_rows.h"

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define INLINE static inline __attribute__((always_inline)) TARGET
/* the rows' own format codes of GGUF rows, one a block type, so each type's decode is compiled into its rows */
#define GGUF_ROWS(type) (16 + (type))
#define IS_GGUF(format) ((format) >= GGUF_ROWS(0))
/* the 256-value block types, eight groups of 32 each with its own scale */
#define IS_SUPERBLOCK(format)                                                                                  \
    ((format) == GGUF_ROWS(FERRY_Q4_K) || (format) == GGUF_ROWS(FERRY_Q5_K) || (format) == GGUF_ROWS(FERRY_Q6_K) || \
     (format) == GGUF_ROWS(FERRY_IQ4_XS))

typedef struct {
    const uint8_t *q;       /* the row's values or codes */
    const float *bscale;    /* fp8: the row's block row of scales */
    const uint8_t *groups;  /* nvfp4: the row's e4m3 group scales; mxfp4: its e8m0 ones */
    int64_t group_bytes;    /* GGUF: a group's share of its block's bytes (the prefetch's step) */
    float row_scale;        /* nvfp4 */
    int64_t cols, ngroups;
    ferry_packed_row packed; /* packed: the row's bytes, base and escape cursor (advanced as vectors decode) */
} row_src;

INLINE void widen_bf16(__m512i raw, __m512 *lo, __m512 *hi) {
    *lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw)), 16));
    *hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1)), 16));
}

/* packed: columns 32v..32v+31 as bf16 bits (packed_rows.h), lanes outside `m` zero. Vectors of a row
 * must be decoded in ascending order: the escape cursor only moves forward. */
INLINE __m512i decode_packed(row_src *s, int64_t v, __mmask32 m) {
    ferry_packed_row *p = &s->packed;
    /* few instructions a vector, and no cross-lane widening but one vpermq: the decode, not memory,
     * bounds these rows on one core. lo: qword q of the 32 bytes to 128-bit lane q,
     * then each byte twice in its 16-bit lane (unpacklo with itself): the sign on bit 15, the mantissa
     * in bits 0-6, value j in lane j */
    __m512i q = _mm512_castsi256_si512(_mm256_maskz_loadu_epi8(m, p->lo + 32 * v));
    q = _mm512_permutexvar_epi64(_mm512_set_epi64(3, 3, 2, 2, 1, 1, 0, 0), q);
    __m512i twice = _mm512_unpacklo_epi8(q, q);
    /* the 16 code bytes (a tail's half: the tail is even) in every 128-bit lane; byte k into the low
     * bytes of 16-bit lanes 2k and 2k + 1, whose codes (low, high nibble) shift to bits 7-10 */
    __mmask16 bytes = (__mmask16)(m == 0xFFFFFFFFu ? 0xFFFF : (1u << ((__builtin_popcount(m) + 1) / 2)) - 1);
    __m512i h = _mm512_broadcast_i32x4(_mm_maskz_loadu_epi8(bytes, p->hi + 16 * v));
    const __m512i spread = _mm512_set_epi32(
        (int)0x800F800F, (int)0x800E800E, (int)0x800D800D, (int)0x800C800C, (int)0x800B800B, (int)0x800A800A,
        (int)0x80098009, (int)0x80088008, (int)0x80078007, (int)0x80068006, (int)0x80058005, (int)0x80048004,
        (int)0x80038003, (int)0x80028002, (int)0x80018001, (int)0x80008000);
    __m512i codes = _mm512_and_si512(_mm512_sllv_epi16(_mm512_shuffle_epi8(h, spread), _mm512_set1_epi32(0x00030007)),
                                     _mm512_set1_epi16(0x0780));
    __mmask32 nonzero = _mm512_test_epi16_mask(codes, codes);
    /* the exponent field: (code + base) << 7 (its low 16 bits, as the reference keeps), 0 for code 0 */
    __m512i exponent = _mm512_maskz_add_epi16(nonzero, codes, _mm512_set1_epi16((short)(p->base << 7)));
    /* code 0 keeps only the sign: the signed zero (an escape's lo mantissa 0x01 is dropped, as the
     * reference drops it); lanes outside m are zero already (lo and codes loaded as zeros) */
    __m512i keep = _mm512_mask_blend_epi16(nonzero, _mm512_set1_epi16((short)0x8000), _mm512_set1_epi16((short)0x807F));
    __m512i bits = _mm512_ternarylogic_epi32(twice, keep, exponent, 0xEA); /* (a & b) | c */
    int64_t end = p->pos + 32 * v + 32;
    if (__builtin_expect(p->esc < p->esc_end && p->esc_index[p->esc] < end, 0)) { /* rare: through memory */
        uint16_t lanes[32];
        _mm512_storeu_si512(lanes, bits);
        for (; p->esc < p->esc_end && p->esc_index[p->esc] < end; p->esc++)
            lanes[p->esc_index[p->esc] - (end - 32)] = p->esc_bits[p->esc];
        bits = _mm512_loadu_si512(lanes);
    }
    return bits;
}

/* 16 bytes as 16 int32 lanes */
INLINE __m512i bytes16(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }

/* Group j's float32 factors in a 256-value block (Q4_K, Q5_K, Q6_K, IQ4_XS), the twin's products (gguf_blocks.h),
 * from the block's fp16 d (Q6_K's at byte 208) and dmin as float32 (superblock_d): Q4_K's and Q5_K's d sc_j in *sa
 * and dmin m_j in *sb; Q6_K's d sc for the group's values 0-15 in *sa, 16-31 in *sb; IQ4_XS's d (sc_j - 32) in *sa. */
INLINE void superblock_d(int type, const uint8_t *b, float *d, float *dmin) {
    *d = ferry_gguf_half(type == FERRY_Q6_K ? b + 208 : b);
    *dmin = type == FERRY_Q6_K || type == FERRY_IQ4_XS ? 0.0f : ferry_gguf_half(b + 2);
}

INLINE void superblock_group_scales(int type, const uint8_t *b, int j, float d, float dmin, float *sa, float *sb) {
    if (type == FERRY_IQ4_XS) {
        *sa = d * (float)ferry_gguf_iq4_xs_scale(b, j);
        *sb = 0.0f;
        return;
    }
    if (type == FERRY_Q6_K) {
        *sa = d * (float)(int8_t)b[192 + 2 * j];
        *sb = d * (float)(int8_t)b[193 + 2 * j];
        return;
    }
    int sc, mn;
    ferry_gguf_k_scale(b + 4, j, &sc, &mn);
    *sa = d * (float)sc;
    *sb = dmin * (float)mn;
}

/* group j (values 32j..32j+31) of the 256-value block at b as float32, lo the first 16 and hi the next, with its
 * factors from superblock_group_scales. Q4_K and Q5_K: 32 code bytes, one a value, the sub-block's nibble shifted
 * down, Q5_K's fifth bit added; Q6_K: its low and high bits in 16-bit lanes. IQ4_XS: the sub-block's 16 bytes in
 * Q4_0's order, grid values under d (scale - 32). */
INLINE void decode_superblock_group(int type, const uint8_t *b, int j, float sa, float sb, __m512 *lo, __m512 *hi) {
    const __m512i nibble = _mm512_set1_epi32(0x0F);
    if (type == FERRY_IQ4_XS) {
        __m512i x = bytes16(b + 8 + 16 * j);
        __m512 grid = _mm512_loadu_ps(ferry_iq4_grid), dl = _mm512_set1_ps(sa);
        *lo = _mm512_mul_ps(dl, _mm512_permutexvar_ps(_mm512_and_si512(x, nibble), grid));
        *hi = _mm512_mul_ps(dl, _mm512_permutexvar_ps(_mm512_srli_epi32(x, 4), grid));
        return;
    }
    if (type == FERRY_Q6_K) { /* the 32 values in 16-bit lanes: low 4 bits nibble t >> 1 of the ql bytes at
                                 64 h + 32 (t & 1), high 2 bits pair t of the qh bytes at 128 + 32 h; q - 32 exact as
                                 an integer, so its float is the twin's q - 32.0 */
        int h = j / 4, t = j % 4;
        __m512i ql = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (t & 1))));
        __m512i qh = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)));
        __m512i low = _mm512_and_si512(_mm512_srl_epi16(ql, _mm_cvtsi32_si128(4 * (t >> 1))), _mm512_set1_epi16(15));
        __m512i high = _mm512_and_si512(_mm512_srl_epi16(qh, _mm_cvtsi32_si128(2 * t)), _mm512_set1_epi16(3));
        __m512i q = _mm512_sub_epi16(_mm512_or_si512(low, _mm512_slli_epi16(high, 4)), _mm512_set1_epi16(32));
        __m512i q0 = _mm512_cvtepi16_epi32(_mm512_castsi512_si256(q));
        __m512i q1 = _mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(q, 1));
        *lo = _mm512_mul_ps(_mm512_set1_ps(sa), _mm512_cvtepi32_ps(q0));
        *hi = _mm512_mul_ps(_mm512_set1_ps(sb), _mm512_cvtepi32_ps(q1));
        return;
    }
    const uint8_t *qs = b + (type == FERRY_Q5_K ? 48 : 16) + 32 * (j / 2);
    __m512i shift = _mm512_set1_epi32(4 * (j & 1));
    __m512i q0 = _mm512_and_si512(_mm512_srlv_epi32(bytes16(qs), shift), nibble);
    __m512i q1 = _mm512_and_si512(_mm512_srlv_epi32(bytes16(qs + 16), shift), nibble);
    if (type == FERRY_Q5_K) { /* bit j of qh byte i: value i's fifth bit */
        __m512i bit = _mm512_set1_epi32(1 << j), sixteen = _mm512_set1_epi32(16);
        q0 = _mm512_mask_or_epi32(q0, _mm512_test_epi32_mask(bytes16(b + 16), bit), q0, sixteen);
        q1 = _mm512_mask_or_epi32(q1, _mm512_test_epi32_mask(bytes16(b + 32), bit), q1, sixteen);
    }
    __m512 ds = _mm512_set1_ps(sa), dm = _mm512_set1_ps(sb);
    *lo = _mm512_sub_ps(_mm512_mul_ps(ds, _mm512_cvtepi32_ps(q0)), dm);
    *hi = _mm512_sub_ps(_mm512_mul_ps(ds, _mm512_cvtepi32_ps(q1)), dm);
}

/* GGUF group v (values 32v..32v+31) of a row of block type `type` as float32, lo the first 16 and hi the next: the
 * twin's formulas (gguf_blocks.h), every product and sum one instruction, so rounded as the twin rounds them. A row is
 * whole groups: no mask. */
INLINE void decode_gguf(int type, const uint8_t *row, int64_t v, __m512 *lo, __m512 *hi) {
    int j;
    const uint8_t *b = ferry_gguf_block(type, row, v, &j);
    const __m512i nibble = _mm512_set1_epi32(0x0F);
    if (type == FERRY_Q8_0) {
        __m512 d = _mm512_set1_ps(ferry_gguf_half(b));
        *lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)))));
        *hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18)))));
    } else if (type == FERRY_Q4_K || type == FERRY_Q5_K || type == FERRY_Q6_K || type == FERRY_IQ4_XS) {
        float d, dmin, sa, sb;
        superblock_d(type, b, &d, &dmin);
        superblock_group_scales(type, b, j, d, dmin, &sa, &sb);
        decode_superblock_group(type, b, j, sa, sb, lo, hi);
    } else { /* the 32-value types of 16 nibble bytes: the low nibbles are values 0-15, the high 16-31 */
        int off = type == FERRY_GGUF_MXFP4 ? 1 : type == FERRY_Q4_1 ? 4 : type == FERRY_Q5_0 ? 6 : type == FERRY_Q5_1 ? 8 : 2;
        __m512i x = bytes16(b + off), q0 = _mm512_and_si512(x, nibble), q1 = _mm512_srli_epi32(x, 4);
        if (type == FERRY_Q5_0 || type == FERRY_Q5_1) { /* bit i of the word: value i's fifth */
            uint32_t qh = ferry_gguf_u32(b + (type == FERRY_Q5_1 ? 4 : 2));
            __m512i sixteen = _mm512_set1_epi32(16);
            q0 = _mm512_mask_or_epi32(q0, (__mmask16)qh, q0, sixteen);
            q1 = _mm512_mask_or_epi32(q1, (__mmask16)(qh >> 16), q1, sixteen);
        }
        __m512 f0, f1;
        if (type == FERRY_IQ4_NL || type == FERRY_GGUF_MXFP4) {
            __m512 table = _mm512_loadu_ps(type == FERRY_IQ4_NL ? ferry_iq4_grid : ferry_mxfp4_doubled);
            f0 = _mm512_permutexvar_ps(q0, table), f1 = _mm512_permutexvar_ps(q1, table);
        } else {
            f0 = _mm512_cvtepi32_ps(q0), f1 = _mm512_cvtepi32_ps(q1);
        }
        if (type == FERRY_Q4_0 || type == FERRY_Q5_0) { /* d (q - 8), d (q - 16): the difference is exact */
            __m512 centre = _mm512_set1_ps(type == FERRY_Q4_0 ? 8.0f : 16.0f);
            f0 = _mm512_sub_ps(f0, centre), f1 = _mm512_sub_ps(f1, centre);
        }
        __m512 d = _mm512_set1_ps(type == FERRY_GGUF_MXFP4 ? ferry_gguf_e8m0_half(b[0]) : ferry_gguf_half(b));
        *lo = _mm512_mul_ps(d, f0), *hi = _mm512_mul_ps(d, f1);
        if (type == FERRY_Q4_1 || type == FERRY_Q5_1) { /* d q + m: the product rounded, then the sum */
            __m512 m = _mm512_set1_ps(ferry_gguf_half(b + 2));
            *lo = _mm512_add_ps(*lo, m), *hi = _mm512_add_ps(*hi, m);
        }
    }
}

/* columns 32v..32v+31 as float32: lo the first 16, hi the next; lanes outside `m` are zero */
INLINE void decode_f32(int format, row_src *s, int64_t v, __mmask32 m, __m512 *lo, __m512 *hi) {
    if (IS_GGUF(format)) {
        decode_gguf(format - GGUF_ROWS(0), s->q, v, lo, hi);
    } else if (format == FERRY_F32) {
        const float *p = (const float *)s->q + 32 * v;
        *lo = _mm512_maskz_loadu_ps((__mmask16)m, p);
        *hi = _mm512_maskz_loadu_ps((__mmask16)(m >> 16), p + 16);
    } else if (format == FERRY_BF16) {
        widen_bf16(_mm512_maskz_loadu_epi16(m, (const uint16_t *)s->q + 32 * v), lo, hi);
    } else if (format == FERRY_PACKED) {
        widen_bf16(decode_packed(s, v, m), lo, hi);
    } else if (format == FERRY_FP8_BLOCK) {
        /* e4m3's 7 magnitude bits shifted left 7 are float16's exponent and mantissa fields: the
         * float16 is the value x 2^-8 exactly, subnormals included (host_expert_weights.py) */
        __m512i h = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(m, s->q + 32 * v));
        h = _mm512_and_si512(_mm512_slli_epi16(h, 7), _mm512_set1_epi16((short)0xBFFF));
        /* a vector of 32 never straddles a block of 128: the 2^8 folds into its scale exactly */
        __m512 scale = _mm512_set1_ps(s->bscale[(32 * v) >> 7] * 256.0f);
        *lo = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), scale);
        *hi = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), scale);
    } else { /* nvfp4, mxfp4: 16 bytes, element 2j in byte j's low nibble */
        __mmask16 bytes = (__mmask16)(m == 0xFFFFFFFFu ? 0xFFFF : (1u << ((__builtin_popcount(m) + 1) / 2)) - 1);
        __m512i d = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(bytes, s->q + 16 * v));
        /* each byte's two codes into the two 16-bit halves of its lane: elements in their order */
        __m512i codes = _mm512_or_si512(_mm512_and_si512(d, _mm512_set1_epi32(15)),
                                        _mm512_slli_epi32(_mm512_srli_epi32(d, 4), 16));
        widen_bf16(_mm512_permutexvar_epi16(codes, _mm512_loadu_si512(ferry_e2m1_bf16)), lo, hi);
        if (format == FERRY_MXFP4) { /* a vector is one group of 32 (cols % 32 == 0); code x scale is exact */
            __m512 g = _mm512_set1_ps(ferry_e8m0_value[s->groups[v]]);
            *lo = _mm512_mul_ps(*lo, g);
            *hi = _mm512_mul_ps(*hi, g);
            return;
        }
        /* nvfp4: a vector is two groups of 16; the second may lie past a row that ends half way */
        float g0 = ferry_e4m3_value[s->groups[2 * v]];
        float g1 = 2 * v + 1 < s->ngroups ? ferry_e4m3_value[s->groups[2 * v + 1]] : 0.0f;
        __m512 rs = _mm512_set1_ps(s->row_scale);
        /* code x group scale is exact; the row scale rounds once, in the reference's order */
        *lo = _mm512_mul_ps(_mm512_mul_ps(*lo, _mm512_set1_ps(g0)), rs);
        *hi = _mm512_mul_ps(_mm512_mul_ps(*hi, _mm512_set1_ps(g1)), rs);
    }
}

/* mxfp4 group v as bf16 where its e8m0 scale e keeps every product a normal bf16 (2 <= e <= 252): e2m1 x 2^(e-127)
 * is exact, so its bf16 is the code's bf16 with e - 127 added to the exponent field (zeros kept), the bits the
 * float32 path rounds to, in a third of its instructions: the decode, not memory, bounded these rows. Byte j's two
 * codes go to 16-bit lanes 2j and 2j + 1 unmasked (d | d << 12): vpermw reads an index's low 5 bits, and the table's
 * entries 16-31 repeat 0-15, so the high nibble's low bit left in lane 2j picks the same value. */
/* e2m1 values as bf16 bits `w` times 2^(e - 127): the exponent field moved by e - 127, zeros kept */
INLINE __m512bh e8m0_scaled_bf16(__m512i w, int e) {
    __mmask32 nonzero = _mm512_test_epi16_mask(w, _mm512_set1_epi16(0x7FFF));
    return (__m512bh)_mm512_mask_add_epi16(w, nonzero, w, _mm512_set1_epi16((short)((e - 127) << 7)));
}

INLINE __m512bh decode_mxfp4_bf16(const row_src *s, int64_t v, __mmask32 m, int e) {
    __mmask16 bytes = (__mmask16)(m == 0xFFFFFFFFu ? 0xFFFF : (1u << ((__builtin_popcount(m) + 1) / 2)) - 1);
    __m512i d = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(bytes, s->q + 16 * v));
    __m512i w = _mm512_permutexvar_epi16(_mm512_or_si512(d, _mm512_slli_epi32(d, 12)),
                                         _mm512_loadu_si512(ferry_e2m1_bf16));
    return e8m0_scaled_bf16(w, e);
}

/* a GGUF MXFP4 block (its e8m0 byte, then 16 bytes: values 0-15 the low nibbles, 16-31 the high) as bf16 the same
 * way: ggml's doubled values at half the scale are the same products (code 8 is +0 there, its table says so) */
INLINE __m512bh decode_gguf_mxfp4_bf16(const uint8_t *b) {
    __m256i d = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b + 1)));
    __m512i codes = _mm512_inserti64x4(_mm512_castsi256_si512(d), _mm256_srli_epi16(d, 4), 1);
    return e8m0_scaled_bf16(_mm512_permutexvar_epi16(codes, _mm512_loadu_si512(ferry_gguf_mxfp4_bf16)), b[0]);
}

INLINE __m512bh decode_bf16(int format, row_src *s, int64_t v, __mmask32 m) {
    if (format == FERRY_BF16) return (__m512bh)_mm512_maskz_loadu_epi16(m, (const uint16_t *)s->q + 32 * v);
    if (format == FERRY_PACKED) return (__m512bh)decode_packed(s, v, m); /* bf16 already: no rounding */
    if (format == FERRY_MXFP4) {
        int e = s->groups[v];
        if (__builtin_expect(e >= 2 && e <= 252, 1)) return decode_mxfp4_bf16(s, v, m, e);
    }
    if (format == GGUF_ROWS(FERRY_GGUF_MXFP4)) { /* a row is whole blocks: no mask */
        int j;
        const uint8_t *b = ferry_gguf_block(FERRY_GGUF_MXFP4, s->q, v, &j);
        if (__builtin_expect(b[0] >= 2 && b[0] <= 252, 1)) return decode_gguf_mxfp4_bf16(b);
    }
    __m512 lo, hi;
    decode_f32(format, s, v, m, &lo, &hi);
    return _mm512_cvtne2ps_pbh(hi, lo); /* round to nearest even, as torch rounds to bf16 */
}

/* the CPU asked to fetch the row's weights `bytes` past vector v (past the row's end, the next row's: a
 * thread's rows lie one after another). A hint, never a fault, and no change to what is computed: on a
 * 2-core EPYC it changes nothing; a server core, whose hardware prefetcher stops at every 4 KiB page (a
 * bf16 row of 2,048 values is one), reads plain and packed rows 7-25 % faster with it. */
INLINE void prefetch_ahead(int format, const row_src *s, int64_t v, int64_t bytes) {
    if (!bytes) return;
    const uint8_t *at = format == FERRY_F32      ? s->q + 128 * v
                        : format == FERRY_BF16   ? s->q + 64 * v
                        : format == FERRY_PACKED ? s->packed.lo + 32 * v
                        : IS_GGUF(format)        ? s->q + s->group_bytes * v
                        : format == FERRY_NVFP4 || format == FERRY_MXFP4 ? s->q + 16 * v
                                                 : s->q + 32 * v; /* fp8: a byte a value */
    _mm_prefetch((const char *)(at + bytes), _MM_HINT_T0);
}

/* one row against N tokens; two sums a token hide the FMA latency at one token (four for an mxfp4 row at one token:
 * its exponent-add decode is short enough that the dot products' latency showed, 10 % of a core's rate).
 * One row at a time on purpose: blocks of 2-4 rows against each activation vector (fewer activation
 * loads) measured 13-17 GB/s at one token on the 2-core EPYC against 24-28 for a row at a time
 * (the same at 8 tokens, which are bound by the dpbf16 rate there); software prefetch 8-32 vectors
 * ahead changed nothing. */
INLINE void row_dots(int format, int act, int N, row_src *s, const void *a, int64_t as, float *y, int64_t ys,
                     int64_t prefetch) {
    __m512 acc0[8], acc1[8];
    for (int t = 0; t < N; t++) acc0[t] = acc1[t] = _mm512_setzero_ps();
    int64_t nv = s->cols / 32, v = 0;
    int tail = (int)(s->cols % 32);
    if (act == FERRY_ACT_BF16) {
        const uint16_t *x = (const uint16_t *)a;
        if (IS_SUPERBLOCK(format)) { /* a block's factors once, then its eight groups in pairs (a row is whole
                                        blocks): the sums and their order are the pairs' loop below */
            int type = format - GGUF_ROWS(0);
            for (; v < nv; v += 8) {
                const uint8_t *b = s->q + v / 8 * ferry_gguf_block_bytes[type];
                for (int p = 0; p < 8; p += 3) prefetch_ahead(format, s, v + p, prefetch); /* the block's lines */
                float d, dmin, sa[8], sb[8]; /* the block's factors once, not once a group */
                superblock_d(type, b, &d, &dmin);
                for (int j = 0; j < 8; j++) superblock_group_scales(type, b, j, d, dmin, &sa[j], &sb[j]);
                for (int j = 0; j < 8; j += 2) {
                    __m512 lo0, hi0, lo1, hi1;
                    decode_superblock_group(type, b, j, sa[j], sb[j], &lo0, &hi0);
                    decode_superblock_group(type, b, j + 1, sa[j + 1], sb[j + 1], &lo1, &hi1);
                    __m512bh w0 = _mm512_cvtne2ps_pbh(hi0, lo0), w1 = _mm512_cvtne2ps_pbh(hi1, lo1);
                    for (int t = 0; t < N; t++) {
                        const uint16_t *xt = x + t * as + 32 * (v + j);
                        acc0[t] = _mm512_dpbf16_ps(acc0[t], w0, (__m512bh)_mm512_loadu_si512(xt));
                        acc1[t] = _mm512_dpbf16_ps(acc1[t], w1, (__m512bh)_mm512_loadu_si512(xt + 32));
                    }
                }
            }
        }
        if (N == 1 && (format == FERRY_MXFP4 || format == GGUF_ROWS(FERRY_GGUF_MXFP4))) { /* four sums: four groups'
                                                                                          decodes overlap their dots */
            __m512 acc2 = _mm512_setzero_ps(), acc3 = _mm512_setzero_ps();
            for (; v + 4 <= nv; v += 4) {
                prefetch_ahead(format, s, v, prefetch); /* 64 codes bytes: one line */
                __m512bh w0 = decode_bf16(format, s, v, 0xFFFFFFFFu), w1 = decode_bf16(format, s, v + 1, 0xFFFFFFFFu);
                __m512bh w2 = decode_bf16(format, s, v + 2, 0xFFFFFFFFu), w3 = decode_bf16(format, s, v + 3, 0xFFFFFFFFu);
                acc0[0] = _mm512_dpbf16_ps(acc0[0], w0, (__m512bh)_mm512_loadu_si512(x + 32 * v));
                acc1[0] = _mm512_dpbf16_ps(acc1[0], w1, (__m512bh)_mm512_loadu_si512(x + 32 * v + 32));
                acc2 = _mm512_dpbf16_ps(acc2, w2, (__m512bh)_mm512_loadu_si512(x + 32 * v + 64));
                acc3 = _mm512_dpbf16_ps(acc3, w3, (__m512bh)_mm512_loadu_si512(x + 32 * v + 96));
            }
            acc0[0] = _mm512_add_ps(acc0[0], acc2);
            acc1[0] = _mm512_add_ps(acc1[0], acc3);
        }
        for (; v + 2 <= nv; v += 2) {
            prefetch_ahead(format, s, v, prefetch);
            prefetch_ahead(format, s, v + 1, prefetch);
            __m512bh w0 = decode_bf16(format, s, v, 0xFFFFFFFFu), w1 = decode_bf16(format, s, v + 1, 0xFFFFFFFFu);
            for (int t = 0; t < N; t++) {
                acc0[t] = _mm512_dpbf16_ps(acc0[t], w0, (__m512bh)_mm512_loadu_si512(x + t * as + 32 * v));
                acc1[t] = _mm512_dpbf16_ps(acc1[t], w1, (__m512bh)_mm512_loadu_si512(x + t * as + 32 * v + 32));
            }
        }
        for (; v < nv + (tail != 0); v++) { /* an odd last vector, then the partial one */
            __m512bh w = decode_bf16(format, s, v, v < nv ? 0xFFFFFFFFu : (1u << tail) - 1);
            for (int t = 0; t < N; t++)
                acc0[t] = _mm512_dpbf16_ps(acc0[t], w, (__m512bh)_mm512_loadu_si512(x + t * as + 32 * v));
        }
    } else {
        const float *x = (const float *)a;
        for (; v < nv + (tail != 0); v++) {
            prefetch_ahead(format, s, v, prefetch);
            __m512 lo, hi;
            decode_f32(format, s, v, v < nv ? 0xFFFFFFFFu : (1u << tail) - 1, &lo, &hi);
            for (int t = 0; t < N; t++) {
                acc0[t] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + t * as + 32 * v), acc0[t]);
                acc1[t] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + t * as + 32 * v + 16), acc1[t]);
            }
        }
    }
    for (int t = 0; t < N; t++) y[t * ys] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[t], acc1[t]));
}

/* `from`: packed rows' escape cursor carried from the row before (packed_rows.h), else -1 */
INLINE void row_source(const ferry_family *f, int format, const uint8_t *expert, int64_t r, int64_t from, row_src *s) {
    const uint8_t *q = expert + f->q_offset;
    s->cols = f->cols;
    if (IS_GGUF(format)) {
        int type = format - GGUF_ROWS(0);
        s->q = q + r * ferry_gguf_row_bytes(type, f->cols);
        s->group_bytes = ferry_gguf_block_bytes[type] * FERRY_GGUF_GROUP / ferry_gguf_block_values[type];
    } else if (format == FERRY_F32) s->q = q + r * f->cols * 4;
    else if (format == FERRY_BF16) s->q = q + r * f->cols * 2;
    else if (format == FERRY_PACKED) ferry_packed_row_at(f, expert, r, 0, f->cols, from, &s->packed);
    else if (format == FERRY_FP8_BLOCK) {
        int64_t block_row = r / f->part_rows * ((f->part_rows + 127) / 128) + r % f->part_rows / 128;
        s->q = q + r * f->cols;
        s->bscale = (const float *)(expert + f->scale_offset) + block_row * f->col_blocks;
    } else { /* nvfp4, mxfp4 */
        s->q = q + r * (f->cols / 2);
        s->ngroups = f->cols / FERRY_FP4_GROUP(format);
        s->groups = expert + f->scale_offset + r * s->ngroups;
        s->row_scale = format == FERRY_NVFP4 ? ((const float *)(expert + f->gscale_offset))[r] : 1.0f;
    }
}

/* one function per (format, compute dtype), switching on the token count so each count's
 * accumulators live in registers */
#define ROWS(NAME, FORMAT, ACT)                                                                          \
    static TARGET void NAME(const ferry_family *f, const uint8_t *expert, const void *a, int64_t as, int n, \
                            int64_t r0, int64_t r1, float *y, int64_t ys, int64_t pf) {                  \
        int64_t from = -1;                                                                               \
        for (int64_t r = r0; r < r1; r++) {                                                              \
            row_src s;                                                                                   \
            row_source(f, FORMAT, expert, r, from, &s);                                                  \
            if (FORMAT == FERRY_PACKED) from = s.packed.esc_end;                                         \
            float *yr = y + (r - r0);                                                                    \
            switch (n) {                                                                                 \
            case 1: row_dots(FORMAT, ACT, 1, &s, a, as, yr, ys, pf); break;                              \
            case 2: row_dots(FORMAT, ACT, 2, &s, a, as, yr, ys, pf); break;                              \
            case 3: row_dots(FORMAT, ACT, 3, &s, a, as, yr, ys, pf); break;                              \
            case 4: row_dots(FORMAT, ACT, 4, &s, a, as, yr, ys, pf); break;                              \
            case 5: row_dots(FORMAT, ACT, 5, &s, a, as, yr, ys, pf); break;                              \
            case 6: row_dots(FORMAT, ACT, 6, &s, a, as, yr, ys, pf); break;                              \
            case 7: row_dots(FORMAT, ACT, 7, &s, a, as, yr, ys, pf); break;                              \
            default: row_dots(FORMAT, ACT, 8, &s, a, as, yr, ys, pf); break;                             \
            }                                                                                            \
        }                                                                                                \
    }

ROWS(rows_f32_f32, FERRY_F32, FERRY_ACT_F32)
ROWS(rows_f32_bf16, FERRY_F32, FERRY_ACT_BF16)
ROWS(rows_bf16_f32, FERRY_BF16, FERRY_ACT_F32)
ROWS(rows_bf16_bf16, FERRY_BF16, FERRY_ACT_BF16)
ROWS(rows_fp8_f32, FERRY_FP8_BLOCK, FERRY_ACT_F32)
ROWS(rows_fp8_bf16, FERRY_FP8_BLOCK, FERRY_ACT_BF16)
ROWS(rows_nvfp4_f32, FERRY_NVFP4, FERRY_ACT_F32)
ROWS(rows_nvfp4_bf16, FERRY_NVFP4, FERRY_ACT_BF16)
ROWS(rows_packed_f32, FERRY_PACKED, FERRY_ACT_F32)
ROWS(rows_packed_bf16, FERRY_PACKED, FERRY_ACT_BF16)
ROWS(rows_mxfp4_f32, FERRY_MXFP4, FERRY_ACT_F32)
ROWS(rows_mxfp4_bf16, FERRY_MXFP4, FERRY_ACT_BF16)
ROWS(rows_q8_0_f32, GGUF_ROWS(FERRY_Q8_0), FERRY_ACT_F32)
ROWS(rows_q8_0_bf16, GGUF_ROWS(FERRY_Q8_0), FERRY_ACT_BF16)
ROWS(rows_q4_0_f32, GGUF_ROWS(FERRY_Q4_0), FERRY_ACT_F32)
ROWS(rows_q4_0_bf16, GGUF_ROWS(FERRY_Q4_0), FERRY_ACT_BF16)
ROWS(rows_q4_1_f32, GGUF_ROWS(FERRY_Q4_1), FERRY_ACT_F32)
ROWS(rows_q4_1_bf16, GGUF_ROWS(FERRY_Q4_1), FERRY_ACT_BF16)
ROWS(rows_q5_0_f32, GGUF_ROWS(FERRY_Q5_0), FERRY_ACT_F32)
ROWS(rows_q5_0_bf16, GGUF_ROWS(FERRY_Q5_0), FERRY_ACT_BF16)
ROWS(rows_q5_1_f32, GGUF_ROWS(FERRY_Q5_1), FERRY_ACT_F32)
ROWS(rows_q5_1_bf16, GGUF_ROWS(FERRY_Q5_1), FERRY_ACT_BF16)
ROWS(rows_q4_k_f32, GGUF_ROWS(FERRY_Q4_K), FERRY_ACT_F32)
ROWS(rows_q4_k_bf16, GGUF_ROWS(FERRY_Q4_K), FERRY_ACT_BF16)
ROWS(rows_q5_k_f32, GGUF_ROWS(FERRY_Q5_K), FERRY_ACT_F32)
ROWS(rows_q5_k_bf16, GGUF_ROWS(FERRY_Q5_K), FERRY_ACT_BF16)
ROWS(rows_q6_k_f32, GGUF_ROWS(FERRY_Q6_K), FERRY_ACT_F32)
ROWS(rows_q6_k_bf16, GGUF_ROWS(FERRY_Q6_K), FERRY_ACT_BF16)
ROWS(rows_iq4_nl_f32, GGUF_ROWS(FERRY_IQ4_NL), FERRY_ACT_F32)
ROWS(rows_iq4_nl_bf16, GGUF_ROWS(FERRY_IQ4_NL), FERRY_ACT_BF16)
ROWS(rows_iq4_xs_f32, GGUF_ROWS(FERRY_IQ4_XS), FERRY_ACT_F32)
ROWS(rows_iq4_xs_bf16, GGUF_ROWS(FERRY_IQ4_XS), FERRY_ACT_BF16)
ROWS(rows_gguf_mxfp4_f32, GGUF_ROWS(FERRY_GGUF_MXFP4), FERRY_ACT_F32)
ROWS(rows_gguf_mxfp4_bf16, GGUF_ROWS(FERRY_GGUF_MXFP4), FERRY_ACT_BF16)

typedef void (*rows_impl)(const ferry_family *, const uint8_t *, const void *, int64_t, int, int64_t, int64_t,
                          float *, int64_t, int64_t);
static const rows_impl IMPLS[6][2] = {{rows_f32_f32, rows_f32_bf16},     {rows_bf16_f32, rows_bf16_bf16},
                                      {rows_fp8_f32, rows_fp8_bf16},     {rows_nvfp4_f32, rows_nvfp4_bf16},
                                      {rows_packed_f32, rows_packed_bf16}, {rows_mxfp4_f32, rows_mxfp4_bf16}};
/* GGUF rows by the family's block type (enum ferry_ggml_type) */
static const rows_impl GGUF_IMPLS[FERRY_GGML_TYPES][2] = {
    {rows_q8_0_f32, rows_q8_0_bf16},     {rows_q4_0_f32, rows_q4_0_bf16},     {rows_q4_1_f32, rows_q4_1_bf16},
    {rows_q5_0_f32, rows_q5_0_bf16},     {rows_q5_1_f32, rows_q5_1_bf16},     {rows_q4_k_f32, rows_q4_k_bf16},
    {rows_q5_k_f32, rows_q5_k_bf16},     {rows_q6_k_f32, rows_q6_k_bf16},     {rows_iq4_nl_f32, rows_iq4_nl_bf16},
    {rows_iq4_xs_f32, rows_iq4_xs_bf16}, {rows_gguf_mxfp4_f32, rows_gguf_mxfp4_bf16}};

void ferry_rows_avx512(const ferry_family *f, int format, int act, const uint8_t *expert, const void *a,
                       int64_t a_stride, int n, int64_t r0, int64_t r1, float *y, int64_t y_stride,
                       int64_t prefetch) {
    const rows_impl *impl = format == FERRY_GGUF ? GGUF_IMPLS[f->ggml_type] : IMPLS[format];
    impl[act](f, expert, a, a_stride, n, r0, r1, y, y_stride, prefetch);
}

TARGET void ferry_decode_rows_avx512(const ferry_family *f, int format, const uint8_t *expert, int64_t r0, int64_t r1,
                                     float *out) {
    if (format == FERRY_GGUF) format = GGUF_ROWS((int)f->ggml_type);
    int64_t nv = f->cols / 32;
    int tail = (int)(f->cols % 32);
    for (int64_t r = r0; r < r1; r++) {
        row_src s = {0}; /* whole: the format is known only at run time here (packed rows never come) */
        row_source(f, format, expert, r, -1, &s);
        float *o = out + (r - r0) * f->cols;
        for (int64_t v = 0; v < nv + (tail != 0); v++) { /* the vectors row_dots decodes, in its order */
            __mmask32 m = v < nv ? 0xFFFFFFFFu : (1u << tail) - 1;
            __m512 lo, hi;
            decode_f32(format, &s, v, m, &lo, &hi);
            _mm512_mask_storeu_ps(o + 32 * v, (__mmask16)m, lo);
            _mm512_mask_storeu_ps(o + 32 * v + 16, (__mmask16)(m >> 16), hi);
        }
    }
}

TARGET void ferry_packed_rows_avx512(const ferry_family *f, const uint8_t *expert, int64_t r0, int64_t r1,
                                     uint16_t *bits) {
    int64_t nv = f->cols / 32;
    int tail = (int)(f->cols % 32);
    int64_t from = -1;
    for (int64_t r = r0; r < r1; r++) { /* rows chained as the ROWS functions chain them */
        row_src s;
        row_source(f, FERRY_PACKED, expert, r, from, &s);
        from = s.packed.esc_end;
        uint16_t *out = bits + (r - r0) * f->cols;
        for (int64_t v = 0; v < nv + (tail != 0); v++) { /* the vectors row_dots decodes, in its order */
            __mmask32 m = v < nv ? 0xFFFFFFFFu : (1u << tail) - 1;
            _mm512_mask_storeu_epi16(out + 32 * v, m, decode_packed(&s, v, m));
        }
    }
}
#endif
