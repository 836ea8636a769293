// A layer's eager forward, worked out once. Before its op, tpfp8.Linear's Python works out ~30
// arguments from the fp8_autocast frame, the checkpoints around the call, the weight cache and the
// state made for the recipe: more host time than the op's own C++ for a small layer. Most calls
// of a layer decide all of it the same way, so tpfp8/module.py makes a template from a call made
// the slow way: the arguments that stay the same from call to call, converted once; where the
// tensors come from -- read from the layer's `_parameters` and `_buffers` at every call, so a
// tensor replaced in between is simply the one the call reads, and no tensor is held; and the two
// gradient flags, from the input and the weight. (A tensor not in its container is looked for in
// the layer's __dict__, where a bias=False layer keeps its None; where neither has it, or where a
// tensor that was there is None, the slow path decides.) With fuse_wgrad_accumulation the weight's
// `main_grad` is read at every call too, as the slow path reads it.
//
// run() calls the op only where everything the slow path based those arguments on still holds,
// and registers the layer for the frame's delayed-scaling update as the slow path does; anywhere
// else it returns None and the module takes the slow path (which makes a new template). Under
// torch.autocast (a template made under the same autocast dtype) it converts the input and bias,
// and outside FP8 the weight, as the slow path does before its op.
#include "call_template.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/SavedTensorHooks.h>
#include <ATen/autocast_mode.h>
#include <pybind11/stl.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <string>
#include <tuple>
#include <vector>

#include "eager_op.h"
#include "py_lookup.h"

namespace py = pybind11;

namespace tpfp8 {
namespace {

// Whether `a == b` (identity first, as Python's `==` on containers does).
bool equal(PyObject* a, PyObject* b) {
  if (a == nullptr || b == nullptr) return false;
  const int eq = PyObject_RichCompareBool(a, b, Py_EQ);
  if (eq < 0) throw py::error_already_set();
  return eq == 1;
}

// The innermost fp8_autocast frame in FP8 (tpfp8.autocast.current()), or a null object.
py::object current_frame(const py::object& frames, const py::str& stack_name,
                         const py::str& recipe_name) {
  const py::object stack =
      py::reinterpret_steal<py::object>(PyObject_GetAttr(frames.ptr(), stack_name.ptr()));
  if (!stack) {  // (no frame ever entered on this thread)
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) throw py::error_already_set();
    PyErr_Clear();
    return py::object();
  }
  if (!PyList_Check(stack.ptr()) || PyList_GET_SIZE(stack.ptr()) == 0) return py::object();
  PyObject* top = PyList_GET_ITEM(stack.ptr(), PyList_GET_SIZE(stack.ptr()) - 1);
  PyObject* recipe = dict_entry(top, recipe_name.ptr());
  if (recipe == nullptr || recipe == Py_None) return py::object();
  return py::reinterpret_borrow<py::object>(top);
}

// What a call made the slow way took for granted, and the op's arguments it chose.
struct Expected {
  py::object is_first_microbatch;  // None or False (the same object)
  py::object config;               // the layer's `_config` (a frozen value)
  py::object codes;                // the frame's recipe codes; None: outside any FP8 frame
  bool delayed;                    // delayed scaling: the layer's state and amax group too
  bool registers;                  // registers the layer for the frame's update
  py::object frame_group;          // the frame's amax_group (delayed)
  py::object amax_group;           // the layer's `_fp8_amax_group` it led to (delayed)
  bool return_bias;                // returns (y, bias), the op adding none
  bool main_grad;                  // fuse_wgrad_accumulation: weight.main_grad read per call
  std::optional<c10::ScalarType> autocast_dtype;  // torch.autocast's for the input's device
};

class CallTemplate {
 public:
  CallTemplate(py::object op, const py::tuple& args,
               const std::vector<std::tuple<std::string, py::str, py::str>>& sources,
               Expected expected, py::object frames, py::object debug)
      : op_object_(std::move(op)),
        op_(op_object_.cast<const EagerOp*>()),
        expected_(std::move(expected)),
        frames_(std::move(frames)),
        debug_(std::move(debug)),
        weight_(index("weight")),
        bias_(index("bias")),
        scale_(index("scale")),
        dgrad_(index("need_dgrad")),
        wgrad_(index("need_wgrad")),
        main_grad_(index("main_grad")) {
    const c10::FunctionSchema& schema = op_->schema();
    TORCH_CHECK_VALUE(args.size() == schema.arguments().size(), "CallTemplate: ", schema.name(),
                      " takes ", schema.arguments().size(), " arguments, got ", args.size());
    // The arguments set at every call: the input, the gradient flags, the sources.
    std::vector<bool> per_call(args.size());
    per_call[0] = per_call[dgrad_] = per_call[wgrad_] = true;
    per_call[main_grad_] = expected_.main_grad;
    for (const auto& [arg, container, name] : sources) {
      const size_t i = index(arg);
      per_call[i] = true;
      sources_.push_back({i, container, name, args[i].is_none()});
    }
    TORCH_CHECK_VALUE(per_call[weight_], "CallTemplate: the weight needs a source");
    TORCH_CHECK_VALUE(!expected_.delayed || per_call[scale_],
                      "CallTemplate: delayed scaling reads the layer's scale");
    for (size_t i = 0; i < args.size(); ++i) {
      if (per_call[i]) {
        constants_.emplace_back();
      } else if (!op_->push(args[i], i, constants_)) {
        TORCH_CHECK_TYPE(false, "CallTemplate: argument ", i, " overrides __torch_function__");
      }
    }
  }

  // The layer's output for `x` (y, or (y, bias) with return_bias), or None where the template does
  // not fit this call.
  py::object run(py::handle layer, py::handle x, py::handle is_first_microbatch) const {
    if (is_first_microbatch.ptr() != expected_.is_first_microbatch.ptr()) return py::none();
    if (!THPVariable_CheckExact(x.ptr()) || !context_allows()) return py::none();
    const at::Tensor& input = THPVariable_Unpack(x.ptr());
    const c10::DeviceType device = input.device().type();
    if (device != c10::DeviceType::CPU && device != c10::DeviceType::CUDA) return py::none();
    if (!autocast_fits(input) || !no_debug_rules()) return py::none();
    const py::object attrs = instance_dict(layer);
    if (dict_entry(attrs.ptr(), config_name_.ptr()) != expected_.config.ptr()) return py::none();
    const py::object frame = current_frame(frames_, stack_name_, recipe_name_);
    if (!frame_fits(frame.ptr(), attrs.ptr())) return py::none();
    torch::jit::Stack stack;
    if (!arguments(input, attrs.ptr(), stack)) return py::none();
    if (expected_.delayed && stack[scale_].toTensor().device() != input.device()) {
      return py::none();
    }
    // What the call gives back and registers in, found before the op runs.
    const py::object bias =
        expected_.return_bias ? source(attrs.ptr(), parameters_name_, bias_name_) : py::none();
    const py::object ran =
        expected_.registers ? held_entry(frame.ptr(), ran_name_.ptr()) : py::none();
    if (!bias || !ran || (expected_.registers && !PyDict_Check(ran.ptr()))) return py::none();
    py::object returned_bias = bias;
    if (expected_.autocast_dtype && !to_autocast_dtype(stack, returned_bias)) return py::none();
    const py::tuple out = op_->call(stack);
    if (expected_.registers && PyDict_SetItem(ran.ptr(), layer.ptr(), layer.ptr()) != 0) {
      throw py::error_already_set();
    }
    if (!expected_.return_bias) return out[0];
    return py::make_tuple(out[0], returned_bias);
  }

 private:
  size_t index(const std::string& name) const {
    const std::optional<int> i = op_->schema().argumentIndexWithName(name);
    TORCH_CHECK_VALUE(i.has_value(), "CallTemplate: ", op_->schema().name(), " has no argument '",
                      name, "'");
    return static_cast<size_t>(*i);
  }

  // What tpfp8.checkpointing.around() answers with None (no checkpoint around the call, outside
  // backward) and the module's checks of torch function modes.
  static bool context_allows() {
    return !at::impl::torch_function_mode_enabled() && c10::GradMode::is_enabled() &&
           !at::SavedTensorDefaultHooks::get_hooks().has_value() &&
           torch::autograd::get_current_graph_task_id() == -1;
  }

  // Whether torch.autocast for the input's device is as it was for the template's call: off, or
  // on with the same dtype and a floating-point input (the slow path converts that).
  bool autocast_fits(const at::Tensor& input) const {
    const c10::DeviceType device = input.device().type();
    if (!at::autocast::is_autocast_enabled(device)) return !expected_.autocast_dtype;
    return expected_.autocast_dtype == at::autocast::get_autocast_dtype(device) &&
           input.is_floating_point();
  }

  // Linear._compute_dtype: the input and bias in autocast's dtype, the weight too outside FP8
  // (an FP8 cast reads the master weight itself), in its order, before the op: the autograd
  // graph's order (hooks, DDP's buckets) is the slow path's. With return_bias the bias given back
  // is the one converted; false where only its __torch_function__ may convert it. Tensor.to
  // returns the tensor itself where its dtype is that already, as Python's does.
  bool to_autocast_dtype(torch::jit::Stack& stack, py::object& returned_bias) const {
    const c10::ScalarType dtype = *expected_.autocast_dtype;
    const auto convert = [&](size_t i) {
      if (stack[i].isTensor()) stack[i] = stack[i].toTensor().to(dtype);
    };
    convert(0);
    if (expected_.codes.is_none()) convert(weight_);
    convert(bias_);  // (None with return_bias: the bias given back is converted instead)
    if (!expected_.return_bias || returned_bias.is_none()) return true;
    torch::jit::Stack pushed;
    if (!THPVariable_Check(returned_bias.ptr()) || !op_->push(returned_bias, bias_, pushed)) {
      return false;
    }
    returned_bias =
        py::reinterpret_steal<py::object>(THPVariable_Wrap(pushed.back().toTensor().to(dtype)));
    return true;
  }

  bool no_debug_rules() const {
    const py::object rules =
        py::reinterpret_steal<py::object>(PyObject_GetAttr(debug_.ptr(), rules_name_.ptr()));
    if (!rules) throw py::error_already_set();
    const int truth = PyObject_IsTrue(rules.ptr());
    if (truth < 0) throw py::error_already_set();
    return truth == 0;
  }

  // Whether the frame (null: none in FP8) is one the template's arguments were chosen for.
  bool frame_fits(PyObject* frame, PyObject* attrs) const {
    if (expected_.codes.is_none()) return frame == nullptr;
    if (frame == nullptr || !equal(dict_entry(frame, codes_name_.ptr()), expected_.codes.ptr())) {
      return false;
    }
    if (!expected_.delayed) return true;
    // The layer's state made for this recipe (else the slow path makes it), its amax group the
    // one this frame leads to, and an FP8 forward run before.
    return equal(dict_entry(attrs, key_name_.ptr()), dict_entry(frame, key_name_frame_.ptr())) &&
           dict_entry(frame, group_name_.ptr()) == expected_.frame_group.ptr() &&
           dict_entry(attrs, amax_group_name_.ptr()) == expected_.amax_group.ptr() &&
           dict_entry(attrs, ran_fp8_name_.ptr()) == Py_True;
  }

  // layer.<container>[name], else the layer's own attribute `name` (held; null if neither).
  static py::object source(PyObject* attrs, const py::str& container, const py::str& name) {
    py::object value = held_entry(dict_entry(attrs, container.ptr()), name.ptr());
    return value ? value : held_entry(attrs, name.ptr());
  }

  // The op's arguments for `x`; false where a source is missing, is None where the template's
  // call had a tensor, or needs __torch_function__.
  bool arguments(const at::Tensor& input, PyObject* attrs, torch::jit::Stack& stack) const {
    stack = constants_;
    stack[0] = input;
    torch::jit::Stack read;
    read.reserve(sources_.size() + 1);
    py::object weight;
    for (const Source& s : sources_) {
      py::object value = source(attrs, s.container, s.name);
      if (!value || (value.is_none() && !s.nullable) || !op_->push(value, s.index, read)) {
        return false;
      }
      stack[s.index] = std::move(read.back());
      if (s.index == weight_) weight = std::move(value);
    }
    stack[dgrad_] = input.requires_grad();
    const bool wgrad = stack[weight_].isTensor() && stack[weight_].toTensor().requires_grad();
    stack[wgrad_] = wgrad;
    return !expected_.main_grad || !wgrad || main_grad(weight, read, stack);
  }

  // The slow path's getattr(weight, "main_grad", None) for a weight that needs a gradient: the
  // tensor its backward accumulates into. False where there is none (the slow path makes one),
  // it is no tensor (the slow path says what it needs) or it needs __torch_function__.
  bool main_grad(const py::object& weight, torch::jit::Stack& read,
                 torch::jit::Stack& stack) const {
    const py::object value =
        py::reinterpret_steal<py::object>(PyObject_GetAttr(weight.ptr(), main_grad_name_.ptr()));
    if (!value) {
      if (!PyErr_ExceptionMatches(PyExc_AttributeError)) throw py::error_already_set();
      PyErr_Clear();
      return false;
    }
    if (!THPVariable_Check(value.ptr()) || !op_->push(value, main_grad_, read)) return false;
    stack[main_grad_] = std::move(read.back());
    return true;
  }

  py::object op_object_;
  const EagerOp* op_;
  Expected expected_;
  py::object frames_;  // tpfp8.autocast's thread-local stack of frames
  py::object debug_;   // tpfp8.debug's state: its `rules`
  struct Source {
    size_t index;  // of the op's argument
    py::str container, name;
    bool nullable;  // None in the call the template was made from
  };
  std::vector<Source> sources_;
  torch::jit::Stack constants_;  // every argument, those set per call empty
  size_t weight_, bias_, scale_, dgrad_, wgrad_, main_grad_;  // positions of these arguments
  const py::str config_name_{"_config"}, stack_name_{"stack"}, recipe_name_{"recipe"},
      codes_name_{"codes"}, key_name_{"_fp8_recipe_key"}, key_name_frame_{"key"},
      group_name_{"amax_group"}, amax_group_name_{"_fp8_amax_group"}, ran_fp8_name_{"_fp8_ran_fp8"},
      ran_name_{"ran"}, parameters_name_{"_parameters"}, bias_name_{"bias"}, rules_name_{"rules"},
      main_grad_name_{"main_grad"};
};

// A torch.dtype argument (None: no dtype).
std::optional<c10::ScalarType> scalar_type(const py::object& dtype) {
  if (dtype.is_none()) return std::nullopt;
  TORCH_CHECK_TYPE(THPDtype_Check(dtype.ptr()), "CallTemplate: autocast_dtype must be a ",
                   "torch.dtype or None, got ", Py_TYPE(dtype.ptr())->tp_name);
  return reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
}

}  // namespace

void bind_call_template(py::module_& m) {
  py::class_<CallTemplate>(m, "CallTemplate",
                           "A layer's eager forward call, worked out once from a call made the "
                           "slow way, checked at every call (tpfp8.module.Linear.forward)")
      .def(py::init([](py::object op, const py::tuple& args,
                       const std::vector<std::tuple<std::string, py::str, py::str>>& sources,
                       py::object is_first_microbatch, py::object config, py::object codes,
                       bool delayed, bool registers, py::object frame_group, py::object amax_group,
                       bool return_bias, py::object frames, py::object debug,
                       py::object autocast_dtype, bool main_grad) {
             Expected expected{std::move(is_first_microbatch),
                               std::move(config),
                               std::move(codes),
                               delayed,
                               registers,
                               std::move(frame_group),
                               std::move(amax_group),
                               return_bias,
                               main_grad,
                               scalar_type(autocast_dtype)};
             return CallTemplate(std::move(op), args, sources, std::move(expected),
                                 std::move(frames), std::move(debug));
           }),
           py::arg("op"), py::arg("args"), py::arg("sources"), py::arg("is_first_microbatch"),
           py::arg("config"), py::arg("codes"), py::arg("delayed"), py::arg("registers"),
           py::arg("frame_group"), py::arg("amax_group"), py::arg("return_bias"), py::arg("frames"),
           py::arg("debug"), py::arg("autocast_dtype") = py::none(), py::arg("main_grad") = false,
           "`op` (an EagerOp) and all its arguments `args` as a call made the slow way passed "
           "them; `sources`: (argument, container, entry) for each tensor read from the layer "
           "at every call (layer.<container>[entry]); the rest: what that call took for granted "
           "(the frame's recipe codes, None outside FP8; under delayed scaling the frame's and "
           "the layer's amax groups); `frames`: tpfp8.autocast's thread-local frames; `debug`: "
           "an object whose `rules` are falsy while no debug rule is set; `autocast_dtype`: "
           "torch.autocast's dtype for the input's device in that call, None where it was off; "
           "`main_grad`: the op's main_grad is the weight's `main_grad`, read at every call "
           "where the weight needs a gradient (fuse_wgrad_accumulation)")
      .def("run", &CallTemplate::run, py::arg("layer"), py::arg("x"),
           py::arg("is_first_microbatch"),
           "The layer's output for `x` (y, or (y, bias) with return_bias), or None where the "
           "template does not fit this call (take the slow path)");
}

}  // namespace tpfp8
