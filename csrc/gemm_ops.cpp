// torch op over kernels/gemm.h: shape and dtype checks, the per-stream cuBLASLt workspace,
// and dispatch to cuBLASLt or the CPU reference.
#include <torch/library.h>

#include <map>
#include <mutex>
#include <vector>

#include "checks.h"
#include "device_dispatch.h"
#include "kernels/gemm.h"
#include "ops.h"

namespace tpfp8 {
namespace {

GemmType gemm_type_from(int64_t code) {
  return code_as<GemmType>(code, "GEMM operand type",
                           "0..4 (float32, bfloat16, float16, e4m3, e5m2)");
}

GemmType storage_type(const at::Tensor& t, const char* name) {
  switch (high_precision_dtype(t, name)) {
    case DType::kBFloat16:
      return GemmType::kBFloat16;
    case DType::kFloat16:
      return GemmType::kFloat16;
    default:
      return GemmType::kFloat32;
  }
}

// One operand: its declared type must agree with its storage; returns (rows, K).
GemmOperand operand(const at::Tensor& t, GemmType type, const OptTensor& scale_inv, bool transposed,
                    const char* name, const at::Tensor& out) {
  check_2d(t, name);
  check_contiguous(t, name);
  check_same_device(t, out, name, "out");
  GemmOperand op;
  op.type = type;
  op.transposed = transposed;
  op.data = t.data_ptr();
  if (is_fp8(type)) {
    TORCH_CHECK_TYPE(t.element_size() == 1, name, " is declared ", gemm_type_name(type),
                     " but holds ", t.scalar_type(), "; pass FP8 codes as uint8 or float8");
    TORCH_CHECK_VALUE(scale_inv.has_value(), name, " is FP8 and needs its scale_inv");
    check_scalar_f32(*scale_inv, "scale_inv", t, name);
    op.scale_inv = scale_inv->data_ptr<float>();
  } else {
    TORCH_CHECK_TYPE(storage_type(t, name) == type, name, " is declared ", gemm_type_name(type),
                     " but holds ", t.scalar_type());
  }
  return op;
}

// Per (device, stream) workspace, allocated on first use (warm-up) and kept: later calls,
// including those under CUDA-graph capture, allocate nothing. Straight from the driver when it
// can be, not from the caching allocator: a first use inside torch.compile's CUDA-graph
// warm-up would otherwise leave a block of the graphs' private pool alive that no graph output
// owns. A first use inside a capture (where cudaMalloc is not allowed) takes it from the
// capture's pool, kept as long as the process.
void* workspace_for(const at::Tensor& like) {
#if defined(TPFP8_WITH_CUDA)
  static std::mutex mutex;
  static std::map<std::pair<int, int64_t>, void*> buffers;  // freed at process exit
  static std::vector<at::Tensor> captured;
  const auto stream = c10::cuda::getCurrentCUDAStream(like.device().index());
  const std::lock_guard<std::mutex> lock(mutex);
  void*& buf = buffers[{like.device().index(), stream.id()}];
  if (buf != nullptr) return buf;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  if (status == cudaStreamCaptureStatusNone) {
    const c10::cuda::CUDAGuard guard(like.device());
    C10_CUDA_CHECK(cudaMalloc(&buf, kGemmWorkspaceBytes));
  } else {
    captured.push_back(
        at::empty({static_cast<int64_t>(kGemmWorkspaceBytes)}, like.options().dtype(at::kByte)));
    buf = captured.back().data_ptr();
  }
  return buf;
#else
  (void)like;
  return nullptr;
#endif
}

}  // namespace

void gemm(const at::Tensor& a, const at::Tensor& b, at::Tensor& out, const OptTensor& a_scale_inv,
          const OptTensor& b_scale_inv, int64_t a_type, int64_t b_type, const OptTensor& bias,
          bool accumulate, bool fast_accum, bool a_transposed, bool b_transposed,
          const OptTensor& residual) {
  GemmParams p;
  p.a = operand(a, gemm_type_from(a_type), a_scale_inv, a_transposed, "A", out);
  p.b = operand(b, gemm_type_from(b_type), b_scale_inv, b_transposed, "B", out);
  p.m = a_transposed ? a.size(1) : a.size(0);
  p.k = a_transposed ? a.size(0) : a.size(1);
  p.n = b_transposed ? b.size(1) : b.size(0);
  const int64_t kb = b_transposed ? b.size(0) : b.size(1);
  TORCH_CHECK_VALUE(kb == p.k, "A contracts over K=", p.k, " but B over K=", kb, " (A ",
                    shape_str(a), a_transposed ? " transposed" : "", ", B ", shape_str(b),
                    b_transposed ? " transposed" : "", ")");
  p.d_type = storage_type(out, "out");
  check_output(out, "out", {p.m, p.n}, out.scalar_type(), out);
  p.d = out.data_ptr();
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == p.n, "bias must be [N]=[", p.n,
                      "], got shape ", shape_str(*bias));
    check_contiguous(*bias, "bias");
    check_same_device(*bias, out, "bias", "out");
    p.bias = bias->data_ptr();
    p.bias_type = storage_type(*bias, "bias");
  }
  if (residual.has_value()) {
    check_output(*residual, "residual", {p.m, p.n}, out.scalar_type(), out);
    TORCH_CHECK_VALUE(!residual->is_alias_of(out),
                      "residual shares memory with out; to add into out, pass accumulate=True");
    p.residual = residual->data_ptr();
  }
  p.accumulate = accumulate;
  p.fast_accum = fast_accum;
  const std::string err = gemm_check(p);
  TORCH_CHECK_VALUE(err.empty(), err);
  run_on_device(
      out, [&] { gemm_cpu(p); },
      [&](cudaStream_t s) {
        p.workspace = workspace_for(out);
        p.workspace_size = kGemmWorkspaceBytes;
        const std::string e = gemm_cuda(p, s);
        TORCH_CHECK(e.empty(), e);  // (cuBLASLt refused a checked call)
        return cudaSuccess;
      });
}

TORCH_LIBRARY_FRAGMENT(tpfp8, m) {
  m.def(
      "gemm(Tensor a, Tensor b, Tensor(a!) out, Tensor? a_scale_inv, Tensor? b_scale_inv, "
      "int a_type, int b_type, Tensor? bias, bool accumulate, bool fast_accum, "
      "bool a_transposed, bool b_transposed, Tensor? residual=None) -> ()");
}
TORCH_LIBRARY_IMPL(tpfp8, CPU, m) { m.impl("gemm", &gemm); }
#if defined(TPFP8_WITH_CUDA)
TORCH_LIBRARY_IMPL(tpfp8, CUDA, m) { m.impl("gemm", &gemm); }
#endif

}  // namespace tpfp8
