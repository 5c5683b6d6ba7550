/* Attention of queries over a paged KV cache, on the CPU: decodes, draft verification, and
 * (for batch invariance) prefill chunks.
 *
 * Reads each sequence's K/V rows where they lie in the cache (bf16 rows are widened to
 * fp32 in registers): the torch path first gathers every context into a padded copy,
 * and at 64 decoding sequences that copy, not the arithmetic, was most of a step.
 *
 * A quantized cache (engine/quant/kv.py) has rows of one-byte codes then the row's bf16
 * scale. Codes are widened to fp32 in registers (int8 by conversion, fp8 e4m3 by moving
 * its bits into an fp32's) and the scales are applied once per position, not per element:
 * a score is (q . codes) * k_scale, and a position's softmax weight is multiplied by its
 * v_scale before the values are summed, the same for every row. A row of 64 codes is 66
 * bytes against fp32's 256: a 16-sequence decode at 2,000 positions attended 1.9x faster
 * (one layer, one thread: 10.9 ms fp32, 5.8 ms int8, 6.0 ms fp8).
 *
 * Work is done a tile at a time: up to TILE consecutive queries of one sequence (a
 * prefill chunk; a decode is a tile of one) and one KV head. The tile's rows are the
 * query heads of its queries that share that KV head (grouped-query attention), and
 * all rows fold each K/V block into an online softmax in fp32 together, four rows by
 * four keys in registers, so a block read once serves every row.
 *
 * Batch invariance: every row's arithmetic is the same whatever tile it is in. A score
 * sums its products LANES dims at a time (with vdpbf16ps, two dims' products per lane,
 * where the cache is bf16 and the CPU has AVX-512 BF16) and then across lanes in one
 * fixed tree (`reduce4` sums four scores' lanes side by side, each in that tree); it is
 * scaled after. A row's softmax
 * covers the positions it sees, with the same vector chunks; positions a row does not
 * see but its tile does get weight exactly 0, and adding 0 * v leaves a sum's bits as
 * they were. The build has no -ffast-math (it would let the compiler reassociate those
 * sums differently in different places); exp is the polynomial `vexp`, the same code for
 * every row. So a token's attention is bit for bit the same computed alone (a decode)
 * or in a chunk of any size.
 *
 * Layouts: q, out [num_queries, num_heads, head_dim]; k_cache, v_cache
 * [num_slots, num_kv_heads, head_dim], slot = block_id * block_size + offset;
 * block_tables [num_seqs, max_blocks]; query i belongs to sequence query_seq[i]
 * and sees context positions 0 .. visible[i] - 1.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX512F__) || defined(__FMA__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
#if defined(__AVX512BF16__) && LANES == 16
#define BF16_DOT 1 /* bf16 scores by vdpbf16ps: two dims' products per fp32 lane, no widening */
#else
#define BF16_DOT 0
#endif
#define MAX_HEAD_DIM 256
#define MAX_GROUP 16
#define MAX_BLOCK 64
#define TILE 8 /* queries sharing each K/V block */
#define PREFETCH_BLOCKS 2 /* how far ahead of the block computed its successors are asked for */
#define MAX_ROWS (TILE * MAX_GROUP)
#define FLOOR -1e30f /* the score of a position a row does not see */
#define INLINE static inline __attribute__((always_inline))
/* Loops over a tile's rows, keys and vectors run in full, so their accumulators stay in
 * registers: left to itself GCC kept them on the stack (a cold 800-token chunk took twice
 * as long). */
#define UNROLL _Pragma("GCC unroll 4")

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef float vec4 __attribute__((vector_size(4 * sizeof(float))));
typedef uint16_t hvec __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint32_t uvec __attribute__((vector_size(LANES * sizeof(uint32_t))));

/* What a cache row holds: the query's floats, or one-byte codes then a bf16 scale. */
enum { CACHE_F32, CACHE_BF16, CACHE_I8, CACHE_FP8 };
#define QUANTIZED(cache) ((cache) >= CACHE_I8)

/* The running softmax of a tile's rows (row = query in tile * group + head in group). */
typedef struct {
    float q[MAX_ROWS][MAX_HEAD_DIM] __attribute__((aligned(64)));
    bf16 q16[MAX_ROWS][MAX_HEAD_DIM] __attribute__((aligned(64))); /* as given, for BF16_DOT */
    float scale; /* of every score */
    float acc[MAX_ROWS][MAX_HEAD_DIM] __attribute__((aligned(64)));
    float weight[MAX_ROWS][MAX_BLOCK] __attribute__((aligned(64))); /* scores, then exp */
    float run_max[MAX_ROWS];
    float run_sum[MAX_ROWS];
} Tile;

/* One KV head's rows of a block: `k[p]`, `v[p]` point at position p's key and value. */
typedef struct {
    const void *k[MAX_BLOCK];
    const void *v[MAX_BLOCK];
    float k_scale[MAX_BLOCK]; /* of a quantized cache's rows */
    float v_scale[MAX_BLOCK];
} Block;

INLINE vec load_f32(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE void store_f32(float *p, vec v) { memcpy(p, &v, sizeof v); }

/* a * b + c. The build fuses no multiply and add on its own (-ffp-contract=off: it fused
 * them in some unrolled copies of a loop and not in others, and a row's bits then depended
 * on its tile); where a fused one is wanted for speed it is asked for here, the same in
 * every copy. */
INLINE vec fmadd(vec a, vec b, vec c) {
#if LANES == 16
    return (vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    return (vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

/* LANES one-byte codes widened to int32 lanes, sign- or zero-extended: one instruction
 * where there are vectors (GCC turned the generic conversion of a byte vector into a byte
 * at a time, and int8 rows then read no faster than fp32 ones). */
INLINE ivec widen_codes(const void *codes, int is_signed) {
#if LANES == 16
    __m128i c = _mm_loadu_si128((const __m128i *)codes);
    return (ivec)(is_signed ? _mm512_cvtepi8_epi32(c) : _mm512_cvtepu8_epi32(c));
#elif defined(__AVX2__)
    __m128i c = _mm_loadl_epi64((const __m128i *)codes);
    return (ivec)(is_signed ? _mm256_cvtepi8_epi32(c) : _mm256_cvtepu8_epi32(c));
#else
    ivec x;
    for (int lane = 0; lane < LANES; lane++)
        x[lane] = is_signed ? ((const int8_t *)codes)[lane] : ((const uint8_t *)codes)[lane];
    return x;
#endif
}

/* LANES fp8 e4m3 codes as fp32: sign to bit 31, exponent and mantissa to bits 20-26, so
 * the fp32 holds the value times 2^-120 (its exponent bias is 127, e4m3's 7; a subnormal
 * code lands on an fp32 subnormal, which the multiply makes exact). Torch's decoding of
 * every code but the two NaNs (never written: quantization clamps to +-448). A lookup
 * through a 256-entry table by gather ran a long-context decode slower than fp32. */
INLINE vec decode_fp8(const uint8_t *codes) {
    uvec x = (uvec)widen_codes(codes, 0);
    return (vec)(((x & 0x80u) << 24) | ((x & 0x7fu) << 20)) * 0x1p120f;
}

/* LANES elements of a cache row from dim d on, widened to fp32 (codes unscaled). */
INLINE vec load_row(const void *row, int64_t d, int cache) {
    if (cache == CACHE_F32) return load_f32((const float *)row + d);
    if (cache == CACHE_I8) return __builtin_convertvector(widen_codes((const int8_t *)row + d, 1), vec);
    if (cache == CACHE_FP8) return decode_fp8((const uint8_t *)row + d);
#if LANES == 16 /* one widening load; GCC splits the generic conversion in two */
    __m256i h = _mm256_loadu_si256((const __m256i *)((const bf16 *)row + d));
    return (vec)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
#else
    hvec h;
    memcpy(&h, (const bf16 *)row + d, sizeof h);
    return (vec)(__builtin_convertvector(h, ivec) << 16);
#endif
}

INLINE float load_one(const void *row, int64_t d, int cache) {
    switch (cache) {
    case CACHE_F32: return ((const float *)row)[d];
    case CACHE_BF16: return from_bf16(((const bf16 *)row)[d]);
    case CACHE_I8: return (float)((const int8_t *)row)[d];
    default: {
        uint32_t x = ((const uint8_t *)row)[d], bits = ((x & 0x80u) << 24) | ((x & 0x7fu) << 20);
        float f;
        memcpy(&f, &bits, sizeof f);
        return f * 0x1p120f;
    }
    }
}

/* Bytes of one cache row (a token's K or V of one KV head): a quantized one ends in its scale. */
INLINE int64_t row_bytes(int64_t head_dim, int cache) {
    return cache == CACHE_F32 ? head_dim * 4 : cache == CACHE_BF16 ? head_dim * 2 : head_dim + 2;
}

/* e^x within a few ulp for x <= 0, exactly 0 below -87 (where fp32 has no normal result):
 * x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to r^6, times 2^n. */
INLINE vec vexp(vec x) {
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    vec n = (x * 1.44269504f + shifter) - shifter;
    vec r = (x - n * 0.693359375f) - n * -2.12194440e-4f; /* ln 2 in two parts */
    vec p = (vec){0} + 1.0f / 720;
    p = fmadd(p, r, (vec){0} + 1.0f / 120);
    p = fmadd(p, r, (vec){0} + 1.0f / 24);
    p = fmadd(p, r, (vec){0} + 1.0f / 6);
    p = fmadd(p, r, (vec){0} + 0.5f);
    p = fmadd(p, r, (vec){0} + 1.0f);
    p = fmadd(p, r, (vec){0} + 1.0f);
    ivec scale = (__builtin_convertvector(n, ivec) + 127) << 23;
    vec result = p * (vec)scale;
    return (vec)((ivec)result & (ivec)(x >= -87.0f));
}

/* Four vectors' lane sums, each by the tree lane i + lane i + half, half = LANES / 2, ..., 1
 * (the same adds whichever vectors share the call). */
INLINE vec4 reduce4(vec a0, vec a1, vec a2, vec a3) {
#if LANES == 16
    vec x01 = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
              __builtin_shufflevector(a0, a1, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    vec x23 = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
              __builtin_shufflevector(a2, a3, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    vec y = __builtin_shufflevector(x01, x23, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
            __builtin_shufflevector(x01, x23, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    vec z = __builtin_shufflevector(y, y, 0, 1, 4, 5, 8, 9, 12, 13, 0, 1, 4, 5, 8, 9, 12, 13) +
            __builtin_shufflevector(y, y, 2, 3, 6, 7, 10, 11, 14, 15, 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(z, z, 0, 2, 4, 6) + __builtin_shufflevector(z, z, 1, 3, 5, 7);
#else
    vec x01 = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 8, 9, 10, 11) +
              __builtin_shufflevector(a0, a1, 4, 5, 6, 7, 12, 13, 14, 15);
    vec x23 = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 8, 9, 10, 11) +
              __builtin_shufflevector(a2, a3, 4, 5, 6, 7, 12, 13, 14, 15);
    vec y = __builtin_shufflevector(x01, x23, 0, 1, 4, 5, 8, 9, 12, 13) +
            __builtin_shufflevector(x01, x23, 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(y, y, 0, 2, 4, 6) + __builtin_shufflevector(y, y, 1, 3, 5, 7);
#endif
}

INLINE float reduce1(vec a) { return reduce4(a, a, a, a)[0]; }

/* q . k over dims [from, to), past the last whole vector. One compiled copy for every
 * score: inlined, the compiler vectorized it across four keys in some places and not in
 * others, and fused its multiply-adds differently there. */
__attribute__((noinline)) static float tail_dot(const float *q, const void *k, int64_t from,
                                                int64_t to, int cache) {
    float total = 0.0f;
    for (int64_t d = from; d < to; d++) total += q[d] * load_one(k, d, cache);
    return total;
}

/* weight[r][p] = q_r . k_p, scaled, for `rows` rows from r0 and `keys` (4 or 1) positions
 * from p0. */
INLINE void score_tile(Tile *t, int64_t r0, int rows, const Block *b, int64_t p0, int keys,
                       int64_t head_dim, int cache) {
    vec acc[4][4] = {{{0}}};
    int dot16 = BF16_DOT && cache == CACHE_BF16;
    int64_t step = dot16 ? 2 * LANES : LANES;
    int64_t full = head_dim - head_dim % step;
    for (int64_t d = 0; d < full; d += step) {
#if BF16_DOT
        if (dot16) {
            __m512bh k[4];
            UNROLL for (int j = 0; j < keys; j++)
                k[j] = (__m512bh)_mm512_loadu_si512((const bf16 *)b->k[p0 + j] + d);
            UNROLL for (int i = 0; i < rows; i++) {
                __m512bh q = (__m512bh)_mm512_load_si512(&t->q16[r0 + i][d]);
                UNROLL for (int j = 0; j < keys; j++)
                    acc[i][j] = (vec)_mm512_dpbf16_ps((__m512)acc[i][j], q, k[j]);
            }
            continue;
        }
#endif
        vec k[4];
        UNROLL for (int j = 0; j < keys; j++) k[j] = load_row(b->k[p0 + j], d, cache);
        UNROLL for (int i = 0; i < rows; i++) {
            vec q = load_f32(&t->q[r0 + i][d]);
            UNROLL for (int j = 0; j < keys; j++) acc[i][j] = fmadd(q, k[j], acc[i][j]);
        }
    }
    UNROLL for (int i = 0; i < rows; i++) {
        float *score = &t->weight[r0 + i][p0];
        vec4 sums = {0};
        if (keys == 4)
            sums = reduce4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
        else
            sums[0] = reduce1(acc[i][0]);
        for (int j = 0; j < keys && full < head_dim; j++)
            sums[j] += tail_dot(t->q[r0 + i], b->k[p0 + j], full, head_dim, cache);
        if (QUANTIZED(cache)) {
            vec4 k_scale = {1.0f, 1.0f, 1.0f, 1.0f};
            memcpy(&k_scale, &b->k_scale[p0], keys * sizeof(float));
            sums *= k_scale;
        }
        sums *= t->scale;
        memcpy(score, &sums, keys * sizeof(float));
    }
}

/* acc[r] += sum_p weight[r][p] * v_p over the block's n positions in order, for `rows` rows
 * from r0 and `vecs` vectors of dims from d0 (held in registers across the positions). */
INLINE void accumulate_tile(Tile *t, int64_t r0, int rows, const Block *b, int64_t n,
                            int64_t d0, int vecs, int cache) {
    vec acc[4][4];
    UNROLL for (int i = 0; i < rows; i++)
        UNROLL for (int c = 0; c < vecs; c++) acc[i][c] = load_f32(&t->acc[r0 + i][d0 + c * LANES]);
    for (int64_t p = 0; p < n; p++) {
        vec v[4];
        UNROLL for (int c = 0; c < vecs; c++) v[c] = load_row(b->v[p], d0 + c * LANES, cache);
        UNROLL for (int i = 0; i < rows; i++) {
            float w = t->weight[r0 + i][p];
            UNROLL for (int c = 0; c < vecs; c++) acc[i][c] = fmadd((vec){0} + w, v[c], acc[i][c]);
        }
    }
    UNROLL for (int i = 0; i < rows; i++)
        UNROLL for (int c = 0; c < vecs; c++) store_f32(&t->acc[r0 + i][d0 + c * LANES], acc[i][c]);
}

/* Scores of `rows` rows from r0 against the block's n positions, four keys at a time. */
INLINE void score_rows(Tile *t, int64_t r0, int rows, const Block *b, int64_t n,
                       int64_t head_dim, int cache) {
    int64_t p = 0;
    for (; p + 4 <= n; p += 4) score_tile(t, r0, rows, b, p, 4, head_dim, cache);
    for (; p < n; p++) score_tile(t, r0, rows, b, p, 1, head_dim, cache);
}

/* CALL(r0, rows) over every row: four at a time, then the 3, 2 or 1 left, each call with a
 * constant row count so that its loops unroll. */
#define FOR_ROW_GROUPS(num_rows, CALL)                                \
    do {                                                              \
        int64_t r0_ = 0;                                              \
        for (; r0_ + 4 <= (num_rows); r0_ += 4) CALL(r0_, 4);         \
        switch ((int)((num_rows) - r0_)) {                            \
        case 3: CALL(r0_, 3); break;                                  \
        case 2: CALL(r0_, 2); break;                                  \
        case 1: CALL(r0_, 1); break;                                  \
        }                                                             \
    } while (0)

/* Scores of every row against the block's n positions, four rows by four keys at a time. */
INLINE void score_block(Tile *t, int64_t num_rows, const Block *b, int64_t n, int64_t head_dim,
                        int cache) {
#define SCORE_ROWS(r0, rows) score_rows(t, r0, rows, b, n, head_dim, cache)
    FOR_ROW_GROUPS(num_rows, SCORE_ROWS);
#undef SCORE_ROWS
}

/* Row r's scores over the `seen` positions it sees become softmax weights against its running
 * maximum (what was summed before is rescaled when the maximum grows); weights of the
 * block's other positions, up to n, are 0. */
INLINE void softmax_row(Tile *t, int64_t r, int64_t head_dim, int64_t seen, int64_t n) {
    float *w = t->weight[r];
    int64_t chunks = (seen + LANES - 1) / LANES;
    for (int64_t p = seen; p < chunks * LANES; p++) w[p] = FLOOR;
    vec maxima = (vec){0} + FLOOR;
    for (int64_t c = 0; c < chunks; c++) {
        vec chunk = load_f32(&w[c * LANES]);
        ivec greater = (ivec)(chunk > maxima); /* C has no vector ?: */
        maxima = (vec)(((ivec)chunk & greater) | ((ivec)maxima & ~greater));
    }
    float block_max = FLOOR;
    for (int lane = 0; lane < LANES; lane++) block_max = maxima[lane] > block_max ? maxima[lane] : block_max;
    if (block_max > t->run_max[r]) {
        float shrink = vexp((vec){0} + (t->run_max[r] - block_max))[0];
        t->run_sum[r] *= shrink;
        for (int64_t d = 0; d < head_dim; d++) t->acc[r][d] *= shrink;
        t->run_max[r] = block_max;
    }
    vec total = {0};
    for (int64_t c = 0; c < chunks; c++) {
        vec e = vexp(load_f32(&w[c * LANES]) - t->run_max[r]);
        store_f32(&w[c * LANES], e);
        total += e;
    }
    t->run_sum[r] += reduce1(total);
    for (int64_t p = chunks * LANES; p < n; p++) w[p] = 0.0f;
}

/* The block's values into the sums of `rows` rows from r0, over the first `full` dims. */
INLINE void accumulate_rows(Tile *t, int64_t r0, int rows, const Block *b, int64_t n,
                            int64_t full, int cache) {
    int64_t d = 0;
    for (; d + 4 * LANES <= full; d += 4 * LANES) accumulate_tile(t, r0, rows, b, n, d, 4, cache);
    for (; d < full; d += LANES) accumulate_tile(t, r0, rows, b, n, d, 1, cache);
}

/* The block's values into every row's sum, four rows at a time, 4 * LANES dims at a time. */
INLINE void accumulate_block(Tile *t, int64_t num_rows, const Block *b, int64_t n,
                             int64_t head_dim, int cache) {
    int64_t full = head_dim - head_dim % LANES;
#define ACCUMULATE_ROWS(r0, rows) accumulate_rows(t, r0, rows, b, n, full, cache)
    FOR_ROW_GROUPS(num_rows, ACCUMULATE_ROWS);
#undef ACCUMULATE_ROWS
    for (int64_t r = 0; r < num_rows; r++)
        for (int64_t d = full; d < head_dim; d++)
            for (int64_t p = 0; p < n; p++)
                t->acc[r][d] += t->weight[r][p] * load_one(b->v[p], d, cache);
}

/* This thread's tile, allocated at its first call and kept: a fresh one per call came from
 * mmap, and faulting its pages in cost a decode step more than its arithmetic. */
static Tile *thread_tile(void) {
    static __thread Tile *tile = NULL;
    if (tile == NULL) tile = aligned_alloc(64, sizeof(Tile));
    return tile;
}

/* The length of the tile starting at query i: consecutive queries of one sequence. */
static int64_t tile_length(const int64_t *query_seq, int64_t i, int64_t num_queries) {
    int64_t len = 1;
    while (len < TILE && i + len < num_queries && query_seq[i + len] == query_seq[i]) len++;
    return len;
}

/* The tile's rows for KV head g: its queries' heads g * group .. (g + 1) * group - 1. */
INLINE void start_tile(Tile *t, const void *q, int64_t i, int64_t len, int64_t g, int64_t group,
                       int64_t num_heads, int64_t head_dim, float scale, int q_bf16) {
    t->scale = scale;
    for (int64_t r = 0; r < len * group; r++) {
        int64_t head = (i + r / group) * num_heads + g * group + r % group;
        for (int64_t d = 0; d < head_dim; d++) {
            t->q[r][d] = q_bf16 ? from_bf16(((const bf16 *)q)[head * head_dim + d])
                                : ((const float *)q)[head * head_dim + d];
            if (BF16_DOT && q_bf16) t->q16[r][d] = ((const bf16 *)q)[head * head_dim + d];
            t->acc[r][d] = 0.0f;
        }
        t->run_max[r] = FLOOR;
        t->run_sum[r] = 0.0f;
    }
}

INLINE void finish_tile(const Tile *t, void *out, int64_t i, int64_t len, int64_t g,
                        int64_t group, int64_t num_heads, int64_t head_dim, int q_bf16) {
    for (int64_t r = 0; r < len * group; r++) {
        int64_t head = (i + r / group) * num_heads + g * group + r % group;
        for (int64_t d = 0; d < head_dim; d++) {
            float value = t->acc[r][d] / t->run_sum[r];
            if (q_bf16)
                ((bf16 *)out)[head * head_dim + d] = to_bf16(value);
            else
                ((float *)out)[head * head_dim + d] = value;
        }
    }
}

/* Asks the memory for a block's K and V rows, every KV head's. A layer's attention finds
 * its context cold (the linears between two layers stream the weights through every
 * cache): 16 decodes, whose context was flushed from the caches first, took 0.35-0.41 ms
 * a layer without these requests and 0.21-0.24 ms with them. */
INLINE void prefetch_block(const char *k_cache, const char *v_cache, int64_t block,
                           int64_t block_bytes) {
    for (int64_t line = 0; line < block_bytes; line += 64) {
        __builtin_prefetch(k_cache + block * block_bytes + line, 0, 3);
        __builtin_prefetch(v_cache + block * block_bytes + line, 0, 3);
    }
}

/* One tile and KV head, block by block up to the farthest position a query of it sees. */
INLINE void attend_tile(Tile *t, Block *b, const char *k_cache, const char *v_cache,
                        const int64_t *table, const int64_t *visible, int64_t len, int64_t g,
                        int64_t group, int64_t num_kv_heads, int64_t head_dim,
                        int64_t block_size, int cache) {
    int64_t row = row_bytes(head_dim, cache);
    int64_t max_visible = 0;
    for (int64_t q = 0; q < len; q++) max_visible = visible[q] > max_visible ? visible[q] : max_visible;
    for (int64_t start = 0; start < max_visible; start += block_size) {
        int64_t n = max_visible - start < block_size ? max_visible - start : block_size;
        int64_t base = table[start / block_size] * block_size;
        for (int64_t p = 0; p < n; p++) {
            b->k[p] = k_cache + ((base + p) * num_kv_heads + g) * row;
            b->v[p] = v_cache + ((base + p) * num_kv_heads + g) * row;
            if (QUANTIZED(cache)) {
                b->k_scale[p] = load_one((const char *)b->k[p] + head_dim, 0, CACHE_BF16);
                b->v_scale[p] = load_one((const char *)b->v[p] + head_dim, 0, CACHE_BF16);
            }
        }
        int64_t ahead = start / block_size + PREFETCH_BLOCKS; /* the first KV head's pass */
        if (g == 0 && ahead * block_size < max_visible)
            prefetch_block(k_cache, v_cache, table[ahead], block_size * num_kv_heads * row);
        score_block(t, len * group, b, n, head_dim, cache);
        for (int64_t r = 0; r < len * group; r++) {
            int64_t seen = visible[r / group] - start;
            softmax_row(t, r, head_dim, seen < 0 ? 0 : seen < n ? seen : n, n);
            if (QUANTIZED(cache)) /* run_sum has the weights; the values want them scaled */
                for (int64_t p = 0; p < n; p++) t->weight[r][p] *= b->v_scale[p];
        }
        accumulate_block(t, len * group, b, n, head_dim, cache);
    }
}

/* Queries [from, to) on this thread. */
INLINE int attend_queries(const void *q, const void *k_cache, const void *v_cache, void *out,
                          const int64_t *block_tables, int64_t max_blocks,
                          const int64_t *query_seq, const int64_t *visible, int64_t from,
                          int64_t to, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t block_size, float scale, int q_bf16, int cache) {
    int64_t group = num_heads / num_kv_heads;
    Tile *t = thread_tile();
    if (t == NULL) return 1;
    Block b;
    for (int64_t i = from; i < to;) {
        int64_t len = tile_length(query_seq, i, to);
        const int64_t *table = block_tables + query_seq[i] * max_blocks;
        int64_t block_bytes = block_size * num_kv_heads * row_bytes(head_dim, cache);
        int64_t tile_visible = visible[i + len - 1]; /* a tile's last query sees the most */
        for (int64_t ahead = 0; ahead < PREFETCH_BLOCKS && ahead * block_size < tile_visible; ahead++)
            prefetch_block(k_cache, v_cache, table[ahead], block_bytes);
        for (int64_t g = 0; g < num_kv_heads; g++) {
            start_tile(t, q, i, len, g, group, num_heads, head_dim, scale, q_bf16);
            attend_tile(t, &b, k_cache, v_cache, table, visible + i, len, g, group, num_kv_heads,
                        head_dim, block_size, cache);
            finish_tile(t, out, i, len, g, group, num_heads, head_dim, q_bf16);
        }
        i += len;
    }
    return 0;
}

/* Every query, the ranges between consecutive `bounds` on the threads of an OpenMP team
 * (torch's own: see engine/kernels/native.py). 0, or -1 for shapes past the limits, -2
 * when a thread could not get its tile's memory. */
INLINE int paged_attention(const void *q, const void *k_cache, const void *v_cache, void *out,
                           const int64_t *block_tables, int64_t max_blocks,
                           const int64_t *query_seq, const int64_t *visible,
                           const int64_t *bounds, int64_t num_ranges, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                           float scale, int q_bf16, int cache) {
    if (head_dim > MAX_HEAD_DIM || num_heads / num_kv_heads > MAX_GROUP || block_size > MAX_BLOCK)
        return -1;
    int failed = 0;
#pragma omp parallel for schedule(static, 1) num_threads(num_ranges) reduction(| : failed)
    for (int64_t r = 0; r < num_ranges; r++)
        failed |= attend_queries(q, k_cache, v_cache, out, block_tables, max_blocks, query_seq,
                                 visible, bounds[r], bounds[r + 1], num_heads, num_kv_heads,
                                 head_dim, block_size, scale, q_bf16, cache);
    return failed ? -2 : 0;
}

/* One entry point per query dtype and cache format, each compiled for its constants. */
#define ENTRY_POINT(NAME, Q_BF16, CACHE)                                                       \
    int NAME(const void *q, const void *k_cache, const void *v_cache, void *out,              \
             const int64_t *block_tables, int64_t max_blocks, const int64_t *query_seq,       \
             const int64_t *visible, const int64_t *bounds, int64_t num_ranges,               \
             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,   \
             float scale) {                                                                   \
        return paged_attention(q, k_cache, v_cache, out, block_tables, max_blocks, query_seq, \
                               visible, bounds, num_ranges, num_heads, num_kv_heads,          \
                               head_dim, block_size, scale, Q_BF16, CACHE);                   \
    }

ENTRY_POINT(paged_attention_f32, 0, CACHE_F32)
ENTRY_POINT(paged_attention_bf16, 1, CACHE_BF16)
ENTRY_POINT(paged_attention_f32_i8, 0, CACHE_I8)
ENTRY_POINT(paged_attention_bf16_i8, 1, CACHE_I8)
ENTRY_POINT(paged_attention_f32_fp8, 0, CACHE_FP8)
ENTRY_POINT(paged_attention_bf16_fp8, 1, CACHE_FP8)
