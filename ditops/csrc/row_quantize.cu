// quantize_fp8: y = act(x) as FP8 rows of format Y (fp8.cuh) and their scales y_scale, act the
// identity or GELU's tanh approximation (static_scale nullptr: dynamic scales). x is read once,
// the row held in registers until its amax is known, y and one scale per row written once.
// PREFIX: a row of y is cat([prefix, act(x)]), hidden = prefix_width + D values, each chunk read
// from the one tensor that holds it (prefix_width % kChunk == 0: no chunk straddles the two), so
// the amax covers both parts and the concatenation is never in memory.
#include "row_tile.cuh"

// 0.5 v (1 + tanh(z)) = v / (1 + exp(-2 z)), z = sqrt(2 / pi) (v + 0.044715 v^3), as the Triton
// kernel computes it: exp(-2 z) = 2^(v (a v^2 + b)), a and b holding -2 sqrt(2 / pi) (0.044715, 1)
// / ln 2, and 1 / d as rsqrt(d)^2 (d >= 1): IEEE math per value would make the 12288-wide MLP rows
// compute-bound. v = -Inf gives NaN, as the definition does.
__device__ inline float gelu_tanh(float v) {
    const float root = rsqrtf(1.0f + exp2f(v * (v * v * -0.1029432395800235f - 2.302208198144325f)));
    return v * root * root;
}

template <typename T, typename Y, bool GELU, bool PREFIX, int ROW_THREADS, int CHUNKS, int BLOCK, int MIN_BLOCKS>
__global__ void LAUNCH_BOUNDS(BLOCK, MIN_BLOCKS) row_quantize(Rows x, Rows prefix, long long prefix_width,
                                                              Y* __restrict__ y, float* __restrict__ y_scale,
                                                              const float* __restrict__ static_scale, long long rows,
                                                              long long tokens, long long hidden) {
    const RowPosition at = RowPosition::of_thread<ROW_THREADS, BLOCK, CHUNKS>(rows, tokens, hidden);
    Row<T, ROW_THREADS, CHUNKS> row;
    if constexpr (PREFIX) {
        row.load_joined(prefix, x, prefix_width, at);
    } else {
        row.load(x, at);
    }
    QuantizedRow<Y, ROW_THREADS, CHUNKS> quantized;
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
        if (!at.holds(i)) continue;
        float v[kChunk];
        row.get(i, v);
        if constexpr (GELU) {
            if (!PREFIX || at.column<ROW_THREADS>(i) >= prefix_width) {  // the prefix is quantised as it is
#pragma unroll
                for (int e = 0; e < kChunk; ++e) v[e] = gelu_tanh(v[e]);
            }
        }
        quantized.set(i, v);
    }
    quantized.template store<BLOCK>(y, y_scale, static_scale, at, hidden);
}
