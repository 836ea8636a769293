// The Python module tpfp8._C: the Linear's C++ entry point and its option structs. The ops
// themselves are registered with the dispatcher (torch.ops.tpfp8.*) by the *_ops.cpp files;
// importing this module loads them.
#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "kernels/gemm.h"
#include "linear.h"

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
  py::class_<DelayedUpdate, std::shared_ptr<DelayedUpdate>>(
      m, "DelayedUpdate", "A module's gradient scaling state, updated at the end of backward")
      .def(py::init<>())
      .def_readwrite("history", &DelayedUpdate::history)
      .def_readwrite("scale", &DelayedUpdate::scale)
      .def_readwrite("scale_inv", &DelayedUpdate::scale_inv)
      .def_readwrite("fp8_max", &DelayedUpdate::fp8_max)
      .def_readwrite("margin", &DelayedUpdate::margin)
      .def_readwrite("use_history_max", &DelayedUpdate::use_history_max)
      .def_readwrite("amax_group", &DelayedUpdate::amax_group);
  py::class_<QuantizerSpec>(m, "QuantizerSpec", "How one tensor of a Linear is quantized")
      .def(py::init<>())
      .def_readwrite("scaling", &QuantizerSpec::scaling)
      .def_readwrite("format", &QuantizerSpec::format)
      .def_readwrite("scale", &QuantizerSpec::scale)
      .def_readwrite("amax", &QuantizerSpec::amax)
      .def_readwrite("epsilon", &QuantizerSpec::epsilon)
      .def_readwrite("reduce_amax", &QuantizerSpec::reduce_amax)
      .def_readwrite("after_backward", &QuantizerSpec::after_backward);
  py::class_<DebugOptions>(m, "DebugOptions", "Precision-debugging choices of one Linear call")
      .def(py::init<>())
      .def_readwrite("active", &DebugOptions::active)
      .def_readwrite("hp_fprop", &DebugOptions::hp_fprop)
      .def_readwrite("hp_dgrad", &DebugOptions::hp_dgrad)
      .def_readwrite("hp_wgrad", &DebugOptions::hp_wgrad)
      .def_readwrite("fake_activation", &DebugOptions::fake_activation)
      .def_readwrite("fake_weight", &DebugOptions::fake_weight)
      .def_readwrite("fake_gradient", &DebugOptions::fake_gradient)
      .def_readwrite("log", &DebugOptions::log);
  py::class_<LinearOptions>(m, "LinearOptions", "Per-call settings of tpfp8._C.linear")
      .def(py::init<>())
      .def_readwrite("fp8", &LinearOptions::fp8)
      .def_readwrite("input", &LinearOptions::input)
      .def_readwrite("weight", &LinearOptions::weight)
      .def_readwrite("grad", &LinearOptions::grad)
      .def_readwrite("save_original_input", &LinearOptions::save_original_input)
      .def_readwrite("fuse_wgrad_accumulation", &LinearOptions::fuse_wgrad_accumulation)
      .def_readwrite("main_grad", &LinearOptions::main_grad)
      .def_readwrite("main_grad_overwrite", &LinearOptions::main_grad_overwrite)
      .def_readwrite("weight_cache", &LinearOptions::weight_cache)
      .def_readwrite("weight_cache_rowwise", &LinearOptions::weight_cache_rowwise)
      .def_readwrite("weight_cache_columnwise", &LinearOptions::weight_cache_columnwise)
      .def_readwrite("weight_cache_scale_inv", &LinearOptions::weight_cache_scale_inv)
      .def_readwrite("parallel_mode", &LinearOptions::parallel_mode)
      .def_readwrite("sequence_parallel", &LinearOptions::sequence_parallel)
      .def_readwrite("tp_group", &LinearOptions::tp_group)
      .def_readwrite("debug", &LinearOptions::debug);
  m.def(
      "all_gather_fp8",
      [](const at::Tensor& local, const QuantizerSpec& spec, const ProcessGroupPtr& group) {
        const Fp8Tensor q = all_gather_fp8(local, spec, group);
        return std::make_tuple(q.rowwise, q.scale_inv);
      },
      py::arg("local"), py::arg("spec"), py::arg("group"), py::call_guard<py::gil_scoped_release>(),
      "Sequence-parallel FP8 gather: (gathered row-wise uint8 codes, shared scale_inv)");
  m.def("update_delayed", &update_delayed, py::arg("updates"),
        py::call_guard<py::gil_scoped_release>(),
        "Delayed-scaling update of many modules' states now (one launch per recipe/group)");
  m.def("check_inputs", &check_inputs, py::arg("x"), py::arg("weight"), py::arg("bias"),
        py::arg("options"), "Raises ValueError unless linear() can run these arguments");
  // Without the GIL: forward may wait on a collective while a communication thread needs the
  // GIL to free an earlier Python-owned tensor (a deadlock seen with gloo otherwise).
  m.def("linear", &linear, py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("options"),
        py::call_guard<py::gil_scoped_release>(),
        "y = x W^T (+ bias) with autograd; see csrc/linear.h");
}
