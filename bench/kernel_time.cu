// Kernel time of the casts, norm_cast, norm_backward and activation_cast at Llama-like shapes,
// without torch: for A/B runs of kernel variants, each binary built from one tree's kernel sources
// (bench/RESULTS.md, 11th session). Run on the GPU machine, from the repository root:
//   K=csrc/kernels; F="-std=c++17 --expt-relaxed-constexpr -O3 -DTPFP8_WITH_CUDA -Icsrc \
//     -gencode=arch=compute_90a,code=sm_90a -Xcompiler -ffp-contract=off"
//   nvcc $F -o /tmp/kernel_time bench/kernel_time.cu $K/norm_cast.cu $K/norm_backward.cu \
//     $K/activation_cast.cu $K/cast.cu $K/cast_transpose.cu $K/norm_cast_cpu.cpp \
//     $K/norm_backward_cpu.cpp $K/activation_cast_cpu.cpp $K/cast_cpu.cpp
//   /tmp/kernel_time [all|copy|probe|cast|norm|normbwd|act]   # ONCE=1: one launch each (ncu)
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
#include "kernels/cast_device.cuh"
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

// A loaded segment's 8 "codes": its elements' high bytes.
__device__ __forceinline__ uint2 probe_codes(uint4 a) {
  return make_uint2(__byte_perm(a.x, a.y, 0x7531), __byte_perm(a.z, a.w, 0x7531));
}

// Stores the column-wise item of columns 4w.. and rows 16b.. of a tile of rows r0.. and column
// vectors v0.. whose row r's word w is word(r, w): 16-byte stores, one a column.
template <typename Word>
__device__ __forceinline__ void store_probe_item(Word&& word, int w, int b, int r0, int v0,
                                                 uint8_t* col, int rows) {
  uint32_t c[4][4];  // [4-row block][column]
  for (int j = 0; j < 4; ++j) {
    const int r = 16 * b + 4 * j;
    const uint32_t q[4] = {word(r, w), word(r + 1, w), word(r + 2, w), word(r + 3, w)};
    device::transpose4x4(q, c[j]);
  }
  for (int k = 0; k < 4; ++k) {
    const size_t column = size_t(v0) * 8 + 4 * w + k;
    *reinterpret_cast<uint4*>(col + column * rows + r0 + 16 * b) =
        make_uint4(c[0][k], c[1][k], c[2][k], c[3][k]);
  }
}

// Bandwidth probe ("free": many blocks an SM, each on its own): norm_cast's traffic at [rows, cols]
// with no arithmetic, the ceiling of each of its forms and of taller column-wise groups. Reads bf16
// once; writes a byte per element row-wise, and optionally the bf16 copy (kOut) and a byte per
// element column-wise (kCol) through a shared tile of kGroup rows (16 KB), stored 16 rows x 4
// columns per thread as norm_cast stores its tiles (16-byte stores; a column's kGroup bytes from
// adjacent threads).
template <bool kOut, bool kCol, int kGroup>
__global__ void __launch_bounds__(256)
    traffic_probe(const uint4* x, uint4* out, uint2* row, uint8_t* col, int rows, int cols) {
  // (+1: a column's two 16-row halves on other banks; 64 and 128 rows keep 2- and 4-way conflicts)
  constexpr int kCols = 16384 / kGroup, kWords = kCols / 4 + 1;
  __shared__ uint32_t tile[kGroup][kWords];
  const int vecs = cols / 8, tiles_c = cols / kCols, tiles = rows / kGroup * tiles_c;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int r0 = t / tiles_c * kGroup, v0 = t % tiles_c * kCols / 8;
    for (int i = threadIdx.x; i < kGroup * kCols / 8; i += blockDim.x) {
      const size_t at = size_t(r0 + i / (kCols / 8)) * vecs + v0 + i % (kCols / 8);
      const uint4 a = x[at];
      if (kOut) out[at] = a;
      const uint2 bytes = probe_codes(a);
      row[at] = bytes;
      if (kCol) {
        uint32_t* dst = &tile[i / (kCols / 8)][i % (kCols / 8) * 2];
        dst[0] = bytes.x, dst[1] = bytes.y;
      }
    }
    if (!kCol) continue;
    __syncthreads();
    store_probe_item([&](int r, int w) { return tile[r][w]; }, threadIdx.x / (kGroup / 16),
                     threadIdx.x % (kGroup / 16), r0, v0, col, rows);
    __syncthreads();
  }
}

// The same traffic in norm_cast's own phases: a block per SM walks groups of kGroup rows of a
// kCols-column slice (its 128 KB tile), loads them and writes row-wise (and out), then after a
// barrier stores the tile column-wise, 16 rows x 4 columns a thread, a column's kGroup bytes
// from adjacent threads; every SM stores at about the same time, as norm_cast's blocks do.
// (norm_cast at hidden 8192: kGroup 32 of 4096 columns, a cluster pair per group.)
// kSpread: XOR by 16-row block times 512 / kGroup words instead, which puts a column's 16-row
// blocks on different banks (27th session: 0.5 us faster with out, 2 without; RESULTS.md).
template <bool kOut, int kGroup, bool kSpread = false>
__global__ void __launch_bounds__(1024, 1)
    phased_probe(const uint4* x, uint4* out, uint2* row, uint8_t* col, int rows, int cols) {
  constexpr int kCols = (128 << 10) / kGroup, kWords = kCols / 4;
  // [kGroup][kWords], words XOR-swizzled by 16-row block; without kSpread within 16-word
  // blocks: the store phase's 16-row blocks of a column share banks (2-way at 32 rows, as in
  // norm_cast's store phase).
  extern __shared__ uint32_t tile[];
  const auto at_word = [](int r, int word) {
    return r * kWords + (word ^ (kSpread ? r / 16 * (512 / kGroup) : r / 16 % 8 * 4));
  };
  const int slices = cols / kCols, walkers = gridDim.x / slices, slice = blockIdx.x % slices;
  const int vecs = cols / 8;
  if (blockIdx.x >= walkers * slices) return;  // (a walker's slices are whole)
  for (int g = blockIdx.x / slices; g < rows / kGroup; g += walkers) {
    const int r0 = g * kGroup, v0 = slice * kCols / 8;
#pragma unroll 4
    for (int i = threadIdx.x; i < kGroup * kCols / 8; i += blockDim.x) {
      const int r = i / (kCols / 8), v = i % (kCols / 8);
      const size_t at = size_t(r0 + r) * vecs + v0 + v;
      const uint4 a = x[at];
      if (kOut) out[at] = a;
      const uint2 bytes = probe_codes(a);
      row[at] = bytes;
      *reinterpret_cast<uint2*>(&tile[at_word(r, 2 * v)]) = bytes;
    }
    __syncthreads();
    for (int item = threadIdx.x; item < kWords * kGroup / 16; item += blockDim.x) {
      store_probe_item([&](int r, int w) { return tile[at_word(r, w)]; }, item / (kGroup / 16),
                       item % (kGroup / 16), r0, v0, col, rows);
    }
    __syncthreads();
  }
}

// A kernel of 1024 threads and `smem` bytes launched in clusters of `size`: how many clusters
// fit the GPU at once (norm_cast's split rows use pairs; 4 would let a block hold 64 rows).
__global__ void __launch_bounds__(1024, 1) cluster_probe() {}
int resident_clusters(int size, int smem) {
  cudaFuncSetAttribute(cluster_probe, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = size, attr.val.clusterDim.y = 1, attr.val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(size), config.blockDim = dim3(1024), config.dynamicSmemBytes = smem;
  config.attrs = &attr, config.numAttrs = 1;
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, cluster_probe, &config) != cudaSuccess) n = -1;
  return n;
}

// Whether col holds row's bytes transposed ([cols][rows] against [rows][cols]), on a sample.
bool transposed(const void* row, const void* col, int rows, int cols) {
  std::vector<uint8_t> r(size_t(rows) * cols), t(r.size());
  cudaMemcpy(r.data(), row, r.size(), cudaMemcpyDeviceToHost);
  cudaMemcpy(t.data(), col, t.size(), cudaMemcpyDeviceToHost);
  size_t bad = 0;
  for (size_t i = 0; i < r.size(); i += 97) bad += r[i] != t[i % cols * rows + i / cols];
  return bad == 0;
}

// The probes beside a device-to-device copy of as many bytes, at norm_cast's 8192 x 8192 forms,
// with column-wise groups of 32 rows (norm_cast's), 64 and 128; and how many clusters of 2 and
// of 4 blocks of 1024 threads fit at once.
void time_probe(const Buffers& b) {
  constexpr int kRows = 8192, kCols = 8192, kPhasedTile = 128 << 10;
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  struct Case {
    const char* name;
    int written;  // bytes an element, beside the 2 read
    void (*kernel)(const uint4*, uint4*, uint2*, uint8_t*, int, int);
    bool phased;  // phased_probe (a block of 1024 per SM), else traffic_probe
  };
  const Case cases[] = {
      {"row", 1, traffic_probe<false, false, 32>, false},
      {"row+col (32-row groups)", 2, traffic_probe<false, true, 32>, false},
      {"row+col (64)", 2, traffic_probe<false, true, 64>, false},
      {"row+col (128)", 2, traffic_probe<false, true, 128>, false},
      {"row+col+out (32)", 4, traffic_probe<true, true, 32>, false},
      {"row+col+out (64)", 4, traffic_probe<true, true, 64>, false},
      {"row+col+out (128)", 4, traffic_probe<true, true, 128>, false},
      {"phased row+col (32 rows x 4096)", 2, phased_probe<false, 32>, true},
      {"phased row+col (64 x 2048)", 2, phased_probe<false, 64>, true},
      {"phased row+col (128 x 1024)", 2, phased_probe<false, 128>, true},
      {"phased row+col+out (32 rows x 4096)", 4, phased_probe<true, 32>, true},
      {"phased row+col+out (64 x 2048)", 4, phased_probe<true, 64>, true},
      {"phased row+col+out (128 x 1024)", 4, phased_probe<true, 128>, true},
      {"phased row+col, no bank conflict (32 rows x 4096)", 2, phased_probe<false, 32, true>, true},
      {"phased row+col+out, no bank conflict (32 rows x 4096)", 4, phased_probe<true, 32, true>,
       true},
      {"phased row+col+out, no bank conflict (64 x 2048)", 4, phased_probe<true, 64, true>, true}};
  const auto* x = static_cast<const uint4*>(b.x);
  auto* out = static_cast<uint4*>(b.dy);
  auto* row = static_cast<uint2*>(b.row);
  auto* col = static_cast<uint8_t*>(b.col);
  for (const Case& c : cases) {
    cudaMemset(row, 0, size_t{kRows} * kCols);  // (so that the check sees this case's bytes)
    const int smem = c.phased ? kPhasedTile : 0;
    if (c.phased) cudaFuncSetAttribute(c.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    const int grid = c.phased ? sms : sms * 8, threads = c.phased ? 1024 : 256;
    const double bytes = double{kRows} * kCols * (2 + c.written);
    const float us =
        time_us([&] { c.kernel<<<grid, threads, smem>>>(x, out, row, col, kRows, kCols); });
    const float copy_us = time_us(
        [&] { cudaMemcpyAsync(b.out, b.x, static_cast<size_t>(bytes / 2), cudaMemcpyDefault); });
    printf(
        "probe 8192x8192 %s: %.1f us, %.0f GB/s; copy of as many bytes %.1f us, %.0f GB/s: "
        "%.0f %% (%s)\n",
        c.name, us, bytes / us / 1e3, copy_us, bytes / copy_us / 1e3, 100.0 * copy_us / us,
        cudaGetErrorString(cudaGetLastError()));
    if (c.written < 2) continue;
    if (!transposed(row, col, kRows, kCols)) printf("probe %s: WRONG column-wise bytes\n", c.name);
    cudaMemset(col, 0, size_t{kRows} * kCols);
  }
  for (int size : {2, 4}) {
    for (int smem : {160 << 10, 224 << 10}) {
      printf("clusters of %d (1024 threads, %d KB): %d resident\n", size, smem >> 10,
             resident_clusters(size, smem));
    }
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
  const struct {
    const char* name;
    void (*run)(const Buffers&);
  } modes[] = {{"copy", time_copy}, {"probe", time_probe},           {"cast", time_cast},
               {"norm", time_norm}, {"normbwd", time_norm_backward}, {"act", time_activation}};
  const char* what = argc > 1 ? argv[1] : "all";
  const bool all = !strcmp(what, "all");
  bool known = all;
  for (const auto& m : modes) known = known || !strcmp(what, m.name);
  if (!known) {
    fprintf(stderr, "usage: %s [all", argv[0]);
    for (const auto& m : modes) fprintf(stderr, "|%s", m.name);
    fprintf(stderr, "]  (ONCE=1: one launch per case)\n");
    return 2;
  }
  const Buffers b = make_buffers();
  for (const auto& m : modes) {
    if (all || !strcmp(what, m.name)) m.run(b);
  }
  return 0;
}
