/* The normalized Hadamard transform of each row (engine/quant/kv.py `rotate`), over blocks
 * of `block` values (a power of two dividing the row), in fp32.
 *
 * An int8 KV cache rotates a layer's queries, keys, values and output in every step: the
 * torch path spends ~20 small ops on each, and in a long-context decode step those ops
 * cost more than a fifth of attention. Here each row is one pass of butterflies in a fixed
 * order (a + b, a - b, then the scale), the same operations as the torch reference, so
 * the result is bit for bit the reference's and never depends on the other rows.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

static void butterflies(float *row, int64_t dim, int64_t block, float scale) {
    for (int64_t start = 0; start < dim; start += block) {
        float *y = row + start;
        for (int64_t half = 1; half < block; half *= 2)
            for (int64_t i = 0; i < block; i += 2 * half)
                for (int64_t j = i; j < i + half; j++) {
                    float low = y[j], high = y[j + half];
                    y[j] = low + high;
                    y[j + half] = low - high;
                }
    }
    for (int64_t i = 0; i < dim; i++) row[i] *= scale;
}

void hadamard(const float *x, int64_t rows, int64_t dim, int64_t block, float scale, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        float *row = out + r * dim;
        for (int64_t i = 0; i < dim; i++) row[i] = x[r * dim + i];
        butterflies(row, dim, block, scale);
    }
}

void hadamard_bf16(const bf16 *x, int64_t rows, int64_t dim, int64_t block, float scale,
                   bf16 *out) {
    float row[dim];
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < dim; i++) row[i] = from_bf16(x[r * dim + i]);
        butterflies(row, dim, block, scale);
        for (int64_t i = 0; i < dim; i++) out[r * dim + i] = to_bf16(row[i]);
    }
}
