// CPU reference of norm_backward.h: the kernel's row reduction emulated lane by lane and its
// band / group column sums in the same order, so every byte equals the CUDA kernels'.
#include <algorithm>
#include <vector>

#include "norm_backward.h"

namespace tpfp8 {
namespace {

// Row sums of two terms at once, in the order norm_backward.h defines; f(c, a, b) sets the two
// terms of column c.
template <typename F>
void tree_sum2(int64_t hidden, F&& f, float& sum_a, float& sum_b) {
  float la[kNormLanes], lb[kNormLanes];
  for (int l = 0; l < kNormLanes; ++l) {
    float a = 0.0f, b = 0.0f;
    for (int64_t c0 = int64_t{l} * 8; c0 < hidden; c0 += int64_t{kNormLanes} * 8) {
      for (int j = 0; j < 8; ++j) {
        float ta, tb;
        f(c0 + j, ta, tb);
        a = add_rn(a, ta), b = add_rn(b, tb);
      }
    }
    la[l] = a, lb[l] = b;
  }
  for (int w = 0; w < kNormLanes / 32; ++w) {
    float* va = la + 32 * w;
    float* vb = lb + 32 * w;
    for (int offset = 16; offset >= 1; offset /= 2) {
      float na[32], nb[32];
      for (int i = 0; i < 32; ++i) {
        na[i] = add_rn(va[i], va[i ^ offset]);
        nb[i] = add_rn(vb[i], vb[i ^ offset]);
      }
      std::copy(na, na + 32, va);
      std::copy(nb, nb + 32, vb);
    }
    sum_a = w == 0 ? va[0] : add_rn(sum_a, va[0]);
    sum_b = w == 0 ? vb[0] : add_rn(sum_b, vb[0]);
  }
}

// out[c] from the bands' partial sums ([bands][hidden]) in the fixed groups.
void sum_bands(const std::vector<float>& partial, int64_t bands, int64_t hidden, float* out) {
  for (int64_t c = 0; c < hidden; ++c) {
    float total = 0.0f;
    for (int j = 0; j < kNormBwdGroups; ++j) {
      float group = 0.0f;
      for (int64_t b = j; b < bands; b += kNormBwdGroups)
        group = add_rn(group, partial[b * hidden + c]);
      total = add_rn(total, group);
    }
    out[c] = from_float<float>(total);
  }
}

template <typename T>
void backward_typed(const NormBackwardParams& p) {
  const T* dy = static_cast<const T*>(p.dy);
  const T* x = static_cast<const T*>(p.x);
  T* dx = static_cast<T*>(p.dx);
  const T* dx_add = static_cast<const T*>(p.dx_add);
  const int64_t h = p.hidden, band_rows = norm_backward_band_rows(p.rows);
  const int64_t bands = norm_backward_bands(p.rows);
  const bool ln = p.norm == NormType::kLayerNorm;
  std::vector<float> dgamma_part(p.dgamma ? bands * h : 0), dbeta_part(p.dbeta ? bands * h : 0);
  std::vector<float> xr(h), dyr(h);
  for (int64_t b = 0; b < bands; ++b) {
    const int64_t r1 = std::min(p.rows, (b + 1) * band_rows);
    float* dg = p.dgamma ? dgamma_part.data() + b * h : nullptr;
    float* db = p.dbeta ? dbeta_part.data() + b * h : nullptr;
    if (dg) std::fill(dg, dg + h, 0.0f);
    if (db) std::fill(db, db + h, 0.0f);
    for (int64_t r = b * band_rows; r < r1; ++r) {
      for (int64_t c = 0; c < h; ++c) {
        xr[c] = to_float(x[r * h + c]);
        dyr[c] = to_float(dy[r * h + c]);
      }
      const float mean = ln ? p.mean[r] : 0.0f, rstd = p.rstd[r];
      float sum_g = 0.0f, sum_gx = 0.0f;
      tree_sum2(
          h,
          [&](int64_t c, float& g, float& gx) {
            const float xhat = norm_xhat(xr[c], mean, rstd, p.norm);
            const float gc = mul_rn(dyr[c], p.gamma[c]);
            g = gc, gx = mul_rn(gc, xhat);
          },
          sum_g, sum_gx);
      const float mean_g = div_rn(sum_g, static_cast<float>(h));
      const float mean_gx = div_rn(sum_gx, static_cast<float>(h));
      for (int64_t c = 0; c < h; ++c) {
        const float xhat = norm_xhat(xr[c], mean, rstd, p.norm);
        const float g = mul_rn(dyr[c], p.gamma[c]);
        const float d = norm_dx(g, xhat, rstd, mean_g, mean_gx, p.norm);
        dx[r * h + c] = from_float<T>(dx_add ? add_rn(d, to_float(dx_add[r * h + c])) : d);
        if (dg) dg[c] = add_rn(dg[c], mul_rn(dyr[c], xhat));
        if (db) db[c] = add_rn(db[c], dyr[c]);
      }
    }
  }
  if (p.dgamma) sum_bands(dgamma_part, bands, h, p.dgamma);
  if (p.dbeta) sum_bands(dbeta_part, bands, h, p.dbeta);
}

}  // namespace

const char* norm_backward_invalid(const NormBackwardParams& p) {
  if (p.rows < 0 || p.hidden <= 0 || p.hidden % kNormHiddenAlign != 0) {
    return "hidden must be a positive multiple of 16 (the FP8 GEMMs' alignment)";
  }
  if (p.hidden > kNormMaxHidden) return "hidden must be at most 16384";
  if (!p.gamma) return "gamma is null";
  if (p.norm == NormType::kRMSNorm && (p.mean || p.dbeta))
    return "RMSNorm has no mean and no dbeta";
  if (p.rows > 0 && (!p.dy || !p.x || !p.dx || !p.rstd)) return "dy, x, dx or rstd is null";
  if (p.rows > 0 && p.norm == NormType::kLayerNorm && !p.mean) return "LayerNorm needs the mean";
  return nullptr;
}

void norm_backward_cpu(const NormBackwardParams& p) {
  if (norm_backward_invalid(p)) return;
  dispatch_dtype(p.dtype, [&](auto tag) { backward_typed<decltype(tag)>(p); });
}

}  // namespace tpfp8
