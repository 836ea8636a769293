// Runs one cast on the CPU reference and (where a GPU is visible) through a CUDA launcher on
// the same input, and compares every output byte. Shared by test_cast and test_cast_transpose.
#pragma once

#include <optional>

#include "kernels/cast.h"
#include "test_util.h"

namespace tpfp8::testing {

struct CastOutputs {
  std::vector<uint8_t> rowwise, columnwise;
  float amax = 0.0f, scale_inv = 0.0f;
  std::vector<float> dbias, dbias_partial;  // with `dbias`: [cols], [dbias_tiles(rows), cols]
};

inline size_t partial_size(Shape s) { return dbias_tiles(s.rows) * s.cols; }

// With `scale_amax`, the cast takes current scaling's scale from that amax (epsilon 1e-6)
// instead of `scale`; with `dbias`, it also sums the columns.
template <typename T>
CastOutputs cast_on_cpu(const std::vector<T>& in, Shape s, Fp8Format f, float scale, bool row,
                        bool col, std::optional<float> scale_amax = std::nullopt,
                        bool dbias = false) {
  CastOutputs o;
  o.rowwise.assign(row ? in.size() : 0, 0xA5);
  o.columnwise.assign(col ? in.size() : 0, 0xA5);
  o.dbias.assign(dbias ? s.cols : 0, -1.0f);
  o.dbias_partial.assign(dbias ? partial_size(s) : 0, -1.0f);
  CastParams p;
  p.input = in.data(), p.rows = s.rows, p.cols = s.cols, p.format = f, p.scale = &scale;
  p.dtype = dtype_of<T>();
  p.rowwise = row ? o.rowwise.data() : nullptr;
  p.columnwise = col ? o.columnwise.data() : nullptr;
  p.amax = &o.amax, p.scale_inv = &o.scale_inv;
  if (scale_amax) p.scale_amax = &*scale_amax, p.epsilon = 1e-6f;
  if (dbias) p.dbias = o.dbias.data(), p.dbias_partial = o.dbias_partial.data();
  cast_cpu(p);
  return o;
}

#if defined(TPFP8_WITH_CUDA)
// `launcher` is quantize_cuda or cast_transpose_cuda.
template <typename T, typename Launcher>
CastOutputs cast_on_gpu(const std::vector<T>& in, Shape s, Fp8Format f, float scale, bool row,
                        bool col, Launcher launcher, std::optional<float> scale_amax = std::nullopt,
                        bool dbias = false) {
  DeviceBuffer<T> d_in(in);
  DeviceBuffer<uint8_t> d_row(row ? in.size() : 0), d_col(col ? in.size() : 0);
  DeviceBuffer<float> d_scale(std::vector<float>{scale}), d_amax(std::vector<float>{0.0f}),
      d_scale_inv(1), d_scale_amax(std::vector<float>{scale_amax.value_or(0.0f)}),
      d_dbias(dbias ? s.cols : 0), d_partial(dbias ? partial_size(s) : 0);
  CastParams p;
  p.input = d_in.get(), p.rows = s.rows, p.cols = s.cols, p.format = f, p.scale = d_scale.get();
  p.dtype = dtype_of<T>();
  p.rowwise = row ? d_row.get() : nullptr;
  p.columnwise = col ? d_col.get() : nullptr;
  p.amax = d_amax.get(), p.scale_inv = d_scale_inv.get();
  if (scale_amax) p.scale_amax = d_scale_amax.get(), p.epsilon = 1e-6f;
  if (dbias) p.dbias = d_dbias.get(), p.dbias_partial = d_partial.get();
  CastOutputs o;
  EXPECT_EQ(launcher(p, nullptr), cudaSuccess);
  if (row) o.rowwise = d_row.to_host();
  if (col) o.columnwise = d_col.to_host();
  if (dbias) o.dbias = d_dbias.to_host(), o.dbias_partial = d_partial.to_host();
  o.amax = d_amax.to_host()[0];
  o.scale_inv = d_scale_inv.to_host()[0];
  return o;
}
#endif

inline ::testing::AssertionResult same_outputs(const CastOutputs& gpu, const CastOutputs& cpu) {
  if (auto r = same_bytes(gpu.rowwise, cpu.rowwise); !r) return r << " (rowwise)";
  if (auto r = same_bytes(gpu.columnwise, cpu.columnwise); !r) return r << " (columnwise)";
  if (auto r = same_bytes<float>({gpu.amax}, {cpu.amax}); !r) return r << " (amax)";
  if (auto r = same_bytes(gpu.dbias_partial, cpu.dbias_partial); !r) return r << " (partial)";
  if (auto r = same_bytes(gpu.dbias, cpu.dbias); !r) return r << " (dbias)";
  return same_bytes<float>({gpu.scale_inv}, {cpu.scale_inv}) << " (scale_inv)";
}

template <typename T>
const char* dtype_name() {
  return std::is_same_v<T, float> ? "fp32" : std::is_same_v<T, bf16_t> ? "bf16" : "fp16";
}

}  // namespace tpfp8::testing
