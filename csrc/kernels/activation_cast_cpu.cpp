// CPU reference of activation_cast.h: a plain loop over activation_element and the shared
// FP8 encoder, the oracle the CUDA kernel is compared with byte for byte.
#include <algorithm>
#include <vector>

#include "activation_cast.h"

namespace tpfp8 {
namespace {

template <Activation A, bool kBackward, typename T>
void activation_cast_typed(const ActivationCastParams& p) {
  const T* x = static_cast<const T*>(p.input);
  const T* dy = static_cast<const T*>(p.grad);
  T* out = static_cast<T*>(p.out);
  const int64_t in_cols = p.in_cols(), out_cols = p.out_cols();
  const float scale = scale_source(p).resolve(p.format);
  const bool two = A == Activation::kSwiGLU && kBackward;
  uint32_t amax = 0;
  // The fp32 results for the column sums, which take cast.h's order over the whole matrix.
  std::vector<float> ys(kBackward && p.dbias ? p.rows * out_cols : 0);
  auto put = [&](int64_t r, int64_t c, float y) {
    amax = std::max(amax, abs_bits(y));
    if (!ys.empty()) ys[r * out_cols + c] = y;
    if (out) out[r * out_cols + c] = from_float<T>(y);
    const uint8_t code = encode_fp8(mul_rn(y, scale), p.format);
    if (p.rowwise) p.rowwise[r * out_cols + c] = code;
    if (p.columnwise) p.columnwise[c * p.rows + r] = code;
  };
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t k = 0; k < p.n; ++k) {
      const float x0 = to_float(x[r * in_cols + k]);
      const float x1 = A == Activation::kSwiGLU ? to_float(x[r * in_cols + p.n + k]) : 0.0f;
      const float g = kBackward ? to_float(dy[r * p.n + k]) : 0.0f;
      float y0 = 0.0f, y1 = 0.0f;
      activation_element<A, kBackward>(x0, x1, g, y0, y1);
      put(r, k, y0);
      if (two) put(r, p.n + k, y1);
    }
  }
  if (p.amax) *p.amax = bits_float(std::max(float_bits(*p.amax), amax));
  if (p.scale_inv) *p.scale_inv = div_rn(1.0f, scale);
  if (kBackward && p.dbias) column_sums_cpu(ys.data(), p.rows, out_cols, p.dbias, p.dbias_partial);
}

}  // namespace

void activation_cast_cpu(const ActivationCastParams& p) {
  dispatch_dtype(p.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (p.activation == Activation::kGelu) {
      p.backward ? activation_cast_typed<Activation::kGelu, true, T>(p)
                 : activation_cast_typed<Activation::kGelu, false, T>(p);
    } else {
      p.backward ? activation_cast_typed<Activation::kSwiGLU, true, T>(p)
                 : activation_cast_typed<Activation::kSwiGLU, false, T>(p);
    }
  });
}

}  // namespace tpfp8
