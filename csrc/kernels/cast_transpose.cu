// Cast-transpose and FP8 transpose over 128x128 tiles; each block loops over tiles.
//
// Every global access of a warp covers whole 128-byte lines, because L2 transactions (not
// DRAM bytes) were the limit of a register-only 8x8-per-thread version (ncu: L2 77 % busy at
// 60 % of DRAM bandwidth, five times the copy's transactions per element). A tile:
//   0. is copied global -> shared with cp.async, up to three tiles ahead of the one being
//      cast, so DRAM reads never wait for the block's stores and barriers (loading a tile into
//      registers and then working on it, two blocks per SM, reached 82-84 % of a copy's
//      bandwidth at 8192^2 and up; this, one block per SM, 85-91 %);
//   1. each thread casts 8 row segments of 8 elements from shared memory, stores them
//      row-wise (a warp: 2 rows x 128 B) and into a shared FP8 tile;
//   2. after a barrier, each thread reads 16 rows x 4 bytes of the FP8 tile, transposes them
//      as 4x4 byte blocks in registers and stores 4 column-wise segments of 16 bytes (a warp:
//      4 rows x 128 B per store).
// The FP8 tile is XOR-swizzled by 16-row group so both phases are free of bank conflicts.
// Tiles past the tensor's edge are zero-filled in shared memory and stored in part; shapes
// that break 16-byte alignment take an element-wise path from global memory.
//
// dbias (cast.h) rides on phase 1: each thread sums its 8 columns over its 8 rows in registers,
// the two threads of a column segment in a warp add by shuffle, and 128 threads add the 8 warps'
// sums from shared memory into the tile's row of dbias_partial. A second kernel adds those rows
// in groups of 8. Work items are then whole tiles (no row bands), so the order of additions
// depends on the shape alone.
#include <cuda_runtime.h>

#include "cast.h"
#include "cast_device.cuh"

namespace tpfp8 {
namespace {

constexpr int kThreads = 256;
constexpr int kTile = 128;                                // rows and columns of a tile
constexpr int kTileWords = kTile / 4;                     // 32-bit words per shared tile row
constexpr int kSegmentsPerRow = kTile / 8;                // phase 1: 8-element segments per row
constexpr int kRowsPerPass = kThreads / kSegmentsPerRow;  // 16
constexpr int kPasses = kTile / kRowsPerPass;             // 8
constexpr int kWarps = kThreads / 32;
static_assert(kTile == kDbiasTileRows && kRowsPerPass == kDbiasLanes && kWarps == kDbiasGroups &&
                  kSegmentsPerRow == 16,
              "the dbias order of cast.h is this kernel's thread layout");

// Word column where (row, word) lives in the shared tile: XOR by the row's 16-row group.
__device__ __forceinline__ int swizzle(int row, int word) { return word ^ (((row / 16) % 8) << 2); }

// The 8 FP8 bytes of a loaded segment: a cast for high-precision input, the bytes themselves
// for FP8 input (the transpose-only op).
template <Fp8Format F, typename T>
__device__ __forceinline__ uint2 segment_bytes(const device::Pack8<T>& pack, float scale,
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

// Async global -> shared copy of 16 bytes (sm_80+); out of bounds, 16 zero bytes instead.
__device__ __forceinline__ void copy16_async(void* dst, const void* src, bool in_bounds) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const auto s = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(src),
               "r"(in_bounds ? 16 : 0));
#else
  *static_cast<uint4*>(dst) = in_bounds ? *static_cast<const uint4*>(src) : uint4{};
#endif
}
__device__ __forceinline__ void commit_copies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;");
#endif
}
// Waits until at most `Pending` committed groups are still in flight.
template <int Pending>
__device__ __forceinline__ void wait_copies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(Pending));
#endif
}

// Shared-memory plan for input type T: kStages input tiles, then the FP8 tile. One block per
// SM with four 16-bit stages in flight beat two blocks with two or three stages each
// (H200, 8192^2 and up: 87-91 % of a copy vs 76-82 %).
template <typename T>
struct Staging {
  static constexpr int kTileBytes = kTile * kTile * static_cast<int>(sizeof(T));
  static constexpr int kFit = (128 << 10) / kTileBytes;
  static constexpr int kStages = kFit < 2 ? 2 : kFit > 8 ? 8 : kFit;
  static constexpr int kChunksPerRow = kTile * static_cast<int>(sizeof(T)) / 16;
  static constexpr int kChunksPerThread = kTile * kChunksPerRow / kThreads;
  static constexpr size_t kSmemBytes = size_t{kStages} * kTileBytes + kTile * kTile;
};

// A tile: rows [m0, m_end) (at most kTile of them) and columns [k0, k0 + kTile) of the
// [rows, cols] tensor, clipped at its edge.
struct TileArgs {
  int64_t rows, cols, m0, k0, m_end;
  float scale;
  uint8_t* rowwise;
  uint8_t* columnwise;
  float* dbias_partial;  // [tiles_m, cols]; null: no column sums
};

// A thread's column sums: its 8 columns (segment) over its 8 rows of a tile, in cast.h's order.
struct ColumnSums {
  float v[8] = {};
  template <typename T>
  __device__ __forceinline__ void add(const device::Pack8<T>& pack) {
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] += device::load_float(pack.v[j]);
  }
};

// The tile's row of dbias_partial from the warps' sums (after a barrier).
__device__ __forceinline__ void store_tile_sums(const float* warp_sums, const TileArgs& t) {
  device::store_column_sums(warp_sums, t.dbias_partial + (t.m0 / kTile) * t.cols, t.k0, t.cols);
}

// Starts the copy of the tile at (t.m0, t.k0) into `buf` ([kTile][kTile] row-major, zeros
// past the tensor's edge); a warp copies whole rows. 16-byte chunks are wholly inside or
// outside the tensor, as the vector path requires cols * sizeof(T) % 16 == 0.
template <typename T>
__device__ __forceinline__ void load_tile_async(const T* __restrict__ in, const TileArgs& t,
                                                T* buf) {
  using S = Staging<T>;
  constexpr int kElemsPerChunk = 16 / static_cast<int>(sizeof(T));
#pragma unroll
  for (int j = 0; j < S::kChunksPerThread; ++j) {
    const int c = threadIdx.x + j * kThreads;
    const int r = c / S::kChunksPerRow, e = (c % S::kChunksPerRow) * kElemsPerChunk;
    const bool inside = t.m0 + r < t.m_end && t.k0 + e < t.cols;
    copy16_async(buf + r * kTile + e, inside ? in + (t.m0 + r) * t.cols + t.k0 + e : in, inside);
  }
}

// Casts a tile staged in shared memory; stores only what lies inside the tensor (whole
// 8-byte row-wise and 16-byte column-wise segments, by the vector path's alignment).
// Column sums (dbias_partial) from the staged values; rows past the edge are zeros there.
template <Fp8Format F, typename T>
__device__ void staged_tile(const T* buf, const TileArgs& t, uint32_t* fp8_tile, float* warp_sums,
                            uint32_t& amax) {
  const int seg = threadIdx.x % kSegmentsPerRow, row0 = threadIdx.x / kSegmentsPerRow;
  const bool seg_inside = t.k0 + seg * 8 < t.cols;
  ColumnSums sums;
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int r = row0 + p * kRowsPerPass;
    const auto pack = *reinterpret_cast<const device::Pack8<T>*>(buf + r * kTile + seg * 8);
    if constexpr (!std::is_same_v<T, uint8_t>) {
      if (t.dbias_partial) sums.add(pack);
    }
    const uint2 bytes = segment_bytes<F>(pack, t.scale, amax);
    if (t.rowwise && seg_inside && t.m0 + r < t.m_end) {
      *reinterpret_cast<uint2*>(t.rowwise + (t.m0 + r) * t.cols + t.k0 + seg * 8) = bytes;
    }
    if (t.columnwise) {
      *reinterpret_cast<uint2*>(fp8_tile + r * kTileWords + swizzle(r, 2 * seg)) = bytes;
    }
  }
  if (t.dbias_partial) device::publish_column_sums(sums.v, warp_sums);
  if (!t.columnwise && !t.dbias_partial) return;
  __syncthreads();  // the FP8 tile and the warps' sums complete
  if (t.dbias_partial) store_tile_sums(warp_sums, t);
  if (!t.columnwise) return;
  // Phase 2: lane -> 16-row group (8 per 128 rows) and word column (4 per warp).
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int group = lane % 8, word = warp * 4 + lane / 8;
  uint32_t cols[4][4];  // [4-row block j][column c]
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = group * 16 + j * 4 + i;
      w[i] = fp8_tile[r * kTileWords + swizzle(r, word)];
    }
    device::transpose4x4(w, cols[j]);
  }
  if (t.m0 + group * 16 >= t.m_end) return;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const int64_t k = t.k0 + word * 4 + c;
    if (k < t.cols) {
      *reinterpret_cast<uint4*>(t.columnwise + k * t.rows + t.m0 + group * 16) =
          make_uint4(cols[0][c], cols[1][c], cols[2][c], cols[3][c]);
    }
  }
}

// Any tile, any alignment: one element per thread and step, straight from global memory.
// Column sums are a second read of the tile (from cache) in the staged path's thread layout.
template <Fp8Format F, typename T>
__device__ void element_tile(const T* __restrict__ in, const TileArgs& t, float* warp_sums,
                             uint32_t& amax) {
  for (int i = threadIdx.x; i < kTile * kTile; i += kThreads) {
    const int64_t m = t.m0 + i / kTile, k = t.k0 + i % kTile;
    if (m >= t.m_end || k >= t.cols) continue;
    const uint8_t b = element_byte<F>(in[m * t.cols + k], t.scale, amax);
    if (t.rowwise) t.rowwise[m * t.cols + k] = b;
    if (t.columnwise) t.columnwise[k * t.rows + m] = b;
  }
  if constexpr (!std::is_same_v<T, uint8_t>) {
    if (!t.dbias_partial) return;
    const int seg = threadIdx.x % kSegmentsPerRow, row0 = threadIdx.x / kSegmentsPerRow;
    ColumnSums sums;
    for (int p = 0; p < kPasses; ++p) {
      const int64_t m = t.m0 + row0 + p * kRowsPerPass;
      for (int j = 0; j < 8; ++j) {
        const int64_t k = t.k0 + seg * 8 + j;
        sums.v[j] += m < t.m_end && k < t.cols ? device::load_float(in[m * t.cols + k]) : 0.0f;
      }
    }
    device::publish_column_sums(sums.v, warp_sums);
    __syncthreads();
    store_tile_sums(warp_sums, t);
    __syncthreads();  // warp_sums read before the next tile writes them
  }
}

template <Fp8Format F, typename T>
__global__ void __launch_bounds__(kThreads)
    tile_transpose_kernel(const T* __restrict__ in, int64_t rows, int64_t cols,
                          ScaleSource scale_src, uint8_t* __restrict__ rowwise,
                          uint8_t* __restrict__ columnwise, float* amax, float* scale_inv,
                          float* dbias_partial, bool vec) {
  using S = Staging<T>;
  extern __shared__ uint4 smem[];  // 16-byte aligned, as cp.async needs
  T* const stages = reinterpret_cast<T*>(smem);
  uint32_t* const fp8_tile =
      reinterpret_cast<uint32_t*>(reinterpret_cast<uint8_t*>(smem) + S::kStages * S::kTileBytes);
  __shared__ __align__(16) float warp_sums[kWarps * kTile];
  TileArgs t{rows, cols, 0, 0, 0, scale_src.resolve(F), rowwise, columnwise, dbias_partial};
  // Tile and item indices fit 32 bits (2^31 tiles would be 2^45 elements); 64-bit division
  // per item cost several % of the bandwidth, the block being short of warps to hide it.
  const int tiles_k = static_cast<int>((cols + kTile - 1) / kTile);
  const int tiles = tiles_k * static_cast<int>((rows + kTile - 1) / kTile);
  // Work items, dealt round-robin: tiles, or for a tensor of fewer tiles than blocks, row bands
  // of 128 / 2^log_split rows so more SMs take part (2048x1024: 65 -> 90 % of a copy). Cutting
  // only the last round of a large tensor did not pay (8192^2: 87 % either way).
  // Column sums take whole tiles: their order must not depend on the grid.
  int log_split = 0;
  while (!dbias_partial && log_split < 3 &&
         (tiles << (log_split + 1)) <= static_cast<int>(gridDim.x)) {
    ++log_split;
  }
  const int items = tiles << log_split;
  // Items are dealt from the end of the tensor: its tail is what L2 still holds from the pass
  // that last touched it (a cast right after current scaling's amax: 25 -> 23 us at 4096^2 bf16).
  auto at = [&](int item) {
    item = items - 1 - item;
    const int tile = item >> log_split, height = kTile >> log_split;
    const int band = item & ((1 << log_split) - 1);
    const int tile_m = tile / tiles_k;
    TileArgs a = t;
    a.m0 = int64_t{tile_m} * kTile + band * height;
    a.m_end = std::min(rows, a.m0 + height);
    a.k0 = int64_t{tile - tile_m * tiles_k} * kTile;
    return a;
  };
  uint32_t local_amax = 0;
  if (vec) {
    auto prefetch = [&](int item, int stage) {
      if (item < items) load_tile_async(in, at(item), stages + stage * (kTile * kTile));
      commit_copies();  // empty groups too: the wait below counts groups
    };
    for (int s = 0; s < S::kStages - 1; ++s) prefetch(blockIdx.x + s * gridDim.x, s);
    int stage = 0;
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
      wait_copies<S::kStages - 2>();  // this item's group done
      // This item's copies visible to all; the previous item (its stage, the FP8 tile) done.
      __syncthreads();
      prefetch(item + (S::kStages - 1) * gridDim.x, (stage + S::kStages - 1) % S::kStages);
      staged_tile<F>(stages + stage * (kTile * kTile), at(item), fp8_tile, warp_sums, local_amax);
      stage = (stage + 1) % S::kStages;
    }
  } else {
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
      element_tile<F>(in, at(item), warp_sums, local_amax);
    }
  }
  if (amax) device::fold_block_amax(local_amax, amax);
  if (scale_inv && blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = 1.0f / t.scale;
}

// Allows the instance its shared memory on the current device and returns how many of its
// blocks fit on an SM; the attribute is per device, so this runs once per instance and device.
template <Fp8Format F, typename T>
int blocks_per_sm() {
  auto configure = [] {
    const auto kernel = tile_transpose_kernel<F, T>;
    constexpr int bytes = static_cast<int>(Staging<T>::kSmemBytes);
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    int n = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, bytes);
    return std::max(n, 1);
  };
  static int per_device[64] = {};  // a race only makes two threads store the same value
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 0 || dev >= 64) return configure();
  if (per_device[dev] == 0) per_device[dev] = configure();
  return per_device[dev];
}

template <Fp8Format F, typename T>
void launch(const T* in, int64_t rows, int64_t cols, ScaleSource scale, uint8_t* rowwise,
            uint8_t* columnwise, float* amax, float* scale_inv, float* dbias_partial,
            cudaStream_t stream) {
  // 16-byte copies and column-wise stores, 8-byte row-wise stores: every start aligned.
  const bool vec = rows % 16 == 0 && cols % 8 == 0 && cols * sizeof(T) % 16 == 0 &&
                   device::aligned(in, 16) && device::aligned(rowwise, 8) &&
                   device::aligned(columnwise, 16);
  const int64_t tiles = ((rows + kTile - 1) / kTile) * ((cols + kTile - 1) / kTile);
  const int64_t resident = int64_t{current_sm_count()} * blocks_per_sm<F, T>();
  // Small tensors: up to 8 row bands per tile, to reach more SMs (not with column sums).
  const int64_t items = dbias_partial ? tiles : tiles * 8;
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min(items, resident)));
  tile_transpose_kernel<F, T><<<grid, kThreads, Staging<T>::kSmemBytes, stream>>>(
      in, rows, cols, scale, rowwise, columnwise, amax, scale_inv, dbias_partial, vec);
}

// dbias[c] from the tiles' rows of partial sums (cast.h's order): warp j adds the tiles
// t = j mod 8 of 32 columns, warp 0 adds the 8 group sums. A column's loads are independent of
// its sums, so each thread keeps several in flight.
constexpr int kSumColumns = 32;
__global__ void __launch_bounds__(kThreads)
    dbias_reduce_kernel(const float* __restrict__ partial, int64_t tiles, int64_t cols,
                        float* __restrict__ dbias) {
  __shared__ float group_sums[kDbiasGroups][kSumColumns];
  const int lane = threadIdx.x % kSumColumns, group = threadIdx.x / kSumColumns;
  const int64_t c = int64_t{blockIdx.x} * kSumColumns + lane;
  float sum = 0.0f;
  if (c < cols) {
#pragma unroll 4
    for (int64_t t = group; t < tiles; t += kDbiasGroups) sum += partial[t * cols + c];
  }
  group_sums[group][lane] = sum;
  __syncthreads();
  if (group != 0 || c >= cols) return;
  sum = 0.0f;
#pragma unroll
  for (int j = 0; j < kDbiasGroups; ++j) sum += group_sums[j][lane];
  dbias[c] = from_float<float>(sum);
}

}  // namespace

cudaError_t cast_transpose_cuda(const CastParams& p, cudaStream_t stream) {
  if (p.dbias && !p.dbias_partial && p.rows > 0) return cudaErrorInvalidValue;
  float* const partial = p.dbias ? p.dbias_partial : nullptr;
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(p.input);
    if (p.format == Fp8Format::kE4M3) {
      launch<Fp8Format::kE4M3>(in, p.rows, p.cols, scale_source(p), p.rowwise, p.columnwise, p.amax,
                               p.scale_inv, partial, stream);
    } else {
      launch<Fp8Format::kE5M2>(in, p.rows, p.cols, scale_source(p), p.rowwise, p.columnwise, p.amax,
                               p.scale_inv, partial, stream);
    }
  });
  if (p.dbias) {
    const cudaError_t e = dbias_reduce_cuda(partial, dbias_tiles(p.rows), p.cols, p.dbias, stream);
    if (e != cudaSuccess) return e;
  }
  return cudaGetLastError();
}

cudaError_t dbias_reduce_cuda(const float* partial, int64_t tiles, int64_t cols, float* dbias,
                              cudaStream_t stream) {
  if (cols <= 0) return cudaSuccess;
  const auto blocks = static_cast<unsigned>((cols + kSumColumns - 1) / kSumColumns);
  dbias_reduce_kernel<<<blocks, kThreads, 0, stream>>>(partial, tiles, cols, dbias);
  return cudaGetLastError();
}

cudaError_t transpose_fp8_cuda(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out,
                               cudaStream_t stream) {
  if (rows * cols == 0) return cudaSuccess;
  launch<Fp8Format::kE4M3>(in, rows, cols, ScaleSource{}, nullptr, out, nullptr, nullptr, nullptr,
                           stream);
  return cudaGetLastError();
}

}  // namespace tpfp8
