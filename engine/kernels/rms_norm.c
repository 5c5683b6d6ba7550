/* RMSNorm on the CPU, fused with the residual add before it: one pass over a row where
 * torch runs several small ops (each with its own dispatch, tens of microseconds apiece
 * in a decode step, more than the arithmetic at these sizes). The fused form works in
 * place, so a step allocates nothing for its norms.
 *
 * fp32 or bf16, row-major [rows, dim]. Each row is computed alone in a fixed order, so a
 * row's result does not depend on the batch around it. bf16 rows are normalised in fp32
 * and rounded where torch's bf16 path rounds (the sum, the normalised row, the product
 * with the weight), so the kernel matches the reference it replaces. Rows are split over
 * `threads` of torch's OpenMP threads; a row is computed the same on any of them.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

#define LANES 8 /* independent partial sums: the compiler vectorizes them without reassociating */

static float mean_square(const float *x, int64_t dim) {
    float partial[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= dim; i += LANES)
        for (int j = 0; j < LANES; j++) partial[j] += x[i + j] * x[i + j];
    float sum = 0.0f;
    for (int j = 0; j < LANES; j++) sum += partial[j];
    for (; i < dim; i++) sum += x[i] * x[i];
    return sum / (float)dim;
}

static void scale_row(const float *x, const float *weight, float inv, int64_t dim, float *out) {
    for (int64_t i = 0; i < dim; i++) out[i] = weight[i] * (x[i] * inv);
}

/* out = weight * x / sqrt(mean(x^2) + eps), per row. */
void rms_norm(const float *x, const float *weight, float eps, int64_t rows, int64_t dim,
              float *out, int64_t threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        scale_row(xr, weight, 1.0f / sqrtf(mean_square(xr, dim) + eps), dim, out + r * dim);
    }
}

/* residual += x, then x = rms_norm(residual): a pre-norm block's skip connection and the
 * next norm in one pass, in place (the caller is done with both inputs). */
void add_rms_norm(float *restrict x, float *restrict residual, const float *restrict weight,
                  float eps, int64_t rows, int64_t dim, int64_t threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * dim, *sr = residual + r * dim;
        for (int64_t i = 0; i < dim; i++) sr[i] += xr[i];
        scale_row(sr, weight, 1.0f / sqrtf(mean_square(sr, dim) + eps), dim, xr);
    }
}

/* ---- bf16 ---- */

/* out = weight * bf16(row * inv), each product rounded to bf16. */
static void scale_row_bf16(const float *row, const bf16 *weight, float inv, int64_t dim,
                           bf16 *out) {
    for (int64_t i = 0; i < dim; i++)
        out[i] = to_bf16(from_bf16(weight[i]) * from_bf16(to_bf16(row[i] * inv)));
}

void rms_norm_bf16(const bf16 *x, const bf16 *weight, float eps, int64_t rows, int64_t dim,
                   bf16 *out, int64_t threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        float row[dim];
        for (int64_t i = 0; i < dim; i++) row[i] = from_bf16(x[r * dim + i]);
        scale_row_bf16(row, weight, 1.0f / sqrtf(mean_square(row, dim) + eps), dim, out + r * dim);
    }
}

void add_rms_norm_bf16(bf16 *restrict x, bf16 *restrict residual, const bf16 *restrict weight,
                       float eps, int64_t rows, int64_t dim, int64_t threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        float row[dim];
        bf16 *xr = x + r * dim, *sr = residual + r * dim;
        for (int64_t i = 0; i < dim; i++) {
            sr[i] = to_bf16(from_bf16(sr[i]) + from_bf16(xr[i]));
            row[i] = from_bf16(sr[i]);
        }
        scale_row_bf16(row, weight, 1.0f / sqrtf(mean_square(row, dim) + eps), dim, xr);
    }
}
