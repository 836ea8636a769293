// Backward of the LayerNorm / RMSNorm of norm_cast.h, from the statistics its forward saved:
// one read of x and dy writes dx, and per-band column sums that a second, small kernel adds
// into dgamma and dbeta.
//
// Per element (fp32, every operation one IEEE operation rounded to nearest, no FMA):
//   xhat = (x - mean) * rstd (LayerNorm), x * rstd (RMSNorm)         norm_xhat
//   g    = dy * gamma
//   dx   = rstd * ((g - mean_g) - xhat * mean_gx)  (RMSNorm: without "- mean_g")   norm_dx
//   dx  += dx_add, where given (a skip connection's gradient), before dx's one rounding
// with mean_g = sum_row(g) / hidden and mean_gx = sum_row(g * xhat) / hidden, and
//   dgamma[c] = sum over rows of dy * xhat,   dbeta[c] = sum over rows of dy   (LayerNorm)
//
// The reduction order is part of the op's definition, so the CUDA kernels and the CPU reference
// give the same bytes (dx, dgamma, dbeta):
//   - row sums as norm_cast.h's but over kNormLanes (256) lanes at every width (the forward
//     takes 128 up to 4096): lane l owns the 8-element chunks l, l + kNormLanes, ... and adds
//     its terms in order into an fp32 partial starting at +0; the lanes' partials reduce as
//     warps of 32 (butterfly: lane i += lane i ^ 16, ^8, ^4, ^2, ^1), then the kNormLanes / 32
//     warp sums are added in warp order (starting from warp 0's);
//   - column sums in two stages over bands of norm_backward_band_rows(rows) consecutive rows
//     (the last band may be short):
//       partial[b][c] = +0 + term(r0, c) + term(r0 + 1, c) + ...    over the rows of band b
//       group[j][c]   = +0 + partial[j][c] + partial[j + 8][c] + ... (bands b = j mod 8, j < 8)
//       out[c]        = +0 + group[0][c] + group[1][c] + ... + group[7][c]
//     (cast.h's dbias order, with bands for its tiles), so no float atomics and no dependence
//     on the GPU's size. A NaN result is stored as the canonical quiet NaN.
#pragma once

#include <cstdint>

#include "dtype.h"
#include "fp8_format.h"
#include "launch.h"
#include "norm_cast.h"

namespace tpfp8 {

constexpr int kNormBwdGroups = 8;         // fixed groups of the second column-sum stage
constexpr int64_t kNormBwdMinBand = 8;    // rows per band: from 8 ...
constexpr int64_t kNormBwdMaxBand = 128;  // ... doubling up to 128 ...
constexpr int64_t kNormBwdBands = 256;    // ... until there are at most this many bands

// Rows per band of the column sums, from the shape alone: enough bands to fill a GPU (a block
// per band), few enough that the fp32 partials stay small beside x and dy.
inline int64_t norm_backward_band_rows(int64_t rows) {
  int64_t band = kNormBwdMinBand;
  while (band < kNormBwdMaxBand && (rows + band - 1) / band > kNormBwdBands) band *= 2;
  return band;
}
inline int64_t norm_backward_bands(int64_t rows) {
  const int64_t band = norm_backward_band_rows(rows);
  return (rows + band - 1) / band;
}

TPFP8_HD float norm_xhat(float x, float mean, float rstd, NormType n) {
  return mul_rn(n == NormType::kLayerNorm ? sub_rn(x, mean) : x, rstd);
}
TPFP8_HD float norm_dx(float g, float xhat, float rstd, float mean_g, float mean_gx, NormType n) {
  const float centered = n == NormType::kLayerNorm ? sub_rn(g, mean_g) : g;
  return mul_rn(rstd, sub_rn(centered, mul_rn(xhat, mean_gx)));
}

// One norm backward over [rows, hidden] (hidden % 16 == 0, hidden <= kNormMaxHidden; rows may
// be 0, which writes zeros to dgamma / dbeta).
//   dy, x, dx  [rows, hidden] in `dtype`, dense (any alignment; 16 bytes is the fast path)
//   dx_add     [rows, hidden] in `dtype`, dense, or nullptr: added to dx (the gradient that
//              reaches x past the norm, as in x + f(norm(x))), so no separate add kernel runs
//   mean, rstd [rows] fp32 as norm_cast wrote them (mean: LayerNorm only)
//   gamma      [hidden] fp32
//   dgamma, dbeta [hidden] fp32 (nullptr: not computed; dbeta must be for RMSNorm)
//   partial    GPU workspace [2][norm_backward_bands(rows)][hidden] fp32, needed with dgamma or
//              dbeta: dgamma's band sums, then dbeta's (the CPU reference needs none)
struct NormBackwardParams {
  const void* dy = nullptr;
  const void* x = nullptr;
  DType dtype = DType::kFloat32;
  int64_t rows = 0;
  int64_t hidden = 0;
  NormType norm = NormType::kLayerNorm;
  const float* mean = nullptr;
  const float* rstd = nullptr;
  const float* gamma = nullptr;
  void* dx = nullptr;
  const void* dx_add = nullptr;
  float* dgamma = nullptr;
  float* dbeta = nullptr;
  float* partial = nullptr;
};

inline int64_t norm_backward_workspace_floats(int64_t rows, int64_t hidden) {
  return 2 * norm_backward_bands(rows) * hidden;
}

// What a NormBackwardParams may not be, in words (nullptr when valid): the launcher returns
// cudaErrorInvalidValue and the CPU reference does nothing for such params.
const char* norm_backward_invalid(const NormBackwardParams& p);

// dx, then (if asked for) dgamma / dbeta: two launches, no synchronisation.
cudaError_t norm_backward_cuda(const NormBackwardParams& p, cudaStream_t stream);
void norm_backward_cpu(const NormBackwardParams& p);

}  // namespace tpfp8
