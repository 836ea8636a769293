// The Python module tpfp8._C: codes, the checks and updates Python calls around the ops. The ops
// themselves are registered with the dispatcher (torch.ops.tpfp8.*) by the *_ops.cpp files;
// importing this module loads them.
#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include "backward_guard.h"
#include "call_template.h"
#include "eager_op.h"
#include "kernels/gemm.h"
#include "kernels/norm_cast.h"
#include "linear.h"
#include "update_plan.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "tpfp8 native code; use it through tpfp8.Linear, tpfp8.ops or torch.ops.tpfp8";
#if defined(TPFP8_WITH_CUDA)
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  using namespace tpfp8;
  // Codes and rules defined once, here in C++; tpfp8.formats and tpfp8.ops read them.
  py::enum_<Fp8Format>(m, "Fp8Format")
      .value("E4M3", Fp8Format::kE4M3)
      .value("E5M2", Fp8Format::kE5M2);
  m.def(
      "fp8_max", [](Fp8Format f) { return fp8_max(f); }, py::arg("format"),
      "Largest finite magnitude of an FP8 format");
  m.def(
      "fp8_traits",
      [](Fp8Format f) {
        const Fp8Traits t = fp8_traits(f);
        return std::make_tuple(t.mantissa_bits, t.exponent_bias, int{t.max_code}, t.max_value);
      },
      py::arg("format"), "(mantissa bits, exponent bias, code of max, max) of an FP8 format");
  py::enum_<GemmType>(m, "GemmType", "Operand and output type codes of torch.ops.tpfp8.gemm")
      .value("FLOAT32", GemmType::kFloat32)
      .value("BFLOAT16", GemmType::kBFloat16)
      .value("FLOAT16", GemmType::kFloat16)
      .value("E4M3", GemmType::kE4M3)
      .value("E5M2", GemmType::kE5M2);
  m.attr("FP8_MULTIPLE") = kFp8Multiple;
  // The fused norms' widths: in_features a multiple of this, at most that (kernels/norm_cast.h).
  m.attr("NORM_HIDDEN_ALIGN") = kNormHiddenAlign;
  m.attr("NORM_MAX_HIDDEN") = kNormMaxHidden;
  py::enum_<Scaling>(m, "Scaling")
      .value("NONE", Scaling::kNone)
      .value("DELAYED", Scaling::kDelayed)
      .value("CURRENT", Scaling::kCurrent);
  py::enum_<WeightCache>(m, "WeightCache")
      .value("NONE", WeightCache::kNone)
      .value("FILL", WeightCache::kFill)
      .value("REUSE", WeightCache::kReuse);
  py::enum_<ParallelMode>(m, "ParallelMode")
      .value("NONE", ParallelMode::kNone)
      .value("COLUMN", ParallelMode::kColumn)
      .value("ROW", ParallelMode::kRow);
  py::enum_<Prologue>(m, "Prologue")
      .value("NONE", Prologue::kNone)
      .value("LAYER_NORM", Prologue::kLayerNorm)
      .value("RMS_NORM", Prologue::kRMSNorm)
      .value("GELU", Prologue::kGelu)
      .value("SWIGLU", Prologue::kSwiGLU);
  // The Linear itself is torch.ops.tpfp8.linear_forward / linear_backward (linear_ops.cpp).
  m.def(
      "check_linear_forward",
      [](const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
         const OptTensor& scale, const OptTensor& amax_history, const OptTensor& cache_rowwise,
         const OptTensor& cache_columnwise, const OptTensor& cache_scale_inv,
         const OptTensor& main_grad, int64_t scaling, int64_t fwd_format, int64_t grad_format,
         double epsilon, int64_t weight_cache, bool save_original_input, int64_t parallel_mode,
         bool sequence_parallel, const std::string& group_name, std::vector<int64_t> debug,
         const OptTensor& prologue_weight, const OptTensor& prologue_bias, int64_t prologue,
         double prologue_eps, const OptTensor& residual) {
        checked_forward_call(x, weight, bias, scale, amax_history, cache_rowwise, cache_columnwise,
                             cache_scale_inv, main_grad, scaling, fwd_format, grad_format, epsilon,
                             weight_cache, save_original_input, parallel_mode, sequence_parallel,
                             group_name, debug, prologue_weight, prologue_bias, prologue,
                             prologue_eps, residual);
      },
      py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("scale"), py::arg("amax_history"),
      py::arg("cache_rowwise"), py::arg("cache_columnwise"), py::arg("cache_scale_inv"),
      py::arg("main_grad"), py::arg("scaling"), py::arg("fwd_format"), py::arg("grad_format"),
      py::arg("epsilon"), py::arg("weight_cache"), py::arg("save_original_input"),
      py::arg("parallel_mode"), py::arg("sequence_parallel"), py::arg("group_name"),
      py::arg("debug"), py::arg("prologue_weight"), py::arg("prologue_bias"), py::arg("prologue"),
      py::arg("prologue_eps"), py::arg("residual") = py::none(),
      "Raises ValueError unless linear_forward can run these arguments (its fake kernel's check)");
  m.def("set_forward_vetted", &set_forward_vetted, py::arg("vetted"),
        "Marks this thread's next Linear forward ops as checked by the module inside a backward "
        "pass (an activation checkpoint's recompute); see csrc/backward_guard.h");
  m.def("set_debug_logger", &set_debug_logger, py::arg("logger"),
        "The function tpfp8.debug's reports go to: logger(handle, gemm, tensor, used, original, "
        "scale_inv, format)");
  m.def(
      "all_gather_fp8",
      [](const at::Tensor& local, Fp8Format format, const std::string& group_name) {
        const Fp8Tensor q = all_gather_fp8(local, CurrentScalingQuantizer(format, 0.0),
                                           c10d::resolve_process_group(group_name));
        return std::make_tuple(q.rowwise, q.scale_inv);
      },
      py::arg("local"), py::arg("format"), py::arg("group_name"),
      py::call_guard<py::gil_scoped_release>(),
      "Sequence-parallel FP8 gather with current scaling: (gathered row-wise uint8 codes, "
      "shared scale_inv)");
  bind_eager_op(m);
  bind_call_template(m);
  bind_update_plan(m);
}
