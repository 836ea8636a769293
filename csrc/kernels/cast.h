// Element-wise FP8 casts: quantize (high precision -> FP8 row-wise), cast-transpose (row-wise
// and column-wise in one pass), transpose of FP8 bytes, dequantize, and amax.
//
// Every op has a CUDA launcher (`*_cuda`, on the given stream, never synchronises) and a CPU
// reference (`*_cpu`) producing the same bytes. Pointers are device pointers for the CUDA
// launchers and host pointers for the CPU references. Tensors are dense and row-major.
#pragma once

#include <cstdint>

#include "dtype.h"
#include "fp8_format.h"
#include "launch.h"

namespace tpfp8 {

// Current scaling's scale of a tensor whose amax is known: fp8_max / max(amax, epsilon) in
// fp32; 1 when amax is 0 or not finite; FLT_MAX when the quotient overflows.
TPFP8_HD float current_scale(float amax, float epsilon, Fp8Format f) {
  if (!(amax > 0.0f) || !(amax <= kFloatMax)) return 1.0f;  // 0, inf or NaN
  const float s = fp8_max(f) / (amax > epsilon ? amax : epsilon);
  return s <= kFloatMax ? s : kFloatMax;
}

// One cast of a [rows, cols] high-precision tensor.
//   scale: *scale, or with scale_amax current_scale(*scale_amax, epsilon) computed by the
//          kernel itself (current scaling costs no launch between amax and cast)
//   rowwise[r * cols + c]    = encode(input[r, c] * scale)    (nullptr: not written)
//   columnwise[c * rows + r] = the same byte, transposed       (nullptr: not written)
//   *amax = max(*amax, max |input|)   folded in, NaN-propagating (nullptr: skipped)
//   *scale_inv = 1 / scale                                       (nullptr: skipped)
//   dbias[c] = sum over r of input[r, c], fp32 (nullptr: skipped; cast_transpose only): the
//          bias gradient of a cast gradient, from the cast's own read of it, summed in the
//          fixed order below with `dbias_partial` as workspace
struct CastParams {
  const void* input = nullptr;
  DType dtype = DType::kFloat32;
  int64_t rows = 0;
  int64_t cols = 0;
  Fp8Format format = Fp8Format::kE4M3;
  const float* scale = nullptr;
  const float* scale_amax = nullptr;  // set: current scaling from this amax, `scale` unused
  float epsilon = 0.0f;
  uint8_t* rowwise = nullptr;
  uint8_t* columnwise = nullptr;
  float* amax = nullptr;
  float* scale_inv = nullptr;
  float* dbias = nullptr;
  float* dbias_partial = nullptr;  // [dbias_tiles(rows), cols] fp32, needed with dbias (GPU)
};

// Column sums (CastParams::dbias) in an order fixed by the shape alone -- the same bytes every
// run and in the CPU reference; no float atomics. All sums start at +0 (so none is -0) and add
// left to right; a NaN result is stored as the canonical quiet NaN.
//   tile t: input rows [128 t, 128 t + 128) (rows past the end add nothing)
//   lane sums  s[q] = x[q] + x[q + 16] + ... + x[q + 112]  (q < 16; rows relative to the tile)
//   tile sum   dbias_partial[t * cols + c] = (s[0] + s[1]) + (s[2] + s[3]) + ... + (s[14] + s[15])
//   group sums g[j] = partial[j] + partial[j + 8] + ... over tiles t = j mod 8  (j < 8)
//   dbias[c]   = g[0] + g[1] + ... + g[7]
// (This is the cast-transpose kernel's thread layout: 16 lanes per column, 8 rows each.)
constexpr int64_t kDbiasTileRows = 128;
constexpr int kDbiasLanes = 16;
constexpr int kDbiasGroups = 8;
inline int64_t dbias_tiles(int64_t rows) { return (rows + kDbiasTileRows - 1) / kDbiasTileRows; }

// Where a cast kernel takes its scale from (CastParams' scale / scale_amax / epsilon).
struct ScaleSource {
  const float* scale = nullptr;
  const float* amax = nullptr;
  float epsilon = 0.0f;
  TPFP8_HD float resolve(Fp8Format f) const {
    return amax ? current_scale(*amax, epsilon, f) : scale ? *scale : 1.0f;
  }
};
inline ScaleSource scale_source(const CastParams& p) { return {p.scale, p.scale_amax, p.epsilon}; }

// Row-wise only (columnwise must be null): an element-wise pass at full vector width.
cudaError_t quantize_cuda(const CastParams& p, cudaStream_t stream);
// Any combination of row-wise / column-wise / dbias outputs, input read once (+ a small
// kernel summing dbias_partial).
cudaError_t cast_transpose_cuda(const CastParams& p, cudaStream_t stream);
// Both ops share one CPU reference: it writes whichever outputs are non-null.
void cast_cpu(const CastParams& p);

// The column sums' second step on the GPU, for any kernel that wrote the tiles' rows
// partial[t * cols + c] of a [rows, cols] tensor (tiles = dbias_tiles(rows)) in the order above:
// dbias[c] = g[0] + ... + g[7].
cudaError_t dbias_reduce_cuda(const float* partial, int64_t tiles, int64_t cols, float* dbias,
                              cudaStream_t stream);
// The CPU reference of the whole order for fp32 values [rows, cols]: dbias[c], and the tiles'
// rows into `partial` when it is non-null.
void column_sums_cpu(const float* values, int64_t rows, int64_t cols, float* dbias,
                     float* partial = nullptr);

// out[c * rows + r] = in[r * cols + c] for FP8 bytes (data gathered from other ranks).
cudaError_t transpose_fp8_cuda(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out,
                               cudaStream_t stream);
void transpose_fp8_cpu(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out);

// out[i] = round_to(out_dtype, decode(in[i]) * *scale_inv) for i < numel.
struct DequantizeParams {
  const uint8_t* input = nullptr;
  int64_t numel = 0;
  Fp8Format format = Fp8Format::kE4M3;
  const float* scale_inv = nullptr;
  void* output = nullptr;
  DType out_dtype = DType::kFloat32;
};
cudaError_t dequantize_cuda(const DequantizeParams& p, cudaStream_t stream);
void dequantize_cpu(const DequantizeParams& p);

// *amax = max(*amax, max |input[i]|) over numel elements; NaN propagates.
cudaError_t amax_cuda(const void* input, DType dtype, int64_t numel, float* amax,
                      cudaStream_t stream);
void amax_cpu(const void* input, DType dtype, int64_t numel, float* amax);

}  // namespace tpfp8
