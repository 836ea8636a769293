// Argument rules shared by the CPU reference and the cuBLASLt path of gemm.h.
#include <sstream>

#include "gemm.h"

namespace tpfp8 {

const char* gemm_type_name(GemmType t) {
  switch (t) {
    case GemmType::kFloat32:
      return "float32";
    case GemmType::kBFloat16:
      return "bfloat16";
    case GemmType::kFloat16:
      return "float16";
    case GemmType::kE4M3:
      return "fp8 e4m3";
    default:
      return "fp8 e5m2";
  }
}

namespace {

std::string fp8_rules(const GemmParams& p) {
  std::ostringstream err;
  if (p.a.type == GemmType::kE5M2 && p.b.type == GemmType::kE5M2) {
    err << "FP8 GEMM of two e5m2 operands is not supported (Hopper takes e4m3 x e4m3, "
           "e4m3 x e5m2, e5m2 x e4m3); quantize one operand as e4m3";
  } else if (!is_fp8(p.a.type) || !is_fp8(p.b.type)) {
    err << "cannot mix " << gemm_type_name(p.a.type) << " and " << gemm_type_name(p.b.type)
        << " operands; quantize both to FP8 or run both in high precision";
  } else if (p.a.transposed || p.b.transposed) {
    err << "FP8 operands must be K-major (A [M, K], B [N, K]): Hopper FP8 GEMMs are TN only; "
           "pass the column-wise (transposed) FP8 data instead";
  } else if (p.k % kFp8Multiple != 0) {
    err << "FP8 GEMM needs K (the contracted dimension) to be a multiple of " << kFp8Multiple
        << ", got K=" << p.k << "; pad the features to a multiple of " << kFp8Multiple;
  } else if (p.n % kFp8Multiple != 0) {
    err << "FP8 GEMM needs N (the output columns) to be a multiple of " << kFp8Multiple
        << ", got N=" << p.n << "; pad the features to a multiple of " << kFp8Multiple;
  } else if (!p.a.scale_inv || !p.b.scale_inv) {
    err << "FP8 operands need their scale_inv";
  } else if (p.bias && p.bias_type != (p.d_type == GemmType::kFloat16 ? GemmType::kFloat16
                                                                      : GemmType::kBFloat16)) {
    err << "FP8 GEMM with " << gemm_type_name(p.d_type) << " output takes a "
        << (p.d_type == GemmType::kFloat16 ? "float16" : "bfloat16") << " bias, got "
        << gemm_type_name(p.bias_type);
  }
  return err.str();
}

}  // namespace

std::string gemm_check(const GemmParams& p) {
  std::ostringstream err;
  if (p.m < 0 || p.n < 0 || p.k < 0) {
    err << "GEMM sizes must be non-negative, got M=" << p.m << " N=" << p.n << " K=" << p.k;
  } else if (is_fp8(p.d_type)) {
    err << "GEMM output must be float32, bfloat16 or float16, got " << gemm_type_name(p.d_type);
  } else if (p.accumulate && p.residual) {
    err << "a GEMM adds either D itself (accumulate) or a residual, not both; add the residual "
           "into D first";
  } else if (is_fp8(p.a.type) || is_fp8(p.b.type)) {
    return fp8_rules(p);
  } else if (p.a.type != p.b.type) {
    err << "high-precision GEMM operands must have one dtype, got " << gemm_type_name(p.a.type)
        << " and " << gemm_type_name(p.b.type);
  } else if (p.d_type != p.a.type && p.d_type != GemmType::kFloat32) {
    err << "GEMM of " << gemm_type_name(p.a.type) << " operands writes " << gemm_type_name(p.a.type)
        << " or float32, got " << gemm_type_name(p.d_type);
  } else if (p.bias && p.bias_type != p.d_type) {
    err << "bias must have the output dtype " << gemm_type_name(p.d_type) << ", got "
        << gemm_type_name(p.bias_type);
  }
  return err.str();
}

}  // namespace tpfp8
