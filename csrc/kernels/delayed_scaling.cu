// Delayed-scaling update (delayed_scaling.h): one warp per tensor reduces the column of the
// history, computes the scale, then rolls the column. Rows are read before any is written
// (the warp syncs in between), so the roll is in place.
#include <cuda_runtime.h>

#include "delayed_scaling.h"

namespace tpfp8 {
namespace {

constexpr int kWarpsPerBlock = 8;

__global__ void delayed_scaling_kernel(DelayedScalingParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t i = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
  if (i >= p.num_tensors) return;
  const int64_t n = p.num_tensors;
  float* h = p.amax_history + i;
  // History values are amaxes: >= 0 or NaN, so the max of their bits is the max (NaN wins).
  uint32_t amax = 0;
  const int64_t rows = p.use_history_max ? p.history_len : 1;
  for (int64_t r = lane; r < rows; r += 32) amax = max(amax, float_bits(h[r * n]));
  amax = __reduce_max_sync(0xFFFFFFFFu, amax);
  if (lane == 0) {
    p.scale[i] = scale_from_amax(bits_float(amax), p.scale[i], p.fp8_max[i], p.margin);
    p.scale_inv[i] = 1.0f / p.scale[i];
  }
  // Roll in chunks of 32 rows from the oldest end: read a chunk, sync, write it one row down.
  for (int64_t top = p.history_len - 1; top >= 0; top -= 32) {
    const int64_t r = top - lane;
    const float v = (r >= 1) ? h[(r - 1) * n] : 0.0f;
    __syncwarp();
    if (r >= 0) h[r * n] = v;
    __syncwarp();
  }
}

}  // namespace

cudaError_t delayed_scaling_update_cuda(const DelayedScalingParams& p, cudaStream_t stream) {
  if (p.num_tensors == 0) return cudaSuccess;
  const int blocks = static_cast<int>((p.num_tensors + kWarpsPerBlock - 1) / kWarpsPerBlock);
  delayed_scaling_kernel<<<blocks, 32 * kWarpsPerBlock, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace tpfp8
