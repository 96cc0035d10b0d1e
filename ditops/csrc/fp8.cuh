// The FP8 formats of the *_fp8 ops' outputs (docs/ops.md section 7), and a conversion to them
// from float written with integer and float arithmetic alone: ROCm 5.2 has no FP8 header, and
// CUDA's converts to OCP e4m3 only. portability.cuh includes this header and specialises
// fp8_pair_bits where the hardware converts; tests/test_fp8_conversion.py compiles it for the host
// and checks float_to_fp8_bits against torch's casts. Needs __device__, __float_as_uint,
// __uint_as_float and fminf from its includer.
#pragma once

// OCP e4m3 (NVIDIA sm_89 and newer, AMD gfx950): bias 7, no infinities, NaN 0x7f, largest 448.
struct float8_e4m3fn {
    unsigned char bits;
    static constexpr int kBias = 7;
    static constexpr float kMax = 448.0f;
    static constexpr unsigned kNaN = 0x7fu;
    static constexpr bool kNegativeZero = true;
};

// MI300's variant (gfx942): bias 8, no infinities, no negative zero, one NaN 0x80, largest 240.
struct float8_e4m3fnuz {
    unsigned char bits;
    static constexpr int kBias = 8;
    static constexpr float kMax = 240.0f;
    static constexpr unsigned kNaN = 0x80u;
    static constexpr bool kNegativeZero = false;
};

// value's bits in F, rounded to nearest even, saturating to +-F::kMax (infinities too, as
// CUDA's __NV_SATFINITE); NaN gives F's NaN.
template <typename F>
__device__ inline unsigned float_to_fp8_bits(float value) {
    const unsigned bits = __float_as_uint(value);
    const unsigned absolute = bits & 0x7fffffffu;
    if (absolute > 0x7f800000u) return F::kNaN;
    const float magnitude = fminf(__uint_as_float(absolute), F::kMax);
    unsigned code;
    if (magnitude < __uint_as_float((127u + 1u - F::kBias) << 23)) {
        // Subnormal: added to 2^(21 - bias), whose last mantissa bit weighs one subnormal step
        // (2^(-2 - bias)), the float adder rounds to the nearest even step; the difference of
        // the bits is the step count, 8 (the smallest normal's code) where it rounds up to it.
        const float steps = __uint_as_float((127u + 21u - F::kBias) << 23);
        code = __float_as_uint(magnitude + steps) - __float_as_uint(steps);
    } else {
        // Normal: the exponent and the top 3 mantissa bits are bits 20-30, rounded to nearest
        // even at bit 20 (a carry moves to the exponent), then rebiased.
        const unsigned rounded = __float_as_uint(magnitude) + 0x7ffffu + ((__float_as_uint(magnitude) >> 20) & 1u);
        code = (rounded >> 20) - ((127u - F::kBias) << 3);
    }
    const unsigned sign = F::kNegativeZero || code != 0 ? (bits >> 24) & 0x80u : 0u;
    return code | sign;
}

// The conversion the kernels use, two values at a time (a's code in the low byte): this one
// unless the platform specialises it for a format its hardware converts to (portability.cuh),
// which converts pairs in one instruction.
template <typename F>
__device__ inline unsigned fp8_pair_bits(float a, float b) { return float_to_fp8_bits<F>(a) | float_to_fp8_bits<F>(b) << 8; }
