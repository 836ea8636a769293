// CPU reference of norm_cast.h: the kernel's reduction tree emulated lane by lane, then the
// shared per-element math, so every byte equals the CUDA kernel's.
#include <algorithm>
#include <vector>

#include "norm_cast.h"

namespace tpfp8 {
namespace {

// The row's sum in the order norm_cast.h defines: each lane folds its columns c into its
// partial s as add(s, c) does, then the lanes' partials add up.
template <typename Add>
float tree_sum(int64_t hidden, Add&& add) {
  const int n = norm_lanes(hidden);
  float lanes[kNormLanes];
  for (int l = 0; l < n; ++l) {
    float s = 0.0f;
    for (int64_t c0 = int64_t{l} * 8; c0 < hidden; c0 += int64_t{n} * 8) {
      for (int j = 0; j < 8; ++j) s = add(s, c0 + j);
    }
    lanes[l] = s;
  }
  float total = 0.0f;
  for (int w = 0; w < n / 32; ++w) {
    float* v = lanes + 32 * w;
    for (int offset = 16; offset >= 1; offset /= 2) {
      float next[32];
      for (int i = 0; i < 32; ++i) next[i] = add_rn(v[i], v[i ^ offset]);
      std::copy(next, next + 32, v);
    }
    total = w == 0 ? v[0] : add_rn(total, v[0]);
  }
  return total;
}

template <typename T>
void norm_typed(const NormCastParams& p, bool amax_only) {
  const T* in = static_cast<const T*>(p.input);
  const float scale = ScaleSource{p.scale, p.scale_amax, p.scale_epsilon}.resolve(p.format);
  std::vector<float> x(p.hidden);
  uint32_t amax = 0;
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t c = 0; c < p.hidden; ++c) x[c] = to_float(in[r * p.hidden + c]);
    const float mean =
        p.norm == NormType::kLayerNorm
            ? div_rn(tree_sum(p.hidden, [&](float s, int64_t c) { return add_rn(s, x[c]); }),
                     static_cast<float>(p.hidden))
            : 0.0f;
    const float rstd = norm_rstd(
        tree_sum(p.hidden,
                 [&](float s, int64_t c) { return norm_square_add(s, x[c], mean, p.norm); }),
        p.hidden, p.eps);
    for (int64_t c = 0; c < p.hidden; ++c) {
      const T y = from_float<T>(
          norm_apply(x[c], mean, rstd, p.gamma[c], p.beta ? p.beta[c] : 0.0f, p.norm));
      const float yf = to_float(y);
      amax = std::max(amax, abs_bits(yf));
      if (amax_only) continue;
      if (p.out) static_cast<T*>(p.out)[r * p.hidden + c] = y;
      const uint8_t code = encode_fp8(mul_rn(yf, scale), p.format);
      if (p.rowwise) p.rowwise[r * p.hidden + c] = code;
      if (p.columnwise) p.columnwise[c * p.rows + r] = code;
    }
    if (amax_only) continue;
    if (p.mean) p.mean[r] = from_float<float>(mean);
    if (p.rstd) p.rstd[r] = from_float<float>(rstd);
  }
  if (p.amax) *p.amax = bits_float(std::max(float_bits(*p.amax), amax));
  if (p.scale_inv && !amax_only) *p.scale_inv = 1.0f / scale;
}

void run(const NormCastParams& p, bool amax_only) {
  if (norm_cast_invalid(p)) return;
  dispatch_dtype(p.dtype, [&](auto tag) { norm_typed<decltype(tag)>(p, amax_only); });
}

}  // namespace

const char* norm_cast_invalid(const NormCastParams& p) {
  if (p.rows < 0 || p.hidden <= 0 || p.hidden % kNormHiddenAlign != 0) {
    return "hidden must be a positive multiple of 16 (the FP8 GEMMs' alignment)";
  }
  if (p.hidden > kNormMaxHidden) return "hidden must be at most 16384";
  if (!p.input && p.rows > 0) return "input is null";
  if (!p.gamma) return "gamma is null";
  if (p.norm == NormType::kRMSNorm && (p.beta || p.mean)) return "RMSNorm has no beta and no mean";
  if ((p.rowwise || p.columnwise) && !p.scale && !p.scale_amax)
    return "an FP8 output needs a scale";
  return nullptr;
}

void norm_cast_cpu(const NormCastParams& p) { run(p, false); }
void norm_cast_amax_cpu(const NormCastParams& p) {
  if (p.amax) run(amax_pass_params(p), true);
}

}  // namespace tpfp8
