// Torch ops over the fused activation casts (kernels/activation_cast.h): validate, fill the
// params struct, run on the tensor's device. Outputs are caller-provided buffers, as for the
// casts (cast_ops.cpp); tpfp8/ops.py allocates them for casual use.
#include "activation_ops.h"

#include <torch/library.h>

#include "checks.h"
#include "dbias_output.h"
#include "device_dispatch.h"
#include "kernels/activation_cast.h"
#include "kernels/gemm.h"

namespace tpfp8 {
namespace {

Activation activation_from(int64_t code) {
  TORCH_CHECK_VALUE(code == 0 || code == 1, "activation must be 0 (GELU) or 1 (SwiGLU), got ",
                    code);
  return static_cast<Activation>(code);
}

// Params of act(x) (grad undefined) or of dx = dy * act'(x), shapes and dtypes checked.
ActivationCastParams activation_params(const at::Tensor* grad, const at::Tensor& input,
                                       int64_t activation) {
  check_2d(input, "input");
  check_contiguous(input, "input");
  ActivationCastParams p;
  p.activation = activation_from(activation);
  p.backward = grad != nullptr;
  p.dtype = high_precision_dtype(input, "input");
  p.input = input.data_ptr();
  p.rows = input.size(0);
  p.n = input.size(1);
  if (p.activation == Activation::kSwiGLU) {
    TORCH_CHECK_VALUE(p.n % 2 == 0,
                      "SwiGLU's input is [a | b], two halves of its last dimension, so that "
                      "dimension must be even; got input of shape ",
                      shape_str(input), " (fc1 of a SwiGLU MLP has 2 x ffn_hidden outputs)");
    p.n /= 2;
  }
  if (grad) {
    TORCH_CHECK_VALUE(grad->dim() == 2 && grad->size(0) == p.rows && grad->size(1) == p.n,
                      "grad must be the gradient of the activation's output, [", p.rows, ", ", p.n,
                      "] for input of shape ", shape_str(input), ", got shape ", shape_str(*grad));
    TORCH_CHECK_VALUE(grad->scalar_type() == input.scalar_type(), "grad must have input's dtype (",
                      input.scalar_type(), "), got ", grad->scalar_type(),
                      "; convert one of them with .to()");
    check_contiguous(*grad, "grad");
    check_same_device(*grad, input, "grad", "input");
    p.grad = grad->data_ptr();
  }
  return p;
}

// An optional output of exactly `sizes` and `dtype` on input's device, or nullptr.
void* optional_output(const OptTensor& t, const char* name, at::IntArrayRef sizes,
                      at::ScalarType dtype, const at::Tensor& input) {
  if (!t.has_value()) return nullptr;
  check_output(*t, name, sizes, dtype, input);
  return t->data_ptr();
}

float* optional_scalar(const OptTensor& t, const char* name, const at::Tensor& input) {
  if (!t.has_value()) return nullptr;
  check_scalar_f32(*t, name, input, "input");
  return t->data_ptr<float>();
}

void run(const ActivationCastParams& p, const at::Tensor& input) {
  run_on_device(
      input, [&] { activation_cast_cpu(p); },
      [&](cudaStream_t s) { return activation_cast_cuda(p, s); });
}

// Fills the outputs of a cast pass (p's scale or scale_amax set by the caller) and runs it.
// With `dbias` (backward only), also the column sums of dx (kernels/cast.h's order).
void run_cast(ActivationCastParams& p, const at::Tensor& input, const OptTensor& rowwise,
              const OptTensor& columnwise, const OptTensor& out, const OptTensor& scale_inv,
              const char* out_name, int64_t fp8_format, const OptTensor& dbias) {
  const int64_t cols = p.out_cols();
  TORCH_CHECK_VALUE(rowwise || columnwise || out,
                    "the fused activation cast needs at least one "
                    "of rowwise / columnwise / ",
                    out_name, " outputs");
  p.format = fp8_format_from(fp8_format);
  if (rowwise || columnwise) {
    TORCH_CHECK_VALUE(cols % kFp8Multiple == 0, "FP8 ", p.backward ? "dx" : "act(x)", " is [",
                      p.rows, ", ", cols, "]: its width ", cols,
                      " is the K of the GEMM that takes it, which Hopper's FP8 GEMMs need to be "
                      "a multiple of ",
                      kFp8Multiple, "; pad the layer's features or ask only for ", out_name);
  }
  p.rowwise =
      static_cast<uint8_t*>(optional_output(rowwise, "rowwise", {p.rows, cols}, at::kByte, input));
  p.columnwise = static_cast<uint8_t*>(
      optional_output(columnwise, "columnwise", {cols, p.rows}, at::kByte, input));
  p.out = optional_output(out, out_name, {p.rows, cols}, input.scalar_type(), input);
  p.scale_inv = optional_scalar(scale_inv, "scale_inv", input);
  TORCH_CHECK_VALUE(!dbias || p.backward,
                    "dbias (column sums) comes with the backward's dx, not with act(x)");
  const DbiasOutput sums(dbias, p.rows, cols, input);
  p.dbias = sums.sum();
  p.dbias_partial = sums.partial();
  run(p, input);
  sums.finish();
}

void cast_delayed(const at::Tensor* grad, const at::Tensor& input, const at::Tensor& scale,
                  const OptTensor& rowwise, const OptTensor& columnwise, const OptTensor& out,
                  const OptTensor& amax, const OptTensor& scale_inv, int64_t activation,
                  int64_t fp8_format, const char* out_name, const OptTensor& dbias = {}) {
  ActivationCastParams p = activation_params(grad, input, activation);
  check_scalar_f32(scale, "scale", input, "input");
  p.scale = scale.data_ptr<float>();
  p.amax = optional_scalar(amax, "amax", input);
  run_cast(p, input, rowwise, columnwise, out, scale_inv, out_name, fp8_format, dbias);
}

void cast_current(const at::Tensor* grad, const at::Tensor& input, const at::Tensor& amax,
                  double epsilon, const OptTensor& rowwise, const OptTensor& columnwise,
                  const OptTensor& out, const OptTensor& scale_inv, int64_t activation,
                  int64_t fp8_format, const char* out_name, const OptTensor& dbias = {}) {
  ActivationCastParams p = activation_params(grad, input, activation);
  check_scalar_f32(amax, "amax", input, "input");
  TORCH_CHECK_VALUE(epsilon >= 0.0, "epsilon must be >= 0, got ", epsilon);
  p.scale_amax = amax.data_ptr<float>();
  p.epsilon = static_cast<float>(epsilon);
  run_cast(p, input, rowwise, columnwise, out, scale_inv, out_name, fp8_format, dbias);
}

void amax_pass(const at::Tensor* grad, const at::Tensor& input, at::Tensor& amax,
               int64_t activation) {
  ActivationCastParams p = activation_params(grad, input, activation);
  check_scalar_f32(amax, "amax", input, "input");
  p.amax = amax.data_ptr<float>();
  run(p, input);
}

}  // namespace

void activation_cast(const at::Tensor& input, const at::Tensor& scale, const OptTensor& rowwise,
                     const OptTensor& columnwise, const OptTensor& out, const OptTensor& amax,
                     const OptTensor& scale_inv, int64_t activation, int64_t fp8_format) {
  cast_delayed(nullptr, input, scale, rowwise, columnwise, out, amax, scale_inv, activation,
               fp8_format, "out");
}

void activation_cast_current(const at::Tensor& input, const at::Tensor& amax, double epsilon,
                             const OptTensor& rowwise, const OptTensor& columnwise,
                             const OptTensor& out, const OptTensor& scale_inv, int64_t activation,
                             int64_t fp8_format) {
  cast_current(nullptr, input, amax, epsilon, rowwise, columnwise, out, scale_inv, activation,
               fp8_format, "out");
}

void activation_amax(const at::Tensor& input, at::Tensor& amax, int64_t activation) {
  amax_pass(nullptr, input, amax, activation);
}

void activation_backward_cast(const at::Tensor& grad, const at::Tensor& input,
                              const at::Tensor& scale, const OptTensor& rowwise,
                              const OptTensor& columnwise, const OptTensor& grad_input,
                              const OptTensor& amax, const OptTensor& scale_inv, int64_t activation,
                              int64_t fp8_format, const OptTensor& dbias) {
  cast_delayed(&grad, input, scale, rowwise, columnwise, grad_input, amax, scale_inv, activation,
               fp8_format, "grad_input", dbias);
}

void activation_backward_cast_current(const at::Tensor& grad, const at::Tensor& input,
                                      const at::Tensor& amax, double epsilon,
                                      const OptTensor& rowwise, const OptTensor& columnwise,
                                      const OptTensor& grad_input, const OptTensor& scale_inv,
                                      int64_t activation, int64_t fp8_format,
                                      const OptTensor& dbias) {
  cast_current(&grad, input, amax, epsilon, rowwise, columnwise, grad_input, scale_inv, activation,
               fp8_format, "grad_input", dbias);
}

void activation_backward_amax(const at::Tensor& grad, const at::Tensor& input, at::Tensor& amax,
                              int64_t activation) {
  amax_pass(&grad, input, amax, activation);
}

void activation_high_precision(const at::Tensor* grad, const at::Tensor& input, at::Tensor& out,
                               int64_t activation) {
  ActivationCastParams p = activation_params(grad, input, activation);
  check_output(out, grad ? "grad_input" : "out", {p.rows, p.out_cols()}, input.scalar_type(),
               input);
  p.out = out.data_ptr();
  run(p, input);
}

TORCH_LIBRARY_FRAGMENT(tpfp8, m) {
  m.def(
      "activation_cast(Tensor input, Tensor scale, Tensor(a!)? rowwise, Tensor(b!)? columnwise, "
      "Tensor(c!)? out, Tensor(d!)? amax, Tensor(e!)? scale_inv, int activation, "
      "int fp8_format) -> ()");
  m.def(
      "activation_cast_current(Tensor input, Tensor amax, float epsilon, Tensor(a!)? rowwise, "
      "Tensor(b!)? columnwise, Tensor(c!)? out, Tensor(d!)? scale_inv, int activation, "
      "int fp8_format) -> ()");
  m.def("activation_amax(Tensor input, Tensor(a!) amax, int activation) -> ()");
  m.def(
      "activation_backward_cast(Tensor grad, Tensor input, Tensor scale, Tensor(a!)? rowwise, "
      "Tensor(b!)? columnwise, Tensor(c!)? grad_input, Tensor(d!)? amax, Tensor(e!)? scale_inv, "
      "int activation, int fp8_format, Tensor(f!)? dbias=None) -> ()");
  m.def(
      "activation_backward_cast_current(Tensor grad, Tensor input, Tensor amax, float epsilon, "
      "Tensor(a!)? rowwise, Tensor(b!)? columnwise, Tensor(c!)? grad_input, "
      "Tensor(d!)? scale_inv, int activation, int fp8_format, Tensor(e!)? dbias=None) -> ()");
  m.def(
      "activation_backward_amax(Tensor grad, Tensor input, Tensor(a!) amax, int activation) -> ()");
}

#define TPFP8_REGISTER_ACTIVATION_OPS(m)                                         \
  m.impl("activation_cast", &activation_cast);                                   \
  m.impl("activation_cast_current", &activation_cast_current);                   \
  m.impl("activation_amax", &activation_amax);                                   \
  m.impl("activation_backward_cast", &activation_backward_cast);                 \
  m.impl("activation_backward_cast_current", &activation_backward_cast_current); \
  m.impl("activation_backward_amax", &activation_backward_amax)

TORCH_LIBRARY_IMPL(tpfp8, CPU, m) { TPFP8_REGISTER_ACTIVATION_OPS(m); }
#if defined(TPFP8_WITH_CUDA)
TORCH_LIBRARY_IMPL(tpfp8, CUDA, m) { TPFP8_REGISTER_ACTIVATION_OPS(m); }
#endif

}  // namespace tpfp8
