/* FP8 (e4m3) weights times float activations on the CPU: one byte a weight read, decoded
 * in registers.
 *
 * Expanded to the model's dtype at load, an FP8 checkpoint computes as fast as a bf16 one:
 * every weight is read as two bytes. At a decode step's few rows a matmul is bound by
 * those reads, so here the codes stay one byte and are decoded where they are used:
 *
 *   y[m, n] = sum_g s[n, g] * sum_{k in g} x[m, k] * e4m3(code[n, k]) * 2^8
 *
 * with s the checkpoint's scale (per tensor, output channel or block: a group g is a run
 * of input channels sharing one, the whole row for per-channel scales) times 2^-8, see
 * `decode`.
 *
 * Decoding. A code's byte, sign-extended to 16 bits and shifted left by 7, has the sign
 * in bit 15 (and again in bit 14, cleared) and the exponent and mantissa in bits 7-13: an
 * fp16 whose value is the e4m3 value times 2^-8 (fp16's exponent bias is 15, e4m3's 7).
 * e4m3 subnormals land on fp16 subnormals, which the conversion to fp32 (F16C) makes
 * exact: every code but the two NaNs (never stored: a quantizer clamps to +-448) decodes
 * to torch's value in three integer instructions and one conversion.
 *
 * Layout. codes [N / R, K, R]: for each block of R output rows, input k's R codes side by
 * side, one load. scales [N / R, G, R] fp32. x [M, K] fp32, out [M, N] fp32. R is 16
 * (512-bit registers) with AVX-512, else 8.
 *
 * At many rows the fp32 multiply-adds bound the matmul, where oneDNN's bf16 kernels do two
 * products an instruction: a step of 32 sequences ran at ~0.8x the dense model's speed. A
 * bf16-pair path (vdpbf16ps, the codes widened to fp32 and narrowed to bf16 pairs in
 * registers) measured slower still here (AMD EPYC, AVX-512 BF16): 0.42-0.46x oneDNN at 16-64
 * rows against this path's 0.46-0.55x.
 *
 * Batch invariance. Every output sums its products in one fixed order whatever else is in
 * the call: four partial sums over k mod 4 (independent chains, so the multiply-adds'
 * latency hides), added in a fixed order at the end of each group, then scaled into the
 * row's total. Up to MAX_TILE activation rows share each decoded chunk; a row's
 * arithmetic is the same in a tile of any size. No -ffast-math, no contraction the code
 * does not ask for.
 */
#include <immintrin.h>
#include <stdint.h>

#if !defined(__AVX2__) || !defined(__F16C__) || !defined(__FMA__)
#error "the FP8 kernel needs AVX2, F16C and FMA (the engine keeps FP8 weights dense otherwise)"
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define ROWS_PER_BLOCK 16
#define MAX_TILE 6 /* 24 partial sums and 4 decoded inputs of 32 registers (4 measured slower) */
typedef __m512 vfloat;
#define ZERO_F() _mm512_setzero_ps()
#define SET1_F(v) _mm512_set1_ps(v)
#define LOAD_F(p) _mm512_loadu_ps(p)
#define STORE_F(p, v) _mm512_storeu_ps((p), (v))
#define FMADD_F(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define ADD_F(a, b) _mm512_add_ps((a), (b))
static inline __attribute__((always_inline)) vfloat decode(const int8_t *codes) {
    __m256i wide = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)codes));
    __m256i half = _mm256_and_si256(_mm256_slli_epi16(wide, 7), _mm256_set1_epi16(-16385));
    return _mm512_cvtph_ps(half);
}
#else
#define ROWS_PER_BLOCK 8
#define MAX_TILE 2 /* 16 registers: four partial sums a row */
typedef __m256 vfloat;
#define ZERO_F() _mm256_setzero_ps()
#define SET1_F(v) _mm256_set1_ps(v)
#define LOAD_F(p) _mm256_loadu_ps(p)
#define STORE_F(p, v) _mm256_storeu_ps((p), (v))
#define FMADD_F(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define ADD_F(a, b) _mm256_add_ps((a), (b))
static inline __attribute__((always_inline)) vfloat decode(const int8_t *codes) {
    __m128i wide = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)codes));
    __m128i half = _mm_and_si128(_mm_slli_epi16(wide, 7), _mm_set1_epi16(-16385));
    return _mm256_cvtph_ps(half);
}
#endif

#define PARTIALS 4 /* inputs k, k+1, k+2, k+3 go to partial sums 0..3: groups take 4j inputs */

int fp8_rows_per_block(void) { return ROWS_PER_BLOCK; }

/* `tile` activation rows from row0 against one block of R output rows (codes w, scales s). */
static inline __attribute__((always_inline)) void block_tile(
    const float *x, const int8_t *w, const float *s, float *out, int64_t n, int64_t k,
    int64_t group, int64_t block, int64_t row0, int tile) {
    vfloat total[MAX_TILE];
    for (int r = 0; r < tile; r++) total[r] = ZERO_F();
    for (int64_t g = 0; g < k / group; g++) {
        vfloat part[MAX_TILE][PARTIALS];
        for (int r = 0; r < tile; r++)
            for (int p = 0; p < PARTIALS; p++) part[r][p] = ZERO_F();
        for (int64_t i = g * group; i < (g + 1) * group; i += PARTIALS) {
            for (int p = 0; p < PARTIALS; p++) {
                vfloat weights = decode(w + (i + p) * ROWS_PER_BLOCK);
                for (int r = 0; r < tile; r++)
                    part[r][p] = FMADD_F(weights, SET1_F(x[(row0 + r) * k + i + p]), part[r][p]);
            }
        }
        vfloat scale = LOAD_F(s + g * ROWS_PER_BLOCK);
        for (int r = 0; r < tile; r++) {
            vfloat sum = ADD_F(ADD_F(part[r][0], part[r][1]), ADD_F(part[r][2], part[r][3]));
            total[r] = FMADD_F(sum, scale, total[r]);
        }
    }
    for (int r = 0; r < tile; r++) STORE_F(out + (row0 + r) * n + block * ROWS_PER_BLOCK, total[r]);
}

/* A remainder of `rows`, a constant; 1 where MAX_TILE leaves no such remainder (never run).
 * MAX_TILE is at most 6. */
#define SHORT_TILE(rows) ((rows) < MAX_TILE ? (rows) : 1)

/* tile_call(row0, tile) over m activation rows: tiles of MAX_TILE, then the rest, the tile
 * size a constant at every call so each inlined copy keeps its sums in registers. */
#define FOR_EACH_TILE(m, tile_call)                                   \
    do {                                                              \
        int64_t row0 = 0;                                             \
        for (; row0 + MAX_TILE <= (m); row0 += MAX_TILE)              \
            tile_call(row0, MAX_TILE);                                \
        switch ((m) - row0) {                                         \
        case 5: tile_call(row0, SHORT_TILE(5)); break;                \
        case 4: tile_call(row0, SHORT_TILE(4)); break;                \
        case 3: tile_call(row0, SHORT_TILE(3)); break;                \
        case 2: tile_call(row0, SHORT_TILE(2)); break;                \
        case 1: tile_call(row0, 1); break;                            \
        default: break;                                               \
        }                                                             \
    } while (0)

/* out [M, N] = x [M, K] @ W^T. Output blocks are split over torch's OpenMP threads. */
void fp8_matmul(const float *x, const int8_t *codes, const float *scales, float *out, int64_t m,
                int64_t n, int64_t k, int64_t group, int64_t threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t block = 0; block < n / ROWS_PER_BLOCK; block++) {
        const int8_t *w = codes + block * k * ROWS_PER_BLOCK;
        const float *s = scales + block * (k / group) * ROWS_PER_BLOCK;
#define FP32_TILE(row0, tile) block_tile(x, w, s, out, n, k, group, block, row0, tile)
        FOR_EACH_TILE(m, FP32_TILE);
#undef FP32_TILE
    }
}
