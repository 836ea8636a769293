// Delayed-scaling update at the end of a step, for n tensors in one launch.
//
// amax_history is [history_len, n] row-major; row 0 holds this step's amax of each tensor.
//   amax_i   = max over all rows of column i     (use_history_max)   or row 0 (most recent)
//   scale_i  = fp8_max_i * 2^-margin / amax_i    kept unchanged if amax_i is 0;
//              a scale that overflows fp32 becomes FLT_MAX
//   scale_inv_i = 1 / scale_i
// then the history rolls one row toward the past (row h <- row h-1, the oldest row drops
// out) and row 0 is zeroed for the next step.
//
// A step whose amax (row 0) is not finite -- NaN or Inf: an overflowed step that GradScaler or
// a loss-spike guard skips -- is dropped as if it had not run: row 0 is zeroed, the history
// does not roll, scale and scale_inv stay. So one bad step never freezes the scale for
// history_len steps. Non-finite values in older rows (a checkpoint written before this rule)
// are ignored by the max.
#pragma once

#include <cstdint>

#include "fp8_format.h"
#include "launch.h"

namespace tpfp8 {

struct DelayedScalingParams {
  float* amax_history = nullptr;  // [history_len, num_tensors]
  int64_t history_len = 0;
  int64_t num_tensors = 0;
  float* scale = nullptr;          // [num_tensors]
  float* scale_inv = nullptr;      // [num_tensors]
  const float* fp8_max = nullptr;  // [num_tensors], the max of each tensor's format
  int margin = 0;
  bool use_history_max = true;
};

cudaError_t delayed_scaling_update_cuda(const DelayedScalingParams& p, cudaStream_t stream);
void delayed_scaling_update_cpu(const DelayedScalingParams& p);

// The same update for tensors whose state lives in separate buffers (each module's own), in
// one launch: tensor i's history is history[i][0 .. history_len), contiguous, newest first.
// Where previous[i] is set, the scale before the update is written there first (what an
// activation checkpoint's recompute after the update casts with), in the same launch.
// Passed by value as kernel parameters, so a captured CUDA graph replays it as it is.
struct DelayedScalingBatch {
  static constexpr int kMaxTensors = 96;  // keeps the parameters under 4 KB
  int num_tensors = 0;
  int64_t history_len = 0;
  int margin = 0;
  bool use_history_max = true;
  float* history[kMaxTensors] = {};
  float* scale[kMaxTensors] = {};
  float* scale_inv[kMaxTensors] = {};
  float* previous[kMaxTensors] = {};  // (null: not kept)
  float fp8_max[kMaxTensors] = {};
};

static_assert(sizeof(DelayedScalingBatch) <= 4096, "a kernel parameter: keep it under 4 KB");

cudaError_t delayed_scaling_update_batch_cuda(const DelayedScalingBatch& b, cudaStream_t stream);
void delayed_scaling_update_batch_cpu(const DelayedScalingBatch& b);

// Whether an amax may enter the history and the scale: finite and not negative -- by its bits,
// so -0.0 (whose bits would win the unsigned max) is refused too.
TPFP8_HD bool usable_amax(float amax) { return float_bits(amax) <= float_bits(kFloatMax); }

// An amax as bits whose unsigned max is the float max; unusable amaxes count as 0.
TPFP8_HD uint32_t amax_bits(float amax) { return usable_amax(amax) ? float_bits(amax) : 0u; }

// One tensor's new scale from its amax (shared by the CPU reference and the kernel).
TPFP8_HD float scale_from_amax(float amax, float old_scale, float fp8_max, int margin) {
  if (!(amax > 0.0f) || !(amax <= kFloatMax)) return old_scale;  // 0, inf or NaN
  float s = fp8_max / amax;
  // 2^-margin applied as a separate exact power-of-two product, identical on host and device.
  s = s * bits_float(static_cast<uint32_t>(127 - margin) << 23);
  return s <= kFloatMax ? s : kFloatMax;
}

}  // namespace tpfp8
