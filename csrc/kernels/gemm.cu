// gemm.h on cuBLASLt. Row-major D = A . B^T is column-major D^T = B . A^T, so cuBLAS's first
// operand is our B and its second our A; K-major storage makes that the "TN" case that
// Hopper's FP8 kernels require. Descriptors and the heuristic's algorithm are built once per
// (device, shape, types, flags, alignment) and reused: a steady-state call only sets the
// pointer attributes and launches.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <tuple>
#include <vector>

#include "gemm.h"

namespace tpfp8 {
namespace {

cudaDataType_t cuda_type(GemmType t) {
  switch (t) {
    case GemmType::kFloat32:
      return CUDA_R_32F;
    case GemmType::kBFloat16:
      return CUDA_R_16BF;
    case GemmType::kFloat16:
      return CUDA_R_16F;
    case GemmType::kE4M3:
      return CUDA_R_8F_E4M3;
    default:
      return CUDA_R_8F_E5M2;
  }
}

// Largest power of two (<= 256) dividing the address: cuBLASLt picks kernels by alignment.
int alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  int align = 256;
  while (align > 1 && a % align != 0) align /= 2;
  return align;
}

struct PlanKey {
  int device;
  int64_t m, n, k;
  int a_type, b_type, d_type, bias_type;
  bool a_t, b_t, bias, accumulate, residual, fast_accum;
  size_t workspace;
  int align_a, align_b, align_c, align_d;
  auto tie() const {
    return std::tie(device, m, n, k, a_type, b_type, d_type, bias_type, a_t, b_t, bias, accumulate,
                    residual, fast_accum, workspace, align_a, align_b, align_c, align_d);
  }
  bool operator<(const PlanKey& o) const { return tie() < o.tie(); }
};

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~Plan() {
    if (desc) cublasLtMatmulDescDestroy(desc);
    for (auto l : {a, b, d}) {
      if (l) cublasLtMatrixLayoutDestroy(l);
    }
  }
};

struct State {
  std::mutex mutex;
  std::map<int, cublasLtHandle_t> handles;
  std::map<PlanKey, std::unique_ptr<Plan>> plans;
};

State& state() {
  static State* s = new State();  // never destroyed: plans may outlive static teardown order
  return *s;
}

#define TPFP8_LT(expr)                                                               \
  do {                                                                               \
    const cublasStatus_t st_ = (expr);                                               \
    if (st_ != CUBLAS_STATUS_SUCCESS) {                                              \
      std::ostringstream os_;                                                        \
      os_ << "cuBLASLt call " #expr " failed with status " << static_cast<int>(st_); \
      return os_.str();                                                              \
    }                                                                                \
  } while (0)

template <typename T>
cublasStatus_t set(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const T& v) {
  return cublasLtMatmulDescSetAttribute(d, attr, &v, sizeof(v));
}

// TPFP8_GEMM_AUTOTUNE: "0" takes the heuristic's first choice, "search" also sweeps every
// configuration cuBLASLt accepts (see sweep()), anything else times the heuristic's list.
enum class Autotune { kOff, kHeuristic, kSearch };
Autotune autotune_mode() {
  static const Autotune mode = [] {
    const char* env = std::getenv("TPFP8_GEMM_AUTOTUNE");
    if (env && std::strcmp(env, "0") == 0) return Autotune::kOff;
    if (env && std::strcmp(env, "search") == 0) return Autotune::kSearch;
    return Autotune::kHeuristic;
  }();
  return mode;
}

// TPFP8_GEMM_LOG=1: each new plan says on stderr which configuration it runs and why.
bool log_choices() {
  static const bool on = [] {
    const char* env = std::getenv("TPFP8_GEMM_LOG");
    return env && std::strcmp(env, "1") == 0;
  }();
  return on;
}

void set_pointers(const Plan& plan, const GemmParams& p) {
  // cuBLAS's first operand is our B, so the scale pointers swap.
  if (is_fp8(p.a.type)) {
    set(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(p.b.scale_inv));
    set(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(p.a.scale_inv));
  }
  if (p.bias) set(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, p.bias);
}

cublasStatus_t run(cublasLtHandle_t handle, const Plan& plan, const cublasLtMatmulAlgo_t& algo,
                   const GemmParams& p, cudaStream_t stream) {
  // C is D itself when accumulating, else the residual (same type and layout as D), or unread.
  const float alpha = 1.0f, beta = p.accumulate || p.residual ? 1.0f : 0.0f;
  const void* c = p.residual ? p.residual : p.d;
  return cublasLtMatmul(handle, plan.desc, &alpha, p.b.data, plan.a, p.a.data, plan.b, &beta, c,
                        plan.d, p.d, plan.d, &algo, p.workspace, p.workspace_size, stream);
}

// Whether the first call of a shape may time candidates: not when D is accumulated into (a
// trial run would change it), nor while the stream is being captured into a CUDA graph.
bool may_time(const GemmParams& p, cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaStreamIsCapturing(stream, &capture);
  return !p.accumulate && capture == cudaStreamCaptureStatusNone;
}

// The index of the fastest of `candidates` (the heuristic's first choice is sometimes several
// percent off the best of its own list), timed once, a one-time host wait like cuDNN's
// benchmark mode. `us` gets each one's best time a call (-1: it could not launch).
int fastest(cublasLtHandle_t handle, const Plan& plan, const GemmParams& p,
            const std::vector<cublasLtMatmulAlgo_t>& candidates, cudaStream_t stream,
            std::vector<float>& us) {
  const int found = static_cast<int>(candidates.size());
  us.assign(found, 1e30f);
  if (found == 1) return 0;
  set_pointers(plan, p);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  // Candidates are timed in interleaved rounds and each keeps its best round, so a clock
  // ramp or a one-off stall does not decide the choice (few-microsecond GEMMs get the same
  // care as long ones: a run is cheap).
  constexpr int kRounds = 3, kReps = 5;
  for (int i = 0; i < found; ++i) {  // warm-up; a candidate that cannot launch is dropped
    if (run(handle, plan, candidates[i], p, stream) != CUBLAS_STATUS_SUCCESS) us[i] = -1;
  }
  for (int round = 0; round < kRounds; ++round) {
    for (int i = 0; i < found; ++i) {
      if (us[i] < 0) continue;
      cudaEventRecord(start, stream);
      for (int r = 0; r < kReps; ++r) run(handle, plan, candidates[i], p, stream);
      cudaEventRecord(stop, stream);
      float ms = 0.0f;
      if (cudaEventSynchronize(stop) == cudaSuccess &&
          cudaEventElapsedTime(&ms, start, stop) == cudaSuccess) {
        us[i] = std::min(us[i], ms * 1000.0f / kReps);
      }
    }
  }
  int best = 0;
  for (int i = 1; i < found; ++i) {
    if (us[i] >= 0 && (us[best] < 0 || us[i] < us[best])) best = i;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaGetLastError();  // a candidate that failed to launch leaves no sticky error behind
  return best;
}

template <typename T>
T config_value(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  T value{};
  size_t size = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &value, sizeof(value), &size);
  return value;
}

// A configuration in cuBLASLt's enum values (cublasLtMatmulTile_t, ..._Stages_t,
// cublasLtClusterShape_t); bench/gemm_candidates.cu prints it too.
std::string describe(const cublasLtMatmulAlgo_t& algo) {
  std::ostringstream os;
  os << "algo " << config_value<int32_t>(algo, CUBLASLT_ALGO_CONFIG_ID) << " tile "
     << config_value<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_TILE_ID) << " stages "
     << config_value<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID) << " cluster "
     << config_value<uint16_t>(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID) << " swizzle "
     << config_value<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING) << " custom "
     << config_value<uint32_t>(algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION) << " split-k "
     << config_value<int32_t>(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM);
  return os.str();
}

// One stderr line for TPFP8_GEMM_LOG: the plan, the configuration it runs, how it was chosen.
void log_choice(const GemmParams& p, const cublasLtMatmulAlgo_t& algo, const std::string& how) {
  fprintf(stderr, "tpfp8 GEMM M=%lld N=%lld K=%lld %s x %s -> %s%s%s%s: %s; %s\n",
          static_cast<long long>(p.m), static_cast<long long>(p.n), static_cast<long long>(p.k),
          gemm_type_name(p.a.type), gemm_type_name(p.b.type), gemm_type_name(p.d_type),
          p.bias ? " +bias" : "", p.accumulate ? " accumulate" : "", p.residual ? " +residual" : "",
          describe(algo).c_str(), how.c_str());
}

// "timed: candidate 2 of 8 (...), us a call: 901.2 *873.4 ...": the chosen one starred; -1.0
// could not launch.
std::string timing_summary(int chosen, const std::vector<float>& us, int heuristic_count) {
  if (us.size() == 1) return "the only candidate (not timed)";
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(1);
  os << "timed: candidate " << chosen + 1 << " of " << us.size() << " (the first "
     << heuristic_count << " the heuristic's), us a call:";
  for (size_t i = 0; i < us.size(); ++i)
    os << (static_cast<int>(i) == chosen ? " *" : " ") << us[i];
  return os.str();
}

// cuBLASLt's candidates for a plan's descriptors (at most `max`, its estimate's fastest first)
// under the key's workspace and alignments. bench/gemm_candidates.cu asks for every one.
cublasStatus_t heuristic_candidates(cublasLtHandle_t handle, const Plan& plan, const PlanKey& key,
                                    const GemmParams& p, int max,
                                    cublasLtMatmulHeuristicResult_t* results, int* found) {
  cublasLtMatmulPreference_t pref;
  cublasStatus_t st = cublasLtMatmulPreferenceCreate(&pref);
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  const uint64_t ws = p.workspace_size;
  const uint32_t aa = key.align_b, ab = key.align_a, ac = key.align_c, ad = key.align_d;
  // (cuBLAS's A is our B)
  const auto set_pref = [&](cublasLtMatmulPreferenceAttributes_t attr, const auto& value) {
    cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value));
  };
  set_pref(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, ws);
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, aa);
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, ab);
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, ac);
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, ad);
  st = cublasLtMatmulAlgoGetHeuristic(handle, plan.desc, plan.a, plan.b, plan.d, plan.d, pref, max,
                                      results, found);
  cublasLtMatmulPreferenceDestroy(pref);
  return st;
}

// The values of one capability of `algo` (its tile or stage ids), or {0} when it lists none.
std::vector<uint32_t> capability_ids(const cublasLtMatmulAlgo_t& algo,
                                     cublasLtMatmulAlgoCapAttributes_t cap) {
  size_t bytes = 0;
  cublasLtMatmulAlgoCapGetAttribute(&algo, cap, nullptr, 0, &bytes);
  std::vector<uint32_t> ids(bytes / sizeof(uint32_t));
  if (!ids.empty()) cublasLtMatmulAlgoCapGetAttribute(&algo, cap, ids.data(), bytes, &bytes);
  if (ids.empty()) ids.push_back(0);
  return ids;
}

template <typename T>
void set_config(cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr, T value) {
  cublasLtMatmulAlgoConfigSetAttribute(&algo, attr, &value, sizeof(value));
}

// Appends to `out` each CTA swizzle x custom option x cluster shape (of at most 4 blocks) of
// `base` that cuBLASLt accepts for the plan within the workspace.
void add_accepted_variants(cublasLtHandle_t handle, const Plan& plan, const GemmParams& p,
                           const cublasLtMatmulAlgo_t& base, uint32_t swizzles, uint32_t customs,
                           std::vector<cublasLtMatmulAlgo_t>& out) {
  constexpr uint16_t kClusters[] = {CUBLASLT_CLUSTER_SHAPE_AUTO,  CUBLASLT_CLUSTER_SHAPE_1x1x1,
                                    CUBLASLT_CLUSTER_SHAPE_2x1x1, CUBLASLT_CLUSTER_SHAPE_1x2x1,
                                    CUBLASLT_CLUSTER_SHAPE_2x2x1, CUBLASLT_CLUSTER_SHAPE_4x1x1,
                                    CUBLASLT_CLUSTER_SHAPE_1x4x1};
  for (uint32_t swizzle = 0; swizzle <= swizzles; ++swizzle) {
    for (uint32_t custom = 0; custom <= customs; ++custom) {
      for (uint16_t cluster : kClusters) {
        cublasLtMatmulAlgo_t a = base;
        set_config(a, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, swizzle);
        set_config(a, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, custom);
        set_config(a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, cluster);
        cublasLtMatmulHeuristicResult_t r{};
        if (cublasLtMatmulAlgoCheck(handle, plan.desc, plan.a, plan.b, plan.d, plan.d, &a, &r) ==
                CUBLAS_STATUS_SUCCESS &&
            r.workspaceSize <= p.workspace_size) {
          out.push_back(a);
        }
      }
    }
  }
}

// Every configuration cuBLASLt accepts for the plan: each algorithm id for its types x its
// tiles x stage counts x the variants above (split-K stays 1: these GEMMs have long K and many
// output tiles).
std::vector<cublasLtMatmulAlgo_t> every_config(cublasLtHandle_t handle, const Plan& plan,
                                               const GemmParams& p) {
  const cudaDataType_t ta = cuda_type(p.b.type), tb = cuda_type(p.a.type);  // cuBLAS A: our B
  const cudaDataType_t td = cuda_type(p.d_type);
  int ids[256];
  int n_ids = 0;
  cublasLtMatmulAlgoGetIds(handle, CUBLAS_COMPUTE_32F, CUDA_R_32F, ta, tb, td, td, 256, ids,
                           &n_ids);
  std::vector<cublasLtMatmulAlgo_t> out;
  for (int i = 0; i < n_ids; ++i) {
    cublasLtMatmulAlgo_t algo;
    if (cublasLtMatmulAlgoInit(handle, CUBLAS_COMPUTE_32F, CUDA_R_32F, ta, tb, td, td, ids[i],
                               &algo) != CUBLAS_STATUS_SUCCESS) {
      continue;
    }
    uint32_t swizzles = 0;
    int32_t customs = 0;
    size_t size = 0;
    cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_CTA_SWIZZLING_SUPPORT, &swizzles,
                                      sizeof(swizzles), &size);
    cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX, &customs,
                                      sizeof(customs), &size);
    for (uint32_t tile : capability_ids(algo, CUBLASLT_ALGO_CAP_TILE_IDS)) {
      for (uint32_t stages : capability_ids(algo, CUBLASLT_ALGO_CAP_STAGES_IDS)) {
        cublasLtMatmulAlgo_t base = algo;
        set_config(base, CUBLASLT_ALGO_CONFIG_TILE_ID, tile);
        set_config(base, CUBLASLT_ALGO_CONFIG_STAGES_ID, stages);
        add_accepted_variants(handle, plan, p, base, swizzles,
                              static_cast<uint32_t>(std::max(customs, 0)), out);
      }
    }
  }
  return out;
}

// TPFP8_GEMM_AUTOTUNE=search: the `keep` fastest of every_config(), each timed once (two
// calls after a warm-up), for fastest() to time again beside the heuristic's list. The
// heuristic's eight miss tiles such as 128x168 that ran 2-5 % faster sustained on three of the
// H200's MLP GEMMs (bench/RESULTS.md, thirty-seventh session). 35-60 s a large shape, once;
// says so on stderr.
std::vector<cublasLtMatmulAlgo_t> sweep(cublasLtHandle_t handle, const Plan& plan,
                                        const GemmParams& p, size_t keep, cudaStream_t stream) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<cublasLtMatmulAlgo_t> configs = every_config(handle, plan, p);
  fprintf(stderr,
          "tpfp8: TPFP8_GEMM_AUTOTUNE=search: timing %zu cuBLASLt configurations for the "
          "GEMM M=%lld N=%lld K=%lld (once per shape)\n",
          configs.size(), static_cast<long long>(p.m), static_cast<long long>(p.n),
          static_cast<long long>(p.k));
  set_pointers(plan, p);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<std::pair<float, size_t>> timed;
  for (size_t i = 0; i < configs.size(); ++i) {
    if (run(handle, plan, configs[i], p, stream) != CUBLAS_STATUS_SUCCESS) continue;
    cudaEventRecord(start, stream);
    bool ok = run(handle, plan, configs[i], p, stream) == CUBLAS_STATUS_SUCCESS &&
              run(handle, plan, configs[i], p, stream) == CUBLAS_STATUS_SUCCESS;
    cudaEventRecord(stop, stream);
    float ms = 0.0f;
    ok = ok && cudaEventSynchronize(stop) == cudaSuccess &&
         cudaEventElapsedTime(&ms, start, stop) == cudaSuccess;
    if (ok) timed.emplace_back(ms, i);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaGetLastError();  // a configuration that failed to launch leaves no sticky error behind
  std::sort(timed.begin(), timed.end());
  std::vector<cublasLtMatmulAlgo_t> fastest_few;
  for (size_t i = 0; i < std::min(keep, timed.size()); ++i) {
    fastest_few.push_back(configs[timed[i].second]);
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  fprintf(stderr, "tpfp8: %zu of them ran, in %.1f s\n", timed.size(), s);
  return fastest_few;
}

// Descriptors and algorithm for one key; column-major view described in the file comment.
std::string build_plan(const GemmParams& p, const PlanKey& key, cublasLtHandle_t handle, Plan& plan,
                       cudaStream_t stream) {
  TPFP8_LT(cublasLtMatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_first = p.b.transposed ? CUBLAS_OP_N : CUBLAS_OP_T;
  const cublasOperation_t op_second = p.a.transposed ? CUBLAS_OP_T : CUBLAS_OP_N;
  TPFP8_LT(set(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, op_first));
  TPFP8_LT(set(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, op_second));
  if (is_fp8(p.a.type)) {
    TPFP8_LT(set(plan.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, int8_t{p.fast_accum}));
  }
  if (p.bias) {
    TPFP8_LT(set(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BIAS));
    TPFP8_LT(set(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                 static_cast<int32_t>(cuda_type(p.bias_type))));
  }
  // First operand: our B, column-major K x N (ld K) or, transposed storage, N x K (ld N).
  TPFP8_LT(cublasLtMatrixLayoutCreate(&plan.a, cuda_type(p.b.type), p.b.transposed ? p.n : p.k,
                                      p.b.transposed ? p.k : p.n, p.b.transposed ? p.n : p.k));
  TPFP8_LT(cublasLtMatrixLayoutCreate(&plan.b, cuda_type(p.a.type), p.a.transposed ? p.m : p.k,
                                      p.a.transposed ? p.k : p.m, p.a.transposed ? p.m : p.k));
  TPFP8_LT(cublasLtMatrixLayoutCreate(&plan.d, cuda_type(p.d_type), p.n, p.m, p.n));

  constexpr int kCandidates = 8;
  cublasLtMatmulHeuristicResult_t results[kCandidates] = {};
  int found = 0;
  const cublasStatus_t st =
      heuristic_candidates(handle, plan, key, p, kCandidates, results, &found);
  if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
    std::ostringstream os;
    os << "cuBLASLt has no kernel for D[" << p.m << ", " << p.n << "] = A . B^T with K=" << p.k
       << ", A " << gemm_type_name(p.a.type) << (p.a.transposed ? " (transposed)" : "") << ", B "
       << gemm_type_name(p.b.type) << (p.b.transposed ? " (transposed)" : "") << ", D "
       << gemm_type_name(p.d_type) << (p.bias ? ", bias " : "")
       << (p.bias ? gemm_type_name(p.bias_type) : "") << " (status " << static_cast<int>(st) << ")";
    return os.str();
  }
  std::vector<cublasLtMatmulAlgo_t> candidates;
  for (int i = 0; i < found; ++i) candidates.push_back(results[i].algo);
  const Autotune mode = autotune_mode();
  if (mode == Autotune::kOff || !may_time(p, stream)) {
    plan.algo = candidates[0];
    if (log_choices()) {
      log_choice(p, plan.algo,
                 mode == Autotune::kOff ? "the heuristic's first (TPFP8_GEMM_AUTOTUNE=0)"
                 : p.accumulate         ? "the heuristic's first (not timed: D accumulates)"
                                        : "the heuristic's first (not timed: graph capture)");
    }
    return {};
  }
  if (mode == Autotune::kSearch) {
    const std::vector<cublasLtMatmulAlgo_t> swept = sweep(handle, plan, p, kCandidates, stream);
    candidates.insert(candidates.end(), swept.begin(), swept.end());
  }
  std::vector<float> us;
  const int chosen = fastest(handle, plan, p, candidates, stream, us);
  plan.algo = candidates[chosen];
  if (log_choices()) log_choice(p, plan.algo, timing_summary(chosen, us, found));
  return {};
}

}  // namespace

std::string gemm_cuda(const GemmParams& p, cudaStream_t stream) {
  std::string err = gemm_check(p);
  if (!err.empty()) return err;
  if (p.m == 0 || p.n == 0) return {};
  PlanKey key{};
  cudaGetDevice(&key.device);
  key.m = p.m, key.n = p.n, key.k = p.k;
  key.a_type = static_cast<int>(p.a.type), key.b_type = static_cast<int>(p.b.type);
  key.d_type = static_cast<int>(p.d_type), key.bias_type = static_cast<int>(p.bias_type);
  key.a_t = p.a.transposed, key.b_t = p.b.transposed, key.bias = p.bias != nullptr;
  key.accumulate = p.accumulate, key.residual = p.residual != nullptr;
  key.fast_accum = p.fast_accum;
  key.workspace = p.workspace_size;
  key.align_a = alignment(p.a.data), key.align_b = alignment(p.b.data);
  key.align_d = alignment(p.d);
  key.align_c = p.residual ? alignment(p.residual) : key.align_d;

  State& s = state();
  const std::lock_guard<std::mutex> lock(s.mutex);
  cublasLtHandle_t& handle = s.handles[key.device];
  if (!handle) TPFP8_LT(cublasLtCreate(&handle));
  std::unique_ptr<Plan>& plan = s.plans[key];
  if (!plan) {
    auto fresh = std::make_unique<Plan>();
    err = build_plan(p, key, handle, *fresh, stream);
    if (!err.empty()) {
      s.plans.erase(key);
      return err;
    }
    plan = std::move(fresh);
  }
  // Pointer attributes change per call; the descriptor is shared, hence under the lock.
  set_pointers(*plan, p);
  TPFP8_LT(run(handle, *plan, plan->algo, p, stream));
  return {};
}

}  // namespace tpfp8
