// Op 3 (Qwen-Image-Edit): LayerNorm with per-token modulation chosen from two [B, D] sets by
// index[b, s], optionally after residual_out = residual + residual_gate * x. gate_out gets the
// chosen gate so that the next call can take it as its residual_gate. With Y an FP8 format, y as
// FP8 rows and their scales y_scale, as modulated_norm.cu stores them (the op's _fp8 forms).
#include "row_tile.cuh"

template <typename T, typename P, bool AFFINE, int ROW_THREADS, int CHUNKS, int BLOCK, int MIN_BLOCKS, typename Y>
__global__ void LAUNCH_BOUNDS(BLOCK, MIN_BLOCKS) selected_modulation_norm(
    Rows x, Rows residual, Modulation residual_gate, Integers index,
    Modulation scale0, Modulation shift0, Modulation gate0, Modulation scale1, Modulation shift1, Modulation gate1,
    const P* __restrict__ weight, const P* __restrict__ bias, Y* __restrict__ y, T* __restrict__ residual_out, T* __restrict__ gate_out,
    float* __restrict__ y_scale, const float* __restrict__ static_scale, float eps, long long rows, long long tokens, long long hidden) {
    constexpr bool kQuantized = sizeof(Y) == 1;  // the FP8 formats are the only 1-byte outputs
    const RowPosition at = RowPosition::of_thread<ROW_THREADS, BLOCK, CHUNKS>(rows, tokens, hidden);
    Row<T, ROW_THREADS, CHUNKS> row;
    row.load(x, at);
    if (residual.data) {
        add_residual(row, residual, ModulationRow<P>(residual_gate, at.batch, at.token), at, hidden, residual_out);
    }
    const RowStatistics statistics = row_statistics<BLOCK>(row, at, hidden, eps, false);
    const bool second = at.valid && load_integer(index, at.batch, at.token) != 0;
    // rows of both sets, then chosen by value: choosing a kernel parameter or a local by reference
    // would move them to local memory
    const RowVector<P, ROW_THREADS, CHUNKS> weight_row(AFFINE ? weight : nullptr, at), bias_row(AFFINE ? bias : nullptr, at);
    const RowVector<P, ROW_THREADS, CHUNKS> scale_row(
        second ? ModulationRow<P>(scale1, at.batch, at.token) : ModulationRow<P>(scale0, at.batch, at.token), at);
    const RowVector<P, ROW_THREADS, CHUNKS> shift_row(
        second ? ModulationRow<P>(shift1, at.batch, at.token) : ModulationRow<P>(shift0, at.batch, at.token), at);
    const RowVector<P, ROW_THREADS, CHUNKS> gate_row(
        second ? ModulationRow<P>(gate1, at.batch, at.token) : ModulationRow<P>(gate0, at.batch, at.token), at);
    Row<T, ROW_THREADS, CHUNKS> chosen_gate;
    QuantizedRow<Y, ROW_THREADS, CHUNKS> quantized;  // FP8: y waits here for the row's amax (else unused)
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
        if (!at.holds(i)) continue;
        float v[kChunk], s[kChunk], t[kChunk], g[kChunk];
        normalized_chunk(row, i, statistics, weight_row, bias_row, v);
        scale_row.get(i, s);
        shift_row.get(i, t);
        gate_row.get(i, g);
#pragma unroll
        for (int e = 0; e < kChunk; ++e) v[e] = v[e] * (1.0f + s[e]) + t[e];
        if constexpr (kQuantized) {
            quantized.set(i, v);
        } else {
            row.set(i, v);
            row.store(y + at.row * hidden, at, i);
        }
        chosen_gate.set(i, g);
        chosen_gate.store(gate_out + at.row * hidden, at, i);
    }
    if constexpr (kQuantized) quantized.template store<BLOCK>(y, y_scale, static_scale, at, hidden);
}
