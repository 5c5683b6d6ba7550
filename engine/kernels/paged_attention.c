/* Attention of queries over a paged KV cache, on the CPU: decodes, draft verification, and
 * (for batch invariance) prefill chunks.
 *
 * Reads each sequence's K/V blocks where they lie in the cache: the torch path
 * first gathers every context into a padded copy, and at 64 decoding sequences
 * that copy, not the arithmetic, was most of a step. One pass per KV head with an
 * online softmax in fp32; the query heads that share a KV head (grouped-query
 * attention) are served by the same pass over K and V.
 *
 * Consecutive queries of one sequence (a prefill chunk) form a tile that shares
 * each K/V block (converted to fp32 once, when the cache is bf16). Every query's arithmetic
 * is the same whatever its tile: `attend_block` folds one block into one
 * query's state, block after block in cache order, so a token's attention is
 * bit for bit the same computed alone (a decode) or in a chunk of any size.
 *
 * Layouts: q, out [num_queries, num_heads, head_dim]; k_cache, v_cache
 * [num_slots, num_kv_heads, head_dim], slot = block_id * block_size + offset;
 * block_tables [num_seqs, max_blocks]; query i belongs to sequence query_seq[i]
 * and sees context positions 0 .. visible[i] - 1.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16
#define MAX_BLOCK 64
#define LANES 8
#define TILE 8 /* queries sharing each K/V block */
/* Scores start from a finite floor (the build uses -ffast-math). */
#define FLOOR -1e30f

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));

static inline float load_f32(float x) { return x; }
static inline float store_f32(float x) { return x; }

/* One query's running softmax state for one KV head: its query heads, scaled. */
typedef struct {
    float q[MAX_GROUP][MAX_HEAD_DIM];
    float acc[MAX_GROUP][MAX_HEAD_DIM];
    float run_max[MAX_GROUP];
    float run_sum[MAX_GROUP];
} QueryState;

/* A block's keys and values for one KV head, in fp32: `k_row[p]`, `v_row[p]` point at
 * position p's key and value. An fp32 cache is read where it lies; a bf16 one is
 * converted into `k` and `v` first (a copy of an fp32 block cost a decode a fifth of
 * its time). */
typedef struct {
    float k[MAX_BLOCK][MAX_HEAD_DIM] __attribute__((aligned(64)));
    float v[MAX_BLOCK][MAX_HEAD_DIM] __attribute__((aligned(64)));
    const float *k_row[MAX_BLOCK];
    const float *v_row[MAX_BLOCK];
} Block;

static inline vec load_vec(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float sum_lanes(vec v) {
    float total = 0.0f;
    for (int lane = 0; lane < LANES; lane++) total += v[lane];
    return total;
}

/* q . k_p from the dims past the last full vector (none when head_dim is a multiple of
 * LANES, as in every model served here). */
static inline float tail_dot(const float *q, const float *k, int64_t from, int64_t head_dim) {
    float total = 0.0f;
    for (int64_t d = from; d < head_dim; d++) total += q[d] * k[d];
    return total;
}

/* score[p] = q . k_p for the block's positions: four positions at a time, each summed
 * LANES dims at a time and then across lanes, in a fixed order (every query sums the
 * same way; the four independent chains keep the FMA units busy). */
static void block_scores(const float *q, const Block *b, int64_t head_dim, int64_t n,
                         float *score) {
    int64_t full = head_dim - head_dim % LANES;
    int64_t p = 0;
    for (; p + 4 <= n; p += 4) {
        vec c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0};
        for (int64_t d = 0; d < full; d += LANES) {
            vec qd = load_vec(&q[d]);
            c0 += qd * load_vec(&b->k_row[p][d]);
            c1 += qd * load_vec(&b->k_row[p + 1][d]);
            c2 += qd * load_vec(&b->k_row[p + 2][d]);
            c3 += qd * load_vec(&b->k_row[p + 3][d]);
        }
        score[p] = sum_lanes(c0) + tail_dot(q, b->k_row[p], full, head_dim);
        score[p + 1] = sum_lanes(c1) + tail_dot(q, b->k_row[p + 1], full, head_dim);
        score[p + 2] = sum_lanes(c2) + tail_dot(q, b->k_row[p + 2], full, head_dim);
        score[p + 3] = sum_lanes(c3) + tail_dot(q, b->k_row[p + 3], full, head_dim);
    }
    for (; p < n; p++) {
        vec c = {0};
        for (int64_t d = 0; d < full; d += LANES) c += load_vec(&q[d]) * load_vec(&b->k_row[p][d]);
        score[p] = sum_lanes(c) + tail_dot(q, b->k_row[p], full, head_dim);
    }
}

/* acc += sum_p weight[p] * v_p, over the positions in order, LANES dims at a time with the
 * running sums held in registers (four vectors of dims per pass). */
static void accumulate_values(float *acc, const float *weight, const Block *b,
                              int64_t head_dim, int64_t n) {
    int64_t d0 = 0;
    for (; d0 + 4 * LANES <= head_dim; d0 += 4 * LANES) {
        vec a0 = load_vec(&acc[d0]), a1 = load_vec(&acc[d0 + LANES]);
        vec a2 = load_vec(&acc[d0 + 2 * LANES]), a3 = load_vec(&acc[d0 + 3 * LANES]);
        for (int64_t p = 0; p < n; p++) {
            const float *v = &b->v_row[p][d0];
            a0 += weight[p] * load_vec(v);
            a1 += weight[p] * load_vec(v + LANES);
            a2 += weight[p] * load_vec(v + 2 * LANES);
            a3 += weight[p] * load_vec(v + 3 * LANES);
        }
        memcpy(&acc[d0], &a0, sizeof a0);
        memcpy(&acc[d0 + LANES], &a1, sizeof a1);
        memcpy(&acc[d0 + 2 * LANES], &a2, sizeof a2);
        memcpy(&acc[d0 + 3 * LANES], &a3, sizeof a3);
    }
    for (; d0 < head_dim; d0++)
        for (int64_t p = 0; p < n; p++) acc[d0] += weight[p] * b->v_row[p][d0];
}

/* Fold n positions of a block into one query's state. Softmax weights and the V sum are
 * computed a block at a time, so the running maximum is rescaled once per block. */
static void attend_block(QueryState *s, int64_t group, int64_t head_dim, const Block *b,
                         int64_t n) {
    float score[MAX_BLOCK] __attribute__((aligned(64)));
    for (int64_t h = 0; h < group; h++) {
        block_scores(s->q[h], b, head_dim, n, score);
        float block_max = FLOOR;
        for (int64_t p = 0; p < n; p++) block_max = score[p] > block_max ? score[p] : block_max;
        if (block_max > s->run_max[h]) { /* rescale what was summed so far */
            float shrink = expf(s->run_max[h] - block_max);
            s->run_sum[h] *= shrink;
            for (int64_t d = 0; d < head_dim; d++) s->acc[h][d] *= shrink;
            s->run_max[h] = block_max;
        }
        for (int64_t p = 0; p < n; p++) {
            score[p] = expf(score[p] - s->run_max[h]);
            s->run_sum[h] += score[p];
        }
        accumulate_values(s->acc[h], score, b, head_dim, n);
    }
}

/* The length of the tile starting at query i: consecutive queries of one sequence. */
static int64_t tile_length(const int64_t *query_seq, int64_t i, int64_t num_queries) {
    int64_t len = 1;
    while (len < TILE && i + len < num_queries && query_seq[i + len] == query_seq[i]) len++;
    return len;
}

/* IN_PLACE: T is float, and the cache's rows are read where they lie. */
#define DEFINE_PAGED_ATTENTION(NAME, T, LOAD, STORE, IN_PLACE)                                 \
    int NAME(const T *q, const T *k_cache, const T *v_cache, T *out,                          \
             const int64_t *block_tables, int64_t max_blocks, const int64_t *query_seq,       \
             const int64_t *visible, int64_t num_queries, int64_t num_heads,                  \
             int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale) {       \
        int64_t group = num_heads / num_kv_heads;                                             \
        if (head_dim > MAX_HEAD_DIM || group > MAX_GROUP || block_size > MAX_BLOCK) return -1; \
        QueryState *states = malloc(TILE * sizeof(QueryState));                               \
        Block *b = aligned_alloc(64, sizeof(Block));                                          \
        if (states == NULL || b == NULL) {                                                    \
            free(states);                                                                     \
            free(b);                                                                          \
            return -2;                                                                        \
        }                                                                                     \
        for (int64_t i = 0; i < num_queries;) {                                               \
            int64_t len = tile_length(query_seq, i, num_queries);                             \
            const int64_t *table = block_tables + query_seq[i] * max_blocks;                  \
            int64_t max_visible = 0;                                                          \
            for (int64_t t = 0; t < len; t++)                                                 \
                max_visible = visible[i + t] > max_visible ? visible[i + t] : max_visible;    \
            for (int64_t g = 0; g < num_kv_heads; g++) {                                      \
                for (int64_t t = 0; t < len; t++) {                                           \
                    QueryState *s = &states[t];                                               \
                    for (int64_t h = 0; h < group; h++) {                                     \
                        const T *qh = q + ((i + t) * num_heads + g * group + h) * head_dim;   \
                        for (int64_t d = 0; d < head_dim; d++) {                              \
                            s->q[h][d] = LOAD(qh[d]) * scale;                                 \
                            s->acc[h][d] = 0.0f;                                              \
                        }                                                                     \
                        s->run_max[h] = FLOOR;                                                \
                        s->run_sum[h] = 0.0f;                                                 \
                    }                                                                         \
                }                                                                             \
                for (int64_t start = 0; start < max_visible; start += block_size) {            \
                    int64_t n = max_visible - start < block_size ? max_visible - start : block_size; \
                    int64_t base = table[start / block_size] * block_size;                    \
                    for (int64_t p = 0; p < n; p++) {                                         \
                        const T *kp = k_cache + ((base + p) * num_kv_heads + g) * head_dim;   \
                        const T *vp = v_cache + ((base + p) * num_kv_heads + g) * head_dim;   \
                        if (IN_PLACE) {                                                       \
                            b->k_row[p] = (const float *)kp;                                  \
                            b->v_row[p] = (const float *)vp;                                  \
                            continue;                                                         \
                        }                                                                     \
                        for (int64_t d = 0; d < head_dim; d++) {                              \
                            b->k[p][d] = LOAD(kp[d]);                                         \
                            b->v[p][d] = LOAD(vp[d]);                                         \
                        }                                                                     \
                        b->k_row[p] = b->k[p];                                                \
                        b->v_row[p] = b->v[p];                                                \
                    }                                                                         \
                    for (int64_t t = 0; t < len; t++) {                                       \
                        int64_t seen = visible[i + t] - start; /* this query's part */        \
                        if (seen > 0)                                                         \
                            attend_block(&states[t], group, head_dim, b, seen < n ? seen : n); \
                    }                                                                         \
                }                                                                             \
                for (int64_t t = 0; t < len; t++) {                                           \
                    QueryState *s = &states[t];                                               \
                    for (int64_t h = 0; h < group; h++) {                                     \
                        T *oh = out + ((i + t) * num_heads + g * group + h) * head_dim;       \
                        for (int64_t d = 0; d < head_dim; d++)                                \
                            oh[d] = STORE(s->acc[h][d] / s->run_sum[h]);                      \
                    }                                                                         \
                }                                                                             \
            }                                                                                 \
            i += len;                                                                         \
        }                                                                                     \
        free(states);                                                                         \
        free(b);                                                                              \
        return 0;                                                                             \
    }

DEFINE_PAGED_ATTENTION(paged_attention_f32, float, load_f32, store_f32, 1)
DEFINE_PAGED_ATTENTION(paged_attention_bf16, bf16, from_bf16, to_bf16, 0)
