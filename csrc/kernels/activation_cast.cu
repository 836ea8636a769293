// Activation fused with the FP8 casts (activation_cast.h), over 128x128 tiles of act(x)'s
// [rows, n]; each block loops over tiles.
//
// A tile: each thread takes 8 row segments of 8 columns (a warp: 2 rows x 128 columns, so
// every global access covers whole 128-byte lines), one at a time: it loads a segment's inputs
// (16-byte loads), computes the activation in fp32, and writes the high-precision output, the
// row-wise FP8 bytes, and the bytes into a shared FP8 tile that is then stored column-wise
// (fp8_tile.cuh). SwiGLU's backward makes two output tiles per tile, columns k and n + k of dx.
// The shared tile exists only when column-wise output is asked for (dynamic shared memory):
// the high-precision-only and amax-only passes neither allocate nor touch it.
//
// The inputs are read once and the activation is never written in high precision unless
// asked for. The exact math (exp and erf from correctly rounded operations, no FMA) costs
// 55-100 instructions an element, which ptxas issues one element after the other: a thread's
// latency is hidden by the other warps, not by loads or elements in flight. So a thread holds
// one segment at a time and the register budget is what keeps many warps resident: 48
// registers (5 blocks of 256, 62.5 % occupancy), 64 for SwiGLU's backward (3 inputs and 2
// outputs an element; 4 blocks, 50 %). Batches of segments loaded ahead took 90-128 registers
// (2 blocks, 25 %): SwiGLU's backward ran at a fifth of the memory bandwidth. (Explicit,
// correctly rounded FMAs in activation_math.h would halve the polynomials.)
//
// Shapes that break vector alignment (n % 8 != 0, misaligned pointers) load and store element
// by element; rows % 16 != 0 only makes the column-wise stores bytewise.
#include <cuda_runtime.h>

#include "activation_cast.h"
#include "cast_device.cuh"
#include "fp8_tile.cuh"

namespace tpfp8 {
namespace {

using device::kFp8Tile;
using device::Pack8;

constexpr int kThreads = 256;
constexpr int kSegmentsPerRow = kFp8Tile / 8;             // 16 segments of 8 columns
constexpr int kRowsPerPass = kThreads / kSegmentsPerRow;  // 16
constexpr int kPasses = kFp8Tile / kRowsPerPass;          // 8
constexpr int kTileBytes = kFp8Tile * kFp8Tile;           // one FP8 output tile in shared memory

// Resident blocks per SM the register budget must allow (see the top of the file); ptxas
// fits each instance without spilling.
template <Activation A, bool kBackward>
constexpr int kMinBlocks = A == Activation::kSwiGLU && kBackward ? 4 : 5;

template <typename T>
struct Args {
  const T* x;
  const T* dy;
  int64_t rows, n, in_cols, out_cols;
  uint8_t* rowwise;
  uint8_t* columnwise;
  T* out;
};

// Eight elements from p (columns k .. k+7 of a row): one vector load, or where `vec` is off
// only the first `valid` of them; zeros past the edge.
template <typename T>
__device__ __forceinline__ Pack8<T> load8(const T* p, bool vec, int valid) {
  Pack8<T> r{};
  if (valid <= 0) return r;
  if (vec) return *reinterpret_cast<const Pack8<T>*>(p);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (j < valid) r.v[j] = p[j];
  }
  return r;
}

template <typename T>
__device__ __forceinline__ void store8(T* p, const float* y, bool vec, int valid) {
  if (vec) {
    Pack8<T> r;
#pragma unroll
    for (int j = 0; j < 8; ++j) r.v[j] = from_float<T>(y[j]);
    *reinterpret_cast<Pack8<T>*>(p) = r;
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (j < valid) p[j] = from_float<T>(y[j]);
  }
}

template <Fp8Format F>
__device__ __forceinline__ uint2 encode8(const float* y, float scale) {
  float v[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = mul_rn(y[j], scale);  // as the CPU: never an FMA
  return make_uint2(device::encode4<F>(v), device::encode4<F>(v + 4));
}

// Writes one row segment of output tile `o` (result columns o*n + k .. +7 of row m).
template <typename T, Fp8Format F>
__device__ __forceinline__ void put_segment(const Args<T>& a, const float* y, int64_t m,
                                            int64_t col, int valid, int r, int seg, float scale,
                                            bool vec, uint32_t* tile) {
  if (a.out) store8(a.out + m * a.out_cols + col, y, vec, valid);
  if (!a.rowwise && !a.columnwise) return;
  const uint2 bytes = encode8<F>(y, scale);
  if (a.rowwise) {
    uint8_t* dst = a.rowwise + m * a.out_cols + col;
    if (vec) {
      *reinterpret_cast<uint2*>(dst) = bytes;
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (j < valid) dst[j] = static_cast<uint8_t>((j < 4 ? bytes.x : bytes.y) >> (8 * (j % 4)));
      }
    }
  }
  if (a.columnwise) {
    *reinterpret_cast<uint2*>(tile + device::fp8_tile_word(r, 2 * seg)) = bytes;
  }
}

template <Activation A, bool kBackward, Fp8Format F, typename T>
__global__ void __launch_bounds__(kThreads, kMinBlocks<A, kBackward>)
    activation_cast_kernel(Args<T> a, ScaleSource scale_src, float* amax, float* scale_inv,
                           bool vec, bool vec_col, bool reverse) {
  constexpr bool kSwiGLU = A == Activation::kSwiGLU;
  constexpr int kOutTiles = kSwiGLU && kBackward ? 2 : 1;
  constexpr int kInputs = 1 + kSwiGLU + kBackward;  // x0, x1 (SwiGLU), dy (backward)
  constexpr int kTileWords = kTileBytes / 4;
  // kOutTiles tiles with column-wise output, else none; 16-byte aligned: rows are written as
  // 8-byte words.
  extern __shared__ __align__(16) uint32_t tiles[];

  const float scale = scale_src.resolve(F);
  const int seg = threadIdx.x % kSegmentsPerRow, row0 = threadIdx.x / kSegmentsPerRow;
  const int tiles_k = static_cast<int>((a.n + kFp8Tile - 1) / kFp8Tile);
  const int num_tiles = tiles_k * static_cast<int>((a.rows + kFp8Tile - 1) / kFp8Tile);
  uint32_t local_amax = 0;
#pragma unroll 1
  for (int item = blockIdx.x; item < num_tiles; item += gridDim.x) {
    // The cast pass after current scaling's amax pass goes backwards: it starts on what the
    // amax pass read last, which L2 still holds.
    const int tile = reverse ? num_tiles - 1 - item : item;
    const int64_t m0 = int64_t{tile / tiles_k} * kFp8Tile;
    const int64_t k0 = int64_t{tile % tiles_k} * kFp8Tile;
    const int64_t k = k0 + seg * 8;
    const int valid = static_cast<int>(std::min<int64_t>(8, a.n - k));  // columns inside
    // Not unrolled: one segment's inputs and results live at a time (the register budget).
#pragma unroll 1
    for (int p = 0; p < kPasses; ++p) {
      const int r = row0 + p * kRowsPerPass;
      const int64_t m = m0 + r;
      // Segments past the edge would compute 0, which leaves the max alone; their rows of
      // the shared tile keep stale bytes, which are never stored.
      if (m >= a.rows || valid <= 0) break;
      Pack8<T> in[kInputs];
      const T* xr = a.x + m * a.in_cols + k;
      in[0] = load8(xr, vec, valid);
      if constexpr (kSwiGLU) in[1] = load8(xr + a.n, vec, valid);
      if constexpr (kBackward) in[kInputs - 1] = load8(a.dy + m * a.n + k, vec, valid);
      float y0[8], y1[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float x0 = device::load_float(in[0].v[j]);
        const float x1 = kSwiGLU ? device::load_float(in[kSwiGLU ? 1 : 0].v[j]) : 0.0f;
        const float g = kBackward ? device::load_float(in[kInputs - 1].v[j]) : 0.0f;
        y1[j] = 0.0f;
        activation_element<A, kBackward>(x0, x1, g, y0[j], y1[j]);
        // Padding (j >= valid) computes to 0, which leaves the max alone.
        local_amax = max(local_amax, abs_bits(y0[j]));
        if (kOutTiles == 2) local_amax = max(local_amax, abs_bits(y1[j]));
      }
      put_segment<T, F>(a, y0, m, k, valid, r, seg, scale, vec, tiles);
      if constexpr (kOutTiles == 2) {
        put_segment<T, F>(a, y1, m, a.n + k, valid, r, seg, scale, vec, tiles + kTileWords);
      }
    }
    if (a.columnwise) {
      __syncthreads();  // the tiles written
      const int64_t m_end = std::min(a.rows, m0 + kFp8Tile);
      const int64_t cols = std::min<int64_t>(kFp8Tile, a.n - k0);
#pragma unroll
      for (int o = 0; o < kOutTiles; ++o) {
        device::store_tile_columnwise(tiles + o * kTileWords, a.columnwise, a.rows, m0, m_end,
                                      o * a.n + k0, cols, vec_col);
      }
      __syncthreads();  // read before the next tile overwrites them
    }
  }
  if (amax) device::fold_block_amax(local_amax, amax);
  if (scale_inv && blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = div_rn(1.0f, scale);
}

// Resident blocks per SM of a kernel instance with `smem` bytes of tiles (none, or all of them),
// asked once per device.
template <typename Kernel>
int blocks_per_sm(Kernel kernel, int smem, int* cache) {
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 0 || dev >= 64) dev = 0;
  if (cache[dev] == 0) {
    int n = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, smem);
    cache[dev] = std::max(n, 1);  // a race only stores the same value twice
  }
  return cache[dev];
}

template <Activation A, bool kBackward, Fp8Format F, typename T>
void launch(const ActivationCastParams& p, cudaStream_t stream) {
  const auto kernel = activation_cast_kernel<A, kBackward, F, T>;
  constexpr int kOutTiles = A == Activation::kSwiGLU && kBackward ? 2 : 1;
  static int cache[2][64] = {};  // [with tiles][device]
  Args<T> a{static_cast<const T*>(p.input),
            static_cast<const T*>(p.grad),
            p.rows,
            p.n,
            p.in_cols(),
            p.out_cols(),
            p.rowwise,
            p.columnwise,
            static_cast<T*>(p.out)};
  using device::aligned;
  const bool vec = p.n % 8 == 0 && aligned(a.x, 16) && (!kBackward || aligned(a.dy, 16)) &&
                   aligned(a.out, 16) && aligned(a.rowwise, 8);
  const bool vec_col = p.rows % 16 == 0 && aligned(a.columnwise, 16);
  // Only column-wise output goes through the shared tiles (at most 32 KiB: no opt-in needed).
  const bool with_tiles = p.columnwise != nullptr;
  const int smem = with_tiles ? kOutTiles * kTileBytes : 0;
  const int64_t tiles = ((p.rows + kFp8Tile - 1) / kFp8Tile) * ((p.n + kFp8Tile - 1) / kFp8Tile);
  const int64_t resident =
      int64_t{current_sm_count()} * blocks_per_sm(kernel, smem, cache[with_tiles]);
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min(tiles, resident)));
  // Only the amax pass of current scaling writes no output.
  const bool amax_pass = !p.rowwise && !p.columnwise && !p.out;
  kernel<<<grid, kThreads, smem, stream>>>(a, scale_source(p), p.amax, p.scale_inv, vec, vec_col,
                                           !amax_pass);
}

template <Fp8Format F, typename T>
void launch_activation(const ActivationCastParams& p, cudaStream_t stream) {
  if (p.activation == Activation::kGelu) {
    p.backward ? launch<Activation::kGelu, true, F, T>(p, stream)
               : launch<Activation::kGelu, false, F, T>(p, stream);
  } else {
    p.backward ? launch<Activation::kSwiGLU, true, F, T>(p, stream)
               : launch<Activation::kSwiGLU, false, F, T>(p, stream);
  }
}

}  // namespace

cudaError_t activation_cast_cuda(const ActivationCastParams& p, cudaStream_t stream) {
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (p.format == Fp8Format::kE4M3) {
      launch_activation<Fp8Format::kE4M3, T>(p, stream);
    } else {
      launch_activation<Fp8Format::kE5M2, T>(p, stream);
    }
  });
  return cudaGetLastError();
}

}  // namespace tpfp8
