// CPU reference of the delayed-scaling update (delayed_scaling.h).
#include <algorithm>
#include <vector>

#include "delayed_scaling.h"

namespace tpfp8 {

void delayed_scaling_update_cpu(const DelayedScalingParams& p) {
  const int64_t n = p.num_tensors;
  for (int64_t i = 0; i < n; ++i) {
    float* h = p.amax_history + i;  // column i, stride n
    uint32_t amax = float_bits(h[0]);
    if (p.use_history_max) {
      for (int64_t r = 1; r < p.history_len; ++r) amax = std::max(amax, float_bits(h[r * n]));
    }
    p.scale[i] = scale_from_amax(bits_float(amax), p.scale[i], p.fp8_max[i], p.margin);
    p.scale_inv[i] = 1.0f / p.scale[i];
    for (int64_t r = p.history_len - 1; r > 0; --r) h[r * n] = h[(r - 1) * n];
    h[0] = 0.0f;
  }
}

}  // namespace tpfp8
