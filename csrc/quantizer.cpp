// Quantizers (quantizer.h) over the cast ops.
#include "quantizer.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/record_function.h>

#include <limits>
#include <mutex>

#include "device_dispatch.h"
#include "ops.h"

namespace tpfp8 {

Fp8Tensor quantize(const at::Tensor& x, const QuantizerSpec& q, bool rowwise, bool columnwise,
                   const Fp8Tensor* into) {
  TORCH_CHECK(q.scaling != Scaling::kNone, "quantize called with a high-precision quantizer");
  Fp8Tensor out;
  const auto u8 = x.options().dtype(at::kByte);
  if (into) {
    out = *into;
    if (!rowwise) out.rowwise = at::Tensor();
    if (!columnwise) out.columnwise = at::Tensor();
  } else {
    if (rowwise) out.rowwise = at::empty({x.size(0), x.size(1)}, u8);
    if (columnwise) out.columnwise = at::empty({x.size(1), x.size(0)}, u8);
    out.scale_inv = at::empty({1}, x.options().dtype(at::kFloat));
  }
  out.format = q.format;
  OptTensor row = rowwise ? OptTensor(out.rowwise) : std::nullopt;
  OptTensor col = columnwise ? OptTensor(out.columnwise) : std::nullopt;
  const auto fmt = static_cast<int64_t>(q.format);
  if (q.scaling == Scaling::kDelayed) {
    cast_transpose(x, q.scale, row, col, q.amax.defined() ? OptTensor(q.amax) : std::nullopt,
                   out.scale_inv, fmt);
    return out;
  }
  at::Tensor a = at::empty({1}, x.options().dtype(at::kFloat));
  zero_bytes(a);
  amax(x, a);
  if (q.reduce_amax) q.reduce_amax(a);
  cast_transpose_current(x, a, q.epsilon, row, col, out.scale_inv, fmt);
  return out;
}

void update_delayed(const std::vector<at::Tensor>& histories, const std::vector<at::Tensor>& scales,
                    const std::vector<at::Tensor>& scale_invs, const std::vector<double>& fp8_max,
                    int64_t margin, bool use_history_max, const ProcessGroupPtr& amax_group) {
  if (histories.empty()) return;
  if (amax_group) {  // one collective for all the layers' amaxes
    const auto newest = c10::fmap(histories, [](const at::Tensor& h) { return h.select(1, 0); });
    at::Tensor amax = at::cat(newest);
    // NaN as Inf: MAX then orders every rank's values alike (a NaN's fate in MAX depends on the
    // backend and on the order of operands), and the bad step is dropped on every rank.
    const double inf = std::numeric_limits<double>::infinity();
    amax.nan_to_num_(inf, inf, inf);
    all_reduce(amax, *amax_group, c10d::ReduceOp::MAX);
    // Written like the kernels write the rest of the state, without a version bump: what
    // saved these tensors (a compiled backward) reads them live, as it should.
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    at::_foreach_copy_(newest, amax.split_with_sizes(c10::fmap(
                                   newest, [](const at::Tensor& t) { return t.size(0); })));
  }
  // Two threads stepping one layer update it one at a time (the CPU reference rolls the
  // history on the host). Not under an amax group: holding a lock across a collective could
  // deadlock against another rank's order.
  static std::mutex mutex;
  std::unique_lock<std::mutex> lock(mutex, std::defer_lock);
  if (!amax_group) lock.lock();
  // Named as the op, so that profiles (and tests) count the launches.
  RECORD_FUNCTION("tpfp8::delayed_scaling_update_many", std::vector<c10::IValue>());
  delayed_scaling_update_many(histories, scales, scale_invs, fp8_max, margin, use_history_max);
}

}  // namespace tpfp8
