/* The CPU decoder of GAAC tiles (docs/format.md), built on first use by gaac_hf/cpu_decode.py and called through
 * ctypes: table entries -> BF16 tiles written straight into a strided output (the caller's K/V layout).
 *
 * One pass per tile: the escape area is parsed once per tile (only where a mode tag is set) into per-group plane
 * bytes and bases, then every output row is rebuilt from its sign+mantissa bytes and the bit planes of its
 * channels' groups; the inner loop runs over channels, contiguous in every input and in the output, and works
 * on bytes (uint8 addition wraps mod 256 like the exponent code; a BF16 is written as its two bytes), so the compiler
 * vectorizes it 32 lanes wide on AVX2. Bit-identical to gaac_hf/codec.py `decode_tiles`
 * (tests/test_gaac_cpu_decode.py). Memory-safe on any input: a corrupt slot (a raw tag without its wide tag, escapes
 * past the capacity) or an entry outside its pool returns an error code instead of reading out of bounds.
 */
#include <stdint.h>
#include <string.h>

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the CPU decoder writes BF16 bytes in little-endian order"
#endif

#define TOKENS 16
#define MAX_GROUPS 256 /* 2 * 128 channels */

enum { GAAC_OK = 0, GAAC_BAD_ENTRY = 1, GAAC_BAD_TAG = 2, GAAC_BAD_ESCAPE = 3 };

/* Rows of one tile from `nplanes` bit planes (3: all groups 3-bit, 4: some 4-bit, 8: some raw); `base` holds one
 * byte per group (row h of groups at base + h * base_step: base_step 0 reuses one per-channel row). */
static inline __attribute__((always_inline)) void emit(const uint8_t *restrict sm, const uint8_t *const *pl,
                                                       const uint8_t *restrict base, int base_step, int C,
                                                       int nplanes, int16_t *restrict out, int64_t ts) {
    for (int h = 0; h < 2; h++) {
        const uint8_t *restrict bh = base + h * base_step;
        const uint8_t *restrict q0 = pl[0] + h * C, *restrict q1 = pl[1] + h * C, *restrict q2 = pl[2] + h * C;
        const uint8_t *restrict q3 = pl[3] + h * C, *restrict q4 = pl[4] + h * C, *restrict q5 = pl[5] + h * C;
        const uint8_t *restrict q6 = pl[6] + h * C, *restrict q7 = pl[7] + h * C;
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) {
            const int t = 8 * h + i;
            const uint8_t *smr = sm + t * C;
            uint8_t *restrict o = (uint8_t *)(out + t * ts); /* little-endian: byte 2c is the low byte of element c */
            for (int c = 0; c < C; c++) {
                uint8_t code = (uint8_t)(((q0[c] >> i) & 1) | (((q1[c] >> i) & 1) << 1) | (((q2[c] >> i) & 1) << 2));
                if (nplanes > 3) code |= (uint8_t)(((q3[c] >> i) & 1) << 3);
                if (nplanes > 4)
                    code |= (uint8_t)((((q4[c] >> i) & 1) << 4) | (((q5[c] >> i) & 1) << 5) |
                                      (((q6[c] >> i) & 1) << 6) | (((q7[c] >> i) & 1) << 7));
                const uint8_t e = (uint8_t)(code + bh[c]); /* the exponent: (code + base) mod 256 */
                const uint8_t v = smr[c];                 /* sign << 7 | mantissa */
                o[2 * c] = (uint8_t)((v & 0x7F) | (e << 7));
                o[2 * c + 1] = (uint8_t)((v & 0x80) | (e >> 1));
            }
        }
    }
}

static int decode_slot(const uint8_t *s, const uint8_t *b3, const uint8_t *b4, int C, int64_t esc_off,
                       int64_t capacity, int16_t *out, int64_t ts) {
    const int G = 2 * C, tag_bytes = G / 8;
    const uint8_t *planes = s + TOKENS * C;
    const uint8_t *wide = planes + 3 * G, *raw = wide + tag_bytes, *esc = s + esc_off;
    static const uint8_t zeros[MAX_GROUPS] = {0};
    uint8_t base[MAX_GROUPS], x[5][MAX_GROUPS];
    const uint8_t *pl[8] = {planes, planes + G, planes + 2 * G, zeros, zeros, zeros, zeros, zeros};
    int any_wide = 0, any_raw = 0;
    for (int j = 0; j < tag_bytes; j++) {
        if (raw[j] & ~wide[j]) return GAAC_BAD_TAG;
        any_wide |= wide[j];
        any_raw |= raw[j];
    }
    if (!any_wide) {
        emit(s, pl, b3, 0, C, 3, out, ts);
        return GAAC_OK;
    }
    memcpy(base, b3, C);
    memcpy(base + C, b3, C);
    memset(x[0], 0, G);
    if (any_raw) memset(x[1], 0, 4 * sizeof x[1]);
    int64_t off = 0;
    for (int j = 0; j < tag_bytes; j++) {
        unsigned w = wide[j], r = raw[j];
        while (w) {
            const int k = __builtin_ctz(w), g = 8 * j + k, c = g % C;
            w &= w - 1;
            if ((r >> k) & 1) {
                if (off + 5 > capacity) return GAAC_BAD_ESCAPE;
                for (int p = 0; p < 5; p++) x[p][g] = esc[off + p];
                base[g] = 0;
                off += 5;
            } else {
                if (off + 1 > capacity) return GAAC_BAD_ESCAPE;
                x[0][g] = esc[off];
                base[g] = b4[c];
                off += 1;
            }
        }
    }
    pl[3] = x[0];
    if (any_raw) {
        for (int p = 1; p < 5; p++) pl[3 + p] = x[p];
        emit(s, pl, base, C, C, 8, out, ts);
    } else {
        emit(s, pl, base, C, C, 4, out, ts);
    }
    return GAAC_OK;
}

/* Entries `table[b * table_b + j * P + p]` (B rows, n blocks, P = d2 * dh * dt tiles per block; >= 0 a slot, else
 * -1 - raw index) -> tile (b, j, p) at out + b * out_b + j * out_n + (p2 * out_2 + ph * out_h + pt * out_t), token
 * stride ts, channel stride 1. Bases `base3`/`base4` uint8 [P][C]. Returns GAAC_OK or the first error code. */
int gaac_expand(const int32_t *table, int64_t B, int64_t n, int64_t d2, int64_t dh, int64_t dt, int64_t table_b,
                const uint8_t *slots, int64_t n_slots, int64_t slot_bytes, int64_t esc_off, const int16_t *raw,
                int64_t n_raw, const uint8_t *base3, const uint8_t *base4, int64_t C, int16_t *out, int64_t out_b,
                int64_t out_n, int64_t out_2, int64_t out_h, int64_t out_t, int64_t ts, int64_t threads) {
    const int64_t P = d2 * dh * dt, total = B * n * P, capacity = slot_bytes - esc_off;
    int status = GAAC_OK;
    if (C > MAX_GROUPS / 2 || C % 16 || capacity < 0) return GAAC_BAD_ENTRY;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && total >= 256)
    for (int64_t flat = 0; flat < total; flat++) {
        const int64_t p = flat % P, j = (flat / P) % n, b = flat / (P * n);
        const int64_t pt = p % dt, ph = (p / dt) % dh, p2 = p / (dt * dh);
        const int32_t entry = table[b * table_b + j * P + p];
        int16_t *o = out + b * out_b + j * out_n + p2 * out_2 + ph * out_h + pt * out_t;
        int err = GAAC_OK;
        if (entry >= 0) {
            if (entry >= n_slots)
                err = GAAC_BAD_ENTRY;
            else
                err = decode_slot(slots + (int64_t)entry * slot_bytes, base3 + p * C, base4 + p * C, (int)C, esc_off,
                                  capacity, o, ts);
        } else if (-1 - (int64_t)entry >= n_raw) {
            err = GAAC_BAD_ENTRY;
        } else {
            const int16_t *src = raw + (-1 - (int64_t)entry) * TOKENS * C;
            for (int t = 0; t < TOKENS; t++) memcpy(o + t * ts, src + t * C, C * sizeof(int16_t));
        }
        if (err != GAAC_OK) {
#pragma omp atomic write
            status = err;
        }
    }
    return status;
}
