// The Linear's forward and backward (linear.h): a short list of steps each, every step a call
// into a named helper below.
#include "linear.h"

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include "checks.h"
#include "comm.h"
#include "kernels/gemm.h"
#include "ops.h"

namespace tpfp8 {
namespace {

// out = A . B^T (+ bias) (+ out, or + residual)
at::Tensor run_gemm(const Operand& a, const Operand& b, at::Tensor out, const OptTensor& bias,
                    bool fast_accum, bool accumulate = false,
                    const OptTensor& residual = std::nullopt) {
  gemm(a.data, b.data, out, a.scale_inv, b.scale_inv, a.type, b.type, bias, accumulate, fast_accum,
       a.transposed, b.transposed, residual);
  return out;
}

// `t` as [-1, cols], contiguous; a 2-D contiguous tensor as it is (no view to make: host time).
at::Tensor as_matrix(const at::Tensor& t, int64_t cols) {
  return t.dim() == 2 && t.is_contiguous() ? t : t.reshape({-1, cols}).contiguous();
}
// as_matrix, copied where it does not start 16-byte aligned (the kernels' vector loads; cuBLASLt
// may have no FP8 kernel for a misaligned matrix).
at::Tensor aligned_matrix(const at::Tensor& t, int64_t cols) {
  const at::Tensor m = as_matrix(t, cols);
  return reinterpret_cast<uintptr_t>(m.data_ptr()) % 16 == 0 ? m : m.clone();
}
// `t` viewed as `shape`, or itself when it has that shape already.
at::Tensor shaped(const at::Tensor& t, at::IntArrayRef shape) {
  return t.sizes() == shape ? t : t.view(shape);
}

}  // namespace

LinearConfig linear_config(int64_t scaling, int64_t fwd_format, int64_t grad_format, double epsilon,
                           int64_t weight_cache, bool save_original_input, int64_t parallel_mode,
                           bool sequence_parallel, const std::string& group_name,
                           at::IntArrayRef debug) {
  LinearConfig c;
  c.scaling = code_as<Scaling>(scaling, "scaling", "0 (none), 1 (delayed) or 2 (current)");
  c.fwd_format = fp8_format_from(fwd_format);
  c.grad_format = fp8_format_from(grad_format);
  c.epsilon = epsilon;
  c.weight_cache =
      code_as<WeightCache>(weight_cache, "weight_cache", "0 (none), 1 (fill) or 2 (reuse)");
  c.save_original_input = save_original_input;
  c.parallel_mode =
      code_as<ParallelMode>(parallel_mode, "parallel_mode", "0 (none), 1 (column) or 2 (row)");
  c.sequence_parallel = sequence_parallel;
  if (!group_name.empty()) c.tp_group = c10d::resolve_process_group(group_name);
  c.debug = debug_options(debug);
  return c;
}

namespace {

// The quantizer of the layer's tensor `role` under `c`, with `state`'s scale and amax slot:
// null in high precision, wrapped in a DebugQuantizer while debugging.
std::unique_ptr<Quantizer> make_quantizer(const LinearConfig& c, const DelayedState& state,
                                          Role role) {
  std::unique_ptr<Quantizer> q;
  const Fp8Format format = role == kGrad ? c.grad_format : c.fwd_format;
  if (c.scaling == Scaling::kDelayed) {
    q = std::make_unique<DelayedScalingQuantizer>(format, state, role);
  } else if (c.scaling == Scaling::kCurrent) {
    q = std::make_unique<CurrentScalingQuantizer>(format, c.epsilon);
  }
  if (c.debug.active) q = std::make_unique<DebugQuantizer>(std::move(q), role, c.debug);
  return q;
}

bool gathers_input(const LinearConfig& c) {
  return c.parallel_mode == ParallelMode::kColumn && c.sequence_parallel;
}
bool gathers_grad(const LinearConfig& c) {
  return c.parallel_mode == ParallelMode::kRow && c.sequence_parallel;
}
// Whether backward keeps the high-precision input (re-quantized, used as it is, or reported).
bool saves_hp_input(const LinearConfig& c) {
  return !c.fp8() || c.save_original_input || c.debug.active;
}
// Column-parallel SP in FP8 keeps this rank's row-wise input bytes and re-gathers them.
bool keeps_local_fp8_input(const LinearConfig& c) { return gathers_input(c) && !saves_hp_input(c); }

// An empty placeholder output on `like`'s device. Zero elements need no memory, so it is made
// directly: at::empty's dispatch and allocator call cost ~0.5 us of host time each on the H200
// (measured in session 30), and a training step makes up to 16 placeholders.
at::Tensor nothing(const at::Tensor& like, at::ScalarType dtype) {
  const c10::Device device = like.device();
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, c10::DataPtr(nullptr, device),
                       c10::GetAllocator(device.type()), /*resizable=*/true);
  return at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::computeDispatchKey(dtype, at::kStrided, device)),
      c10::scalarTypeToTypeMeta(dtype));
}

}  // namespace

// (Not from the rows of y and x: there may be none.)
int64_t output_dim0(int64_t x_dim0, const LinearConfig& c) {
  if (!c.sequence_parallel) return x_dim0;
  const int64_t tp = c.tp_group->getSize();
  return c.parallel_mode == ParallelMode::kColumn ? x_dim0 * tp : x_dim0 / tp;
}

namespace {

// The output's shape for input `x`: x's, the last dimension n, dim 0 as sequence parallelism
// leaves it.
std::vector<int64_t> output_shape(const at::Tensor& x, int64_t n, const LinearConfig& c) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n;
  shape[0] = output_dim0(shape[0], c);
  return shape;
}

void check_residual(const at::Tensor& residual, const at::Tensor& x, int64_t n,
                    const LinearConfig& c) {
  const std::vector<int64_t> shape = output_shape(x, n, c);
  TORCH_CHECK_VALUE(
      residual.sizes() == at::IntArrayRef(shape) && residual.scalar_type() == x.scalar_type() &&
          residual.device() == x.device(),
      "residual is added to the output, so it must be ", x.scalar_type(), " of the output's shape ",
      at::IntArrayRef(shape), " on ", x.device(), ", got ", residual.scalar_type(), " of shape ",
      residual.sizes(), " on ", residual.device(),
      "; convert it, or add it after the call (under torch.autocast the output "
      "has the autocast dtype)");
}

}  // namespace

// The one check of a Linear call's arguments (the fake kernels call it too): each failure is a
// ValueError that says what was given and how to fix it.
void check_inputs(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                  const LinearConfig& c, const DelayedState& state, const WeightCacheBuffers& cache,
                  const OptTensor& main_grad, const PrologueArgs& prologue,
                  const OptTensor& residual) {
  TORCH_CHECK_VALUE(weight.dim() == 2, "Linear weight must be 2-D [out, in], got ", weight.sizes());
  const int64_t n = weight.size(0), k = weight.size(1), k_in = prologue.input_cols(k);
  const bool row = c.parallel_mode == ParallelMode::kRow;
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) == k_in, "Linear expects input [..., ",
                    k_in == k ? "in_features=" : "2 x in_features=", k_in, row ? " per rank" : "",
                    "], got shape ", x.sizes(), "; the last dimension must be ",
                    k_in == k ? "in_features" : "2 x in_features (SwiGLU's [gate | up])");
  check_prologue(prologue, x, k, row);
  const auto float_type = [](const at::Tensor& t) {
    const at::ScalarType d = t.scalar_type();
    return d == at::kFloat || d == at::kBFloat16 || d == at::kHalf;
  };
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK_VALUE(float_type(x), "Linear input must be float32, bfloat16 or float16, got ",
                    dtype);
  TORCH_CHECK_VALUE(x.device() == weight.device(), "Linear input is on ", x.device(),
                    " but its weight is on ", weight.device(), "; move the input (or the module)");
  TORCH_CHECK_VALUE(!bias || bias->device() == weight.device(), "bias is on ", bias->device(),
                    " but the weight on ", weight.device());
  TORCH_CHECK_VALUE(float_type(weight) && (!bias || float_type(*bias)),
                    "Linear weight and bias must be float32, bfloat16 or float16, got ",
                    weight.scalar_type(), bias ? " and " : "",
                    bias ? c10::toString(bias->scalar_type()) : "");
  TORCH_CHECK_VALUE(!bias || (bias->dim() == 1 && bias->size(0) == n), "bias must be [", n,
                    "], got shape ", bias ? bias->sizes() : at::IntArrayRef());
  TORCH_CHECK_VALUE(c.weight_cache == WeightCache::kNone || c.fp8(),
                    "the FP8 weight cache (is_first_microbatch) needs FP8 (fp8_autocast)");
  TORCH_CHECK_VALUE(
      c.parallel_mode == ParallelMode::kNone ? !c.sequence_parallel : bool(c.tp_group),
      "tensor parallelism needs tp_group, and sequence_parallel needs a parallel_mode");
  if (c.fp8()) {
    TORCH_CHECK_VALUE(k % kFp8Multiple == 0 && n % kFp8Multiple == 0,
                      "FP8 Linear needs in_features and out_features (per rank) to be multiples "
                      "of ",
                      kFp8Multiple, ", got ", k, " and ", n,
                      " (Hopper's FP8 GEMMs need it); pad the layer or run it outside "
                      "fp8_autocast");
    TORCH_CHECK_VALUE(!(c.save_original_input && c.scaling == Scaling::kDelayed),
                      "save_original_input=True cannot be used with delayed scaling: the scale "
                      "moves between forward and backward, so re-quantizing would not reproduce "
                      "the forward's FP8 input; use tpfp8.CurrentScaling() or "
                      "save_original_input=False");
    TORCH_CHECK_VALUE(c.weight_cache != WeightCache::kReuse || cache.rowwise.defined(),
                      "is_first_microbatch=False needs an earlier call with "
                      "is_first_microbatch=True to cache the FP8 weight");
    TORCH_CHECK_VALUE(
        c.weight_cache == WeightCache::kNone ||
            (cache.rowwise.sizes() == weight.sizes() && cache.columnwise.defined() &&
             cache.columnwise.sizes() == at::IntArrayRef({k, n}) && cache.scale_inv.defined() &&
             cache.scale_inv.numel() == 1 && cache.rowwise.scalar_type() == at::kByte &&
             cache.columnwise.scalar_type() == at::kByte &&
             cache.scale_inv.scalar_type() == at::kFloat),
        "the FP8 weight cache needs uint8 [", n, ", ", k, "] and [", k, ", ", n,
        "] buffers and a float32 scale_inv [1]");
    TORCH_CHECK_VALUE(
        c.scaling != Scaling::kDelayed || (state.scale.defined() && state.scale.numel() == 3 &&
                                           state.scale.device() == weight.device()),
        "delayed scaling needs the layer's scale [3] on the weight's device");
  } else {
    TORCH_CHECK_VALUE(dtype == weight.scalar_type(), "Linear input is ", dtype,
                      " but the weight is ", weight.scalar_type(),
                      "; convert one of them or use torch.autocast (outside FP8 both must match)");
  }
  if (main_grad) {
    TORCH_CHECK_VALUE(
        main_grad->scalar_type() == at::kFloat && main_grad->sizes() == weight.sizes() &&
            main_grad->device() == weight.device() && main_grad->is_contiguous(),
        "fuse_wgrad_accumulation needs weight.main_grad as float32 ", weight.sizes(),
        ", contiguous (the weight gradient GEMM writes it in place), on the weight's device ",
        weight.device(), ", got ", main_grad->is_contiguous() ? "" : "a non-contiguous ",
        main_grad->scalar_type(), " ", main_grad->sizes(), " on ", main_grad->device());
  }
  TORCH_CHECK_VALUE(!c.sequence_parallel || x.dim() >= 2,
                    "sequence parallelism splits the input's dim 0 (the sequence) over the group: "
                    "it needs [sequence, ..., features], got shape ",
                    x.sizes());
  if (row && c.sequence_parallel) {
    const int64_t tp = c.tp_group->getSize();
    TORCH_CHECK_VALUE(x.size(0) % tp == 0, "sequence length (dim 0)=", x.size(0),
                      " is not divisible by the tensor-parallel group size ", tp,
                      "; pad the sequence");
  }
  if (residual) check_residual(*residual, x, n, c);
}

namespace {

Fp8Tensor weight_fp8(const at::Tensor& weight, const Quantizer& q, const LinearConfig& c,
                     const WeightCacheBuffers& cache, bool columnwise) {
  const Fp8Tensor cached{cache.rowwise, cache.columnwise, cache.scale_inv, c.fwd_format};
  if (c.weight_cache == WeightCache::kReuse) return cached;
  const bool fill = c.weight_cache == WeightCache::kFill;
  return q.quantize(weight.contiguous(), true, columnwise || fill, fill ? &cached : nullptr);
}

// One operand of a GEMM: the tensor, its quantizer (null: high precision), and whether the
// GEMM reads it column-wise (contracting over its rows).
struct Use {
  const Prepared* t;
  const Quantizer* q;
  bool columnwise;
};

// The two operands of `gemm`: FP8 unless either tensor's quantizer asks for high precision.
std::pair<Operand, Operand> operands(Gemm gemm, const Use& a, const Use& b, at::ScalarType dtype) {
  const auto high = [gemm](const Use& u) { return !u.q || u.q->needs_high_precision(gemm); };
  const bool hp = high(a) || high(b);
  const auto one = [&](const Use& u) {
    return u.q ? u.q->operand(gemm, *u.t, u.columnwise, hp, dtype)
               : high_precision_operand(u.t->hp, dtype, u.columnwise);
  };
  return {one(a), one(b)};
}

// 1. The input of fprop: quantized by `q`, and gathered along rows under column-parallel SP;
//    what wgrad will need goes to `out`.
Prepared prepare_input(const at::Tensor& x2, const LinearConfig& c, const Quantizer* q,
                       bool need_wgrad, ForwardResult& out) {
  const bool gather = gathers_input(c);
  if (!c.fp8()) return {gather ? all_gather_rows(x2, *c.tp_group) : x2, {}};
  const bool columnwise = need_wgrad && !c.save_original_input;
  Prepared in;
  if (gather && q->quantizes_after_gather()) {
    // Quantize what the GEMMs see: the gathered tensor, whose amax is the global one.
    const at::Tensor total = all_gather_rows(x2, *c.tp_group);
    in = {total, q->quantize(total, true, columnwise)};
  } else if (gather) {
    Fp8Tensor local;
    in = {at::Tensor(), all_gather_fp8(x2, *q, c.tp_group, &local)};
    if (need_wgrad && keeps_local_fp8_input(c)) out.x_fp8 = local.rowwise;  // re-gathered later
  } else {
    in = {x2, q->quantize(x2, true, columnwise)};
  }
  if (columnwise && !out.x_fp8.defined()) out.x_fp8 = in.q.columnwise;
  out.x_scale_inv = in.q.scale_inv;
  return in;
}

// 2. The gradient: quantized by `q`, and gathered along rows under row-parallel SP. With `db`,
//    the column sums of this rank's dy (float32) come out of the cast's own read of dy; left
//    undefined where dy has no FP8 cast.
Prepared prepare_grad(const at::Tensor& dy, const LinearConfig& c, const Quantizer* q,
                      bool need_dgrad, bool need_wgrad, at::Tensor* db) {
  const bool gather = gathers_grad(c);
  if (!c.fp8()) return {gather ? all_gather_rows(dy, *c.tp_group) : dy, {}};
  OptTensor sum;
  if (db) sum = *db = at::empty({dy.size(1)}, dy.options().dtype(at::kFloat));
  if (!need_dgrad && !need_wgrad) {  // the bias's gradient alone (a frozen weight: BitFit)
    if (sum) column_sum(dy, *sum);   // (this rank's rows, as the casts below sum them)
    return {dy, {}};
  }
  if (!gather) return {dy, q->quantize(dy, need_dgrad, need_wgrad, nullptr, {}, sum)};
  if (q->quantizes_after_gather()) {
    // The gathered tensor's cast would sum every rank's rows; this rank's rows alone, by the
    // same kernel, keep db as the fast path makes it (debugging changes no result).
    if (sum) column_sum(dy, *sum);
    // Whole (gathered first): its local amax is the global.
    const at::Tensor total = all_gather_rows(dy, *c.tp_group);
    return {total, q->quantize(total, need_dgrad, need_wgrad)};
  }
  Fp8Tensor g = all_gather_fp8(dy, *q, c.tp_group, nullptr, sum);
  if (need_wgrad) {
    g.columnwise = at::empty({g.rowwise.size(1), g.rowwise.size(0)}, g.rowwise.options());
    transpose_fp8(g.rowwise, g.columnwise);
  }
  return {at::Tensor(), g};
}

// The input for wgrad: saved, re-gathered or re-quantized.
Prepared input_for_wgrad(const at::Tensor& x_saved, const at::Tensor& x_gathered,
                         const SavedForBackward& s, const LinearConfig& c, const Quantizer* q) {
  if (saves_hp_input(c)) {
    const at::Tensor hp = x_gathered.defined() ? x_gathered : x_saved;
    if (!c.fp8()) return {hp, {}};
    // The whole tensor is here (gathered, replicated or this rank's own): its local amax is
    // the one forward used, so the re-quantized bytes equal forward's.
    if (c.save_original_input) return {hp, q->quantize(hp, false, true)};
    // Debugging: forward's column-wise data, and the values for reports.
    return {hp, {at::Tensor(), s.x_fp8, s.x_scale_inv, c.fwd_format}};
  }
  Fp8Tensor saved{at::Tensor(), s.x_fp8, s.x_scale_inv, c.fwd_format};
  if (!x_gathered.defined()) return {at::Tensor(), saved};
  saved.columnwise = at::empty({x_gathered.size(1), x_gathered.size(0)}, x_gathered.options());
  transpose_fp8(x_gathered, saved.columnwise);
  return {at::Tensor(), saved};
}

// 1'. With a prologue: its kernel writes the FP8 input (this rank's rows under column-parallel
//     SP, gathered as FP8 bytes) where the recipe allows, else its high-precision output goes
//     the usual way. The output is kept where backward or the caller needs it.
Prepared prepare_prologue_input(const at::Tensor& x, int64_t k, const LinearConfig& c,
                                const Quantizer* q, const PrologueArgs& prologue, bool keep_output,
                                bool need_wgrad, ForwardResult& out) {
  const at::Tensor x2 = aligned_matrix(x, prologue.input_cols(k));
  PrologueStats stats;
  Prepared in;
  // Debugging needs the values and save_original_input re-quantizes them in backward: both
  // from the high-precision output, so that every usage comes from the same values.
  if (!c.fp8() || c.debug.active || c.save_original_input) {
    const at::Tensor y = prologue_high_precision(x2, prologue, stats);
    in = prepare_input(y, c, q, need_wgrad, out);
    if (keep_output || saves_hp_input(c)) out.x_hp = y;
  } else {
    const bool gather = gathers_input(c);
    if (keep_output) out.x_hp = at::empty({x2.size(0), k}, x2.options());
    const FusedCast fused = fused_prologue(x2, prologue, stats, out.x_hp);
    in.q = q->quantize_fused(fused, true, need_wgrad && !gather,
                             gather ? c.tp_group : ProcessGroupPtr());
    if (gather) {
      if (need_wgrad) out.x_fp8 = in.q.rowwise;  // this rank's rows, re-gathered in backward
      in.q.rowwise = all_gather_rows(in.q.rowwise, *c.tp_group);
    } else if (need_wgrad) {
      out.x_fp8 = in.q.columnwise;
    }
    out.x_scale_inv = in.q.scale_inv;
  }
  out.mean = stats.mean;
  out.rstd = stats.rstd;
  return in;
}

// 5'. With a prologue: its backward from dgrad's output (and the gradient of its output where
//     the module returned it); a norm's weight gradients are summed over the group when each
//     rank normalized its own rows (column-parallel SP).
//     With a handoff to give, an activation's backward writes dx in FP8 for the layer before.
void prologue_grads(Grads& out, const SavedForBackward& s, const LinearConfig& c, int64_t k,
                    const GradHandoff& handoff) {
  at::Tensor dy = out.dx;
  if (s.prologue_output_grad.defined()) dy = dy + as_matrix(s.prologue_output_grad, k);
  const at::Tensor x = as_matrix(s.prologue_input, s.prologue.input_cols(k));
  if (handoff.gives()) {
    TORCH_CHECK(c.fp8() && !c.debug.active && !s.prologue.norm(),
                "internal error: an FP8 gradient handoff needs an activation, FP8, no debugging");
    const auto q = make_quantizer(c, handoff.state, kGrad);
    const at::Tensor dy_c = dy.contiguous();
    if (handoff.dbias) out.dx_dbias = at::empty({x.size(1)}, x.options().dtype(at::kFloat));
    out.dx_fp8 = q->quantize_fused(
        fused_activation_backward(dy_c, x, s.prologue,
                                  handoff.dbias ? OptTensor(out.dx_dbias) : std::nullopt),
        handoff.rowwise, handoff.columnwise);
    out.dx = at::Tensor();
    return;
  }
  // (aligned: a misaligned one would send the whole kernel down its element-wise path)
  const OptTensor input_grad =
      s.input_grad.defined() ? OptTensor(aligned_matrix(s.input_grad, x.size(1))) : std::nullopt;
  PrologueGrads g = prologue_backward(dy.contiguous(), x, s.prologue, s.stats, input_grad);
  if (s.prologue.norm() && gathers_input(c)) {
    all_reduce(g.dweight, *c.tp_group, c10d::ReduceOp::SUM);
    if (s.prologue.bias) all_reduce(g.dbias, *c.tp_group, c10d::ReduceOp::SUM);
  }
  out.dx = shaped(g.dx, s.prologue_input.sizes());
  out.dprologue_weight = g.dweight;
  if (s.prologue.bias) out.dprologue_bias = g.dbias;
}

}  // namespace

ForwardResult linear_forward(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                             const LinearConfig& c, const DelayedState& state,
                             const WeightCacheBuffers& cache, bool need_dgrad, bool need_wgrad,
                             const PrologueArgs& prologue, bool keep_prologue_output,
                             const OptTensor& residual) {
  const int64_t n = weight.size(0), k = weight.size(1);
  ForwardResult out;
  const auto xq = make_quantizer(c, state, kInput), wq = make_quantizer(c, state, kWeight);
  // 1. The input of fprop: quantized (after any prologue, or by its kernel), and gathered along
  //    rows under column-parallel SP.
  const Prepared in = prologue.any() ? prepare_prologue_input(x, k, c, xq.get(), prologue,
                                                              keep_prologue_output, need_wgrad, out)
                                     : prepare_input(as_matrix(x, k), c, xq.get(), need_wgrad, out);
  // 2. The weight: FP8 row-wise for fprop (+ column-wise for dgrad), or the cache's.
  Prepared w{weight, {}};
  if (c.fp8()) {
    w.q = weight_fp8(weight, *wq, c, cache, need_dgrad);
    if (c.weight_cache == WeightCache::kNone) {
      if (need_dgrad) out.w_fp8 = w.q.columnwise;
      out.w_scale_inv = w.q.scale_inv;
    }
  }
  // 3. fprop. The bias and the residual are fused in the epilogue, except under row parallelism
  //    (each is added once, after the reduction) and where an FP8 GEMM writes fp32 (its
  //    epilogue takes a 16-bit bias).
  const auto [x_op, w_op] =
      operands(Gemm::kFprop, {&in, xq.get(), false}, {&w, wq.get(), false}, x.scalar_type());
  at::Tensor y = at::empty({x_op.data.size(0), n}, x.options());
  const bool row = c.parallel_mode == ParallelMode::kRow;
  const bool fuse_bias = bias && !row && !(x_op.scale_inv && y.scalar_type() == at::kFloat);
  // (The epilogue reads a contiguous bias; nn.Linear takes any, so a strided one is copied.)
  run_gemm(x_op, w_op, y,
           fuse_bias ? OptTensor(bias->to(y.scalar_type()).contiguous()) : std::nullopt, c.fp8(),
           false, residual && !row ? OptTensor(aligned_matrix(*residual, n)) : std::nullopt);
  // 4. Row parallel: sum the partial outputs over the group. (Folding the residual into one
  //    rank's epilogue would need it whole there; under SP each rank holds its rows only.)
  if (row && c.sequence_parallel) {
    y = reduce_scatter_rows(y, *c.tp_group);
  } else if (row) {
    all_reduce(y, *c.tp_group, c10d::ReduceOp::SUM);
  }
  if (bias && !fuse_bias) y.add_(bias->to(y.scalar_type()));
  if (residual && row) y.add_(as_matrix(*residual, n));

  out.y = shaped(y, output_shape(x, n, c));
  // Empty placeholders where backward needs nothing (an op returns tensors, not None).
  for (at::Tensor* t : {&out.x_fp8, &out.w_fp8}) {
    if (!t->defined()) *t = nothing(x, at::kByte);
  }
  for (at::Tensor* t : {&out.x_scale_inv, &out.w_scale_inv, &out.mean, &out.rstd}) {
    if (!t->defined()) *t = nothing(x, at::kFloat);
  }
  if (out.x_hp.defined()) {
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = k;
    out.x_hp = shaped(out.x_hp, shape);
  } else {
    out.x_hp = nothing(x, x.scalar_type());
  }
  return out;
}

Grads linear_backward(const at::Tensor& dy_in, const SavedForBackward& s, const at::Tensor& weight,
                      const LinearConfig& c, const DelayedState& state, const OptTensor& main_grad,
                      bool main_grad_overwrite, bool need_dgrad, bool need_wgrad,
                      std::optional<at::ScalarType> bias_dtype, const GradHandoff& handoff) {
  const int64_t n = weight.size(0), k = weight.size(1);
  // A handed-off dy is FP8 already: dy_in then only says where and in what dtype.
  const at::Tensor dy = handoff.dy ? dy_in : as_matrix(dy_in, n);
  TORCH_CHECK(!handoff.dy || (c.fp8() && !c.debug.active && !gathers_grad(c) &&
                              (!bias_dtype || handoff.dy_dbias.defined())),
              "internal error: an FP8 gradient handoff needs FP8, no debugging, no gathered "
              "gradient, and the column sums where there is a bias gradient");
  const auto xq = make_quantizer(c, state, kInput), wq = make_quantizer(c, state, kWeight),
             gq = make_quantizer(c, state, kGrad);
  const at::Tensor x_saved = s.x ? as_matrix(*s.x, k) : at::Tensor();

  // 1. Column-parallel SP: start re-gathering the input for wgrad; it overlaps dgrad.
  //    (Quantized after the gather, its column-wise data is whole already.)
  WorkPtr x_work;
  at::Tensor x_gathered;
  if (need_wgrad && gathers_input(c) && (saves_hp_input(c) || keeps_local_fp8_input(c))) {
    x_gathered = all_gather_rows(saves_hp_input(c) ? x_saved : s.x_fp8, *c.tp_group, &x_work);
  }
  // 2. The gradient: quantized, and gathered along rows under row-parallel SP; db's local sum
  //    from the same cast.
  at::Tensor db;
  const Prepared g = handoff.dy ? Prepared{at::Tensor(), *handoff.dy}
                                : prepare_grad(dy, c, gq.get(), need_dgrad, need_wgrad,
                                               bias_dtype ? &db : nullptr);
  const int64_t rows = handoff.dy
                           ? (g.q.rowwise.defined() ? g.q.rowwise.size(0) : g.q.columnwise.size(1))
                           : dy.size(0);
  if (handoff.dy && bias_dtype) db = handoff.dy_dbias;
  // 3. dgrad, then (column parallel) its reduction, in flight during wgrad.
  Grads out;
  WorkPtr dx_work;
  if (need_dgrad) {
    const Prepared w{weight, {at::Tensor(), s.w_fp8, s.w_scale_inv, c.fwd_format}};
    const auto [dy_op, w_op] =
        operands(Gemm::kDgrad, {&g, gq.get(), false}, {&w, wq.get(), true}, s.x_dtype);
    out.dx =
        run_gemm(dy_op, w_op, at::empty({dy_op.data.size(0), k}, dy.options().dtype(s.x_dtype)),
                 std::nullopt, false);
    if (c.parallel_mode == ParallelMode::kColumn && c.sequence_parallel) {
      out.dx = reduce_scatter_rows(out.dx, *c.tp_group, &dx_work);
    } else if (c.parallel_mode == ParallelMode::kColumn) {
      all_reduce(out.dx, *c.tp_group, c10d::ReduceOp::SUM, &dx_work);
    }
  }
  // 4. wgrad, into main_grad or a fresh dW.
  if (need_wgrad) {
    wait(x_work);
    const Prepared in = input_for_wgrad(x_saved, x_gathered, s, c, xq.get());
    const auto [dy_op, x_op] =
        operands(Gemm::kWgrad, {&g, gq.get(), true}, {&in, xq.get(), true}, s.x_dtype);
    const bool accumulate = main_grad && !main_grad_overwrite;
    at::Tensor dw = main_grad ? *main_grad : at::empty({n, k}, weight.options());
    if (rows > 0) {
      run_gemm(dy_op, x_op, dw, std::nullopt, false, accumulate);
    } else if (!accumulate) {
      dw.zero_();  // no tokens: an empty sum (cuBLASLt has no GEMM with K = 0)
    }
    if (!main_grad) out.dw = dw;
  }
  wait(dx_work);
  if (out.dx.defined() && s.prologue.any()) {
    prologue_grads(out, s, c, k, handoff);
  } else if (out.dx.defined()) {
    out.dx = shaped(out.dx, s.x_shape);
  }
  // 5. db: the local sum (step 2's, or here where dy had no FP8 cast); under row-parallel SP
  //    each rank holds part of the rows of dy.
  if (bias_dtype) {
    if (!db.defined()) db = dy.sum(0, false, at::kFloat);
    if (gathers_grad(c)) all_reduce(db, *c.tp_group, c10d::ReduceOp::SUM);
    // (A handed-in sum is the caller's tensor: the op's output must not alias it.)
    out.db = db.to(*bias_dtype, /*non_blocking=*/false, /*copy=*/handoff.dy != nullptr);
  }
  // (As forward's: ops return tensors.)
  for (at::Tensor* t : {&out.dx, &out.dw, &out.db, &out.dprologue_weight, &out.dprologue_bias}) {
    if (!t->defined()) *t = nothing(dy, dy.scalar_type());
  }
  for (at::Tensor* t : {&out.dx_fp8.rowwise, &out.dx_fp8.columnwise}) {
    if (!t->defined()) *t = nothing(dy, at::kByte);
  }
  for (at::Tensor* t : {&out.dx_fp8.scale_inv, &out.dx_dbias}) {
    if (!t->defined()) *t = nothing(dy, at::kFloat);
  }
  return out;
}

DelayedUpdate layers_update(const std::vector<at::Tensor>& scales,
                            const std::vector<at::Tensor>& scale_invs,
                            const std::vector<at::Tensor>& histories,
                            const std::vector<at::Tensor>& grad_histories,
                            const std::vector<double>& fp8_max, int64_t margin,
                            bool use_history_max, const ProcessGroupPtr& amax_group,
                            const std::vector<at::Tensor>& previous) {
  const size_t n = scales.size();
  TORCH_CHECK_VALUE(scale_invs.size() == n && histories.size() == n && grad_histories.size() == n,
                    "layers_update: one scale_inv, history and gradient history per layer (", n,
                    "), got ", scale_invs.size(), ", ", histories.size(), " and ",
                    grad_histories.size());
  TORCH_CHECK_VALUE(previous.empty() || previous.size() == n,
                    "layers_update: one `previous` buffer per layer, got ", previous.size(),
                    " for ", n, " layers");
  std::vector<at::Tensor> all_histories, all_scales, all_scale_invs, all_previous;
  std::vector<int64_t> offsets;
  for (size_t j = 0; j < n; ++j) {  // forward (input, weight): slots 0-1; gradient: 2
    all_histories.insert(all_histories.end(), {histories[j], grad_histories[j]});
    all_scales.insert(all_scales.end(), {scales[j], scales[j]});
    all_scale_invs.insert(all_scale_invs.end(), {scale_invs[j], scale_invs[j]});
    if (!previous.empty()) all_previous.insert(all_previous.end(), {previous[j], previous[j]});
    offsets.insert(offsets.end(), {0, 2});
  }
  // (The update kernel keeps the previous scales itself: no copy launched before it.)
  return DelayedUpdate(all_histories, all_scales, all_scale_invs, fp8_max, margin, use_history_max,
                       amax_group, offsets, all_previous);
}

Fp8Tensor all_gather_fp8(const at::Tensor& local, const Quantizer& quantizer,
                         const ProcessGroupPtr& group, Fp8Tensor* local_out,
                         const OptTensor& dbias) {
  Fp8Tensor q = quantizer.quantize(local.contiguous(), true, false, nullptr, group, dbias);
  if (local_out) *local_out = q;
  q.rowwise = all_gather_rows(q.rowwise, *group);  // FP8 bytes: half of bf16's traffic
  return q;
}

}  // namespace tpfp8
