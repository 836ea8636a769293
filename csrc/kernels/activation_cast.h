// An activation fused with the FP8 casts around it (the MLP block fc1 -> act -> fc2):
//   forward:  act(x) written straight as FP8 row-wise and/or column-wise (fc2's fprop and wgrad
//             operands), optionally also in high precision;
//   backward: dx = dy * act'(x) from fc2's dgrad output dy and the saved pre-activation x,
//             written straight as FP8 (fc1's dgrad and wgrad operands), optionally also in high
//             precision.
// GELU is torch's default (erf) form; SwiGLU takes x = [a | b] ([rows, 2n]) to silu(a) * b
// ([rows, n]), as TransformerEngine's swiglu, and its gradient is [da | db] ([rows, 2n]).
//
// The activation is computed in fp32 (activation_math.h) and cast from fp32: the FP8 codes
// and the amax are those of the fp32 value, the high-precision output its rounding to the
// input's dtype. CUDA launchers (`*_cuda`) and CPU references (`*_cpu`) give the same bytes.
//
// Current scaling takes two launches: an amax-only pass (no output set, `amax` set), then the
// cast pass with `scale_amax` pointing at that amax (after any all-reduce of it). That reads x
// (and dy) twice but writes act(x) only as FP8: for bf16 GELU 2 + 2 + 1 + 1 = 6 bytes per
// element against 10 unfused (act: read 2, write 2; amax: read 2; cast-transpose: read 2,
// write 1 + 1). Delayed scaling is one pass: 4 bytes against 8.
#pragma once

#include <cstdint>

#include "activation_math.h"
#include "cast.h"

namespace tpfp8 {

enum class Activation : int { kGelu = 0, kSwiGLU = 1 };

struct ActivationCastParams {
  Activation activation = Activation::kGelu;
  bool backward = false;
  // x [rows, in_cols] with in_cols = n (GELU) or 2n (SwiGLU); backward: dy [rows, n] too, of
  // the same dtype.
  const void* input = nullptr;
  const void* grad = nullptr;
  DType dtype = DType::kFloat32;
  int64_t rows = 0;
  int64_t n = 0;  // columns of act(x)
  Fp8Format format = Fp8Format::kE4M3;
  // As CastParams: `scale`, or with `scale_amax` current scaling from that amax.
  const float* scale = nullptr;
  const float* scale_amax = nullptr;
  float epsilon = 0.0f;
  // The result y (forward: act(x), [rows, n]; backward: dx, [rows, in_cols]), each nullable:
  //   rowwise [rows, out_cols], columnwise [out_cols, rows] FP8; out [rows, out_cols] in dtype;
  //   *amax = max(*amax, max |y|) (NaN-propagating); *scale_inv = 1 / scale.
  uint8_t* rowwise = nullptr;
  uint8_t* columnwise = nullptr;
  void* out = nullptr;
  float* amax = nullptr;
  float* scale_inv = nullptr;
  // Backward only: dbias[c] = sum over rows r of y[r, c] ([out_cols] fp32; fc1's bias gradient),
  // of the fp32 results (not their rounding to dtype), in cast.h's order (CastParams::dbias), with
  // dbias_partial ([dbias_tiles(rows), out_cols] fp32) as the GPU's workspace; the CPU reference
  // fills it too when given. nullptr: skipped. It is an output like the others, so current
  // scaling passes it to the cast pass only (the amax pass sets nothing but `amax`). Forward
  // with dbias: the CUDA launcher returns cudaErrorInvalidValue, the CPU reference ignores it.
  float* dbias = nullptr;
  float* dbias_partial = nullptr;

  int64_t in_cols() const { return activation == Activation::kSwiGLU ? 2 * n : n; }
  int64_t out_cols() const { return backward ? in_cols() : n; }
};

// One element of the result from the inputs of column k of act(x): x0 = x[r, k],
// x1 = x[r, n + k] (SwiGLU), g = dy[r, k] (backward) give y0, the result's column k, and for
// SwiGLU's backward y1, its column n + k. All-zero inputs give exactly 0 (padding is harmless).
template <Activation A, bool kBackward>
TPFP8_HD void activation_element(float x0, float x1, float g, float& y0, float& y1) {
  if constexpr (A == Activation::kGelu) {
    y0 = kBackward ? mul_rn(g, gelu_grad(x0)) : gelu(x0);
  } else if constexpr (kBackward) {
    swiglu_grad(x0, x1, g, y0, y1);
  } else {
    y0 = mul_rn(silu(x0), x1);
  }
}

inline ScaleSource scale_source(const ActivationCastParams& p) {
  return {p.scale, p.scale_amax, p.epsilon};
}

cudaError_t activation_cast_cuda(const ActivationCastParams& p, cudaStream_t stream);
void activation_cast_cpu(const ActivationCastParams& p);

}  // namespace tpfp8
