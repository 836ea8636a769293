// Activation fused with the FP8 casts (activation_cast.h), over 128x128 tiles of act(x)'s
// [rows, n]; each block loops over tiles.
//
// A tile: each thread takes 8 row segments of 8 columns (a warp: 2 rows x 128 columns, so
// every global access covers whole 128-byte lines), one at a time: it computes a segment's
// activation in fp32 from its inputs and writes the high-precision output, the row-wise FP8
// bytes, and the bytes into a shared FP8 tile that is then stored column-wise (fp8_tile.cuh).
// SwiGLU's backward makes two output tiles per tile, columns k and n + k of dx. The shared
// tile exists only when column-wise output is asked for (dynamic shared memory): the
// high-precision-only and amax-only passes neither allocate nor touch it.
//
// The inputs are read once and the activation is never written in high precision unless
// asked for. The exact math (exp and erf from correctly rounded operations) costs 55-100
// instructions an element, which ptxas issues one element after the other, so a thread holds
// one segment at a time and the register budget keeps many warps resident: 48 registers (5
// blocks of 256, 62.5 % occupancy), 80 for SwiGLU's backward (3 inputs and 2 outputs an
// element; 3 blocks, 37.5 %, which its shared memory allows anyway). Batches of segments loaded
// ahead into registers took 90-128 registers (2 blocks): SwiGLU's backward ran at a fifth of
// the memory bandwidth. Instead a thread copies the inputs of its next two segments into its
// own shared stages (cp.async, no registers held) while it computes the current one, also
// across tiles and through the column-wise stores: with one segment's loads in flight per
// thread only while it waited on them, SwiGLU ran at ~2 TB/s.
//
// bf16 inputs skip the math for nearly every element: tables of what depends on x alone over the
// 4096 bf16 inputs with 2^-12 <= |x| < 16, filled by each block with the same functions
// (ActivationTable), take 16 KiB (32 for SwiGLU's backward) of shared memory before the tiles.
// From tables the kernels were still issue-bound (ncu, GELU forward: 72-76 % of issue slots), so
// a segment's bookkeeping counted: its table entries are computed on the input words two at a
// time, the amax is a tree of FMNMX with |y| operands, and the tile's addresses are constant
// offsets (H200, 8192x16384: GELU forward 225 -> 166 us, backward 251 -> 216). Past that, issue
// no longer sets GELU's forward: a hot path 41 % shorter, or 4-5 input stages, left it at 166 us.
//
// dbias (backward) is cast.h's order of column sums, which is this layout: a thread adds its
// segments' fp32 results over the 8 passes in registers (a lane sum of 8 columns per output
// tile), the two threads of a column segment in a warp add by shuffle, and 128 threads add the
// 8 warps' sums through shared memory (the FP8 tiles once stored, else room of its own) into
// the tile's row of dbias_partial; cast_transpose's reduction kernel adds the rows. Only the
// instances built with it (kDbias) carry the sums and their barriers.
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
// Input stages of a thread: the segment it computes and the ones in flight. GELU's backward
// without dbias runs 3.5 % faster with one in flight (251 against 260 us at 8192x16384 on the
// H200); every other instance is as fast or faster with two.
template <Activation A, bool kBackward, bool kDbias>
constexpr int kStagesOf = A == Activation::kGelu && kBackward && !kDbias ? 2 : 3;

// Resident blocks per SM the register budget must allow (see the top of the file); ptxas
// fits each instance without spilling but fp32 GELU's forward (one word, to L1). SwiGLU's backward,
// 16-bit, with column-wise output takes 68 KiB of shared memory (32 tiles, 36 stages): 3 blocks.
// The dbias instances hold 8 (GELU) or 16 (SwiGLU) lane sums more: at 48 / 64 (GELU) and 80 (SwiGLU
// but bf16) registers ptxas spilled, so they get 80 (3 blocks), fp16 and fp32 SwiGLU 128 (2 blocks,
// all fp32's shared memory allows anyway).
template <Activation A, bool kBackward, typename T, bool kDbias>
constexpr int kMinBlocks =
    A == Activation::kSwiGLU && kBackward ? (kDbias && !std::is_same_v<T, bf16_t> ? 2 : 3)
                                          : (kDbias ? 3 : 5);

template <typename T>
struct Args {
  const T* x;
  const T* dy;
  int64_t rows, n, in_cols, out_cols;
  uint8_t* rowwise;
  uint8_t* columnwise;
  T* out;
  float* dbias_partial;  // the dbias instances only
};

// One output tile's warp sums of the column sums: [warp][column] fp32.
constexpr int kSumBytes = kDbiasGroups * kFp8Tile * 4;

// A segment's 8 inputs of one tensor as the 32-bit words they arrive in (16-bit elements two a
// word, the first in the low half): an element is unpacked where it is used, and the tables'
// entries are computed on the words (in registers, a Pack8 of 16-bit elements was unpacked
// into a register each and packed again: 12-24 instructions a segment).
template <typename T>
struct alignas(16) Words {
  static constexpr int kCount = 2 * static_cast<int>(sizeof(T));
  uint32_t w[kCount];
  __device__ float at(int j) const { return device::element<T>(w, j); }
  __device__ uint32_t bits(int j) const {  // element j's own bits
    static_assert(sizeof(T) == 2, "two elements a word");
    return w[j / 2] >> 16 * (j % 2) & 0xFFFFu;
  }
};

// The first `valid` of eight elements from p (columns k .. k+7 of a row), element by element
// (unaligned inputs); zeros past the edge.
template <typename T>
__device__ __forceinline__ Words<T> load8(const T* p, int valid) {
  constexpr int kPerWord = 8 / Words<T>::kCount;
  Words<T> r{};
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    uint32_t bits = 0;
    if constexpr (sizeof(T) == 4) {
      if (j < valid) bits = float_bits(p[j]);
    } else {
      if (j < valid) bits = p[j].bits;
    }
    r.w[j / kPerWord] |= bits << (32 / kPerWord) * (j % kPerWord);
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

// A thread's place in its walk: the tile `item` of the block's (blockIdx.x, + gridDim.x, ...)
// and the pass of it, and where that puts its segment.
struct Place {
  int item, pass;
  int64_t m0, k0;  // the tile's first row and column
  int64_t m, k;    // the segment: row m, columns k .. k+7
  int valid;       // columns inside; 0 past the last tile or row
};

struct Walk {
  int64_t rows, n;
  int tiles_k, num_tiles, row0, seg;
  bool reverse;

  __device__ Place at(int item, int pass) const {
    Place p{item, pass};
    // The cast pass after current scaling's amax pass goes backwards: it starts on what the
    // amax pass read last, which L2 still holds.
    // (unsigned: int's division costs a sign fix-up on top)
    const uint32_t tile = reverse ? num_tiles - 1 - item : item;
    p.m0 = int64_t{tile / static_cast<uint32_t>(tiles_k)} * kFp8Tile;
    p.k0 = int64_t{tile % static_cast<uint32_t>(tiles_k)} * kFp8Tile;
    p.m = p.m0 + row0 + pass * kRowsPerPass;
    p.k = p.k0 + seg * 8;
    p.valid = item < num_tiles && p.m < rows ? static_cast<int>(std::min<int64_t>(8, n - p.k)) : 0;
    return p;
  }
  __device__ Place next(Place p) const {
    if (p.pass + 1 == kPasses) return at(p.item + static_cast<int>(gridDim.x), 0);
    ++p.pass;
    p.m += kRowsPerPass;
    if (p.m >= rows) p.valid = 0;
    return p;
  }
};

// A segment's inputs in a thread's own slot of the shared stage: [input][16-byte piece][thread],
// so copies and reads of a warp cover whole consecutive lines (no bank conflicts), and only the
// thread that copied a slot reads it (no barrier).
template <typename T, int kInputs>
struct Stage {
  static constexpr int kPieces = static_cast<int>(sizeof(Pack8<T>)) / 16;
  static constexpr int kBytes = kInputs * kPieces * kThreads * 16;
  uint4* slot;

  __device__ void copy(const T* const (&src)[kInputs]) const {
#pragma unroll
    for (int i = 0; i < kInputs; ++i) {
#pragma unroll
      for (int q = 0; q < kPieces; ++q) {
        uint4* dst = slot + (i * kPieces + q) * kThreads + threadIdx.x;
        const uint4* from = reinterpret_cast<const uint4*>(src[i]) + q;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(
                         static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
                     "l"(from)
                     : "memory");
#else
        *dst = *from;
#endif
      }
    }
  }
  __device__ Words<T> read(int i) const {
    Words<T> r;
#pragma unroll
    for (int q = 0; q < kPieces; ++q) {
      reinterpret_cast<uint4*>(r.w)[q] = slot[(i * kPieces + q) * kThreads + threadIdx.x];
    }
    return r;
  }
};

__device__ __forceinline__ void commit_copies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
// Waits until at most N of the thread's copy groups are in flight.
template <int N>
__device__ __forceinline__ void wait_copies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// An activation of bf16 inputs from tables in shared memory. A bf16 takes 2^16 values, and the
// 4096 with 2^-12 <= |x| < 16 hold nearly every activation a layer makes. What depends on x (on
// the gate a for SwiGLU) alone is tabulated: GELU(x) or GELU'(x), silu(a), or silu'(a) and
// a sigmoid(a) (two tables); the rest is the multiplies the formulas end with, in their order.
// Each block fills its tables at its start with the same device functions the other elements
// go through, so a looked-up value is the computed one, bit for bit. An element outside (zeros,
// tiny, huge, inf, NaN, padding) is computed, alone: the rest of its segment is still looked up
// (|x| < 2^-12 is ~1 in 5000 normal activations, so ~3-5 % of a warp's segments hold one, and
// the warp waits for one computed element instead of eight). The exact math is 45-70
// instructions an element (issue-bound: more resident blocks made GELU slower), a lookup ~4.
template <Activation A, bool kBackward>
struct ActivationTable {
  static constexpr uint32_t kLowExponent = 127 - 12;  // biased: |x| >= 2^-12
  static constexpr uint32_t kHalf = 16 * 128;         // 16 exponents (|x| < 2^4) of 128 codes
  static constexpr int kEntries = 2 * kHalf;          // a table: [sign][exponent][mantissa]
  static constexpr int kTables = A == Activation::kSwiGLU && kBackward ? 2 : 1;
  static constexpr int kBytes = kTables * kEntries * 4;

  __device__ static void fill(float* table) {
    for (uint32_t i = threadIdx.x; i < kEntries; i += kThreads) {
      const uint32_t bits = ((i & kHalf) << 4) | ((i & (kHalf - 1)) + (kLowExponent << 7));
      const float x = bits_float(bits << 16);
      if constexpr (A == Activation::kGelu) {
        table[i] = kBackward ? gelu_grad(x) : gelu(x);
      } else if constexpr (kBackward) {
        silu_grad_factors(x, table[i], table[kEntries + i]);
      } else {
        table[i] = silu(x);
      }
    }
  }

  // Whether the tables hold x (x0's bits), and its entry there: the sign moved to kHalf.
  __device__ static bool holds(uint32_t bits) { return magnitude(bits) < kHalf; }
  __device__ static uint32_t entry(uint32_t bits) {
    return magnitude(bits) | ((bits >> 4) & kHalf);
  }
  // Whether the tables hold every x of a segment, and their entries (where they do), computed
  // two at a time in the words the bf16 pairs share: entry() of each half. A half outside the
  // range leaves a bit from kHalf up in its difference (one below wraps round; the borrow it
  // takes from the half above only matters when it already tells), so one OR of the four
  // differences decides. Equal to holds() and entry() for all 2^32 words (checked on the CPU).
  __device__ static bool entries(const Words<bf16_t>& x, uint32_t (&at)[8]) {
    constexpr uint32_t kPair = 0x10001u;  // a 16-bit constant in both halves
    const uint32_t* w = x.w;
    uint32_t off = 0;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const uint32_t d = (w[q] & 0x7FFFu * kPair) - (kLowExponent << 7) * kPair;
      off |= d;
      const uint32_t pair = d | ((w[q] >> 4) & kHalf * kPair);
      at[2 * q] = pair & 0xFFFFu;
      at[2 * q + 1] = pair >> 16;
    }
    return (off & (0x10000u - kHalf) * kPair) == 0;
  }
  // Element j's results from its inputs (x0, x1 for SwiGLU, g for backward, as
  // activation_element takes them), where the tables hold its x0 (entry `at`).
  template <int kInputs>
  __device__ static void lookup(const float* table, const Words<bf16_t> (&in)[kInputs], int j,
                                uint32_t at, float& y0, float& y1) {
    const float g = kBackward ? in[kInputs - 1].at(j) : 0.0f;
    if constexpr (A == Activation::kGelu) {
      y0 = kBackward ? mul_rn(g, table[at]) : table[at];
    } else {
      const float b = in[1].at(j);
      if constexpr (kBackward) {
        y0 = mul_rn(mul_rn(g, b), table[at]);  // as swiglu_grad
        y1 = mul_rn(g, table[kEntries + at]);
      } else {
        y0 = mul_rn(table[at], b);
      }
    }
  }
  // The entry of |x| among one sign's, >= kHalf outside the table (it wraps round below).
  __device__ static uint32_t magnitude(uint32_t bits) {
    return (bits & 0x7FFFu) - (kLowExponent << 7);
  }
};

template <typename T>
constexpr bool kTabulated = std::is_same_v<T, bf16_t>;

// kDbias (backward only): also the tiles' rows of dbias_partial, a separate instance so the
// others keep their registers.
template <Activation A, bool kBackward, Fp8Format F, typename T, bool kDbias>
__global__ void __launch_bounds__(kThreads, kMinBlocks<A, kBackward, T, kDbias>)
    activation_cast_kernel(Args<T> a, ScaleSource scale_src, float* amax, float* scale_inv,
                           bool vec, bool vec_col, bool reverse) {
  constexpr bool kSwiGLU = A == Activation::kSwiGLU;
  constexpr int kOutTiles = kSwiGLU && kBackward ? 2 : 1;
  constexpr int kInputs = 1 + kSwiGLU + kBackward;  // x0, x1 (SwiGLU), dy (backward)
  constexpr int kTileWords = kTileBytes / 4;
  using StageT = Stage<T, kInputs>;
  constexpr int kStages = kStagesOf<A, kBackward, kDbias>;
  // kOutTiles FP8 tiles with column-wise output (else none; 16-byte aligned: rows are written
  // as 8-byte words), then kStages input stages when `vec`. The dbias instances' warp sums
  // (kOutTiles * kSumBytes) take the FP8 tiles once stored, else follow the stages.
  // (bf16: the activation's tables first.)
  constexpr bool kTable = kTabulated<T>;
  using Table = ActivationTable<A, kBackward>;
  extern __shared__ __align__(16) uint32_t smem[];
  float* const table = reinterpret_cast<float*>(smem);
  uint32_t* const tiles = smem + (kTable ? Table::kBytes / 4 : 0);
  uint4* const stages =
      reinterpret_cast<uint4*>(tiles + (a.columnwise ? kOutTiles * kTileWords : 0));
  float* const warp_sums =
      reinterpret_cast<float*>(a.columnwise ? reinterpret_cast<uint4*>(tiles)
                                            : stages + (vec ? kStages * (StageT::kBytes / 16) : 0));
  const auto stage = [&](int s) { return StageT{stages + s * (StageT::kBytes / 16)}; };
  // Where the segment at p reads its inputs.
  const auto sources = [&](const Place& p, const T*(&src)[kInputs]) {
    src[0] = a.x + p.m * a.in_cols + p.k;
    if constexpr (kSwiGLU) src[1] = src[0] + a.n;
    if constexpr (kBackward) src[kInputs - 1] = a.dy + p.m * a.n + p.k;
  };
  const auto copy_ahead = [&](const Place& p, int s) {
    const T* src[kInputs];
    sources(p, src);
    if (p.valid > 0) stage(s).copy(src);
    commit_copies();
  };

  const float scale = scale_src.resolve(F);
  const int tiles_k = static_cast<int>((a.n + kFp8Tile - 1) / kFp8Tile);
  const Walk walk{a.rows,
                  a.n,
                  tiles_k,
                  tiles_k * static_cast<int>((a.rows + kFp8Tile - 1) / kFp8Tile),
                  static_cast<int>(threadIdx.x) / kSegmentsPerRow,
                  static_cast<int>(threadIdx.x) % kSegmentsPerRow,
                  reverse};
  // Aligned inputs are copied kStages - 1 segments ahead (cp.async: no registers held), so a
  // thread's next loads are in flight while it computes; the others load when needed.
  Place ahead = walk.at(blockIdx.x, 0);
  int slot = 0;  // the stage of the current segment
  if (vec) {
#pragma unroll
    for (int s = 0; s + 1 < kStages; ++s) {
      copy_ahead(ahead, s);
      ahead = walk.next(ahead);
    }
  }
  if constexpr (kTable) {
    Table::fill(table);  // while the first inputs are in flight
    __syncthreads();
  }
  float local_amax = 0.0f;
  // The lane sums of cast.h's dbias order: this thread's 8 columns of each output tile over its
  // rows row0, row0 + 16, ..., row0 + 112 of the current tile.
  float sums[kOutTiles][8] = {};
#pragma unroll 1
  for (Place cur = walk.at(blockIdx.x, 0); cur.item < walk.num_tiles;) {
    if (vec) {
      // Into the stage read one segment ago (its reads are done: their values were used).
      copy_ahead(ahead, slot == 0 ? kStages - 1 : slot - 1);
      ahead = walk.next(ahead);
      wait_copies<kStages - 1>();
    }
    // Segments past the edge would compute 0, which leaves the max alone; their rows of the
    // shared tile keep stale bytes, which are never stored.
    if (cur.valid > 0) {
      Words<T> in[kInputs];
      const T* src[kInputs];
      sources(cur, src);
#pragma unroll
      for (int i = 0; i < kInputs; ++i) {
        in[i] = vec ? stage(slot).read(i) : load8(src[i], cur.valid);
      }
      float y0[8], y1[8] = {};
      const auto compute = [&](int j) {
        const float x0 = in[0].at(j);
        const float x1 = kSwiGLU ? in[kSwiGLU ? 1 : 0].at(j) : 0.0f;
        const float g = kBackward ? in[kInputs - 1].at(j) : 0.0f;
        activation_element<A, kBackward>(x0, x1, g, y0[j], y1[j]);
      };
      if constexpr (kTable) {
        uint32_t at[8];
        if (Table::entries(in[0], at)) {  // the usual case, free of per-element branches
#pragma unroll
          for (int j = 0; j < 8; ++j) Table::lookup(table, in, j, at[j], y0[j], y1[j]);
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const uint32_t bits = in[0].bits(j);
            if (Table::holds(bits)) {
              Table::lookup(table, in, j, Table::entry(bits), y0[j], y1[j]);
            } else {
              compute(j);
            }
          }
        }
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) compute(j);
      }
      // Padding (j >= valid) computes to 0, which leaves the max alone (and the sums of
      // columns that are never stored).
      local_amax = device::max_abs8(local_amax, y0);
      if constexpr (kOutTiles == 2) local_amax = device::max_abs8(local_amax, y1);
      if constexpr (kDbias) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          sums[0][j] += y0[j];
          if constexpr (kOutTiles == 2) sums[kOutTiles - 1][j] += y1[j];
        }
      }
      const int r = walk.row0 + cur.pass * kRowsPerPass;
      put_segment<T, F>(a, y0, cur.m, cur.k, cur.valid, r, walk.seg, scale, vec, tiles);
      if constexpr (kOutTiles == 2) {
        put_segment<T, F>(a, y1, cur.m, a.n + cur.k, cur.valid, r, walk.seg, scale, vec,
                          tiles + kTileWords);
      }
    }
    slot = slot + 1 == kStages ? 0 : slot + 1;
    if (cur.pass + 1 == kPasses && a.columnwise) {
      __syncthreads();  // the tiles written
      const int64_t m_end = std::min(a.rows, cur.m0 + kFp8Tile);
      const int64_t cols = std::min<int64_t>(kFp8Tile, a.n - cur.k0);
#pragma unroll
      for (int o = 0; o < kOutTiles; ++o) {
        device::store_tile_columnwise(tiles + o * kTileWords, a.columnwise, a.rows, cur.m0, m_end,
                                      o * a.n + cur.k0, cols, vec_col);
      }
      __syncthreads();  // read before the next tile overwrites them
    }
    if constexpr (kDbias) {
      if (cur.pass + 1 == kPasses) {
        // Every thread reaches each tile's last pass, past the edge too: barriers are uniform.
#pragma unroll
        for (int o = 0; o < kOutTiles; ++o) {
          device::publish_column_sums(sums[o], warp_sums + o * (kSumBytes / 4));
#pragma unroll
          for (int j = 0; j < 8; ++j) sums[o][j] = 0.0f;
        }
        __syncthreads();  // the warps' sums written
        float* const row = a.dbias_partial + (cur.m0 / kFp8Tile) * a.out_cols;
#pragma unroll
        for (int o = 0; o < kOutTiles; ++o) {
          device::store_column_sums(warp_sums + o * (kSumBytes / 4), row + o * a.n, cur.k0, a.n);
        }
        __syncthreads();  // read before the next tile writes them (or its FP8 tiles)
      }
    }
    cur = walk.next(cur);
  }
  if (vec) wait_copies<0>();  // none may land after the block's shared memory is reused
  if (amax) device::fold_block_amax(float_bits(local_amax), amax);
  if (scale_inv && blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = div_rn(1.0f, scale);
}

// Resident blocks per SM of a kernel instance with `smem` bytes of dynamic shared memory (one of
// the 4 layouts: with / without tiles and stages), asked once per device.
template <typename Kernel>
int blocks_per_sm(Kernel kernel, int smem, int smem_max, int* cache) {
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 0 || dev >= 64) dev = 0;
  if (cache[dev] == 0) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_max);
    // Stages and tiles, not L1, hold what a block reuses: ask for the largest carveout so the
    // resident blocks counted here are the ones that run.
    cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                         cudaSharedmemCarveoutMaxShared);
    int n = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, smem);
    cache[dev] = std::max(n, 1);  // a race only stores the same value twice
  }
  return cache[dev];
}

template <Activation A, bool kBackward, Fp8Format F, typename T, bool kDbias>
void launch(const ActivationCastParams& p, cudaStream_t stream) {
  const auto kernel = activation_cast_kernel<A, kBackward, F, T, kDbias>;
  constexpr int kOutTiles = A == Activation::kSwiGLU && kBackward ? 2 : 1;
  constexpr int kInputs = 1 + (A == Activation::kSwiGLU) + kBackward;
  constexpr int kStageBytes = kStagesOf<A, kBackward, kDbias> * Stage<T, kInputs>::kBytes;
  static int cache[4][64] = {};  // [with tiles][with stages][device]
  Args<T> a{static_cast<const T*>(p.input),
            static_cast<const T*>(p.grad),
            p.rows,
            p.n,
            p.in_cols(),
            p.out_cols(),
            p.rowwise,
            p.columnwise,
            static_cast<T*>(p.out),
            kDbias ? p.dbias_partial : nullptr};
  using device::aligned;
  const bool vec = p.n % 8 == 0 && aligned(a.x, 16) && (!kBackward || aligned(a.dy, 16)) &&
                   aligned(a.out, 16) && aligned(a.rowwise, 8);
  const bool vec_col = p.rows % 16 == 0 && aligned(a.columnwise, 16);
  // Column-wise output goes through the shared tiles, aligned inputs through the stages; the
  // warp sums of dbias need their own room only without the tiles.
  const bool with_tiles = p.columnwise != nullptr;
  constexpr int kTableBytes = kTabulated<T> ? ActivationTable<A, kBackward>::kBytes : 0;
  const int smem = kTableBytes + (with_tiles ? kOutTiles * kTileBytes : 0) +
                   (vec ? kStageBytes : 0) + (kDbias && !with_tiles ? kOutTiles * kSumBytes : 0);
  const int64_t tiles = ((p.rows + kFp8Tile - 1) / kFp8Tile) * ((p.n + kFp8Tile - 1) / kFp8Tile);
  const int64_t resident =
      int64_t{current_sm_count()} *
      blocks_per_sm(kernel, smem, kTableBytes + kOutTiles * kTileBytes + kStageBytes,
                    cache[with_tiles * 2 + vec]);
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min(tiles, resident)));
  // Only the amax pass of current scaling writes no output.
  const bool amax_pass = !p.rowwise && !p.columnwise && !p.out && !kDbias;
  kernel<<<grid, kThreads, smem, stream>>>(a, scale_source(p), p.amax, p.scale_inv, vec, vec_col,
                                           !amax_pass);
}

template <Fp8Format F, typename T>
void launch_activation(const ActivationCastParams& p, cudaStream_t stream) {
  if (p.activation == Activation::kGelu) {
    !p.backward ? launch<Activation::kGelu, false, F, T, false>(p, stream)
    : p.dbias   ? launch<Activation::kGelu, true, F, T, true>(p, stream)
                : launch<Activation::kGelu, true, F, T, false>(p, stream);
  } else {
    !p.backward ? launch<Activation::kSwiGLU, false, F, T, false>(p, stream)
    : p.dbias   ? launch<Activation::kSwiGLU, true, F, T, true>(p, stream)
                : launch<Activation::kSwiGLU, true, F, T, false>(p, stream);
  }
}

}  // namespace

cudaError_t activation_cast_cuda(const ActivationCastParams& p, cudaStream_t stream) {
  if (p.dbias && (!p.backward || (!p.dbias_partial && p.rows > 0))) return cudaErrorInvalidValue;
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (p.format == Fp8Format::kE4M3) {
      launch_activation<Fp8Format::kE4M3, T>(p, stream);
    } else {
      launch_activation<Fp8Format::kE5M2, T>(p, stream);
    }
  });
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess || !p.dbias) return e;
  return dbias_reduce_cuda(p.dbias_partial, dbias_tiles(p.rows), p.out_cols(), p.dbias, stream);
}

}  // namespace tpfp8
