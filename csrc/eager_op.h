// tpfp8._C.EagerOp, the modules' eager calls of their ops (eager_op.cpp), and the conversion of
// Python values to an op's arguments it rests on (also used by call_template.cpp).
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <pybind11/pybind11.h>

#include <string>

namespace tpfp8 {

// An op of torch.ops.tpfp8 called eagerly with less host time than through torch.ops.
class EagerOp {
 public:
  EagerOp(const std::string& name, pybind11::object traced);

  // The op on `args` (its leading arguments; the rest take their defaults).
  pybind11::object operator()(const pybind11::args& args) const;

  // Pushes `obj` as the value of argument `index`; false where the call must go through
  // __torch_function__ (a tensor subclass that overrides it). TypeError for a value of another
  // type.
  bool push(pybind11::handle obj, size_t index, torch::jit::Stack& stack) const;

  // Runs the op on `stack` (the GIL released) and returns its outputs, a tuple of tensors.
  pybind11::object call(torch::jit::Stack& stack) const;

  const c10::FunctionSchema& schema() const { return op_.schema(); }

 private:
  bool convert(pybind11::handle obj, const c10::Argument& arg, torch::jit::Stack& stack) const;
  bool overrides_torch_function(pybind11::handle obj) const;

  c10::OperatorHandle op_;
  pybind11::object traced_;    // torch.ops' callable of the same op
  pybind11::object disabled_;  // torch._C._disabled_torch_function_impl
};

void bind_eager_op(pybind11::module_& m);

}  // namespace tpfp8
