// What runs on a Linear's input before its FP8 cast in the fused modules -- a norm
// (tpfp8.LayerNormLinear, RMSNormLinear, LayerNormMLP's fc1) or an activation (LayerNormMLP's
// fc2, whose input is fc1's output) -- written straight to FP8 by the same kernel where the
// recipe allows, and its backward.
#pragma once

#include <torch/types.h>

#include "ops.h"
#include "quantizer.h"

namespace tpfp8 {

enum class Prologue : int {
  kNone = 0,
  kLayerNorm = 1,
  kRMSNorm = 2,
  kGelu = 3,
  kSwiGLU = 4,
  kLast = kSwiGLU
};

inline bool is_norm(Prologue kind) {
  return kind == Prologue::kLayerNorm || kind == Prologue::kRMSNorm;
}

struct PrologueArgs {
  Prologue kind = Prologue::kNone;
  OptTensor weight, bias;  // a norm's gamma and (LayerNorm, optional) beta, [K]
  double eps = 0.0;
  bool any() const { return kind != Prologue::kNone; }
  bool norm() const { return is_norm(kind); }
  // The input's width for an output `cols` wide (SwiGLU's input is [a | b]).
  int64_t input_cols(int64_t cols) const { return kind == Prologue::kSwiGLU ? 2 * cols : cols; }
};
PrologueArgs prologue_args(int64_t kind, const OptTensor& weight, const OptTensor& bias,
                           double eps);

// Raises ValueError unless the prologue can run before a Linear of in_features `k` (per rank)
// on input x.
void check_prologue(const PrologueArgs& p, const at::Tensor& x, int64_t k, bool row_parallel);

// What a norm keeps for its backward (none for an activation; no mean for RMSNorm).
struct PrologueStats {
  at::Tensor mean, rstd;
};

// y = prologue(x) in x's dtype, for x [M, input_cols] (contiguous, 16-byte aligned).
at::Tensor prologue_high_precision(const at::Tensor& x, const PrologueArgs& p,
                                   PrologueStats& stats);
// The prologue with the FP8 cast in its pass, for a quantizer to drive (quantize_fused);
// `hp_out`, if defined, receives y in x's dtype from the same pass. `stats` must outlive it.
FusedCast fused_prologue(const at::Tensor& x, const PrologueArgs& p, PrologueStats& stats,
                         const at::Tensor& hp_out);

// An activation's backward, dx = dy * act'(x), with the FP8 cast of dx in its pass (the
// gradient of LayerNormMLP's fc1 output, cast with fc1's gradient quantizer); `dbias` (float32
// [x's columns]), if given, receives dx's column sums from the cast pass (fc1's bias gradient).
FusedCast fused_activation_backward(const at::Tensor& dy, const at::Tensor& x,
                                    const PrologueArgs& p, const OptTensor& dbias = std::nullopt);

struct PrologueGrads {
  at::Tensor dx, dweight, dbias;  // dweight / dbias: a norm's, undefined for an activation
};
// The gradients for x [M, input_cols] from dy, the gradient of y.
PrologueGrads prologue_backward(const at::Tensor& dy, const at::Tensor& x, const PrologueArgs& p,
                                const PrologueStats& stats, const OptTensor& dx_add = std::nullopt);

}  // namespace tpfp8
