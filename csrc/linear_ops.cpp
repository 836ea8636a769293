// The Linear's forward and backward as schema-first ops, torch.ops.tpfp8.linear_forward /
// linear_backward: tensors (the layer's FP8 state and caches among them, mutated in place as
// the schemas declare) and plain values only, so torch.compile traces a call as one node.
// The tensor-parallel group travels by name, as torch's functional collectives pass it.
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/library.h>

#include "backward_guard.h"
#include "linear.h"

namespace tpfp8 {
namespace {

thread_local bool forward_vetted = false;

using ForwardOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                  at::Tensor, at::Tensor, at::Tensor>;
using BackwardOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                   at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

bool in_compiled_backward() {
  const auto node = torch::autograd::get_current_node();
  return node && node->name() == "CompiledFunctionBackward";
}

ForwardOutputs forward_op(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                          const OptTensor& scale, const OptTensor& amax_history,
                          const OptTensor& cache_rowwise, const OptTensor& cache_columnwise,
                          const OptTensor& cache_scale_inv, const OptTensor& main_grad,
                          int64_t scaling, int64_t fwd_format, int64_t grad_format, double epsilon,
                          int64_t weight_cache, bool save_original_input, int64_t parallel_mode,
                          bool sequence_parallel, c10::string_view group_name,
                          at::IntArrayRef debug, bool need_dgrad, bool need_wgrad,
                          const OptTensor& prologue_weight, const OptTensor& prologue_bias,
                          int64_t prologue, double prologue_eps, bool keep_prologue_output,
                          const OptTensor& residual) {
  check_forward_outside_backward_or_vetted(amax_history.has_value());
  // Every check runs before any state (amax history, caches) is touched.
  const ForwardCall call = checked_forward_call(
      x, weight, bias, scale, amax_history, cache_rowwise, cache_columnwise, cache_scale_inv,
      main_grad, scaling, fwd_format, grad_format, epsilon, weight_cache, save_original_input,
      parallel_mode, sequence_parallel, std::string(group_name), debug, prologue_weight,
      prologue_bias, prologue, prologue_eps, residual);
  ForwardResult r = linear_forward(x, weight, bias, call.c, call.state, call.cache, need_dgrad,
                                   need_wgrad, call.prologue, keep_prologue_output, residual);
  return {r.y, r.x_fp8, r.x_scale_inv, r.w_fp8, r.w_scale_inv, r.x_hp, r.mean, r.rstd};
}

BackwardOutputs backward_op(
    const at::Tensor& dy, const OptTensor& x, const at::Tensor& x_fp8,
    const at::Tensor& x_scale_inv, const at::Tensor& weight, const at::Tensor& w_fp8,
    const at::Tensor& w_scale_inv, const OptTensor& scale, const OptTensor& grad_amax_history,
    const OptTensor& main_grad, bool main_grad_overwrite, int64_t scaling, int64_t fwd_format,
    int64_t grad_format, double epsilon, bool save_original_input, int64_t parallel_mode,
    bool sequence_parallel, c10::string_view group_name, at::IntArrayRef debug,
    c10::SymIntArrayRef x_shape, at::ScalarType x_dtype, std::optional<at::ScalarType> bias_dtype,
    bool need_dgrad, bool need_wgrad, const OptTensor& prologue_input,
    const OptTensor& prologue_weight, const OptTensor& prologue_bias, const OptTensor& mean,
    const OptTensor& rstd, int64_t prologue, const OptTensor& prologue_output_grad,
    const OptTensor& handoff_scale, const OptTensor& handoff_grad_amax_history,
    bool handoff_rowwise, bool handoff_columnwise, bool handoff_dbias, const OptTensor& dy_rowwise,
    const OptTensor& dy_columnwise, const OptTensor& dy_scale_inv, const OptTensor& dy_dbias,
    const OptTensor& input_grad) {
  const LinearConfig c =
      linear_config(scaling, fwd_format, grad_format, epsilon, 0, save_original_input,
                    parallel_mode, sequence_parallel, std::string(group_name), debug);
  const DelayedState state{
      scale.value_or(at::Tensor()), {}, grad_amax_history.value_or(at::Tensor())};
  SavedForBackward saved{
      x, x_fp8, x_scale_inv, w_fp8, w_scale_inv, C10_AS_INTARRAYREF_SLOW(x_shape).vec(), x_dtype};
  saved.prologue = prologue_args(prologue, prologue_weight, prologue_bias, 0.0);
  if (saved.prologue.any()) {
    TORCH_CHECK_VALUE(prologue_input.has_value(), "a prologue's backward needs its input");
    saved.prologue_input = *prologue_input;
    saved.stats = {mean.value_or(at::Tensor()), rstd.value_or(at::Tensor())};
    saved.prologue_output_grad = prologue_output_grad.value_or(at::Tensor());
  }
  if (input_grad) {
    TORCH_CHECK_VALUE(saved.prologue.norm() && need_dgrad,
                      "input_grad (a skip connection's gradient) is added in a norm prologue's "
                      "backward: it needs prologue LayerNorm or RMSNorm and need_dgrad=True");
    TORCH_CHECK_VALUE(input_grad->sizes() == saved.prologue_input.sizes() &&
                          input_grad->scalar_type() == saved.prologue_input.scalar_type(),
                      "input_grad must be ", saved.prologue_input.scalar_type(),
                      " of the prologue input's shape ", saved.prologue_input.sizes(), ", got ",
                      input_grad->scalar_type(), " of shape ", input_grad->sizes());
    saved.input_grad = *input_grad;
  }
  GradHandoff handoff{
      {handoff_scale.value_or(at::Tensor()), {}, handoff_grad_amax_history.value_or(at::Tensor())},
      handoff_rowwise,
      handoff_columnwise,
      handoff_dbias};
  Fp8Tensor handed;
  if (dy_scale_inv) {
    handed = {dy_rowwise.value_or(at::Tensor()), dy_columnwise.value_or(at::Tensor()),
              *dy_scale_inv, c.grad_format};
    TORCH_CHECK_VALUE(
        (!need_dgrad || handed.rowwise.defined()) && (!need_wgrad || handed.columnwise.defined()),
        "an FP8 dy needs its row-wise data for dgrad and column-wise for wgrad");
    handoff.dy = &handed;
    handoff.dy_dbias = dy_dbias.value_or(at::Tensor());
  }
  const Grads g = linear_backward(dy, saved, weight, c, state, main_grad, main_grad_overwrite,
                                  need_dgrad, need_wgrad, bias_dtype, handoff);
  return {g.dx,
          g.dw,
          g.db,
          g.dprologue_weight,
          g.dprologue_bias,
          g.dx_fp8.rowwise,
          g.dx_fp8.columnwise,
          g.dx_fp8.scale_inv,
          g.dx_dbias};
}

// The ops' kernel for the Autograd key: the op itself, called below autograd. Only
// torch.ops.tpfp8.linear / mlp (linear_autograd.cpp) differentiate these ops, calling them with
// grad mode off; a direct call that autograd would have to record is refused. (Without this
// kernel torch's fallback for ops without autograd runs, which boxes every argument on each
// call -- ~4 us of host time a call on the H200, session 30 -- and only warns at backward.)
bool differentiable(const at::Tensor& t) { return t.defined() && t.requires_grad(); }
bool differentiable(const OptTensor& t) { return t && differentiable(*t); }
template <class T>
bool differentiable(const T&) {
  return false;
}

template <class Signature, const char* kName>
struct BelowAutograd;
template <class Ret, class... Args, const char* kName>
struct BelowAutograd<Ret(Args...), kName> {
  static Ret call(Args... args) {
    static const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow(kName, "").typed<Ret(Args...)>();
    TORCH_CHECK(!at::GradMode::is_enabled() || !(differentiable(args) || ...), kName,
                " has no derivative of its own, and a tensor given to it requires grad: call it "
                "under torch.no_grad() (or with detached tensors), or differentiate "
                "torch.ops.tpfp8.linear, which runs it with its backward");
    const at::AutoDispatchBelowADInplaceOrView below;
    return op.call(args...);
  }
};
constexpr char kForwardName[] = "tpfp8::linear_forward";
constexpr char kBackwardName[] = "tpfp8::linear_backward";

}  // namespace

ForwardCall checked_forward_call(const at::Tensor& x, const at::Tensor& weight,
                                 const OptTensor& bias, const OptTensor& scale,
                                 const OptTensor& amax_history, const OptTensor& cache_rowwise,
                                 const OptTensor& cache_columnwise,
                                 const OptTensor& cache_scale_inv, const OptTensor& main_grad,
                                 int64_t scaling, int64_t fwd_format, int64_t grad_format,
                                 double epsilon, int64_t weight_cache, bool save_original_input,
                                 int64_t parallel_mode, bool sequence_parallel,
                                 const std::string& group_name, at::IntArrayRef debug,
                                 const OptTensor& prologue_weight, const OptTensor& prologue_bias,
                                 int64_t prologue, double prologue_eps, const OptTensor& residual) {
  ForwardCall call{
      linear_config(scaling, fwd_format, grad_format, epsilon, weight_cache, save_original_input,
                    parallel_mode, sequence_parallel, group_name, debug),
      {scale.value_or(at::Tensor()), amax_history.value_or(at::Tensor()), {}},
      {cache_rowwise.value_or(at::Tensor()), cache_columnwise.value_or(at::Tensor()),
       cache_scale_inv.value_or(at::Tensor())},
      prologue_args(prologue, prologue_weight, prologue_bias, prologue_eps)};
  check_inputs(x, weight, bias, call.c, call.state, call.cache, main_grad, call.prologue, residual);
  return call;
}

void set_forward_vetted(bool vetted) { forward_vetted = vetted; }

void check_forward_outside_backward_or_vetted(bool records_amax) {
  // (A compiled backward's own recomputes never repeat an op that records its amax: it mutates.)
  TORCH_CHECK(forward_vetted || torch::autograd::get_current_graph_task_id() == -1 ||
                  (in_compiled_backward() && !records_amax),
              "a tpfp8.Linear forward ran inside a backward pass where tpfp8 could not check "
              "which forward it repeats: an eager activation checkpoint recomputes a "
              "torch.compile'd layer or function, whose compiled code repeats what it was "
              "traced with, not the forward's recipe and scales. Compile the model around its "
              "checkpoints instead (torch.compile(model); with delayed scaling "
              "fullgraph=False, where torch runs each checkpoint eagerly), or leave the "
              "checkpointed code uncompiled");
}

TORCH_LIBRARY_FRAGMENT(tpfp8, m) {
  m.def(
      "linear_forward(Tensor x, Tensor weight, Tensor? bias, Tensor? scale, "
      "Tensor(a!)? amax_history, Tensor(b!)? weight_cache_rowwise, "
      "Tensor(c!)? weight_cache_columnwise, Tensor(d!)? weight_cache_scale_inv, "
      "Tensor? main_grad, int scaling, int fwd_format, int grad_format, float epsilon, "
      "int weight_cache, bool save_original_input, int parallel_mode, bool sequence_parallel, "
      "str group_name, int[] debug, bool need_dgrad, bool need_wgrad, "
      "Tensor? prologue_weight=None, Tensor? prologue_bias=None, int prologue=0, "
      "float prologue_eps=0.0, bool keep_prologue_output=False, Tensor? residual=None) "
      "-> (Tensor y, Tensor x_fp8, Tensor x_scale_inv, Tensor w_fp8, Tensor w_scale_inv, "
      "Tensor x_hp, Tensor mean, Tensor rstd)");
  m.def(
      "linear_backward(Tensor dy, Tensor? x, Tensor x_fp8, Tensor x_scale_inv, Tensor weight, "
      "Tensor w_fp8, Tensor w_scale_inv, Tensor? scale, Tensor(a!)? grad_amax_history, "
      "Tensor(b!)? main_grad, bool main_grad_overwrite, int scaling, int fwd_format, "
      "int grad_format, float epsilon, bool save_original_input, int parallel_mode, "
      "bool sequence_parallel, str group_name, int[] debug, SymInt[] x_shape, "
      "ScalarType x_dtype, ScalarType? bias_dtype, bool need_dgrad, bool need_wgrad, "
      "Tensor? prologue_input=None, Tensor? prologue_weight=None, Tensor? prologue_bias=None, "
      "Tensor? mean=None, Tensor? rstd=None, int prologue=0, Tensor? prologue_output_grad=None, "
      "Tensor? handoff_scale=None, Tensor(c!)? handoff_grad_amax_history=None, "
      "bool handoff_rowwise=False, bool handoff_columnwise=False, bool handoff_dbias=False, "
      "Tensor? dy_rowwise=None, Tensor? dy_columnwise=None, Tensor? dy_scale_inv=None, "
      "Tensor? dy_dbias=None, Tensor? input_grad=None) "
      "-> (Tensor dx, Tensor dw, Tensor db, Tensor dprologue_weight, Tensor dprologue_bias, "
      "Tensor dx_rowwise, Tensor dx_columnwise, Tensor dx_scale_inv, Tensor dx_dbias)");
}

TORCH_LIBRARY_IMPL(tpfp8, CPU, m) {
  m.impl("linear_forward", &forward_op);
  m.impl("linear_backward", &backward_op);
}
#if defined(TPFP8_WITH_CUDA)
TORCH_LIBRARY_IMPL(tpfp8, CUDA, m) {
  m.impl("linear_forward", &forward_op);
  m.impl("linear_backward", &backward_op);
}
#endif
TORCH_LIBRARY_IMPL(tpfp8, Autograd, m) {
  m.impl("linear_forward", &BelowAutograd<decltype(forward_op), kForwardName>::call);
  m.impl("linear_backward", &BelowAutograd<decltype(backward_op), kBackwardName>::call);
}

}  // namespace tpfp8
