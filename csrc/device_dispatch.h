// Runs a kernel-library op on the tensor's device: the CPU reference for CPU tensors, the CUDA
// launcher on torch's current stream (under a device guard) for CUDA tensors.
#pragma once

#include <torch/types.h>

#include <cstring>

#include "kernels/launch.h"

#if defined(TPFP8_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace tpfp8 {

template <typename CpuFn, typename CudaFn>
void run_on_device(const at::Tensor& t, CpuFn&& cpu, CudaFn&& cuda) {
  if (t.device().is_cpu()) {
    cpu();
    return;
  }
#if defined(TPFP8_WITH_CUDA)
  if (t.is_cuda()) {
    const c10::cuda::CUDAGuard guard(t.device());
    const cudaError_t err = cuda(c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(err == cudaSuccess, "tpfp8 CUDA launch failed: ", cudaGetErrorString(err));
    return;
  }
#endif
  (void)cuda;
  TORCH_CHECK(
      false, "tpfp8 ops run on CPU or CUDA tensors, got a tensor on ", t.device(),
      t.is_cuda() ? " but this build of tpfp8 has no CUDA; rebuild with nvcc available" : "");
}

// Zeroes a small tensor's bytes: a memset, not at::zeros (no TensorIterator set-up on the CPU,
// no kernel on the GPU).
inline void zero_bytes(const at::Tensor& t) {
  run_on_device(
      t, [&] { std::memset(t.data_ptr(), 0, t.nbytes()); },
      [&](cudaStream_t s) {
#if defined(TPFP8_WITH_CUDA)
        return cudaMemsetAsync(t.data_ptr(), 0, t.nbytes(), s);
#else
        return cudaSuccess;  // never called: run_on_device takes no CUDA tensor in this build
#endif
      });
}

}  // namespace tpfp8
