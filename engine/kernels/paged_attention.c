/* Attention of short queries (decodes, draft verification) over a paged KV cache, on the CPU.
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

#define DEFINE_PAGED_ATTENTION(NAME, T, LOAD, STORE)                                           \
    int NAME(const T *q, const T *k_cache, const T *v_cache, T *out,                          \
             const int64_t *block_tables, int64_t max_blocks, const int64_t *query_seq,       \
             const int64_t *visible, int64_t num_queries, int64_t num_heads,                  \
             int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale) {       \
        int64_t group = num_heads / num_kv_heads;                                             \
        if (head_dim > MAX_HEAD_DIM || group > MAX_GROUP) return -1;                          \
        float qs[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM];                      \
        float kf[MAX_HEAD_DIM], vf[MAX_HEAD_DIM], run_max[MAX_GROUP], run_sum[MAX_GROUP];     \
        for (int64_t i = 0; i < num_queries; i++) {                                           \
            const int64_t *table = block_tables + query_seq[i] * max_blocks;                  \
            for (int64_t g = 0; g < num_kv_heads; g++) {                                      \
                for (int64_t h = 0; h < group; h++) {                                         \
                    const T *qh = q + (i * num_heads + g * group + h) * head_dim;             \
                    for (int64_t d = 0; d < head_dim; d++) {                                  \
                        qs[h][d] = LOAD(qh[d]) * scale;                                       \
                        acc[h][d] = 0.0f;                                                     \
                    }                                                                         \
                    run_max[h] = -INFINITY;                                                   \
                    run_sum[h] = 0.0f;                                                        \
                }                                                                             \
                for (int64_t pos = 0; pos < visible[i]; pos++) {                              \
                    int64_t slot = table[pos / block_size] * block_size + pos % block_size;   \
                    const T *kp = k_cache + (slot * num_kv_heads + g) * head_dim;             \
                    const T *vp = v_cache + (slot * num_kv_heads + g) * head_dim;             \
                    for (int64_t d = 0; d < head_dim; d++) {                                  \
                        kf[d] = LOAD(kp[d]);                                                  \
                        vf[d] = LOAD(vp[d]);                                                  \
                    }                                                                         \
                    for (int64_t h = 0; h < group; h++) {                                     \
                        float score = 0.0f;                                                   \
                        for (int64_t d = 0; d < head_dim; d++) score += qs[h][d] * kf[d];     \
                        if (score > run_max[h]) { /* rescale what was summed so far */        \
                            float shrink = expf(run_max[h] - score);                          \
                            run_sum[h] *= shrink;                                             \
                            for (int64_t d = 0; d < head_dim; d++) acc[h][d] *= shrink;       \
                            run_max[h] = score;                                               \
                        }                                                                     \
                        float weight = expf(score - run_max[h]);                              \
                        run_sum[h] += weight;                                                 \
                        for (int64_t d = 0; d < head_dim; d++) acc[h][d] += weight * vf[d];   \
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
