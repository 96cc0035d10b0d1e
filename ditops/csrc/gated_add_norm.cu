// Op 4 (Z-Image "sandwich" norm): out = x + act(gate) * norm(branch), act = identity or tanh,
// stored in x's dtype; then optionally y = norm2(out) * (1 + scale), reading out as stored.
#include "row_tile.cuh"

template <typename T, typename P, int ROW_THREADS, int CHUNKS, int BLOCK>
__global__ void __launch_bounds__(BLOCK) gated_add_norm(
    Rows x, Rows branch, Modulation gate, Modulation scale, const P* weight, const P* bias, const P* weight2, const P* bias2,
    T* out, T* y, float eps, long long rms, long long tanh_gate, long long rows, long long tokens, long long hidden) {
    const RowPosition at = RowPosition::of_thread<ROW_THREADS, BLOCK>(rows, tokens);
    float v[CHUNKS][kChunk], residual[CHUNKS][kChunk];
    load_row<T, ROW_THREADS, CHUNKS>(branch, at, hidden, v);
    load_row<T, ROW_THREADS, CHUNKS>(x, at, hidden, residual);  // loaded early: its latency hides behind the norm
    normalize_row<P, ROW_THREADS, CHUNKS, BLOCK>(v, at, hidden, eps, rms != 0, weight, bias);
    const ModulationRow<P> gate_row(gate, at.batch, at.token);
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
        const long long column = at.column<ROW_THREADS>(i);
        if (!(at.valid && column < hidden)) continue;
        float g[kChunk];
        gate_row.load(column, g);
#pragma unroll
        for (int e = 0; e < kChunk; ++e) {
            const float activated = tanh_gate ? tanhf(g[e]) : g[e];
            v[i][e] = to_float(from_float<T>(residual[i][e] + activated * v[i][e]));  // y's norm reads out as stored
        }
        store_chunk(out + at.row * hidden + column, v[i]);
    }
    if (y == nullptr) return;  // uniform across the block: add_gate_norm has no y
    normalize_row<P, ROW_THREADS, CHUNKS, BLOCK>(v, at, hidden, eps, rms != 0, weight2, bias2);
    const ModulationRow<P> scale_row(scale, at.batch, at.token);
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
        const long long column = at.column<ROW_THREADS>(i);
        if (!(at.valid && column < hidden)) continue;
        float s[kChunk];
        scale_row.load(column, s);
#pragma unroll
        for (int e = 0; e < kChunk; ++e) v[i][e] *= 1.0f + s[e];
        store_chunk(y + at.row * hidden + column, v[i]);
    }
}
