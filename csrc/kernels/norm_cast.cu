// Fused LayerNorm / RMSNorm -> FP8 cast (norm_cast.h).
//
// A "team" of kNormLanes threads normalizes one row at a time, holding it in registers as
// 8-element vector loads (the reduction order of norm_cast.h follows from that layout); a
// 16-bit input's block has two teams. While a team reduces and stores one row, its next
// row's loads are already in flight. A block walks groups of 16 or 32 rows:
//   1. each team normalizes its rows of the group and stores the high-precision row and the
//      row-wise FP8 codes straight from registers (a warp: 512 / 256 contiguous bytes);
//   2. with column-wise output, the FP8 codes also go to a [group][hidden] shared tile, and
//      after a barrier the block stores it transposed, 16 rows x 4 columns per thread (4x4
//      byte transposes, 16-byte stores), as cast_transpose.cu does for its tiles.
// Row-major tiles need no swizzle: phase 1 writes and phase 2 reads consecutive words.
//
// Traffic per element, bf16 input, FP8 row + column output (B = bytes):
//   delayed scaling, fused:   read x 2 + write FP8 2                  = 4 B (+2 with out)
//   unfused (norm, cast):     read x 2 + write y 2 + read y 2 + FP8 2 = 8 B
//   current scaling, fused:   amax pass read x 2, cast pass 4         = 6 B (+2 with out)
//   unfused (norm, amax, cast): 8 B + read y 2                        = 10 B
// The amax pass rereads the input instead of keeping y: writing y and reading it back costs
// 4 B where rereading x costs 2. Its groups run from the first; the cast pass's from the last,
// so the cast first meets the rows the amax pass left in L2.
#include <cuda_runtime.h>

#include <algorithm>

#include "cast_device.cuh"
#include "norm_cast.h"

namespace tpfp8 {
namespace {

constexpr int kWarpsPerTeam = kNormLanes / 32;
constexpr int kTileBudget = 200 << 10;  // shared bytes for the FP8 tile (227 KB per block max)

template <typename T>
constexpr int teams_for() {
  return sizeof(T) == 4 ? 1 : 2;  // fp32 rows need twice the registers
}

// A lane's chunks of one row; kChunks (4 or 8, of kNormMaxChunks) bounds hidden at
// kNormLanes * 8 * kChunks, so rows of up to 8192 take half the registers.
template <typename T, int kChunks>
struct Row {
  device::Pack8<T> chunk[kChunks];
};

struct Args {
  NormCastParams p;
  int group_rows;       // rows per group: 16 or 32
  bool tile;            // column-wise output goes through the shared tile
  bool columnwise_vec;  // 16-byte column-wise stores (rows % 16 == 0, aligned)
  bool amax_only;
  bool from_end;
};

// Barrier of one team (ids 1, 2; 0 is __syncthreads).
__device__ __forceinline__ void team_sync(int team) {
  asm volatile("bar.sync %0, %1;" ::"r"(team + 1), "r"(kNormLanes) : "memory");
}

// Sum of the team's lane partials in norm_cast.h's order, the same in every lane. `buf` holds
// two slots that consecutive reductions alternate, so one barrier per reduction suffices: a
// slot is rewritten only after every lane passed the next reduction's barrier.
__device__ __forceinline__ float team_sum(float s, float (*buf)[kWarpsPerTeam], int& parity,
                                          int team) {
#pragma unroll
  for (int offset = 16; offset >= 1; offset /= 2) {
    s = add_rn(s, __shfl_xor_sync(0xFFFFFFFFu, s, offset));
  }
  const int lane = threadIdx.x % kNormLanes;
  float* slot = buf[parity];
  parity ^= 1;
  if (lane % 32 == 0) slot[lane / 32] = s;
  team_sync(team);
  float total = slot[0];
#pragma unroll
  for (int w = 1; w < kWarpsPerTeam; ++w) total = add_rn(total, slot[w]);
  return total;
}

template <typename T, int kChunks>
__device__ __forceinline__ void load_row(const T* __restrict__ in, int64_t r, int64_t hidden,
                                         Row<T, kChunks>& row) {
  const int lane = threadIdx.x % kNormLanes;
  const auto* packs = reinterpret_cast<const device::Pack8<T>*>(in + r * hidden);
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    const int c = lane + k * kNormLanes;
    if (c * 8 < hidden) row.chunk[k] = packs[c];
  }
}

// Sums f(x) over the lane's elements in order (norm_cast.h: chunks ascending, then within).
template <typename T, int kChunks, typename F>
__device__ __forceinline__ float lane_sum(const Row<T, kChunks>& row, int64_t hidden, F&& f) {
  const int lane = threadIdx.x % kNormLanes;
  float s = 0.0f;
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    if ((lane + k * kNormLanes) * 8 < hidden) {
#pragma unroll
      for (int j = 0; j < 8; ++j) s = add_rn(s, f(device::load_float(row.chunk[k].v[j])));
    }
  }
  return s;
}

// Eight fp32 values from 32-byte aligned memory (gamma, beta: read-only, reused by every row).
__device__ __forceinline__ void load8(const float* src, float (&dst)[8]) {
  const float4 lo = __ldg(reinterpret_cast<const float4*>(src));
  const float4 hi = __ldg(reinterpret_cast<const float4*>(src) + 1);
  dst[0] = lo.x, dst[1] = lo.y, dst[2] = lo.z, dst[3] = lo.w;
  dst[4] = hi.x, dst[5] = hi.y, dst[6] = hi.z, dst[7] = hi.w;
}

// Normalizes row r (held in `row`) and writes its outputs; `tile_row` is its row of the shared
// FP8 tile, or null.
template <Fp8Format F, typename T, int kChunks>
__device__ __forceinline__ void norm_row(const Row<T, kChunks>& row, int64_t r, const Args& a,
                                         float scale, float (*red)[kWarpsPerTeam], int& parity,
                                         int team, uint32_t& amax, uint8_t* tile_row) {
  const NormCastParams& p = a.p;
  const int64_t h = p.hidden;
  const int lane = threadIdx.x % kNormLanes;
  float mean = 0.0f;
  if (p.norm == NormType::kLayerNorm) {
    const float sum = lane_sum(row, h, [](float x) { return x; });
    mean = div_rn(team_sum(sum, red, parity, team), static_cast<float>(h));
  }
  const float sum_sq = lane_sum(row, h, [&](float x) { return norm_square(x, mean, p.norm); });
  const float rstd = norm_rstd(team_sum(sum_sq, red, parity, team), h, p.eps);
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    const int c = lane + k * kNormLanes;
    if (c * 8 >= h) continue;
    float gs[8], bs[8] = {};
    load8(p.gamma + c * 8, gs);
    if (p.beta) load8(p.beta + c * 8, bs);
    device::Pack8<T> y;
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float x = device::load_float(row.chunk[k].v[j]);
      y.v[j] = from_float<T>(norm_apply(x, mean, rstd, gs[j], bs[j], p.norm));
      const float yf = device::load_float(y.v[j]);
      amax = max(amax, abs_bits(yf));
      v[j] = mul_rn(yf, scale);
    }
    if (a.amax_only) continue;
    const int64_t at = r * h + int64_t{c} * 8;
    if (p.out) *reinterpret_cast<device::Pack8<T>*>(static_cast<T*>(p.out) + at) = y;
    if (!p.rowwise && !p.columnwise) continue;
    const uint2 bytes = make_uint2(device::encode4<F>(v), device::encode4<F>(v + 4));
    if (p.rowwise) *reinterpret_cast<uint2*>(p.rowwise + at) = bytes;
    if (tile_row) {
      *reinterpret_cast<uint2*>(tile_row + c * 8) = bytes;
    } else if (p.columnwise) {  // hidden too large for a tile: byte stores, slow but right
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const uint32_t word = j < 4 ? bytes.x : bytes.y;
        p.columnwise[(int64_t{c} * 8 + j) * p.rows + r] = static_cast<uint8_t>(word >> 8 * (j % 4));
      }
    }
  }
  if (lane == 0 && !a.amax_only) {
    if (p.mean) p.mean[r] = from_float<float>(mean);
    if (p.rstd) p.rstd[r] = from_float<float>(rstd);
  }
}

// Stores the group's FP8 tile ([group_rows][hidden], rows from r0) column-wise.
__device__ void store_columnwise(const uint8_t* tile, int64_t r0, const Args& a) {
  const NormCastParams& p = a.p;
  const int words = static_cast<int>(p.hidden / 4);
  const auto* tile32 = reinterpret_cast<const uint32_t*>(tile);
  const int items = words * (a.group_rows / 16);
  for (int item = threadIdx.x; item < items; item += blockDim.x) {
    const int w = item % words, b = item / words;
    const int64_t rb = r0 + 16 * b;
    if (rb >= p.rows) continue;
    uint32_t cols[4][4];  // [4-row block j][column c]
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t rows4[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) rows4[i] = tile32[(16 * b + 4 * j + i) * words + w];
      device::transpose4x4(rows4, cols[j]);
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      uint8_t* dst = p.columnwise + (int64_t{w} * 4 + c) * p.rows + rb;
      if (a.columnwise_vec) {
        *reinterpret_cast<uint4*>(dst) = make_uint4(cols[0][c], cols[1][c], cols[2][c], cols[3][c]);
      } else {
        const int n = static_cast<int>(std::min<int64_t>(16, p.rows - rb));
        for (int i = 0; i < n; ++i) dst[i] = static_cast<uint8_t>(cols[i / 4][c] >> 8 * (i % 4));
      }
    }
  }
}

template <Fp8Format F, typename T, int kChunks>
__global__ void __launch_bounds__(kNormLanes* teams_for<T>()) norm_cast_kernel(const Args a) {
  constexpr int kTeams = teams_for<T>();
  extern __shared__ uint4 smem[];
  __shared__ float red[kTeams][2][kWarpsPerTeam];
  const NormCastParams& p = a.p;
  const T* in = static_cast<const T*>(p.input);
  const int team = threadIdx.x / kNormLanes;
  uint8_t* const tile = reinterpret_cast<uint8_t*>(smem);
  const float scale = ScaleSource{p.scale, p.scale_amax, p.scale_epsilon}.resolve(F);

  const int64_t groups = (p.rows + a.group_rows - 1) / a.group_rows;
  const int steps = a.group_rows / kTeams;  // rows a team takes per group
  auto first_row = [&](int64_t g) { return (a.from_end ? groups - 1 - g : g) * a.group_rows; };
  auto row_at = [&](int64_t g, int step) { return first_row(g) + team + int64_t{step} * kTeams; };
  uint32_t amax = 0;
  int parity = 0;
  Row<T, kChunks> cur, next;
  if (blockIdx.x < groups && row_at(blockIdx.x, 0) < p.rows) {
    load_row(in, row_at(blockIdx.x, 0), p.hidden, cur);
  }
  for (int64_t g = blockIdx.x; g < groups; g += gridDim.x) {
    for (int step = 0; step < steps; ++step) {
      const int64_t r = row_at(g, step);
      const int64_t g_next = step + 1 < steps ? g : g + gridDim.x;
      const int64_t r_next = row_at(g_next, (step + 1) % steps);
      if (g_next < groups && r_next < p.rows) load_row(in, r_next, p.hidden, next);
      if (r < p.rows) {
        uint8_t* tile_row = a.tile ? tile + (team + step * kTeams) * p.hidden : nullptr;
        norm_row<F>(cur, r, a, scale, red[team], parity, team, amax, tile_row);
      }
      cur = next;
    }
    if (a.tile) {
      __syncthreads();  // the group's tile complete
      store_columnwise(tile, first_row(g), a);
      __syncthreads();  // read before the next group overwrites it
    }
  }
  if (p.amax) device::fold_block_amax(amax, p.amax);
  if (p.scale_inv && !a.amax_only && blockIdx.x == 0 && threadIdx.x == 0) {
    *p.scale_inv = 1.0f / scale;
  }
}

// Blocks of the instance that fit the machine with `smem_bytes` of tile each. The shared-memory
// attribute is per device: set once per instance and device.
template <Fp8Format F, typename T, int kChunks>
int resident_blocks(int smem_bytes) {
  const auto kernel = norm_cast_kernel<F, T, kChunks>;
  static bool configured[64] = {};  // a race only makes two threads set the same value
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 0 || dev >= 64 || !configured[dev]) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kTileBudget);
    if (dev >= 0 && dev < 64) configured[dev] = true;
  }
  int n = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kNormLanes * teams_for<T>(),
                                                smem_bytes);
  return std::max(n, 1) * current_sm_count();
}

template <Fp8Format F, typename T, int kChunks>
void launch(Args a, cudaStream_t stream) {
  const NormCastParams& p = a.p;
  const bool columnwise = p.columnwise && !a.amax_only;
  a.group_rows = columnwise && 32 * p.hidden <= (96 << 10) ? 32 : 16;
  a.tile = columnwise && a.group_rows * p.hidden <= kTileBudget;
  a.columnwise_vec = p.rows % 16 == 0 && device::aligned(p.columnwise, 16);
  const int smem = a.tile ? static_cast<int>(a.group_rows * p.hidden) : 0;
  const int64_t groups = (p.rows + a.group_rows - 1) / a.group_rows;
  const int grid = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(groups, resident_blocks<F, T, kChunks>(smem))));
  norm_cast_kernel<F, T, kChunks><<<grid, kNormLanes * teams_for<T>(), smem, stream>>>(a);
}

cudaError_t run(Args a, cudaStream_t stream) {
  const NormCastParams& p = a.p;
  if (norm_cast_invalid(p)) return cudaErrorInvalidValue;
  // Whole-chunk vector access: 16-byte rows of input / out, 8-byte FP8 rows, float4 gamma.
  const void* need16[] = {p.input, p.out, p.gamma, p.beta};
  for (const void* ptr : need16) {
    if (!device::aligned(ptr, 16)) return cudaErrorMisalignedAddress;
  }
  if (!device::aligned(p.rowwise, 8)) return cudaErrorMisalignedAddress;
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    const bool short_rows = p.hidden <= kNormLanes * 8 * 4;
    if (p.format == Fp8Format::kE4M3) {
      short_rows ? launch<Fp8Format::kE4M3, T, 4>(a, stream)
                 : launch<Fp8Format::kE4M3, T, kNormMaxChunks>(a, stream);
    } else {
      short_rows ? launch<Fp8Format::kE5M2, T, 4>(a, stream)
                 : launch<Fp8Format::kE5M2, T, kNormMaxChunks>(a, stream);
    }
  });
  return cudaGetLastError();
}

}  // namespace

cudaError_t norm_cast_cuda(const NormCastParams& p, cudaStream_t stream) {
  Args a{};
  a.p = p;
  a.from_end = p.scale_amax != nullptr;  // after an amax pass: start where it ended (L2)
  return run(a, stream);
}

cudaError_t norm_cast_amax_cuda(const NormCastParams& p, cudaStream_t stream) {
  if (!p.amax) return cudaErrorInvalidValue;
  Args a{};
  a.p = amax_pass_params(p);
  a.amax_only = true;
  return run(a, stream);
}

}  // namespace tpfp8
