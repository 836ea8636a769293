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

// One cast of a [rows, cols] high-precision tensor.
//   rowwise[r * cols + c]    = encode(input[r, c] * *scale)   (nullptr: not written)
//   columnwise[c * rows + r] = the same byte, transposed       (nullptr: not written)
//   *amax = max(*amax, max |input|)   folded in, NaN-propagating (nullptr: skipped)
//   *scale_inv = 1 / *scale                                      (nullptr: skipped)
struct CastParams {
  const void* input = nullptr;
  DType dtype = DType::kFloat32;
  int64_t rows = 0;
  int64_t cols = 0;
  Fp8Format format = Fp8Format::kE4M3;
  const float* scale = nullptr;
  uint8_t* rowwise = nullptr;
  uint8_t* columnwise = nullptr;
  float* amax = nullptr;
  float* scale_inv = nullptr;
};

// Row-wise only (columnwise must be null): an element-wise pass at full vector width.
cudaError_t quantize_cuda(const CastParams& p, cudaStream_t stream);
// Any combination of row-wise / column-wise outputs, input read once.
cudaError_t cast_transpose_cuda(const CastParams& p, cudaStream_t stream);
// Both ops share one CPU reference: it writes whichever outputs are non-null.
void cast_cpu(const CastParams& p);

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
