// CPU references of the casts in cast.h: plain loops over the shared encode/decode of
// fp8_format.h, the oracle every CUDA kernel is compared with byte for byte.
#include <algorithm>
#include <vector>

#include "cast.h"

namespace tpfp8 {
namespace {

template <typename T>
void cast_typed(const CastParams& p) {
  const T* in = static_cast<const T*>(p.input);
  const float scale = scale_source(p).resolve(p.format);
  uint32_t amax = 0;
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t c = 0; c < p.cols; ++c) {
      const float x = to_float(in[r * p.cols + c]);
      amax = std::max(amax, abs_bits(x));
      const uint8_t code = encode_fp8(x * scale, p.format);
      if (p.rowwise) p.rowwise[r * p.cols + c] = code;
      if (p.columnwise) p.columnwise[c * p.rows + r] = code;
    }
  }
  if (p.amax) *p.amax = bits_float(std::max(float_bits(*p.amax), amax));
  if (p.scale_inv) *p.scale_inv = 1.0f / scale;
}

// cast.h's order of the column sums, walking rows in memory order: tile t's lane sum of lane
// row q gets rows q, q + 16, ..., q + 112 in turn, each a contiguous row of all columns.
template <typename T>
void column_sums_typed(const T* in, int64_t rows, int64_t cols, float* dbias, float* partial) {
  const int64_t tiles = dbias_tiles(rows);
  std::vector<float> own;
  if (!partial) {
    own.resize(tiles * cols);
    partial = own.data();
  }
  std::vector<float> lanes(kDbiasLanes * cols);
  for (int64_t t = 0; t < tiles; ++t) {
    std::fill(lanes.begin(), lanes.end(), 0.0f);
    for (int64_t r = t * kDbiasTileRows; r < std::min(rows, (t + 1) * kDbiasTileRows); ++r) {
      float* lane = &lanes[(r % kDbiasLanes) * cols];
      for (int64_t c = 0; c < cols; ++c) lane[c] += to_float(in[r * cols + c]);
    }
    for (int64_t c = 0; c < cols; ++c) {
      float sum = 0.0f;
      for (int q = 0; q < kDbiasLanes; q += 2)
        sum += lanes[q * cols + c] + lanes[(q + 1) * cols + c];
      partial[t * cols + c] = from_float<float>(sum);
    }
  }
  for (int64_t c = 0; c < cols; ++c) {
    float sum = 0.0f;
    for (int j = 0; j < kDbiasGroups; ++j) {
      float group = 0.0f;
      for (int64_t t = j; t < tiles; t += kDbiasGroups) group += partial[t * cols + c];
      sum += group;
    }
    dbias[c] = from_float<float>(sum);
  }
}

template <typename T>
uint32_t amax_typed(const void* input, int64_t numel) {
  const T* in = static_cast<const T*>(input);
  uint32_t amax = 0;
  for (int64_t i = 0; i < numel; ++i) amax = std::max(amax, abs_bits(to_float(in[i])));
  return amax;
}

template <typename T>
void dequantize_typed(const DequantizeParams& p) {
  T* out = static_cast<T*>(p.output);
  const float scale_inv = *p.scale_inv;
  for (int64_t i = 0; i < p.numel; ++i) {
    out[i] = from_float<T>(decode_fp8(p.input[i], p.format) * scale_inv);
  }
}

}  // namespace

void cast_cpu(const CastParams& p) {
  dispatch_dtype(p.dtype, [&](auto tag) {
    if (p.rowwise || p.columnwise || p.amax || p.scale_inv) cast_typed<decltype(tag)>(p);
    if (p.dbias) {
      column_sums_typed(static_cast<const decltype(tag)*>(p.input), p.rows, p.cols, p.dbias,
                        p.dbias_partial);
    }
  });
}

void column_sums_cpu(const float* values, int64_t rows, int64_t cols, float* dbias,
                     float* partial) {
  column_sums_typed(values, rows, cols, dbias, partial);
}

void transpose_fp8_cpu(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) out[c * rows + r] = in[r * cols + c];
  }
}

void dequantize_cpu(const DequantizeParams& p) {
  dispatch_dtype(p.out_dtype, [&](auto tag) { dequantize_typed<decltype(tag)>(p); });
}

void amax_cpu(const void* input, DType dtype, int64_t numel, float* amax) {
  const uint32_t a =
      dispatch_dtype(dtype, [&](auto tag) { return amax_typed<decltype(tag)>(input, numel); });
  *amax = bits_float(std::max(float_bits(*amax), a));
}

}  // namespace tpfp8
