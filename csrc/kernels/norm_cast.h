// Fused LayerNorm / RMSNorm forward -> FP8 cast, for the norm that feeds an FP8 Linear: one
// read of the input writes the normalized output, its FP8 row-wise and column-wise codes, the
// amax and the per-row statistics backward needs.
//
// The reduction order is part of the op's definition, so the CUDA kernel and the CPU reference
// give the same bytes (mean, rstd, every output):
//   - a row is split into 8-element chunks; lane l of L = norm_lanes(hidden) owns chunks l,
//     l + L, ... and adds its elements' terms in order into an fp32 partial starting at +0;
//   - the lanes' partials reduce as warps of 32 (butterfly: lane i += lane i ^ 16, ^8, ^4, ^2,
//     ^1), then the L / 32 warp sums are added in warp order;
//   - every operation is one IEEE fp32 operation rounded to nearest (no rsqrt); the square
//     terms are fused into their partial (fma) and so is LayerNorm's beta (norm_apply).
// LayerNorm is two-pass over the row (held in registers): mean, then the centered variance.
#pragma once

#include <cmath>
#include <cstdint>

#include "cast.h"
#include "dtype.h"
#include "fp8_format.h"
#include "launch.h"

namespace tpfp8 {

enum class NormType : int { kLayerNorm = 0, kRMSNorm = 1 };

constexpr int kNormLanes = 256;       // the most threads (CPU: emulated lanes) of one row
constexpr int kNormMaxChunks = 8;     // 8-element chunks a lane holds: hidden <= 16384
constexpr int kNormHiddenAlign = 16;  // the FP8 GEMMs' K alignment
constexpr int64_t kNormMaxHidden = int64_t{kNormLanes} * kNormMaxChunks * 8;

// The lanes that reduce a row: 128 for rows of up to 4096, so a lane holds up to 32 elements and
// the work done once per row and lane (the team-wide sums, rstd, the walk) is spread over twice
// as many as with 256; 256 for wider rows, which 128 lanes could not hold in registers.
TPFP8_HD constexpr int norm_lanes(int64_t hidden) { return hidden <= 4096 ? 128 : kNormLanes; }

// A lane's partial s of the row's second reduction plus x's term, fused: (x - mean)^2 for
// LayerNorm, x^2 for RMSNorm (whose "mean" is 0 by convention).
TPFP8_HD float norm_square_add(float s, float x, float mean, NormType n) {
  const float d = n == NormType::kLayerNorm ? sub_rn(x, mean) : x;
  return fma_rn(d, d, s);
}
// 1 / sqrt(sum_sq / hidden + eps).
TPFP8_HD float norm_rstd(float sum_sq, int64_t hidden, float eps) {
  return div_rn(1.0f, sqrt_rn(add_rn(div_rn(sum_sq, static_cast<float>(hidden)), eps)));
}
// y = (x - mean) * rstd * gamma + beta (LayerNorm; the last two fused), x * rstd * gamma
// (RMSNorm), left to right.
TPFP8_HD float norm_apply(float x, float mean, float rstd, float gamma, float beta, NormType n) {
  if (n == NormType::kRMSNorm) return mul_rn(mul_rn(x, rstd), gamma);
  return fma_rn(mul_rn(sub_rn(x, mean), rstd), gamma, beta);
}

// One fused norm over a [rows, hidden] tensor (hidden % 16 == 0, hidden <= kNormMaxHidden).
//   y[r, c]   = norm_apply(...) rounded to the input dtype (the FP8 codes and the amax are of
//               this rounded value, so they equal norm-then-cast_transpose bit for bit)
//   out       = y in the input dtype                               (nullptr: not written)
//   rowwise / columnwise / amax / scale_inv as CastParams, of y    (nullptr: not written)
//   mean[r]   = the row's mean (LayerNorm only), rstd[r] = 1/sqrt(var + eps), fp32
// gamma and beta are fp32 [hidden]; beta nullptr means 0 (and must be for RMSNorm).
// Current scaling runs two launches: norm_cast_amax_cuda (only `amax`), then norm_cast_cuda
// with scale_amax pointing at it.
struct NormCastParams {
  const void* input = nullptr;
  DType dtype = DType::kFloat32;
  int64_t rows = 0;
  int64_t hidden = 0;
  NormType norm = NormType::kLayerNorm;
  const float* gamma = nullptr;
  const float* beta = nullptr;
  float eps = 1e-5f;
  Fp8Format format = Fp8Format::kE4M3;
  const float* scale = nullptr;
  const float* scale_amax = nullptr;  // set: current scaling from this amax, `scale` unused
  float scale_epsilon = 0.0f;
  void* out = nullptr;
  uint8_t* rowwise = nullptr;
  uint8_t* columnwise = nullptr;
  float* amax = nullptr;
  float* scale_inv = nullptr;
  float* mean = nullptr;
  float* rstd = nullptr;
};

// The params of current scaling's first pass: p with every output but amax (and the scale)
// cleared.
inline NormCastParams amax_pass_params(NormCastParams p) {
  p.out = nullptr, p.rowwise = nullptr, p.columnwise = nullptr;
  p.scale_inv = nullptr, p.mean = nullptr, p.rstd = nullptr;
  p.scale = nullptr, p.scale_amax = nullptr;
  return p;
}

// What a NormCastParams may not be, in words (nullptr when valid): the launchers return
// cudaErrorInvalidValue and the CPU reference does nothing for such params.
const char* norm_cast_invalid(const NormCastParams& p);

// Every output p names, in one pass over the input.
cudaError_t norm_cast_cuda(const NormCastParams& p, cudaStream_t stream);
// Current scaling's first pass: folds max |y| into *p.amax and writes nothing else (p's other
// outputs are ignored).
cudaError_t norm_cast_amax_cuda(const NormCastParams& p, cudaStream_t stream);

void norm_cast_cpu(const NormCastParams& p);
void norm_cast_amax_cpu(const NormCastParams& p);

}  // namespace tpfp8
