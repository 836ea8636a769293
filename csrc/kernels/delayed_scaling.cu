// Delayed-scaling update (delayed_scaling.h): one warp per tensor reduces its history,
// computes the scale, then rolls the history. Rows are read before any is written
// (the warp syncs in between), so the roll is in place.
#include <cuda_runtime.h>

#include "delayed_scaling.h"

namespace tpfp8 {
namespace {

constexpr int kWarpsPerBlock = 8;

// One warp updates one tensor whose history is h[0], h[stride], ... h[(len - 1) * stride],
// keeping its scale before the update in `previous` where that is set.
__device__ void update_one(float* h, int64_t stride, int64_t len, bool use_history_max,
                           float fp8_max, int margin, float* scale, float* scale_inv,
                           float* previous) {
  const int lane = threadIdx.x % 32;
  if (lane == 0 && previous != nullptr) *previous = *scale;
  if (!usable_amax(h[0])) {  // a bad step is dropped (delayed_scaling.h); every lane agrees
    __syncwarp();
    if (lane == 0) h[0] = 0.0f;
    return;
  }
  uint32_t amax = 0;
  const int64_t rows = use_history_max ? len : 1;
  for (int64_t r = lane; r < rows; r += 32) amax = max(amax, amax_bits(h[r * stride]));
  amax = __reduce_max_sync(0xFFFFFFFFu, amax);
  if (lane == 0) {
    *scale = scale_from_amax(bits_float(amax), *scale, fp8_max, margin);
    *scale_inv = 1.0f / *scale;
  }
  // Roll in chunks of 32 rows from the oldest end: read a chunk, sync, write it one row down.
  for (int64_t top = len - 1; top >= 0; top -= 32) {
    const int64_t r = top - lane;
    const float v = (r >= 1) ? h[(r - 1) * stride] : 0.0f;
    __syncwarp();
    if (r >= 0) h[r * stride] = v;
    __syncwarp();
  }
}

__global__ void delayed_scaling_kernel(DelayedScalingParams p) {
  const int64_t i = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
  if (i >= p.num_tensors) return;
  update_one(p.amax_history + i, p.num_tensors, p.history_len, p.use_history_max, p.fp8_max[i],
             p.margin, p.scale + i, p.scale_inv + i, nullptr);
}

__global__ void delayed_scaling_batch_kernel(const __grid_constant__ DelayedScalingBatch b) {
  const int i = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  if (i >= b.num_tensors) return;
  update_one(b.history[i], 1, b.history_len, b.use_history_max, b.fp8_max[i], b.margin, b.scale[i],
             b.scale_inv[i], b.previous[i]);
}

}  // namespace

cudaError_t delayed_scaling_update_cuda(const DelayedScalingParams& p, cudaStream_t stream) {
  if (p.num_tensors == 0) return cudaSuccess;
  const int blocks = static_cast<int>((p.num_tensors + kWarpsPerBlock - 1) / kWarpsPerBlock);
  delayed_scaling_kernel<<<blocks, 32 * kWarpsPerBlock, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t delayed_scaling_update_batch_cuda(const DelayedScalingBatch& b, cudaStream_t stream) {
  if (b.num_tensors == 0) return cudaSuccess;
  const int blocks = (b.num_tensors + kWarpsPerBlock - 1) / kWarpsPerBlock;
  delayed_scaling_batch_kernel<<<blocks, 32 * kWarpsPerBlock, 0, stream>>>(b);
  return cudaGetLastError();
}

}  // namespace tpfp8
