/* Reductions across the 8 lanes of a 256-bit register, for the CPU kernels (AVX2). */
#ifndef TIERSERVE_LANES_H
#define TIERSERVE_LANES_H

#include <immintrin.h>
#include <stdint.h>

/* The largest of 8 floats (as max_ps compares: a NaN lane yields the other operand). */
static inline float max_of_8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* The exact sum of 8 int32 lanes. */
static inline int32_t sum_of_8(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

#endif
