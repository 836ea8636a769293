// Fused norm -> FP8 cast (kernels/norm_cast.h): the CPU reference against an fp64 norm, and
// CUDA bytes equal to the CPU reference for every norm, scaling, dtype, shape and output set.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <optional>

#include "cast_harness.h"
#include "kernels/norm_cast.h"

namespace tpfp8 {
namespace {

using namespace testing;

// Which outputs a run writes.
struct Outputs {
  bool out = true, row = true, col = true, stats = true;
};

struct NormOutputs {
  std::vector<uint8_t> out, rowwise, columnwise;  // out: the input dtype's bytes
  std::vector<float> mean, rstd;
  float amax = 0.0f, scale_inv = 0.0f;
};

struct Case {
  Shape s;
  NormType norm;
  Fp8Format format;
  Outputs o;
  std::optional<float> scale;  // delayed scaling; none: current scaling (epsilon 1e-6)
};

// Rows centred away from 0 with per-row spread, so LayerNorm's centering matters; a row of
// every 8 has a NaN or an inf (if there are enough rows) to check their propagation.
std::vector<float> norm_inputs(Shape s, uint64_t seed, bool specials = true) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(s.rows * s.cols);
  for (int64_t r = 0; r < s.rows; ++r) {
    const float offset = 3.0f * normal(rng), spread = std::exp2(2.0f * normal(rng));
    for (int64_t c = 0; c < s.cols; ++c) v[r * s.cols + c] = offset + spread * normal(rng);
  }
  if (specials && s.rows >= 8) {
    v[5 * s.cols + s.cols / 2] = NAN;
    v[7 * s.cols] = -INFINITY;
  }
  return v;
}

std::vector<float> weights(int64_t n, uint64_t seed, float mean) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(mean, 0.5f);
  std::vector<float> w(n);
  for (auto& x : w) x = normal(rng);
  return w;
}

template <typename T>
std::vector<uint8_t> bytes_of(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

NormCastParams params_for(const Case& k, const std::vector<float>& gamma,
                          const std::vector<float>& beta) {
  NormCastParams p;
  p.rows = k.s.rows, p.hidden = k.s.cols, p.norm = k.norm, p.format = k.format;
  p.eps = 1e-5f, p.scale_epsilon = 1e-6f;
  p.gamma = gamma.data();
  p.beta = k.norm == NormType::kLayerNorm ? beta.data() : nullptr;
  return p;
}

template <typename T>
NormOutputs norm_on_cpu(const std::vector<T>& in, const Case& k, const std::vector<float>& gamma,
                        const std::vector<float>& beta) {
  const size_t n = in.size();
  NormOutputs o;
  std::vector<T> out(k.o.out ? n : 0);
  o.rowwise.assign(k.o.row ? n : 0, 0xA5);
  o.columnwise.assign(k.o.col ? n : 0, 0xA5);
  const bool mean = k.o.stats && k.norm == NormType::kLayerNorm;
  o.mean.assign(mean ? k.s.rows : 0, -1.0f);
  o.rstd.assign(k.o.stats ? k.s.rows : 0, -1.0f);
  NormCastParams p = params_for(k, gamma, beta);
  p.input = in.data(), p.dtype = dtype_of<T>();
  p.out = k.o.out ? out.data() : nullptr;
  p.rowwise = k.o.row ? o.rowwise.data() : nullptr;
  p.columnwise = k.o.col ? o.columnwise.data() : nullptr;
  p.mean = mean ? o.mean.data() : nullptr;
  p.rstd = k.o.stats ? o.rstd.data() : nullptr;
  p.amax = &o.amax, p.scale_inv = &o.scale_inv;
  if (k.scale) {
    p.scale = &*k.scale;
    norm_cast_cpu(p);
  } else {  // as the op does: the amax pass, then the cast from that amax
    norm_cast_amax_cpu(p);
    p.scale_amax = p.amax, p.amax = nullptr;
    norm_cast_cpu(p);
  }
  o.out = bytes_of(out);
  return o;
}

#if defined(TPFP8_WITH_CUDA)
template <typename T>
NormOutputs norm_on_gpu(const std::vector<T>& in, const Case& k, const std::vector<float>& gamma,
                        const std::vector<float>& beta) {
  const size_t n = in.size();
  const bool mean = k.o.stats && k.norm == NormType::kLayerNorm;
  DeviceBuffer<T> d_in(in), d_out(k.o.out ? n : 0);
  DeviceBuffer<uint8_t> d_row(k.o.row ? n : 0), d_col(k.o.col ? n : 0);
  DeviceBuffer<float> d_gamma(gamma), d_beta(beta), d_mean(mean ? k.s.rows : 0),
      d_rstd(k.o.stats ? k.s.rows : 0), d_amax(std::vector<float>{0.0f}), d_scale_inv(1),
      d_scale(std::vector<float>{k.scale.value_or(1.0f)});
  NormCastParams p = params_for(k, gamma, beta);
  p.gamma = d_gamma.get();
  p.beta = k.norm == NormType::kLayerNorm ? d_beta.get() : nullptr;
  p.input = d_in.get(), p.dtype = dtype_of<T>();
  p.out = k.o.out ? d_out.get() : nullptr;
  p.rowwise = k.o.row ? d_row.get() : nullptr;
  p.columnwise = k.o.col ? d_col.get() : nullptr;
  p.mean = mean ? d_mean.get() : nullptr;
  p.rstd = k.o.stats ? d_rstd.get() : nullptr;
  p.amax = d_amax.get(), p.scale_inv = d_scale_inv.get();
  if (k.scale) {
    p.scale = d_scale.get();
    EXPECT_EQ(norm_cast_cuda(p, nullptr), cudaSuccess);
  } else {
    EXPECT_EQ(norm_cast_amax_cuda(p, nullptr), cudaSuccess);
    p.scale_amax = p.amax, p.amax = nullptr;
    EXPECT_EQ(norm_cast_cuda(p, nullptr), cudaSuccess);
  }
  NormOutputs o;
  if (k.o.out) o.out = bytes_of(d_out.to_host());
  if (k.o.row) o.rowwise = d_row.to_host();
  if (k.o.col) o.columnwise = d_col.to_host();
  if (mean) o.mean = d_mean.to_host();
  if (k.o.stats) o.rstd = d_rstd.to_host();
  o.amax = d_amax.to_host()[0];
  o.scale_inv = d_scale_inv.to_host()[0];
  return o;
}
#endif

::testing::AssertionResult same_outputs(const NormOutputs& gpu, const NormOutputs& cpu) {
  if (auto r = same_bytes(gpu.out, cpu.out); !r) return r << " (out)";
  if (auto r = same_bytes(gpu.rowwise, cpu.rowwise); !r) return r << " (rowwise)";
  if (auto r = same_bytes(gpu.columnwise, cpu.columnwise); !r) return r << " (columnwise)";
  if (auto r = same_bytes(gpu.mean, cpu.mean); !r) return r << " (mean)";
  if (auto r = same_bytes(gpu.rstd, cpu.rstd); !r) return r << " (rstd)";
  if (auto r = same_bytes<float>({gpu.amax}, {cpu.amax}); !r) return r << " (amax)";
  return same_bytes<float>({gpu.scale_inv}, {cpu.scale_inv}) << " (scale_inv)";
}

const char* norm_name(NormType n) { return n == NormType::kLayerNorm ? "LayerNorm" : "RMSNorm"; }

TEST(NormCastCpu, MatchesAnFp64Norm) {
  const Shape s{37, 1040};
  const auto x = norm_inputs(s, 11, false);
  const auto gamma = weights(s.cols, 1, 1.0f), beta = weights(s.cols, 2, 0.0f);
  for (const NormType norm : {NormType::kLayerNorm, NormType::kRMSNorm}) {
    const Case k{s, norm, Fp8Format::kE4M3, {}, 3.0f};
    const NormOutputs o = norm_on_cpu(x, k, gamma, beta);
    std::vector<float> out(x.size());
    std::memcpy(out.data(), o.out.data(), o.out.size());
    uint32_t amax = 0;
    for (int64_t r = 0; r < s.rows; ++r) {
      const float* row = x.data() + r * s.cols;
      double mean = 0.0, sq = 0.0;
      for (int64_t c = 0; c < s.cols; ++c) mean += row[c];
      mean = norm == NormType::kLayerNorm ? mean / s.cols : 0.0;
      for (int64_t c = 0; c < s.cols; ++c) sq += (row[c] - mean) * (row[c] - mean);
      const double rstd = 1.0 / std::sqrt(sq / s.cols + 1e-5);
      if (norm == NormType::kLayerNorm) {
        EXPECT_NEAR(o.mean[r], mean, 1e-6 * (std::fabs(mean) + 1));
      }
      EXPECT_NEAR(o.rstd[r], rstd, 2e-6 * rstd) << norm_name(norm) << " row " << r;
      for (int64_t c = 0; c < s.cols; ++c) {
        const double b = norm == NormType::kLayerNorm ? beta[c] : 0.0;
        const double want = (row[c] - mean) * rstd * gamma[c] + b;
        const float got = out[r * s.cols + c];
        // fp32 rounding of y, plus x - mean losing the bits of x below mean's ulp.
        const double tol =
            4e-6 * (std::fabs(want) + 1) + 2 * FLT_EPSILON * std::fabs(mean * rstd * gamma[c]);
        ASSERT_NEAR(got, want, tol) << norm_name(norm) << " row " << r;
        amax = std::max(amax, abs_bits(got));
        ASSERT_EQ(o.rowwise[r * s.cols + c], encode_fp8(got * 3.0f, Fp8Format::kE4M3));
        ASSERT_EQ(o.columnwise[c * s.rows + r], o.rowwise[r * s.cols + c]);
      }
    }
    EXPECT_EQ(o.amax, bits_float(amax));
    EXPECT_EQ(o.scale_inv, 1.0f / 3.0f);
  }
}

TEST(NormCastCpu, CurrentScalingCastsWithTheAmaxOfTheNormalizedOutput) {
  const Shape s{20, 64};
  const auto x = convert<bf16_t>(norm_inputs(s, 5, false));
  const auto gamma = weights(s.cols, 3, 1.0f), beta = weights(s.cols, 4, 0.0f);
  for (const NormType norm : {NormType::kLayerNorm, NormType::kRMSNorm}) {
    const NormOutputs current = norm_on_cpu(x, {s, norm, Fp8Format::kE5M2, {}, {}}, gamma, beta);
    const float scale = current_scale(current.amax, 1e-6f, Fp8Format::kE5M2);
    const NormOutputs delayed = norm_on_cpu(x, {s, norm, Fp8Format::kE5M2, {}, scale}, gamma, beta);
    EXPECT_TRUE(same_outputs(current, delayed)) << norm_name(norm);
    EXPECT_EQ(current.amax, delayed.amax);  // the cast pass folds nothing more into it
  }
}

TEST(NormCastCpu, RejectsWhatTheKernelCannotDo) {
  const std::vector<float> gamma(16384 + 16, 1.0f), x(16384 + 16);
  NormCastParams p;
  p.input = x.data(), p.gamma = gamma.data(), p.rows = 1;
  for (const int64_t hidden : {0, 8, 24, 16384 + 16}) {
    p.hidden = hidden;
    EXPECT_NE(norm_cast_invalid(p), nullptr) << hidden;
  }
  p.hidden = 16384;
  EXPECT_EQ(norm_cast_invalid(p), nullptr);
  p.norm = NormType::kRMSNorm, p.beta = gamma.data();
  EXPECT_NE(norm_cast_invalid(p), nullptr);
  p.beta = nullptr;
  std::vector<uint8_t> row(16384);
  p.rowwise = row.data();
  EXPECT_NE(norm_cast_invalid(p), nullptr);  // an FP8 output without a scale
}

#if defined(TPFP8_WITH_CUDA)
// Shapes: one chunk per lane or less, ragged row counts (partial 16 / 32-row groups, rows not a
// multiple of 16: byte-wise column stores), 32-row groups of whole rows (hidden <= 4096), of
// rows split over a cluster pair (8192 with row- and column-wise output, LayerNorm with beta or
// RMSNorm with out: 33 and 2200 rows with byte-wise column stores, 4224 with 16-byte ones, both
// with more groups than an H200 has clusters) and of column slices (other wide rows with
// row-wise output, and RMSNorm's 8192 without out: 8208 whose last slice is 16 columns, 16384,
// 6160 with more groups than blocks; column-wise output alone keeps 16 / 8-row groups);
// 128-lane rows (whole 2048 and 4096, ragged below) and 256-lane rows in two chunk buckets
// (<= 8192, <= 16384).
const std::vector<Shape>& norm_shapes() {
  static const std::vector<Shape> shapes = {
      {1, 16},      {3, 48},      {17, 1040}, {64, 2048},  {100, 3072},  {48, 4096}, {33, 8192},
      {2200, 8192}, {4224, 8192}, {32, 8208}, {20, 16384}, {4500, 6160}, {0, 64}};
  return shapes;
}

std::vector<Case> cases_for(Shape s) {
  std::vector<Case> cases;
  const Outputs all, row_only{false, true, false, false}, col_only{false, false, true, true},
      no_fp8{true, false, false, true}, fp8{false, true, true, true};  // fp8: a Linear's input
  for (const NormType norm : {NormType::kLayerNorm, NormType::kRMSNorm}) {
    cases.push_back({s, norm, Fp8Format::kE4M3, all, 2.5f});
    cases.push_back({s, norm, Fp8Format::kE5M2, row_only, 1000.0f});
    cases.push_back({s, norm, Fp8Format::kE4M3, col_only, 0.75f});
    cases.push_back({s, norm, Fp8Format::kE4M3, no_fp8, 1.0f});
    cases.push_back({s, norm, Fp8Format::kE4M3, fp8, 2.0f});
    cases.push_back({s, norm, Fp8Format::kE5M2, fp8, {}});
    cases.push_back({s, norm, Fp8Format::kE4M3, all, {}});
    cases.push_back({s, norm, Fp8Format::kE5M2, col_only, {}});
  }
  return cases;
}

template <typename T>
void expect_norm_cast_matches(Shape s) {
  const std::vector<T> x = convert<T>(norm_inputs(s, s.rows * 131 + s.cols));
  const auto gamma = weights(s.cols, s.cols, 1.0f), beta = weights(s.cols, s.rows, 0.1f);
  for (const Case& k : cases_for(s)) {
    const NormOutputs cpu = norm_on_cpu(x, k, gamma, beta);
    const NormOutputs gpu = norm_on_gpu(x, k, gamma, beta);
    EXPECT_TRUE(same_outputs(gpu, cpu))
        << dtype_name<T>() << " " << norm_name(k.norm) << " " << format_name(k.format) << " "
        << s.rows << "x" << s.cols << " out=" << k.o.out << " row=" << k.o.row << " col=" << k.o.col
        << " stats=" << k.o.stats << (k.scale ? " delayed" : " current");
  }
}
#endif

TEST(NormCastCuda, MatchesCpuForEveryNormScalingShapeAndOutputSet) {
  TPFP8_REQUIRE_GPU();
#if defined(TPFP8_WITH_CUDA)
  for (const Shape s : norm_shapes()) {
    expect_norm_cast_matches<float>(s);
    expect_norm_cast_matches<bf16_t>(s);
    expect_norm_cast_matches<fp16_t>(s);
  }
#endif
}

TEST(NormCastCuda, LauncherRefusesBadParamsBeforeTouchingTheDevice) {
#if defined(TPFP8_WITH_CUDA)
  NormCastParams p;
  const float gamma = 1.0f;
  p.gamma = &gamma, p.rows = 1, p.hidden = 24, p.input = &gamma;
  EXPECT_EQ(norm_cast_cuda(p, nullptr), cudaErrorInvalidValue);
  p.hidden = 32;
  EXPECT_EQ(norm_cast_amax_cuda(p, nullptr), cudaErrorInvalidValue);  // no amax to fold into
#else
  GTEST_SKIP() << "tpfp8 built without CUDA";
#endif
}

}  // namespace
}  // namespace tpfp8
