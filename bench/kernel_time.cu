// Kernel time of the casts, norm_cast, norm_backward and activation_cast at Llama-like shapes,
// without torch: for A/B runs of kernel variants, each binary built from one tree's kernel sources
// (bench/RESULTS.md, 11th session). Run on the GPU machine, from the repository root:
//   K=csrc/kernels; F="-std=c++17 --expt-relaxed-constexpr -O3 -DTPFP8_WITH_CUDA -Icsrc \
//     -gencode=arch=compute_90a,code=sm_90a -Xcompiler -ffp-contract=off"
//   nvcc $F -o /tmp/kernel_time bench/kernel_time.cu $K/norm_cast.cu $K/norm_backward.cu \
//     $K/activation_cast.cu $K/cast.cu $K/cast_transpose.cu $K/norm_cast_cpu.cpp \
//     $K/norm_backward_cpu.cpp $K/activation_cast_cpu.cpp $K/cast_cpu.cpp
//   /tmp/kernel_time [all|copy|cast|norm|normbwd|act]   # ONCE=1: one launch each (for ncu)
// Inputs are uniform in [-2, 2) bf16; the scale is 1 (delayed scaling). GB/s counts the bytes
// each kernel must move (bf16 in, FP8 out).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/activation_cast.h"
#include "kernels/cast.h"
#include "kernels/norm_backward.h"
#include "kernels/norm_cast.h"

namespace {
using namespace tpfp8;

// Microseconds per launch: the mean of 30 back-to-back launches after 3 untimed (ONCE set: one
// launch, for a profiler).
template <typename F>
float time_us(F f, int reps = 30) {
  if (getenv("ONCE")) {
    f();
    cudaDeviceSynchronize();
    return 1.0f;
  }
  for (int i = 0; i < 3; ++i) f();
  cudaEvent_t a, b;
  cudaEventCreate(&a), cudaEventCreate(&b);
  cudaEventRecord(a);
  for (int i = 0; i < reps; ++i) f();
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms = 0.0f;
  cudaEventElapsedTime(&ms, a, b);
  return ms * 1e3f / reps;
}

struct Buffers {
  void *x, *dy, *row, *col, *out;
  float *gamma, *beta, *scale, *amax, *scale_inv;
};

Buffers make_buffers() {
  const size_t elems = size_t{8192} * 28672, bytes = elems * 2;
  Buffers b{};
  cudaMalloc(&b.x, bytes), cudaMalloc(&b.dy, bytes), cudaMalloc(&b.row, bytes);
  cudaMalloc(&b.col, bytes), cudaMalloc(&b.out, bytes);
  cudaMalloc(&b.gamma, 16384 * 4), cudaMalloc(&b.beta, 16384 * 4);  // beta: lines of its own
  cudaMalloc(&b.scale, 4), cudaMalloc(&b.amax, 4), cudaMalloc(&b.scale_inv, 4);
  std::vector<uint16_t> h(elems);  // bf16 bits, uniform in [-2, 2) (a fixed LCG)
  uint32_t s = 1;
  for (auto& v : h) {
    s = s * 1664525u + 1013904223u;
    const float f = ((s >> 8) / 16777216.0f - 0.5f) * 4.0f;
    uint32_t u;
    memcpy(&u, &f, 4);
    v = static_cast<uint16_t>(u >> 16);
  }
  cudaMemcpy(b.x, h.data(), bytes, cudaMemcpyHostToDevice);
  cudaMemcpy(b.dy, h.data(), bytes, cudaMemcpyHostToDevice);
  const std::vector<float> ones(16384, 1.0f);
  cudaMemcpy(b.gamma, ones.data(), 16384 * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(b.beta, ones.data(), 16384 * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(b.scale, ones.data(), 4, cudaMemcpyHostToDevice);
  return b;
}

void time_copy(const Buffers& b) {
  for (size_t mb : {134, 470}) {
    const size_t bytes = mb << 20;  // moved: half read, half written
    const float us = time_us([&] { cudaMemcpyAsync(b.out, b.x, bytes / 2, cudaMemcpyDefault); });
    printf("copy %zu MB moved: %.1f us, %.0f GB/s\n", mb, us, bytes / us / 1e3);
  }
}

// The MLP block's casts at hidden 4096 (bf16, 8192 tokens, FFN 16384): cast-transpose of x
// (E4M3) and of the output gradient (E5M2, with and without the bias gradient), of a weight
// [16384, 4096] (E4M3); row-wise-only quantize and the amax pass of current scaling. GB/s counts
// bf16 in, FP8 out (and the amax pass's read).
void time_cast(const Buffers& b) {
  float* partial;
  cudaMalloc(&partial, dbias_tiles(16384) * 4096 * 4);
  struct Case {
    const char* name;
    int64_t rows;
    Fp8Format format;
    bool columnwise, dbias;  // column-wise: cast_transpose, else row-wise quantize
  };
  const Case cases[] = {
      {"cast_transpose x e4m3 8192x4096", 8192, Fp8Format::kE4M3, true, false},
      {"cast_transpose dy e5m2 8192x4096", 8192, Fp8Format::kE5M2, true, false},
      {"cast_transpose dy e5m2 8192x4096 +dbias", 8192, Fp8Format::kE5M2, true, true},
      {"cast_transpose w e4m3 16384x4096", 16384, Fp8Format::kE4M3, true, false},
      {"quantize x e4m3 8192x4096", 8192, Fp8Format::kE4M3, false, false}};
  for (const Case& c : cases) {
    CastParams p;
    p.input = b.x, p.dtype = DType::kBFloat16, p.rows = c.rows, p.cols = 4096;
    p.format = c.format, p.scale = b.scale, p.rowwise = static_cast<uint8_t*>(b.row);
    p.columnwise = c.columnwise ? static_cast<uint8_t*>(b.col) : nullptr;
    p.amax = b.amax, p.scale_inv = b.scale_inv;
    p.dbias = c.dbias ? reinterpret_cast<float*>(b.out) : nullptr;
    p.dbias_partial = c.dbias ? partial : nullptr;
    const float us =
        time_us([&] { c.columnwise ? cast_transpose_cuda(p, 0) : quantize_cuda(p, 0); });
    const double bytes = c.rows * 4096.0 * (2 + 1 + c.columnwise);
    printf("%s: %.1f us, %.0f GB/s (%s)\n", c.name, us, bytes / us / 1e3,
           cudaGetErrorString(cudaGetLastError()));
  }
  const float us =
      time_us([&] { amax_cuda(b.x, DType::kBFloat16, int64_t{8192} * 4096, b.amax, 0); });
  printf("amax x 8192x4096: %.1f us, %.0f GB/s (%s)\n", us, 8192.0 * 4096 * 2 / us / 1e3,
         cudaGetErrorString(cudaGetLastError()));
  cudaFree(partial);
}

// RMSNorm or LayerNorm of bf16 [8192, hidden] to row-wise FP8, column-wise too, and the bf16
// output too (bench/norm_cast.py's case).
void time_norm_case(const Buffers& b, NormType norm, int64_t hidden, bool columnwise, bool out) {
  const bool ln = norm == NormType::kLayerNorm;
  NormCastParams p;
  p.input = b.x, p.dtype = DType::kBFloat16, p.rows = 8192, p.hidden = hidden;
  p.norm = norm, p.gamma = b.gamma, p.beta = ln ? b.beta : nullptr, p.scale = b.scale;
  p.rowwise = static_cast<uint8_t*>(b.row);
  p.columnwise = columnwise ? static_cast<uint8_t*>(b.col) : nullptr;
  p.amax = b.amax, p.scale_inv = b.scale_inv, p.rstd = static_cast<float*>(b.out);
  p.mean = ln ? static_cast<float*>(b.out) + 8192 : nullptr;
  p.out = out ? b.dy : nullptr;
  const float us = time_us([&] { norm_cast_cuda(p, 0); });
  const double bytes = 8192.0 * hidden * (2 + 1 + columnwise + 2 * out);
  const char* what = out ? "row+col+out" : columnwise ? "row+col" : "row";
  printf("norm %s bf16 8192x%ld %s: %.1f us, %.0f GB/s (%s)\n", ln ? "ln" : "rms",
         static_cast<long>(hidden), what, us, bytes / us / 1e3,
         cudaGetErrorString(cudaGetLastError()));
}

void time_norm(const Buffers& b) {
  for (const NormType norm : {NormType::kRMSNorm, NormType::kLayerNorm}) {
    for (int64_t hidden : {2048, 4096, 8192}) {
      time_norm_case(b, norm, hidden, false, false);
      time_norm_case(b, norm, hidden, true, false);
      time_norm_case(b, norm, hidden, true, true);
    }
  }
}

// RMSNorm or LayerNorm backward of bf16 [8192, hidden]: dx, dgamma (and dbeta). GB/s counts x
// and dy read, dx written.
void time_norm_backward(const Buffers& b) {
  float *stats, *partial;
  cudaMalloc(&stats, 2 * 8192 * 4);
  cudaMalloc(&partial, norm_backward_workspace_floats(8192, 16384) * 4);
  const std::vector<float> ones(2 * 8192, 1.0f);
  cudaMemcpy(stats, ones.data(), ones.size() * 4, cudaMemcpyHostToDevice);
  for (const NormType norm : {NormType::kRMSNorm, NormType::kLayerNorm}) {
    for (int64_t hidden : {2048, 4096, 8192}) {
      const bool ln = norm == NormType::kLayerNorm;
      NormBackwardParams p;
      p.dy = b.dy, p.x = b.x, p.dtype = DType::kBFloat16, p.rows = 8192, p.hidden = hidden;
      p.norm = norm, p.mean = ln ? stats : nullptr, p.rstd = stats + 8192, p.gamma = b.gamma;
      p.dx = b.out, p.partial = partial;
      float* sums = reinterpret_cast<float*>(b.col);
      p.dgamma = sums, p.dbeta = ln ? sums + 16384 : nullptr;
      const float us = time_us([&] { norm_backward_cuda(p, 0); });
      printf("normbwd %s bf16 8192x%ld: %.1f us, %.0f GB/s (%s)\n", ln ? "ln" : "rms",
             static_cast<long>(hidden), us, 8192.0 * hidden * 6 / us / 1e3,
             cudaGetErrorString(cudaGetLastError()));
    }
  }
  cudaFree(stats), cudaFree(partial);
}

// GELU [8192, 16384] and SwiGLU [8192, 2 x 14336] forward (E4M3) and backward (E5M2, also with
// fc1's bias gradient), bf16 in, row-wise and column-wise FP8 out.
void time_activation(const Buffers& b) {
  float* partial;
  cudaMalloc(&partial, dbias_tiles(8192) * 28672 * 4);
  for (int swiglu = 0; swiglu < 2; ++swiglu) {
    for (int pass = 0; pass < 3; ++pass) {
      const bool backward = pass > 0, dbias = pass == 2;
      ActivationCastParams p;
      p.activation = swiglu ? Activation::kSwiGLU : Activation::kGelu;
      p.backward = backward;
      p.input = b.x, p.grad = b.dy, p.dtype = DType::kBFloat16, p.rows = 8192;
      p.n = swiglu ? 14336 : 16384;
      p.format = backward ? Fp8Format::kE5M2 : Fp8Format::kE4M3;
      p.scale = b.scale, p.rowwise = static_cast<uint8_t*>(b.row);
      p.columnwise = static_cast<uint8_t*>(b.col), p.amax = b.amax, p.scale_inv = b.scale_inv;
      p.dbias = dbias ? reinterpret_cast<float*>(b.out) : nullptr;
      p.dbias_partial = dbias ? partial : nullptr;
      const float us = time_us([&] { activation_cast_cuda(p, 0); });
      const double in = 8192.0 * p.in_cols() * 2 + (backward ? 8192.0 * p.n * 2 : 0);
      const double out = 8192.0 * p.out_cols() * 2;
      printf("act %s %s 8192x%ld: %.1f us, %.0f GB/s (%s)\n", swiglu ? "swiglu" : "gelu",
             dbias      ? "bwd+dbias"
             : backward ? "bwd"
                        : "fwd",
             static_cast<long>(p.n), us, (in + out) / us / 1e3,
             cudaGetErrorString(cudaGetLastError()));
    }
  }
  cudaFree(partial);
}

}  // namespace

int main(int argc, char** argv) {
  const char* what = argc > 1 ? argv[1] : "all";
  const bool all = !strcmp(what, "all");
  if (!all && strcmp(what, "copy") && strcmp(what, "cast") && strcmp(what, "norm") &&
      strcmp(what, "normbwd") && strcmp(what, "act")) {
    fprintf(stderr, "usage: %s [all|copy|cast|norm|normbwd|act]  (ONCE=1: one launch per case)\n",
            argv[0]);
    return 2;
  }
  const Buffers b = make_buffers();
  if (all || !strcmp(what, "copy")) time_copy(b);
  if (all || !strcmp(what, "cast")) time_cast(b);
  if (all || !strcmp(what, "norm")) time_norm(b);
  if (all || !strcmp(what, "normbwd")) time_norm_backward(b);
  if (all || !strcmp(what, "act")) time_activation(b);
  return 0;
}
