// tpfp8._C.CallTemplate: a layer's eager forward call, worked out once and checked at every call
// (call_template.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace tpfp8 {

void bind_call_template(pybind11::module_& m);

}  // namespace tpfp8
