// CPU reference of the delayed-scaling update (delayed_scaling.h).
#include <algorithm>

#include "delayed_scaling.h"

namespace tpfp8 {

namespace {

// One tensor: its history is h[0], h[stride], ... h[(len - 1) * stride]; its scale before the
// update goes to `previous` where that is set.
void update_one(float* h, int64_t stride, int64_t len, bool use_history_max, float fp8_max,
                int margin, float* scale, float* scale_inv, float* previous) {
  if (previous != nullptr) *previous = *scale;
  if (!usable_amax(h[0])) {  // a bad step is dropped (delayed_scaling.h)
    h[0] = 0.0f;
    return;
  }
  uint32_t amax = float_bits(h[0]);
  if (use_history_max) {
    for (int64_t r = 1; r < len; ++r) amax = std::max(amax, amax_bits(h[r * stride]));
  }
  *scale = scale_from_amax(bits_float(amax), *scale, fp8_max, margin);
  *scale_inv = 1.0f / *scale;
  for (int64_t r = len - 1; r > 0; --r) h[r * stride] = h[(r - 1) * stride];
  h[0] = 0.0f;
}

}  // namespace

void delayed_scaling_update_cpu(const DelayedScalingParams& p) {
  for (int64_t i = 0; i < p.num_tensors; ++i) {
    update_one(p.amax_history + i, p.num_tensors, p.history_len, p.use_history_max, p.fp8_max[i],
               p.margin, p.scale + i, p.scale_inv + i, nullptr);
  }
}

void delayed_scaling_update_batch_cpu(const DelayedScalingBatch& b) {
  for (int i = 0; i < b.num_tensors; ++i) {
    update_one(b.history[i], 1, b.history_len, b.use_history_max, b.fp8_max[i], b.margin,
               b.scale[i], b.scale_inv[i], b.previous[i]);
  }
}

}  // namespace tpfp8
