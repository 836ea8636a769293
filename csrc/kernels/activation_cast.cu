// Activation fused with the FP8 casts (activation_cast.h), over 128x128 tiles of act(x)'s
// [rows, n]; each block loops over tiles.
//
// A tile: each thread takes 8 row segments of 8 columns (a warp: 2 rows x 128 columns, so
// every global access covers whole 128-byte lines), loads its inputs for several segments at
// once straight into registers (16-byte loads, kLoadBytes in flight per thread), computes the
// activation in fp32, and writes the high-precision output, the row-wise FP8 bytes, and the
// bytes into a shared FP8 tile that is then stored column-wise (fp8_tile.cuh). SwiGLU's
// backward makes two output tiles per tile, columns k and n + k of dx.
//
// The inputs are read once and the activation is never written in high precision unless
// asked for. The exact math (exp and erf from correctly rounded operations, no FMA) costs an
// estimated 60-90 fp32 instructions an element, while an H200 at copy bandwidth gives bf16
// GELU forward ~30: the kernel may well be ALU-bound there (not measured yet; allowing
// explicit, correctly rounded FMAs in activation_math.h would halve the polynomials).
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
// Input bytes a thread loads before computing on any of them: enough in flight per SM to
// cover DRAM latency with 2-3 resident blocks, few enough registers to keep them resident.
constexpr int kLoadBytes = 128;

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
__device__ __forceinline__ Pack8<T> load8(const T* p, bool vec, int64_t valid) {
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
__device__ __forceinline__ void store8(T* p, const float* y, bool vec, int64_t valid) {
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
                                            int64_t col, int64_t valid, int r, int seg, float scale,
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
__global__ void __launch_bounds__(kThreads, 2)
    activation_cast_kernel(Args<T> a, ScaleSource scale_src, float* amax, float* scale_inv,
                           bool vec, bool vec_col, bool reverse) {
  constexpr bool kSwiGLU = A == Activation::kSwiGLU;
  constexpr int kOutTiles = kSwiGLU && kBackward ? 2 : 1;
  constexpr int kInputs = 1 + kSwiGLU + kBackward;  // x0, x1 (SwiGLU), dy (backward)
  constexpr int kBatch =
      std::max(1, std::min(kPasses, kLoadBytes / (kInputs * 8 * int(sizeof(T)))));
  static_assert(kPasses % kBatch == 0, "batches must tile the passes");
  // 16-byte aligned: rows are written as 8-byte words.
  __shared__ __align__(16) uint32_t tiles[kOutTiles][kFp8Tile * device::kFp8TileWords];

  const float scale = scale_src.resolve(F);
  const int seg = threadIdx.x % kSegmentsPerRow, row0 = threadIdx.x / kSegmentsPerRow;
  const int tiles_k = static_cast<int>((a.n + kFp8Tile - 1) / kFp8Tile);
  const int num_tiles = tiles_k * static_cast<int>((a.rows + kFp8Tile - 1) / kFp8Tile);
  uint32_t local_amax = 0;
  for (int item = blockIdx.x; item < num_tiles; item += gridDim.x) {
    // The cast pass after current scaling's amax pass goes backwards: it starts on what the
    // amax pass read last, which L2 still holds.
    const int tile = reverse ? num_tiles - 1 - item : item;
    const int64_t m0 = int64_t{tile / tiles_k} * kFp8Tile;
    const int64_t k0 = int64_t{tile % tiles_k} * kFp8Tile;
    const int64_t k = k0 + seg * 8;
    const int64_t valid = std::min<int64_t>(8, a.n - k);  // columns of this segment inside
#pragma unroll
    for (int p0 = 0; p0 < kPasses; p0 += kBatch) {
      Pack8<T> in[kBatch][kInputs];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int64_t m = m0 + row0 + (p0 + b) * kRowsPerPass;
        const int64_t v = m < a.rows ? valid : 0;
        const T* xr = a.x + m * a.in_cols + k;
        in[b][0] = load8(xr, vec, v);
        if constexpr (kSwiGLU) in[b][1] = load8(xr + a.n, vec, v);
        if constexpr (kBackward) in[b][kInputs - 1] = load8(a.dy + m * a.n + k, vec, v);
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int r = row0 + (p0 + b) * kRowsPerPass;
        const int64_t m = m0 + r;
        float y0[8], y1[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float x0 = device::load_float(in[b][0].v[j]);
          const float x1 = kSwiGLU ? device::load_float(in[b][kSwiGLU ? 1 : 0].v[j]) : 0.0f;
          const float g = kBackward ? device::load_float(in[b][kInputs - 1].v[j]) : 0.0f;
          y1[j] = 0.0f;
          activation_element<A, kBackward>(x0, x1, g, y0[j], y1[j]);
          // Padding computes to 0, which leaves the max alone.
          local_amax = max(local_amax, abs_bits(y0[j]));
          if (kOutTiles == 2) local_amax = max(local_amax, abs_bits(y1[j]));
        }
        // Rows past the edge leave stale bytes in the shared tile, which are never stored.
        if (m >= a.rows || valid <= 0) continue;
        put_segment<T, F>(a, y0, m, k, valid, r, seg, scale, vec, tiles[0]);
        if constexpr (kOutTiles == 2) {
          put_segment<T, F>(a, y1, m, a.n + k, valid, r, seg, scale, vec, tiles[1]);
        }
      }
    }
    if (a.columnwise) {
      __syncthreads();  // the tiles written
      const int64_t m_end = std::min(a.rows, m0 + kFp8Tile);
      const int64_t cols = std::min<int64_t>(kFp8Tile, a.n - k0);
#pragma unroll
      for (int o = 0; o < kOutTiles; ++o) {
        device::store_tile_columnwise(tiles[o], a.columnwise, a.rows, m0, m_end, o * a.n + k0, cols,
                                      vec_col);
      }
      __syncthreads();  // read before the next tile overwrites them
    }
  }
  if (amax) device::fold_block_amax(local_amax, amax);
  if (scale_inv && blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = div_rn(1.0f, scale);
}

// Resident blocks per SM of a kernel instance on the current device, asked once per device.
template <typename Kernel>
int blocks_per_sm(Kernel kernel, int* cache) {
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 0 || dev >= 64) dev = 0;
  if (cache[dev] == 0) {
    int n = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, 0);
    cache[dev] = std::max(n, 1);  // a race only stores the same value twice
  }
  return cache[dev];
}

template <Activation A, bool kBackward, Fp8Format F, typename T>
void launch(const ActivationCastParams& p, cudaStream_t stream) {
  const auto kernel = activation_cast_kernel<A, kBackward, F, T>;
  static int cache[64] = {};
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
  const int64_t tiles = ((p.rows + kFp8Tile - 1) / kFp8Tile) * ((p.n + kFp8Tile - 1) / kFp8Tile);
  const int64_t resident = int64_t{current_sm_count()} * blocks_per_sm(kernel, cache);
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min(tiles, resident)));
  // Only the amax pass of current scaling writes no output.
  const bool amax_pass = !p.rowwise && !p.columnwise && !p.out;
  kernel<<<grid, kThreads, 0, stream>>>(a, scale_source(p), p.amax, p.scale_inv, vec, vec_col,
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
