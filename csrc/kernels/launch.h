// What the CUDA launchers of this library share: the stream and status types, without making
// CPU-only users include the CUDA runtime. The launchers exist only in builds with CUDA
// (TPFP8_WITH_CUDA); the CPU references always exist.
#pragma once

#if defined(TPFP8_WITH_CUDA)
#include <cuda_runtime_api.h>
#else
// Same declarations the CUDA runtime makes, so signatures read the same in both builds.
struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;
enum cudaError { cudaSuccess = 0 };
typedef enum cudaError cudaError_t;
#endif
