/* bf16 <-> fp32 for the CPU kernels: a bf16 is the top 16 bits of an fp32. */
#ifndef TIERSERVE_BF16_H
#define TIERSERVE_BF16_H

#include <stdint.h>
#include <string.h>

typedef uint16_t bf16;

static inline float from_bf16(bf16 v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Rounded to nearest even, as torch rounds; a NaN stays a (quiet) NaN. */
static inline bf16 to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (bf16)((bits >> 16) | 0x0040u);
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (bf16)(bits >> 16);
}

#endif
