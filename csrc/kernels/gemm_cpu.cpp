// CPU reference of gemm.h: every operand decoded to fp64 (FP8 and 16-bit values are exact
// there), products summed in fp64, then scaled, biased, accumulated and rounded once.
#include <stdexcept>
#include <vector>

#include "gemm.h"

namespace tpfp8 {
namespace {

double element(const void* data, GemmType t, int64_t i) {
  switch (t) {
    case GemmType::kFloat32:
      return static_cast<const float*>(data)[i];
    case GemmType::kBFloat16:
      return to_float(static_cast<const bf16_t*>(data)[i]);
    case GemmType::kFloat16:
      return to_float(static_cast<const fp16_t*>(data)[i]);
    case GemmType::kE4M3:
      return decode_fp8(static_cast<const uint8_t*>(data)[i], Fp8Format::kE4M3);
    default:
      return decode_fp8(static_cast<const uint8_t*>(data)[i], Fp8Format::kE5M2);
  }
}

// Operand as a dense [rows, K] fp64 matrix, whatever its storage.
std::vector<double> decode_operand(const GemmOperand& op, int64_t rows, int64_t k) {
  std::vector<double> out(rows * k);
  const double scale = is_fp8(op.type) ? *op.scale_inv : 1.0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < k; ++c) {
      const int64_t i = op.transposed ? c * rows + r : r * k + c;
      out[r * k + c] = element(op.data, op.type, i) * scale;
    }
  }
  return out;
}

void store(void* d, GemmType t, int64_t i, double v) {
  const float f = static_cast<float>(v);
  if (t == GemmType::kFloat32) static_cast<float*>(d)[i] = f;
  if (t == GemmType::kBFloat16) static_cast<bf16_t*>(d)[i] = to_bf16(f);
  if (t == GemmType::kFloat16) static_cast<fp16_t*>(d)[i] = to_fp16(f);
}

}  // namespace

void gemm_cpu(const GemmParams& p) {
  const std::string err = gemm_check(p);
  if (!err.empty()) throw std::invalid_argument(err);
  const std::vector<double> a = decode_operand(p.a, p.m, p.k);
  const std::vector<double> b = decode_operand(p.b, p.n, p.k);
  for (int64_t i = 0; i < p.m; ++i) {
    for (int64_t j = 0; j < p.n; ++j) {
      double acc = 0.0;
      for (int64_t c = 0; c < p.k; ++c) acc += a[i * p.k + c] * b[j * p.k + c];
      if (p.bias) acc += element(p.bias, p.bias_type, j);
      if (p.accumulate) acc += element(p.d, p.d_type, i * p.n + j);
      if (p.residual) acc += element(p.residual, p.d_type, i * p.n + j);
      store(p.d, p.d_type, i * p.n + j, acc);
    }
  }
}

}  // namespace tpfp8
