// Norm backward (kernels/norm_backward.h): the CPU reference against an fp64 backward and
// against the column-sum order the header defines, and CUDA bytes equal to the CPU reference
// for every norm, dtype and shape (empty, ragged bands, both register layouts, unaligned).
#include <cfloat>
#include <cmath>

#include "cast_harness.h"
#include "kernels/norm_backward.h"

namespace tpfp8 {
namespace {

using namespace testing;

const char* norm_name(NormType n) { return n == NormType::kLayerNorm ? "LayerNorm" : "RMSNorm"; }

template <typename T>
std::vector<uint8_t> bytes_of(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// A forward's input and its saved statistics (from norm_cast's CPU reference), and a gradient.
template <typename T>
struct Inputs {
  Shape s;
  NormType norm;
  std::vector<T> x, dy;
  std::vector<float> gamma, mean, rstd;
};

// Rows centred away from 0 with per-row spread (LayerNorm's centering matters); with `specials`
// and 8 rows or more, row 5 has a NaN in x and row 7 an inf in dy.
template <typename T>
Inputs<T> make_inputs(Shape s, NormType norm, uint64_t seed, bool specials = true) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(s.rows * s.cols), dy(s.rows * s.cols), gamma(s.cols);
  for (int64_t r = 0; r < s.rows; ++r) {
    const float offset = 3.0f * normal(rng), spread = std::exp2(2.0f * normal(rng));
    const float dy_scale = std::exp2(normal(rng));
    for (int64_t c = 0; c < s.cols; ++c) {
      x[r * s.cols + c] = offset + spread * normal(rng);
      dy[r * s.cols + c] = dy_scale * normal(rng);
    }
  }
  for (auto& g : gamma) g = 1.0f + 0.5f * normal(rng);
  if (specials && s.rows >= 8) {
    x[5 * s.cols + s.cols / 2] = NAN;
    dy[7 * s.cols] = INFINITY;
  }
  Inputs<T> in{s, norm, convert<T>(x), convert<T>(dy), gamma, {}, {}};
  in.mean.assign(norm == NormType::kLayerNorm ? s.rows : 0, 0.0f);
  in.rstd.assign(s.rows, 0.0f);
  NormCastParams f;
  f.input = in.x.data(), f.dtype = dtype_of<T>(), f.rows = s.rows, f.hidden = s.cols;
  f.norm = norm, f.gamma = gamma.data(), f.eps = 1e-5f;
  f.mean = norm == NormType::kLayerNorm ? in.mean.data() : nullptr;
  f.rstd = in.rstd.data();
  norm_cast_cpu(f);
  return in;
}

struct Outputs {
  std::vector<uint8_t> dx;  // x's dtype's bytes
  std::vector<float> dgamma, dbeta;
};

// Which column sums a run asks for.
struct Sums {
  bool dgamma = true, dbeta = true;
};

template <typename T>
NormBackwardParams params_for(const Inputs<T>& in) {
  NormBackwardParams p;
  p.dtype = dtype_of<T>(), p.rows = in.s.rows, p.hidden = in.s.cols, p.norm = in.norm;
  p.dy = in.dy.data(), p.x = in.x.data(), p.gamma = in.gamma.data(), p.rstd = in.rstd.data();
  p.mean = in.norm == NormType::kLayerNorm ? in.mean.data() : nullptr;
  return p;
}

// A gradient reaching x past the norm (dx_add): of x's shape, in its dtype.
template <typename T>
std::vector<T> skip_gradient(const Inputs<T>& in) {
  std::mt19937_64 rng(in.s.rows * 7 + in.s.cols);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> add(in.x.size());
  for (auto& v : add) v = normal(rng);
  return convert<T>(add);
}

template <typename T>
Outputs backward_on_cpu(const Inputs<T>& in, Sums sums = {}, const std::vector<T>* add = nullptr) {
  const bool dbeta = sums.dbeta && in.norm == NormType::kLayerNorm;
  std::vector<T> dx(in.x.size());
  Outputs o;
  o.dgamma.assign(sums.dgamma ? in.s.cols : 0, -1.0f);
  o.dbeta.assign(dbeta ? in.s.cols : 0, -1.0f);
  NormBackwardParams p = params_for(in);
  p.dx = dx.data();
  p.dx_add = add ? add->data() : nullptr;
  p.dgamma = sums.dgamma ? o.dgamma.data() : nullptr;
  p.dbeta = dbeta ? o.dbeta.data() : nullptr;
  EXPECT_EQ(norm_backward_invalid(p), nullptr);
  norm_backward_cpu(p);
  o.dx = bytes_of(dx);
  return o;
}

::testing::AssertionResult same_outputs(const Outputs& gpu, const Outputs& cpu) {
  if (auto r = same_bytes(gpu.dx, cpu.dx); !r) return r << " (dx)";
  if (auto r = same_bytes(gpu.dgamma, cpu.dgamma); !r) return r << " (dgamma)";
  return same_bytes(gpu.dbeta, cpu.dbeta) << " (dbeta)";
}

TEST(NormBackwardCpu, MatchesAnFp64Backward) {
  // 37 rows: five bands of 8, the last short.
  const Shape s{37, 1040};
  for (const NormType norm : {NormType::kLayerNorm, NormType::kRMSNorm}) {
    const Inputs<float> in = make_inputs<float>(s, norm, 3, false);
    const Outputs o = backward_on_cpu(in);
    std::vector<float> dx(in.x.size());
    std::memcpy(dx.data(), o.dx.data(), o.dx.size());
    std::vector<double> dgamma(s.cols), dbeta(s.cols), dgamma_abs(s.cols), dbeta_abs(s.cols);
    for (int64_t r = 0; r < s.rows; ++r) {
      const double mean = norm == NormType::kLayerNorm ? in.mean[r] : 0.0, rstd = in.rstd[r];
      std::vector<double> xhat(s.cols), g(s.cols);
      double mean_g = 0, mean_gx = 0, abs_g = 0, abs_gx = 0;
      for (int64_t c = 0; c < s.cols; ++c) {
        xhat[c] = (in.x[r * s.cols + c] - mean) * rstd;
        g[c] = double{in.dy[r * s.cols + c]} * in.gamma[c];
        mean_g += g[c], mean_gx += g[c] * xhat[c];
        abs_g += std::fabs(g[c]), abs_gx += std::fabs(g[c] * xhat[c]);
      }
      mean_g /= s.cols, mean_gx /= s.cols, abs_g /= s.cols, abs_gx /= s.cols;
      if (norm == NormType::kRMSNorm) mean_g = 0;
      for (int64_t c = 0; c < s.cols; ++c) {
        const double want = rstd * (g[c] - mean_g - xhat[c] * mean_gx);
        // Rounding of each term, plus the fp32 row sums (at most ~40 additions deep).
        const double tol =
            rstd * (4 * FLT_EPSILON *
                        (std::fabs(g[c]) + std::fabs(mean_g) + std::fabs(xhat[c] * mean_gx)) +
                    64 * FLT_EPSILON * (abs_g + std::fabs(xhat[c]) * abs_gx)) +
            1e-30;
        ASSERT_NEAR(dx[r * s.cols + c], want, tol)
            << norm_name(norm) << " row " << r << " col " << c;
        const double dy = in.dy[r * s.cols + c];
        dgamma[c] += dy * xhat[c], dgamma_abs[c] += std::fabs(dy * xhat[c]);
        dbeta[c] += dy, dbeta_abs[c] += std::fabs(dy);
      }
    }
    for (int64_t c = 0; c < s.cols; ++c) {
      EXPECT_NEAR(o.dgamma[c], dgamma[c], 64 * FLT_EPSILON * dgamma_abs[c]) << c;
      if (norm == NormType::kLayerNorm) {
        EXPECT_NEAR(o.dbeta[c], dbeta[c], 64 * FLT_EPSILON * dbeta_abs[c]) << c;
      }
    }
    if (norm == NormType::kRMSNorm) {
      EXPECT_TRUE(o.dbeta.empty());
    }
  }
}

// dgamma / dbeta of a [rows, hidden] backward, summed exactly as norm_backward.h spells out
// (bands, then groups of bands b = j mod 8, then the groups in order), from the fp32 terms.
std::vector<float> column_sums_by_definition(const std::vector<float>& terms, Shape s) {
  const int64_t band = norm_backward_band_rows(s.rows), bands = norm_backward_bands(s.rows);
  std::vector<float> partial(bands * s.cols, 0.0f), out(s.cols);
  for (int64_t b = 0; b < bands; ++b) {
    for (int64_t r = b * band; r < std::min(s.rows, (b + 1) * band); ++r) {
      for (int64_t c = 0; c < s.cols; ++c) partial[b * s.cols + c] += terms[r * s.cols + c];
    }
  }
  for (int64_t c = 0; c < s.cols; ++c) {
    float total = 0.0f;
    for (int j = 0; j < 8; ++j) {
      float group = 0.0f;
      for (int64_t b = j; b < bands; b += 8) group += partial[b * s.cols + c];
      total += group;
    }
    out[c] = total;
  }
  return out;
}

TEST(NormBackwardCpu, DxAddIsAddedToTheFp32DxThenRoundedOnce) {
  const Shape s{37, 1040};
  for (const NormType norm : {NormType::kLayerNorm, NormType::kRMSNorm}) {
    const Inputs<bf16_t> in = make_inputs<bf16_t>(s, norm, 6, false);
    // The same inputs in fp32 (exact): the kernel's fp32 dx, written unrounded.
    Inputs<float> wide{s, norm, {}, {}, in.gamma, in.mean, in.rstd};
    for (const bf16_t v : in.x) wide.x.push_back(to_float(v));
    for (const bf16_t v : in.dy) wide.dy.push_back(to_float(v));
    const std::vector<bf16_t> add = skip_gradient(in);
    const Outputs got = backward_on_cpu(in, {}, &add), plain = backward_on_cpu(in);
    const Outputs fp32 = backward_on_cpu(wide);
    std::vector<float> dx32(in.x.size());
    std::memcpy(dx32.data(), fp32.dx.data(), fp32.dx.size());
    std::vector<bf16_t> want(in.x.size());
    for (size_t i = 0; i < want.size(); ++i) want[i] = to_bf16(dx32[i] + to_float(add[i]));
    EXPECT_TRUE(same_bytes(got.dx, bytes_of(want))) << norm_name(norm);
    EXPECT_TRUE(same_bytes(got.dgamma, plain.dgamma)) << norm_name(norm);
    EXPECT_TRUE(same_bytes(got.dbeta, plain.dbeta)) << norm_name(norm);
  }
}

TEST(NormBackwardCpu, ColumnSumsFollowTheDefinedOrder) {
  // 2100 rows: bands of 16 (2100 / 8 > 256), 132 bands, the last short: every group is used.
  const Shape s{2100, 32};
  EXPECT_EQ(norm_backward_band_rows(s.rows), 16);
  const Inputs<bf16_t> in = make_inputs<bf16_t>(s, NormType::kLayerNorm, 8, false);
  const Outputs o = backward_on_cpu(in);
  std::vector<float> dgamma_terms(s.rows * s.cols), dbeta_terms(s.rows * s.cols);
  for (int64_t r = 0; r < s.rows; ++r) {
    for (int64_t c = 0; c < s.cols; ++c) {
      const float dy = to_float(in.dy[r * s.cols + c]);
      const float xhat = norm_xhat(to_float(in.x[r * s.cols + c]), in.mean[r], in.rstd[r], in.norm);
      dgamma_terms[r * s.cols + c] = dy * xhat;
      dbeta_terms[r * s.cols + c] = dy;
    }
  }
  EXPECT_TRUE(same_bytes(o.dgamma, column_sums_by_definition(dgamma_terms, s)));
  EXPECT_TRUE(same_bytes(o.dbeta, column_sums_by_definition(dbeta_terms, s)));
}

TEST(NormBackwardCpu, BandsDependOnTheRowCountOnly) {
  EXPECT_EQ(norm_backward_bands(0), 0);
  EXPECT_EQ(norm_backward_band_rows(1), 8);
  EXPECT_EQ(norm_backward_band_rows(2048), 8);  // 256 bands
  EXPECT_EQ(norm_backward_band_rows(2049), 16);
  EXPECT_EQ(norm_backward_band_rows(8192), 32);
  EXPECT_EQ(norm_backward_bands(8192), 256);
  EXPECT_EQ(norm_backward_band_rows(int64_t{1} << 20), 128);  // more bands past 32768 rows
  EXPECT_EQ(norm_backward_bands(int64_t{1} << 20), 8192);
}

TEST(NormBackwardCpu, NoRowsGiveZeroSums) {
  const Inputs<bf16_t> in = make_inputs<bf16_t>({0, 64}, NormType::kLayerNorm, 1);
  const Outputs o = backward_on_cpu(in);
  EXPECT_TRUE(same_bytes(o.dgamma, std::vector<float>(64, 0.0f)));
  EXPECT_TRUE(same_bytes(o.dbeta, std::vector<float>(64, 0.0f)));
}

TEST(NormBackwardCpu, NanAndInfStayInTheirRowsAndColumns) {
  const Shape s{16, 64};
  const Inputs<float> in = make_inputs<float>(s, NormType::kLayerNorm, 4);  // x[5, 32] NaN
  const Outputs o = backward_on_cpu(in);
  std::vector<float> dx(in.x.size());
  std::memcpy(dx.data(), o.dx.data(), o.dx.size());
  for (int64_t r = 0; r < s.rows; ++r) {
    for (int64_t c = 0; c < s.cols; ++c) {
      const float v = dx[r * s.cols + c];
      if (r == 5) {
        EXPECT_EQ(float_bits(v), 0x7FC00000u) << c;  // the canonical NaN
      } else if (r == 7) {  // inf - inf somewhere in every term: NaN or inf
        EXPECT_FALSE(std::isfinite(v)) << c;
        if (std::isnan(v)) EXPECT_EQ(float_bits(v), 0x7FC00000u) << c;
      } else {
        EXPECT_TRUE(std::isfinite(v)) << r << " " << c;
      }
    }
  }
  // Row 5's NaN reaches every dgamma (its rstd is NaN); dbeta only through dy's inf in column 0.
  EXPECT_TRUE(std::isnan(o.dgamma[3]));
  EXPECT_TRUE(std::isinf(o.dbeta[0]));
  EXPECT_TRUE(std::isfinite(o.dbeta[1]));
}

TEST(NormBackwardCpu, RejectsWhatTheKernelCannotDo) {
  const std::vector<float> v(16400, 1.0f);
  std::vector<float> out(16400);
  NormBackwardParams p;
  p.dy = v.data(), p.x = v.data(), p.dx = out.data(), p.gamma = v.data();
  p.mean = v.data(), p.rstd = v.data(), p.rows = 1;
  for (const int64_t hidden : {0, 8, 24, 16384 + 16}) {
    p.hidden = hidden;
    EXPECT_NE(norm_backward_invalid(p), nullptr) << hidden;
  }
  p.hidden = 16384;
  EXPECT_EQ(norm_backward_invalid(p), nullptr);
  p.mean = nullptr;
  EXPECT_NE(norm_backward_invalid(p), nullptr);  // LayerNorm without its mean
  p.norm = NormType::kRMSNorm;
  EXPECT_EQ(norm_backward_invalid(p), nullptr);
  p.dbeta = out.data();
  EXPECT_NE(norm_backward_invalid(p), nullptr);  // RMSNorm has no dbeta
  p.dbeta = nullptr, p.rstd = nullptr;
  EXPECT_NE(norm_backward_invalid(p), nullptr);
  p.rows = 0, p.dy = p.x = nullptr, p.dx = nullptr;
  EXPECT_EQ(norm_backward_invalid(p), nullptr);  // no rows need no row pointers
}

#if defined(TPFP8_WITH_CUDA)
// A device copy of `host` starting `offset` elements into its buffer (offset 1: misaligned).
template <typename T>
struct Placed {
  DeviceBuffer<T> buf;
  int offset;
  Placed(const std::vector<T>& host, int off) : buf(with_pad(host, off)), offset(off) {}
  Placed(size_t n, int off) : buf(n + off), offset(off) {}
  T* get() const { return buf.get() + offset; }
  std::vector<T> to_host() const {
    std::vector<T> h = buf.to_host();
    return std::vector<T>(h.begin() + offset, h.end());
  }
  static std::vector<T> with_pad(const std::vector<T>& host, int off) {
    std::vector<T> v(off);
    v.insert(v.end(), host.begin(), host.end());
    return v;
  }
};

template <typename T>
Outputs backward_on_gpu(const Inputs<T>& in, Sums sums = {}, int offset = 0,
                        const std::vector<T>* add = nullptr) {
  const bool dbeta = sums.dbeta && in.norm == NormType::kLayerNorm;
  const size_t n = in.x.size();
  const int64_t h = in.s.cols;
  Placed<T> d_x(in.x, offset), d_dy(in.dy, offset), d_dx(n, offset),
      d_add(add ? *add : std::vector<T>(), offset);
  Placed<float> d_gamma(in.gamma, offset), d_mean(in.mean, offset), d_rstd(in.rstd, offset),
      d_dgamma(sums.dgamma ? h : 0, offset), d_dbeta(dbeta ? h : 0, offset),
      d_partial(norm_backward_workspace_floats(in.s.rows, h), offset);
  NormBackwardParams p = params_for(in);
  p.x = d_x.get(), p.dy = d_dy.get(), p.dx = d_dx.get(), p.gamma = d_gamma.get();
  p.dx_add = add ? d_add.get() : nullptr;
  p.mean = in.norm == NormType::kLayerNorm ? d_mean.get() : nullptr;
  p.rstd = d_rstd.get();
  p.dgamma = sums.dgamma ? d_dgamma.get() : nullptr;
  p.dbeta = dbeta ? d_dbeta.get() : nullptr;
  p.partial = d_partial.get();
  EXPECT_EQ(norm_backward_cuda(p, nullptr), cudaSuccess);
  Outputs o;
  o.dx = bytes_of(d_dx.to_host());
  if (sums.dgamma) o.dgamma = d_dgamma.to_host();
  if (dbeta) o.dbeta = d_dbeta.to_host();
  return o;
}

// Shapes: one chunk or less per lane, rows not a multiple of the band (8), 132 bands of 16
// (every group of the second stage), bands of 64 with a short last band, the register-sum
// (<= 4096), 4-chunk (<= 8192) and 8-chunk (<= 16384) layouts, a partly covered 8-chunk row,
// no rows.
const std::vector<Shape>& backward_shapes() {
  static const std::vector<Shape> shapes = {{1, 16},     {3, 48},     {17, 1040},  {64, 2048},
                                            {2100, 256}, {8200, 16},  {300, 4096}, {33, 8192},
                                            {9, 8208},   {20, 16384}, {0, 64}};
  return shapes;
}

template <typename T>
void expect_backward_matches(Shape s, int offset) {
  for (const NormType norm : {NormType::kLayerNorm, NormType::kRMSNorm}) {
    const Inputs<T> in = make_inputs<T>(s, norm, s.rows * 131 + s.cols);
    EXPECT_TRUE(same_outputs(backward_on_gpu(in, {}, offset), backward_on_cpu(in)))
        << dtype_name<T>() << " " << norm_name(norm) << " " << s.rows << "x" << s.cols << " offset "
        << offset;
    const std::vector<T> add = skip_gradient(in);
    EXPECT_TRUE(same_outputs(backward_on_gpu(in, {}, offset, &add), backward_on_cpu(in, {}, &add)))
        << dtype_name<T>() << " " << norm_name(norm) << " " << s.rows << "x" << s.cols << " offset "
        << offset << " with dx_add";
  }
}
#endif

TEST(NormBackwardCuda, MatchesCpuForEveryNormDtypeAndShape) {
  TPFP8_REQUIRE_GPU();
#if defined(TPFP8_WITH_CUDA)
  for (const Shape s : backward_shapes()) {
    expect_backward_matches<float>(s, 0);
    expect_backward_matches<bf16_t>(s, 0);
    expect_backward_matches<fp16_t>(s, 0);
  }
#endif
}

TEST(NormBackwardCuda, MatchesCpuFromUnalignedPointers) {
  TPFP8_REQUIRE_GPU();
#if defined(TPFP8_WITH_CUDA)
  for (const Shape s : {Shape{17, 1040}, Shape{33, 8192}, Shape{20, 16384}}) {
    expect_backward_matches<float>(s, 1);
    expect_backward_matches<bf16_t>(s, 1);
    expect_backward_matches<fp16_t>(s, 1);
  }
#endif
}

TEST(NormBackwardCuda, SumsAreOptionalAndRunsRepeatBitForBit) {
  TPFP8_REQUIRE_GPU();
#if defined(TPFP8_WITH_CUDA)
  const Inputs<bf16_t> in = make_inputs<bf16_t>({2100, 256}, NormType::kLayerNorm, 9);
  const Outputs full = backward_on_gpu(in);
  EXPECT_TRUE(same_outputs(backward_on_gpu(in), full));
  for (const Sums sums : {Sums{false, false}, Sums{true, false}, Sums{false, true}}) {
    EXPECT_TRUE(same_outputs(backward_on_gpu(in, sums), backward_on_cpu(in, sums)))
        << sums.dgamma << sums.dbeta;
  }
#endif
}

TEST(NormBackwardCuda, LauncherRefusesBadParamsBeforeTouchingTheDevice) {
#if defined(TPFP8_WITH_CUDA)
  const float v = 1.0f;
  float out = 0.0f;
  NormBackwardParams p;
  p.dy = &v, p.x = &v, p.dx = &out, p.gamma = &v, p.mean = &v, p.rstd = &v, p.rows = 1;
  p.hidden = 24;
  EXPECT_EQ(norm_backward_cuda(p, nullptr), cudaErrorInvalidValue);
  p.hidden = 32, p.dgamma = &out;
  EXPECT_EQ(norm_backward_cuda(p, nullptr), cudaErrorInvalidValue);  // no partial workspace
#else
  GTEST_SKIP() << "tpfp8 built without CUDA";
#endif
}

}  // namespace
}  // namespace tpfp8
