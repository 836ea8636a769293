// gemm.h on cuBLASLt. Row-major D = A . B^T is column-major D^T = B . A^T, so cuBLAS's first
// operand is our B and its second our A; K-major storage makes that the "TN" case that
// Hopper's FP8 kernels require. Descriptors and the heuristic's algorithm are built once per
// (device, shape, types, flags, alignment) and reused: a steady-state call only sets the
// pointer attributes and launches.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
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
  bool a_t, b_t, bias, accumulate, fast_accum;
  size_t workspace;
  int align_a, align_b, align_d;
  auto tie() const {
    return std::tie(device, m, n, k, a_type, b_type, d_type, bias_type, a_t, b_t, bias, accumulate,
                    fast_accum, workspace, align_a, align_b, align_d);
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

bool autotune_enabled() {
  static const bool on = [] {
    const char* env = std::getenv("TPFP8_GEMM_AUTOTUNE");
    return !(env && std::strcmp(env, "0") == 0);
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
  const float alpha = 1.0f, beta = p.accumulate ? 1.0f : 0.0f;
  return cublasLtMatmul(handle, plan.desc, &alpha, p.b.data, plan.a, p.a.data, plan.b, &beta, p.d,
                        plan.d, p.d, plan.d, &algo, p.workspace, p.workspace_size, stream);
}

// The heuristic's first choice is sometimes several percent off the best of its own list, so
// the first call of a shape times the candidates once (a one-time host wait, like cuDNN's
// benchmark mode; TPFP8_GEMM_AUTOTUNE=0 turns it off). Skipped when D is accumulated into
// (a trial run would change it) and while the stream is being captured into a CUDA graph.
cublasLtMatmulAlgo_t fastest(cublasLtHandle_t handle, const Plan& plan, const GemmParams& p,
                             const cublasLtMatmulHeuristicResult_t* results, int found,
                             cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaStreamIsCapturing(stream, &capture);
  if (found == 1 || p.accumulate || capture != cudaStreamCaptureStatusNone || !autotune_enabled()) {
    return results[0].algo;
  }
  set_pointers(plan, p);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  // Candidates are timed in interleaved rounds and each keeps its best round, so a clock
  // ramp or a one-off stall does not decide the choice (few-microsecond GEMMs get the same
  // care as long ones: a run is cheap).
  constexpr int kRounds = 3, kReps = 5;
  std::vector<float> best_ms(found, 1e30f);
  for (int i = 0; i < found; ++i) {  // warm-up; a candidate that cannot launch is dropped
    if (run(handle, plan, results[i].algo, p, stream) != CUBLAS_STATUS_SUCCESS) best_ms[i] = -1;
  }
  for (int round = 0; round < kRounds; ++round) {
    for (int i = 0; i < found; ++i) {
      if (best_ms[i] < 0) continue;
      cudaEventRecord(start, stream);
      for (int r = 0; r < kReps; ++r) run(handle, plan, results[i].algo, p, stream);
      cudaEventRecord(stop, stream);
      float ms = 0.0f;
      if (cudaEventSynchronize(stop) == cudaSuccess &&
          cudaEventElapsedTime(&ms, start, stop) == cudaSuccess) {
        best_ms[i] = std::min(best_ms[i], ms);
      }
    }
  }
  int best = 0;
  for (int i = 1; i < found; ++i) {
    if (best_ms[i] >= 0 && (best_ms[best] < 0 || best_ms[i] < best_ms[best])) best = i;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaGetLastError();  // a candidate that failed to launch leaves no sticky error behind
  return results[best].algo;
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
  const uint32_t aa = key.align_b, ab = key.align_a, ad = key.align_d;  // cuBLAS A is our B
  const auto set_pref = [&](cublasLtMatmulPreferenceAttributes_t attr, const auto& value) {
    cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value));
  };
  set_pref(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, ws);
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, aa);
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, ab);
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, ad);
  set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, ad);
  st = cublasLtMatmulAlgoGetHeuristic(handle, plan.desc, plan.a, plan.b, plan.d, plan.d, pref, max,
                                      results, found);
  cublasLtMatmulPreferenceDestroy(pref);
  return st;
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
  plan.algo = fastest(handle, plan, p, results, found, stream);
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
  key.accumulate = p.accumulate, key.fast_accum = p.fast_accum;
  key.workspace = p.workspace_size;
  key.align_a = alignment(p.a.data), key.align_b = alignment(p.b.data);
  key.align_d = alignment(p.d);

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
