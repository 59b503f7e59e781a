/* GGUF blocks straight from a file's map into the tiled layouts the AVX-512 VNNI kernel
 * reads (quant_linear.c, "Tiles of 16 rows"; kernels/reference/quant.py), one pass per
 * weight: no row layout in between, no torch temporaries.
 *
 * Every entry takes `rows`, the address of each output row's blocks (n_out of them, a
 * multiple of 16), so the parts of a fused weight and a permutation of their rows
 * (llama.cpp's q / k order) are read where they lie. It writes a tiled QuantizedWeight's
 * tensors:
 *   codes  the tiled layout of the target width, tile after tile
 *   d, m   [n_out / 16 tiles][G groups][16 rows] fp16 bits
 * Specification (tests/kernels/test_gguf_repack.py compares bit for bit): the torch path,
 *   6 bits: tile(from_ggml_blocks(raw, "Q6_K", k))
 *   8 bits: tile(cat_rows(parts)), each part from_ggml_blocks(...) (Q8_0), widen(...) of a
 *           4-bit kind, or quantize_int8(dequantize(...), blocks_per_group=1) of Q6_K
 *           (its scales per 16 elements do not fit groups of 32: requantized).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "half.h"

#define BLOCK 32
#define TILE 16
#define SUPER 256 /* a K-quant superblock's elements */
#define MIN_ELEMENTS_PER_THREAD (1 << 20)

/* Row kinds of arbor_tile8_blocks (kernels/cpu/gguf_repack.py: KINDS). */
enum { KIND_Q4_0 = 0, KIND_Q4_1 = 1, KIND_Q8_0 = 2, KIND_Q4_K = 3, KIND_Q6_K = 4 };

static int threads_for(int64_t elements, int num_threads) {
    const int64_t useful = elements / MIN_ELEMENTS_PER_THREAD;
    return useful < 1 ? 1 : (useful < num_threads ? (int)useful : num_threads);
}

static uint16_t load_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return h;
}

/* Codes 32j .. 32j + 31 (0..63) of a Q6_K superblock `sb` (ql 128 bytes, qh 64): element
 * 128h + 32r + i has its low nibble in ql byte 64h + 32(r & 1) + i (low for r < 2, high
 * for r >= 2) and its top two bits in qh byte 32h + i, bits 2r and 2r + 1. */
static void q6_k_block_codes(const uint8_t *sb, int j, uint8_t *q) {
    const int h = j / 4, r = j % 4;
    const uint8_t *ql = sb + 64 * h + 32 * (r & 1), *qh = sb + 128 + 32 * h;
    for (int i = 0; i < BLOCK; i++) {
        const int low = r < 2 ? ql[i] & 0x0f : ql[i] >> 4;
        q[i] = (uint8_t)(low | (((qh[i] >> (2 * r)) & 3) << 4));
    }
}

/* Q6_K superblocks (ql 128, qh 64, int8 sc 16, fp16 d: 210 bytes per 256 elements) into the
 * tiled 6-bit layout (kernels/reference/q6_k.py, "Tiled layout"): per tile and superblock
 * the codes a byte each, [64 chunks of 4 elements][16 rows][4 bytes], then the int8 scales,
 * [16 sub-blocks][16 rows]; d as stored and m = -32 d. k_len: a multiple of 256. */
void arbor_tile_q6_k_blocks(const uint8_t *const *rows, int64_t n_out, int64_t k_len, uint8_t *codes,
                            uint16_t *d, uint16_t *m, int num_threads) {
    const int64_t ns = k_len / SUPER, tiles = n_out / TILE;
#pragma omp parallel for num_threads(threads_for(n_out * k_len, num_threads)) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t s = 0; s < ns; s++) {
            uint8_t *out = codes + (t * ns + s) * (TILE * (SUPER + 16)), q[BLOCK];
            for (int r = 0; r < TILE; r++) {
                const uint8_t *sb = rows[t * TILE + r] + s * 210;
                for (int j = 0; j < SUPER / BLOCK; j++) {
                    q6_k_block_codes(sb, j, q);
                    for (int c = 0; c < BLOCK / 4; c++) memcpy(out + (8 * j + c) * 64 + 4 * r, q + 4 * c, 4);
                }
                for (int j = 0; j < 16; j++) out[SUPER * TILE + j * TILE + r] = sb[192 + j];
                const uint16_t dh = load_half(sb + 208);
                d[(t * ns + s) * TILE + r] = dh;
                m[(t * ns + s) * TILE + r] = float_to_half(-32.0f * half_to_float(dh));
            }
        }
    }
}

/* Block b (elements 32b .. 32b + 31) of a Q6_K row requantized to 8-bit codes, as
 * quantize_int8(dequantize(w), blocks_per_group=1) does: w = (d sc_j) (q - 32) in fp32,
 * d8 = max |w| / 127 rounded to fp16, code = round(w / d8) + 128 (w * (1 / d8), ties to
 * even, clamped to +-127), m8 = -128 d8. */
static void q6_k_block8(const uint8_t *row, int64_t b, uint8_t *q, uint16_t *d, uint16_t *m) {
    const uint8_t *sb = row + (b / 8) * 210;
    const int j = (int)(b % 8);
    const float dv = half_to_float(load_half(sb + 208));
    float w[BLOCK], amax = 0.0f;
    q6_k_block_codes(sb, j, q);
    for (int i = 0; i < BLOCK; i++) {
        const float scale = dv * (float)(int8_t)sb[192 + 2 * j + i / 16];
        w[i] = scale * ((float)q[i] - 32.0f);
        amax = fmaxf(amax, fabsf(w[i]));
    }
    *d = float_to_half(amax / 127.0f);
    const float dq = half_to_float(*d), inv = dq > 0.0f ? 1.0f / dq : 0.0f;
    for (int i = 0; i < BLOCK; i++) q[i] = (uint8_t)(fminf(fmaxf(nearbyintf(w[i] * inv), -127.0f), 127.0f) + 128.0f);
    *m = float_to_half(-128.0f * dq);
}

/* Block b of a Q4_K row as 8-bit codes (the nibbles, widened) and its d sc_j, -dmin m_j in
 * fp16 (ggml's get_scale_min_k4 unpacking, as arbor_tile_q4_k_blocks). */
static void q4_k_block8(const uint8_t *row, int64_t b, uint8_t *q, uint16_t *d, uint16_t *m) {
    const uint8_t *sb = row + (b / 8) * 144, *sc6 = sb + 4;
    const int j = (int)(b % 8);
    const int sc = j < 4 ? sc6[j] & 63 : (sc6[j + 4] & 0x0f) | ((sc6[j - 4] >> 6) << 4);
    const int mn = j < 4 ? sc6[j + 4] & 63 : (sc6[j + 4] >> 4) | ((sc6[j] >> 6) << 4);
    *d = float_to_half(half_to_float(load_half(sb)) * (float)sc);
    *m = float_to_half(-(half_to_float(load_half(sb + 2)) * (float)mn));
    const uint8_t *nib = sb + 16 + (j / 2) * 32; /* element i of the block: byte i's nibble */
    const int shift = (j & 1) ? 4 : 0;
    for (int i = 0; i < BLOCK; i++) q[i] = (nib[i] >> shift) & 0x0f;
}

/* Block b of a row of `kind` as 8-bit codes q (w = d q + m) and its d, m (fp16 bits). */
static void block8(const uint8_t *row, int kind, int64_t b, uint8_t *q, uint16_t *d, uint16_t *m) {
    if (kind == KIND_Q6_K) {
        q6_k_block8(row, b, q, d, m);
    } else if (kind == KIND_Q4_K) {
        q4_k_block8(row, b, q, d, m);
    } else if (kind == KIND_Q8_0) { /* d, 32 int8: code = q + 128, m = -128 d */
        const uint8_t *src = row + b * 34;
        *d = load_half(src);
        *m = float_to_half(-128.0f * half_to_float(*d));
        for (int i = 0; i < BLOCK; i++) q[i] = (uint8_t)((int8_t)src[2 + i] + 128);
    } else { /* Q4_0: d, 16 bytes of nibbles (element i low, 16 + i high), m = -8 d; Q4_1: d, m, nibbles */
        const int with_m = kind == KIND_Q4_1;
        const uint8_t *src = row + b * (with_m ? 20 : 18), *qs = src + (with_m ? 4 : 2);
        *d = load_half(src);
        *m = with_m ? load_half(src + 2) : float_to_half(-8.0f * half_to_float(*d));
        for (int i = 0; i < 16; i++) {
            q[i] = qs[i] & 0x0f;
            q[16 + i] = qs[i] >> 4;
        }
    }
}

/* Rows of mixed kinds (kinds[n]: KIND_*) into the tiled 8-bit layout with groups of 32:
 * per tile [kp / 4 chunks][16 rows][4 bytes]. k_len: a multiple of 32 (256 for the K-quant
 * kinds); kp = k_len rounded up to 64, the padded block with code 0, d = m = 0. */
void arbor_tile8_blocks(const uint8_t *const *rows, const uint8_t *kinds, int64_t n_out, int64_t k_len, int64_t kp,
                        uint8_t *codes, uint16_t *d, uint16_t *m, int num_threads) {
    const int64_t nb = k_len / BLOCK, kb = kp / BLOCK, tiles = n_out / TILE;
#pragma omp parallel for num_threads(threads_for(n_out * kp, num_threads)) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        uint8_t *ct = codes + t * TILE * kp, q[BLOCK];
        for (int64_t b = 0; b < kb; b++) {
            for (int r = 0; r < TILE; r++) {
                uint16_t dh = 0, mh = 0;
                if (b < nb) {
                    block8(rows[t * TILE + r], kinds[t * TILE + r], b, q, &dh, &mh);
                } else {
                    memset(q, 0, sizeof q);
                }
                for (int c = 0; c < BLOCK / 4; c++) memcpy(ct + (8 * b + c) * 64 + 4 * r, q + 4 * c, 4);
                d[(t * kb + b) * TILE + r] = dh;
                m[(t * kb + b) * TILE + r] = mh;
            }
        }
    }
}
