// Op 4 (Z-Image "sandwich" norm): out = x + act(gate) * norm(branch), act = identity or tanh,
// stored in x's dtype; then optionally y = norm2(out) * (1 + scale), reading out as stored, with
// Y an FP8 format as FP8 rows and their scales y_scale, as modulated_norm.cu stores them (the _fp8 form).
// Its two input rows and two output rows move with the streaming cache hint (read or written
// once): each row is touched once, so keeping it in L2 only evicts data that is reused.
// modulated_norm keeps default-policy loads and stores, where the same hints were slower.
#include "row_tile.cuh"

template <typename T, typename P, bool AFFINE, int ROW_THREADS, int CHUNKS, int BLOCK, int MIN_BLOCKS, typename Y>
__global__ void LAUNCH_BOUNDS(BLOCK, MIN_BLOCKS) gated_add_norm(
    Rows x, Rows branch, Modulation gate, Modulation scale, const P* __restrict__ weight, const P* __restrict__ bias, const P* __restrict__ weight2,
    const P* __restrict__ bias2, T* __restrict__ out, Y* __restrict__ y, float* __restrict__ y_scale, const float* __restrict__ static_scale,
    float eps, long long rms, long long tanh_gate, long long rows, long long tokens, long long hidden) {
    constexpr bool kQuantized = sizeof(Y) == 1;  // the FP8 formats are the only 1-byte outputs
    const RowPosition at = RowPosition::of_thread<ROW_THREADS, BLOCK, CHUNKS>(rows, tokens, hidden);
    Row<T, ROW_THREADS, CHUNKS> row, residual;
    row.template load<true>(branch, at);
    residual.template load<true>(x, at);  // loaded early: its latency hides behind the norm
    const RowStatistics statistics = row_statistics<BLOCK>(row, at, hidden, eps, rms != 0);
    const RowVector<P, ROW_THREADS, CHUNKS> weight_row(AFFINE ? weight : nullptr, at), bias_row(AFFINE ? bias : nullptr, at);
    const RowVector<P, ROW_THREADS, CHUNKS> gate_row(ModulationRow<P>(gate, at.batch, at.token), at);
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
        if (!at.holds(i)) continue;
        float v[kChunk], r[kChunk], g[kChunk];
        normalized_chunk(row, i, statistics, weight_row, bias_row, v);
        residual.get(i, r);
        gate_row.get(i, g);
#pragma unroll
        for (int e = 0; e < kChunk; ++e) v[e] = r[e] + (tanh_gate ? tanhf(g[e]) : g[e]) * v[e];
        row.set(i, v);  // y's norm reads out as stored
        row.template store<true>(out + at.row * hidden, at, i);
    }
    if (y == nullptr) return;  // uniform across the block: add_gate_norm has no y
    const RowStatistics out_statistics = row_statistics<BLOCK>(row, at, hidden, eps, rms != 0);
    const RowVector<P, ROW_THREADS, CHUNKS> weight2_row(AFFINE ? weight2 : nullptr, at), bias2_row(AFFINE ? bias2 : nullptr, at);
    const RowVector<P, ROW_THREADS, CHUNKS> scale_row(ModulationRow<P>(scale, at.batch, at.token), at);
    QuantizedRow<Y, ROW_THREADS, CHUNKS> quantized;  // FP8: y waits here for the row's amax (else unused)
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
        if (!at.holds(i)) continue;
        float v[kChunk], s[kChunk];
        normalized_chunk(row, i, out_statistics, weight2_row, bias2_row, v);
        scale_row.get(i, s);
#pragma unroll
        for (int e = 0; e < kChunk; ++e) v[e] *= 1.0f + s[e];
        if constexpr (kQuantized) {
            quantized.set(i, v);
        } else {
            row.set(i, v);
            row.template store<true>(y + at.row * hidden, at, i);
        }
    }
    if constexpr (kQuantized) quantized.template store<BLOCK>(y, y_scale, static_scale, at, hidden);
}
