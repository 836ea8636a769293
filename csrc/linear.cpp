// The Linear autograd Function (linear.h): a short list of steps in forward and backward,
// each a call into a named helper below.
#include "linear.h"

#include <torch/autograd.h>

#include "ops.h"

namespace tpfp8 {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kFp8Multiple = 16;  // FP8 GEMMs need K-major dimensions in multiples of 16

int64_t gemm_code(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 ? 1 : t.scalar_type() == at::kHalf ? 2 : 0;
}
int64_t gemm_code(Fp8Format f) { return f == Fp8Format::kE4M3 ? 3 : 4; }

// Column-wise FP8 data [rows, M] contracted over M in wgrad: zero codes pad M to a multiple
// of 16, which adds exact zeros to the sum. No copy when M is already aligned.
at::Tensor pad_contracted(const at::Tensor& t) {
  const int64_t pad = (kFp8Multiple - t.size(1) % kFp8Multiple) % kFp8Multiple;
  return pad == 0 ? t : at::constant_pad_nd(t, {0, pad}, 0);
}

at::Tensor fp8_gemm(const at::Tensor& a, const Fp8Tensor& qa, const at::Tensor& b,
                    const Fp8Tensor& qb, at::Tensor out, const OptTensor& bias, bool fast,
                    bool accumulate = false) {
  gemm(a, b, out, qa.scale_inv, qb.scale_inv, gemm_code(qa.format), gemm_code(qb.format), bias,
       accumulate, fast, false, false);
  return out;
}

void check_inputs(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                  const LinearOptions& o) {
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "Linear expects input [..., in_features=", k,
              "], got shape ", x.sizes(), "; the last dimension must be in_features");
  TORCH_CHECK(at::isFloatingType(x.scalar_type()) && x.scalar_type() != at::kDouble,
              "Linear input must be float32, bfloat16 or float16, got ", x.scalar_type());
  TORCH_CHECK(x.device() == weight.device(), "Linear input is on ", x.device(),
              " but its weight is on ", weight.device(), "; move the input (or the module)");
  TORCH_CHECK(!bias || bias->device() == weight.device(), "bias is on ", bias->device(),
              " but the weight on ", weight.device());
  if (o.fp8) {
    TORCH_CHECK(k % kFp8Multiple == 0 && n % kFp8Multiple == 0,
                "FP8 Linear needs in_features and out_features to be multiples of 16 (FP8 "
                "GEMMs on Hopper), got in_features=",
                k, ", out_features=", n, "; pad the layer or run it outside fp8_autocast");
    TORCH_CHECK(!(o.save_original_input && o.input.scaling == Scaling::kDelayed),
                "save_original_input=True cannot be used with delayed scaling: the scale moves "
                "between forward and backward, so re-quantizing would not reproduce the "
                "forward's FP8 input; use CurrentScaling or save_original_input=False");
    TORCH_CHECK(o.weight_cache != WeightCache::kReuse || o.weight_cache_rowwise.defined(),
                "is_first_microbatch=False needs a weight cached by an earlier call with "
                "is_first_microbatch=True");
  } else {
    TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "Linear input is ", x.scalar_type(),
                " but the weight is ", weight.scalar_type(), " (outside FP8 both must match)");
  }
  if (o.fuse_wgrad_accumulation) {
    TORCH_CHECK(o.main_grad.defined() && o.main_grad.scalar_type() == at::kFloat &&
                    o.main_grad.sizes() == weight.sizes(),
                "fuse_wgrad_accumulation needs weight.main_grad as float32 ", weight.sizes());
  }
}

Fp8Tensor weight_fp8(const at::Tensor& weight, const LinearOptions& o, bool columnwise) {
  const Fp8Tensor cache{o.weight_cache_rowwise, o.weight_cache_columnwise, o.weight_cache_scale_inv,
                        o.weight.format};
  if (o.weight_cache == WeightCache::kReuse) return cache;
  const bool fill = o.weight_cache == WeightCache::kFill;
  return quantize(weight.contiguous(), o.weight, true, columnwise || fill, fill ? &cache : nullptr);
}

// What backward needs beyond the tensors saved through save_for_backward.
struct Saved : torch::CustomClassHolder {
  LinearOptions o;
  std::vector<int64_t> x_shape;
  at::ScalarType x_dtype;
  std::optional<at::ScalarType> bias_dtype;
  Fp8Tensor qx, qw;  // column-wise parts only
};

struct LinearFunction : torch::autograd::Function<LinearFunction> {
  // grad_enabled: autograd turns grad mode off inside forward, so the caller's mode is passed
  // in; without it (inference) no column-wise data is made for a backward that never comes.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const OptTensor& bias, const LinearOptions& o, bool grad_enabled) {
    const int64_t n = weight.size(0), k = weight.size(1);
    const at::Tensor x2 = x.reshape({-1, k}).contiguous();
    auto s = c10::make_intrusive<Saved>();
    s->o = o;
    s->x_shape = x.sizes().vec();
    s->x_dtype = x.scalar_type();
    if (bias) s->bias_dtype = bias->scalar_type();
    const bool need_wgrad = grad_enabled && (weight.requires_grad() || o.fuse_wgrad_accumulation);
    const bool need_dgrad = grad_enabled && x.requires_grad();
    at::Tensor y = at::empty({x2.size(0), n}, x.options());
    if (!o.fp8) {
      gemm(x2, weight, y, std::nullopt, std::nullopt, gemm_code(x2), gemm_code(weight),
           bias ? OptTensor(bias->to(y.scalar_type())) : std::nullopt, false, false, false, false);
      ctx->save_for_backward({x2, weight});
    } else {
      const Fp8Tensor qx = quantize(x2, o.input, true, need_wgrad && !o.save_original_input);
      const Fp8Tensor qw = weight_fp8(weight, o, need_dgrad);
      // The FP8 epilogue adds a 16-bit bias; an fp32 output gets its bias added in fp32.
      const bool fuse_bias = bias && y.scalar_type() != at::kFloat;
      fp8_gemm(qx.rowwise, qx, qw.rowwise, qw, y,
               fuse_bias ? OptTensor(bias->to(y.scalar_type())) : std::nullopt, true);
      if (bias && !fuse_bias) y.add_(*bias);
      s->qx = {at::Tensor(), qx.columnwise, qx.scale_inv, qx.format};
      s->qw = {at::Tensor(), qw.columnwise, qw.scale_inv, qw.format};
      ctx->save_for_backward({o.save_original_input ? x2 : at::Tensor(), weight});
    }
    ctx->saved_data["state"] = c10::IValue::make_capsule(s);
    std::vector<int64_t> out_shape = s->x_shape;
    out_shape.back() = n;
    return y.view(out_shape);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = c10::static_intrusive_pointer_cast<Saved>(ctx->saved_data["state"].toCapsule());
    const LinearOptions& o = s->o;
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& weight = saved[1];
    const int64_t n = weight.size(0), k = weight.size(1);
    const at::Tensor dy = grads[0].reshape({-1, n}).contiguous();
    const bool need_dgrad = ctx->needs_input_grad(0);
    const bool need_wgrad = ctx->needs_input_grad(1) || o.fuse_wgrad_accumulation;
    at::Tensor dx, dw;
    at::Tensor dw_out =
        o.fuse_wgrad_accumulation ? o.main_grad : at::empty({n, k}, weight.options());
    const bool accumulate = o.fuse_wgrad_accumulation && !o.main_grad_overwrite;
    if (!o.fp8) {
      const at::Tensor& x2 = saved[0];
      if (need_dgrad) {
        dx = at::empty({dy.size(0), k}, dy.options().dtype(s->x_dtype));
        gemm(dy, weight, dx, std::nullopt, std::nullopt, gemm_code(dy), gemm_code(weight),
             std::nullopt, false, false, false, true);
      }
      if (need_wgrad) {
        gemm(dy, x2, dw_out, std::nullopt, std::nullopt, gemm_code(dy), gemm_code(x2), std::nullopt,
             accumulate, false, true, true);
      }
    } else {
      const Fp8Tensor qdy = quantize(dy, o.grad, need_dgrad, need_wgrad);
      if (need_dgrad) {
        dx = fp8_gemm(qdy.rowwise, qdy, s->qw.columnwise, s->qw,
                      at::empty({dy.size(0), k}, dy.options().dtype(s->x_dtype)), std::nullopt,
                      false);
      }
      if (need_wgrad) {
        const Fp8Tensor qx =
            o.save_original_input ? quantize(saved[0], o.input, false, true) : s->qx;
        fp8_gemm(pad_contracted(qdy.columnwise), qdy, pad_contracted(qx.columnwise), qx, dw_out,
                 std::nullopt, false, accumulate);
      }
    }
    if (need_wgrad && !o.fuse_wgrad_accumulation) dw = dw_out;
    at::Tensor db;
    if (s->bias_dtype && ctx->needs_input_grad(2)) {
      db = dy.sum(0, false, at::kFloat).to(*s->bias_dtype);
    }
    return {dx.defined() ? dx.view(s->x_shape) : dx, dw, db, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                  const LinearOptions& options) {
  check_inputs(x, weight, bias, options);
  return LinearFunction::apply(x, weight, bias, options, at::GradMode::is_enabled());
}

}  // namespace tpfp8
