// Shared helpers of the GoogleTest suites: random inputs with the awkward values mixed in,
// and device buffers for comparing CUDA kernels with the CPU reference.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/dtype.h"
#include "kernels/fp8_format.h"

#if defined(TPFP8_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace tpfp8::testing {

inline const char* format_name(Fp8Format f) { return f == Fp8Format::kE4M3 ? "E4M3" : "E5M2"; }

// Random fp32 values over many magnitudes, with ~2% specials (0, -0, inf, NaN, fp32
// subnormals) so every kernel path meets them.
inline std::vector<float> random_floats(size_t n, uint64_t seed, float spread = 10.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> special(0, 199);
  const float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 1e-40f, -3e-42f, 448.0f};
  std::vector<float> v(n);
  for (auto& x : v) {
    const int s = special(rng);
    x = s < 8 ? specials[s] : normal(rng) * std::exp2(std::round(normal(rng) * spread / 4));
  }
  return v;
}

// Storage of `values` in element type T (bf16/fp16 rounded to nearest even).
template <typename T>
std::vector<T> convert(const std::vector<float>& values) {
  std::vector<T> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = from_float<T>(values[i]);
  return out;
}

inline bool gpu_available() {
#if defined(TPFP8_WITH_CUDA)
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
#else
  return false;
#endif
}

#define TPFP8_REQUIRE_GPU()                                                             \
  do {                                                                                  \
    if (!::tpfp8::testing::gpu_available()) {                                           \
      GTEST_SKIP() << "no CUDA GPU visible (or tpfp8 built without CUDA): CUDA == CPU " \
                      "byte comparisons need the device";                               \
    }                                                                                   \
  } while (0)

#if defined(TPFP8_WITH_CUDA)
#define TPFP8_CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << cudaGetErrorString(cudaGetLastError())

// A device copy of a host vector, freed on scope exit; `poison` fills it with a byte pattern
// so an element a kernel forgot to write fails the comparison.
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n, int poison = 0xA5) : n_(n) {
    if (cudaMalloc(&ptr_, std::max<size_t>(1, n) * sizeof(T)) != cudaSuccess) ptr_ = nullptr;
    if (ptr_) cudaMemset(ptr_, poison, std::max<size_t>(1, n) * sizeof(T));
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) {
    if (ptr_) cudaMemcpy(ptr_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(ptr_); }
  T* get() const { return static_cast<T*>(ptr_); }
  std::vector<T> to_host() const {
    std::vector<T> h(n_);
    cudaDeviceSynchronize();
    cudaMemcpy(h.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost);
    return h;
  }

 private:
  void* ptr_ = nullptr;
  size_t n_;
};
#endif

// Byte-exact comparison that reports the first mismatching index.
template <typename T>
::testing::AssertionResult same_bytes(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "sizes differ";
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) {
      return ::testing::AssertionFailure()
             << "first difference at element " << i << " of " << a.size();
    }
  }
  return ::testing::AssertionSuccess();
}

struct Shape {
  int64_t rows, cols;
};
// The shapes every kernel is checked at: 1-element, long rows, odd tails, large; for the
// cast-transpose's vector path also one tile cut into bands (16x8, 48x4104: a band partly
// past the last row) and partial tiles on both edges (4000x4000).
inline const std::vector<Shape>& kernel_shapes() {
  static const std::vector<Shape> shapes = {{1, 1},       {1, 4097},    {17, 33},     {127, 129},
                                            {160, 136},   {64, 256},    {16, 8},      {48, 4104},
                                            {4000, 4000}, {4096, 4096}, {4096, 4104}, {8191, 129}};
  return shapes;
}

}  // namespace tpfp8::testing
