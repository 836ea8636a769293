// LayerNorm / RMSNorm backward (norm_backward.h).
//
// A block of kNormLanes threads takes one band of rows, one row at a time, holding x and dy in
// registers as 8-element vector loads (the row reduction order of norm_backward.h follows from
// that layout); while it reduces and stores one row, the next row's loads are in flight, and
// one thread keeps the rows after it asked of L2 (bulk prefetch), so those loads meet L2: a
// band is one block's serial work, and only ~2 blocks share an SM at 256 bands. Each
// row needs one reduction (the sums of g and g * xhat, together), then dx is computed from the
// registers. Each thread also adds its own columns' dgamma / dbeta terms over the band's rows,
// in registers (hidden <= 4096) or in its own slots of shared memory (larger rows, which would
// not leave registers for the row), and writes them as the band's row of `partial`; a second
// kernel sums the bands.
//
// Traffic per element, bf16: read x 2 + dy 2 (+ dx_add 2), write dx 2 = 6 B (8 B), plus 16 B per
// band and column for the partials (written, read back: at most 256 bands up to 32768 rows, so ~8%
// at [8192, 4096]).
#include <cuda_runtime.h>

#include <algorithm>

#include "cast_device.cuh"
#include "norm_backward.h"

namespace tpfp8 {
namespace {

constexpr int kWarps = kNormLanes / 32;
constexpr int kSumColumns = 32;  // columns per block of the band-sum kernel
constexpr int kSumThreads = kSumColumns * kNormBwdGroups;
constexpr int kSumBatch = 16;  // band rows a thread of it loads at once
// x and dy an SM keeps asked of L2 ahead: one row pair at hidden >= 2048. More is slower (96 KB:
// 6-9 % at hidden 2048 and 4096 on the H200), none slower still (5 %).
constexpr int64_t kAheadBytes = 16 << 10;
constexpr int64_t kMaxAhead = 8;

struct Args {
  NormBackwardParams p;
  int64_t band_rows;
  int64_t bands;
  bool vec;          // dy, x, dx (dx_add) 16-byte aligned: whole chunks as vector accesses
  bool vec_gamma;    // gamma 16-byte aligned
  bool vec_partial;  // partial 16-byte aligned
  int ahead;         // rows past the next that a block keeps asked of L2 (0: none)
};

// Column sums held in registers (few chunks) or in shared memory (many): the lane's slots are
// [dgamma, dbeta][chunk][half of 8 columns]; in shared memory a slot's float4s of consecutive
// lanes are adjacent (no bank conflicts).
template <int kChunks>
struct ColumnSums {
  static constexpr bool kShared = kChunks > 2;
  static constexpr int kSlots = 2 * kChunks * 2;
  float4 reg[kShared ? 1 : kSlots];
  float4* smem;

  __device__ __forceinline__ float4& at(int which, int k, int half) {
    const int i = (which * kChunks + k) * 2 + half;
    if constexpr (kShared) {
      return smem[i * kNormLanes + threadIdx.x];
    } else {
      return reg[i];
    }
  }
  __device__ __forceinline__ void zero(int which, int k) {
    at(which, k, 0) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    at(which, k, 1) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  __device__ __forceinline__ void add(int which, int k, const float (&t)[8]) {
    float4 lo = at(which, k, 0), hi = at(which, k, 1);
    lo.x = add_rn(lo.x, t[0]), lo.y = add_rn(lo.y, t[1]);
    lo.z = add_rn(lo.z, t[2]), lo.w = add_rn(lo.w, t[3]);
    hi.x = add_rn(hi.x, t[4]), hi.y = add_rn(hi.y, t[5]);
    hi.z = add_rn(hi.z, t[6]), hi.w = add_rn(hi.w, t[7]);
    at(which, k, 0) = lo, at(which, k, 1) = hi;
  }
  // Dynamic shared memory of a block: the slots of the outputs asked for (dbeta is slot set 1).
  static int smem_bytes(const NormBackwardParams& p) {
    if (!kShared) return 0;
    const int sets = p.dbeta ? 2 : p.dgamma ? 1 : 0;
    return sets * kChunks * 2 * kNormLanes * static_cast<int>(sizeof(float4));
  }
};

// Eight elements of T as 32-bit words, two to a word for 16-bit types: a struct of eight
// 16-bit fields would take a register per element.
template <typename T>
struct Chunk {
  static constexpr int kWords = 2 * sizeof(T);
  uint32_t w[kWords];
};

__device__ __forceinline__ uint32_t bits_of(float x) { return __float_as_uint(x); }
__device__ __forceinline__ uint32_t bits_of(bf16_t x) { return x.bits; }
__device__ __forceinline__ uint32_t bits_of(fp16_t x) { return x.bits; }

template <typename T>
__device__ __forceinline__ T of_bits(uint32_t b) {
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(b);
  } else {
    return T{static_cast<uint16_t>(b)};
  }
}

template <typename T>
__device__ __forceinline__ uint32_t element_bits(const Chunk<T>& c, int j) {
  if constexpr (sizeof(T) == 4) {
    return c.w[j];
  } else {
    return j % 2 ? c.w[j / 2] >> 16 : c.w[j / 2] & 0xFFFFu;
  }
}

template <typename T>
__device__ __forceinline__ float element(const Chunk<T>& c, int j) {
  return device::load_float(of_bits<T>(element_bits(c, j)));
}

// Element j of a chunk being assembled in order (j even first for 16-bit types).
template <typename T>
__device__ __forceinline__ void set_element(Chunk<T>& c, int j, T v) {
  if constexpr (sizeof(T) == 4) {
    c.w[j] = bits_of(v);
  } else if (j % 2 == 0) {
    c.w[j / 2] = bits_of(v);
  } else {
    c.w[j / 2] |= bits_of(v) << 16;
  }
}

template <typename T>
__device__ __forceinline__ Chunk<T> load_chunk(const T* src, bool vec) {
  Chunk<T> c;
  if (vec) {
#pragma unroll
    for (int i = 0; i < Chunk<T>::kWords / 4; ++i) {
      const uint4 u = reinterpret_cast<const uint4*>(src)[i];
      c.w[4 * i] = u.x, c.w[4 * i + 1] = u.y, c.w[4 * i + 2] = u.z, c.w[4 * i + 3] = u.w;
    }
    return c;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) set_element(c, j, src[j]);
  return c;
}

template <typename T>
__device__ __forceinline__ void store_chunk(T* dst, const Chunk<T>& c, bool vec) {
  if (vec) {
#pragma unroll
    for (int i = 0; i < Chunk<T>::kWords / 4; ++i) {
      reinterpret_cast<uint4*>(dst)[i] =
          make_uint4(c.w[4 * i], c.w[4 * i + 1], c.w[4 * i + 2], c.w[4 * i + 3]);
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) dst[j] = of_bits<T>(element_bits(c, j));
}

// Eight fp32 values, read-only and reused by every row (gamma).
__device__ __forceinline__ void load_gamma8(const float* src, bool vec, float (&dst)[8]) {
  if (vec) {
    const float4 lo = __ldg(reinterpret_cast<const float4*>(src));
    const float4 hi = __ldg(reinterpret_cast<const float4*>(src) + 1);
    dst[0] = lo.x, dst[1] = lo.y, dst[2] = lo.z, dst[3] = lo.w;
    dst[4] = hi.x, dst[5] = hi.y, dst[6] = hi.z, dst[7] = hi.w;
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) dst[j] = __ldg(src + j);
}

__device__ __forceinline__ void store_partial8(float* dst, float4 lo, float4 hi, bool vec) {
  if (vec) {
    reinterpret_cast<float4*>(dst)[0] = lo;
    reinterpret_cast<float4*>(dst)[1] = hi;
    return;
  }
  dst[0] = lo.x, dst[1] = lo.y, dst[2] = lo.z, dst[3] = lo.w;
  dst[4] = hi.x, dst[5] = hi.y, dst[6] = hi.z, dst[7] = hi.w;
}

// A lane's chunks of one row of x and dy, with the row's statistics.
template <typename T, int kChunks>
struct Row {
  Chunk<T> x[kChunks], dy[kChunks];
  float mean, rstd;
};

__device__ __forceinline__ bool owns(int k, int64_t hidden) {
  return (static_cast<int64_t>(threadIdx.x) + int64_t{k} * kNormLanes) * 8 < hidden;
}
__device__ __forceinline__ int64_t column(int k) {
  return (static_cast<int64_t>(threadIdx.x) + int64_t{k} * kNormLanes) * 8;
}

template <typename T, int kChunks>
__device__ __forceinline__ void load_row(const Args& a, int64_t r, Row<T, kChunks>& row) {
  const NormBackwardParams& p = a.p;
  const T* x = static_cast<const T*>(p.x) + r * p.hidden;
  const T* dy = static_cast<const T*>(p.dy) + r * p.hidden;
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    if (!owns(k, p.hidden)) continue;
    row.x[k] = load_chunk(x + column(k), a.vec);
    row.dy[k] = load_chunk(dy + column(k), a.vec);
  }
  row.mean = p.norm == NormType::kLayerNorm ? p.mean[r] : 0.0f;
  row.rstd = p.rstd[r];
}

// Sums of the block's lane partials (both components) in norm_backward.h's order, the same in
// every lane. `buf` holds two slots that consecutive reductions alternate, so one barrier per
// reduction suffices: a slot is rewritten only after every lane passed the next barrier.
__device__ __forceinline__ float2 block_sum2(float2 s, float2 (*buf)[kWarps], int& parity) {
#pragma unroll
  for (int offset = 16; offset >= 1; offset /= 2) {
    s.x = add_rn(s.x, __shfl_xor_sync(0xFFFFFFFFu, s.x, offset));
    s.y = add_rn(s.y, __shfl_xor_sync(0xFFFFFFFFu, s.y, offset));
  }
  float2* slot = buf[parity];
  parity ^= 1;
  if (threadIdx.x % 32 == 0) slot[threadIdx.x / 32] = s;
  __syncthreads();
  float2 total = slot[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) {
    total.x = add_rn(total.x, slot[w].x);
    total.y = add_rn(total.y, slot[w].y);
  }
  return total;
}

// Row r's dx from its x and dy in registers; adds its dgamma / dbeta terms to `sums`.
template <typename T, int kChunks>
__device__ __forceinline__ void backward_row(const Args& a, int64_t r, const Row<T, kChunks>& row,
                                             ColumnSums<kChunks>& sums, float2 (*red)[kWarps],
                                             int& parity) {
  const NormBackwardParams& p = a.p;
  const int64_t h = p.hidden;
  const NormType n = p.norm;
  float2 s = make_float2(0.0f, 0.0f);
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    if (!owns(k, h)) continue;
    float gamma[8];
    load_gamma8(p.gamma + column(k), a.vec_gamma, gamma);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float xhat = norm_xhat(element(row.x[k], j), row.mean, row.rstd, n);
      const float g = mul_rn(element(row.dy[k], j), gamma[j]);
      if (n == NormType::kLayerNorm) s.x = add_rn(s.x, g);
      s.y = add_rn(s.y, mul_rn(g, xhat));
    }
  }
  const float2 total = block_sum2(s, red, parity);
  const float mean_g = div_rn(total.x, static_cast<float>(h));
  const float mean_gx = div_rn(total.y, static_cast<float>(h));
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    if (!owns(k, h)) continue;
    float gamma[8], dx[8], dgamma[8], dbeta[8];
    load_gamma8(p.gamma + column(k), a.vec_gamma, gamma);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float dy = element(row.dy[k], j);
      const float xhat = norm_xhat(element(row.x[k], j), row.mean, row.rstd, n);
      const float g = mul_rn(dy, gamma[j]);
      dx[j] = norm_dx(g, xhat, row.rstd, mean_g, mean_gx, n);
      dgamma[j] = mul_rn(dy, xhat);
      dbeta[j] = dy;
    }
    if (p.dx_add) {
      const Chunk<T> add = load_chunk(static_cast<const T*>(p.dx_add) + r * h + column(k), a.vec);
#pragma unroll
      for (int j = 0; j < 8; ++j) dx[j] = add_rn(dx[j], element(add, j));
    }
    Chunk<T> out;
    device::round8<T>(dx, out.w);  // from_float<T> of each
    store_chunk(static_cast<T*>(p.dx) + r * h + column(k), out, a.vec);
    if (p.dgamma) sums.add(0, k, dgamma);
    if (p.dbeta) sums.add(1, k, dbeta);
  }
}

// Registers of an instance: the row's words (x and dy, twice with the next row in flight), the
// column sums (registers up to 2 chunks), the reduction's temporaries. Up to 16 words of a row
// the instance fits 2 blocks per SM (128 registers), else 1 (255). The next row goes in flight
// in registers where two rows and the column sums take at most half of them (fp32 rows of 2
// chunks at 2 blocks, or 8 chunks, would spill); the others rely on L2 alone.
template <typename T, int kChunks>
struct Config {
  static constexpr int kRowWords = Chunk<T>::kWords * kChunks;
  static constexpr int kMinBlocks = kRowWords <= 16 ? 2 : 1;
  static constexpr int kSumRegs =
      ColumnSums<kChunks>::kShared ? 0 : 4 * ColumnSums<kChunks>::kSlots;
  static constexpr bool kPrefetch = 2 * 2 * kRowWords + kSumRegs <= (kMinBlocks == 2 ? 64 : 128);
};

template <typename T, int kChunks>
__global__ void __launch_bounds__(kNormLanes, (Config<T, kChunks>::kMinBlocks))
    norm_backward_kernel(const Args a) {
  constexpr bool kPrefetch = Config<T, kChunks>::kPrefetch;
  extern __shared__ float4 sums_smem[];
  __shared__ float2 red[2][kWarps];
  const NormBackwardParams& p = a.p;
  const int64_t h = p.hidden;
  const int64_t band = blockIdx.x;
  const int64_t r0 = band * a.band_rows;
  const int64_t r1 = std::min(p.rows, r0 + a.band_rows);
  ColumnSums<kChunks> sums;
  sums.smem = sums_smem;
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    if (!owns(k, h)) continue;
    if (p.dgamma) sums.zero(0, k);
    if (p.dbeta) sums.zero(1, k);
  }
  // HBM latency is hidden by L2, not registers: one thread asks L2 for the x and dy rows
  // a.ahead past the one loaded into registers, so each row's loads meet L2.
  const int64_t row_bytes = h * static_cast<int64_t>(sizeof(T));
  auto ask_l2 = [&](int64_t r) {
    if (threadIdx.x == 0 && r < r1) {
      device::prefetch_l2(static_cast<const char*>(p.x) + r * row_bytes, row_bytes);
      device::prefetch_l2(static_cast<const char*>(p.dy) + r * row_bytes, row_bytes);
    }
  };
  for (int i = 1; i <= a.ahead; ++i) ask_l2(r0 + i);  // a.ahead == 0: no prefetch
  int parity = 0;
  if constexpr (kPrefetch) {
    // Two register rows in turn (two rows a trip), so the row in flight is never copied: a
    // copy would wait for its loads.
    Row<T, kChunks> ra, rb;
    auto step = [&](int64_t r, const Row<T, kChunks>& row, Row<T, kChunks>& next) {
      if (a.ahead > 0) ask_l2(r + 1 + a.ahead);
      if (r + 1 < r1) load_row(a, r + 1, next);
      backward_row(a, r, row, sums, red, parity);
    };
    if (r0 < r1) load_row(a, r0, ra);
    for (int64_t r = r0; r < r1; r += 2) {
      step(r, ra, rb);
      if (r + 1 < r1) step(r + 1, rb, ra);
    }
  } else {
    for (int64_t r = r0; r < r1; ++r) {
      if (a.ahead > 0) ask_l2(r + 1 + a.ahead);
      Row<T, kChunks> row;
      load_row(a, r, row);
      backward_row(a, r, row, sums, red, parity);
    }
  }
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    if (!owns(k, h)) continue;
#pragma unroll
    for (int which = 0; which < 2; ++which) {
      if (!(which == 0 ? p.dgamma : p.dbeta)) continue;
      float* dst = p.partial + (which * a.bands + band) * h + column(k);
      store_partial8(dst, sums.at(which, k, 0), sums.at(which, k, 1), a.vec_partial);
    }
  }
}

// out[c] from the bands' rows of partial sums (norm_backward.h's order): warp j adds the bands
// b = j mod 8 of 32 columns, warp 0 adds the 8 group sums. blockIdx.y: dgamma, dbeta.
__global__ void __launch_bounds__(kSumThreads)
    band_sum_kernel(const float* __restrict__ partial, int64_t bands, int64_t hidden,
                    float* __restrict__ dgamma, float* __restrict__ dbeta) {
  __shared__ float group_sums[kNormBwdGroups][kSumColumns];
  float* const out = blockIdx.y == 0 ? dgamma : dbeta;
  if (!out) return;
  const float* src = partial + blockIdx.y * bands * hidden;
  const int lane = threadIdx.x % kSumColumns, group = threadIdx.x / kSumColumns;
  const int64_t c = int64_t{blockIdx.x} * kSumColumns + lane;
  float sum = 0.0f;
  if (c < hidden) {
    // kSumBatch loads in flight before their in-order adds: latency, not bandwidth, bounds this.
    for (int64_t b0 = group; b0 < bands; b0 += kSumBatch * kNormBwdGroups) {
      float v[kSumBatch];
#pragma unroll
      for (int i = 0; i < kSumBatch; ++i) {
        const int64_t b = b0 + int64_t{i} * kNormBwdGroups;
        v[i] = b < bands ? src[b * hidden + c] : 0.0f;
      }
#pragma unroll
      for (int i = 0; i < kSumBatch; ++i) {
        if (b0 + int64_t{i} * kNormBwdGroups < bands) sum = add_rn(sum, v[i]);
      }
    }
  }
  group_sums[group][lane] = sum;
  __syncthreads();
  if (group != 0 || c >= hidden) return;
  sum = 0.0f;
#pragma unroll
  for (int j = 0; j < kNormBwdGroups; ++j) sum = add_rn(sum, group_sums[j][lane]);
  out[c] = from_float<float>(sum);
}

template <typename T, int kChunks>
void launch(Args a, cudaStream_t stream) {
  const auto kernel = norm_backward_kernel<T, kChunks>;
  // Rows asked of L2 ahead: about kAheadBytes of x and dy per SM, over the blocks an SM holds.
  const int64_t sm_count = std::max(1, current_sm_count());
  const int64_t blocks_per_sm =
      std::min<int64_t>(Config<T, kChunks>::kMinBlocks, (a.bands + sm_count - 1) / sm_count);
  const int64_t rows_bytes = 2 * a.p.hidden * static_cast<int64_t>(sizeof(T));
  a.ahead = a.vec ? static_cast<int>(std::clamp<int64_t>(kAheadBytes / (blocks_per_sm * rows_bytes),
                                                         1, kMaxAhead))
                  : 0;
  const int smem = ColumnSums<kChunks>::smem_bytes(a.p);
  if (smem > (48 << 10)) {            // above the default: opt in, once per device and instance
    static bool configured[64] = {};  // a race only makes two threads set the same value
    int dev = 0;
    cudaGetDevice(&dev);
    if (dev < 0 || dev >= 64 || !configured[dev]) {
      const int most = 2 * kChunks * 2 * kNormLanes * static_cast<int>(sizeof(float4));
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, most);
      if (dev >= 0 && dev < 64) configured[dev] = true;
    }
  }
  kernel<<<static_cast<unsigned>(a.bands), kNormLanes, smem, stream>>>(a);
}

}  // namespace

cudaError_t norm_backward_cuda(const NormBackwardParams& p, cudaStream_t stream) {
  if (norm_backward_invalid(p)) return cudaErrorInvalidValue;
  const bool sums = p.dgamma || p.dbeta;
  if (sums && p.rows > 0 && !p.partial) return cudaErrorInvalidValue;
  Args a{};
  a.p = p;
  a.band_rows = norm_backward_band_rows(p.rows);
  a.bands = norm_backward_bands(p.rows);
  a.vec = device::aligned(p.x, 16) && device::aligned(p.dy, 16) && device::aligned(p.dx, 16) &&
          (!p.dx_add || device::aligned(p.dx_add, 16));
  a.vec_gamma = device::aligned(p.gamma, 16);
  a.vec_partial = device::aligned(p.partial, 16);
  if (p.rows > 0) {
    dispatch_dtype(p.dtype, [&](auto tag) {
      using T = decltype(tag);
      if (p.hidden <= kNormLanes * 8 * 2) {
        launch<T, 2>(a, stream);
      } else if (p.hidden <= kNormLanes * 8 * 4) {
        launch<T, 4>(a, stream);
      } else {
        launch<T, kNormMaxChunks>(a, stream);
      }
    });
  }
  if (sums) {
    const dim3 grid(static_cast<unsigned>((p.hidden + kSumColumns - 1) / kSumColumns),
                    p.dbeta ? 2 : 1);
    band_sum_kernel<<<grid, kSumThreads, 0, stream>>>(p.partial, a.bands, p.hidden, p.dgamma,
                                                      p.dbeta);
  }
  return cudaGetLastError();
}

}  // namespace tpfp8
