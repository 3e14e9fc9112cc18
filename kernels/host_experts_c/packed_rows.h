/* Where one row of a packed expert lies (kernels/expert_pack.py's 12-bit layout), shared by both
 * instruction sets so they find the same bytes and the same escapes.
 *
 * Value j of an expert's row of V: lo[j] is its sign and 7 mantissa bits, the nibble j of hi (even j
 * in the low nibble) its exponent code c. c in 1..15 means exponent base + c; c = 0 a zero of lo's
 * sign, or an escape, whose 16 bits are in the expert's escape list. The bits are put back exactly
 * as unpack_expert_reference does: a code-0 value is the signed zero, then every listed position is
 * overwritten from the list. The list (not lo's 0x01 marker) places the escapes, as the reference's
 * index assignment does; its positions ascend within an expert (pack_experts' nonzero order, checked
 * by host_expert_kernel.py), so a row's escapes are one contiguous run, walked with a cursor as the
 * row's vectors advance. Rows start at an even value (the caller refuses odd H or I), so a row's
 * codes start at a byte boundary. */
#ifndef FERRY_PACKED_ROWS_H
#define FERRY_PACKED_ROWS_H

#include "expert_job.h"

typedef struct {
    const uint8_t *lo, *hi; /* the row's first value's byte and its code byte */
    int32_t base;           /* the family's exponent base for this expert */
    int64_t pos;            /* the row's first value's position in the expert's V values */
    const int32_t *esc_index;
    const uint16_t *esc_bits;
    int64_t esc, esc_end;   /* the row's escapes: esc_index[esc .. esc_end) */
} ferry_packed_row;

/* the first k in [lo, hi) with index[k] >= pos (hi if none) */
static inline int64_t ferry_first_escape(const int32_t *index, int64_t lo, int64_t hi, int64_t pos) {
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (index[mid] < pos) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* columns c0..c1 of row r of family f, for the expert whose lo bytes of f start at `expert`. `from`:
 * the previous row's esc_end when this row follows it (its first escape, found without a search:
 * a binary search a row cost a fifth of a hot expert's time), else -1. */
static inline void ferry_packed_row_at(const ferry_family *f, const uint8_t *expert, int64_t r, int64_t c0,
                                       int64_t c1, int64_t from, ferry_packed_row *p) {
    /* the expert's number: `expert` is f->base + e * f->expert_stride (host_experts.c's expert_bytes) */
    int64_t e = (expert - f->base) / f->expert_stride;
    int64_t at = r * f->cols + c0; /* from the family's first value */
    p->lo = expert + at;
    p->hi = f->hi + e * f->hi_stride + at / 2;
    p->base = f->exp_base[2 * e];
    p->pos = f->first_value + at;
    p->esc_index = f->esc_index;
    p->esc_bits = f->esc_bits;
    int64_t first = f->esc_offsets[e], last = f->esc_offsets[e + 1];
    p->esc = from >= 0 ? from : ferry_first_escape(f->esc_index, first, last, p->pos);
    int64_t end = p->esc, stop = p->pos + (c1 - c0);
    while (end < last && f->esc_index[end] < stop) end++; /* a row holds few escapes */
    p->esc_end = end;
}

/* one value's bf16 bits from its lo byte and exponent code, escapes aside (the reference's formula:
 * the low 16 bits of sign | (code + base) << 7 | mantissa, or the signed zero for code 0) */
static inline uint16_t ferry_packed_bits(uint8_t lo, unsigned code, int32_t base) {
    uint32_t sign = (uint32_t)(lo & 0x80) << 8;
    uint32_t body = ((uint32_t)(code + base) << 7) | (lo & 0x7F);
    return (uint16_t)(sign | (code ? body : 0)); /* a select, not a branch: the portable loop vectorises */
}

#endif
