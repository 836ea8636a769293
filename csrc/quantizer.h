// Quantizers: how one tensor of a Linear (input, weight or gradient) becomes FP8.
//
// A quantizer owns its recipe and says which usages it produces: row-wise data [M, K] for
// GEMMs that contract over K, column-wise data [K, M] (the transpose) for those that contract
// over M. Both come from one cast_transpose pass over the high-precision tensor.
#pragma once

#include <torch/types.h>

#include <functional>
#include <memory>
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

// One module's delayed-scaling state of its backward tensors (the gradient), updated at the
// end of the backward pass -- history rolled, scales recomputed -- batched with every other
// module's in one launch, after one all-reduce (MAX) of all their newest amaxes over
// amax_group when there is one (tensor parallelism). Owned by the module; shared here.
struct DelayedUpdate {
  at::Tensor history;           // [n, history_len] fp32, tensor-major, newest first
  at::Tensor scale, scale_inv;  // [n] fp32
  std::vector<double> fp8_max;  // [n]
  int64_t margin = 0;
  bool use_history_max = true;
  ProcessGroupPtr amax_group;  // null on a single device
};

// Updates now: the states that share a device, recipe and amax_group get one all-reduce and
// one launch (fp8_autocast's exit calls this for the forward states).
void update_delayed(const std::vector<std::shared_ptr<DelayedUpdate>>& updates);

// Queues `update` for the end of the running backward pass (a no-op outside backward; several
// calls for one state within a pass update it once). Each pass -- autograd graph task -- keeps
// its own queue, so concurrent backward passes (threads) each update their own states.
void update_after_backward(const std::shared_ptr<DelayedUpdate>& update);

struct QuantizerSpec {
  Scaling scaling = Scaling::kNone;
  Fp8Format format = Fp8Format::kE4M3;
  // Delayed scaling: cast with the module's current scale ([1] view) and fold this step's
  // amax into its history row 0 ([1] view); the update happens at the end of the step.
  at::Tensor scale;
  at::Tensor amax;
  // Current scaling: scale = fp8_max / max(amax, epsilon) of this very tensor. reduce_amax,
  // when set, runs on the [1] amax before the scale is computed (tensor parallelism makes it
  // an all-reduce MAX so every rank gets the same scale).
  double epsilon = 0.0;
  std::function<void(at::Tensor&)> reduce_amax;
  // Delayed scaling of a gradient: the state to update once backward is done.
  std::shared_ptr<DelayedUpdate> after_backward;
};

// Quantizes a 2-D contiguous tensor. The outputs are fresh tensors unless `into` provides
// buffers of the right shapes (the weight cache), which are then written in place.
Fp8Tensor quantize(const at::Tensor& x, const QuantizerSpec& q, bool rowwise, bool columnwise,
                   const Fp8Tensor* into = nullptr);

}  // namespace tpfp8
