/* Attention of queries over a paged KV cache, on the CPU: decodes, draft verification, and
 * (for batch invariance) prefill chunks: each query is computed alone, in one fixed order
 * over the cache, so its result is the same whatever other queries share the call.
 *
 * Reads each sequence's K/V blocks where they lie in the cache: the torch path
 * first gathers every context into a padded copy, and at 64 decoding sequences
 * that copy, not the arithmetic, was most of a step. One pass per query and
 * KV head with an online softmax in fp32; the query heads that share a KV head
 * (grouped-query attention) are served by the same pass over K and V.
 *
 * Layouts: q, out [num_queries, num_heads, head_dim]; k_cache, v_cache
 * [num_slots, num_kv_heads, head_dim], slot = block_id * block_size + offset;
 * block_tables [num_seqs, max_blocks]; query i belongs to sequence query_seq[i]
 * and sees context positions 0 .. visible[i] - 1.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16

static inline float load_f32(float x) { return x; }
static inline float store_f32(float x) { return x; }

static inline float load_bf16(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t store_bf16(float f) { /* round to nearest even */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* Scores, softmax weights and the V sum are computed a block (block_size positions) at a
 * time, so the running maximum is rescaled once per block and the exponentials run as
 * one vectorizable loop. Scores start from a finite floor (the build uses -ffast-math). */
#define MAX_BLOCK 64
#define FLOOR -1e30f

#define DEFINE_PAGED_ATTENTION(NAME, T, LOAD, STORE)                                           \
    int NAME(const T *q, const T *k_cache, const T *v_cache, T *out,                          \
             const int64_t *block_tables, int64_t max_blocks, const int64_t *query_seq,       \
             const int64_t *visible, int64_t num_queries, int64_t num_heads,                  \
             int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale) {       \
        int64_t group = num_heads / num_kv_heads;                                             \
        if (head_dim > MAX_HEAD_DIM || group > MAX_GROUP || block_size > MAX_BLOCK) return -1; \
        float qs[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM];                      \
        float kf[MAX_BLOCK][MAX_HEAD_DIM], vf[MAX_BLOCK][MAX_HEAD_DIM];                       \
        float score[MAX_GROUP][MAX_BLOCK], run_max[MAX_GROUP], run_sum[MAX_GROUP];            \
        for (int64_t i = 0; i < num_queries; i++) {                                           \
            const int64_t *table = block_tables + query_seq[i] * max_blocks;                  \
            for (int64_t g = 0; g < num_kv_heads; g++) {                                      \
                for (int64_t h = 0; h < group; h++) {                                         \
                    const T *qh = q + (i * num_heads + g * group + h) * head_dim;             \
                    for (int64_t d = 0; d < head_dim; d++) {                                  \
                        qs[h][d] = LOAD(qh[d]) * scale;                                       \
                        acc[h][d] = 0.0f;                                                     \
                    }                                                                         \
                    run_max[h] = FLOOR;                                                       \
                    run_sum[h] = 0.0f;                                                        \
                }                                                                             \
                for (int64_t start = 0; start < visible[i]; start += block_size) {            \
                    int64_t n = visible[i] - start < block_size ? visible[i] - start : block_size; \
                    int64_t base = table[start / block_size] * block_size;                    \
                    for (int64_t p = 0; p < n; p++) {                                         \
                        const T *kp = k_cache + ((base + p) * num_kv_heads + g) * head_dim;   \
                        const T *vp = v_cache + ((base + p) * num_kv_heads + g) * head_dim;   \
                        for (int64_t d = 0; d < head_dim; d++) {                              \
                            kf[p][d] = LOAD(kp[d]);                                           \
                            vf[p][d] = LOAD(vp[d]);                                           \
                        }                                                                     \
                    }                                                                         \
                    for (int64_t h = 0; h < group; h++) {                                     \
                        float block_max = FLOOR;                                              \
                        for (int64_t p = 0; p < n; p++) {                                     \
                            float s = 0.0f;                                                   \
                            for (int64_t d = 0; d < head_dim; d++) s += qs[h][d] * kf[p][d];  \
                            score[h][p] = s;                                                  \
                            block_max = s > block_max ? s : block_max;                        \
                        }                                                                     \
                        if (block_max > run_max[h]) { /* rescale what was summed so far */    \
                            float shrink = expf(run_max[h] - block_max);                      \
                            run_sum[h] *= shrink;                                             \
                            for (int64_t d = 0; d < head_dim; d++) acc[h][d] *= shrink;       \
                            run_max[h] = block_max;                                           \
                        }                                                                     \
                        for (int64_t p = 0; p < n; p++) {                                     \
                            score[h][p] = expf(score[h][p] - run_max[h]);                     \
                            run_sum[h] += score[h][p];                                        \
                        }                                                                     \
                        for (int64_t p = 0; p < n; p++)                                       \
                            for (int64_t d = 0; d < head_dim; d++)                            \
                                acc[h][d] += score[h][p] * vf[p][d];                          \
                    }                                                                         \
                }                                                                             \
                for (int64_t h = 0; h < group; h++) {                                         \
                    T *oh = out + (i * num_heads + g * group + h) * head_dim;                 \
                    for (int64_t d = 0; d < head_dim; d++) oh[d] = STORE(acc[h][d] / run_sum[h]); \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        return 0;                                                                             \
    }

DEFINE_PAGED_ATTENTION(paged_attention_f32, float, load_f32, store_f32)
DEFINE_PAGED_ATTENTION(paged_attention_bf16, uint16_t, load_bf16, store_bf16)
