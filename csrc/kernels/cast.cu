// Element-wise CUDA kernels of cast.h: quantize, dequantize, amax. Each thread walks the
// tensor in chunks of 8 elements (one 16-byte access where aligned) over a grid sized to the
// machine, so the amax costs one atomic per block rather than per chunk.
#include <cuda_runtime.h>

#include "cast.h"
#include "cast_device.cuh"

namespace tpfp8 {

int current_sm_count() {
  static int counts[64] = {0};
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 0 || dev >= 64) return 132;
  if (counts[dev] == 0) cudaDeviceGetAttribute(&counts[dev], cudaDevAttrMultiProcessorCount, dev);
  return counts[dev] > 0 ? counts[dev] : 132;
}

namespace {

constexpr int kThreads = 256;

// Grid for `chunks` units of work: enough blocks to fill the machine, no more than needed.
int grid_for(int64_t chunks, int blocks_per_sm) {
  const int64_t needed = (chunks + kThreads - 1) / kThreads;
  return static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(needed, current_sm_count() * blocks_per_sm)));
}

template <typename T, Fp8Format F>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const T* __restrict__ in, int64_t n, ScaleSource scale_src,
                    uint8_t* __restrict__ out, float* amax, float* scale_inv, bool vec) {
  const float scale = scale_src.resolve(F);
  uint32_t local_amax = 0;
  const int64_t chunks = (n + 7) / 8;
  for (int64_t ch = blockIdx.x * int64_t{kThreads} + threadIdx.x; ch < chunks;
       ch += int64_t{gridDim.x} * kThreads) {
    const int64_t i = ch * 8;
    if (vec && i + 8 <= n) {
      const auto pack = *reinterpret_cast<const device::Pack8<T>*>(in + i);
      *reinterpret_cast<uint2*>(out + i) = device::cast8<F>(pack, scale, local_amax);
    } else {
      for (int64_t j = i; j < n && j < i + 8; ++j) {
        const float x = device::load_float(in[j]);
        local_amax = max(local_amax, abs_bits(x));
        out[j] = encode_fp8(x * scale, F);
      }
    }
  }
  if (amax) device::fold_block_amax(local_amax, amax);
  if (scale_inv && blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = 1.0f / scale;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint8_t* __restrict__ in, int64_t n, Fp8Format format,
                      const float* __restrict__ scale_inv_ptr, T* __restrict__ out, bool vec) {
  const float scale_inv = *scale_inv_ptr;
  const int64_t chunks = (n + 7) / 8;
  for (int64_t ch = blockIdx.x * int64_t{kThreads} + threadIdx.x; ch < chunks;
       ch += int64_t{gridDim.x} * kThreads) {
    const int64_t i = ch * 8;
    if (vec && i + 8 <= n) {
      const auto codes = *reinterpret_cast<const device::Pack8<uint8_t>*>(in + i);
      device::Pack8<T> pack;
#pragma unroll
      for (int j = 0; j < 8; ++j)
        pack.v[j] = from_float<T>(decode_fp8(codes.v[j], format) * scale_inv);
      *reinterpret_cast<device::Pack8<T>*>(out + i) = pack;
    } else {
      for (int64_t j = i; j < n && j < i + 8; ++j) {
        out[j] = from_float<T>(decode_fp8(in[j], format) * scale_inv);
      }
    }
  }
}

// max_abs8's FMNMX tree, canonicalised in the fold (H200, 8192x4096 bf16: 19.8-20.1 -> 18.4-18.7
// us against abs_bits per element).
template <typename T>
__device__ __forceinline__ float pack_amax(const device::Pack8<T>& pack, float amax) {
  float x[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) x[j] = device::load_float(pack.v[j]);
  return device::max_abs8(amax, x);
}

// kAmaxLoads 16-byte loads are issued before any is used: with one in flight per thread, even a
// full machine of threads keeps too few bytes in flight to cover DRAM latency (2.6 TB/s at
// 4096^2 bf16).
constexpr int kAmaxLoads = 4;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    amax_kernel(const T* __restrict__ in, int64_t n, float* amax, bool vec) {
  float local_amax = 0.0f;
  const int64_t stride = int64_t{gridDim.x} * kThreads;
  const int64_t first = blockIdx.x * int64_t{kThreads} + threadIdx.x;
  const int64_t whole = vec ? n / 8 : 0;  // 8-element chunks read as one access
  const auto* packs = reinterpret_cast<const device::Pack8<T>*>(in);
  for (int64_t ch = first; ch < whole; ch += kAmaxLoads * stride) {
    device::Pack8<T> p[kAmaxLoads];
#pragma unroll
    for (int u = 0; u < kAmaxLoads; ++u) {
      const int64_t c = ch + u * stride;
      p[u] = c < whole ? packs[c] : device::Pack8<T>{};  // zeros leave the max alone
    }
#pragma unroll
    for (int u = 0; u < kAmaxLoads; ++u) local_amax = pack_amax(p[u], local_amax);
  }
  // The elements no chunk covered: all of them on the scalar path, else the last n % 8.
  for (int64_t i = whole * 8 + first; i < n; i += stride) {
    local_amax = device::max_abs(local_amax, device::load_float(in[i]));
  }
  device::fold_block_amax(float_bits(local_amax), amax);
}

}  // namespace

cudaError_t quantize_cuda(const CastParams& p, cudaStream_t stream) {
  // cast_transpose_cuda writes those.
  if (p.columnwise != nullptr || p.dbias != nullptr) return cudaErrorInvalidValue;
  const int64_t n = p.rows * p.cols;  // n == 0 still launches: scale_inv is written
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(p.input);
    const bool vec =
        device::aligned(in, alignof(device::Pack8<T>)) && device::aligned(p.rowwise, 8);
    const int grid = grid_for((n + 7) / 8, 8);
    const ScaleSource src = scale_source(p);
    if (p.format == Fp8Format::kE4M3) {
      quantize_kernel<T, Fp8Format::kE4M3>
          <<<grid, kThreads, 0, stream>>>(in, n, src, p.rowwise, p.amax, p.scale_inv, vec);
    } else {
      quantize_kernel<T, Fp8Format::kE5M2>
          <<<grid, kThreads, 0, stream>>>(in, n, src, p.rowwise, p.amax, p.scale_inv, vec);
    }
  });
  return cudaGetLastError();
}

cudaError_t dequantize_cuda(const DequantizeParams& p, cudaStream_t stream) {
  if (p.numel == 0) return cudaSuccess;
  dispatch_dtype(p.out_dtype, [&](auto tag) {
    using T = decltype(tag);
    T* out = static_cast<T*>(p.output);
    const bool vec = device::aligned(out, alignof(device::Pack8<T>)) && device::aligned(p.input, 8);
    dequantize_kernel<T><<<grid_for((p.numel + 7) / 8, 8), kThreads, 0, stream>>>(
        p.input, p.numel, p.format, p.scale_inv, out, vec);
  });
  return cudaGetLastError();
}

cudaError_t amax_cuda(const void* input, DType dtype, int64_t numel, float* amax,
                      cudaStream_t stream) {
  if (numel == 0) return cudaSuccess;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(input);
    // Threads enough for kAmaxLoads chunks each (a small tensor gets fewer, fuller blocks).
    const int64_t chunks = (numel + 7) / 8;
    amax_kernel<T><<<grid_for((chunks + kAmaxLoads - 1) / kAmaxLoads, 8), kThreads, 0, stream>>>(
        in, numel, amax, device::aligned(in, alignof(device::Pack8<T>)));
  });
  return cudaGetLastError();
}

}  // namespace tpfp8
