// Ops 1 and 2: y = norm(v) * (1 + scale) + shift, where v = x, or v = residual + gate * x,
// stored first as residual_out and normalised as stored. Each element is read once and
// written once; the row stays in registers between the two.
#include "row_tile.cuh"

template <typename T, typename P, int ROW_THREADS, int CHUNKS, int BLOCK>
__global__ void __launch_bounds__(BLOCK) modulated_norm(
    Rows x, Rows residual, Modulation gate, Modulation scale, Modulation shift, const P* weight, const P* bias,
    T* y, T* residual_out, float eps, long long rms, long long rows, long long tokens, long long hidden) {
    const RowPosition at = RowPosition::of_thread<ROW_THREADS, BLOCK>(rows, tokens);
    float v[CHUNKS][kChunk];
    load_row<T, ROW_THREADS, CHUNKS>(x, at, hidden, v);
    if (residual.data) {
        const ModulationRow<P> gate_row(gate, at.batch, at.token);
        float previous[CHUNKS][kChunk];
        load_row<T, ROW_THREADS, CHUNKS>(residual, at, hidden, previous);
#pragma unroll
        for (int i = 0; i < CHUNKS; ++i) {
            const long long column = at.column<ROW_THREADS>(i);
            if (!(at.valid && column < hidden)) continue;
            float g[kChunk];
            if (gate_row.data) gate_row.load(column, g);
#pragma unroll
            for (int e = 0; e < kChunk; ++e) {
                // the norm reads residual_out as stored, rounded to T
                v[i][e] = to_float(from_float<T>(previous[i][e] + (gate_row.data ? g[e] * v[i][e] : v[i][e])));
            }
            store_chunk(residual_out + at.row * hidden + column, v[i]);
        }
    }
    normalize_row<P, ROW_THREADS, CHUNKS, BLOCK>(v, at, hidden, eps, rms != 0, weight, bias);
    const ModulationRow<P> scale_row(scale, at.batch, at.token), shift_row(shift, at.batch, at.token);
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
        const long long column = at.column<ROW_THREADS>(i);
        if (!(at.valid && column < hidden)) continue;
        float s[kChunk], t[kChunk];
        scale_row.load(column, s);
        if (shift_row.data) shift_row.load(column, t);
#pragma unroll
        for (int e = 0; e < kChunk; ++e) v[i][e] = v[i][e] * (1.0f + s[e]) + (shift_row.data ? t[e] : 0.0f);
        store_chunk(y + at.row * hidden + column, v[i]);
    }
}
