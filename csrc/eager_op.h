// tpfp8._C.EagerOp, the modules' eager calls of their ops (eager_op.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace tpfp8 {

void bind_eager_op(pybind11::module_& m);

}  // namespace tpfp8
