/* SwiGLU's middle on the CPU: silu(gate) * up over a fused gate/up projection's rows, in
 * bf16, in one pass into a dense output.
 *
 * torch spends two ops on it (silu in place, then the product), each converting bf16 to
 * fp32 and back, and leaves the result in the strided gate half, which the down
 * projection reads again. Here silu comes from a table of every bf16 input's silu that
 * torch itself computed (65,536 fp32 entries, 256 KB), so it is torch's to the bit by
 * construction; the product is rounded to bf16 once, as torch's bf16 multiply rounds.
 * Rows are split over `threads` of torch's OpenMP threads.
 */
#include <stdint.h>

#include "bf16.h"

/* out[r][i] = bf16(silu(gate[r][i]) * up[r][i]), where row r of `gate_up` is [gate | up],
 * each `width` wide, and `silu_table[g]` is silu of the bf16 whose bits are g. */
void silu_mul_bf16(const bf16 *gate_up, const float *silu_table, int64_t rows, int64_t width,
                   bf16 *out, int64_t threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        const bf16 *gate = gate_up + r * 2 * width, *up = gate + width;
        bf16 *row = out + r * width;
        for (int64_t i = 0; i < width; i++)
            row[i] = to_bf16(silu_table[gate[i]] * from_bf16(up[i]));
    }
}
