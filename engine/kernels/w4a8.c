/* W4A8 matmul on the CPU: 4-bit weights times 8-bit activations, integer dot products,
 * and its W8A8 sibling for the layers a mixed-precision config keeps at INT8 (at the end).
 *
 * Weight-only INT4 with float activations spends its time de-quantizing: every
 * weight becomes a float before it is multiplied. Here the activations are
 * quantized instead (per row and per weight group, to int8, which is cheap: M rows,
 * not N), and the 4-bit codes meet them in AVX2's integer multiply-adds, 64
 * products per two instructions. Each group's integer sum is scaled into a float
 * accumulator once:
 *
 *   y[m, n] = sum_g a[m, g] * (s[g, n] * (dot_g(q[n], xq[m]) - 8 sum_g(xq[m]))
 *                              + z[g, n] * sum_g(xq[m]))
 *
 * for the weight value (q - 8) * s + z and a[m, g] the activation group's scale.
 * The centring (- 8 sum) is done in exact integers: in floats it would cancel two
 * large terms. Every output row's arithmetic is the same whatever
 * else shares the call (integer sums are exact; the float steps come in one fixed
 * order), so results do not depend on the batch: the engine's batch invariance.
 *
 * Layouts. x [M, K] fp32. The weight, for each block of R output rows, holds K / 8
 * chunks of 4 R bytes: byte 4 r + j of chunk c has row r's code for input 8 c + j in
 * its low nibble and for input 8 c + 4 + j in its high nibble, so one load and two
 * masks give two registers of R rows x 4 inputs, the shape of a 4-product dot.
 * scales and zeros [K / G, N] fp32. out [M, N] fp32.
 *
 * Width. With AVX-512 VNNI a block is R = 16 rows, one 512-bit register: each
 * vpdpbusd then does 64 products, and the unpacking, the activation broadcasts and
 * the per-group float steps are paid once per 16 outputs instead of per 8 (at 64
 * activation rows, 1.6x bf16 against 1.1x for 8-row blocks in 256-bit registers, on
 * a Zen 4 core). Elsewhere R = 8 in 256-bit registers: each dot is one vpdpbusd with
 * AVX-VNNI, else AVX2's maddubs + madd + add. Every path gives the same exact int32
 * sums (no pair sum here can saturate maddubs' int16) and the same float steps, so
 * the outputs are bit for bit the same whichever was built; only the layout differs
 * (`w4a8_rows_per_block`).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "lanes.h"

#ifndef __AVX2__
#error "the W4A8 kernel needs AVX2 (the engine falls back to its torch path)"
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* 16 output rows a block, in 512-bit registers */
#define HAS_VNNI 1
#define ROWS_PER_BLOCK 16
typedef __m512i vint;
typedef __m512 vfloat;
#define LOAD_I(p) _mm512_loadu_si512((const void *)(p))
#define LOAD_F(p) _mm512_loadu_ps(p)
#define STORE_F(p, v) _mm512_storeu_ps((p), (v))
#define ZERO_I() _mm512_setzero_si512()
#define ZERO_F() _mm512_setzero_ps()
#define SET1_8(v) _mm512_set1_epi8(v)
#define SET1_32(v) _mm512_set1_epi32(v)
#define SET1_F(v) _mm512_set1_ps(v)
#define AND(a, b) _mm512_and_si512((a), (b))
#define SHIFT_RIGHT_16(a, n) _mm512_srli_epi16((a), (n))
#define ADD_32(a, b) _mm512_add_epi32((a), (b))
#define SUB_32(a, b) _mm512_sub_epi32((a), (b))
#define ABS_8(a) _mm512_abs_epi8(a)
/* x with each byte negated where w's is negative (AVX-512 has no vpsignb; where w is 0
 * the product is 0 anyway, as |w| is) */
#define SIGN_LIKE_8(x, w) \
    _mm512_mask_sub_epi8((x), _mm512_movepi8_mask(w), _mm512_setzero_si512(), (x))
#define MUL_F(a, b) _mm512_mul_ps((a), (b))
#define FMADD_F(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define TO_FLOAT(a) _mm512_cvtepi32_ps(a)
#define DPBUSD(acc, u, s) _mm512_dpbusd_epi32((acc), (u), (s))
#else
/* 8 output rows a block, in 256-bit registers */
#define ROWS_PER_BLOCK 8
typedef __m256i vint;
typedef __m256 vfloat;
#define LOAD_I(p) _mm256_loadu_si256((const __m256i *)(p))
#define LOAD_F(p) _mm256_loadu_ps(p)
#define STORE_F(p, v) _mm256_storeu_ps((p), (v))
#define ZERO_I() _mm256_setzero_si256()
#define ZERO_F() _mm256_setzero_ps()
#define SET1_8(v) _mm256_set1_epi8(v)
#define SET1_32(v) _mm256_set1_epi32(v)
#define SET1_F(v) _mm256_set1_ps(v)
#define AND(a, b) _mm256_and_si256((a), (b))
#define SHIFT_RIGHT_16(a, n) _mm256_srli_epi16((a), (n))
#define ADD_32(a, b) _mm256_add_epi32((a), (b))
#define SUB_32(a, b) _mm256_sub_epi32((a), (b))
#define ABS_8(a) _mm256_abs_epi8(a)
#define SIGN_LIKE_8(x, w) _mm256_sign_epi8((x), (w))
#define MUL_F(a, b) _mm256_mul_ps((a), (b))
#define FMADD_F(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define TO_FLOAT(a) _mm256_cvtepi32_ps(a)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define HAS_VNNI 1
#define DPBUSD(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#elif defined(__AVXVNNI__)
#define HAS_VNNI 1
#define DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32((acc), (u), (s))
#else
#define HAS_VNNI 0
#endif
#endif

#define INPUTS_PER_CHUNK 8
#define CHUNK_BYTES (4 * ROWS_PER_BLOCK)
#define MAX_TILE 4 /* activation rows sharing each weight chunk (more measured slower) */

/* One group of activations (a multiple of 8) -> int8 codes; returns their sum. The
 * rounding is the CPU's default, to nearest even, as nearbyintf and torch.round. */
static inline int32_t quantize_group(const float *xs, int64_t group, float inv, int8_t *qs) {
    const __m256 vinv = _mm256_set1_ps(inv);
    const __m256i high = _mm256_set1_epi32(127), low = _mm256_set1_epi32(-127);
    __m256i sum = _mm256_setzero_si256();
    for (int64_t i = 0; i < group; i += 8) {
        __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xs + i), vinv));
        q = _mm256_min_epi32(_mm256_max_epi32(q, low), high);
        sum = _mm256_add_epi32(sum, q);
        __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q, q), _mm256_setzero_si256());
        int32_t first = _mm256_extract_epi32(bytes, 0), second = _mm256_extract_epi32(bytes, 4);
        memcpy(qs + i, &first, 4);
        memcpy(qs + i + 4, &second, 4);
    }
    return sum_of_8(sum);
}

/* x [m, k] -> int8 codes xq [m, k], and per (row, group) the scale a = max|x| / 127 and
 * the codes' sum. A group of zeros gets scale 0. Vectorized: at 64 rows the quantizing
 * was a fifth of the INT4 layers' time when it ran element by element. */
void w4a8_quantize(const float *x, int64_t m, int64_t k, int64_t group, int8_t *xq, float *a,
                   int32_t *sums) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    int64_t num_groups = k / group;
    for (int64_t row = 0; row < m; row++) {
        for (int64_t g = 0; g < num_groups; g++) {
            const float *xs = x + row * k + g * group;
            __m256 vmax = _mm256_setzero_ps();
            for (int64_t i = 0; i < group; i += 8)
                vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(xs + i), magnitude));
            float amax = max_of_8(vmax);
            float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            sums[row * num_groups + g] = quantize_group(xs, group, inv, xq + row * k + g * group);
            a[row * num_groups + g] = amax / 127.0f;
        }
    }
}

/* 1 where the dot products below run on VNNI, 0 on AVX2's multiply-adds. */
int w4a8_uses_vnni(void) { return HAS_VNNI; }

/* Output rows per weight block: the layout this build reads (16 or 8). */
int w4a8_rows_per_block(void) { return ROWS_PER_BLOCK; }

/* acc + per int32 lane the sum of 4 products unsigned u8 x signed s8. The caller keeps
 * each pair sum within int16, so the AVX2 path's saturating maddubs never saturates. */
static inline vint dot4_accumulate(vint acc, vint u, vint s) {
#if HAS_VNNI
    return DPBUSD(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                   _mm256_set1_epi16(1)));
#endif
}

static inline vint broadcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return SET1_32(v);
}

/* `tile` activation rows (starting at row0) times one block of ROWS_PER_BLOCK weight rows. Inlined
 * per tile size, so the accumulators live in registers. */
static inline __attribute__((always_inline)) void block_tile(
    const int8_t *xq, const float *a, const int32_t *sums, const uint8_t *w, const float *scales,
    const float *zeros, float *out, int64_t n, int64_t k, int64_t group, int64_t block,
    int64_t row0, int tile) {
    const vint low_nibbles = SET1_8(0x0F);
    int64_t num_groups = k / group, chunks_per_group = group / INPUTS_PER_CHUNK;
    vfloat acc[MAX_TILE];
    for (int r = 0; r < tile; r++) acc[r] = ZERO_F();
    for (int64_t g = 0; g < num_groups; g++) {
        /* Two accumulators a row (low and high nibbles): independent chains of dot
         * products, so their latency hides behind each other. */
        vint dot_lo[MAX_TILE], dot_hi[MAX_TILE];
        for (int r = 0; r < tile; r++) dot_lo[r] = dot_hi[r] = ZERO_I();
        for (int64_t ch = g * chunks_per_group; ch < (g + 1) * chunks_per_group; ch++) {
            vint packed = LOAD_I(w + ch * CHUNK_BYTES);
            vint lo = AND(packed, low_nibbles);
            vint hi = AND(SHIFT_RIGHT_16(packed, 4), low_nibbles);
            for (int r = 0; r < tile; r++) {
                const int8_t *xs = xq + (row0 + r) * k + ch * INPUTS_PER_CHUNK;
                /* codes 0..15 times int8 codes: pair sums stay within int16 */
                dot_lo[r] = dot4_accumulate(dot_lo[r], lo, broadcast4(xs));
                dot_hi[r] = dot4_accumulate(dot_hi[r], hi, broadcast4(xs + 4));
            }
        }
        vfloat s = LOAD_F(scales + g * n + block * ROWS_PER_BLOCK);
        vfloat z = LOAD_F(zeros + g * n + block * ROWS_PER_BLOCK);
        for (int r = 0; r < tile; r++) {
            int64_t ag = (row0 + r) * num_groups + g;
            vint dot = ADD_32(dot_lo[r], dot_hi[r]);
            vint centred = SUB_32(dot, SET1_32(8 * sums[ag]));
            vfloat sa = MUL_F(s, SET1_F(a[ag]));
            acc[r] = FMADD_F(TO_FLOAT(centred), sa, acc[r]);
            acc[r] = FMADD_F(z, SET1_F(a[ag] * (float)sums[ag]), acc[r]);
        }
    }
    for (int r = 0; r < tile; r++)
        STORE_F(out + (row0 + r) * n + block * ROWS_PER_BLOCK, acc[r]);
}

/* tile_call(row0, tile) over m activation rows: tiles of MAX_TILE, then the rest, the tile
 * size a constant at every call so each inlined copy keeps its accumulators in registers. */
#define FOR_EACH_TILE(m, tile_call)                                                  \
    do {                                                                             \
        int64_t row0 = 0;                                                            \
        for (; row0 + MAX_TILE <= (m); row0 += MAX_TILE) tile_call(row0, MAX_TILE); \
        switch ((m) - row0) {                                                        \
            case 3: tile_call(row0, 3); break;                                       \
            case 2: tile_call(row0, 2); break;                                       \
            case 1: tile_call(row0, 1); break;                                       \
            default: break;                                                          \
        }                                                                            \
    } while (0)

/* out = dequantized x @ W^T, its output blocks split over `threads` of the OpenMP
 * team (torch's own). Each weight block is read from memory once and reused from
 * cache by every tile of activation rows. */
void w4a8_matmul(const int8_t *xq, const float *a, const int32_t *sums, const uint8_t *w,
                 const float *scales, const float *zeros, float *out, int64_t m, int64_t n,
                 int64_t k, int64_t group, int64_t threads) {
    int64_t block_bytes = (k / INPUTS_PER_CHUNK) * CHUNK_BYTES;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t block = 0; block < n / ROWS_PER_BLOCK; block++) {
        const uint8_t *wb = w + block * block_bytes;
#define INT4_TILE(row0, tile) \
    block_tile(xq, a, sums, wb, scales, zeros, out, n, k, group, block, row0, tile)
        FOR_EACH_TILE(m, INT4_TILE);
#undef INT4_TILE
    }
}

/* ---- W8A8: INT8 weights (one scale per output row) times the same int8 activations ----
 *
 *   y[m, n] = s[n] * sum_g a[m, g] * dot_g(w[n], xq[m])
 *
 * Layout: for each block of R output rows, K / 4 chunks of 4 R bytes: byte 4 r + j of
 * chunk c is row r's weight for input 4 c + j. Both operands are signed, and a 4-product
 * dot wants one unsigned:
 * - with VNNI (no saturation), the activations ride shifted to unsigned, x + 128, against
 *   the weights as they are, and 128 times each group's weight sum (`offsets`
 *   [K / group, N], from the repack) comes off the exact int32 sum after: one dot
 *   product per row and chunk;
 * - on AVX2's maddubs, whose int16 pair sums saturate, the weight's magnitude meets the
 *   activation carrying the weight's sign (|w| <= 128, |xq| <= 127: a pair sum stays
 *   within int16).
 * Both give the same exact integer sums. */
#define INT8_INPUTS_PER_CHUNK 4

static inline __attribute__((always_inline)) void int8_block_tile(
    const uint8_t *xu, const int8_t *xq, const float *a, const int8_t *w, const int32_t *offsets,
    const float *scales, float *out, int64_t n, int64_t k, int64_t group, int64_t block,
    int64_t row0, int tile) {
    int64_t num_groups = k / group, chunks_per_group = group / INT8_INPUTS_PER_CHUNK;
    vfloat acc[MAX_TILE];
    for (int r = 0; r < tile; r++) acc[r] = ZERO_F();
    for (int64_t g = 0; g < num_groups; g++) {
        vint dot[MAX_TILE];
        for (int r = 0; r < tile; r++) dot[r] = ZERO_I();
        for (int64_t ch = g * chunks_per_group; ch < (g + 1) * chunks_per_group; ch++) {
            vint weights = LOAD_I(w + ch * CHUNK_BYTES);
#if HAS_VNNI
            for (int r = 0; r < tile; r++) {
                int64_t at = (row0 + r) * k + ch * INT8_INPUTS_PER_CHUNK;
                dot[r] = DPBUSD(dot[r], broadcast4((const int8_t *)xu + at), weights);
            }
#else
            vint magnitude = ABS_8(weights); /* -128 reads as unsigned 128 */
            for (int r = 0; r < tile; r++) {
                const int8_t *xs = xq + (row0 + r) * k + ch * INT8_INPUTS_PER_CHUNK;
                vint signed_x = SIGN_LIKE_8(broadcast4(xs), weights);
                dot[r] = dot4_accumulate(dot[r], magnitude, signed_x);
            }
#endif
        }
#if HAS_VNNI
        vint offset = LOAD_I(offsets + g * n + block * ROWS_PER_BLOCK);
        for (int r = 0; r < tile; r++) dot[r] = SUB_32(dot[r], offset);
#endif
        for (int r = 0; r < tile; r++) {
            vfloat ag = SET1_F(a[(row0 + r) * num_groups + g]);
            acc[r] = FMADD_F(TO_FLOAT(dot[r]), ag, acc[r]);
        }
    }
    vfloat s = LOAD_F(scales + block * ROWS_PER_BLOCK);
    for (int r = 0; r < tile; r++)
        STORE_F(out + (row0 + r) * n + block * ROWS_PER_BLOCK, MUL_F(acc[r], s));
}

/* out = dequantized x @ W^T, split and tiled as in w4a8_matmul. Returns 0, or -1 when
 * the shifted activations could not be allocated (nothing computed). */
int w8a8_matmul(const int8_t *xq, const float *a, const int8_t *w, const int32_t *offsets,
                const float *scales, float *out, int64_t m, int64_t n, int64_t k, int64_t group,
                int64_t threads) {
    int64_t block_bytes = (k / INT8_INPUTS_PER_CHUNK) * CHUNK_BYTES;
    uint8_t *xu = NULL;
#if HAS_VNNI
    xu = malloc((size_t)(m * k));
    if (xu == NULL) return -1;
    for (int64_t i = 0; i < m * k; i++) xu[i] = (uint8_t)xq[i] ^ 0x80; /* x + 128 */
#endif
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t block = 0; block < n / ROWS_PER_BLOCK; block++) {
        const int8_t *wb = w + block * block_bytes;
#define INT8_TILE(row0, tile) \
    int8_block_tile(xu, xq, a, wb, offsets, scales, out, n, k, group, block, row0, tile)
        FOR_EACH_TILE(m, INT8_TILE);
#undef INT8_TILE
    }
    free(xu);
    return 0;
}
