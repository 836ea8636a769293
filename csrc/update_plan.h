// tpfp8._C.DelayedUpdate and tpfp8._C.UpdatePlan: fp8_autocast's exit, planned once per set of
// layers (update_plan.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace tpfp8 {

void bind_update_plan(pybind11::module_& m);

}  // namespace tpfp8
