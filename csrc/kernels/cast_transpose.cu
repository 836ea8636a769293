// Cast-transpose and FP8 transpose: each thread owns an 8x8 block of the matrix, reads its 8
// row segments with 16-byte loads, writes them row-wise, transposes the 64 bytes in registers
// (byte permutes) and writes 8 column segments. A warp covers 64 rows x 32 columns, so every
// global access of the warp is a run of >= 32 contiguous bytes per row: no shared memory, no
// bank conflicts, and the input is read exactly once.
#include <cuda_runtime.h>

#include <cstdlib>

#include "cast.h"
#include "cast_device.cuh"

namespace tpfp8 {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpRows = 64, kWarpCols = 32;   // 8 x 4 threads of 8x8 each
constexpr int kWarpsM = 2, kWarpsK = 4;         // 8 warps
constexpr int kTileRows = kWarpRows * kWarpsM;  // 128
constexpr int kTileCols = kWarpCols * kWarpsK;  // 128

// Transposes a 4x4 byte block: w[r] holds row r, result t[c] holds column c.
__device__ __forceinline__ void transpose4x4(const uint32_t w[4], uint32_t t[4]) {
  const uint32_t x0 = __byte_perm(w[0], w[1], 0x5140), x1 = __byte_perm(w[0], w[1], 0x7362);
  const uint32_t y0 = __byte_perm(w[2], w[3], 0x5140), y1 = __byte_perm(w[2], w[3], 0x7362);
  t[0] = __byte_perm(x0, y0, 0x5410);
  t[1] = __byte_perm(x0, y0, 0x7632);
  t[2] = __byte_perm(x1, y1, 0x5410);
  t[3] = __byte_perm(x1, y1, 0x7632);
}

// rows[r] = bytes 0..7 of row r; returns cols[c] = bytes (row 0..7) of column c.
__device__ __forceinline__ void transpose8x8(const uint2 rows[8], uint2 cols[8]) {
  uint32_t q[4], t[4];
#pragma unroll
  for (int half_c = 0; half_c < 2; ++half_c) {  // columns 0-3 from .x, 4-7 from .y
#pragma unroll
    for (int half_r = 0; half_r < 2; ++half_r) {  // rows 0-3 -> .x of result, 4-7 -> .y
#pragma unroll
      for (int r = 0; r < 4; ++r) q[r] = half_c ? rows[4 * half_r + r].y : rows[4 * half_r + r].x;
      transpose4x4(q, t);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        if (half_r)
          cols[4 * half_c + c].y = t[c];
        else
          cols[4 * half_c + c].x = t[c];
      }
    }
  }
}

// The 8 FP8 bytes of a loaded row segment: a cast for high-precision input, the bytes
// themselves for FP8 input (the transpose-only op).
template <Fp8Format F, typename T>
__device__ __forceinline__ uint2 row_bytes(const device::Pack8<T>& pack, float scale,
                                           uint32_t& amax) {
  if constexpr (std::is_same_v<T, uint8_t>) {
    return *reinterpret_cast<const uint2*>(&pack);
  } else {
    return device::cast8<F>(pack, scale, amax);
  }
}

template <Fp8Format F, typename T>
__device__ __forceinline__ uint8_t element_byte(T x, float scale, uint32_t& amax) {
  if constexpr (std::is_same_v<T, uint8_t>) {
    return x;
  } else {
    const float f = device::load_float(x);
    amax = max(amax, abs_bits(f));
    return encode_fp8(f * scale, F);
  }
}

// One 8x8 block at (m0, k0), with or without 16-byte accesses.
template <Fp8Format F, typename T>
__device__ __forceinline__ void block8x8(const T* __restrict__ in, int64_t rows, int64_t cols,
                                         int64_t m0, int64_t k0, float scale, bool vec,
                                         uint8_t* __restrict__ rowwise,
                                         uint8_t* __restrict__ columnwise, uint32_t& amax) {
  if (vec && m0 + 8 <= rows && k0 + 8 <= cols) {
    // All eight loads are issued before any is used: they are in flight together.
    device::Pack8<T> packs[8];
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      packs[r] = *reinterpret_cast<const device::Pack8<T>*>(in + (m0 + r) * cols + k0);
    }
    uint2 r8[8];
#pragma unroll
    for (int r = 0; r < 8; ++r) r8[r] = row_bytes<F>(packs[r], scale, amax);
    if (rowwise) {
#pragma unroll
      for (int r = 0; r < 8; ++r) *reinterpret_cast<uint2*>(rowwise + (m0 + r) * cols + k0) = r8[r];
    }
    if (columnwise) {
      uint2 c8[8];
      transpose8x8(r8, c8);
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        *reinterpret_cast<uint2*>(columnwise + (k0 + c) * rows + m0) = c8[c];
      }
    }
    return;
  }
  // Edge blocks and unaligned shapes: element by element, bounds checked.
  for (int64_t m = m0; m < m0 + 8 && m < rows; ++m) {
    for (int64_t k = k0; k < k0 + 8 && k < cols; ++k) {
      const uint8_t b = element_byte<F>(in[m * cols + k], scale, amax);
      if (rowwise) rowwise[m * cols + k] = b;
      if (columnwise) columnwise[k * rows + m] = b;
    }
  }
}

template <Fp8Format F, typename T>
__global__ void __launch_bounds__(kThreads)
    tile_transpose_kernel(const T* __restrict__ in, int64_t rows, int64_t cols,
                          const float* __restrict__ scale_ptr, uint8_t* __restrict__ rowwise,
                          uint8_t* __restrict__ columnwise, float* amax, float* scale_inv, bool vec,
                          int group) {
  const float scale = scale_ptr ? *scale_ptr : 1.0f;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t dm = (warp / kWarpsK) * kWarpRows + (lane / 4) * 8;
  const int64_t dk = (warp % kWarpsK) * kWarpCols + (lane % 4) * 8;
  const int64_t tiles_k = (cols + kTileCols - 1) / kTileCols;
  const int64_t tiles_m = (rows + kTileRows - 1) / kTileRows;
  uint32_t local_amax = 0;
  for (int64_t t = blockIdx.x; t < tiles_m * tiles_k; t += gridDim.x) {
    // Tiles in flight together form a band of `group` tile rows walked column by column, so
    // each input row, row-wise output row and column-wise output row is touched in runs of
    // kilobytes rather than 128-byte pieces scattered over DRAM pages.
    const int64_t first_m = (t / (group * tiles_k)) * group;
    const int64_t band = min(tiles_m - first_m, int64_t{group});
    const int64_t in_band = t - first_m * tiles_k;
    const int64_t m0 = (first_m + in_band % band) * kTileRows + dm;
    const int64_t k0 = (in_band / band) * kTileCols + dk;
    block8x8<F>(in, rows, cols, m0, k0, scale, vec, rowwise, columnwise, local_amax);
  }
  if (amax) device::fold_block_amax(local_amax, amax);
  if (scale_inv && blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = 1.0f / scale;
}

// Tile rows per band (see the kernel); TPFP8_CAST_TRANSPOSE_GROUP overrides it for tuning.
int tile_group() {
  static const int group = [] {
    const char* env = std::getenv("TPFP8_CAST_TRANSPOSE_GROUP");
    const int g = env ? std::atoi(env) : 0;
    return g > 0 ? g : 16;
  }();
  return group;
}

template <Fp8Format F, typename T>
void launch(const T* in, int64_t rows, int64_t cols, const float* scale, uint8_t* rowwise,
            uint8_t* columnwise, float* amax, float* scale_inv, cudaStream_t stream) {
  // 16-byte row loads and 8-byte stores need every row (and column) start aligned.
  const bool vec = rows % 8 == 0 && cols % 8 == 0 &&
                   device::aligned(in, alignof(device::Pack8<T>)) && device::aligned(rowwise, 8) &&
                   device::aligned(columnwise, 8);
  const int64_t tiles = ((rows + kTileRows - 1) / kTileRows) * ((cols + kTileCols - 1) / kTileCols);
  const int grid = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(tiles, int64_t{current_sm_count()} * 4)));
  tile_transpose_kernel<F, T><<<grid, kThreads, 0, stream>>>(
      in, rows, cols, scale, rowwise, columnwise, amax, scale_inv, vec, tile_group());
}

}  // namespace

cudaError_t cast_transpose_cuda(const CastParams& p, cudaStream_t stream) {
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(p.input);
    if (p.format == Fp8Format::kE4M3) {
      launch<Fp8Format::kE4M3>(in, p.rows, p.cols, p.scale, p.rowwise, p.columnwise, p.amax,
                               p.scale_inv, stream);
    } else {
      launch<Fp8Format::kE5M2>(in, p.rows, p.cols, p.scale, p.rowwise, p.columnwise, p.amax,
                               p.scale_inv, stream);
    }
  });
  return cudaGetLastError();
}

cudaError_t transpose_fp8_cuda(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out,
                               cudaStream_t stream) {
  if (rows * cols == 0) return cudaSuccess;
  launch<Fp8Format::kE4M3>(in, rows, cols, nullptr, nullptr, out, nullptr, nullptr, stream);
  return cudaGetLastError();
}

}  // namespace tpfp8
