// The Linear as one op, torch.ops.tpfp8.linear, with its autograd registered here in C++: a
// torch::autograd::Function over linear_forward / linear_backward, which it calls through the
// dispatcher, so torch.compile traces those two (and their fake kernels) into the forward and
// backward graphs. Eager, a call crosses from Python to C++ once and backward not at all.
#include <torch/autograd.h>
#include <torch/library.h>

#include "linear.h"

namespace tpfp8 {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using ForwardOp = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                             at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&, const OptTensor&,
    const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&, int64_t, int64_t,
    int64_t, double, int64_t, bool, int64_t, bool, c10::string_view, at::IntArrayRef, bool, bool,
    const OptTensor&, const OptTensor&, int64_t, double, bool);
using BackwardOp = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const OptTensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&, const OptTensor&,
    bool, int64_t, int64_t, int64_t, double, bool, int64_t, bool, c10::string_view, at::IntArrayRef,
    c10::SymIntArrayRef, at::ScalarType, std::optional<at::ScalarType>, bool, bool,
    const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&,
    int64_t, const OptTensor&);

const c10::TypedOperatorHandle<ForwardOp>& forward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("tpfp8::linear_forward", "")
                             .typed<ForwardOp>();
  return op;
}
const c10::TypedOperatorHandle<BackwardOp>& backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("tpfp8::linear_backward", "")
                             .typed<BackwardOp>();
  return op;
}

// The op's plain values, as backward needs them again.
struct Config {
  int64_t scaling, fwd_format, grad_format, weight_cache, parallel_mode;
  double epsilon;
  bool save_original_input, sequence_parallel, main_grad_overwrite, saves_input;
  std::string group_name;
  std::vector<int64_t> debug;
  int64_t prologue = 0;  // (a fused module's norm or activation, prologue.h)
  double prologue_eps = 0.0;
  bool keep_prologue_output = false;
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
           at::Tensor>
run_forward(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
            const OptTensor& scale, const OptTensor& amax_history, const OptTensor& replay,
            const OptTensor& cache_rowwise, const OptTensor& cache_columnwise,
            const OptTensor& cache_scale_inv, const OptTensor& main_grad,
            const OptTensor& prologue_weight, const OptTensor& prologue_bias, const Config& c,
            bool need_dgrad, bool need_wgrad) {
  // A checkpoint's recompute casts with its first forward's scales and records no amax.
  return forward_op().call(
      x, weight, bias, replay ? replay : scale, replay ? OptTensor() : amax_history, cache_rowwise,
      cache_columnwise, cache_scale_inv, main_grad, c.scaling, c.fwd_format, c.grad_format,
      c.epsilon, c.weight_cache, c.save_original_input, c.parallel_mode, c.sequence_parallel,
      c.group_name, c.debug, need_dgrad, need_wgrad, prologue_weight, prologue_bias, c.prologue,
      c.prologue_eps, c.keep_prologue_output);
}

struct Saved : torch::CustomClassHolder {
  Config c;
  OptTensor scale, grad_amax_history, main_grad, prologue_bias;
  std::vector<c10::SymInt> x_shape;
  at::ScalarType x_dtype;
  std::optional<at::ScalarType> bias_dtype;
  bool need_dx = false, need_dw = false, need_db = false;  // (optional inputs shift indices)
  bool need_dprologue_weight = false, need_dprologue_bias = false;
  bool need_dgrad() const { return need_dx || need_dprologue_weight || need_dprologue_bias; }
};

constexpr size_t kInputs = 16;  // forward's arguments after ctx: a gradient (or none) each
constexpr size_t kPrologueWeight = 11, kPrologueBias = 12;  // (their indices among them)

// What forward saves, by position: the high-precision input of the GEMMs (or nothing), the FP8
// input and weight, the weight, and a prologue's input, weight and statistics.
enum SavedIndex : size_t {
  kX,
  kXFp8,
  kXScaleInv,
  kWeight,
  kWFp8,
  kWScaleInv,
  kPrologueInput,
  kPrologueWeightSaved,
  kMean,
  kRstd
};

OptTensor saved_or_none(const variable_list& saved, size_t i, bool wanted = true) {
  return wanted && saved[i].defined() ? OptTensor(saved[i]) : std::nullopt;
}

struct LinearAutograd : torch::autograd::Function<LinearAutograd> {
  // (y, the prologue's output where asked for, else empty)
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                               const OptTensor& bias, const OptTensor& scale,
                               const OptTensor& amax_history, const OptTensor& grad_amax_history,
                               const OptTensor& replay, const OptTensor& cache_rowwise,
                               const OptTensor& cache_columnwise, const OptTensor& cache_scale_inv,
                               const OptTensor& main_grad, const OptTensor& prologue_weight,
                               const OptTensor& prologue_bias, Config c, bool need_dgrad,
                               bool need_wgrad) {
    auto [y, x_fp8, x_scale_inv, w_fp8, w_scale_inv, x_hp, mean, rstd] = run_forward(
        x, weight, bias, scale, amax_history, replay, cache_rowwise, cache_columnwise,
        cache_scale_inv, main_grad, prologue_weight, prologue_bias, c, need_dgrad, need_wgrad);
    if (c.weight_cache != 0) {  // the cache is backward's FP8 weight
      w_fp8 = *cache_columnwise;
      w_scale_inv = *cache_scale_inv;
    }
    const bool prologue = c.prologue != 0;
    const at::Tensor gemm_input = prologue ? x_hp : x;
    ctx->save_for_backward({c.saves_input ? gemm_input : at::Tensor(), x_fp8, x_scale_inv, weight,
                            w_fp8, w_scale_inv, prologue ? x : at::Tensor(),
                            prologue_weight.value_or(at::Tensor()), mean, rstd});
    auto s = c10::make_intrusive<Saved>();
    s->scale = scale;
    s->grad_amax_history = grad_amax_history;
    s->main_grad = main_grad;
    s->prologue_bias = prologue_bias;
    if (prologue) {  // (the GEMMs' input is the prologue's output: in_features wide)
      s->x_shape = x.sym_sizes().vec();
      s->x_shape.back() = weight.sym_size(1);
    } else {
      s->x_shape = x.sym_sizes().vec();
    }
    s->x_dtype = x.scalar_type();
    if (bias) s->bias_dtype = bias->scalar_type();
    s->need_dx = x.requires_grad();
    s->need_dw = weight.requires_grad();
    s->need_db = bias && bias->requires_grad();
    s->need_dprologue_weight = prologue_weight && prologue_weight->requires_grad();
    s->need_dprologue_bias = prologue_bias && prologue_bias->requires_grad();
    if (!c.keep_prologue_output) ctx->mark_non_differentiable({x_hp});
    s->c = std::move(c);
    ctx->saved_data["s"] = c10::IValue::make_capsule(s);
    return {y, x_hp};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = c10::static_intrusive_pointer_cast<Saved>(ctx->saved_data["s"].toCapsule());
    const auto saved = ctx->get_saved_variables();
    const Config& c = s->c;
    // Grad mode on inside backward means create_graph=True (double backward).
    if (at::GradMode::is_enabled()) return differentiable_backward(grads[0], saved, *s);
    const OptTensor output_grad =
        c.keep_prologue_output && grads[1].defined() ? OptTensor(grads[1]) : std::nullopt;
    auto [dx, dw, db, dpw, dpb] = backward_op().call(
        grads[0], saved_or_none(saved, kX), saved[kXFp8], saved[kXScaleInv], saved[kWeight],
        saved[kWFp8], saved[kWScaleInv], s->scale, s->grad_amax_history, s->main_grad,
        c.main_grad_overwrite, c.scaling, c.fwd_format, c.grad_format, c.epsilon,
        c.save_original_input, c.parallel_mode, c.sequence_parallel, c.group_name, c.debug,
        s->x_shape, s->x_dtype, s->need_db ? s->bias_dtype : std::nullopt, s->need_dgrad(),
        s->need_dw || s->main_grad.has_value(), saved_or_none(saved, kPrologueInput),
        saved_or_none(saved, kPrologueWeightSaved), s->prologue_bias,
        saved_or_none(saved, kMean, c.prologue == static_cast<int64_t>(Prologue::kLayerNorm)),
        saved_or_none(saved, kRstd, prologue_args(c.prologue, {}, {}, 0.0).norm()), c.prologue,
        output_grad);
    variable_list out(kInputs);
    if (s->need_dx) out[0] = dx;
    if (s->need_dw && !s->main_grad) out[1] = dw;
    if (s->need_db) out[2] = db;
    if (s->need_dprologue_weight) out[kPrologueWeight] = dpw;
    if (s->need_dprologue_bias) out[kPrologueBias] = dpb;
    return out;
  }

 private:
  static variable_list differentiable_backward(const at::Tensor& dy, const variable_list& saved,
                                               const Saved& s);
};

// The backward as differentiable torch ops, for gradients of gradients (a gradient penalty): high
// precision on one device only -- an FP8 cast has no useful derivative, and the collectives are
// not differentiable -- and a clear error otherwise, never a silently detached dx.
variable_list LinearAutograd::differentiable_backward(const at::Tensor& dy,
                                                      const variable_list& saved, const Saved& s) {
  const Config& c = s.c;
  TORCH_CHECK(c.scaling == 0 && c.parallel_mode == 0 && !s.main_grad && c.prologue == 0,
              "tpfp8.Linear supports double backward (create_graph=True) only in high "
              "precision on one device without fuse_wgrad_accumulation, and not in the fused "
              "modules; this call used ",
              c.scaling != 0         ? "FP8"
              : c.parallel_mode != 0 ? "tensor parallelism"
              : c.prologue != 0      ? "a fused norm or activation"
                                     : "fuse_wgrad_accumulation",
              ". Run the layer outside fp8_autocast (and unsplit) for a gradient penalty");
  const at::Tensor &x = saved[0], &weight = saved[3];
  const at::Tensor dy2 = dy.reshape({-1, weight.size(0)});
  variable_list out(kInputs);
  if (s.need_dx) out[0] = dy2.mm(weight).to(s.x_dtype).view_symint(s.x_shape);
  if (s.need_dw) out[1] = dy2.t().mm(x.reshape({-1, weight.size(1)})).to(weight.scalar_type());
  if (s.need_db) out[2] = dy2.sum(0).to(*s.bias_dtype);
  return out;
}

// The op's kernel: with autograd (the Autograd key) or without (inference mode: the forward op).
template <bool kAutograd>
std::tuple<at::Tensor, at::Tensor> linear_kernel(
    const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias, const OptTensor& scale,
    const OptTensor& amax_history, const OptTensor& grad_amax_history, const OptTensor& replay,
    const OptTensor& cache_rowwise, const OptTensor& cache_columnwise,
    const OptTensor& cache_scale_inv, const OptTensor& main_grad, int64_t scaling,
    int64_t fwd_format, int64_t grad_format, double epsilon, int64_t weight_cache,
    bool save_original_input, int64_t parallel_mode, bool sequence_parallel,
    c10::string_view group_name, at::IntArrayRef debug, bool main_grad_overwrite, bool saves_input,
    bool need_dgrad, bool need_wgrad, const OptTensor& prologue_weight,
    const OptTensor& prologue_bias, int64_t prologue, double prologue_eps,
    bool keep_prologue_output) {
  Config c{scaling,
           fwd_format,
           grad_format,
           weight_cache,
           parallel_mode,
           epsilon,
           save_original_input,
           sequence_parallel,
           main_grad_overwrite,
           saves_input,
           std::string(group_name),
           debug.vec(),
           prologue,
           prologue_eps,
           keep_prologue_output};
  if constexpr (kAutograd) {
    const variable_list y =
        LinearAutograd::apply(x, weight, bias, scale, amax_history, grad_amax_history, replay,
                              cache_rowwise, cache_columnwise, cache_scale_inv, main_grad,
                              prologue_weight, prologue_bias, std::move(c), need_dgrad, need_wgrad);
    return {y[0], y[1]};
  }
  const auto r =
      run_forward(x, weight, bias, scale, amax_history, replay, cache_rowwise, cache_columnwise,
                  cache_scale_inv, main_grad, prologue_weight, prologue_bias, c, false, false);
  return {std::get<0>(r), std::get<5>(r)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tpfp8, m) {
  m.def(
      "linear(Tensor x, Tensor weight, Tensor? bias, Tensor? scale, Tensor(a!)? amax_history, "
      "Tensor(b!)? grad_amax_history, Tensor? replay, Tensor(c!)? weight_cache_rowwise, "
      "Tensor(d!)? weight_cache_columnwise, Tensor(e!)? weight_cache_scale_inv, "
      "Tensor(f!)? main_grad, int scaling, int fwd_format, int grad_format, float epsilon, "
      "int weight_cache, bool save_original_input, int parallel_mode, bool sequence_parallel, "
      "str group_name, int[] debug, bool main_grad_overwrite, bool saves_input, "
      "bool need_dgrad, bool need_wgrad, Tensor? prologue_weight=None, "
      "Tensor? prologue_bias=None, int prologue=0, float prologue_eps=0.0, "
      "bool keep_prologue_output=False) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tpfp8, Autograd, m) { m.impl("linear", &linear_kernel<true>); }
TORCH_LIBRARY_IMPL(tpfp8, CPU, m) { m.impl("linear", &linear_kernel<false>); }
#if defined(TPFP8_WITH_CUDA)
TORCH_LIBRARY_IMPL(tpfp8, CUDA, m) { m.impl("linear", &linear_kernel<false>); }
#endif

}  // namespace tpfp8
