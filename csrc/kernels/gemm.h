// One GEMM entry point for the three GEMMs of a Linear, in row-major terms:
//
//   D[M, N] = (a_scale_inv * b_scale_inv) * sum_k A[m, k] * B[n, k]  (+ bias[n])  (+ D if
//   accumulate, or + residual[m, n])
//
// A and B are K-major by default: A stored [M, K], B stored [N, K], K contiguous -- the layout
// Hopper's FP8 tensor cores take (cuBLASLt "TN"). High-precision operands may instead be stored
// K-outer (`transposed`: A as [K, M], B as [K, N]); FP8 operands never are, and nothing here
// transposes silently. Accumulation is in fp32 (`fast_accum` lets FP8 kernels accumulate in
// reduced precision between promotions; default off).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "dtype.h"
#include "fp8_format.h"
#include "launch.h"

namespace tpfp8 {

// The codes are what torch.ops.tpfp8.gemm takes (exported to Python as tpfp8._C.GemmType).
enum class GemmType : int {
  kFloat32 = 0,
  kBFloat16 = 1,
  kFloat16 = 2,
  kE4M3 = 3,
  kE5M2 = 4,
  kLast = kE5M2
};

// FP8 GEMMs on Hopper need the K-major dimensions (K and N) in multiples of this.
constexpr int64_t kFp8Multiple = 16;

inline GemmType gemm_type(Fp8Format f) {
  return f == Fp8Format::kE4M3 ? GemmType::kE4M3 : GemmType::kE5M2;
}

inline bool is_fp8(GemmType t) { return t == GemmType::kE4M3 || t == GemmType::kE5M2; }
inline int element_size(GemmType t) { return t == GemmType::kFloat32 ? 4 : is_fp8(t) ? 1 : 2; }
const char* gemm_type_name(GemmType t);

struct GemmOperand {
  const void* data = nullptr;
  GemmType type = GemmType::kBFloat16;
  const float* scale_inv = nullptr;  // FP8 only: one fp32 on the device (host for the CPU ref)
  bool transposed = false;           // stored K-outer ([K, rows]) instead of [rows, K]
};

struct GemmParams {
  int64_t m = 0, n = 0, k = 0;
  GemmOperand a, b;
  void* d = nullptr;                      // [M, N] row-major
  GemmType d_type = GemmType::kBFloat16;  // fp32, bf16 or fp16
  const void* bias = nullptr;             // [N] or null
  GemmType bias_type = GemmType::kBFloat16;
  bool accumulate = false;  // D += result (beta = 1), e.g. into fp32 main_grad
  // [M, N] row-major in D's type, added before D's one rounding (beta = 1 with C = residual):
  // a block's skip connection folded into the GEMM instead of a separate add. Not with
  // accumulate (that adds D itself).
  const void* residual = nullptr;
  bool fast_accum = false;
  void* workspace = nullptr;  // CUDA only
  size_t workspace_size = 0;
};

// Empty when the combination is supported, else a sentence naming what is wrong, the rule and
// how to fix it. Both the CPU reference and the CUDA path accept exactly these combinations.
std::string gemm_check(const GemmParams& p);

// Bytes of workspace the CUDA path wants per stream (Hopper: 32 MiB).
constexpr size_t kGemmWorkspaceBytes = size_t{32} << 20;

// cuBLASLt on `stream`. The algorithm is chosen once per (shape, types, flags) and cached; after
// that a call allocates nothing and never synchronises (CUDA-graph capturable). Returns an
// error string, empty on success.
std::string gemm_cuda(const GemmParams& p, cudaStream_t stream);

// Reference: decode, multiply and accumulate in fp64, scale, add, round to D's type.
void gemm_cpu(const GemmParams& p);

}  // namespace tpfp8
