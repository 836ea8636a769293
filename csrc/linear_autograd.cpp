// The Linear as one op, torch.ops.tpfp8.linear, and LayerNormMLP's two Linears as one,
// torch.ops.tpfp8.mlp, with their autograd registered here in C++: torch::autograd::Functions
// over linear_forward / linear_backward, which they call through the dispatcher, so
// torch.compile traces those two (and their fake kernels) into the forward and backward graphs.
// Eager, a call crosses from Python to C++ once and backward not at all.
//
// The MLP is one op so that its backward can hand fc1 its gradient in FP8: fc2's backward casts
// the activation's input gradient in the activation backward's own pass, with fc1's gradient
// quantizer (GradHandoff, linear.h), with its column sums where fc1 has a bias, instead of
// writing it in high precision for fc1 to read and cast again. Two autograd nodes could only
// pass fc1 a high-precision tensor.
#include <torch/autograd.h>
#include <torch/library.h>

#include <array>

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
    const OptTensor&, const OptTensor&, int64_t, double, bool, const OptTensor&);
using BackwardOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                   at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using BackwardOp = BackwardOutputs(
    const at::Tensor&, const OptTensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&, const OptTensor&,
    bool, int64_t, int64_t, int64_t, double, bool, int64_t, bool, c10::string_view, at::IntArrayRef,
    c10::SymIntArrayRef, at::ScalarType, std::optional<at::ScalarType>, bool, bool,
    const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&,
    int64_t, const OptTensor&, const OptTensor&, const OptTensor&, bool, bool, bool,
    const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&);

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

// A layer's plain values, as backward needs them again.
struct Config {
  int64_t scaling, fwd_format, grad_format, weight_cache, parallel_mode;
  double epsilon;
  bool save_original_input, sequence_parallel, main_grad_overwrite, saves_input;
  std::string group_name;
  std::vector<int64_t> debug;
  bool need_dgrad, need_wgrad;
  int64_t prologue = 0;  // (a fused module's norm or activation, prologue.h)
  double prologue_eps = 0.0;
  bool keep_prologue_output = false;
  Prologue prologue_kind() const { return static_cast<Prologue>(prologue); }
  bool norm() const { return is_norm(prologue_kind()); }
};

// A layer's differentiable tensors.
struct Params {
  at::Tensor weight;
  OptTensor bias, prologue_weight, prologue_bias;
};
// A layer's FP8 state and caches (mutated in place, never differentiated) and its values.
struct Layer {
  OptTensor scale, amax_history, grad_amax_history, replay, cache_rowwise, cache_columnwise,
      cache_scale_inv, main_grad;
  Config c;
};

// One layer's arguments after its input, as `linear` takes them (`mlp` takes two such lists):
// the schema text, with `prefix` on each name and `alias` the letters of its mutated tensors.
constexpr size_t kLayerArgs = 29;
std::string layer_schema(const std::string& p, const std::string& alias, bool defaults) {
  const auto mut = [&](size_t i) { return "Tensor(" + alias.substr(i, 1) + "!)? " + p; };
  const auto d = [defaults](const char* value) { return defaults ? std::string(value) : ""; };
  return "Tensor " + p + "weight, Tensor? " + p + "bias, Tensor? " + p + "scale, " + mut(0) +
         "amax_history, " + mut(1) + "grad_amax_history, Tensor? " + p + "replay, " + mut(2) +
         "weight_cache_rowwise, " + mut(3) + "weight_cache_columnwise, " + mut(4) +
         "weight_cache_scale_inv, " + mut(5) + "main_grad, int " + p + "scaling, int " + p +
         "fwd_format, int " + p + "grad_format, float " + p + "epsilon, int " + p +
         "weight_cache, bool " + p + "save_original_input, int " + p + "parallel_mode, bool " + p +
         "sequence_parallel, str " + p + "group_name, int[] " + p + "debug, bool " + p +
         "main_grad_overwrite, bool " + p + "saves_input, bool " + p + "need_dgrad, bool " + p +
         "need_wgrad, Tensor? " + p + "prologue_weight" + d("=None") + ", Tensor? " + p +
         "prologue_bias" + d("=None") + ", int " + p + "prologue" + d("=0") + ", float " + p +
         "prologue_eps" + d("=0.0") + ", bool " + p + "keep_prologue_output" + d("=False");
}

OptTensor optional_tensor(const c10::IValue& v) { return v.toOptional<at::Tensor>(); }

// The layer whose arguments start at stack[i] (layer_schema's order).
std::pair<Params, Layer> parse_layer(const torch::jit::Stack& stack, size_t i) {
  const auto t = [&](size_t j) { return optional_tensor(stack[i + j]); };
  Params p{stack[i].toTensor(), t(1), t(24), t(25)};
  Layer l{t(2), t(3), t(4), t(5), t(6), t(7), t(8), t(9), {}};
  Config& c = l.c;
  c.scaling = stack[i + 10].toInt();
  c.fwd_format = stack[i + 11].toInt();
  c.grad_format = stack[i + 12].toInt();
  c.epsilon = stack[i + 13].toDouble();
  c.weight_cache = stack[i + 14].toInt();
  c.save_original_input = stack[i + 15].toBool();
  c.parallel_mode = stack[i + 16].toInt();
  c.sequence_parallel = stack[i + 17].toBool();
  c.group_name = stack[i + 18].toStringRef();
  c.debug = stack[i + 19].toIntVector();
  c.main_grad_overwrite = stack[i + 20].toBool();
  c.saves_input = stack[i + 21].toBool();
  c.need_dgrad = stack[i + 22].toBool();
  c.need_wgrad = stack[i + 23].toBool();
  c.prologue = stack[i + 26].toInt();
  c.prologue_eps = stack[i + 27].toDouble();
  c.keep_prologue_output = stack[i + 28].toBool();
  return {std::move(p), std::move(l)};
}

using ForwardOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                  at::Tensor, at::Tensor, at::Tensor>;
ForwardOutputs run_forward(const at::Tensor& x, const Params& p, const Layer& l,
                           const OptTensor& residual = std::nullopt) {
  const Config& c = l.c;
  // A checkpoint's recompute casts with its first forward's scales and records no amax.
  return forward_op().call(
      x, p.weight, p.bias, l.replay ? l.replay : l.scale, l.replay ? OptTensor() : l.amax_history,
      l.cache_rowwise, l.cache_columnwise, l.cache_scale_inv, l.main_grad, c.scaling, c.fwd_format,
      c.grad_format, c.epsilon, c.weight_cache, c.save_original_input, c.parallel_mode,
      c.sequence_parallel, c.group_name, c.debug, c.need_dgrad, c.need_wgrad, p.prologue_weight,
      p.prologue_bias, c.prologue, c.prologue_eps, c.keep_prologue_output, residual);
}

// A layer's arguments checked as its forward op checks them, before anything runs.
ForwardCall checked(const at::Tensor& x, const Params& p, const Layer& l,
                    const OptTensor& residual = std::nullopt) {
  const Config& c = l.c;
  return checked_forward_call(
      x, p.weight, p.bias, l.replay ? l.replay : l.scale, l.replay ? OptTensor() : l.amax_history,
      l.cache_rowwise, l.cache_columnwise, l.cache_scale_inv, l.main_grad, c.scaling, c.fwd_format,
      c.grad_format, c.epsilon, c.weight_cache, c.save_original_input, c.parallel_mode,
      c.sequence_parallel, c.group_name, c.debug, p.prologue_weight, p.prologue_bias, c.prologue,
      c.prologue_eps, residual);
}

// Both layers of an MLP checked before fc1 runs, fc2 against a stand-in for fc1's output (its
// shape, dtype and device: a stride-0 view of x): a call that fc2 rejects leaves fc1's state
// (the amax its cast records) as it was.
// (Traced with symbolic shapes, the fake kernels check the two in turn, and nothing is written.)
void check_mlp(const at::Tensor& x, const Params& p1, const Layer& l1, const Params& p2,
               const Layer& l2, const OptTensor& residual) {
  if (x.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) return;
  const ForwardCall first = checked(x, p1, l1);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = p1.weight.size(0);
  shape.front() = output_dim0(shape.front(), first.c);
  checked(x.detach().as_strided(shape, std::vector<int64_t>(shape.size(), 0)), p2, l2, residual);
}

struct Saved : torch::CustomClassHolder {
  Config c;
  OptTensor scale, grad_amax_history, main_grad, prologue_bias;
  std::vector<c10::SymInt> x_shape, y_shape;
  at::TensorOptions y_options;
  at::ScalarType x_dtype;
  std::optional<at::ScalarType> bias_dtype;
  bool need_dx = false, need_dw = false, need_db = false;
  bool need_dprologue_weight = false, need_dprologue_bias = false;
  bool need_dgrad() const { return need_dx || need_dprologue_weight || need_dprologue_bias; }
  bool need_wgrad() const { return need_dw || main_grad.has_value(); }
};

// What a layer's forward saves, by position: the high-precision input of the GEMMs (or
// nothing), the FP8 input and weight, the weight, and a prologue's input, weight and statistics.
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
  kRstd,
  kSavedPerLayer
};

// A layer's forward: its outputs (y, the prologue's output or empty), and what its backward
// needs, appended to `to_save`. `need_dx`: whether its input's gradient will be asked for.
struct LayerForward {
  at::Tensor y, x_hp;
  c10::intrusive_ptr<Saved> s;
};
LayerForward layer_forward(const at::Tensor& x, const Params& p, const Layer& l, bool need_dx,
                           std::vector<at::Tensor>& to_save,
                           const OptTensor& residual = std::nullopt) {
  auto [y, x_fp8, x_scale_inv, w_fp8, w_scale_inv, x_hp, mean, rstd] =
      run_forward(x, p, l, residual);
  const Config& c = l.c;
  if (c.weight_cache != 0) {  // the cache is backward's FP8 weight
    w_fp8 = *l.cache_columnwise;
    w_scale_inv = *l.cache_scale_inv;
  }
  const bool prologue = c.prologue != 0;
  const at::Tensor gemm_input = prologue ? x_hp : x;
  to_save.insert(to_save.end(), {c.saves_input ? gemm_input : at::Tensor(), x_fp8, x_scale_inv,
                                 p.weight, w_fp8, w_scale_inv, prologue ? x : at::Tensor(),
                                 p.prologue_weight.value_or(at::Tensor()), mean, rstd});
  auto s = c10::make_intrusive<Saved>();
  s->scale = l.scale;  // (backward casts dy with today's gradient scale)
  s->grad_amax_history = l.grad_amax_history;
  s->main_grad = l.main_grad;
  s->prologue_bias = p.prologue_bias;
  s->x_shape = x.sym_sizes().vec();
  if (prologue) s->x_shape.back() = p.weight.sym_size(1);  // (the GEMMs' input: in_features)
  s->x_dtype = x.scalar_type();
  s->y_shape = y.sym_sizes().vec();
  s->y_options = y.options();
  if (p.bias) s->bias_dtype = p.bias->scalar_type();
  s->need_dx = need_dx;
  s->need_dw = p.weight.requires_grad();
  s->need_db = p.bias && p.bias->requires_grad();
  s->need_dprologue_weight = p.prologue_weight && p.prologue_weight->requires_grad();
  s->need_dprologue_bias = p.prologue_bias && p.prologue_bias->requires_grad();
  s->c = c;
  return {y, x_hp, s};
}

OptTensor saved_or_none(const variable_list& saved, size_t i, bool wanted = true) {
  return wanted && saved[i].defined() ? OptTensor(saved[i]) : std::nullopt;
}

// What a layer's backward gives to (the MLP's fc2) or takes from (fc1) the FP8 handoff.
struct Handoff {
  OptTensor scale, grad_amax_history;
  bool rowwise = false, columnwise = false, dbias = false;
  OptTensor dy_rowwise, dy_columnwise, dy_scale_inv, dy_dbias;
};

// A layer's backward from `saved` (its kSavedPerLayer tensors from `first` on).
BackwardOutputs layer_backward(const at::Tensor& dy, const variable_list& saved, size_t first,
                               const Saved& s, const OptTensor& output_grad, const Handoff& h = {},
                               const OptTensor& input_grad = std::nullopt) {
  const Config& c = s.c;
  const auto at = [&](size_t i, bool wanted = true) {
    return saved_or_none(saved, first + i, wanted);
  };
  return backward_op().call(
      dy, at(kX), saved[first + kXFp8], saved[first + kXScaleInv], saved[first + kWeight],
      saved[first + kWFp8], saved[first + kWScaleInv], s.scale, s.grad_amax_history, s.main_grad,
      c.main_grad_overwrite, c.scaling, c.fwd_format, c.grad_format, c.epsilon,
      c.save_original_input, c.parallel_mode, c.sequence_parallel, c.group_name, c.debug, s.x_shape,
      s.x_dtype, s.need_db ? s.bias_dtype : std::nullopt, s.need_dgrad(), s.need_wgrad(),
      at(kPrologueInput), at(kPrologueWeightSaved), s.prologue_bias,
      at(kMean, c.prologue_kind() == Prologue::kLayerNorm), at(kRstd, c.norm()), c.prologue,
      output_grad, h.scale, h.grad_amax_history, h.rowwise, h.columnwise, h.dbias, h.dy_rowwise,
      h.dy_columnwise, h.dy_scale_inv, h.dy_dbias, input_grad);
}

// A layer's gradients into `out`, at the positions of its differentiable inputs (x, weight,
// bias, prologue weight and bias; -1: not an input of the op).
void place_grads(const BackwardOutputs& g, const Saved& s, variable_list& out,
                 std::array<int, 5> at) {
  const bool wanted[5] = {s.need_dx, s.need_dw && !s.main_grad, s.need_db, s.need_dprologue_weight,
                          s.need_dprologue_bias};
  const at::Tensor grads[5] = {std::get<0>(g), std::get<1>(g), std::get<2>(g), std::get<3>(g),
                               std::get<4>(g)};
  for (size_t i = 0; i < 5; ++i) {
    if (wanted[i] && at[i] >= 0) out[at[i]] = grads[i];
  }
}

c10::intrusive_ptr<Saved> saved_layer(AutogradContext* ctx, const char* key) {
  return c10::static_intrusive_pointer_cast<Saved>(ctx->saved_data[key].toCapsule());
}

// The gradient of a layer's output y: zeros where none came (only the norm output it returned
// was used). Autograd does not make them: the Functions do not materialize gradients, which
// spares a zeros kernel for the usually absent norm-output gradient (host time).
at::Tensor output_grad(const at::Tensor& grad, const Saved& s) {
  return grad.defined() ? grad : at::zeros_symint(s.y_shape, s.y_options);
}

// The output gradient of a prologue the module returned (a norm output), where one came.
OptTensor returned_output_grad(const Config& c, const at::Tensor& grad) {
  return c.keep_prologue_output && grad.defined() ? OptTensor(grad) : std::nullopt;
}

// How an op's `residual` (added to its output) gets its gradient, which is dy itself: handed
// back as the residual's (kPassed), or, where the residual is the input x of a norm prologue
// whose backward runs (x + f(norm(x))), added to dx in the norm backward's own pass (kFolded:
// autograd then has one gradient of x to take, not two to add in a kernel of their own).
// `layer_inputs`: the op's tensors before the residual (the layer's own), those given.
enum class Residual : int64_t { kNone, kPassed, kFolded };
void keep_residual(AutogradContext* ctx, const OptTensor& residual, const at::Tensor& x,
                   bool norm_backward_runs, std::initializer_list<OptTensor> layer_inputs) {
  Residual r = Residual::kNone;
  if (residual && residual->requires_grad()) {
    r = residual->is_same(x) && norm_backward_runs ? Residual::kFolded : Residual::kPassed;
  }
  ctx->saved_data["residual"] = static_cast<int64_t>(r);
  int64_t given = 0, bit = 1;  // (which layer inputs autograd has an edge for: those given)
  for (const OptTensor& t : layer_inputs) {
    if (t.has_value() && t->defined()) given |= bit;
    bit <<= 1;
  }
  ctx->saved_data["layer_given"] = given;
}
Residual kept_residual(AutogradContext* ctx) {
  return static_cast<Residual>(ctx->saved_data["residual"].toInt());
}
// The layer inputs (bit i: forward's i-th tensor) whose gradients this backward asks for: not
// all that require one under torch.autograd.grad(loss, inputs) or backward(inputs=...). The
// edges are the tensors given, in order, an absent optional none.
int64_t asked_inputs(AutogradContext* ctx) {
  const int64_t given = ctx->saved_data["layer_given"].toInt();
  int64_t asked = 0;
  size_t edge = 0;
  for (int64_t bit = 1; bit <= given; bit <<= 1) {
    if ((given & bit) && ctx->needs_input_grad(edge++)) asked |= bit;
  }
  return asked;
}
// A layer's Saved with the gradients this backward does not ask for dropped (`at`: each
// gradient's input position, as place_grads), so that their GEMMs and side effects do not run:
// main_grad untouched, as nn.Linear leaves weight.grad. `s` itself where all are asked for.
c10::intrusive_ptr<Saved> narrowed(const c10::intrusive_ptr<Saved>& s, int64_t asked,
                                   std::array<int, 5> at) {
  const auto wanted = [asked, &at](size_t i) { return at[i] < 0 || (asked >> at[i]) & 1; };
  if (wanted(0) && wanted(1) && wanted(2) && wanted(3) && wanted(4)) return s;
  auto n = c10::make_intrusive<Saved>(*s);
  n->need_dx = n->need_dx && wanted(0);
  n->need_dw = n->need_dw && wanted(1);
  if (!wanted(1)) n->main_grad.reset();
  n->need_db = n->need_db && wanted(2);
  n->need_dprologue_weight = n->need_dprologue_weight && wanted(3);
  n->need_dprologue_bias = n->need_dprologue_bias && wanted(4);
  return n;
}
// The gradients of an op's `inputs` where only the residual's is asked for: the output's.
variable_list residual_grad(Residual r, const at::Tensor& grad, size_t inputs, size_t index) {
  variable_list out(inputs);
  if (r == Residual::kPassed) out[index] = grad;
  return out;
}

// The gradient the norm backward adds to dx (kFolded), where one came and the layer's (narrowed)
// backward runs dgrad: where x's gradient is not asked for, there is no dx to add it to.
OptTensor folded_grad(Residual r, const at::Tensor& grad, const Saved& s) {
  return r == Residual::kFolded && grad.defined() && s.need_dgrad() ? OptTensor(grad)
                                                                    : std::nullopt;
}

struct LinearAutograd : torch::autograd::Function<LinearAutograd> {
  // (y, the prologue's output where asked for, else empty)
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                               const OptTensor& bias, const OptTensor& prologue_weight,
                               const OptTensor& prologue_bias, const OptTensor& residual,
                               const Layer& l) {
    std::vector<at::Tensor> to_save;
    LayerForward f = layer_forward(x, {weight, bias, prologue_weight, prologue_bias}, l,
                                   x.requires_grad(), to_save, residual);
    keep_residual(ctx, residual, x, l.c.norm() && x.requires_grad(),
                  {x, weight, bias, prologue_weight, prologue_bias});
    ctx->save_for_backward(to_save);
    ctx->set_materialize_grads(false);
    if (!l.c.keep_prologue_output) ctx->mark_non_differentiable({f.x_hp});
    ctx->saved_data["s"] = c10::IValue::make_capsule(f.s);
    return {f.y, f.x_hp};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Residual residual = kept_residual(ctx);
    // (Only the residual's gradient asked for (torch.autograd.grad(loss, [r]), or a frozen
    // layer): the layer's backward is skipped, as autograd skips a layer an add bypasses.)
    const int64_t asked = asked_inputs(ctx);
    if (asked == 0) return residual_grad(residual, grads[0], kInputs, kResidual);
    const auto s = saved_layer(ctx, "s");
    const auto saved = ctx->get_saved_variables();
    // Grad mode on inside backward means create_graph=True (double backward), refused with
    // fuse_wgrad_accumulation even where the weight's gradient is not asked for: a second
    // backward would reach the weight through .grad, not main_grad.
    const at::Tensor dy = output_grad(grads[0], *s);
    if (at::GradMode::is_enabled()) {
      variable_list out = differentiable_backward(dy, saved, *s);
      if (residual == Residual::kPassed) out[kResidual] = grads[0];
      return out;
    }
    const auto n = narrowed(s, asked, {0, 1, 2, 3, 4});
    variable_list out = backward_of(dy, saved, *n, grads[1], folded_grad(residual, grads[0], *n));
    if (residual == Residual::kPassed) out[kResidual] = grads[0];
    return out;
  }

  static constexpr size_t kInputs = 7;  // forward's arguments after ctx: a gradient (or none) each
  static constexpr size_t kResidual = 5;

 private:
  static variable_list backward_of(const at::Tensor& dy, const variable_list& saved, const Saved& s,
                                   const at::Tensor& norm_output_grad,
                                   const OptTensor& input_grad) {
    const auto g = layer_backward(dy, saved, 0, s, returned_output_grad(s.c, norm_output_grad), {},
                                  input_grad);
    variable_list out(kInputs);
    place_grads(g, s, out, {0, 1, 2, 3, 4});
    return out;
  }
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
  const at::Tensor &x = saved[kX], &weight = saved[kWeight];
  const at::Tensor dy2 = dy.reshape({-1, weight.size(0)});
  variable_list out(kInputs);
  if (s.need_dx) out[0] = dy2.mm(weight).to(s.x_dtype).view_symint(s.x_shape);
  if (s.need_dw) out[1] = dy2.t().mm(x.reshape({-1, weight.size(1)})).to(weight.scalar_type());
  if (s.need_db) out[2] = dy2.sum(0).to(*s.bias_dtype);
  return out;
}

// Whether fc2 can hand fc1 its gradient in FP8 (GradHandoff): FP8 with neither layer debugged
// (fc1's debug quantizer needs its gradient's high-precision values) and an activation between
// them (its pass also makes fc1's bias gradient); not to a row-parallel fc1 with sequence
// parallelism, which gathers its gradient in its own cast.
bool hands_off(const Saved& fc1, const Saved& fc2) {
  const Config& c = fc2.c;
  const bool fc1_gathers =
      fc1.c.parallel_mode == static_cast<int64_t>(ParallelMode::kRow) && fc1.c.sequence_parallel;
  return c.scaling != 0 && c.debug.empty() && fc1.c.debug.empty() && !c.norm() && c.prologue != 0 &&
         fc2.need_dx && !fc1_gathers;
}

struct MlpAutograd : torch::autograd::Function<MlpAutograd> {
  // (y, fc1's prologue output (the normalized input) where asked for, else empty)
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w1,
                               const OptTensor& b1, const OptTensor& norm_weight,
                               const OptTensor& norm_bias, const at::Tensor& w2,
                               const OptTensor& b2, const OptTensor& residual, const Layer& fc1,
                               const Layer& fc2) {
    std::vector<at::Tensor> to_save;
    LayerForward f1 =
        layer_forward(x, {w1, b1, norm_weight, norm_bias}, fc1, x.requires_grad(), to_save);
    LayerForward f2 =
        layer_forward(f1.y, {w2, b2, {}, {}}, fc2, fc2.c.need_dgrad, to_save, residual);
    // (fc1's backward, and its norm's, run only when fc2's dgrad does)
    keep_residual(ctx, residual, x, fc1.c.norm() && x.requires_grad() && fc2.c.need_dgrad,
                  {x, w1, b1, norm_weight, norm_bias, w2, b2});
    ctx->save_for_backward(to_save);
    ctx->set_materialize_grads(false);
    if (!fc1.c.keep_prologue_output) ctx->mark_non_differentiable({f1.x_hp});
    ctx->saved_data["fc1"] = c10::IValue::make_capsule(f1.s);
    ctx->saved_data["fc2"] = c10::IValue::make_capsule(f2.s);
    return {f2.y, f1.x_hp};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const Residual residual = kept_residual(ctx);
    const int64_t asked = asked_inputs(ctx);
    if (asked == 0) return residual_grad(residual, grads[0], kInputs, kResidual);
    const auto s1 = narrowed(saved_layer(ctx, "fc1"), asked, {0, 1, 2, 3, 4});
    auto s2 = narrowed(saved_layer(ctx, "fc2"), asked, {-1, 5, 6, -1, -1});
    if (s2->need_dx && !(s1->need_dgrad() || s1->need_wgrad() || s1->need_db)) {
      s2 = c10::make_intrusive<Saved>(*s2);  // (fc1 has nothing asked of it: no dgrad for it)
      s2->need_dx = false;
    }
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "tpfp8.MLP and LayerNormMLP do not support double backward (create_graph=True)");
    const auto saved = ctx->get_saved_variables();
    variable_list out(kInputs);
    Handoff give;
    if (hands_off(*s1, *s2)) {
      give = {s1->scale, s1->grad_amax_history, s1->need_dgrad(), s1->need_wgrad(), s1->need_db};
    }
    const at::Tensor dy = output_grad(grads[0], *s2);
    if (residual == Residual::kPassed) out[kResidual] = grads[0];
    const auto g2 = layer_backward(dy, saved, kSavedPerLayer, *s2, std::nullopt, give);
    place_grads(g2, *s2, out, {-1, 5, 6, -1, -1});  // (forward's w2, b2; fc2's x is internal)
    const OptTensor norm_grad = returned_output_grad(s1->c, grads[1]);
    const OptTensor input_grad = folded_grad(residual, grads[0], *s1);
    if (!s2->need_dx) return out;
    BackwardOutputs g1;
    if (give.rowwise || give.columnwise) {
      Handoff take;
      // (only what was given: an output not asked for is an empty placeholder, whose 0 rows
      // would be taken for the gradient's, and fc1's weight gradient came out zero)
      if (give.rowwise) take.dy_rowwise = std::get<5>(g2);
      if (give.columnwise) take.dy_columnwise = std::get<6>(g2);
      take.dy_scale_inv = std::get<7>(g2);
      if (s1->need_db) take.dy_dbias = std::get<8>(g2);
      // (dy itself is FP8 here: an empty tensor says where and in what dtype)
      const at::Tensor where = dy.new_empty({0}, dy.options().dtype(s1->x_dtype));
      g1 = layer_backward(where, saved, 0, *s1, norm_grad, take, input_grad);
    } else {
      g1 = layer_backward(std::get<0>(g2), saved, 0, *s1, norm_grad, {}, input_grad);
    }
    place_grads(g1, *s1, out, {0, 1, 2, 3, 4});
    return out;
  }

  static constexpr size_t kInputs = 10;
  static constexpr size_t kResidual = 7;
};

// The ops' kernels, boxed (each call parses its layers' arguments from the stack): with
// autograd (the Autograd key) or without (inference mode: the forward ops alone).
template <bool kAutograd>
void linear_kernel(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const at::Tensor x = (*stack)[0].toTensor();
  auto [p, l] = parse_layer(*stack, 1);
  const OptTensor residual = optional_tensor((*stack)[1 + kLayerArgs]);
  at::Tensor y, x_hp;
  if constexpr (kAutograd) {
    const variable_list out =
        LinearAutograd::apply(x, p.weight, p.bias, p.prologue_weight, p.prologue_bias, residual, l);
    y = out[0];
    x_hp = out[1];
  } else {
    l.c.need_dgrad = l.c.need_wgrad = false;
    const auto r = run_forward(x, p, l, residual);
    y = std::get<0>(r);
    x_hp = std::get<5>(r);
  }
  torch::jit::drop(*stack, 2 + kLayerArgs);
  torch::jit::push(*stack, y, x_hp);
}

template <bool kAutograd>
void mlp_kernel(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const at::Tensor x = (*stack)[0].toTensor();
  auto [p1, l1] = parse_layer(*stack, 1);
  auto [p2, l2] = parse_layer(*stack, 1 + kLayerArgs);
  TORCH_CHECK_VALUE(!p2.prologue_weight && !p2.prologue_bias,
                    "mlp: fc2's prologue is an activation, which takes no weight or bias");
  const OptTensor residual = optional_tensor((*stack)[1 + 2 * kLayerArgs]);
  check_mlp(x, p1, l1, p2, l2, residual);
  at::Tensor y, x_hp;
  if constexpr (kAutograd) {
    const variable_list out =
        MlpAutograd::apply(x, p1.weight, p1.bias, p1.prologue_weight, p1.prologue_bias, p2.weight,
                           p2.bias, residual, l1, l2);
    y = out[0];
    x_hp = out[1];
  } else {
    for (Layer* l : {&l1, &l2}) l->c.need_dgrad = l->c.need_wgrad = false;
    const auto r1 = run_forward(x, p1, l1);
    y = std::get<0>(run_forward(std::get<0>(r1), p2, l2, residual));
    x_hp = std::get<5>(r1);
  }
  torch::jit::drop(*stack, 2 + 2 * kLayerArgs);
  torch::jit::push(*stack, y, x_hp);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tpfp8, m) {
  const std::string linear = "linear(Tensor x, " + layer_schema("", "abcdef", true) +
                             ", Tensor? residual=None) -> (Tensor, Tensor)";
  const std::string mlp = "mlp(Tensor x, " + layer_schema("fc1_", "abcdef", false) + ", " +
                          layer_schema("fc2_", "ghijkl", false) +
                          ", Tensor? residual=None) -> (Tensor, Tensor)";
  m.def(linear.c_str());
  m.def(mlp.c_str());
}

#define TPFP8_REGISTER_LINEAR_KERNELS(m, autograd)                                         \
  m.impl("linear", torch::CppFunction::makeFromBoxedFunction<&linear_kernel<autograd>>()); \
  m.impl("mlp", torch::CppFunction::makeFromBoxedFunction<&mlp_kernel<autograd>>())

TORCH_LIBRARY_IMPL(tpfp8, Autograd, m) { TPFP8_REGISTER_LINEAR_KERNELS(m, true); }
TORCH_LIBRARY_IMPL(tpfp8, CPU, m) { TPFP8_REGISTER_LINEAR_KERNELS(m, false); }
#if defined(TPFP8_WITH_CUDA)
TORCH_LIBRARY_IMPL(tpfp8, CUDA, m) { TPFP8_REGISTER_LINEAR_KERNELS(m, false); }
#endif

}  // namespace tpfp8
