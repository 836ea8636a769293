// Every cuBLASLt candidate for the FP8 GEMMs of an MLP step (fc1 -> act -> fc2, FFN 4x hidden),
// timed in bursts (what gemm.cu's autotune sees) and sustained (~0.6 s of back-to-back calls, the
// card at its power cap), with the joules a call from the GPU's energy counter. It includes
// gemm.cu, so descriptors, preferences and pointers are the extension's own plan's (a standalone
// cuBLASLt harness got NOT_SUPPORTED from every call: bench/RESULTS.md, 17th-19th sessions).
// Run on the GPU machine, from the repository root (N: the cuBLASLt that torch uses):
//   N=$(python3 -c "import nvidia.cu13, os; print(list(nvidia.cu13.__path__)[0])")
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -DTPFP8_WITH_CUDA -I$N/include \
//     -Icsrc -Icsrc/kernels -o /tmp/gemm_candidates bench/gemm_candidates.cu \
//     csrc/kernels/gemm_common.cpp -L$N/lib -l:libcublasLt.so.13 -ldl
//   LD_LIBRARY_PATH=$N/lib /tmp/gemm_candidates [--search] [hidden [tokens]]  # 4096 8192
// --search goes past the heuristic's list: every configuration gemm.cu's every_config() finds
// (what TPFP8_GEMM_AUTOTUNE=search sweeps), each timed in a burst; the fastest few are then
// timed sustained beside the heuristic's own first three.
// J/call comes from a counter read over ~0.4 s; its update granularity makes single readings
// coarse (tens of %), so rank by time.
#include <cuda_fp8.h>
#include <dlfcn.h>
#include <unistd.h>

#include <random>

#include "../csrc/kernels/gemm.cu"

namespace tpfp8 {
namespace {

// Millijoules from NVML's total energy counter (0 when NVML is missing).
struct EnergyCounter {
  using GetEnergy = int (*)(void*, unsigned long long*);
  GetEnergy get = nullptr;
  void* device = nullptr;
  EnergyCounter() {
    void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!lib) return;
    auto init = reinterpret_cast<int (*)()>(dlsym(lib, "nvmlInit_v2"));
    auto handle =
        reinterpret_cast<int (*)(unsigned, void**)>(dlsym(lib, "nvmlDeviceGetHandleByIndex_v2"));
    auto energy = reinterpret_cast<GetEnergy>(dlsym(lib, "nvmlDeviceGetTotalEnergyConsumption"));
    if (init && handle && energy && init() == 0 && handle(0, &device) == 0) get = energy;
  }
  unsigned long long mj() const {
    unsigned long long e = 0;
    if (get) get(device, &e);
    return e;
  }
};

// Milliseconds a call over `calls` back-to-back calls of f.
template <typename F>
float per_call_ms(F f, int calls, cudaStream_t st) {
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaEventRecord(e0, st);
  for (int q = 0; q < calls; ++q) f();
  cudaEventRecord(e1, st);
  cudaEventSynchronize(e1);
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return ms / calls;
}

// build_plan's heuristic query, asking for every candidate.
int all_candidates(cublasLtHandle_t handle, const Plan& plan, const PlanKey& key,
                   const GemmParams& p, cublasLtMatmulHeuristicResult_t (&res)[32]) {
  int found = 0;
  heuristic_candidates(handle, plan, key, p, 32, res, &found);
  return found;
}

// gemm.cu's plan for `p` on a new handle, as the extension builds it; false (said) if none.
bool open_plan(const char* name, const GemmParams& p, cudaStream_t st, cublasLtHandle_t& handle,
               Plan& plan, PlanKey& key) {
  key = PlanKey{};
  key.align_a = alignment(p.a.data), key.align_b = alignment(p.b.data),
  key.align_c = key.align_d = alignment(p.d);
  cublasLtCreate(&handle);
  const std::string err = build_plan(p, key, handle, plan, st);
  if (!err.empty()) printf("%s: no plan: %s\n", name, err.c_str());
  return err.empty();
}

void survey(const char* name, const GemmParams& p, const EnergyCounter& energy, cudaStream_t st) {
  PlanKey key;
  cublasLtHandle_t handle;
  Plan plan;
  if (!open_plan(name, p, st, handle, plan, key)) return;
  cublasLtMatmulHeuristicResult_t res[32] = {};
  const int found = all_candidates(handle, plan, key, p, res);
  set_pointers(plan, p);
  const double flop = 2.0 * p.m * p.n * p.k;
  printf("== %s m=%lld n=%lld k=%lld: %d candidates\n", name, static_cast<long long>(p.m),
         static_cast<long long>(p.n), static_cast<long long>(p.k), found);
  for (int i = 0; i < found; ++i) {
    auto call = [&] { run(handle, plan, res[i].algo, p, st); };
    if (run(handle, plan, res[i].algo, p, st) != CUBLAS_STATUS_SUCCESS) {
      printf("  cand %d: cannot run\n", i);
      continue;
    }
    cudaStreamSynchronize(st);
    float burst = 1e9f;
    for (int r = 0; r < 3; ++r) {
      usleep(30000);  // the clocks recover a little between bursts
      burst = std::min(burst, per_call_ms(call, 5, st));
    }
    // Sustained: ~0.6 s of calls, timed over the last two thirds.
    const int n = std::max(30, static_cast<int>(600.0f / burst));
    for (int q = 0; q < n / 3; ++q) call();
    cudaStreamSynchronize(st);
    const unsigned long long mj0 = energy.mj();
    const float sustained = per_call_ms(call, 2 * n / 3, st);
    const double joules = (energy.mj() - mj0) / 1000.0 / (2 * n / 3);
    const uint32_t tile = config_value<uint32_t>(res[i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID);
    printf(
        "  cand %d tile %3u: burst %6.1f us (%4.0f TFLOPS)  sustained %6.1f us (%4.0f TFLOPS)"
        "  %.4f J/call\n",
        i, tile, burst * 1e3, flop / burst / 1e9, sustained * 1e3, flop / sustained / 1e9, joules);
    usleep(300000);  // and cool down between candidates
  }
  cublasLtDestroy(handle);
}

// Burst time of every configuration, then the fastest `keep` and the heuristic's first three
// timed sustained, one after another with a pause between.
void search(const char* name, const GemmParams& p, cudaStream_t st) {
  PlanKey key;
  cublasLtHandle_t handle;
  Plan plan;
  if (!open_plan(name, p, st, handle, plan, key)) return;
  set_pointers(plan, p);
  const double flop = 2.0 * p.m * p.n * p.k;
  printf("== %s m=%lld n=%lld k=%lld\n", name, static_cast<long long>(p.m),
         static_cast<long long>(p.n), static_cast<long long>(p.k));
  const std::vector<cublasLtMatmulAlgo_t> configs = every_config(handle, plan, p);
  std::vector<std::pair<float, int>> burst;
  for (size_t i = 0; i < configs.size(); ++i) {
    auto call = [&] { run(handle, plan, configs[i], p, st); };
    if (run(handle, plan, configs[i], p, st) != CUBLAS_STATUS_SUCCESS ||
        cudaStreamSynchronize(st) != cudaSuccess) {
      cudaGetLastError();
      continue;
    }
    burst.emplace_back(per_call_ms(call, 3, st), static_cast<int>(i));
  }
  std::sort(burst.begin(), burst.end());
  printf("  %zu configurations ran; fastest bursts:\n", burst.size());
  cublasLtMatmulHeuristicResult_t res[32] = {};
  const int found = all_candidates(handle, plan, key, p, res);
  std::vector<std::pair<std::string, cublasLtMatmulAlgo_t>> finals;
  for (int i = 0; i < std::min(found, 3); ++i) {
    finals.emplace_back("heuristic #" + std::to_string(i), res[i].algo);
  }
  constexpr size_t kKeep = 6;
  for (size_t i = 0; i < std::min(kKeep, burst.size()); ++i) {
    finals.emplace_back("search #" + std::to_string(i), configs[burst[i].second]);
  }
  for (const auto& final : finals) {
    const cublasLtMatmulAlgo_t& algo = final.second;
    auto call = [&] { run(handle, plan, algo, p, st); };
    usleep(300000);
    const float b = per_call_ms(call, 5, st);
    const int n = std::max(30, static_cast<int>(500.0f / b));
    for (int q = 0; q < n / 3; ++q) call();
    const float sustained = per_call_ms(call, 2 * n / 3, st);
    printf("  %-13s %s: burst %6.1f us (%4.0f TFLOPS)  sustained %6.1f us (%4.0f TFLOPS)\n",
           final.first.c_str(), describe(algo).c_str(), b * 1e3, flop / b / 1e9, sustained * 1e3,
           flop / sustained / 1e9);
  }
  cublasLtDestroy(handle);
}

// Normal(0, 8) values as E4M3 or E5M2 codes.
void* random_codes(size_t n, bool e5m2, std::mt19937& g) {
  std::normal_distribution<float> normal(0.0f, 8.0f);
  std::vector<uint8_t> h(n);
  for (auto& b : h) {
    const float v = normal(g);
    b = e5m2 ? __nv_fp8_e5m2(v).__x : __nv_fp8_e4m3(v).__x;
  }
  void* d = nullptr;
  cudaMalloc(&d, n);
  cudaMemcpy(d, h.data(), n, cudaMemcpyHostToDevice);
  return d;
}

}  // namespace
}  // namespace tpfp8

int main(int argc, char** argv) {
  using namespace tpfp8;
  const bool exhaustive = argc > 1 && std::strcmp(argv[1], "--search") == 0;
  const int first = exhaustive ? 2 : 1;
  const int64_t hidden = argc > first ? std::atoll(argv[first]) : 4096;
  const int64_t tokens = argc > first + 1 ? std::atoll(argv[first + 1]) : 8192;
  if (argc > first + 2 || hidden <= 0 || tokens <= 0 || hidden % 16 || tokens % 16) {
    fprintf(stderr,
            "usage: %s [--search] [hidden [tokens]]  (multiples of 16; default 4096 8192)\n"
            "  times cuBLASLt's FP8 GEMM candidates for an MLP step (see the file's header)\n",
            argv[0]);
    return 2;
  }
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0) {
    fprintf(stderr, "%s: no CUDA GPU visible\n", argv[0]);
    return 1;
  }
  setenv("TPFP8_GEMM_AUTOTUNE", "0", 1);  // build_plan's own choice is not needed here
  const int64_t ffn = 4 * hidden;
  const size_t most = static_cast<size_t>(std::max(tokens, hidden) * ffn);
  std::mt19937 g(1);
  void* const e4 = random_codes(most, false, g);
  void* const e5 = random_codes(most, true, g);
  void *d = nullptr, *bias = nullptr, *ws = nullptr;
  float* scales = nullptr;
  cudaMalloc(&d, most * 2);
  cudaMalloc(&bias, ffn * 2);
  cudaMemset(bias, 0, ffn * 2);
  cudaMalloc(&ws, kGemmWorkspaceBytes);
  cudaMalloc(&scales, 256 * 2);  // two scale_inv, each on its own 256 bytes
  const float inv = 1.0f / 64;
  cudaMemcpy(scales, &inv, 4, cudaMemcpyHostToDevice);
  cudaMemcpy(scales + 64, &inv, 4, cudaMemcpyHostToDevice);
  cudaStream_t st;
  cudaStreamCreate(&st);
  const EnergyCounter energy;
  struct Shape {
    const char* name;
    int64_t m, n, k;
    bool grad, bias;
  };
  const Shape shapes[] = {{"fc1 fprop", tokens, ffn, hidden, false, true},
                          {"fc2 fprop", tokens, hidden, ffn, false, true},
                          {"fc2 dgrad", tokens, ffn, hidden, true, false},
                          {"fc2 wgrad", hidden, ffn, tokens, true, false},
                          {"fc1 dgrad", tokens, hidden, ffn, true, false},
                          {"fc1 wgrad", ffn, hidden, tokens, true, false}};
  for (const Shape& s : shapes) {
    GemmParams p;  // as linear.cpp asks: gradients in E5M2, fast accumulation in fprop only
    p.m = s.m, p.n = s.n, p.k = s.k;
    p.a = {s.grad ? e5 : e4, s.grad ? GemmType::kE5M2 : GemmType::kE4M3, scales, false};
    p.b = {e4, GemmType::kE4M3, scales + 64, false};
    p.d = d, p.d_type = GemmType::kBFloat16;
    p.bias = s.bias ? bias : nullptr;
    p.fast_accum = !s.grad;
    p.workspace = ws, p.workspace_size = kGemmWorkspaceBytes;
    if (exhaustive) {
      search(s.name, p, st);
    } else {
      survey(s.name, p, energy, st);
    }
  }
  return 0;
}
