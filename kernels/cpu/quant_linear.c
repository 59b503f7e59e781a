/* y = x @ W^T for block-quantized weights, the way llama.cpp does Q8_0 x Q4_1:
 * the activations are quantized to int8 in blocks of 32 (one fp32 scale per block), each
 * weight row is a run of unsigned codes with fp16 (scale, offset) per group of blocks, and
 * the inner product of a block is an integer dot product (AVX-512 VNNI `vpdpbusd`, AVX2
 * `vpmaddubsw`, or plain C), scaled once per block.
 *
 * Weight format (kernels/reference/quant.py is its specification):
 *   w[n, k] = d[n, g] * code[n, k] + m[n, g],  g = (k / 32) >> group_shift
 *   codes, 4 bits: [N, Kp / 2] bytes; within each 64-element superblock, byte i holds
 *                  element i in its low nibble and element 32 + i in its high nibble
 *   codes, 8 bits: [N, Kp] bytes (unsigned; Q8_0's signed q is stored as q + 128, m = -128 d)
 *   codes, 5 bits: [N, Kp / 64 * 40] bytes: per 64-element superblock the 4-bit layout's 32
 *                  bytes, then a little-endian uint64 whose bit i is element i's fifth bit
 *                  (Q5_0 / Q5_1 / Q5_K: codes 0..31, m = -16 d for Q5_0)
 *   codes, 6 bits: Q6_K as the file holds it, w = (d[n, g] * sc_j) * (code - 32) with an int8
 *                  sc_j per 16 elements inside the codes (kernels/reference/q6_k.py; "6 bits" below)
 *   Kp = K rounded up to a multiple of 64; padded columns have code 0 and meet x = 0.
 *   tiled (AVX-512 VNNI only; N a multiple of 16): rows in tiles of 16, and within a tile
 *                  one 64-byte chunk = 4 consecutive inputs of each of the 16 rows (8 bits;
 *                  4 bits: per block, chunk c holds inputs 4c..4c+3 low, 16+4c.. high; 5 bits:
 *                  those 4 chunks, then a 64-bit mask of fifth bits per chunk and nibble), scales
 *                  and offsets [G][16] per tile: see "Tiles of 16 rows" below
 * Activations: xq[m, k] = round(x[m, k] / dx[m, b]), dx = max |x| / 127 over block b, so
 *   sum_k w x ~= sum_b dx_b (d_g isum_b + m_g xsum_b),
 *   isum_b = sum_{k in b} code * xq,  xsum_b = sum_{k in b} xq.
 *
 * The instruction set is the compiler's (-march=native at the first build on each machine):
 * AVX-512 F/BW/DQ + VNNI, else AVX2 + FMA + F16C, else portable C. ARBOR_QUANT_NO_AVX512
 * and ARBOR_QUANT_SCALAR force the lower paths (the tests compare all three).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "arbor_cpu.h"

#if !defined(ARBOR_QUANT_SCALAR)
#include <immintrin.h>
#endif
#include "half.h"

#if !defined(ARBOR_QUANT_SCALAR) && !defined(ARBOR_QUANT_NO_AVX512) && defined(__AVX512F__) && \
    defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define QPATH_AVX512 1
#elif !defined(ARBOR_QUANT_SCALAR) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QPATH_AVX2 1
#endif

#define BLOCK 32
#define MIN_MACS_PER_THREAD (1 << 18)
#define Q6_SUPER 256                  /* elements of a Q6_K superblock */
#define Q6_ROW_BYTES 208              /* its bytes in the row layout: ql 128, qh 64, sc 16 */
#define Q6_TILED_ROW_BYTES 272        /* a row's superblock in tiles: 256 codes a byte each, 16 sc */
#define Q6_TILE_BYTES (16 * Q6_TILED_ROW_BYTES) /* a superblock in a tile: 8 blocks x 8 chunks, then sc */
#define Q6_TILE_SC (8 * 8 * 64)       /* where a tiled superblock's sub-block scales start */
#define Q5_SB_BYTES 40                /* a 64-element superblock of 5-bit codes in rows: 32 nibble bytes, 8 of bits */
#define Q5_TILE_BLOCK 320             /* a block of a 5-bit tile: 4 chunks of nibbles, 8 masks of 8 bytes */

/* Bytes of codes per weight row (a tile's bytes / 16 when tiled). */
static inline int64_t qrow_bytes(int bits, int64_t kp, int tiled) {
    if (bits == 6) return kp / Q6_SUPER * (tiled ? Q6_TILED_ROW_BYTES : Q6_ROW_BYTES);
    if (bits == 5) return kp / 64 * Q5_SB_BYTES; /* the same in tiles: 320 bytes a block of 16 rows */
    return bits == 4 ? kp / 2 : kp;
}

int arbor_quant_tiles(void);

int64_t arbor_qweight_row_bytes(int bits, int64_t kp, int tiled) { return qrow_bytes(bits, kp, tiled); }

static int threads_for(int64_t work, int num_threads) {
    const int64_t useful = work / MIN_MACS_PER_THREAD;
    return useful < 1 ? 1 : (useful < num_threads ? (int)useful : num_threads);
}

/* One row of x (K floats) -> xq [Kp] int8, dx, xsum and xs = dx * xsum [nb] (nb = Kp / 32). */
static void quantize_row(const float *x, int64_t k_len, int64_t nb, int8_t *xq, float *dx,
                         int32_t *xsum, int32_t *xsum16, float *xs) {
    for (int64_t b = 0; b < nb; b++) {
        const int64_t start = b * BLOCK;
        const int64_t n = k_len - start < BLOCK ? (k_len - start > 0 ? k_len - start : 0) : BLOCK;
        float amax = 0.0f;
        for (int64_t i = 0; i < n; i++) { /* fmaxf's result (NaN ignored), without its libm call */
            const float a = fabsf(x[start + i]);
            amax = a > amax ? a : amax;
        }
        const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t half[2] = {0, 0};
        for (int64_t i = 0; i < BLOCK; i++) {
            const int8_t q = i < n ? (int8_t)lrintf(x[start + i] * inv) : 0;
            xq[start + i] = q;
            half[i >= BLOCK / 2] += q;
        }
        const int32_t sum = half[0] + half[1];
        dx[b] = d;
        xsum[b] = sum;
        xsum16[2 * b] = half[0], xsum16[2 * b + 1] = half[1];
        xs[b] = d * (float)sum;
    }
}

/* ---- 6 bits: Q6_K (kernels/reference/q6_k.py) -------------------------------------------
 * A superblock of 256 codes (0..63) with an int8 scale per 16 and the row's fp16 d per
 * superblock: per block b of 32 (halves lo, hi: sub-blocks 2b, 2b + 1),
 *   sum_k w x ~= dx_b d (sc_lo (isum_lo - 32 xsum16_lo) + sc_hi (isum_hi - 32 xsum16_hi)),
 * isum over code * xq, all in int32 (|total| < 2^26). The row layout is read element by
 * element (portable; weights whose rows do not fill whole tiles); the fast path is the
 * tiled one (tile_block, BITS == 6). */

/* Code e (< 256) of a superblock in the row layout (ql: 128 bytes, qh: 64, sc: 16). */
static inline int q6_code(const uint8_t *sb, int e) {
    const int h = e >> 7, r = (e >> 5) & 3, i = e & 31;
    const uint8_t ql = sb[64 * h + 32 * (r & 1) + i], qh = sb[128 + 32 * h + i];
    return ((r < 2 ? ql : ql >> 4) & 0x0f) | (((qh >> (2 * r)) & 3) << 4);
}

/* Code e of a 5-bit row in the row layout: its nibble and its bit in the superblock's uint64. */
static inline int q5_code(const uint8_t *w, int64_t e) {
    const uint8_t *sb = w + (e / 64) * Q5_SB_BYTES;
    const int i = (int)(e % 64);
    return ((sb[i & 31] >> (i & 32 ? 4 : 0)) & 0x0f) | (((sb[32 + i / 8] >> (i % 8)) & 1) << 4);
}

/* One 6-bit weight row (codes w, d: its num_groups fp16) against one activation row. */
static float dot_row6(const uint8_t *w, const uint16_t *d, const int8_t *xq, const float *dx,
                      const int32_t *xsum16, int64_t nb) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *sb = w + (b / 8) * Q6_ROW_BYTES;
        const int8_t *sc = (const int8_t *)(sb + 192);
        const int e0 = (int)(b % 8) * BLOCK;
        int32_t isum[2] = {0, 0};
        for (int i = 0; i < BLOCK; i++) isum[i >> 4] += q6_code(sb, e0 + i) * xq[b * BLOCK + i];
        const int32_t total = sc[e0 / 16] * (isum[0] - 32 * xsum16[2 * b]) +
                              sc[e0 / 16 + 1] * (isum[1] - 32 * xsum16[2 * b + 1]);
        acc += (half_to_float(d[b / 8]) * dx[b]) * (float)total;
    }
    return acc;
}

static inline void put(float *y, float v, const float *bias, int64_t n, int accumulate);

/* Rows [n0, n1) of a 6-bit weight in the row layout (see arbor_qmatmul_range). */
static void qmatmul_rows6(const ArborQWeight *w, const ArborQAct *a, int64_t n0, int64_t n1, float *y,
                          int64_t ldy, int accumulate) {
    const int64_t kp = w->kp, nb = kp / BLOCK, row_bytes = qrow_bytes(6, kp, 0);
    for (int64_t m = 0; m < a->rows; m++)
        for (int64_t n = n0; n < n1; n++) {
            const float v = dot_row6(w->codes + n * row_bytes, w->d + n * w->num_groups, a->xq + m * kp,
                                     a->dx + m * nb, a->xsum16 + m * 2 * nb, nb);
            put(y + m * ldy + (n - n0), v, w->bias, n, accumulate);
        }
}

#if defined(QPATH_AVX512)
static inline __m512i load_codes(const uint8_t *w, int bits, int64_t sb) {
    if (bits == 8) return _mm512_loadu_si512((const void *)(w + sb * 64));
    const uint8_t *at = w + sb * (bits == 5 ? Q5_SB_BYTES : 32);
    const __m256i v = _mm256_loadu_si256((const __m256i *)at);
    const __m256i mask = _mm256_set1_epi8(0x0f);
    const __m256i lo = _mm256_and_si256(v, mask);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
    const __m512i codes = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); /* elements 0..63 */
    if (bits != 5) return codes;
    uint64_t fifth;
    memcpy(&fifth, at + 32, 8);
    return _mm512_mask_add_epi8(codes, _cvtu64_mask64(fifth), codes, _mm512_set1_epi8(0x10));
}
#endif

#if !defined(QPATH_AVX512) && !defined(QPATH_AVX2)
/* sum_b s[b] * isum_b for one weight row (codes w) and one activation row (xq). */
static inline float dot_row(const uint8_t *w, int bits, const int8_t *xq, const float *s, int64_t nb) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        int32_t isum = 0;
        const int8_t *xb = xq + b * BLOCK;
        if (bits == 4) {
            const uint8_t *wb = w + (b / 2) * 32;
            const int shift = (b & 1) ? 4 : 0;
            for (int i = 0; i < BLOCK; i++) isum += (int32_t)((wb[i] >> shift) & 0x0f) * xb[i];
        } else if (bits == 5) {
            for (int i = 0; i < BLOCK; i++) isum += (int32_t)q5_code(w, b * BLOCK + i) * xb[i];
        } else {
            const uint8_t *wb = w + b * BLOCK;
            for (int i = 0; i < BLOCK; i++) isum += (int32_t)wb[i] * xb[i];
        }
        acc += s[b] * (float)isum;
    }
    return acc;
}
#endif

/* The per-block scales and offsets of weight row n as floats, wd[b] = d[g], wm[b] = m[g]
 * (g = b >> group_shift), with 16 zero floats of slack past nb for the vector loads. */
static inline void weight_row_scales(const ArborQWeight *w, int64_t n, int64_t nb, float *wd, float *wm) {
    const uint16_t *d = w->d + n * w->num_groups, *mo = w->m + n * w->num_groups;
    if (w->num_groups == 1) { /* one group per row (int8 per channel) */
        const float dv = half_to_float(d[0]), mv = half_to_float(mo[0]);
        for (int64_t b = 0; b < nb; b++) wd[b] = dv, wm[b] = mv;
    } else {
#if defined(QPATH_AVX512)
        if (w->group_shift == 0) {
            for (int64_t b = 0; b < nb; b += 16) {
                const __mmask16 k = nb - b >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (nb - b)) - 1);
                _mm512_mask_storeu_ps(wd + b, k, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, d + b)));
                _mm512_mask_storeu_ps(wm + b, k, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, mo + b)));
            }
        } else
#endif
        {
            for (int64_t b = 0; b < nb; b++) {
                wd[b] = half_to_float(d[b >> w->group_shift]);
                wm[b] = half_to_float(mo[b >> w->group_shift]);
            }
        }
    }
    memset(wd + nb, 0, 16 * sizeof(float));
    memset(wm + nb, 0, 16 * sizeof(float));
}

#if defined(QPATH_AVX2)
/* 8-bit codes are multiplied as q = code - 128: sum code * x = sum q * x + 128 * xsum, so
 * the block's offset becomes m + 128 d (zero for symmetric int8, whose m is -128 d). Whether
 * any block of the row keeps an offset. */
static inline int offset_128(const float *wd, float *wm, int64_t nb, int bits) {
    int any = 0;
    for (int64_t b = 0; b < nb; b++) {
        if (bits == 8) wm[b] += 128.0f * wd[b];
        any |= wm[b] != 0.0f;
    }
    return any;
}
#endif

#if defined(QPATH_AVX512)
/* One weight row against one activation row (as dot_block), in two independent chains. */
static inline float dot_row1(const uint8_t *w, int bits, const float *wd, const float *wm, int64_t nb,
                             const int8_t *xq, const float *dxe, const float *xs) {
    const __m512i pick = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const int64_t nsb = nb / 2;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t sb = 0;
#define STEP(ACC, SB)                                                                              \
    do {                                                                                           \
        const __m512i iv = _mm512_dpbusd_epi32(_mm512_setzero_si512(), load_codes(w, bits, SB),    \
                                               _mm512_loadu_si512((const void *)(xq + (SB) * 64))); \
        const __m512 sc = _mm512_mul_ps(_mm512_permutexvar_ps(pick, _mm512_loadu_ps(wd + 2 * (SB))), \
                                        _mm512_loadu_ps(dxe + (SB) * 16));                        \
        ACC = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iv), sc, ACC);                                    \
    } while (0)
    for (; sb + 1 < nsb; sb += 2) {
        STEP(acc0, sb);
        STEP(acc1, sb + 1);
    }
    if (sb < nsb) STEP(acc0, sb);
#undef STEP
    for (int64_t b = 0; b < nb; b += 16) { /* the offset term, m * dx * xsum */
        const __mmask16 k = nb - b >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (nb - b)) - 1);
        acc1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, wm + b), _mm512_maskz_loadu_ps(k, xs + b), acc1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

/* The four horizontal sums of a0..a3, as one vector [sum a0, sum a1, sum a2, sum a3]. */
static inline __m128 hsum4x16(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m256 b0 = _mm256_add_ps(_mm512_castps512_ps256(a0), _mm512_extractf32x8_ps(a0, 1));
    const __m256 b1 = _mm256_add_ps(_mm512_castps512_ps256(a1), _mm512_extractf32x8_ps(a1, 1));
    const __m256 b2 = _mm256_add_ps(_mm512_castps512_ps256(a2), _mm512_extractf32x8_ps(a2, 1));
    const __m256 b3 = _mm256_add_ps(_mm512_castps512_ps256(a3), _mm512_extractf32x8_ps(a3, 1));
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(b0, b1), _mm256_hadd_ps(b2, b3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* NW weight rows (codes w, row stride row_bytes; per-block floats wd / wm, row stride ws)
 * against JN activation rows: each superblock of codes is unpacked once for the JN rows,
 * and each activation superblock (codes and scales) is loaded once for the NW rows. NW,
 * JN and ROW_SCALE are compile-time constants at every call (always_inline), so the loops
 * unroll into NW * JN independent accumulators. xq: the first activation row (row stride
 * kp); dxe: its expanded scales (stride nsb * 16); xs: its dx * xsum (stride nb).
 * ROW_SCALE (one scale and offset per weight row: int8 per channel): a block's integer sum
 * is scaled by dx alone, and the caller applies the row's d and its offset m * sum_b xs
 * once (out = d * out + m * xs_total), which saves a multiply per block and the offset
 * pass. out[i * 4 + j]. */
static inline __attribute__((always_inline)) void dot_block(
    const uint8_t *w, int64_t row_bytes, int bits, const float *wd, const float *wm, int64_t ws,
    int64_t nb, const int8_t *xq, int64_t kp, const float *dxe, const float *xs, const int NW,
    const int JN, const int ROW_SCALE, float *out) {
    const __m512i pick = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const int64_t nsb = nb / 2;
    __m512 acc[2][4];
    for (int i = 0; i < NW; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) {
        __m512i wv[2];
        __m512 wdp[2];
        for (int i = 0; i < NW; i++) {
            wv[i] = load_codes(w + i * row_bytes, bits, sb);
            if (!ROW_SCALE) wdp[i] = _mm512_permutexvar_ps(pick, _mm512_loadu_ps(wd + i * ws + 2 * sb));
        }
        for (int j = 0; j < JN; j++) {
            const __m512i xv = _mm512_loadu_si512((const void *)(xq + j * kp + sb * 64));
            const __m512 dv = _mm512_loadu_ps(dxe + (j * nsb + sb) * 16);
            for (int i = 0; i < NW; i++) {
                const __m512 iv =
                    _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[i], xv));
                acc[i][j] = _mm512_fmadd_ps(iv, ROW_SCALE ? dv : _mm512_mul_ps(wdp[i], dv), acc[i][j]);
            }
        }
    }
    for (int i = 0; i < NW; i++) {
        if (!ROW_SCALE) {
            for (int j = 0; j < JN; j++) {
                for (int64_t b = 0; b < nb; b += 16) { /* the offset term, m * dx * xsum */
                    const __mmask16 k = nb - b >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (nb - b)) - 1);
                    acc[i][j] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, wm + i * ws + b),
                                                _mm512_maskz_loadu_ps(k, xs + j * nb + b), acc[i][j]);
                }
            }
        }
        _mm_storeu_ps(out + i * 4, hsum4x16(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
    }
}
#endif

#if defined(QPATH_AVX512)
/* ---- Tiles of 16 rows -------------------------------------------------------------------
 * The row layout above leaves vpdpbusd's 16 lanes holding parts of one output, summed
 * horizontally at the end, and pays a convert and a multiply-add per 64 products. In the
 * tiled layout (kernels/reference/quant.py, "Tiled layout") one 64-byte chunk holds 4
 * consecutive inputs of each of a tile's 16 rows, so vpdpbusd against those 4 inputs of one
 * activation row, broadcast, adds into the tile's 16 outputs at once: a block of 32 inputs
 * is 8 vpdpbusd into integer sums, then one convert and one multiply-add by the block's
 * scales per (tile, activation row). NT tiles (<= TILE_GROUP) meet JN (<= 2) activation rows
 * at a time: each chunk is loaded once for JN rows, each broadcast used by NT tiles.
 *
 *   tile t, 8 bits:  chunk (b * 8 + c) = rows 16t..16t+15 x inputs 32b + 4c .. 32b + 4c + 3
 *   tile t, 4 bits:  chunk (b * 4 + c), c < 4: low nibbles inputs 32b + 4c + q, high nibbles
 *                    inputs 32b + 16 + 4c + q (q = byte in the row's 4)
 *   tile t, 5 bits:  block b at byte 320 b: those 4 chunks, then 8 uint64 masks, (c, h) at
 *                    256 + 16c + 8h: bit 4r + q = the fifth bit of the code in byte lane 4r + q
 *                    of chunk c's low (h = 0) or high (h = 1) nibbles; one masked add of 16 each
 *   scales of tile t: d[16t * G + g * 16 + r] (fp16), offsets likewise
 *
 * Each output lane's arithmetic is the same whatever NT and JN are, so any split of the
 * rows over calls or threads computes the same bits (the fused step relies on it). */
enum { TILE_GROUP = 4, TILE_JN = 2 };

/* The 6-bit (Q6_K) tile_block: per block, each half (sub-block) is 4 vpdpbusd into an integer
 * sum, turned into sc * (isum - 32 xsum16) in int32; the two halves' sum is converted and
 * scaled by d * dx once. A tile's superblock: 8 blocks of 8 chunks (the codes a byte each, as
 * the 8-bit tiled layout), then sc [16 sub-blocks][16 rows]. */
static inline __attribute__((always_inline)) void tile_block6(
    const uint8_t *codes, int64_t tile_bytes, const uint16_t *d, int64_t tile_scales, int64_t nb,
    const int8_t *xq, int64_t kp, const float *dx, const int32_t *xsum16, const int NT, const int JN,
    __m512 acc[TILE_GROUP][TILE_JN]) {
    for (int i = 0; i < NT; i++)
        for (int j = 0; j < JN; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const int64_t at = (b / 8) * Q6_TILE_BYTES + (b % 8) * 8 * 64;
        const uint8_t *sc = codes + (b / 8) * Q6_TILE_BYTES + Q6_TILE_SC + (b % 8) * 2 * 16;
        const int8_t *xb = xq + b * BLOCK;
        __m512i total[TILE_GROUP][TILE_JN];
        for (int i = 0; i < NT; i++)
            for (int j = 0; j < JN; j++) total[i][j] = _mm512_setzero_si512();
        for (int half = 0; half < 2; half++) {
            __m512i isum[TILE_GROUP][TILE_JN];
            for (int i = 0; i < NT; i++)
                for (int j = 0; j < JN; j++) isum[i][j] = _mm512_setzero_si512();
            for (int c = 0; c < 4; c++) {
                __m512i q[TILE_GROUP];
                for (int i = 0; i < NT; i++)
                    q[i] = _mm512_loadu_si512((const void *)(codes + i * tile_bytes + at + (4 * half + c) * 64));
                for (int j = 0; j < JN; j++) {
                    int32_t x4;
                    memcpy(&x4, xb + j * kp + 16 * half + 4 * c, 4);
                    const __m512i xv = _mm512_set1_epi32(x4);
                    for (int i = 0; i < NT; i++) isum[i][j] = _mm512_dpbusd_epi32(isum[i][j], q[i], xv);
                }
            }
            for (int i = 0; i < NT; i++) {
                const __m512i s = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sc + i * tile_bytes + half * 16)));
                for (int j = 0; j < JN; j++) {
                    const __m512i part = _mm512_mullo_epi32(
                        s, _mm512_sub_epi32(isum[i][j], _mm512_set1_epi32(32 * xsum16[j * 2 * nb + 2 * b + half])));
                    total[i][j] = _mm512_add_epi32(total[i][j], part);
                }
            }
        }
        for (int i = 0; i < NT; i++) {
            const __m512 wd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + i * tile_scales + (b / 8) * 16)));
            for (int j = 0; j < JN; j++)
                acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[i][j]), _mm512_mul_ps(wd, _mm512_set1_ps(dx[j * nb + b])),
                                            acc[i][j]);
        }
    }
}

static inline __attribute__((always_inline)) void tile_block(
    const uint8_t *codes, int64_t tile_bytes, const uint16_t *d, const uint16_t *mo, int64_t tile_scales,
    int group_shift, int64_t nb, const int8_t *xq, int64_t kp, const float *dx, const float *xs,
    const int NT, const int JN, const int BITS, const int ROW_SCALE, __m512 acc[TILE_GROUP][TILE_JN]) {
    for (int i = 0; i < NT; i++)
        for (int j = 0; j < JN; j++) acc[i][j] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0f), sixteen = _mm512_set1_epi8(0x10);
    for (int64_t b = 0; b < nb; b++) {
        __m512i isum[TILE_GROUP][TILE_JN];
        for (int i = 0; i < NT; i++)
            for (int j = 0; j < JN; j++) isum[i][j] = _mm512_setzero_si512();
        const int8_t *xb = xq + b * BLOCK;
        if (BITS == 8) {
            for (int c = 0; c < 8; c++) {
                __m512i wv[TILE_GROUP];
                for (int i = 0; i < NT; i++) wv[i] = _mm512_loadu_si512((const void *)(codes + i * tile_bytes + (b * 8 + c) * 64));
                for (int j = 0; j < JN; j++) {
                    int32_t x4;
                    memcpy(&x4, xb + j * kp + 4 * c, 4);
                    const __m512i xv = _mm512_set1_epi32(x4);
                    for (int i = 0; i < NT; i++) isum[i][j] = _mm512_dpbusd_epi32(isum[i][j], wv[i], xv);
                }
            }
        } else {
            const int64_t block_at = b * (BITS == 5 ? Q5_TILE_BLOCK : 4 * 64);
            for (int c = 0; c < 4; c++) {
                __m512i lo[TILE_GROUP], hi[TILE_GROUP];
                for (int i = 0; i < NT; i++) {
                    const uint8_t *chunk = codes + i * tile_bytes + block_at + c * 64;
                    const __m512i v = _mm512_loadu_si512((const void *)chunk);
                    lo[i] = _mm512_and_si512(v, low);
                    hi[i] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                    if (BITS == 5) { /* the fifth bits: + 16 where the chunk's mask has a bit */
                        uint64_t fifth[2];
                        memcpy(fifth, codes + i * tile_bytes + block_at + 256 + c * 16, 16);
                        lo[i] = _mm512_mask_add_epi8(lo[i], _cvtu64_mask64(fifth[0]), lo[i], sixteen);
                        hi[i] = _mm512_mask_add_epi8(hi[i], _cvtu64_mask64(fifth[1]), hi[i], sixteen);
                    }
                }
                for (int j = 0; j < JN; j++) {
                    int32_t xl, xh;
                    memcpy(&xl, xb + j * kp + 4 * c, 4);
                    memcpy(&xh, xb + j * kp + 16 + 4 * c, 4);
                    const __m512i xlv = _mm512_set1_epi32(xl), xhv = _mm512_set1_epi32(xh);
                    for (int i = 0; i < NT; i++) {
                        isum[i][j] = _mm512_dpbusd_epi32(isum[i][j], lo[i], xlv);
                        isum[i][j] = _mm512_dpbusd_epi32(isum[i][j], hi[i], xhv);
                    }
                }
            }
        }
        if (ROW_SCALE) { /* the row's d and offset are applied once, by the caller */
            for (int j = 0; j < JN; j++) {
                const __m512 dv = _mm512_set1_ps(dx[j * nb + b]);
                for (int i = 0; i < NT; i++) acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i][j]), dv, acc[i][j]);
            }
        } else { /* d * dx * isum + m * dx * xsum, the block's group's d and m */
            const int64_t g = b >> group_shift;
            __m512 wd[TILE_GROUP], wm[TILE_GROUP];
            for (int i = 0; i < NT; i++) {
                wd[i] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + i * tile_scales + g * 16)));
                wm[i] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mo + i * tile_scales + g * 16)));
            }
            for (int j = 0; j < JN; j++) {
                const __m512 dv = _mm512_set1_ps(dx[j * nb + b]), sv = _mm512_set1_ps(xs[j * nb + b]);
                for (int i = 0; i < NT; i++) {
                    acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i][j]), _mm512_mul_ps(wd[i], dv), acc[i][j]);
                    acc[i][j] = _mm512_fmadd_ps(wm[i], sv, acc[i][j]);
                }
            }
        }
    }
}

/* Rows [n0, n1) of a tiled weight against every activation row (see arbor_qmatmul_range). */
static void qmatmul_tiles(const ArborQWeight *w, const ArborQAct *a, int64_t n0, int64_t n1, float *y,
                          int64_t ldy, int accumulate) {
    const int64_t kp = w->kp, nb = kp / BLOCK, rows = a->rows;
    const int64_t tile_bytes = 16 * qrow_bytes(w->bits, kp, 1), tile_scales = 16 * w->num_groups;
    const int row_scale = w->num_groups == 1 && w->bits != 6;
    const int64_t t_end = (n1 + 15) / 16;
    for (int64_t t0 = n0 / 16; t0 < t_end; t0 += TILE_GROUP) {
        const int64_t nt = t_end - t0 < TILE_GROUP ? t_end - t0 : TILE_GROUP;
        const uint8_t *codes = w->codes + t0 * tile_bytes;
        const uint16_t *d = w->d + t0 * tile_scales, *mo = w->m + t0 * tile_scales;
        for (int64_t m0 = 0; m0 < rows; m0 += TILE_JN) {
            const int64_t jn = rows - m0 < TILE_JN ? rows - m0 : TILE_JN;
            const int8_t *xq = a->xq + m0 * kp;
            const float *dx = a->dx + m0 * nb, *xs = a->xs + m0 * nb;
            __m512 acc[TILE_GROUP][TILE_JN];
#define TB(NT, JN, BITS, RS) tile_block(codes, tile_bytes, d, mo, tile_scales, w->group_shift, nb, xq, kp, dx, xs, NT, JN, BITS, RS, acc)
#define BY_JN(NT, BITS, RS) do { if (jn == 2) TB(NT, 2, BITS, RS); else TB(NT, 1, BITS, RS); } while (0)
#define BY_NT(BITS, RS)                                                                            \
    do {                                                                                           \
        if (nt == 4) BY_JN(4, BITS, RS);                                                           \
        else if (nt == 3) BY_JN(3, BITS, RS);                                                      \
        else if (nt == 2) BY_JN(2, BITS, RS);                                                      \
        else BY_JN(1, BITS, RS);                                                                   \
    } while (0)
            if (w->bits == 6) {
#define TB6(NT, JN) tile_block6(codes, tile_bytes, d, tile_scales, nb, xq, kp, dx, a->xsum16 + m0 * 2 * nb, NT, JN, acc)
#define BY_JN6(NT) do { if (jn == 2) TB6(NT, 2); else TB6(NT, 1); } while (0)
                if (nt == 4) BY_JN6(4);
                else if (nt == 3) BY_JN6(3);
                else if (nt == 2) BY_JN6(2);
                else BY_JN6(1);
#undef BY_JN6
#undef TB6
            } else if (w->bits == 8) {
                if (row_scale) BY_NT(8, 1);
                else BY_NT(8, 0);
            } else if (w->bits == 5) {
                if (row_scale) BY_NT(5, 1);
                else BY_NT(5, 0);
            } else {
                if (row_scale) BY_NT(4, 1);
                else BY_NT(4, 0);
            }
#undef BY_NT
#undef BY_JN
#undef TB
            for (int64_t j = 0; j < jn; j++) {
                float xs_total = 0.0f; /* sum_b dx * xsum, for a per-row offset */
                if (row_scale)
                    for (int64_t b = 0; b < nb; b++) xs_total += xs[j * nb + b];
                for (int64_t i = 0; i < nt; i++) {
                    const int64_t t = t0 + i;
                    __m512 v = acc[i][j];
                    if (row_scale)
                        v = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mo + i * tile_scales))),
                                            _mm512_set1_ps(xs_total),
                                            _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d + i * tile_scales))), v));
                    if (w->bias != NULL) v = _mm512_add_ps(v, _mm512_loadu_ps(w->bias + t * 16));
                    float *out = y + (m0 + j) * ldy;
                    if (t * 16 >= n0 && t * 16 + 16 <= n1) { /* a whole tile */
                        float *at = out + (t * 16 - n0);
                        _mm512_storeu_ps(at, accumulate ? _mm512_add_ps(_mm512_loadu_ps(at), v) : v);
                    } else { /* the edge of [n0, n1) cuts the tile */
                        float lanes[16];
                        _mm512_storeu_ps(lanes, v);
                        for (int64_t n = t * 16 > n0 ? t * 16 : n0; n < t * 16 + 16 && n < n1; n++)
                            out[n - n0] = accumulate ? out[n - n0] + lanes[n - t * 16] : lanes[n - t * 16];
                    }
                }
            }
        }
    }
}
#endif

#if defined(QPATH_AVX2)
static inline float hsum8(__m256 v) {
    const __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    __m128 s4 = _mm_add_ps(lo, hi);
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
    return _mm_cvtss_f32(s4);
}

/* 32 fifth bits -> 32 bytes, byte i = 16 where bit i is set: byte i of the word is spread to
 * lanes 8 (i / 8) .. + 7 and each lane keeps its own bit. */
static inline __m256i fifth_bits_avx2(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int32_t)bits),
        _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    const __m256i lane_bit = _mm256_set1_epi64x((int64_t)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, lane_bit), lane_bit), _mm256_set1_epi8(0x10));
}

/* The 5-bit codes of block b of a row (0..31): its nibbles (the superblock's low or high
 * ones) with the fifth bits added. */
static inline __m256i codes5_avx2(const uint8_t *w, int64_t b) {
    const uint8_t *sb = w + (b / 2) * Q5_SB_BYTES;
    const __m256i v = _mm256_loadu_si256((const __m256i *)sb);
    uint32_t fifth;
    memcpy(&fifth, sb + 32 + (b & 1) * 4, 4);
    const __m256i nib = _mm256_and_si256((b & 1) ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0f));
    return _mm256_or_si256(nib, fifth_bits_avx2(fifth));
}

/* The AVX2 dot_block: NW (<= 2) weight rows against JN (<= 4) activation rows, block by
 * block. A block's codes are unpacked once for the JN rows and an activation block is
 * loaded once for the NW rows; the integer dot product of a block is vpmaddubsw (u8 x s8
 * pairs) + vpmaddwd, converted and scaled once. 8-bit codes are used as the signed
 * q = code - 128 (u8 code x s8 pairs would saturate int16): |q| x sign(x, q), and the 128 *
 * xsum this leaves out is in wm (offset_128). ROW_SCALE: the weight has
 * one scale per row (int8 per channel), applied once at the end rather than per block.
 * has_offset[i]: weight row i has a nonzero offset term (symmetric int8 has none).
 * xq: the first activation row (row stride kp); dx, xs: its per-block floats (stride nb).
 * NW, JN, BITS and ROW_SCALE are compile-time constants at every call. out[i * 4 + j]. */
static inline __attribute__((always_inline)) void dot_block_avx2(
    const uint8_t *w, int64_t row_bytes, const float *wd, const float *wm, const int *has_offset,
    int64_t ws, int64_t nb, const int8_t *xq, int64_t kp, const float *dx, const float *xs, const int NW,
    const int JN, const int BITS, const int ROW_SCALE, float *out) {
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0f), flip = _mm256_set1_epi8((char)0x80);
    __m256 acc[2][4];
    for (int i = 0; i < NW; i++)
        for (int j = 0; j < JN; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i wu[2], wq[2]; /* unsigned codes (|q| for 8 bits); the signed q */
        for (int i = 0; i < NW; i++) {
            if (BITS == 4) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(w + i * row_bytes + (b / 2) * 32));
                wu[i] = _mm256_and_si256((b & 1) ? _mm256_srli_epi16(v, 4) : v, low);
            } else if (BITS == 5) {
                wu[i] = codes5_avx2(w + i * row_bytes, b);
            } else {
                wq[i] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + i * row_bytes + b * BLOCK)), flip);
                wu[i] = _mm256_sign_epi8(wq[i], wq[i]); /* |q|; q = -128 gives 0x80 = 128 unsigned */
            }
        }
        for (int j = 0; j < JN; j++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + j * kp + b * BLOCK));
            const float dxb = dx[j * nb + b];
            for (int i = 0; i < NW; i++) {
                /* |pair| <= 2 * 31 * 127 (4, 5 bits) or 2 * 128 * 127 (8 bits): no saturation */
                const __m256i pairs = BITS != 8 ? _mm256_maddubs_epi16(wu[i], xv)
                                                : _mm256_maddubs_epi16(wu[i], _mm256_sign_epi8(xv, wq[i]));
                const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
                const __m256 sc = _mm256_set1_ps(ROW_SCALE ? dxb : wd[i * ws + b] * dxb);
                acc[i][j] = _mm256_fmadd_ps(f, sc, acc[i][j]);
            }
        }
    }
    for (int i = 0; i < NW; i++) {
        for (int j = 0; j < JN; j++) {
            float v = hsum8(acc[i][j]);
            if (ROW_SCALE) v *= wd[i * ws];
            if (has_offset[i]) { /* the offset term, m * dx * xsum */
                __m256 off = _mm256_setzero_ps();
                int64_t b = 0;
                for (; b + 8 <= nb; b += 8)
                    off = _mm256_fmadd_ps(_mm256_loadu_ps(wm + i * ws + b), _mm256_loadu_ps(xs + j * nb + b), off);
                float tail = 0.0f;
                for (; b < nb; b++) tail += wm[i * ws + b] * xs[j * nb + b];
                v += hsum8(off) + tail;
            }
            out[i * 4 + j] = v;
        }
    }
}
#endif

#if defined(QPATH_AVX2)
/* Weight row n against the one activation row of a matrix-vector product (bound by memory):
 * the block scales are converted 8 at a time as the row is read instead of staged per tile
 * (at one activation row nothing would amortize the staging), and two accumulators take
 * alternate blocks. The arithmetic is dot_block_avx2's; xs_total = sum_b xs[b] (the caller's,
 * once per call). */
static float dot_row1_avx2(const ArborQWeight *w, int64_t n, const ArborQAct *a, float xs_total) {
    const int64_t kp = w->kp, nb = kp / BLOCK, row_bytes = qrow_bytes(w->bits, kp, 0);
    const uint8_t *codes = w->codes + n * row_bytes;
    const uint16_t *d = w->d + n * w->num_groups, *mo = w->m + n * w->num_groups;
    const float *dx = a->dx, *xs = a->xs;
    const float add128 = w->bits == 8 ? 128.0f : 0.0f; /* see offset_128 */
    float s_row[nb], row_d = 1.0f, offset;
    const float *s = s_row; /* the per-block scales of the products */
    if (w->num_groups == 1) { /* one scale per row: s = dx, scaled once at the end */
        row_d = half_to_float(d[0]);
        offset = (half_to_float(mo[0]) + add128 * row_d) * xs_total;
        s = dx;
    } else {
        float *s_out = s_row;
        __m256 off = _mm256_setzero_ps();
        int64_t b = 0;
        if (w->group_shift == 0) {
            for (; b + 8 <= nb; b += 8) {
                const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + b)));
                const __m256 mv = _mm256_fmadd_ps(_mm256_set1_ps(add128), dv,
                                                  _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mo + b))));
                _mm256_storeu_ps(s_out + b, _mm256_mul_ps(dv, _mm256_loadu_ps(dx + b)));
                off = _mm256_fmadd_ps(mv, _mm256_loadu_ps(xs + b), off);
            }
        }
        float tail = 0.0f;
        for (; b < nb; b++) {
            const float dv = half_to_float(d[b >> w->group_shift]);
            s_out[b] = dv * dx[b];
            tail += (half_to_float(mo[b >> w->group_shift]) + add128 * dv) * xs[b];
        }
        offset = hsum8(off) + tail;
    }
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0f), flip = _mm256_set1_epi8((char)0x80);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b += 2) { /* nb is even: Kp is a multiple of 64 */
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(a->xq + b * BLOCK));
        const __m256i x1 = _mm256_loadu_si256((const __m256i *)(a->xq + b * BLOCK + BLOCK));
        __m256i p0, p1;
        if (w->bits == 4) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(codes + (b / 2) * 32));
            p0 = _mm256_maddubs_epi16(_mm256_and_si256(v, low), x0);
            p1 = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), x1);
        } else if (w->bits == 5) {
            p0 = _mm256_maddubs_epi16(codes5_avx2(codes, b), x0);
            p1 = _mm256_maddubs_epi16(codes5_avx2(codes, b + 1), x1);
        } else {
            const __m256i q0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(codes + b * BLOCK)), flip);
            const __m256i q1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(codes + b * BLOCK + BLOCK)), flip);
            p0 = _mm256_maddubs_epi16(_mm256_sign_epi8(q0, q0), _mm256_sign_epi8(x0, q0));
            p1 = _mm256_maddubs_epi16(_mm256_sign_epi8(q1, q1), _mm256_sign_epi8(x1, q1));
        }
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p0, ones)), _mm256_set1_ps(s[b]), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p1, ones)), _mm256_set1_ps(s[b + 1]), acc1);
    }
    return row_d * hsum8(_mm256_add_ps(acc0, acc1)) + offset;
}
#endif

/* The byte sizes of an ArborQAct's arrays, in layout order: xq, dx, xs, xsum, dxe, xsum16
 * (each placed 64-byte aligned; dxe has 16 floats of slack for the last vector load). */
enum { QACT_ARRAYS = 6 };
static void qact_sizes(int64_t rows, int64_t kp, size_t sizes[QACT_ARRAYS]) {
    const size_t nb = (size_t)(kp / BLOCK), r = (size_t)rows;
    sizes[0] = r * (size_t)kp, sizes[1] = sizes[2] = sizes[3] = 4 * r * nb, sizes[4] = 4 * r * nb * 8 + 64;
    sizes[5] = 8 * r * nb;
}

static size_t align64(size_t n) { return (n + 63) / 64 * 64; }

size_t arbor_qact_bytes(int64_t rows, int64_t kp) {
    size_t sizes[QACT_ARRAYS], total = 0;
    qact_sizes(rows, kp, sizes);
    for (int i = 0; i < QACT_ARRAYS; i++) total += align64(sizes[i]);
    return total;
}

void arbor_qact_init(ArborQAct *a, void *mem, int64_t rows, int64_t kp) {
    size_t sizes[QACT_ARRAYS];
    qact_sizes(rows, kp, sizes);
    char *p = mem;
    a->xq = (int8_t *)p, p += align64(sizes[0]);
    a->dx = (float *)p, p += align64(sizes[1]);
    a->xs = (float *)p, p += align64(sizes[2]);
    a->xsum = (int32_t *)p, p += align64(sizes[3]);
    a->dxe = (float *)p, p += align64(sizes[4]);
    a->xsum16 = (int32_t *)p;
    a->rows = rows, a->kp = kp;
}

void arbor_qact_quantize_row(ArborQAct *a, int64_t r, const float *x, int64_t k_len) {
    const int64_t kp = a->kp, nb = kp / BLOCK, nsb = nb / 2;
    float *dx = a->dx + r * nb;
    quantize_row(x, k_len, nb, a->xq + r * kp, dx, a->xsum + r * nb, a->xsum16 + r * 2 * nb, a->xs + r * nb);
    float *dxe = a->dxe + r * nsb * 16;
    for (int64_t sb = 0; sb < nsb; sb++)
        for (int i = 0; i < 16; i++) dxe[sb * 16 + i] = dx[2 * sb + (i >= 8)];
}

static inline void put(float *y, float v, const float *bias, int64_t n, int accumulate) {
    if (bias != NULL) v += bias[n];
    *y = accumulate ? *y + v : v;
}

void arbor_qmatmul_range(const ArborQWeight *w, const ArborQAct *a, int64_t n0, int64_t n1, float *y,
                         int64_t ldy, int accumulate) {
    const int64_t kp = w->kp, nb = kp / BLOCK, rows = a->rows, row_bytes = qrow_bytes(w->bits, kp, 0);
    if (w->bits == 6 && !w->tiled) {
        qmatmul_rows6(w, a, n0, n1, y, ldy, accumulate);
        return;
    }
#if defined(QPATH_AVX512)
    if (w->tiled) {
        qmatmul_tiles(w, a, n0, n1, y, ldy, accumulate);
        return;
    }
    /* Tiles of up to TILE_ROWS weight rows (codes and float scales stay in L1) meet the
     * activation rows four at a time, two weight rows at a time (dot_block). */
    enum { TILE_ROWS = 16 };
    const int64_t ws = nb + 16, nsb = nb / 2;
    const int row_scale = w->num_groups == 1;
    float wd[TILE_ROWS * ws], wm[TILE_ROWS * ws];
    for (int64_t t0 = n0; t0 < n1; t0 += TILE_ROWS) {
        const int64_t t1 = t0 + TILE_ROWS < n1 ? t0 + TILE_ROWS : n1;
        for (int64_t n = t0; n < t1; n++) weight_row_scales(w, n, nb, wd + (n - t0) * ws, wm + (n - t0) * ws);
        if (rows == 1) { /* one activation row: a matrix-vector product, bound by memory */
            for (int64_t n = t0; n < t1; n++) {
                const float v = dot_row1(w->codes + n * row_bytes, w->bits, wd + (n - t0) * ws,
                                         wm + (n - t0) * ws, nb, a->xq, a->dxe, a->xs);
                put(y + (n - n0), v, w->bias, n, accumulate);
            }
            continue;
        }
        for (int64_t m0 = 0; m0 < rows; m0 += 4) {
            const int64_t jn = rows - m0 < 4 ? rows - m0 : 4;
            const int8_t *xq = a->xq + m0 * kp;
            const float *dxe = a->dxe + m0 * nsb * 16, *xs = a->xs + m0 * nb;
            float xs_total[4] = {0.0f, 0.0f, 0.0f, 0.0f}; /* sum_b dx * xsum, for ROW_SCALE */
            if (row_scale)
                for (int64_t j = 0; j < jn; j++)
                    for (int64_t b = 0; b < nb; b++) xs_total[j] += xs[j * nb + b];
            for (int64_t n = t0; n < t1; n += 2) {
                const int64_t nw = t1 - n < 2 ? 1 : 2;
                const uint8_t *codes = w->codes + n * row_bytes;
                const float *wdn = wd + (n - t0) * ws, *wmn = wm + (n - t0) * ws;
                float out[8];
#define BLOCK_CALL(NW, JN, RS) dot_block(codes, row_bytes, w->bits, wdn, wmn, ws, nb, xq, kp, dxe, xs, NW, JN, RS, out)
#define BY_ROWS(NW, RS)                                                                            \
    do {                                                                                           \
        if (jn == 4) BLOCK_CALL(NW, 4, RS);                                                        \
        else if (jn == 3) BLOCK_CALL(NW, 3, RS);                                                   \
        else if (jn == 2) BLOCK_CALL(NW, 2, RS);                                                   \
        else BLOCK_CALL(NW, 1, RS);                                                                \
    } while (0)
                if (row_scale) {
                    if (nw == 2) BY_ROWS(2, 1);
                    else BY_ROWS(1, 1);
                } else {
                    if (nw == 2) BY_ROWS(2, 0);
                    else BY_ROWS(1, 0);
                }
#undef BY_ROWS
#undef BLOCK_CALL
                for (int64_t i = 0; i < nw; i++) {
                    for (int64_t j = 0; j < jn; j++) {
                        float v = out[i * 4 + j];
                        if (row_scale) v = wdn[i * ws] * v + wmn[i * ws] * xs_total[j];
                        put(y + (m0 + j) * ldy + (n + i - n0), v, w->bias, n + i, accumulate);
                    }
                }
            }
        }
    }
#elif defined(QPATH_AVX2)
    /* Tiles of up to TILE_ROWS weight rows meet the activation rows four at a time, two
     * weight rows at a time (dot_block_avx2). */
    enum { TILE_ROWS = 16 };
    const int64_t ws = nb + 16;
    const int row_scale = w->num_groups == 1;
    if (rows == 1) { /* a matrix-vector product; xs_total: sum_b dx * xsum, for per-row offsets */
        float xs_total = 0.0f;
        for (int64_t b = 0; b < nb; b++) xs_total += a->xs[b];
        for (int64_t n = n0; n < n1; n++)
            put(y + (n - n0), dot_row1_avx2(w, n, a, xs_total), w->bias, n, accumulate);
        return;
    }
    float wd[TILE_ROWS * ws], wm[TILE_ROWS * ws];
    int has_offset[TILE_ROWS];
    for (int64_t t0 = n0; t0 < n1; t0 += TILE_ROWS) {
        const int64_t t1 = t0 + TILE_ROWS < n1 ? t0 + TILE_ROWS : n1;
        for (int64_t n = t0; n < t1; n++) {
            weight_row_scales(w, n, nb, wd + (n - t0) * ws, wm + (n - t0) * ws);
            has_offset[n - t0] = offset_128(wd + (n - t0) * ws, wm + (n - t0) * ws, nb, w->bits);
        }
        for (int64_t m0 = 0; m0 < rows; m0 += 4) {
            const int64_t jn = rows - m0 < 4 ? rows - m0 : 4;
            const int8_t *xq = a->xq + m0 * kp;
            const float *dx = a->dx + m0 * nb, *xs = a->xs + m0 * nb;
            for (int64_t n = t0; n < t1; n += 2) {
                const int64_t nw = t1 - n < 2 ? 1 : 2;
                const uint8_t *codes = w->codes + n * row_bytes;
                const float *wdn = wd + (n - t0) * ws, *wmn = wm + (n - t0) * ws;
                float out[8];
#define BLOCK_CALL(NW, JN, BITS, RS) \
    dot_block_avx2(codes, row_bytes, wdn, wmn, has_offset + (n - t0), ws, nb, xq, kp, dx, xs, NW, JN, BITS, RS, out)
#define BY_ROWS(NW, BITS, RS)                                                                      \
    do {                                                                                           \
        if (jn == 4) BLOCK_CALL(NW, 4, BITS, RS);                                                  \
        else if (jn == 3) BLOCK_CALL(NW, 3, BITS, RS);                                             \
        else if (jn == 2) BLOCK_CALL(NW, 2, BITS, RS);                                             \
        else BLOCK_CALL(NW, 1, BITS, RS);                                                          \
    } while (0)
#define BY_WEIGHT_ROWS(BITS, RS)                                                                   \
    do {                                                                                           \
        if (nw == 2) BY_ROWS(2, BITS, RS);                                                         \
        else BY_ROWS(1, BITS, RS);                                                                 \
    } while (0)
                if (w->bits == 4) {
                    if (row_scale) BY_WEIGHT_ROWS(4, 1);
                    else BY_WEIGHT_ROWS(4, 0);
                } else if (w->bits == 5) {
                    if (row_scale) BY_WEIGHT_ROWS(5, 1);
                    else BY_WEIGHT_ROWS(5, 0);
                } else {
                    if (row_scale) BY_WEIGHT_ROWS(8, 1);
                    else BY_WEIGHT_ROWS(8, 0);
                }
#undef BY_WEIGHT_ROWS
#undef BY_ROWS
#undef BLOCK_CALL
                for (int64_t i = 0; i < nw; i++)
                    for (int64_t j = 0; j < jn; j++)
                        put(y + (m0 + j) * ldy + (n + i - n0), out[i * 4 + j], w->bias, n + i, accumulate);
            }
        }
    }
#else
    /* Tiles of up to TILE_ROWS weight rows meet every activation row while they are in L1. */
    enum { TILE_ROWS = 16 };
    const int64_t ws = nb + 16;
    float wd[TILE_ROWS * ws], wm[TILE_ROWS * ws], s[nb];
    for (int64_t t0 = n0; t0 < n1; t0 += TILE_ROWS) {
        const int64_t t1 = t0 + TILE_ROWS < n1 ? t0 + TILE_ROWS : n1;
        for (int64_t n = t0; n < t1; n++) weight_row_scales(w, n, nb, wd + (n - t0) * ws, wm + (n - t0) * ws);
        for (int64_t m = 0; m < rows; m++) {
            const float *dx = a->dx + m * nb, *xs = a->xs + m * nb;
            for (int64_t n = t0; n < t1; n++) {
                const float *wdn = wd + (n - t0) * ws, *wmn = wm + (n - t0) * ws;
                float offset = 0.0f;
                for (int64_t b = 0; b < nb; b++) {
                    s[b] = wdn[b] * dx[b];
                    offset += wmn[b] * xs[b];
                }
                const float v = dot_row(w->codes + n * row_bytes, w->bits, a->xq + m * kp, s, nb) + offset;
                put(y + m * ldy + (n - n0), v, w->bias, n, accumulate);
            }
        }
    }
#endif
}

/* y[M, N] = x[M, K] @ W^T (+ bias). Returns 0, -1 when scratch memory ran out, -2 for a
 * tiled weight in a build without the AVX-512 VNNI path (arbor_quant_tiles() is 0).
 *   codes: [N, row_bytes] (row_bytes = Kp / 2, Kp, or Kp / 256 * 208), d, mo: [N, num_groups] fp16 bits, in
 *   rows or (tiled) in tiles of 16 rows. */
int arbor_quant_linear(const float *x, int64_t rows, int64_t k_len, const uint8_t *codes,
                       const uint16_t *d, const uint16_t *mo, int64_t n_out, int64_t kp,
                       int64_t num_groups, int group_shift, int bits, int tiled, const float *bias,
                       float *y, int num_threads) {
    if (tiled && !arbor_quant_tiles()) return -2;
    const ArborQWeight w = {codes, d, mo, bias, n_out, k_len, kp, num_groups, group_shift, bits, tiled};
    void *mem = aligned_alloc(64, arbor_qact_bytes(rows, kp));
    if (mem == NULL) return -1;
    ArborQAct a;
    arbor_qact_init(&a, mem, rows, kp);
#pragma omp parallel for num_threads(threads_for(rows * k_len * 16, num_threads)) schedule(static)
    for (int64_t r = 0; r < rows; r++) arbor_qact_quantize_row(&a, r, x + r * k_len, k_len);
    /* Each thread takes one contiguous run of 16-row tiles, in one call (the tiled kernel
     * takes TILE_GROUP tiles at a time); a tile meets every activation row while it is in L1. */
    const int64_t num_tiles = (n_out + 15) / 16;
#pragma omp parallel num_threads(threads_for(rows * n_out * kp, num_threads))
    {
        const int64_t size = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t n0 = num_tiles * tid / size * 16, n1_tiles = num_tiles * (tid + 1) / size * 16;
        const int64_t n1 = n1_tiles < n_out ? n1_tiles : n_out;
        if (n0 < n1) arbor_qmatmul_range(&w, &a, n0, n1, y + n0, n_out, 0);
    }
    free(mem);
    return 0;
}

/* fp32 -> bf16 bits, rounded to nearest even (torch's conversion; the values are finite). */
static inline uint16_t to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* Row n of a tiled weight in the row layout: its codes (row_bytes), scales and offsets
 * (num_groups each). */
static void untile_row(const uint8_t *codes, const uint16_t *d, const uint16_t *mo, int64_t n, int64_t kp,
                       int64_t num_groups, int bits, uint8_t *row, uint16_t *row_d, uint16_t *row_m) {
    const int64_t t = n / 16, r = n % 16, row_bytes = qrow_bytes(bits, kp, 1);
    const uint8_t *tile = codes + t * 16 * row_bytes;
    for (int64_t g = 0; g < num_groups; g++) {
        row_d[g] = d[t * 16 * num_groups + g * 16 + r];
        row_m[g] = mo[t * 16 * num_groups + g * 16 + r];
    }
    if (bits == 8) {
        for (int64_t c = 0; c < kp / 4; c++) memcpy(row + 4 * c, tile + c * 64 + 4 * r, 4);
        return;
    }
    const int64_t block_bytes = bits == 5 ? Q5_TILE_BLOCK : 4 * 64;
    if (bits == 5) memset(row, 0, (size_t)row_bytes); /* the fifth bits are or-ed in */
    for (int64_t b = 0; b < kp / BLOCK; b++) { /* block b's 32 codes, then into the superblock */
        uint8_t code[BLOCK];
        const uint8_t *tb = tile + b * block_bytes;
        for (int c = 0; c < 4; c++) {
            for (int q = 0; q < 4; q++) {
                const uint8_t byte = tb[c * 64 + 4 * r + q];
                code[4 * c + q] = byte & 0x0f;
                code[16 + 4 * c + q] = byte >> 4;
                if (bits == 5) { /* masks (c, low) and (c, high): bit 4r + q */
                    const int lane = 4 * (int)r + q;
                    code[4 * c + q] |= ((tb[256 + c * 16 + lane / 8] >> (lane % 8)) & 1) << 4;
                    code[16 + 4 * c + q] |= ((tb[256 + c * 16 + 8 + lane / 8] >> (lane % 8)) & 1) << 4;
                }
            }
        }
        uint8_t *sb = row + (b / 2) * (bits == 5 ? Q5_SB_BYTES : BLOCK); /* byte i: block 2s element i low, 2s + 1 high */
        for (int i = 0; i < BLOCK; i++) {
            sb[i] = (b & 1) ? (uint8_t)(sb[i] | ((code[i] & 0x0f) << 4)) : (code[i] & 0x0f);
            if (bits != 5) continue;
            const int e = (int)(b & 1) * BLOCK + i; /* the element's bit in the superblock's uint64 */
            sb[32 + e / 8] = (uint8_t)(sb[32 + e / 8] | ((code[i] >> 4) << (e % 8)));
        }
    }
}

/* Superblock s of row n of a 6-bit weight: its 256 codes, 16 sub-block scales and d. */
static void q6_superblock(const uint8_t *codes, const uint16_t *d, int64_t n, int64_t s, int64_t kp,
                          int64_t num_groups, int tiled, uint8_t q[Q6_SUPER], int8_t sc[16], uint16_t *dn) {
    const int64_t row_bytes = qrow_bytes(6, kp, tiled);
    if (!tiled) {
        const uint8_t *sb = codes + n * row_bytes + s * Q6_ROW_BYTES;
        for (int e = 0; e < Q6_SUPER; e++) q[e] = (uint8_t)q6_code(sb, e);
        memcpy(sc, sb + 192, 16);
        *dn = d[n * num_groups + s];
        return;
    }
    const int64_t t = n / 16, r = n % 16;
    const uint8_t *sb = codes + t * 16 * row_bytes + s * Q6_TILE_BYTES;
    for (int c = 0; c < Q6_SUPER / 4; c++) memcpy(q + 4 * c, sb + c * 64 + 4 * r, 4);
    for (int j = 0; j < 16; j++) sc[j] = (int8_t)sb[Q6_TILE_SC + j * 16 + r];
    *dn = d[t * 16 * num_groups + s * 16 + r];
}

/* arbor_dequantize for 6 bits: (d * sc_j) * (code - 32), as gguf's dequantizer computes it. */
__attribute__((optimize("fp-contract=off"))) static void dequantize6(
    const uint8_t *codes, const uint16_t *d, int64_t n_out, int64_t kp, int64_t num_groups, int tiled,
    void *out, int bf16, int num_threads) {
#pragma omp parallel for num_threads(threads_for(n_out * kp * 4, num_threads)) schedule(static)
    for (int64_t n = 0; n < n_out; n++) {
        for (int64_t s = 0; s < kp / Q6_SUPER; s++) {
            uint8_t q[Q6_SUPER];
            int8_t sc[16];
            uint16_t dh;
            q6_superblock(codes, d, n, s, kp, num_groups, tiled, q, sc, &dh);
            const float dv = half_to_float(dh);
            for (int e = 0; e < Q6_SUPER; e++) {
                const float v = (dv * (float)sc[e / 16]) * (float)((int)q[e] - 32);
                if (bf16) ((uint16_t *)out)[n * kp + s * Q6_SUPER + e] = to_bf16(v);
                else ((float *)out)[n * kp + s * Q6_SUPER + e] = v;
            }
        }
    }
}

/* out[N, K] = d * code + m, the reference's dequantize bit for bit, in fp32 (bf16 = 0) or
 * rounded to bf16 (bf16 = 1: torch's float -> bfloat16 of those values). One pass over
 * the codes, rows split over threads: the large-batch paths multiply the result with
 * torch (fp32 F.linear where there is no AVX-512, oneDNN bf16 where there is AVX512_BF16). */
__attribute__((optimize("fp-contract=off"))) void arbor_dequantize(
    const uint8_t *codes, const uint16_t *d, const uint16_t *mo, int64_t n_out, int64_t k_len,
    int64_t kp, int64_t num_groups, int group_shift, int bits, int tiled, void *out, int bf16,
    int num_threads) {
    if (bits == 6) { /* k_len == kp: Q6_K rows are whole superblocks */
        dequantize6(codes, d, n_out, kp, num_groups, tiled, out, bf16, num_threads);
        return;
    }
    const int64_t nb = kp / BLOCK, row_bytes = qrow_bytes(bits, kp, 0);
#pragma omp parallel for num_threads(threads_for(n_out * kp * 4, num_threads)) schedule(static)
    for (int64_t n = 0; n < n_out; n++) {
        uint8_t row[tiled ? row_bytes : 1];
        uint16_t row_d[tiled ? num_groups : 1], row_m[tiled ? num_groups : 1];
        const uint8_t *w = codes + n * row_bytes;
        const uint16_t *dn = d + n * num_groups, *mn = mo + n * num_groups;
        if (tiled) {
            untile_row(codes, d, mo, n, kp, num_groups, bits, row, row_d, row_m);
            w = row, dn = row_d, mn = row_m;
        }
        for (int64_t b = 0; b < nb && b * BLOCK < k_len; b++) {
            const int64_t g = num_groups == 1 ? 0 : b >> group_shift;
            const float dv = half_to_float(dn[g]), mv = half_to_float(mn[g]);
            const int64_t len = k_len - b * BLOCK < BLOCK ? k_len - b * BLOCK : BLOCK;
#if defined(QPATH_AVX512) && defined(__AVX512BF16__)
            if (bf16 && bits != 5) { /* 32 values: codes widened, d * code, + m, rounded by vcvtne2ps2bf16 (RNE) */
                __m128i c0, c1;
                if (bits == 4) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(w + (b / 2) * 32));
                    const __m256i nib = _mm256_and_si256((b & 1) ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0f));
                    c0 = _mm256_castsi256_si128(nib), c1 = _mm256_extracti128_si256(nib, 1);
                } else {
                    c0 = _mm_loadu_si128((const __m128i *)(w + b * BLOCK));
                    c1 = _mm_loadu_si128((const __m128i *)(w + b * BLOCK + 16));
                }
                const __m512 dvv = _mm512_set1_ps(dv), mvv = _mm512_set1_ps(mv);
                const __m512 lo = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c0)), dvv), mvv);
                const __m512 hi = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c1)), dvv), mvv);
                const __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
                uint16_t *dst = (uint16_t *)out + n * k_len + b * BLOCK;
                _mm512_mask_storeu_epi16(dst, len == BLOCK ? (__mmask32)0xffffffffu : (__mmask32)((1u << len) - 1), packed);
                continue;
            }
#endif
            float v[BLOCK];
            if (bits == 4) {
                const uint8_t *wb = w + (b / 2) * 32;
                const int shift = (b & 1) ? 4 : 0;
                for (int i = 0; i < BLOCK; i++) v[i] = dv * (float)((wb[i] >> shift) & 0x0f) + mv;
            } else if (bits == 5) {
                for (int i = 0; i < BLOCK; i++) v[i] = dv * (float)q5_code(w, b * BLOCK + i) + mv;
            } else {
                const uint8_t *wb = w + b * BLOCK;
                for (int i = 0; i < BLOCK; i++) v[i] = dv * (float)wb[i] + mv;
            }
            if (bf16) {
                uint16_t h[BLOCK];
                for (int i = 0; i < BLOCK; i++) h[i] = to_bf16(v[i]);
                memcpy((uint16_t *)out + n * k_len + b * BLOCK, h, (size_t)len * sizeof(uint16_t));
            } else {
                memcpy((float *)out + n * k_len + b * BLOCK, v, (size_t)len * sizeof(float));
            }
        }
    }
}

/* Q4_0 / Q4_1 blocks (GGUF: per row, blocks of 32 elements of d [, m] fp16 and 16 bytes of
 * nibbles, byte j: element j low, j + 16 high) straight into the tiled 4-bit layout, one
 * pass, no unpacking: a block's 16 nibble bytes are already its 4 chunks of 4 bytes
 * (kernels/reference/quant.py, tiled_from_q4_blocks, is the specification). Output row n
 * is read from rows[n] (the caller's pointers into the file's map: a fused weight's parts,
 * q / k rows in their un-permuted order). n_out is a multiple of 16; blocks past the row's
 * nb = k_len / 32 (up to kp / 32) get code 0 and d = m = 0.
 *   codes: [n_out / 16][kp / 32][4][16][4] bytes; d, m: [n_out / 16][kp / 32][16] fp16 bits
 *   (Q4_0: m = -8 d, rounded to fp16 as torch rounds it). */
void arbor_tile_q4_blocks(const uint8_t *const *rows, int64_t n_out, int64_t k_len, int64_t kp, int with_m,
                          uint8_t *codes, uint16_t *d, uint16_t *m, int num_threads) {
    const int64_t nb = k_len / BLOCK, kb = kp / BLOCK, block_bytes = with_m ? 20 : 18, qs = with_m ? 4 : 2;
    const int64_t tiles = n_out / 16;
#pragma omp parallel for num_threads(threads_for(n_out * kp, num_threads)) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        uint8_t *ct = codes + t * kb * 4 * 64;
        uint16_t *dt = d + t * kb * 16, *mt = m + t * kb * 16;
        for (int64_t b = 0; b < kb; b++) {
            for (int r = 0; r < 16; r++) {
                uint8_t *cb = ct + b * 4 * 64 + 4 * r;
                if (b >= nb) {
                    for (int c = 0; c < 4; c++) memset(cb + c * 64, 0, 4);
                    dt[b * 16 + r] = mt[b * 16 + r] = 0;
                    continue;
                }
                const uint8_t *src = rows[t * 16 + r] + b * block_bytes;
                for (int c = 0; c < 4; c++) memcpy(cb + c * 64, src + qs + 4 * c, 4);
                memcpy(dt + b * 16 + r, src, 2);
                if (with_m) memcpy(mt + b * 16 + r, src + 2, 2);
                else mt[b * 16 + r] = float_to_half(-8.0f * half_to_float(dt[b * 16 + r]));
            }
        }
    }
}

/* Q5_0 / Q5_1 blocks (GGUF: per block of 32, d [, m] fp16, a uint32 of fifth bits (bit j:
 * element j) and 16 bytes of nibbles as Q4's) straight into the 5-bit tiles, one pass: the
 * nibble bytes are the block's 4 chunks as for Q4, and mask (c, h) gathers bits 16h + 4c ..
 * + 3 of each row's uint32 at lanes 4r .. 4r + 3 (the specification: tile(from_ggml_blocks(raw,
 * kind, k)) in kernels/reference/quant.py). Rows, padding and Q5_0's m = -16 d (fp16) as
 * arbor_tile_q4_blocks.
 *   codes: [n_out / 16][kp / 32][320] bytes; d, m: [n_out / 16][kp / 32][16] fp16 bits. */
void arbor_tile_q5_blocks(const uint8_t *const *rows, int64_t n_out, int64_t k_len, int64_t kp, int with_m,
                          uint8_t *codes, uint16_t *d, uint16_t *m, int num_threads) {
    const int64_t nb = k_len / BLOCK, kb = kp / BLOCK, block_bytes = with_m ? 24 : 22, qh_at = with_m ? 4 : 2;
    const int64_t tiles = n_out / 16;
#pragma omp parallel for num_threads(threads_for(n_out * kp, num_threads)) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        uint8_t *ct = codes + t * kb * Q5_TILE_BLOCK;
        uint16_t *dt = d + t * kb * 16, *mt = m + t * kb * 16;
        for (int64_t b = 0; b < kb; b++) {
            uint8_t *cb = ct + b * Q5_TILE_BLOCK;
            uint64_t masks[8] = {0, 0, 0, 0, 0, 0, 0, 0}; /* (c, h) at 2c + h */
            for (int r = 0; r < 16; r++) {
                if (b >= nb) {
                    for (int c = 0; c < 4; c++) memset(cb + c * 64 + 4 * r, 0, 4);
                    dt[b * 16 + r] = mt[b * 16 + r] = 0;
                    continue;
                }
                const uint8_t *src = rows[t * 16 + r] + b * block_bytes;
                uint32_t qh;
                memcpy(&qh, src + qh_at, 4);
                for (int c = 0; c < 4; c++) {
                    memcpy(cb + c * 64 + 4 * r, src + qh_at + 4 + 4 * c, 4);
                    masks[2 * c] |= (uint64_t)((qh >> (4 * c)) & 0x0f) << (4 * r);
                    masks[2 * c + 1] |= (uint64_t)((qh >> (16 + 4 * c)) & 0x0f) << (4 * r);
                }
                memcpy(dt + b * 16 + r, src, 2);
                if (with_m) memcpy(mt + b * 16 + r, src + 2, 2);
                else mt[b * 16 + r] = float_to_half(-16.0f * half_to_float(dt[b * 16 + r]));
            }
            memcpy(cb + 256, masks, sizeof masks); /* little-endian, as the kernel loads them */
        }
    }
}

/* Q4_K superblocks (d, dmin fp16, 12 bytes of 6-bit sub-block scales and mins, 128 bytes of
 * nibbles: per 64 elements, byte i holds element i low and 32 + i high) straight into the
 * tiled 4-bit layout with groups of 32: d * sc_j and -dmin * m_j rounded to fp16 (the
 * specification: tile(from_ggml_blocks(raw, "Q4_K", k)) in kernels/reference/quant.py).
 * Rows and outputs as arbor_tile_q4_blocks; k_len a multiple of 256 (= kp). */
void arbor_tile_q4_k_blocks(const uint8_t *const *rows, int64_t n_out, int64_t k_len, uint8_t *codes,
                            uint16_t *d, uint16_t *m, int num_threads) {
    const int64_t ns = k_len / 256, kb = k_len / BLOCK, tiles = n_out / 16;
#pragma omp parallel for num_threads(threads_for(n_out * k_len, num_threads)) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        uint8_t *ct = codes + t * kb * 4 * 64;
        uint16_t *dt = d + t * kb * 16, *mt = m + t * kb * 16;
        for (int r = 0; r < 16; r++) {
            for (int64_t s = 0; s < ns; s++) {
                const uint8_t *src = rows[t * 16 + r] + s * 144, *q = src + 4, *nib = src + 16;
                uint16_t dh, mh;
                memcpy(&dh, src, 2);
                memcpy(&mh, src + 2, 2);
                const float dv = half_to_float(dh), dmin = half_to_float(mh);
                for (int j = 0; j < 8; j++) { /* sub-block j = our block 8 s + j */
                    const int sc = j < 4 ? q[j] & 63 : (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
                    const int mn = j < 4 ? q[j + 4] & 63 : (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
                    const int64_t b = s * 8 + j;
                    dt[b * 16 + r] = float_to_half(dv * (float)sc);
                    mt[b * 16 + r] = float_to_half(-(dmin * (float)mn));
                    const uint8_t *pair = nib + (j / 2) * 32; /* element i of the block: byte i's nibble */
                    const int shift = (j & 1) ? 4 : 0;
                    for (int c = 0; c < 4; c++) {
                        uint8_t *out = ct + (b * 4 + c) * 64 + 4 * r;
                        for (int k = 0; k < 4; k++)
                            out[k] = (uint8_t)(((pair[4 * c + k] >> shift) & 0x0f) | (((pair[16 + 4 * c + k] >> shift) & 0x0f) << 4));
                    }
                }
            }
        }
    }
}

/* Whether this build (and so this CPU: -march=native) has AVX512_BF16, whose oneDNN bf16
 * matmul the large-batch path uses (arbor_dequantize writes the bf16 weight with it). */
int arbor_quant_has_bf16(void) {
#if defined(QPATH_AVX512) && defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* Whether this build multiplies tiled weights (the AVX-512 VNNI path); the others take
 * the row layout only. */
int arbor_quant_tiles(void) {
#if defined(QPATH_AVX512)
    return 1;
#else
    return 0;
#endif
}

/* Which path this build took: 2 AVX-512 VNNI, 1 AVX2, 0 portable C. */
int arbor_quant_path(void) {
#if defined(QPATH_AVX512)
    return 2;
#elif defined(QPATH_AVX2)
    return 1;
#else
    return 0;
#endif
}
