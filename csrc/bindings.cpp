// The Python module tpfp8._C. The ops themselves are registered with the dispatcher
// (torch.ops.tpfp8.*) by the *_ops.cpp files; importing this module loads them.
#include <torch/extension.h>

PYBIND11_MODULE(_C, m) {
  m.doc() = "tpfp8 native ops; use them through tpfp8.ops or torch.ops.tpfp8";
#if defined(TPFP8_WITH_CUDA)
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
