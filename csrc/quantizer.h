// Quantizers: how one tensor of a Linear (input, weight or gradient) becomes FP8.
//
// A quantizer owns its recipe and says which usages it produces: row-wise data [M, K] for
// GEMMs that contract over K, column-wise data [K, M] (the transpose) for those that contract
// over M. Both come from one cast_transpose pass over the high-precision tensor.
#pragma once

#include <torch/types.h>

#include <functional>
#include <vector>

#include "comm.h"
#include "kernels/fp8_format.h"

namespace tpfp8 {

// A per-tensor-scaled FP8 tensor. Either data part may be undefined.
struct Fp8Tensor {
  at::Tensor rowwise;     // [M, K] uint8
  at::Tensor columnwise;  // [K, M] uint8
  at::Tensor scale_inv;   // [1] fp32, shared by both parts
  Fp8Format format = Fp8Format::kE4M3;
};

enum class Scaling : int { kNone = 0, kDelayed = 1, kCurrent = 2 };

// Delayed-scaling update of many layers' states now: histories[j] [n_j, H] (tensor-major,
// newest first), scales[j] / scale_invs[j] [n_j], fp8_max one per tensor. With `amax_group`
// the newest amaxes of all of them are all-reduced (MAX) first, in one collective; then the
// histories roll and the scales update in one launch per 96 tensors.
void update_delayed(const std::vector<at::Tensor>& histories, const std::vector<at::Tensor>& scales,
                    const std::vector<at::Tensor>& scale_invs, const std::vector<double>& fp8_max,
                    int64_t margin, bool use_history_max, const ProcessGroupPtr& amax_group);

struct QuantizerSpec {
  Scaling scaling = Scaling::kNone;
  Fp8Format format = Fp8Format::kE4M3;
  // Delayed scaling: cast with the module's current scale ([1] view) and fold this step's
  // amax into its history row 0 ([1] view; undefined: not recorded, as in a checkpoint's
  // recompute); the update happens at the end of the step.
  at::Tensor scale;
  at::Tensor amax;
  // Current scaling: scale = fp8_max / max(amax, epsilon) of this very tensor. reduce_amax,
  // when set, runs on the [1] amax before the scale is computed (tensor parallelism makes it
  // an all-reduce MAX so every rank gets the same scale).
  double epsilon = 0.0;
  std::function<void(at::Tensor&)> reduce_amax;
};

// Quantizes a 2-D contiguous tensor. The outputs are fresh tensors unless `into` provides
// buffers of the right shapes (the weight cache), which are then written in place.
Fp8Tensor quantize(const at::Tensor& x, const QuantizerSpec& q, bool rowwise, bool columnwise,
                   const Fp8Tensor* into = nullptr);

}  // namespace tpfp8
