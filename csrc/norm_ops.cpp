// Torch ops over the fused norm -> FP8 cast (kernels/norm_cast.h) and the norm's backward
// (kernels/norm_backward.h): validate, fill the params struct, run on the input's device. The
// cast's outputs are caller-provided buffers, as for the cast ops (tpfp8/ops.py allocates them
// for casual use); the backward allocates its own.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

#include "checks.h"
#include "device_dispatch.h"
#include "kernels/norm_backward.h"
#include "kernels/norm_cast.h"
#include "ops.h"

namespace tpfp8 {
namespace {

NormType norm_type(bool rms_norm) { return rms_norm ? NormType::kRMSNorm : NormType::kLayerNorm; }

// gamma / beta as the kernels read them: contiguous fp32 [hidden] (a bf16 weight is converted,
// a small copy beside the row pass).
at::Tensor norm_weight(const at::Tensor& w, const char* name, const at::Tensor& input) {
  TORCH_CHECK_VALUE(w.dim() == 1 && w.size(0) == input.size(1), name,
                    " must be 1-D [hidden=", input.size(1), "], got shape ", shape_str(w));
  high_precision_dtype(w, name);
  check_same_device(w, input, name, "input");
  return w.to(at::kFloat).contiguous();
}

template <typename T>
T* optional_out(const OptTensor& t, const char* name, at::IntArrayRef sizes, at::ScalarType dtype,
                const at::Tensor& ref) {
  if (!t.has_value()) return nullptr;
  check_output(*t, name, sizes, dtype, ref);
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0, name,
                    " must start 16-byte aligned (the kernel's vector stores); pass a fresh "
                    "tensor, not an offset view");
  return static_cast<T*>(t->data_ptr());
}

// Everything but the scale: the caller sets p.scale or p.scale_amax.
struct NormCall {
  NormCastParams p;
  at::Tensor gamma, beta;  // fp32 copies the params point at, alive for the call
};

NormCall norm_call(const at::Tensor& input, const at::Tensor& gamma, const OptTensor& beta,
                   bool rms_norm, double eps, const OptTensor& out, const OptTensor& rowwise,
                   const OptTensor& columnwise, const OptTensor& scale_inv, const OptTensor& mean,
                   const OptTensor& rstd, int64_t fp8_format) {
  check_2d(input, "input");
  check_contiguous(input, "input");
  NormCall c;
  NormCastParams& p = c.p;
  p.dtype = high_precision_dtype(input, "input");
  p.rows = input.size(0);
  p.hidden = input.size(1);
  TORCH_CHECK_VALUE(p.hidden > 0 && p.hidden % kNormHiddenAlign == 0 && p.hidden <= kNormMaxHidden,
                    "norm_cast needs hidden (input.size(1)) a multiple of ", kNormHiddenAlign,
                    " in [16, ", kNormMaxHidden,
                    "] (the FP8 GEMMs' alignment, the kernel's "
                    "registers), got ",
                    p.hidden, "; pad the hidden size or use torch's norm");
  TORCH_CHECK_VALUE(eps >= 0.0, "eps must be >= 0, got ", eps);
  TORCH_CHECK_VALUE(!(rms_norm && beta.has_value()),
                    "RMSNorm has no beta (bias); pass beta=None or use LayerNorm");
  TORCH_CHECK_VALUE(!(rms_norm && mean.has_value()), "RMSNorm has no mean to save; pass mean=None");
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(input.data_ptr()) % 16 == 0,
                    "input must start 16-byte aligned (the kernel's vector loads); call "
                    ".clone() on an offset view");
  p.input = input.data_ptr();
  p.norm = norm_type(rms_norm);
  p.eps = static_cast<float>(eps);
  p.format = fp8_format_from(fp8_format);
  c.gamma = norm_weight(gamma, "gamma", input);
  p.gamma = c.gamma.data_ptr<float>();
  if (beta) {
    c.beta = norm_weight(*beta, "beta", input);
    p.beta = c.beta.data_ptr<float>();
  }
  p.out = optional_out<void>(out, "out", input.sizes(), input.scalar_type(), input);
  p.rowwise = optional_out<uint8_t>(rowwise, "rowwise", {p.rows, p.hidden}, at::kByte, input);
  p.columnwise =
      optional_out<uint8_t>(columnwise, "columnwise", {p.hidden, p.rows}, at::kByte, input);
  if (scale_inv) check_scalar_f32(*scale_inv, "scale_inv", input, "input");
  p.scale_inv = scale_inv ? scale_inv->data_ptr<float>() : nullptr;
  p.mean = optional_out<float>(mean, "mean", {p.rows}, at::kFloat, input);
  p.rstd = optional_out<float>(rstd, "rstd", {p.rows}, at::kFloat, input);
  return c;
}

void run_norm_cast(const NormCastParams& p, const at::Tensor& input) {
  run_on_device(
      input, [&] { norm_cast_cpu(p); }, [&](cudaStream_t s) { return norm_cast_cuda(p, s); });
}

}  // namespace

void norm_amax(const at::Tensor& input, const at::Tensor& gamma, const OptTensor& beta,
               bool rms_norm, double eps, const at::Tensor& amax) {
  NormCall c = norm_call(input, gamma, beta, rms_norm, eps, {}, {}, {}, {}, {}, {}, 0);
  check_scalar_f32(amax, "amax", input, "input");
  c.p.amax = amax.data_ptr<float>();
  run_on_device(
      input, [&] { norm_cast_amax_cpu(c.p); },
      [&](cudaStream_t s) { return norm_cast_amax_cuda(c.p, s); });
}

void norm_cast_from(const at::Tensor& input, const at::Tensor& gamma, const OptTensor& beta,
                    bool rms_norm, double eps, const OptTensor& scale, const OptTensor& scale_amax,
                    double scale_epsilon, const OptTensor& out, const OptTensor& rowwise,
                    const OptTensor& columnwise, const OptTensor& amax, const OptTensor& scale_inv,
                    const OptTensor& mean, const OptTensor& rstd, int64_t fp8_format) {
  NormCall c = norm_call(input, gamma, beta, rms_norm, eps, out, rowwise, columnwise, scale_inv,
                         mean, rstd, fp8_format);
  TORCH_CHECK_VALUE(!(rowwise || columnwise) || scale || scale_amax,
                    "an FP8 output of the norm needs a scale (or an amax to derive it from)");
  TORCH_CHECK_VALUE(scale_epsilon >= 0.0, "scale_epsilon must be >= 0, got ", scale_epsilon);
  if (scale) check_scalar_f32(*scale, "scale", input, "input");
  if (scale_amax) check_scalar_f32(*scale_amax, "amax", input, "input");
  if (amax) check_scalar_f32(*amax, "amax", input, "input");
  c.p.scale = scale ? scale->data_ptr<float>() : nullptr;
  c.p.scale_amax = scale_amax ? scale_amax->data_ptr<float>() : nullptr;
  c.p.scale_epsilon = static_cast<float>(scale_epsilon);
  c.p.amax = amax ? amax->data_ptr<float>() : nullptr;
  run_norm_cast(c.p, input);
}

void norm_cast(const at::Tensor& input, const at::Tensor& gamma, const OptTensor& beta,
               bool rms_norm, double eps, const at::Tensor& scale, const OptTensor& out,
               const OptTensor& rowwise, const OptTensor& columnwise, const OptTensor& amax,
               const OptTensor& scale_inv, const OptTensor& mean, const OptTensor& rstd,
               int64_t fp8_format) {
  norm_cast_from(input, gamma, beta, rms_norm, eps, scale, std::nullopt, 0.0, out, rowwise,
                 columnwise, amax, scale_inv, mean, rstd, fp8_format);
}

void norm_cast_current(const at::Tensor& input, const at::Tensor& gamma, const OptTensor& beta,
                       bool rms_norm, double eps, const at::Tensor& amax, double scale_epsilon,
                       const OptTensor& out, const OptTensor& rowwise, const OptTensor& columnwise,
                       const OptTensor& scale_inv, const OptTensor& mean, const OptTensor& rstd,
                       int64_t fp8_format) {
  // Pass 1 folds max |y| into amax; pass 2 casts with the scale the kernel derives from it.
  // Every argument is checked before pass 1 writes amax.
  norm_call(input, gamma, beta, rms_norm, eps, out, rowwise, columnwise, scale_inv, mean, rstd,
            fp8_format);
  TORCH_CHECK_VALUE(scale_epsilon >= 0.0, "scale_epsilon must be >= 0, got ", scale_epsilon);
  norm_amax(input, gamma, beta, rms_norm, eps, amax);
  norm_cast_from(input, gamma, beta, rms_norm, eps, std::nullopt, amax, scale_epsilon, out, rowwise,
                 columnwise, std::nullopt, scale_inv, mean, rstd, fp8_format);
}

// The norm's backward (kernels/norm_backward.h): dx from one pass over x and dy, dgamma / dbeta
// as per-band column sums added in a fixed order -- the same bytes every run, on CPU and GPU.
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_backward(
    const at::Tensor& dy, const at::Tensor& x, const OptTensor& mean, const at::Tensor& rstd,
    const at::Tensor& gamma, bool rms_norm, const OptTensor& dx_add) {
  check_2d(x, "x");
  high_precision_dtype(x, "x");
  TORCH_CHECK_VALUE(dy.sizes() == x.sizes(), "dy must have x's shape ", shape_str(x), ", got ",
                    shape_str(dy));
  high_precision_dtype(dy, "dy");
  check_same_device(dy, x, "dy", "x");
  const int64_t rows = x.size(0), hidden = x.size(1);
  TORCH_CHECK_VALUE(rstd.dim() == 1 && rstd.size(0) == rows && rstd.scalar_type() == at::kFloat,
                    "rstd must be float32 [rows=", rows, "] (norm_cast's rstd), got ",
                    rstd.scalar_type(), " of shape ", shape_str(rstd));
  check_same_device(rstd, x, "rstd", "x");
  TORCH_CHECK_VALUE(rms_norm != mean.has_value(),
                    rms_norm ? "RMSNorm's backward takes no mean; pass mean=None"
                             : "LayerNorm's backward needs the mean norm_cast saved");
  if (mean) {
    TORCH_CHECK_VALUE(
        mean->dim() == 1 && mean->size(0) == rows && mean->scalar_type() == at::kFloat,
        "mean must be float32 [rows=", rows, "], got ", mean->scalar_type(), " of shape ",
        shape_str(*mean));
    check_same_device(*mean, x, "mean", "x");
  }
  TORCH_CHECK_VALUE(gamma.dim() == 1 && gamma.size(0) == hidden,
                    "gamma must be 1-D [hidden=", hidden, "], got shape ", shape_str(gamma));
  high_precision_dtype(gamma, "gamma");
  check_same_device(gamma, x, "gamma", "x");

  TORCH_CHECK_VALUE(hidden > 0 && hidden % kNormHiddenAlign == 0 && hidden <= kNormMaxHidden,
                    "norm_backward needs hidden (x.size(1)) a multiple of ", kNormHiddenAlign,
                    " in [16, ", kNormMaxHidden, "] (norm_cast's limits), got ", hidden);

  if (dx_add) {
    TORCH_CHECK_VALUE(dx_add->sizes() == x.sizes() && dx_add->scalar_type() == x.scalar_type(),
                      "dx_add must be ", x.scalar_type(), " of x's shape ", shape_str(x),
                      " (it is added to dx), got ", dx_add->scalar_type(), " of shape ",
                      shape_str(*dx_add));
    check_same_device(*dx_add, x, "dx_add", "x");
  }
  // The kernel reads x and dy in one dtype: a dy of another dtype goes in fp32 with x (both
  // exact), and dx is rounded to x's dtype once, at the end.
  const bool same_dtype = dy.scalar_type() == x.scalar_type();
  const at::Tensor xk = (same_dtype ? x : x.to(at::kFloat)).contiguous();
  const at::Tensor dyk = (same_dtype ? dy : dy.to(at::kFloat)).contiguous();
  const at::Tensor addk = dx_add ? dx_add->to(xk.scalar_type()).contiguous() : at::Tensor();
  const at::Tensor gamma32 = gamma.to(at::kFloat).contiguous();
  const at::Tensor rstd_c = rstd.contiguous();
  const at::Tensor mean_c = mean ? mean->contiguous() : at::Tensor();
  const at::TensorOptions f32 = x.options().dtype(at::kFloat);
  const at::Tensor dx = at::empty(xk.sizes(), xk.options());
  const at::Tensor dgamma = at::empty({hidden}, f32);
  const at::Tensor dbeta = rms_norm ? at::Tensor() : at::empty({hidden}, f32);
  const at::Tensor partial =  // the CPU reference needs no workspace
      x.device().is_cpu() ? at::Tensor()
                          : at::empty({norm_backward_workspace_floats(rows, hidden)}, f32);

  NormBackwardParams p;
  p.dy = dyk.data_ptr();
  p.x = xk.data_ptr();
  p.dtype = high_precision_dtype(xk, "x");
  p.rows = rows;
  p.hidden = hidden;
  p.norm = norm_type(rms_norm);
  p.mean = mean ? mean_c.data_ptr<float>() : nullptr;
  p.rstd = rstd_c.data_ptr<float>();
  p.gamma = gamma32.data_ptr<float>();
  p.dx = dx.data_ptr();
  p.dx_add = addk.defined() ? addk.data_ptr() : nullptr;
  p.dgamma = dgamma.data_ptr<float>();
  p.dbeta = rms_norm ? nullptr : dbeta.data_ptr<float>();
  p.partial = partial.defined() ? partial.data_ptr<float>() : nullptr;
  run_on_device(
      x, [&] { norm_backward_cpu(p); }, [&](cudaStream_t s) { return norm_backward_cuda(p, s); });
  return {same_dtype ? dx : dx.to(x.scalar_type()), dgamma.to(gamma.scalar_type()),
          rms_norm ? at::empty({0}, gamma.options()) : dbeta.to(gamma.scalar_type())};
}

TORCH_LIBRARY_FRAGMENT(tpfp8, m) {
  m.def(
      "norm_cast(Tensor input, Tensor gamma, Tensor? beta, bool rms_norm, float eps, "
      "Tensor scale, Tensor(a!)? out, Tensor(b!)? rowwise, Tensor(c!)? columnwise, "
      "Tensor(d!)? amax, Tensor(e!)? scale_inv, Tensor(f!)? mean, Tensor(g!)? rstd, "
      "int fp8_format) -> ()");
  m.def(
      "norm_cast_current(Tensor input, Tensor gamma, Tensor? beta, bool rms_norm, float eps, "
      "Tensor(a!) amax, float scale_epsilon, Tensor(b!)? out, Tensor(c!)? rowwise, "
      "Tensor(d!)? columnwise, Tensor(e!)? scale_inv, Tensor(f!)? mean, Tensor(g!)? rstd, "
      "int fp8_format) -> ()");
  m.def(
      "norm_backward(Tensor dy, Tensor x, Tensor? mean, Tensor rstd, Tensor gamma, "
      "bool rms_norm, Tensor? dx_add=None) -> (Tensor, Tensor, Tensor)");
}

#define TPFP8_REGISTER_NORM_OPS(m)                 \
  m.impl("norm_cast", &norm_cast);                 \
  m.impl("norm_cast_current", &norm_cast_current); \
  m.impl("norm_backward", &norm_backward)

TORCH_LIBRARY_IMPL(tpfp8, CPU, m) { TPFP8_REGISTER_NORM_OPS(m); }
#if defined(TPFP8_WITH_CUDA)
TORCH_LIBRARY_IMPL(tpfp8, CUDA, m) { TPFP8_REGISTER_NORM_OPS(m); }
#endif

}  // namespace tpfp8
