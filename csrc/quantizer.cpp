// Quantizers (quantizer.h) over the cast ops.
#include "quantizer.h"

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
    cast_transpose(x, q.scale, row, col, q.amax, out.scale_inv, fmt);
    return out;
  }
  at::Tensor a = at::zeros({1}, x.options().dtype(at::kFloat));
  amax(x, a);
  if (q.reduce_amax) q.reduce_amax(a);
  cast_transpose_current(x, a, q.epsilon, row, col, out.scale_inv, fmt);
  return out;
}

}  // namespace tpfp8
