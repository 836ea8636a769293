// The Linear autograd Function (linear.h): a short list of steps in forward and backward,
// each a call into a named helper below.
#include "linear.h"

#include <torch/autograd.h>

#include "comm.h"
#include "kernels/gemm.h"
#include "ops.h"

namespace tpfp8 {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

int64_t gemm_code(const at::Tensor& t) {
  const at::ScalarType d = t.scalar_type();
  return static_cast<int64_t>(d == at::kBFloat16 ? GemmType::kBFloat16
                              : d == at::kHalf   ? GemmType::kFloat16
                                                 : GemmType::kFloat32);
}
int64_t gemm_code(Fp8Format f) { return static_cast<int64_t>(gemm_type(f)); }

// Column-wise FP8 data [rows, M] contracted over M in wgrad: zero codes pad M to a multiple
// of 16, which adds exact zeros to the sum. No copy when M is already aligned.
at::Tensor pad_contracted(const at::Tensor& t) {
  const int64_t pad = (kFp8Multiple - t.size(1) % kFp8Multiple) % kFp8Multiple;
  return pad == 0 ? t : at::constant_pad_nd(t, {0, pad}, 0);
}

// A GEMM operand as the GEMM reads it: FP8 codes with their scale_inv, or high-precision
// values, stored [rows, K] or (transposed, high precision only) [K, rows].
struct Operand {
  at::Tensor data;
  OptTensor scale_inv;
  int64_t type = 0;
  bool transposed = false;
};

Operand rowwise(const Fp8Tensor& q) { return {q.rowwise, q.scale_inv, gemm_code(q.format)}; }
Operand columnwise(const Fp8Tensor& q) {
  return {pad_contracted(q.columnwise), q.scale_inv, gemm_code(q.format)};
}
Operand high_precision(const at::Tensor& t, bool transposed = false) {
  return {t, std::nullopt, gemm_code(t), transposed};
}

// out = A . B^T (+ bias) (+ out)
at::Tensor run_gemm(const Operand& a, const Operand& b, at::Tensor out, const OptTensor& bias,
                    bool fast_accum, bool accumulate = false) {
  gemm(a.data, b.data, out, a.scale_inv, b.scale_inv, a.type, b.type, bias, accumulate, fast_accum,
       a.transposed, b.transposed);
  return out;
}

// `t` as [-1, cols], contiguous; a 2-D contiguous tensor as it is (no view to make: host time).
at::Tensor as_matrix(const at::Tensor& t, int64_t cols) {
  return t.dim() == 2 && t.is_contiguous() ? t : t.reshape({-1, cols}).contiguous();
}
// `t` viewed as `shape`, or itself when it has that shape already.
at::Tensor shaped(const at::Tensor& t, at::IntArrayRef shape) {
  return t.sizes() == shape ? t : t.view(shape);
}

// Current scaling of a tensor that is split across the group: the amax is all-reduced (MAX)
// first, so every rank computes the scale of the whole tensor.
QuantizerSpec with_group_amax(QuantizerSpec spec, const ProcessGroupPtr& group) {
  if (spec.scaling == Scaling::kCurrent) {
    spec.reduce_amax = [group](at::Tensor& amax) { all_reduce(amax, *group, c10d::ReduceOp::MAX); };
  }
  return spec;
}

}  // namespace

// The one check of a Linear call's arguments (Python calls it too, for the meta device): each
// failure is a ValueError that says what was given and how to fix it.
void check_inputs(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                  const LinearOptions& o) {
  const int64_t n = weight.size(0), k = weight.size(1);
  const bool row = o.parallel_mode == ParallelMode::kRow;
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) == k, "Linear expects input [..., in_features=", k,
                    row ? " per rank" : "", "], got shape ", x.sizes(),
                    "; the last dimension must be in_features");
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                    "Linear input must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK_VALUE(x.device() == weight.device(), "Linear input is on ", x.device(),
                    " but its weight is on ", weight.device(), "; move the input (or the module)");
  TORCH_CHECK_VALUE(!bias || bias->device() == weight.device(), "bias is on ", bias->device(),
                    " but the weight on ", weight.device());
  TORCH_CHECK_VALUE(
      o.parallel_mode == ParallelMode::kNone ? !o.sequence_parallel : bool(o.tp_group),
      "tensor parallelism needs tp_group, and sequence_parallel needs a parallel_mode");
  if (o.fp8) {
    TORCH_CHECK_VALUE(k % kFp8Multiple == 0 && n % kFp8Multiple == 0,
                      "FP8 Linear needs in_features and out_features (per rank) to be multiples "
                      "of ",
                      kFp8Multiple, ", got ", k, " and ", n,
                      " (Hopper's FP8 GEMMs need it); pad the layer or run it outside "
                      "fp8_autocast");
    TORCH_CHECK_VALUE(!(o.save_original_input && o.input.scaling == Scaling::kDelayed),
                      "save_original_input=True cannot be used with delayed scaling: the scale "
                      "moves between forward and backward, so re-quantizing would not reproduce "
                      "the forward's FP8 input; use tpfp8.CurrentScaling() or "
                      "save_original_input=False");
    TORCH_CHECK_VALUE(o.weight_cache != WeightCache::kReuse || o.weight_cache_rowwise.defined(),
                      "is_first_microbatch=False needs an earlier call with "
                      "is_first_microbatch=True to cache the FP8 weight");
  } else {
    TORCH_CHECK_VALUE(dtype == weight.scalar_type(), "Linear input is ", dtype,
                      " but the weight is ", weight.scalar_type(),
                      "; convert one of them or use torch.autocast (outside FP8 both must match)");
  }
  if (o.fuse_wgrad_accumulation) {
    TORCH_CHECK_VALUE(o.main_grad.defined() && o.main_grad.scalar_type() == at::kFloat &&
                          o.main_grad.sizes() == weight.sizes() &&
                          o.main_grad.device() == weight.device(),
                      "fuse_wgrad_accumulation needs weight.main_grad as float32 ", weight.sizes(),
                      " on the weight's device ", weight.device());
  }
  if (row && o.sequence_parallel) {
    const int64_t tp = o.tp_group->getSize();
    TORCH_CHECK_VALUE(x.size(0) % tp == 0, "sequence length (dim 0)=", x.size(0),
                      " is not divisible by the tensor-parallel group size ", tp,
                      "; pad the sequence");
  }
}

namespace {

Fp8Tensor weight_fp8(const at::Tensor& weight, const LinearOptions& o, bool columnwise) {
  const Fp8Tensor cache{o.weight_cache_rowwise, o.weight_cache_columnwise, o.weight_cache_scale_inv,
                        o.weight.format};
  if (o.weight_cache == WeightCache::kReuse) return cache;
  const bool fill = o.weight_cache == WeightCache::kFill;
  return quantize(weight.contiguous(), o.weight, true, columnwise || fill, fill ? &cache : nullptr);
}

// A tensor made ready for its GEMMs: its FP8 form and, where kept, the whole high-precision
// tensor (high-precision runs, re-quantization, debugging).
struct Prepared {
  at::Tensor hp;
  Fp8Tensor q;
};

// One operand of a GEMM: the tensor, and whether the GEMM reads it column-wise (contracting
// over its rows) -- as FP8 codes, or in high precision when the GEMM runs there (debug).
struct Use {
  const char* tensor;  // "activation", "weight", "gradient"
  const Prepared* t;
  bool columnwise;
  int64_t fake;  // fake_quant format or -1
};

at::Tensor fake_quantize(const at::Tensor& hp, int64_t format) {
  QuantizerSpec spec;
  spec.scaling = Scaling::kCurrent;
  spec.format = static_cast<Fp8Format>(format);
  const Fp8Tensor q = quantize(hp.contiguous(), spec, true, false);
  at::Tensor out = at::empty(hp.sizes(), hp.options().dtype(at::kFloat));
  dequantize(q.rowwise, q.scale_inv, format, out);
  return out;
}

// The two operands of `gemm`, with the debug options applied and reported.
std::pair<Operand, Operand> operands(const char* gemm, const Use& a, const Use& b, bool fp8,
                                     bool hp_gemm, const DebugOptions& d,
                                     at::ScalarType compute_dtype) {
  const bool high = !fp8 || hp_gemm || a.fake >= 0 || b.fake >= 0;
  auto one = [&](const Use& u) {
    if (high) {
      const at::Tensor used =
          (u.fake >= 0 ? fake_quantize(u.t->hp, u.fake) : u.t->hp).to(compute_dtype).contiguous();
      if (d.log) d.log(gemm, u.tensor, used.to(at::kFloat), u.t->hp, at::Tensor(), u.fake);
      return high_precision(used, u.columnwise);
    }
    const Fp8Tensor& q = u.t->q;
    if (d.log) {
      const at::Tensor& codes = u.columnwise ? q.columnwise : q.rowwise;
      at::Tensor used = at::empty(codes.sizes(), codes.options().dtype(at::kFloat));
      dequantize(codes, q.scale_inv, static_cast<int64_t>(q.format), used);
      d.log(gemm, u.tensor, u.columnwise ? used.t() : used, u.t->hp, q.scale_inv,
            static_cast<int64_t>(q.format));
    }
    return u.columnwise ? columnwise(q) : rowwise(q);
  };
  return {one(a), one(b)};
}

// The part of an FP8 tensor backward keeps: its column-wise data (the row-wise copy is dropped).
Fp8Tensor columnwise_part(const Fp8Tensor& q) {
  return {at::Tensor(), q.columnwise, q.scale_inv, q.format};
}

// What backward needs beyond the tensors saved through save_for_backward.
struct Saved : torch::CustomClassHolder {
  LinearOptions o;
  std::vector<int64_t> x_shape;
  at::ScalarType x_dtype;
  std::optional<at::ScalarType> bias_dtype;
  // FP8 input for wgrad: column-wise [K, M], or (column-parallel sequence parallel) this
  // rank's row-wise bytes [M/tp, K], re-gathered in backward. FP8 weight: column-wise.
  Fp8Tensor qx, qw;
};

bool gathers_input(const LinearOptions& o) {
  return o.parallel_mode == ParallelMode::kColumn && o.sequence_parallel;
}
bool gathers_grad(const LinearOptions& o) {
  return o.parallel_mode == ParallelMode::kRow && o.sequence_parallel;
}
// Dim 0 of the output for an input's dim 0: sequence parallelism gathers it (column) or
// scatters it (row) over the group. (Not from the rows of y and x: there may be none.)
int64_t output_dim0(int64_t x_dim0, const LinearOptions& o) {
  if (!o.sequence_parallel) return x_dim0;
  const int64_t tp = o.tp_group->getSize();
  return o.parallel_mode == ParallelMode::kColumn ? x_dim0 * tp : x_dim0 / tp;
}
// Whether backward keeps the high-precision input (re-quantized, used as it is, or reported).
bool saves_hp_input(const LinearOptions& o) {
  return !o.fp8 || o.save_original_input || o.debug.active;
}
// Debugging gathers and quantizes whole tensors: statistics and usages are of what the GEMMs see.
bool quantizes_after_gather(const LinearOptions& o) { return o.debug.active; }

struct LinearFunction : torch::autograd::Function<LinearFunction> {
  // grad_enabled: autograd turns grad mode off inside forward, so the caller's mode is passed
  // in; without it (inference) no column-wise data is made for a backward that never comes.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const OptTensor& bias, const LinearOptions& o, bool grad_enabled) {
    const int64_t n = weight.size(0), k = weight.size(1);
    const at::Tensor x2 = as_matrix(x, k);
    auto s = c10::make_intrusive<Saved>();
    s->o = o;
    s->x_shape = x.sizes().vec();
    s->x_dtype = x.scalar_type();
    if (bias) s->bias_dtype = bias->scalar_type();
    const bool need_wgrad = grad_enabled && (weight.requires_grad() || o.fuse_wgrad_accumulation);
    const bool need_dgrad = grad_enabled && x.requires_grad();

    // 1. The input of fprop: quantized, and gathered along rows under column-parallel SP.
    const Prepared in = prepare_input(x2, o, need_wgrad, *s);
    // 2. The weight: FP8 row-wise for fprop (+ column-wise for dgrad).
    Prepared w{weight, {}};
    if (o.fp8) {
      w.q = weight_fp8(weight, o, need_dgrad);
      s->qw = columnwise_part(w.q);
    }
    // 3. fprop. The bias is fused in the epilogue except where an FP8 GEMM writes fp32 (its
    //    epilogue takes a 16-bit bias) and under row parallelism (it is added once, after the
    //    reduction).
    const DebugOptions& d = o.debug;
    const auto [x_op, w_op] =
        operands("fprop", {"activation", &in, false, d.fake_activation},
                 {"weight", &w, false, d.fake_weight}, o.fp8, d.hp_fprop, d, s->x_dtype);
    at::Tensor y = at::empty({x_op.data.size(0), n}, x.options());
    const bool row = o.parallel_mode == ParallelMode::kRow;
    const bool fuse_bias = bias && !row && !(x_op.scale_inv && y.scalar_type() == at::kFloat);
    run_gemm(x_op, w_op, y, fuse_bias ? OptTensor(bias->to(y.scalar_type())) : std::nullopt, o.fp8);
    // 4. Row parallel: sum the partial outputs over the group.
    if (row && o.sequence_parallel) {
      y = reduce_scatter_rows(y, *o.tp_group);
    } else if (row) {
      all_reduce(y, *o.tp_group, c10d::ReduceOp::SUM);
    }
    if (bias && !fuse_bias) y.add_(bias->to(y.scalar_type()));

    ctx->saved_data["state"] = c10::IValue::make_capsule(s);
    std::vector<int64_t> out_shape = s->x_shape;
    out_shape.back() = n;
    out_shape[0] = output_dim0(out_shape[0], o);
    // High precision keeps the input itself: a double backward differentiates through it.
    ctx->save_for_backward({!o.fp8 ? x : saves_hp_input(o) ? x2 : at::Tensor(), weight});
    return shaped(y, out_shape);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = c10::static_intrusive_pointer_cast<Saved>(ctx->saved_data["state"].toCapsule());
    const LinearOptions& o = s->o;
    const DebugOptions& d = o.debug;
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& weight = saved[1];
    const int64_t n = weight.size(0), k = weight.size(1);
    const at::Tensor dy = as_matrix(grads[0], n);
    const at::Tensor x_saved = saved[0].defined() ? as_matrix(saved[0], k) : saved[0];
    // Grad mode on inside backward means create_graph=True (double backward).
    if (at::GradMode::is_enabled()) return differentiable_backward(ctx, dy, x_saved, weight, *s);
    const bool need_dgrad = ctx->needs_input_grad(0);
    const bool need_wgrad = ctx->needs_input_grad(1) || o.fuse_wgrad_accumulation;

    // 1. Column-parallel SP: start re-gathering the input for wgrad; it overlaps dgrad.
    //    (Quantized after the gather, its column-wise data is whole already.)
    WorkPtr x_work;
    at::Tensor x_gathered;
    const bool regather = gathers_input(o) && (saves_hp_input(o) || s->qx.rowwise.defined());
    if (need_wgrad && regather) {
      x_gathered =
          all_gather_rows(saves_hp_input(o) ? x_saved : s->qx.rowwise, *o.tp_group, &x_work);
    }
    // 2. The gradient: quantized, and gathered along rows under row-parallel SP. Delayed
    //    scaling updates its state once the whole backward pass is done.
    const Prepared g = prepare_grad(dy, o, need_dgrad, need_wgrad);
    if (o.fp8 && o.grad.after_backward) update_after_backward(o.grad.after_backward);
    // 3. dgrad, then (column parallel) its reduction, in flight during wgrad.
    at::Tensor dx;
    WorkPtr dx_work;
    if (need_dgrad) {
      const Prepared w{weight, s->qw};
      const auto [dy_op, w_op] =
          operands("dgrad", {"gradient", &g, false, d.fake_gradient},
                   {"weight", &w, true, d.fake_weight}, o.fp8, d.hp_dgrad, d, s->x_dtype);
      dx = run_gemm(dy_op, w_op, at::empty({dy_op.data.size(0), k}, dy.options().dtype(s->x_dtype)),
                    std::nullopt, false);
      if (o.parallel_mode == ParallelMode::kColumn && o.sequence_parallel) {
        dx = reduce_scatter_rows(dx, *o.tp_group, &dx_work);
      } else if (o.parallel_mode == ParallelMode::kColumn) {
        all_reduce(dx, *o.tp_group, c10d::ReduceOp::SUM, &dx_work);
      }
    }
    // 4. wgrad, into main_grad or a fresh dW.
    at::Tensor dw;
    if (need_wgrad) {
      wait(x_work);
      const Prepared in = input_for_wgrad(x_saved, x_gathered, *s);
      const auto [dy_op, x_op] =
          operands("wgrad", {"gradient", &g, true, d.fake_gradient},
                   {"activation", &in, true, d.fake_activation}, o.fp8, d.hp_wgrad, d, s->x_dtype);
      const bool accumulate = o.fuse_wgrad_accumulation && !o.main_grad_overwrite;
      at::Tensor out =
          o.fuse_wgrad_accumulation ? o.main_grad : at::empty({n, k}, weight.options());
      if (dy.size(0) > 0) {
        run_gemm(dy_op, x_op, out, std::nullopt, false, accumulate);
      } else if (!accumulate) {
        out.zero_();  // no tokens: an empty sum (cuBLASLt has no GEMM with K = 0)
      }
      if (!o.fuse_wgrad_accumulation) dw = out;
    }
    wait(dx_work);
    // 5. db: the local sum; under row-parallel SP each rank holds part of the rows of dy.
    at::Tensor db;
    if (s->bias_dtype && ctx->needs_input_grad(2)) {
      db = dy.sum(0, false, at::kFloat);
      if (gathers_grad(o)) all_reduce(db, *o.tp_group, c10d::ReduceOp::SUM);
      db = db.to(*s->bias_dtype);
    }
    return {dx.defined() ? shaped(dx, s->x_shape) : dx, dw, db, at::Tensor(), at::Tensor()};
  }

 private:
  // The backward as differentiable torch ops, for gradients of gradients (a gradient penalty):
  // high precision on one device only -- an FP8 cast has no useful derivative, and the
  // collectives here are not differentiable -- and a clear error otherwise, never a silently
  // detached dx.
  static variable_list differentiable_backward(AutogradContext* ctx, const at::Tensor& dy,
                                               const at::Tensor& x2, const at::Tensor& weight,
                                               const Saved& s) {
    const LinearOptions& o = s.o;
    TORCH_CHECK(!o.fp8 && o.parallel_mode == ParallelMode::kNone && !o.fuse_wgrad_accumulation,
                "tpfp8.Linear supports double backward (create_graph=True) only in high "
                "precision on one device without fuse_wgrad_accumulation; this call used ",
                o.fp8                                    ? "FP8"
                : o.parallel_mode != ParallelMode::kNone ? "tensor parallelism"
                                                         : "fuse_wgrad_accumulation",
                ". Run the layer outside fp8_autocast (and unsplit) for a gradient penalty");
    at::Tensor dx, dw, db;
    if (ctx->needs_input_grad(0)) dx = shaped(dy.mm(weight).to(s.x_dtype), s.x_shape);
    if (ctx->needs_input_grad(1)) dw = dy.t().mm(x2).to(weight.scalar_type());
    if (s.bias_dtype && ctx->needs_input_grad(2)) db = dy.sum(0).to(*s.bias_dtype);
    return {dx, dw, db, at::Tensor(), at::Tensor()};
  }

  static Prepared prepare_input(const at::Tensor& x2, const LinearOptions& o, bool need_wgrad,
                                Saved& s) {
    const bool gather = gathers_input(o);
    const bool columnwise = need_wgrad && !o.save_original_input;
    if (!o.fp8) return {gather ? all_gather_rows(x2, *o.tp_group) : x2, {}};
    if (gather && quantizes_after_gather(o)) {
      // Quantize what the GEMMs see: the gathered tensor, whose amax is the global one.
      const at::Tensor total = all_gather_rows(x2, *o.tp_group);
      const Fp8Tensor q = quantize(total, o.input, true, columnwise);
      s.qx = columnwise_part(q);
      return {total, q};
    }
    if (gather) {
      Fp8Tensor local;
      const Fp8Tensor q = all_gather_fp8(x2, o.input, o.tp_group, &local);
      s.qx = {local.rowwise, at::Tensor(), q.scale_inv, q.format};  // re-gathered in backward
      return {at::Tensor(), q};
    }
    const Fp8Tensor q = quantize(x2, o.input, true, columnwise);
    s.qx = columnwise_part(q);
    return {x2, q};
  }

  static Prepared prepare_grad(const at::Tensor& dy, const LinearOptions& o, bool need_dgrad,
                               bool need_wgrad) {
    const bool gather = gathers_grad(o);
    if (!o.fp8) return {gather ? all_gather_rows(dy, *o.tp_group) : dy, {}};
    if (!gather || quantizes_after_gather(o)) {
      // Whole (replicated, this rank's own, or gathered first): its local amax is the global.
      const at::Tensor total = gather ? all_gather_rows(dy, *o.tp_group) : dy;
      return {total, quantize(total, o.grad, need_dgrad, need_wgrad)};
    }
    Fp8Tensor q = all_gather_fp8(dy, o.grad, o.tp_group);
    if (need_wgrad) {
      q.columnwise = at::empty({q.rowwise.size(1), q.rowwise.size(0)}, q.rowwise.options());
      transpose_fp8(q.rowwise, q.columnwise);
    }
    return {at::Tensor(), q};
  }

  // The input for wgrad: saved, re-gathered or re-quantized.
  static Prepared input_for_wgrad(const at::Tensor& x_saved, const at::Tensor& x_gathered,
                                  const Saved& s) {
    const LinearOptions& o = s.o;
    if (saves_hp_input(o)) {
      const at::Tensor hp = x_gathered.defined() ? x_gathered : x_saved;
      if (!o.fp8) return {hp, {}};
      // The whole tensor is here (gathered, replicated or this rank's own): its local amax is
      // the one forward used, so the re-quantized bytes equal forward's.
      if (o.save_original_input) return {hp, quantize(hp, o.input, false, true)};
      return {hp, s.qx};  // debugging: forward's column-wise data, and the values for reports
    }
    if (!x_gathered.defined()) return {at::Tensor(), s.qx};
    Fp8Tensor q = s.qx;
    q.columnwise = at::empty({x_gathered.size(1), x_gathered.size(0)}, x_gathered.options());
    transpose_fp8(x_gathered, q.columnwise);
    return {at::Tensor(), q};
  }
};

}  // namespace

Fp8Tensor all_gather_fp8(const at::Tensor& local, const QuantizerSpec& spec,
                         const ProcessGroupPtr& group, Fp8Tensor* local_out) {
  Fp8Tensor q = quantize(local.contiguous(), with_group_amax(spec, group), true, false);
  if (local_out) *local_out = q;
  q.rowwise = all_gather_rows(q.rowwise, *group);  // FP8 bytes: half of bf16's traffic
  return q;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                  const LinearOptions& options) {
  check_inputs(x, weight, bias, options);
  return LinearFunction::apply(x, weight, bias, options, at::GradMode::is_enabled());
}

}  // namespace tpfp8
