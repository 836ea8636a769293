// Writing a 128x128 FP8 tile column-wise through shared memory, for kernels whose threads
// produce it row by row (256 threads; a thread's 8-byte row segments go to the tile with
// fp8_tile_word, then store_tile_columnwise writes 16-byte column segments). The tile is
// [128][32] uint32 in shared memory, aligned to at least 8 bytes.
//
// The same layout as cast_transpose.cu's tile (which keeps its own store loop: its thread layout
// also fixes the order of its bias-gradient sums): the tile is XOR-swizzled by 16-row group so
// both the row-wise writes and the column-wise reads are free of bank conflicts, and a warp's
// column-wise stores cover 4 rows x 128 B.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cast_device.cuh"

namespace tpfp8 {
namespace device {

constexpr int kFp8Tile = 128;                // rows and columns of a tile
constexpr int kFp8TileWords = kFp8Tile / 4;  // 32-bit words per tile row

// Index of the word holding bytes [4 word, 4 word + 4) of tile row `row` (unsigned: a shift
// and a mask, where int's / and % cost a signed-division fix-up each per segment).
__device__ __forceinline__ uint32_t fp8_tile_word(uint32_t row, uint32_t word) {
  return row * kFp8TileWords + (word ^ ((row / 16 % 8) << 2));
}

// Stores tile rows [0, m_end - m0) and columns [0, cols) transposed: tile (r, c) goes to
// out[(col0 + c) * rows + m0 + r]. Each thread takes 16 rows x 4 columns; `vec` (rows % 16 == 0
// and `out` 16-byte aligned) lets whole 16-row segments go as one store, the rest byte by byte.
// Call with all 256 threads after a barrier that follows the tile's writes.
__device__ __forceinline__ void store_tile_columnwise(const uint32_t* tile, uint8_t* out,
                                                      int64_t rows, int64_t m0, int64_t m_end,
                                                      int64_t col0, int64_t cols, bool vec) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int group = lane % 8, word = warp * 4 + lane / 8;  // 16-row group, 4-column word
  // The group's 16 rows share one swizzle, so their words lie a row apart: constant offsets.
  const uint32_t* first = tile + fp8_tile_word(group * 16, word);
  uint32_t t[4][4];  // [4-row block][column]
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = first[(j * 4 + i) * kFp8TileWords];
    transpose4x4(w, t[j]);
  }
  const int64_t m = m0 + group * 16;
  if (m >= m_end) return;
  const bool whole = vec && m + 16 <= m_end;
  uint8_t* dst = out + (col0 + word * 4) * rows + m;
#pragma unroll
  for (int c = 0; c < 4; ++c, dst += rows) {
    if (word * 4 + c >= cols) return;
    if (whole) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(t[0][c], t[1][c], t[2][c], t[3][c]);
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) {  // unrolled: t stays in registers
        if (m + i < m_end) dst[i] = static_cast<uint8_t>(t[i / 4][c] >> (8 * (i % 4)));
      }
    }
  }
}

}  // namespace device
}  // namespace tpfp8
