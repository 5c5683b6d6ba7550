/* Rotary position embeddings on the CPU, in place on the fused QKV projection's output.
 *
 * torch rotates q and k with five ops each per layer (a negation, a concatenation,
 * two products and a sum), every one a dispatch and a pass over memory, at decode
 * sizes more than the arithmetic. This does both in one pass over each row.
 *
 * x [rows, row_stride]: each row's first num_heads heads of head_dim values are
 * rotated (q's heads then k's, the layout of the fused projection); cos, sin
 * [rows, head_dim] at each row's position. HF's rotate-half layout:
 *   out[i] = x[i] cos[i] - x[i + half] sin[i]      for i < half
 *   out[i] = x[i] cos[i] + x[i - half] sin[i]      for i >= half
 * with every product and the sum rounded where torch rounds them (to bf16 in bf16),
 * and no fused multiply-add (built with -ffp-contract=off), so the result is
 * torch's to the bit.
 */
#include <stdint.h>

#include "bf16.h"

#define MAX_HEAD_DIM 512

static inline float keep_f32(float f) { return f; }

/* ROUND: what torch's elementwise ops round each result to in this dtype. */
#define DEFINE_ROPE(NAME, T, LOAD, ROUND)                                                      \
    int NAME(T *x, const T *cos, const T *sin, int64_t rows, int64_t row_stride,               \
             int64_t num_heads, int64_t head_dim) {                                             \
        if (head_dim > MAX_HEAD_DIM || head_dim % 2) return -1;                                 \
        int64_t half = head_dim / 2;                                                            \
        float in[MAX_HEAD_DIM];                                                                 \
        for (int64_t r = 0; r < rows; r++) {                                                    \
            const T *c = cos + r * head_dim, *s = sin + r * head_dim;                           \
            for (int64_t h = 0; h < num_heads; h++) {                                           \
                T *head = x + r * row_stride + h * head_dim;                                    \
                for (int64_t i = 0; i < head_dim; i++) in[i] = LOAD(head[i]);                   \
                for (int64_t i = 0; i < head_dim; i++) {                                        \
                    float rotated = i < half ? -in[i + half] : in[i - half];                    \
                    float straight = LOAD(ROUND(in[i] * LOAD(c[i])));                           \
                    head[i] = ROUND(straight + LOAD(ROUND(rotated * LOAD(s[i]))));              \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        return 0;                                                                               \
    }

DEFINE_ROPE(rope_f32, float, keep_f32, keep_f32)
DEFINE_ROPE(rope_bf16, bf16, from_bf16, to_bf16)
