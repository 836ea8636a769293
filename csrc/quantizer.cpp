// Quantizers (quantizer.h) over the cast ops.
#include "quantizer.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <limits>
#include <mutex>

#include "device_dispatch.h"
#include "kernels/gemm.h"

namespace tpfp8 {

const char* gemm_name(Gemm g) {
  static const char* const names[] = {"fprop", "dgrad", "wgrad"};
  return names[static_cast<int>(g)];
}

namespace {

int64_t gemm_code(const at::Tensor& t) {
  const at::ScalarType d = t.scalar_type();
  return static_cast<int64_t>(d == at::kBFloat16 ? GemmType::kBFloat16
                              : d == at::kHalf   ? GemmType::kFloat16
                                                 : GemmType::kFloat32);
}

// Column-wise FP8 data [rows, M] contracted over M in wgrad: zero codes pad M to a multiple
// of 16, which adds exact zeros to the sum. No copy when M is already aligned.
at::Tensor pad_contracted(const at::Tensor& t) {
  const int64_t pad = (kFp8Multiple - t.size(1) % kFp8Multiple) % kFp8Multiple;
  return pad == 0 ? t : at::constant_pad_nd(t, {0, pad}, 0);
}

OptTensor optional(const at::Tensor& t, bool wanted = true) {
  return wanted && t.defined() ? OptTensor(t) : std::nullopt;
}

}  // namespace

Operand high_precision_operand(const at::Tensor& t, at::ScalarType dtype, bool transposed) {
  const at::Tensor used = t.to(dtype).contiguous();
  return {used, std::nullopt, gemm_code(used), transposed};
}

Operand Quantizer::operand(Gemm, const Prepared& t, bool columnwise, bool high_precision,
                           at::ScalarType dtype) const {
  if (high_precision) return high_precision_operand(t.hp, dtype, columnwise);
  const int64_t type = static_cast<int64_t>(gemm_type(t.q.format));
  if (columnwise) return {pad_contracted(t.q.columnwise), t.q.scale_inv, type};
  return {t.q.rowwise, t.q.scale_inv, type};
}

Fp8Tensor Quantizer::outputs(const at::Tensor& x, bool rowwise, bool columnwise,
                             const Fp8Tensor* into) const {
  if (!into) return outputs(x.size(0), x.size(1), x.options(), rowwise, columnwise);
  Fp8Tensor out = *into;
  if (!rowwise) out.rowwise = at::Tensor();
  if (!columnwise) out.columnwise = at::Tensor();
  out.format = format();
  return out;
}

Fp8Tensor Quantizer::outputs(int64_t rows, int64_t cols, const at::TensorOptions& options,
                             bool rowwise, bool columnwise) const {
  Fp8Tensor out;
  const auto u8 = options.dtype(at::kByte);
  if (rowwise) out.rowwise = at::empty({rows, cols}, u8);
  if (columnwise) out.columnwise = at::empty({cols, rows}, u8);
  out.scale_inv = at::empty({1}, options.dtype(at::kFloat));
  out.format = format();
  return out;
}

Fp8Tensor Quantizer::quantize_fused(const FusedCast&, bool, bool, const ProcessGroupPtr&) const {
  TORCH_CHECK_VALUE(false,
                    "this recipe's quantizer has no cast fused into a norm or activation kernel "
                    "(Quantizer::quantize_fused), which the fused modules need; use "
                    "tpfp8.Linear behind torch's norm or activation instead");
}

Fp8Tensor DelayedScalingQuantizer::quantize(const at::Tensor& x, bool rowwise, bool columnwise,
                                            const Fp8Tensor* into,
                                            const ProcessGroupPtr& /*split_over*/,
                                            const OptTensor& dbias) const {
  Fp8Tensor out = outputs(x, rowwise, columnwise, into);
  cast_transpose_slots(x, scale_, role_, optional(out.rowwise, rowwise),
                       optional(out.columnwise, columnwise), optional(history_), amax_index(),
                       out.scale_inv, static_cast<int64_t>(format()), dbias);
  return out;
}

// The history is tensor-major: this tensor's newest amax is the first of its row.
int64_t DelayedScalingQuantizer::amax_index() const {
  return (role_ == kGrad ? 0 : role_) * (history_.defined() ? history_.size(1) : 0);
}

Fp8Tensor DelayedScalingQuantizer::quantize_fused(const FusedCast& fused, bool rowwise,
                                                  bool columnwise,
                                                  const ProcessGroupPtr& /*split_over*/) const {
  Fp8Tensor out = outputs(fused.rows, fused.cols, fused.options, rowwise, columnwise);
  CastScale s;
  s.scale = scale_.narrow(0, role_, 1);
  if (history_.defined()) s.amax = history_.view(-1).narrow(0, amax_index(), 1);
  fused.cast(out, s);
  return out;
}

Fp8Tensor CurrentScalingQuantizer::quantize(const at::Tensor& x, bool rowwise, bool columnwise,
                                            const Fp8Tensor* into,
                                            const ProcessGroupPtr& split_over,
                                            const OptTensor& dbias) const {
  Fp8Tensor out = outputs(x, rowwise, columnwise, into);
  const at::Tensor a = amax_of(x.options(), [&](at::Tensor& a) { amax(x, a); }, split_over);
  // dbias rides on the cast pass, not the amax pass: the cast is the tiled kernel whose fixed
  // order of additions delayed scaling shares (one kernel, one CPU reference), while the amax
  // is a flat sweep with no column structure. Both read x; the cast mostly from L2.
  cast_transpose_current(x, a, epsilon_, optional(out.rowwise, rowwise),
                         optional(out.columnwise, columnwise), out.scale_inv,
                         static_cast<int64_t>(format()), dbias);
  return out;
}

Fp8Tensor CurrentScalingQuantizer::quantize_fused(const FusedCast& fused, bool rowwise,
                                                  bool columnwise,
                                                  const ProcessGroupPtr& split_over) const {
  Fp8Tensor out = outputs(fused.rows, fused.cols, fused.options, rowwise, columnwise);
  CastScale s;
  s.scale_amax = amax_of(fused.options, [&](at::Tensor& a) { fused.amax(a); }, split_over);
  s.epsilon = epsilon_;
  fused.cast(out, s);
  return out;
}

at::Tensor CurrentScalingQuantizer::amax_of(const at::TensorOptions& options,
                                            const std::function<void(at::Tensor&)>& pass,
                                            const ProcessGroupPtr& split_over) const {
  at::Tensor a = at::empty({1}, options.dtype(at::kFloat));
  zero_bytes(a);
  pass(a);
  if (split_over) {
    // NaN as Inf, as the delayed update's reduction does: every rank then gets the same (unit)
    // scale for a bad step, whatever the backend makes of NaN in MAX.
    const double inf = std::numeric_limits<double>::infinity();
    a.nan_to_num_(inf, inf, inf);
    all_reduce(a, *split_over, c10d::ReduceOp::MAX);
  }
  return a;
}

DelayedUpdate::DelayedUpdate(const std::vector<at::Tensor>& histories,
                             const std::vector<at::Tensor>& scales,
                             const std::vector<at::Tensor>& scale_invs,
                             const std::vector<double>& fp8_max, int64_t margin,
                             bool use_history_max, ProcessGroupPtr amax_group,
                             at::IntArrayRef scale_offsets, const std::vector<at::Tensor>& previous)
    : batches_(delayed_scaling_batches(histories, scales, scale_invs, fp8_max, margin,
                                       use_history_max, scale_offsets, previous)),
      amax_group_(std::move(amax_group)) {
  for (const auto* tensors : {&histories, &scales, &scale_invs, &previous}) {
    for (size_t j = 0; j < tensors->size(); ++j) {
      const at::Tensor& t = (*tensors)[j];
      if (j > 0 && t.is_same((*tensors)[j - 1])) continue;  // (a layer's slots of one tensor)
      held_.emplace_back(t);
    }
  }
  if (amax_group_) {
    newest_ = c10::fmap(histories, [](const at::Tensor& h) { return h.select(1, 0); });
    newest_sizes_ = c10::fmap(histories, [](const at::Tensor& h) { return h.size(0); });
  }
}

DelayedUpdate::Held::Held(const at::Tensor& t)
    : tensor(t),
      storage(t.storage()),
      data(t.const_data_ptr()),
      dtype(t.scalar_type()),
      sizes(t.sizes().vec()),
      strides(t.strides().vec()) {}

bool DelayedUpdate::Held::unchanged() const {
  return tensor.const_data_ptr() == data && tensor.scalar_type() == dtype &&
         tensor.sizes() == at::IntArrayRef(sizes) && tensor.strides() == at::IntArrayRef(strides);
}

bool DelayedUpdate::unchanged() const {
  return std::all_of(held_.begin(), held_.end(), [](const Held& h) { return h.unchanged(); });
}

void DelayedUpdate::run() const {
  TORCH_CHECK(unchanged(),
              "DelayedUpdate: a state tensor's storage or shape changed since the update was "
              "built; build it again");
  launch();
}

void DelayedUpdate::launch() const {
  if (batches_.empty()) return;
  if (amax_group_) {  // one collective for all the layers' amaxes
    at::Tensor amax = at::cat(newest_);
    // NaN as Inf: MAX then orders every rank's values alike (a NaN's fate in MAX depends on the
    // backend and on the order of operands), and the bad step is dropped on every rank.
    const double inf = std::numeric_limits<double>::infinity();
    amax.nan_to_num_(inf, inf, inf);
    all_reduce(amax, *amax_group_, c10d::ReduceOp::MAX);
    // Written like the kernels write the rest of the state, without a version bump: what
    // saved these tensors (a compiled backward) reads them live, as it should.
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    at::_foreach_copy_(newest_, amax.split_with_sizes(newest_sizes_));
  }
  // Two threads stepping one layer update it one at a time (the CPU reference rolls the
  // history on the host). Not under an amax group: holding a lock across a collective could
  // deadlock against another rank's order.
  static std::mutex mutex;
  std::unique_lock<std::mutex> lock(mutex, std::defer_lock);
  if (!amax_group_) lock.lock();
  // Named as the op, so that profiles (and tests) count the launches.
  RECORD_FUNCTION("tpfp8::delayed_scaling_update_many", std::vector<c10::IValue>());
  run_delayed_scaling_batches(held_.front().tensor, batches_);  // (histories[0]'s device)
}

}  // namespace tpfp8
