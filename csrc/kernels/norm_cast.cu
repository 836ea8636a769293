// Fused LayerNorm / RMSNorm -> FP8 cast (norm_cast.h).
//
// A "team" of norm_lanes(hidden) threads (128 or 256) normalizes one row at a time, holding it
// in registers as 8-element chunks (the reduction order of norm_cast.h follows from that
// layout; split rows, below, keep it with half the lanes in each of two blocks). A block has 1 to 8
// teams, whichever keeps the most warps resident, and walks groups of 8, 16 or 32 rows:
//   1. each team normalizes its rows of the group and stores the high-precision row and the
//      row-wise FP8 codes straight from registers (a warp: 512 / 256 contiguous bytes);
//   2. with column-wise output, the FP8 codes also go to a [group][hidden] shared tile, and
//      after a barrier the block stores it transposed, 16 (8-row groups: 8) rows x 4 columns
//      per thread (4x4 byte transposes, 16-byte stores), as cast_transpose.cu does for its tiles.
//      Rows wider than 4096 keep 32-row groups. Rows of 8192 are split over the two blocks of
//      a cluster where that measured faster (split_rows): each block holds half of the row's
//      256 lanes, so its own columns fit its tile, and the team sums add the partner's warp
//      partials through distributed shared memory (split_post / split_collect). Other wide
//      rows put their first 4096 columns in the tile and read the rest back slice by slice
//      from the row-wise codes just written (L2).
// Row-major tiles need no swizzle: phase 1 writes consecutive words and phase 2 reads them
// (two-way conflicts for 32-row groups, whose two 16-row halves go to adjacent threads).
//
// Latency without registers: each thread copies its chunks of the team's next row into shared
// memory (cp.async) while the team reduces and stores the current one. A row in flight in
// registers would cost 16 of the 64 registers that let 1024 threads share an SM. Nothing is
// asked of L2 further ahead: a bulk prefetch of 64 KB per SM made every instance slower (4-10 %;
// 128 and 256 KB slower still), most likely by scattering DRAM accesses over more rows at once.
//
// Traffic per element, bf16 input, FP8 row + column output (B = bytes):
//   delayed scaling, fused:   read x 2 + write FP8 2                  = 4 B (+2 with out)
//   unfused (norm, cast):     read x 2 + write y 2 + read y 2 + FP8 2 = 8 B
//   current scaling, fused:   amax pass read x 2, cast pass 4         = 6 B (+2 with out)
//   unfused (norm, amax, cast): 8 B + read y 2                        = 10 B
// The amax pass rereads the input instead of keeping y: writing y and reading it back costs
// 4 B where rereading x costs 2. Its groups run from the first; the cast pass's from the last,
// so the cast first meets the rows the amax pass left in L2.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <type_traits>

#include "cast_device.cuh"
#include "norm_cast.h"

namespace tpfp8 {
namespace {

constexpr int kMaxTileBytes = 128 << 10;     // a group's FP8 tile, beside the teams' stages
constexpr int kStagedParamBytes = 32 << 10;  // gamma + beta this large go to shared memory
constexpr int kSplitLanes = 128;             // a split row's lanes per block (of 256)

// The rows split over a cluster pair: 4 chunks a lane of 256, 128 lanes a block.
constexpr int kSplitHidden = 2 * kSplitLanes * 8 * 4;

// Columns a block of a split row owns (rank 0 or 1 of its cluster): the chunks of its lanes
// [rank * 128, rank * 128 + 128) of the row's 256, 8 columns each. (Computed, not the constant
// half of kSplitHidden: with the constant, ptxas spilled the staged LayerNorm instances.)
TPFP8_HD constexpr int64_t split_columns(int64_t hidden, int rank) {
  const int64_t chunks = hidden / 8, tail = chunks % kNormLanes - rank * kSplitLanes;
  return (chunks / kNormLanes * kSplitLanes + (tail < 0             ? 0
                                               : tail > kSplitLanes ? kSplitLanes
                                                                    : tail)) *
         8;
}

// Registers: a lane's kChunks 8-element chunks of a row (4; 8 for rows over 8192; 2 or 4 for
// rows of exactly 2048 or 4096) take kRowRegs. The thread bound caps the rest: 64 registers for
// rows of 16 registers or fewer (1024 threads fit an SM), 80 for 32 (768), 128 for 64; tighter
// caps spill. Teams per block: a power of two, as groups are.
template <typename T, int kChunks, int kLanes>
struct Plan {
  static constexpr int kRowRegs = kChunks * 8 * static_cast<int>(sizeof(T)) / 4;
  static constexpr int kMaxThreads = kRowRegs <= 16 ? 1024 : kRowRegs <= 32 ? 768 : 512;
  static constexpr int kMaxTeams = kMaxThreads / kLanes >= 8   ? 8
                                   : kMaxThreads / kLanes >= 4 ? 4
                                   : kMaxThreads / kLanes >= 2 ? 2
                                                               : 1;
};

// A lane's chunks of one row: chunk k's 8 elements in kWords 32-bit words (16-bit elements two
// a word, the first in the low half), as in memory.
template <typename T, int kChunks>
struct Row {
  static constexpr int kWords = 2 * static_cast<int>(sizeof(T));
  static constexpr int kVecs = kWords / 4;  // 16-byte pieces of a chunk
  uint32_t w[kChunks][kWords];
};

struct Args {
  NormCastParams p;
  int group_rows;       // rows per group: 8, 16 or 32
  int teams;            // teams per block: 1, 2, 4 or 8
  int steps;            // group_rows / teams: rows a team takes per group
  int tile_bytes;       // shared FP8 tile (0: none), then gamma and beta, then a stage per team
  int param_bytes;      // gamma (and beta) in shared memory (0: read from global memory)
  int tile_cols;        // columns of the tile: hidden, a slice of it, or a split block's own
  int param_cols;       // floats of staged gamma (and beta): staged_param_cols of own columns
  int walkers;          // blocks (split: clusters) walking the groups
  bool split;           // rows split over a cluster pair (kSplit 2)
  bool columnwise_vec;  // 16-byte (8-row groups: 8-byte) column-wise stores
  bool amax_only;
  bool from_end;
};

// A place in the rows a team normalizes, in order: its block's (split rows: its cluster's)
// groups w, w + walkers, ... (counted from the last one when from_end), in each the rows team,
// team + teams, ... of the group. Stepped rather than computed from a count: no division or
// shift per row.
struct Cursor {
  int64_t g;  // group, in walking order
  int step;   // the team's row of it
  __device__ void advance(const Args& a) {
    if (++step == a.steps) step = 0, g += a.walkers;
  }
};

struct TeamRows {
  const Args& a;
  int64_t groups;
  int team;
  __device__ int64_t group_start(int64_t g) const {
    return (a.from_end ? groups - 1 - g : g) * a.group_rows;
  }
  __device__ int tile_row(const Cursor& c) const { return team + c.step * a.teams; }
  // The row at c, or -1 past the end of the tensor.
  __device__ int64_t row(const Cursor& c) const {
    if (c.g >= groups) return -1;
    const int64_t r = group_start(c.g) + tile_row(c);
    return r < a.p.rows ? r : -1;
  }
};

// Barrier of one team (ids 1..8; 0 is __syncthreads).
template <int kLanes>
__device__ __forceinline__ void team_sync(int team) {
  asm volatile("bar.sync %0, %1;" ::"r"(team + 1), "r"(kLanes) : "memory");
}

// Sum of a warp's lane partials in norm_cast.h's butterfly order, the same in every lane.
__device__ __forceinline__ float warp_sum(float s) {
#pragma unroll
  for (int offset = 16; offset >= 1; offset /= 2) {
    s = add_rn(s, __shfl_xor_sync(0xFFFFFFFFu, s, offset));
  }
  return s;
}

// Sum of the team's lane partials in norm_cast.h's order, the same in every lane. `buf` holds
// two slots that consecutive reductions alternate, so one barrier per reduction suffices: a
// slot is rewritten only after every lane passed the next reduction's barrier.
template <int kLanes>
__device__ __forceinline__ float team_sum(float s, float (*buf)[kLanes / 32], int& parity,
                                          int team) {
  s = warp_sum(s);
  const int lane = threadIdx.x % kLanes;
  float* slot = buf[parity];
  parity ^= 1;
  if (lane % 32 == 0) slot[lane / 32] = s;
  team_sync<kLanes>(team);
  float total = slot[0];
#pragma unroll
  for (int w = 1; w < kLanes / 32; ++w) total = add_rn(total, slot[w]);
  return total;
}

// A split team's view of its warp partials' slots (kSplit 2): two sets of one 64-bit slot per
// warp of the whole row, in this block's shared memory (`local`) and its partner's (`remote`),
// as 32-bit shared-window addresses (with generic pointers the split LayerNorm kernels spilled
// 20-32 B; 4 B remain, a value reloaded once a row); and the team's count of the sums it posted
// (each sum's tag: its count, from 1).
struct SplitSlots {
  uint32_t local;
  uint32_t remote;
  uint32_t posted;
};

// team_sum for a row split over a cluster pair, in two steps, so that work can go between them.
// split_post: each warp stores its partial, with the sum's tag in the high word, in its slot in
// both blocks (one 64-bit store: a reader sees the partial and its tag together). split_collect:
// each warp's first lane waits until every slot of the set shows the tag and adds the partials
// in warp order, the same order and so the same sum in both blocks. A team posts each sum after
// collecting the one before (so it collects the sum it posted last), and sets alternate: a set
// is rewritten two sums on, once every warp of both blocks posted the sum in between, which it
// did after collecting this one. (The accesses are volatile, so relaxed: that order rests on
// each post depending on a poll's result. Acquire / release forms were not measured.)
// kSleep: waiting lanes sleep between looks, for LayerNorm, where spinning took issue slots
// from the working warps (8192 +out 145.6 -> 129.8 us); RMSNorm, not issue-bound, spins (122.8
// against 124.2 us). mbarrier waits were slower than either, and so was LayerNorm spinning on
// one of its two waits a row and sleeping on the other (+out 127.1 -> 129.4-130.7 us).
template <int kLanes>
__device__ __forceinline__ void split_post(float s, SplitSlots& slots, int lane0) {
  constexpr int kWarps = 2 * kLanes / 32;
  s = warp_sum(s);
  const uint32_t tag = ++slots.posted;
  if (threadIdx.x % 32 == 0) {
    const uint64_t tagged = uint64_t{tag} << 32 | __float_as_uint(s);
    const int at = (tag & 1) * kWarps + (lane0 + static_cast<int>(threadIdx.x) % kLanes) / 32;
    asm volatile("st.volatile.shared.u64 [%0], %1;" ::"r"(slots.local + at * 8), "l"(tagged)
                 : "memory");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900  // (no clusters before: never launched)
    asm volatile("st.volatile.shared::cluster.u64 [%0], %1;" ::"r"(slots.remote + at * 8),
                 "l"(tagged)
                 : "memory");
#endif
  }
}
template <int kLanes, bool kSleep>
__device__ __forceinline__ float split_collect(SplitSlots& slots) {
  constexpr int kWarps = 2 * kLanes / 32;
  const uint32_t tag = slots.posted;
  float total = 0.0f;
  if (threadIdx.x % 32 == 0) {
    const uint32_t set = slots.local + (tag & 1) * kWarps * 8;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      uint64_t v;
      while (true) {
        asm volatile("ld.volatile.shared.u64 %0, [%1];" : "=l"(v) : "r"(set + w * 8) : "memory");
        if (static_cast<uint32_t>(v >> 32) == tag) break;
        if (kSleep) __nanosleep(64);
      }
      const float part = __uint_as_float(static_cast<uint32_t>(v));
      total = w == 0 ? part : add_rn(total, part);
    }
  }
  return __shfl_sync(0xFFFFFFFFu, total, 0);
}

// A split block (kSplit 2) copies its lanes' chunks, from lane0 on, of the whole row's layout
// into a stage laid out as its own.
template <typename T, int kChunks, int kLanes, int kSplit>
__device__ __forceinline__ void copy_row_async(const T* row_src, int chunks, uint4* stage,
                                               int lane0) {
  constexpr int kVecs = Row<T, kChunks>::kVecs, kStride = kLanes * kVecs;
  const int lane = threadIdx.x % kLanes;
  const auto* src = reinterpret_cast<const uint4*>(row_src) + (lane0 + lane) * kVecs;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const auto dst = static_cast<uint32_t>(__cvta_generic_to_shared(stage + lane * kVecs));
#endif
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    if (k >= chunks) continue;
#pragma unroll
    for (int q = 0; q < kVecs; ++q) {
      const int at = k * kStride + q, from = k * kStride * kSplit + q;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst + at * 16), "l"(src + from)
                   : "memory");
#else
      stage[lane * kVecs + at] = src[from];
#endif
    }
  }
}
// Waits for the thread's copies (one row at most is in flight).
__device__ __forceinline__ void wait_copies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// Chunk k of the lane's row in its stage (what it copied itself, after wait_copies).
template <int kLanes, typename T, int kChunks>
__device__ __forceinline__ void read_chunk(const uint4* stage, int k,
                                           uint32_t (&w)[Row<T, kChunks>::kWords]) {
  constexpr int kVecs = Row<T, kChunks>::kVecs, kStride = kLanes * kVecs;
  const uint4* src = stage + threadIdx.x % kLanes * kVecs + k * kStride;
#pragma unroll
  for (int q = 0; q < kVecs; ++q) {
    const uint4 v = src[q];
    w[4 * q] = v.x, w[4 * q + 1] = v.y, w[4 * q + 2] = v.z, w[4 * q + 3] = v.w;
  }
}

template <int kLanes, typename T, int kChunks>
__device__ __forceinline__ void read_row(const uint4* stage, int chunks, Row<T, kChunks>& row) {
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    if (k < chunks) read_chunk<kLanes, T, kChunks>(stage, k, row.w[k]);
  }
}

// A chunk's 8 elements x folded in order into the partial s as s = add(s, x).
template <typename T, size_t kWords, typename F>
__device__ __forceinline__ float chunk_sum(float s, const uint32_t (&w)[kWords], F&& add) {
#pragma unroll
  for (int j = 0; j < 8; ++j) s = add(s, device::element<T>(w, j));
  return s;
}

// The lane's partial: its elements folded in order (norm_cast.h: chunks ascending, then within).
template <typename T, int kChunks, typename F>
__device__ __forceinline__ float lane_sum(const Row<T, kChunks>& row, int chunks, F&& add) {
  float s = 0.0f;
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    if (k < chunks) s = chunk_sum<T>(s, row.w[k], add);
  }
  return s;
}

// The row column of a block's tile column t: t itself, unless the row is split over a cluster,
// whose blocks' tiles (and staged gamma and beta) hold their own lanes' chunks in order.
__device__ __forceinline__ int64_t row_column(const Args& a, int lane0, int t) {
  if (!a.split) return t;
  const int chunk = t / 8;
  return (int64_t{chunk / kSplitLanes} * kNormLanes + lane0 + chunk % kSplitLanes) * 8 + t % 8;
}

// lane_sum of the lane's row in its stage, a chunk at a time (registers are short).
template <int kLanes, typename T, int kChunks, typename F>
__device__ __forceinline__ float stage_sum(const uint4* stage, int chunks, F&& add) {
  float s = 0.0f;
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    if (k < chunks) {
      uint32_t w[Row<T, kChunks>::kWords];
      read_chunk<kLanes, T, kChunks>(stage, k, w);
      s = chunk_sum<T>(s, w, add);
    }
  }
  return s;
}

// Staged gamma and beta (each param_cols floats) are float4s in [chunk][half][lane] order: the
// float4 of tile column t (t % 4 == 0) for kLanes lanes. A warp's loads of a half chunk then read
// 512 contiguous bytes; in the row's order (a lane's 8 floats together), lanes 4 apart shared a
// bank: two wavefronts a quarter warp, by count most of LayerNorm's shared-memory wavefronts
// (LayerNorm row+col on the H200, us: 8192 114.7 -> 111.5, 4096 54.3 -> 51.3; +out unchanged).
template <int kLanes>
__device__ __forceinline__ int staged_float4(int t) {
  return (t / (kLanes * 8) * 2 + t / 4 % 2) * kLanes + t / 8 % kLanes;
}
// The floats staged_float4 needs per parameter: own columns rounded up to whole chunks.
inline int staged_param_cols(int64_t own, int lanes) {
  return static_cast<int>((own + lanes * 8 - 1) / (lanes * 8) * (lanes * 8));
}

// gamma's (which 0) or beta's (1) eight values from row column c8 on (column t8 of the
// block's own): from the block's copy in shared memory (kStaged instances), else from global
// memory. An instance per kind: one generic load for both ran 0.5-5 % slower, and a branch
// between the two made LayerNorm spill. Plain global loads, not the read-only path (__ldg): as
// fast or faster (LayerNorm 8192 6 %), and __ldg spilled fp32 LayerNorm 4096.
template <bool kStaged, int kLanes>
__device__ __forceinline__ void load_param8(const Args& a, int which, int c8, int t8,
                                            float (&dst)[8]) {
  const float4* src;  // (one expression for both made fp32 LayerNorm at 4096 spill)
  if constexpr (kStaged) {
    extern __shared__ uint4 smem[];
    src = reinterpret_cast<const float4*>(reinterpret_cast<const uint8_t*>(smem) + a.tile_bytes) +
          which * a.param_cols / 4 + staged_float4<kLanes>(t8);
  } else {
    src = reinterpret_cast<const float4*>((which ? a.p.beta : a.p.gamma) + c8);
  }
  const float4 lo = src[0], hi = src[kStaged ? kLanes : 1];
  dst[0] = lo.x, dst[1] = lo.y, dst[2] = lo.z, dst[3] = lo.w;
  dst[4] = hi.x, dst[5] = hi.y, dst[6] = hi.z, dst[7] = hi.w;
}

// Copies gamma (and beta) to shared memory after the tile, where every row reads them: from
// global memory, a row of LayerNorm at hidden 4096 asks L1 for 32 KB beside its 8 KB of input,
// more than L1 keeps beside the tile.
// A split block copies its own columns (row_column), `own` of them.
template <int kLanes>
__device__ void stage_params(const Args& a, int lane0, int own) {
  extern __shared__ uint4 smem[];
  auto* dst = reinterpret_cast<float4*>(reinterpret_cast<uint8_t*>(smem) + a.tile_bytes);
  const int n = a.param_cols / 4;
  for (int i = threadIdx.x; i < own / 4; i += blockDim.x) {
    const int64_t c4 = row_column(a, lane0, 4 * i) / 4;
    const int at = staged_float4<kLanes>(4 * i);
    dst[at] = __ldg(reinterpret_cast<const float4*>(a.p.gamma) + c4);
    if (a.p.beta) dst[n + at] = __ldg(reinterpret_cast<const float4*>(a.p.beta) + c4);
  }
}

// y = from_float<T>(f) elementwise, in Row's word layout; folds max |y| into `amax`, kept as
// |y|'s own bits (16-bit T: two magnitudes a max). T's rounding leaves one NaN, above every
// other value, so these bits order values as abs_bits(load_float(y)) does (amax_bits converts).
template <typename T>
__device__ __forceinline__ void round_chunk(const float (&f)[8], uint32_t (&y)[2 * sizeof(T)],
                                            uint32_t& amax) {
  const uint32_t m = device::round8<T>(f, y);
  amax = sizeof(T) == 4 ? max(amax, m) : __vmaxu2(amax, m);
}
// round_chunk's amax accumulator as abs_bits of the largest |y|.
template <typename T>
__device__ __forceinline__ uint32_t amax_bits(uint32_t acc) {
  if constexpr (sizeof(T) == 4) {
    return acc;
  } else {
    const T largest{static_cast<uint16_t>(max(acc & 0xFFFFu, acc >> 16))};
    return abs_bits(device::load_float(largest));
  }
}

// Writes row r's outputs, normalized by mean and rstd (the row held in `row`, `chunks` chunks
// of it the lane's); `tile_row` is its row of the shared FP8 tile, or null. hook(k) runs after
// chunk k in every lane, whatever its chunk count (split rows exchange the next row's sums
// there). The lanes of a split block are lane0 + its threads' of the whole row.
template <Fp8Format F, NormType N, int kLanes, int kSplit, bool kStaged, typename T, int kChunks,
          typename Hook>
__device__ __forceinline__ void write_row(const Row<T, kChunks>& row, int chunks, int64_t r,
                                          const Args& a, float scale, int lane0, float mean,
                                          float rstd, uint32_t& amax, uint8_t* tile_row,
                                          Hook&& hook) {
  constexpr int kStride = kLanes * kSplit * 8;  // elements between a lane's chunks in the row
  constexpr int kOwnStride = kLanes * 8;        // ... in the block's tile and staged gamma
  const NormCastParams& p = a.p;
  const int64_t h = p.hidden;
  const int lane = threadIdx.x % kLanes, row_lane = lane0 + lane;
  // Chunk k of the lane is kStride elements (bytes, for FP8) after its chunk 0. Where the row
  // goes is settled once per row: per chunk, those tests and the 64-bit address arithmetic took
  // ~20 of a chunk's ~135 instructions (LayerNorm 8192 row-wise 88 -> 83 us on the H200).
  const int64_t at = r * h + row_lane * 8;
  // (The amax pass's outputs are null already; without the amax_only tests, ptxas spills fp32
  // LayerNorm at 4096.)
  T* const out = a.amax_only ? nullptr : static_cast<T*>(p.out);
  uint8_t* const rowwise = a.amax_only ? nullptr : p.rowwise;
  uint8_t* const tile = tile_row && !a.amax_only ? tile_row + lane * 8 : nullptr;
#pragma unroll
  for (int k = 0; k < kChunks; ++k) {
    if (k > 0) hook(k - 1);
    if (k >= chunks) continue;
    const int c8 = row_lane * 8 + k * kStride;  // the chunk's first column
    const int t8 = lane * 8 + k * kOwnStride;   // ... of the block's own (its tile's)
    float gs[8], bs[8] = {};
    load_param8<kStaged, kLanes>(a, 0, c8, t8, gs);
    if (N == NormType::kLayerNorm && p.beta) load_param8<kStaged, kLanes>(a, 1, c8, t8, bs);
    float f[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      f[j] = norm_apply(device::element<T>(row.w[k], j), mean, rstd, gs[j], bs[j], N);
    }
    uint32_t y[Row<T, kChunks>::kWords];
    round_chunk<T>(f, y, amax);
    if (out) {
      auto* dst = reinterpret_cast<uint4*>(out + at + k * kStride);
      // Evict-first: L2 keeps the FP8 codes that wide rows' column slices read back instead
      // (LayerNorm 8192 with column-wise output and out 147 -> 137 us; split rows read nothing
      // back, and were measured with it).
#pragma unroll
      for (int q = 0; q < Row<T, kChunks>::kVecs; ++q) {
        __stcs(dst + q, make_uint4(y[4 * q], y[4 * q + 1], y[4 * q + 2], y[4 * q + 3]));
      }
    }
    if (!rowwise && !tile) continue;
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = mul_rn(device::element<T>(y, j), scale);
    const uint2 bytes = make_uint2(device::encode4<F>(v), device::encode4<F>(v + 4));
    if (rowwise) *reinterpret_cast<uint2*>(rowwise + at + k * kStride) = bytes;
    if (tile && t8 < a.tile_cols) *reinterpret_cast<uint2*>(tile + k * kOwnStride) = bytes;
  }
  hook(kChunks - 1);
  if (row_lane == 0 && !a.amax_only) {
    if (p.mean) p.mean[r] = from_float<float>(mean);
    if (p.rstd) p.rstd[r] = from_float<float>(rstd);
  }
}

// Normalizes row r (held in `row`, `chunks` chunks of it the lane's) and writes its outputs
// (write_row), its mean and rstd summed by `reduce` (team_sum). `row_read` runs once the first
// team-wide sum is done: every lane has used its copy of the row by then, so its stage may be
// refilled.
template <Fp8Format F, NormType N, int kLanes, bool kStaged, typename T, int kChunks,
          typename Reduce, typename Next>
__device__ __forceinline__ void norm_row(const Row<T, kChunks>& row, int chunks, int64_t r,
                                         const Args& a, float scale, Reduce&& reduce,
                                         uint32_t& amax, uint8_t* tile_row, Next&& row_read) {
  const int64_t h = a.p.hidden;
  float mean = 0.0f;
  if constexpr (N == NormType::kLayerNorm) {
    const float sum = lane_sum(row, chunks, [](float s, float x) { return add_rn(s, x); });
    mean = div_rn(reduce(sum), static_cast<float>(h));
    row_read();
  }
  const float sum_sq =
      lane_sum(row, chunks, [&](float s, float x) { return norm_square_add(s, x, mean, N); });
  const float rstd = norm_rstd(reduce(sum_sq), h, a.p.eps);
  if constexpr (N == NormType::kRMSNorm) row_read();
  write_row<F, N, kLanes, 1, kStaged>(row, chunks, r, a, scale, 0, mean, rstd, amax, tile_row,
                                      [](int) {});
}

// Stores the group's FP8 tile ([group_rows][tile_cols], rows from r0, its first `cols` columns
// being columns col0 + row_column(..)) column-wise, kBlock rows (16, or 8 for 8-row groups) x 4
// columns per thread item. A 32-row group's two 16-row blocks of a column go to adjacent
// threads, so a warp's stores fill whole 32-byte sectors.
template <int kBlock>
__device__ void store_columnwise(const uint8_t* tile, int64_t r0, int64_t col0, int cols,
                                 const Args& a, int lane0) {
  constexpr int kQuads = kBlock / 4;
  const NormCastParams& p = a.p;
  const int words = a.tile_cols / 4;
  const auto* tile32 = reinterpret_cast<const uint32_t*>(tile);
  const int log_blocks = a.group_rows > kBlock ? 1 : 0;
  const int items = (cols / 4) << log_blocks;
  for (int item = threadIdx.x; item < items; item += blockDim.x) {
    const int b = item & ((1 << log_blocks) - 1), w = item >> log_blocks;
    const int64_t rb = r0 + kBlock * b;
    if (rb >= p.rows) continue;
    uint32_t cols[kQuads][4];  // [4-row block j][column c]
#pragma unroll
    for (int j = 0; j < kQuads; ++j) {
      uint32_t rows4[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) rows4[i] = tile32[(kBlock * b + 4 * j + i) * words + w];
      device::transpose4x4(rows4, cols[j]);
    }
    const int64_t col = col0 + row_column(a, lane0, 4 * w);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      uint8_t* dst = p.columnwise + (col + c) * p.rows + rb;
      if (a.columnwise_vec) {
        if constexpr (kBlock == 16) {
          *reinterpret_cast<uint4*>(dst) =
              make_uint4(cols[0][c], cols[1][c], cols[2][c], cols[3][c]);
        } else {
          *reinterpret_cast<uint2*>(dst) = make_uint2(cols[0][c], cols[1][c]);
        }
      } else {
        const int64_t n = p.rows - rb;
#pragma unroll
        for (int i = 0; i < kBlock; ++i) {  // unrolled: cols stays in registers
          if (i < n) dst[i] = static_cast<uint8_t>(cols[i / 4][c] >> 8 * (i % 4));
        }
      }
    }
  }
}

// Copies columns col0 .. col0 + cols of the group's row-wise FP8 codes (global memory, just
// written by this block: the barrier before makes them visible) into the tile, 8 bytes a copy,
// asynchronously (all of a thread's copies in flight at once, no registers held; a load at a
// time, each waited for, took ~10 % of the kernel at hidden 8192); waits for them. A warp takes
// a row: 256 contiguous bytes a copy instruction.
__device__ void load_tile_rowwise(uint8_t* tile, int64_t r0, int64_t col0, int cols,
                                  const Args& a) {
  const NormCastParams& p = a.p;
  const int pieces = cols / 8;
  for (int row = threadIdx.x / 32; row < a.group_rows; row += blockDim.x / 32) {
    if (r0 + row >= p.rows) break;  // (rows past the end are never stored)
    const auto* src = reinterpret_cast<const uint2*>(p.rowwise + (r0 + row) * p.hidden + col0);
    auto* dst = reinterpret_cast<uint2*>(tile + row * a.tile_cols);
    for (int piece = threadIdx.x % 32; piece < pieces; piece += 32) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
      const auto d = static_cast<uint32_t>(__cvta_generic_to_shared(dst + piece));
      asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(d), "l"(src + piece)
                   : "memory");
#else
      dst[piece] = src[piece];
#endif
    }
  }
  wait_copies();
}

// Stores the group's column-wise output once the tile holds its rows (after a barrier). A tile
// narrower than the rows holds their first tile_cols columns; the rest follow slice by slice
// from the row-wise codes, which L2 still holds: 32-row groups (whole column-wise sectors) for
// rows too wide for a 32-row tile, at the price of an L2 read of the codes. A split block's tile
// holds all its `own` columns.
__device__ void store_group(uint8_t* tile, int64_t r0, const Args& a, int lane0, int own) {
  const int64_t width = a.split ? own : a.p.hidden;
  for (int64_t col0 = 0; col0 < width; col0 += a.tile_cols) {
    const int cols = static_cast<int>(std::min<int64_t>(a.tile_cols, width - col0));
    if (col0 > 0) {
      __syncthreads();  // the previous slice read
      load_tile_rowwise(tile, r0, col0, cols, a);
      __syncthreads();  // this slice loaded
    }
    a.group_rows == 8 ? store_columnwise<8>(tile, r0, col0, cols, a, lane0)
                      : store_columnwise<16>(tile, r0, col0, cols, a, lane0);
  }
}

// kWhole: every lane holds exactly kChunks chunks (hidden = kLanes * kSplit * 8 * kChunks), a
// constant, so the chunk loops carry no bounds tests. kSplit 2: a cluster pair shares each row,
// the block of rank 0 or 1 holding lanes [rank * kLanes, rank * kLanes + kLanes) of its
// kLanes * 2 (launched as clusters of 2, and only with a tile).
template <Fp8Format F, NormType N, typename T, int kChunks, bool kWhole, int kLanes, bool kStaged,
          int kSplit>
__global__ void __launch_bounds__(Plan<T, kChunks, kLanes>::kMaxThreads)
    norm_cast_kernel(const Args a) {
  using P = Plan<T, kChunks, kLanes>;
  constexpr int kRowLanes = kLanes * kSplit;
  extern __shared__ uint4 smem[];
  __shared__ float red[P::kMaxTeams][2][kLanes / 32];
  __shared__ uint64_t slots[kSplit > 1 ? P::kMaxTeams : 1][kSplit > 1 ? 2 * kRowLanes / 32 : 1];
  const NormCastParams& p = a.p;
  const T* in = static_cast<const T*>(p.input);
  const int team = threadIdx.x / kLanes;
  int rank = 0;  // in the cluster
  SplitSlots split{};
  if constexpr (kSplit > 1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    (void)slots;
    __trap();  // no clusters before sm_90: the launcher finds none and never sends rows here
#else
    namespace cg = cooperative_groups;
    const cg::cluster_group cluster = cg::this_cluster();
    rank = static_cast<int>(cluster.block_rank());
    for (int i = threadIdx.x; i < P::kMaxTeams * 2 * kRowLanes / 32; i += blockDim.x) {
      (&slots[0][0])[i] = 0;
    }
    split.local = static_cast<uint32_t>(__cvta_generic_to_shared(slots[team]));
    asm("mapa.shared::cluster.u32 %0, %1, %2;"
        : "=r"(split.remote)
        : "r"(split.local), "r"(rank ^ 1));
    cluster.sync();  // both blocks' slots cleared before either stores to the other's
#endif
  }
  const int lane0 = rank * kLanes;
  const int own = kSplit > 1 ? static_cast<int>(split_columns(p.hidden, rank)) : 0;
  uint8_t* const tile = reinterpret_cast<uint8_t*>(smem);
  const int64_t row_bytes = (kSplit > 1 ? a.tile_cols : p.hidden) * int64_t{sizeof(T)};
  uint4* const stage =
      reinterpret_cast<uint4*>(tile + a.tile_bytes + a.param_bytes + team * row_bytes);
  const float scale = ScaleSource{p.scale, p.scale_amax, p.scale_epsilon}.resolve(F);
  const int64_t groups = (p.rows + a.group_rows - 1) / a.group_rows;
  const TeamRows rows{a, groups, team};

  // Row i + 1 is copied to the stage while row i is normalized. The lane's chunks of a row:
  // c = lane0 + lane, + kRowLanes, ... below hidden / 8.
  const int lane = threadIdx.x % kLanes;
  const int chunks =
      kWhole ? kChunks
             : static_cast<int>((p.hidden / 8 - lane0 - lane + kRowLanes - 1) / kRowLanes);
  auto copy = [&](int64_t r) {
    if (r >= 0) {
      copy_row_async<T, kChunks, kLanes, kSplit>(in + r * p.hidden, chunks, stage, lane0);
    }
  };
  int parity = 0;
  auto reduce = [&](float s) { return team_sum<kLanes>(s, red[team], parity, team); };
  // Split rows post row r's sums from its stage ahead (split_post) and collect them a part of a
  // row later (split_collect): the partner's latency hides behind the previous row's writes.
  // The first sum (LayerNorm's mean, RMSNorm's sum of squares) goes after chunk kPostAt of the
  // previous row (its stage copy had chunks 0 and 1 to land), LayerNorm's second after chunk
  // kPostAt + 1, once the mean is collected (the mean after chunk 0 was no faster).
  constexpr int kPostAt = kChunks / 2 - 1;
  constexpr bool kSleep = N == NormType::kLayerNorm;  // (split_collect says why)
  float mean_ahead = 0.0f;  // (split LayerNorm) the mean of the row in the stage
  // Row r's sums due after chunk k of the row before; k < 0: all of them now (no row before).
  auto post_sums = [&](int64_t r, int k) {
    if (r < 0) return;
    const float h = static_cast<float>(p.hidden);
    if (k == kPostAt || k < 0) {
      wait_copies();
      const float s = stage_sum<kLanes, T, kChunks>(stage, chunks, [](float part, float x) {
        return N == NormType::kLayerNorm ? add_rn(part, x) : norm_square_add(part, x, 0.0f, N);
      });
      split_post<kLanes>(s, split, lane0);
    }
    if (N == NormType::kLayerNorm && (k == kPostAt + 1 || k < 0)) {
      mean_ahead = div_rn(split_collect<kLanes, kSleep>(split), h);
      split_post<kLanes>(
          stage_sum<kLanes, T, kChunks>(
              stage, chunks,
              [&](float s, float x) { return norm_square_add(s, x, mean_ahead, N); }),
          split, lane0);
    }
  };
  Cursor at{blockIdx.x / kSplit, 0};
  int64_t r = rows.row(at);
  copy(r);
  if constexpr (kStaged) {
    stage_params<kLanes>(a, lane0, kSplit > 1 ? own : static_cast<int>(p.hidden));
    __syncthreads();
  }
  if constexpr (kSplit > 1) post_sums(r, -1);

  uint32_t amax = 0;
  while (at.g < groups) {
    Cursor next = at;
    next.advance(a);
    const int64_t r_next = rows.row(next);  // `next` itself is not kept: registers are short
    if (r < 0) {
      copy(r_next);
      if constexpr (kSplit > 1) post_sums(r_next, -1);
    } else if constexpr (kSplit > 1) {
      Row<T, kChunks> row;
      read_row<kLanes>(stage, chunks, row);  // (waited for in post_sums)
      copy(r_next);  // (its writes land a global load later than the reads just issued)
      const float mean = mean_ahead;
      const float rstd = norm_rstd(split_collect<kLanes, kSleep>(split), p.hidden, p.eps);
      uint8_t* tile_row = tile + rows.tile_row(at) * a.tile_cols;  // (split rows have a tile)
      write_row<F, N, kLanes, kSplit, kStaged>(row, chunks, r, a, scale, lane0, mean, rstd, amax,
                                               tile_row, [&](int k) { post_sums(r_next, k); });
    } else {
      wait_copies();
      Row<T, kChunks> row;
      read_row<kLanes>(stage, chunks, row);
      uint8_t* tile_row = a.tile_bytes ? tile + rows.tile_row(at) * a.tile_cols : nullptr;
      norm_row<F, N, kLanes, kStaged>(row, chunks, r, a, scale, reduce, amax, tile_row,
                                      [&] { copy(r_next); });
    }
    if (a.tile_bytes && at.step == a.steps - 1) {
      __syncthreads();  // the group's tile complete
      store_group(tile, rows.group_start(at.g), a, lane0, own);
      __syncthreads();  // read before the next group overwrites it
    }
    at.advance(a);
    r = r_next;
  }
  if (p.amax) device::fold_block_amax(amax_bits<T>(amax), p.amax);
  if (p.scale_inv && !a.amax_only && blockIdx.x == 0 && threadIdx.x == 0) {
    *p.scale_inv = 1.0f / scale;
  }
  // Neither block of a pair leaves while the other may still have a store to its shared memory
  // in flight (as distributed shared memory requires).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  if constexpr (kSplit > 1) cooperative_groups::this_cluster().sync();
#endif
}

// Teams per block and resident blocks per SM of an instance for a layout (bytes of the tile and
// the staged gamma / beta, stage bytes per team): the team count keeping the most warps
// resident, ties to the smaller block (fewer warps wait at its barriers); 0 blocks when none
// fits. Split instances also get the clusters of two resident at once (0: none, e.g. before
// sm_90). Asked of the runtime on the first launch with a layout on a device, then cached.
struct Residency {
  int teams = 1;
  int blocks_per_sm = 1;
  int clusters = 0;
};

// A launch of split rows' kernels in clusters of two blocks: the configuration and the cluster
// attribute it points at (so neither copies nor moves).
struct PairLaunch {
  cudaLaunchAttribute pair{};
  cudaLaunchConfig_t config{};
  PairLaunch(int grid, int threads, int smem, cudaStream_t stream) {
    pair.id = cudaLaunchAttributeClusterDimension;
    pair.val.clusterDim.x = 2, pair.val.clusterDim.y = 1, pair.val.clusterDim.z = 1;
    config.gridDim = dim3(grid), config.blockDim = dim3(threads);
    config.dynamicSmemBytes = smem, config.stream = stream;
    config.attrs = &pair, config.numAttrs = 1;
  }
  PairLaunch(const PairLaunch&) = delete;
  PairLaunch& operator=(const PairLaunch&) = delete;
};

template <typename Kernel>
int resident_clusters(Kernel kernel, int threads, int smem) {
  const PairLaunch launch(2, threads, smem, nullptr);
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, kernel, &launch.config) != cudaSuccess) {
    (void)cudaGetLastError();  // (not sticky) no clusters here: the caller slices instead
    n = 0;
  }
  return std::clamp(n, 0, 255);
}

template <Fp8Format F, NormType N, typename T, int kChunks, bool kWhole, int kLanes, bool kStaged,
          int kSplit>
Residency residency(int fixed_bytes, int stage_bytes) {
  const auto kernel = norm_cast_kernel<F, N, T, kChunks, kWhole, kLanes, kStaged, kSplit>;
  // Per device and kind (with / without a tile, which current scaling's two passes alternate),
  // the last layout asked and its answer in one word (layout << 24 | clusters << 16 | teams
  // << 8 | blocks), so racing launches see one whole answer or none.
  static std::atomic<uint64_t> cache[64][2] = {};
  const uint64_t layout = (static_cast<uint64_t>(fixed_bytes) << 17 | stage_bytes) + 1;
  int dev = 0;
  cudaGetDevice(&dev);
  const int kind = fixed_bytes > 0;  // a tile (gamma and beta are staged only beside one)
  std::atomic<uint64_t>* slot = dev >= 0 && dev < 64 ? &cache[dev][kind] : nullptr;
  const uint64_t seen = slot ? slot->load(std::memory_order_relaxed) : 0;
  if (seen >> 24 == layout) {
    return {static_cast<int>(seen >> 8 & 0xFF), static_cast<int>(seen & 0xFF),
            static_cast<int>(seen >> 16 & 0xFF)};
  }
  // All the dynamic shared memory a block may have, next to its static arrays.
  int smem_max = 0;
  cudaDeviceGetAttribute(&smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  cudaFuncAttributes attr{};
  cudaFuncGetAttributes(&attr, kernel);
  smem_max -= static_cast<int>(attr.sharedSizeBytes);
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_max);
  Residency best{1, 0};
  for (int teams = 1; teams <= Plan<T, kChunks, kLanes>::kMaxTeams; teams *= 2) {
    const int smem = fixed_bytes + teams * stage_bytes;
    int n = 0;
    if (smem <= smem_max) {
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kLanes * teams, smem);
    }
    if (n * teams > best.blocks_per_sm * best.teams) best = {teams, n};
  }
  best.blocks_per_sm = std::clamp(best.blocks_per_sm, 0, 255);
  if (kSplit > 1 && best.blocks_per_sm > 0) {
    best.clusters =
        resident_clusters(kernel, kLanes * best.teams, fixed_bytes + best.teams * stage_bytes);
  }
  if (slot) {
    slot->store(layout << 24 | static_cast<uint64_t>(best.clusters) << 16 | best.teams << 8 |
                    best.blocks_per_sm,
                std::memory_order_relaxed);
  }
  return best;
}

// The instances built with gamma (and beta) staged: only rows of 4096 or more hold
// kStagedParamBytes of them -- LayerNorm's at exactly 4096 (128 lanes, whole) and its split
// rows (a block's half of 8192), RMSNorm's from 8192 (256 lanes). Not LayerNorm's 256-lane
// rows: its staged instances spilled, and at 8192 its 64 KB do not fit beside the tile anyway.
template <NormType N, int kChunks, bool kWhole, int kLanes, int kSplit>
constexpr bool kMayStage =
    N == NormType::kLayerNorm ? kSplit > 1 || (kWhole && kLanes * 8 * kChunks == 4096)
                              : kLanes == kNormLanes;

// Rows split over a cluster pair: 8192 wide with row- and column-wise output, where the split
// measured faster than reading column slices back (bf16 on the H200, us): LayerNorm row+col
// 120.7 -> 115.1, +out 137.5 -> 129.8; RMSNorm +out 131.4 -> 122.8 (its waits spinning), but
// row+col 90.5 -> 98.8 at best, whose shorter chunks hide less of the partner's latency. Only whole
// rows (ragged ones spilled) of 16-bit input (fp32's spilled and were not measured), and LayerNorm
// with beta (staged; without, it spilled).
// With `out`, RMSNorm runs as fast as its bytes move in these phases (122 us; with no arithmetic,
// bench/kernel_time.cu probe: 121) and LayerNorm 6 us slower, which is not its mean: without the
// mean's exchange it took 131.5 us, without the mean pass at all 128.3 (row+col: 110.3 -> 103.4
// and 93.3).
inline bool split_rows(const Args& a) {
  const NormCastParams& p = a.p;
  return p.hidden == kSplitHidden && p.columnwise && p.rowwise && !a.amax_only &&
         (p.norm == NormType::kLayerNorm ? p.beta != nullptr : p.out != nullptr);
}

template <Fp8Format F, NormType N, typename T, int kChunks, bool kWhole, int kLanes, bool kStaged,
          int kSplit>
void launch_instance(const Args& a, int grid, int smem, cudaStream_t stream) {
  const auto kernel = norm_cast_kernel<F, N, T, kChunks, kWhole, kLanes, kStaged, kSplit>;
  if constexpr (kSplit == 1) {
    kernel<<<grid, kLanes * a.teams, smem, stream>>>(a);
  } else {
    static_assert(kSplit == 2, "split rows go to pairs of blocks");
    const PairLaunch launch(grid, kLanes * a.teams, smem, stream);
    cudaLaunchKernelEx(&launch.config, kernel, a);
  }
}

// Returns false, launching nothing, when a split instance finds no cluster to run on.
template <Fp8Format F, NormType N, typename T, int kChunks, bool kWhole, int kLanes, int kSplit = 1>
bool launch(Args a, cudaStream_t stream) {
  const NormCastParams& p = a.p;
  const bool columnwise = p.columnwise && !a.amax_only;
  // Column-wise output goes through a tile of 32-row groups, which make whole 32-byte
  // column-wise sectors (16-row groups' half sectors made the column-wise stores of hidden 4096
  // cost as much as the rest of the kernel: 101 against 63 us on the H200). Rows too wide for a
  // 32-row tile of kMaxTileBytes are split over a cluster pair (split_rows), or else put a
  // slice of their columns in it and the rest follows from the row-wise codes (store_group;
  // 16-row groups' column-wise stores took 126 of 205 us at hidden 8192); column-wise output
  // alone keeps 16- or 8-row groups of whole rows.
  const int64_t fits = kMaxTileBytes / p.hidden;  // rows of the whole width a tile holds
  const bool sliced = columnwise && fits < 32 && p.rowwise;
  a.split = kSplit > 1;
  a.group_rows = !columnwise ? 16 : fits >= 32 || sliced ? 32 : fits >= 16 ? 16 : 8;
  const int64_t own = a.split ? split_columns(p.hidden, 0) : p.hidden;  // columns of a block
  a.tile_cols = static_cast<int>(sliced && !a.split ? kMaxTileBytes / 32 : own);
  a.param_cols = staged_param_cols(own, kLanes);
  const int block_rows = std::min(a.group_rows, 16);
  a.columnwise_vec = p.rows % block_rows == 0 && device::aligned(p.columnwise, block_rows);
  a.tile_bytes = columnwise ? a.group_rows * a.tile_cols : 0;
  const int stage_bytes = static_cast<int>(own * sizeof(T));
  // gamma and beta go to shared memory when a tile leaves L1 too small for them (LayerNorm at
  // 4096: 61 against 69 us; smaller ones lost 2-7 % there, in L1 already) and they leave as
  // many warps resident as without.
  const int param_bytes = a.param_cols * static_cast<int>(sizeof(float)) * (p.beta ? 2 : 1);
  // Split LayerNorm rows (with beta: split_rows) always stage them; their unstaged instances
  // spilled, and are not built.
  constexpr bool kStagedOnly = kSplit > 1 && N == NormType::kLayerNorm;
  Residency res{1, 0};
  if constexpr (!kStagedOnly) {
    res = residency<F, N, T, kChunks, kWhole, kLanes, false, kSplit>(a.tile_bytes, stage_bytes);
  }
  a.param_bytes = 0;
  constexpr bool kMay = kMayStage<N, kChunks, kWhole, kLanes, kSplit>;
  if constexpr (kMay) {
    if (a.tile_bytes > 0 && param_bytes >= kStagedParamBytes) {
      const Residency staged = residency<F, N, T, kChunks, kWhole, kLanes, true, kSplit>(
          a.tile_bytes + param_bytes, stage_bytes);
      if (staged.blocks_per_sm * staged.teams >= res.blocks_per_sm * res.teams &&
          (kSplit == 1 || staged.clusters > 0)) {
        res = staged, a.param_bytes = param_bytes;
      }
    }
  }
  if ((kSplit > 1 && res.clusters == 0) || (kStagedOnly && !a.param_bytes)) return false;
  res.blocks_per_sm = std::max(res.blocks_per_sm, 1);
  a.teams = res.teams;
  a.steps = a.group_rows / a.teams;
  const int64_t groups = (p.rows + a.group_rows - 1) / a.group_rows;
  const int64_t walkers =
      kSplit > 1 ? res.clusters : int64_t{res.blocks_per_sm} * current_sm_count();
  a.walkers = static_cast<int>(std::max<int64_t>(1, std::min(groups, walkers)));
  const int grid = a.walkers * kSplit;
  const int smem = a.tile_bytes + a.param_bytes + a.teams * stage_bytes;
  if constexpr (kMay) {
    if (a.param_bytes) {
      launch_instance<F, N, T, kChunks, kWhole, kLanes, true, kSplit>(a, grid, smem, stream);
      return true;
    }
  }
  if constexpr (!kStagedOnly) {
    launch_instance<F, N, T, kChunks, kWhole, kLanes, false, kSplit>(a, grid, smem, stream);
  }
  return true;
}

template <Fp8Format F, NormType N, typename T>
void launch_rows(const Args& a, cudaStream_t stream) {
  // Rows norm_lanes gives 128 lanes (up to 4096): 2048 and 4096 are two and four whole lane
  // strides, whose instances drop the per-chunk tests of this issue-bound kernel. Wider rows
  // take 256 lanes, 4 or 8 chunks a lane; 16-bit rows of exactly 8192 a whole instance too
  // (LayerNorm 8192 row-wise 83 -> 79 us). fp32's whole 256-lane LayerNorm spilled. Split rows
  // (split_rows, 16-bit) are the whole 256-lane layout over two blocks of 128.
  constexpr int kNarrow = 128;
  static_assert(norm_lanes(kNarrow * 8 * 4 + kNormHiddenAlign) != kNarrow,
                "128-lane rows must fit 4 chunks a lane");
  static_assert(kSplitLanes * 2 == kNormLanes && kSplitHidden == kNormLanes * 8 * 4,
                "a split row is the whole 256-lane layout of 4 chunks a lane");
  const int64_t h = a.p.hidden;
  if (norm_lanes(h) == kNarrow) {
    if (h == kNarrow * 8 * 2) return void(launch<F, N, T, 2, true, kNarrow>(a, stream));
    if (h == kNarrow * 8 * 4) return void(launch<F, N, T, 4, true, kNarrow>(a, stream));
    return void(launch<F, N, T, 4, false, kNarrow>(a, stream));
  }
  if constexpr (sizeof(T) == 2) {
    if (split_rows(a) && launch<F, N, T, 4, true, kSplitLanes, 2>(a, stream)) return;
    if (h == kNormLanes * 8 * 4) return void(launch<F, N, T, 4, true, kNormLanes>(a, stream));
  }
  h <= kNormLanes * 8 * 4 ? launch<F, N, T, 4, false, kNormLanes>(a, stream)
                          : launch<F, N, T, kNormMaxChunks, false, kNormLanes>(a, stream);
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
    constexpr auto kLN = NormType::kLayerNorm, kRMS = NormType::kRMSNorm;
    if (p.format == Fp8Format::kE4M3) {
      p.norm == kLN ? launch_rows<Fp8Format::kE4M3, kLN, T>(a, stream)
                    : launch_rows<Fp8Format::kE4M3, kRMS, T>(a, stream);
    } else {
      p.norm == kLN ? launch_rows<Fp8Format::kE5M2, kLN, T>(a, stream)
                    : launch_rows<Fp8Format::kE5M2, kRMS, T>(a, stream);
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
