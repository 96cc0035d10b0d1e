// Ops 1 and 2: y = norm(v) * (1 + scale) + shift, where v = x, or v = residual + gate * x,
// stored first as residual_out and normalised as stored; with Y an FP8 format (fp8.cuh), y as
// FP8 rows and their scales y_scale (their _fp8 forms; static_scale nullptr: dynamic scales).
// Each element is read once and written once; the row stays in registers between the two.
#include "row_tile.cuh"

template <typename T, typename P, bool AFFINE, int ROW_THREADS, int CHUNKS, int BLOCK, int MIN_BLOCKS, typename Y>
__global__ void LAUNCH_BOUNDS(BLOCK, MIN_BLOCKS) modulated_norm(
    Rows x, Rows residual, Modulation gate, Modulation scale, Modulation shift, const P* __restrict__ weight, const P* __restrict__ bias,
    Y* __restrict__ y, T* __restrict__ residual_out, float* __restrict__ y_scale, const float* __restrict__ static_scale,
    float eps, long long rms, long long rows, long long tokens, long long hidden) {
    constexpr bool kQuantized = sizeof(Y) == 1;  // the FP8 formats are the only 1-byte outputs
    const RowPosition at = RowPosition::of_thread<ROW_THREADS, BLOCK, CHUNKS>(rows, tokens, hidden);
    Row<T, ROW_THREADS, CHUNKS> row;
    row.load(x, at);
    if (residual.data) add_residual(row, residual, ModulationRow<P>(gate, at.batch, at.token), at, hidden, residual_out);
    const RowStatistics statistics = row_statistics<BLOCK>(row, at, hidden, eps, rms != 0);
    const RowVector<P, ROW_THREADS, CHUNKS> weight_row(AFFINE ? weight : nullptr, at), bias_row(AFFINE ? bias : nullptr, at);
    const RowVector<P, ROW_THREADS, CHUNKS> scale_row(ModulationRow<P>(scale, at.batch, at.token), at);
    const RowVector<P, ROW_THREADS, CHUNKS> shift_row(ModulationRow<P>(shift, at.batch, at.token), at);
    QuantizedRow<Y, ROW_THREADS, CHUNKS> quantized;  // FP8: y waits here for the row's amax (else unused)
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
        if (!at.holds(i)) continue;
        float v[kChunk], s[kChunk], t[kChunk];
        normalized_chunk(row, i, statistics, weight_row, bias_row, v);
        scale_row.get(i, s);
        shift_row.get(i, t);
#pragma unroll
        for (int e = 0; e < kChunk; ++e) v[e] = v[e] * (1.0f + s[e]) + t[e];
        if constexpr (kQuantized) {
            quantized.set(i, v);
        } else {
            row.set(i, v);
            row.store(y + at.row * hidden, at, i);
        }
    }
    if constexpr (kQuantized) quantized.template store<BLOCK>(y, y_scale, static_scale, at, hidden);
}
