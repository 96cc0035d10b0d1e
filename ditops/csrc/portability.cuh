// What differs between NVIDIA (NVRTC) and AMD (hiprtc): the warp width, lane exchanges, the
// 16-bit float types and the FP8 conversion. Kernel files use only what this header defines, so
// the code an AMD GPU runs differs from what an NVIDIA GPU runs only in kWarpSize and in how
// OCP e4m3 is converted (the same bits).
#pragma once

#if defined(__HIP__) || defined(__HIPCC_RTC__)

#ifndef __HIPCC_RTC__  // hiprtc pre-includes the runtime and its fp16 builtins
#include <hip/hip_runtime.h>
#endif

constexpr int kWarpSize = 64;  // CDNA wavefronts (gfx90a, gfx942, gfx950)
// Threads per block, and blocks an SM must hold on NVIDIA (which caps registers per thread).
// HIP's second argument means waves per execution unit; nothing was measured on AMD, so there
// only the threads.
#define LAUNCH_BOUNDS(threads, blocks) __launch_bounds__(threads)

__device__ inline float shuffle_xor(float value, int lane_mask) { return __shfl_xor(value, lane_mask, kWarpSize); }
__device__ inline uint4 load_read_only(const uint4* address) { return *address; }
__device__ inline uint2 load_read_only(const uint2* address) { return *address; }
// No cache hints on AMD (not measured there).
__device__ inline uint4 load_streaming(const uint4* address) { return *address; }
__device__ inline void store_streaming(uint4* address, const uint4& value) { *address = value; }
__device__ inline float shuffle(float value, int source_lane) { return __shfl(value, source_lane, kWarpSize); }

// Named structs rather than aliases of _Float16: hiprtc finds template instances by the
// spelling of their arguments, and an alias's spelling is lost.
struct float16 { _Float16 value; };
__device__ inline float to_float(float16 value) { return static_cast<float>(value.value); }
template <typename T> __device__ inline float bits_to_float(unsigned bits);
template <typename T> __device__ inline unsigned float_to_bits(float value);
template <> __device__ inline float bits_to_float<float16>(unsigned bits) {
    return static_cast<float>(__builtin_bit_cast(_Float16, static_cast<unsigned short>(bits)));
}
template <> __device__ inline unsigned float_to_bits<float16>(float value) {
    return __builtin_bit_cast(unsigned short, static_cast<_Float16>(value));
}

// bfloat16 as its 16 bits, converted by hand so that rounding is exactly torch's
// (round to nearest even, NaN stays NaN) whatever the ROCm version's headers offer.
struct bfloat16 { unsigned short bits; };
__device__ inline float to_float(bfloat16 value) { return __uint_as_float(static_cast<unsigned>(value.bits) << 16); }
template <> __device__ inline float bits_to_float<bfloat16>(unsigned bits) { return __uint_as_float(bits << 16); }
template <> __device__ inline unsigned float_to_bits<bfloat16>(float value) {
    unsigned bits = __float_as_uint(value);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (bits >> 16) | 0x40u;
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return bits >> 16;
}

// ROCm 5.2 has no FP8 header: every format converts in software (fp8.cuh).
#include "fp8.cuh"

#else

#include <cuda_fp16.h>
#include <cuda_bf16.h>

constexpr int kWarpSize = 32;
#define LAUNCH_BOUNDS(threads, blocks) __launch_bounds__(threads, blocks)
constexpr unsigned kAllLanes = 0xffffffffu;  // every kernel calls lane exchanges with the whole warp

__device__ inline float shuffle_xor(float value, int lane_mask) { return __shfl_xor_sync(kAllLanes, value, lane_mask); }
// Through the non-coherent cache: the compiler may then move the load ahead of stores.
__device__ inline uint4 load_read_only(const uint4* address) { return __ldg(address); }
__device__ inline uint2 load_read_only(const uint2* address) { return __ldg(address); }
// ld.global.cs and st.global.cs: the line is evicted first (data read or written once).
__device__ inline uint4 load_streaming(const uint4* address) { return __ldcs(address); }
__device__ inline void store_streaming(uint4* address, const uint4& value) { __stcs(address, value); }
__device__ inline float shuffle(float value, int source_lane) { return __shfl_sync(kAllLanes, value, source_lane); }

// NVIDIA only, for modulated_norm_stream.cu (whose launch table has no AMD entries):
// asynchronous 16-byte copies from global to shared memory (sm_80+), each waited for by the
// thread that issued it; a barrier of `threads` threads of the block (id 1-15; 0 is
// __syncthreads'); a shared-memory read the compiler may not hoist out of a loop.
__device__ inline void copy_async_16(void* shared_target, const void* source) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                 :: "r"(static_cast<unsigned>(__cvta_generic_to_shared(shared_target))), "l"(source) : "memory");
}
__device__ inline void copy_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int PENDING>
__device__ inline void copy_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(PENDING) : "memory"); }
__device__ inline void named_barrier(int id, int threads) { asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(threads) : "memory"); }
// max(a, |b|) for a >= 0, NaN where either is NaN (max.NaN, sm_80+; NaN's bits as an unsigned
// are above Inf's, as magnitude_max orders them): one instruction where magnitude_max takes two.
__device__ inline float magnitude_max_nan(float a, float b) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(fabsf(b)));
    return r;
}
// The largest of a warp's unsigned values, in every lane (redux.sync, sm_80+).
__device__ inline unsigned warp_max(unsigned value) { return __reduce_max_sync(kAllLanes, value); }
__device__ inline float4 load_shared_volatile(const float4* address) {
    float4 r;
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w)
                 : "r"(static_cast<unsigned>(__cvta_generic_to_shared(address))));
    return r;
}

using float16 = __half;
using bfloat16 = __nv_bfloat16;
__device__ inline float to_float(float16 value) { return __half2float(value); }
__device__ inline float to_float(bfloat16 value) { return __bfloat162float(value); }
template <typename T> __device__ inline float bits_to_float(unsigned bits);
template <typename T> __device__ inline unsigned float_to_bits(float value);
template <> __device__ inline float bits_to_float<float16>(unsigned bits) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}
template <> __device__ inline unsigned float_to_bits<float16>(float value) { return __half_as_ushort(__float2half_rn(value)); }
template <> __device__ inline float bits_to_float<bfloat16>(unsigned bits) { return __uint_as_float(bits << 16); }
template <> __device__ inline unsigned float_to_bits<bfloat16>(float value) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(value));
}

// OCP e4m3 converts in one instruction from sm_89 (cuda_fp8.h emulates it on older GPUs);
// e4m3fnuz, which no NVIDIA GPU has, in software (fp8.cuh): that path can run on NVIDIA too.
#include <cuda_fp8.h>
#include "fp8.cuh"
template <> __device__ inline unsigned fp8_pair_bits<float8_e4m3fn>(float a, float b) {
    return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
}

#endif

// An element's bits (low bits of an unsigned) as float and back, rounding to nearest even:
// packed 16-byte words are read and written through these rather than by viewing registers
// as arrays of T, which older AMD compilers place in scratch memory.
__device__ inline float to_float(float value) { return value; }
template <> __device__ inline float bits_to_float<float>(unsigned bits) { return __uint_as_float(bits); }
template <> __device__ inline unsigned float_to_bits<float>(float value) { return __float_as_uint(value); }

// Lanes that work as one unit on every GPU: a warp on NVIDIA, half a wavefront on AMD. Kernels
// that place work by segments (the rotary kernel's heads) then launch the same shapes on both
// (SEGMENT in ditops/backends/compiled.py).
constexpr int kSegment = 32;

// A 16-byte load of data no thread of the kernel writes, and a 16-byte store; STREAMING: with the
// streaming cache hint.
template <bool STREAMING>
__device__ inline uint4 load_hinted(const uint4* address) {
    if constexpr (STREAMING) return load_streaming(address);
    else return load_read_only(address);
}

template <bool STREAMING>
__device__ inline void store_hinted(uint4* address, const uint4& value) {
    if constexpr (STREAMING) store_streaming(address, value);
    else *address = value;
}
