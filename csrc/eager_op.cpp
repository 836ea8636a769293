// tpfp8._C.EagerOp: the modules' eager calls of their ops (torch.ops.tpfp8.linear / mlp) with
// less host time than torch.ops. torch.ops' generic path asks every argument whether it
// overrides __torch_function__ and converts each through torch::jit::toIValue, whose isinstance
// checks cost ~800 instructions an argument; a Linear call has 30: ~61k instructions outside the
// op's kernel, more than the module's own Python, against 11k here (session 31, callgrind;
// bench/RESULTS.md). Here the schema's few argument types are converted directly and the op runs
// through the same dispatcher entry (callBoxed, without the GIL, as torch.ops runs it), so
// autograd, fake tensors, dispatch modes and profiling see the same op. Calls __torch_function__
// must see -- a torch-function mode, a tensor subclass that overrides it -- go through torch.ops
// itself, as do the calls torch.compile traces (the modules choose torch.ops there).
#include "eager_op.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/extension.h>

namespace tpfp8 {

namespace py = pybind11;

EagerOp::EagerOp(const std::string& name, py::object traced)
    : op_(c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "")),
      traced_(std::move(traced)),
      disabled_(py::module_::import("torch._C").attr("_disabled_torch_function_impl")) {}

py::object EagerOp::operator()(const py::args& args) const {
  const std::vector<c10::Argument>& schema = op_.schema().arguments();
  TORCH_CHECK_TYPE(args.size() <= schema.size(), op_.schema().name(), " takes at most ",
                   schema.size(), " arguments, got ", args.size());
  if (at::impl::torch_function_mode_enabled()) return traced_(*args);
  torch::jit::Stack stack;
  stack.reserve(schema.size());
  for (size_t i = 0; i < args.size(); ++i) {
    if (!push(args[i], i, stack)) return traced_(*args);
  }
  for (size_t i = args.size(); i < schema.size(); ++i) {
    TORCH_CHECK_TYPE(schema[i].default_value(), op_.schema().name(), " missing argument '",
                     schema[i].name(), "'");
    stack.push_back(*schema[i].default_value());
  }
  return call(stack);
}

py::object EagerOp::call(torch::jit::Stack& stack) const {
  {
    py::gil_scoped_release no_gil;
    op_.callBoxed(&stack);
  }
  py::tuple out(stack.size());
  for (size_t i = 0; i < stack.size(); ++i) {
    out[i] = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(stack[i]).toTensor()));
  }
  return std::move(out);
}

bool EagerOp::push(py::handle obj, size_t index, torch::jit::Stack& stack) const {
  const c10::Argument& arg = op_.schema().arguments()[index];
  const c10::TypePtr& type = arg.real_type();
  const c10::TypeKind kind = type->kind();
  PyObject* p = obj.ptr();
  const bool is_tensor = PyObject_TypeCheck(p, reinterpret_cast<PyTypeObject*>(THPVariableClass));
  if (is_tensor && !THPVariable_CheckExact(p) && overrides_torch_function(obj)) return false;
  const bool tensor_arg =
      kind == c10::TypeKind::TensorType ||
      (kind == c10::TypeKind::OptionalType &&
       type->expectRef<c10::OptionalType>().getElementType()->kind() == c10::TypeKind::TensorType);
  int overflow = 0;
  if (tensor_arg && p == Py_None && kind == c10::TypeKind::OptionalType) {
    stack.emplace_back();
  } else if (tensor_arg && is_tensor) {
    stack.emplace_back(THPVariable_Unpack(p));
  } else if (kind == c10::TypeKind::IntType && PyLong_CheckExact(p)) {
    const long long value = PyLong_AsLongLongAndOverflow(p, &overflow);
    TORCH_CHECK_TYPE(!overflow, op_.schema().name(), ": argument '", arg.name(),
                     "' is out of int64's range");
    stack.emplace_back(static_cast<int64_t>(value));
  } else if (kind == c10::TypeKind::BoolType && PyBool_Check(p)) {
    stack.emplace_back(p == Py_True);
  } else if (kind == c10::TypeKind::FloatType && PyFloat_CheckExact(p)) {
    stack.emplace_back(PyFloat_AS_DOUBLE(p));
  } else {
    return convert(obj, arg, stack);
  }
  return true;
}

// Anything else (another type, a number of another kind): torch's own conversion, its failure a
// TypeError that names the argument.
bool EagerOp::convert(py::handle obj, const c10::Argument& arg, torch::jit::Stack& stack) const {
  try {
    stack.push_back(torch::jit::toIValue(obj, arg.real_type()));
  } catch (const std::exception&) {  // (pybind's cast error says nothing more)
    TORCH_CHECK_TYPE(false, op_.schema().name(), ": argument '", arg.name(), "' must be ",
                     arg.real_type()->repr_str(), ", got ", Py_TYPE(obj.ptr())->tp_name);
  }
  return true;
}

// As torch decides it: a subclass of Tensor whose __torch_function__ is not the disabled one
// (nn.Parameter's is).
bool EagerOp::overrides_torch_function(py::handle obj) const {
  const py::object impl = py::getattr(obj, "__torch_function__", py::none());
  return !impl.is_none() && !impl.is(disabled_);
}

void bind_eager_op(py::module_& m) {
  py::class_<EagerOp>(m, "EagerOp",
                      "An op of torch.ops.tpfp8 called eagerly with less host time than through "
                      "torch.ops (same dispatcher entry; __torch_function__ calls go through "
                      "`traced`, torch.ops' callable of the same op)")
      .def(py::init<const std::string&, py::object>(), py::arg("name"), py::arg("traced"))
      .def("__call__", &EagerOp::operator());
}

}  // namespace tpfp8
