// activation_cast (kernels/activation_cast.cu, activation_math.h): the fp32 exp / erf against
// double over dense grids, the CPU reference against an fp64 emulation, and CUDA bytes equal
// to the CPU reference for both activations, directions, scalings, dtypes and odd shapes.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <optional>
#include <tuple>

#include "kernels/activation_cast.h"
#include "test_util.h"

namespace tpfp8 {
namespace {

using namespace testing;

// Error of `got` in units in the last place of the fp32 grid at `want` (subnormal ulp below).
double ulp_error(float got, double want) {
  if (std::isnan(want)) return std::isnan(got) ? 0.0 : INFINITY;
  if (std::isinf(want)) return static_cast<double>(got) == want ? 0.0 : INFINITY;
  int e = 0;
  std::frexp(want, &e);
  return std::fabs(got - want) / std::ldexp(1.0, std::max(e - 24, -149));
}

// Max ulp error of f against ref over [lo, hi] in steps of ~step, reported as a property.
double max_ulp(const char* name, float lo, float hi, float step, float (*f)(float),
               double (*ref)(double)) {
  double worst = 0.0, at = 0.0;
  for (float x = lo; x < hi; x += step) {
    for (const float v : {x, std::nextafter(x, hi)}) {
      const double e = ulp_error(f(v), ref(v));
      if (e > worst) worst = e, at = v;
    }
  }
  std::printf("  %s: max error %.3f ulp (at %.9g) over [%g, %g]\n", name, worst, at, lo, hi);
  ::testing::Test::RecordProperty(std::string(name) + "_max_ulp", std::to_string(worst));
  return worst;
}

TEST(ActivationMath, ExpIsWithinAnUlpOfDouble) {
  EXPECT_LE(max_ulp(
                "exp", -103.9f, 88.72f, 1.3e-4f, [](float x) { return exp_fp32(x); },
                [](double x) { return std::exp(x); }),
            1.05);
  EXPECT_EQ(exp_fp32(0.0f), 1.0f);
  EXPECT_EQ(exp_fp32(-INFINITY), 0.0f);
  EXPECT_EQ(exp_fp32(INFINITY), INFINITY);
  EXPECT_EQ(exp_fp32(89.0f), INFINITY);
  EXPECT_TRUE(std::isnan(exp_fp32(NAN)));
}

TEST(ActivationMath, ErfIsWithinTwoUlpOfDouble) {
  EXPECT_LE(max_ulp("erf", -6.0f, 6.0f, 3e-6f, erf_fp32, [](double x) { return std::erf(x); }),
            2.0);
  EXPECT_LE(
      max_ulp("erf_tiny", -1e-30f, 1e-30f, 1e-34f, erf_fp32, [](double x) { return std::erf(x); }),
      2.0);
  EXPECT_LE(max_ulp(
                "erfc", 0.0f, 10.0f, 3e-6f,
                [](float a) { return erfc_from_gauss(a, exp_neg_square(a, 1)); },
                [](double a) { return std::erfc(a); }),
            6.0);
  EXPECT_EQ(erf_fp32(INFINITY), 1.0f);
  EXPECT_EQ(erf_fp32(-INFINITY), -1.0f);
  EXPECT_TRUE(std::signbit(erf_fp32(-0.0f)));
  EXPECT_TRUE(std::isnan(erf_fp32(NAN)));
}

double gelu64(double x) { return 0.5 * x * std::erfc(-x / std::sqrt(2.0)); }
double gelu_grad64(double x) {
  return 0.5 * std::erfc(-x / std::sqrt(2.0)) + x * std::exp(-0.5 * x * x) / std::sqrt(2 * M_PI);
}
double silu64(double a) { return a / (1.0 + std::exp(-a)); }

TEST(ActivationMath, ActivationsAreCloseToDouble) {
  // Relative to max(|value|, 1/8): GELU' has a root near -0.75 where any fp32 formula cancels.
  double worst[3] = {0, 0, 0};
  for (float x = -12.0f; x < 12.0f; x += 1e-4f) {
    const double want[3] = {gelu64(x), gelu_grad64(x), silu64(x)};
    const float got[3] = {gelu(x), gelu_grad(x), silu(x)};
    for (int i = 0; i < 3; ++i) {
      const double e = std::fabs(got[i] - want[i]) / std::max(std::fabs(want[i]), 0.125) * 0x1p24;
      worst[i] = std::max(worst[i], e);
    }
  }
  std::printf("  gelu %.2f, gelu' %.2f, silu %.2f ulp (of max(|value|, 1/8))\n", worst[0], worst[1],
              worst[2]);
  EXPECT_LE(worst[0], 16.0);
  EXPECT_LE(worst[1], 16.0);
  EXPECT_LE(worst[2], 4.0);
  EXPECT_TRUE(std::isnan(gelu(-INFINITY)));  // -inf * 0, as torch
  EXPECT_EQ(gelu(INFINITY), INFINITY);
  EXPECT_EQ(silu(INFINITY), INFINITY);
}

// ---------------------------------------------------------------------------------------------
// One fused call on the CPU reference or the GPU.

struct Case {
  Activation act;
  bool backward;
  int64_t rows, n;
  Fp8Format format;
  bool rowwise = true, columnwise = true, out = true;
  std::optional<float> current;  // current scaling with this epsilon: the amax pass first
  bool dbias = false;            // backward: the column sums too (on the cast pass)
};

template <typename T>
struct Result {
  std::vector<uint8_t> rowwise, columnwise;
  std::vector<T> out;
  float amax = 0.0f, scale_inv = 0.0f;
  std::vector<float> dbias, dbias_partial;  // with Case::dbias: [out_cols], [tiles, out_cols]
};

constexpr float kScale = 37.5f;

template <typename T>
struct Inputs {
  std::vector<T> x, dy;
  Inputs(const Case& c, uint64_t seed) {
    const int64_t in_cols = c.act == Activation::kSwiGLU ? 2 * c.n : c.n;
    x = convert<T>(random_floats(c.rows * in_cols, seed, 3.0f));
    if (c.backward) dy = convert<T>(random_floats(c.rows * c.n, seed + 1, 3.0f));
  }
};

ActivationCastParams params_of(const Case& c, DType dtype) {
  ActivationCastParams p;
  p.activation = c.act, p.backward = c.backward, p.dtype = dtype;
  p.rows = c.rows, p.n = c.n, p.format = c.format;
  return p;
}

template <typename T>
Result<T> run_cpu(const Case& c, const Inputs<T>& in) {
  ActivationCastParams p = params_of(c, dtype_of<T>());
  const int64_t size = c.rows * p.out_cols();
  Result<T> r;
  r.rowwise.assign(c.rowwise ? size : 0, 0xA5);
  r.columnwise.assign(c.columnwise ? size : 0, 0xA5);
  r.out.assign(c.out ? size : 0, T{});
  p.input = in.x.data(), p.grad = c.backward ? in.dy.data() : nullptr;
  float scale = kScale, amax = 0.0f;
  if (c.current) {
    ActivationCastParams pass = p;
    pass.amax = &amax;
    activation_cast_cpu(pass);
    p.scale_amax = &amax, p.epsilon = *c.current;
    r.amax = amax;
  } else {
    p.scale = &scale, p.amax = &r.amax;
  }
  p.rowwise = c.rowwise ? r.rowwise.data() : nullptr;
  p.columnwise = c.columnwise ? r.columnwise.data() : nullptr;
  p.out = c.out ? r.out.data() : nullptr;
  p.scale_inv = &r.scale_inv;
  if (c.dbias) {
    r.dbias.assign(p.out_cols(), -1.0f);
    r.dbias_partial.assign(dbias_tiles(c.rows) * p.out_cols(), -1.0f);
    p.dbias = r.dbias.data(), p.dbias_partial = r.dbias_partial.data();
  }
  activation_cast_cpu(p);
  return r;
}

#if defined(TPFP8_WITH_CUDA)
template <typename T>
Result<T> run_gpu(const Case& c, const Inputs<T>& in) {
  ActivationCastParams p = params_of(c, dtype_of<T>());
  const size_t size = c.rows * p.out_cols();
  DeviceBuffer<T> x(in.x), dy(in.dy), out(c.out ? size : 0);
  DeviceBuffer<uint8_t> row(c.rowwise ? size : 0), col(c.columnwise ? size : 0);
  DeviceBuffer<float> scale(std::vector<float>{kScale}), amax(std::vector<float>{0.0f}),
      scale_inv(1), dbias(c.dbias ? p.out_cols() : 0),
      partial(c.dbias ? dbias_tiles(c.rows) * p.out_cols() : 0);
  p.input = x.get(), p.grad = c.backward ? dy.get() : nullptr;
  if (c.current) {
    ActivationCastParams pass = p;
    pass.amax = amax.get();
    EXPECT_EQ(activation_cast_cuda(pass, nullptr), cudaSuccess);
    p.scale_amax = amax.get(), p.epsilon = *c.current;
  } else {
    p.scale = scale.get(), p.amax = amax.get();
  }
  p.rowwise = c.rowwise ? row.get() : nullptr;
  p.columnwise = c.columnwise ? col.get() : nullptr;
  p.out = c.out ? out.get() : nullptr;
  p.scale_inv = scale_inv.get();
  if (c.dbias) p.dbias = dbias.get(), p.dbias_partial = partial.get();
  EXPECT_EQ(activation_cast_cuda(p, nullptr), cudaSuccess);
  Result<T> r;
  if (c.rowwise) r.rowwise = row.to_host();
  if (c.columnwise) r.columnwise = col.to_host();
  if (c.out) r.out = out.to_host();
  r.amax = amax.to_host()[0];
  r.scale_inv = scale_inv.to_host()[0];
  if (c.dbias) r.dbias = dbias.to_host(), r.dbias_partial = partial.to_host();
  return r;
}
#endif

template <typename T>
::testing::AssertionResult same_result(const Result<T>& a, const Result<T>& b) {
  if (auto r = same_bytes(a.rowwise, b.rowwise); !r) return r << " (rowwise)";
  if (auto r = same_bytes(a.columnwise, b.columnwise); !r) return r << " (columnwise)";
  if (auto r = same_bytes(a.out, b.out); !r) return r << " (high-precision out)";
  if (auto r = same_bytes<float>({a.amax}, {b.amax}); !r) return r << " (amax)";
  if (auto r = same_bytes(a.dbias_partial, b.dbias_partial); !r) return r << " (dbias_partial)";
  if (auto r = same_bytes(a.dbias, b.dbias); !r) return r << " (dbias)";
  return same_bytes<float>({a.scale_inv}, {b.scale_inv}) << " (scale_inv)";
}

template <typename T>
const char* dtype_name() {
  return std::is_same_v<T, float> ? "fp32" : std::is_same_v<T, bf16_t> ? "bf16" : "fp16";
}

std::string describe(const Case& c, const char* dtype) {
  char s[160];
  std::snprintf(s, sizeof(s), "%s %s %s %s %lldx%lld row=%d col=%d out=%d %s%s", dtype,
                c.act == Activation::kGelu ? "gelu" : "swiglu", c.backward ? "bwd" : "fwd",
                format_name(c.format), static_cast<long long>(c.rows), static_cast<long long>(c.n),
                c.rowwise, c.columnwise, c.out, c.current ? "current" : "delayed",
                c.dbias ? " dbias" : "");
  return s;
}

// ---------------------------------------------------------------------------------------------
// The CPU reference against fp64: each element computed in double from the same inputs.

// The result's column `col` of row `r` in double (the columns of dx for SwiGLU's backward).
double reference(const Case& c, const std::vector<float>& x, const std::vector<float>& dy,
                 int64_t r, int64_t col) {
  const int64_t in_cols = c.act == Activation::kSwiGLU ? 2 * c.n : c.n;
  const int64_t k = col % c.n;
  const double x0 = x[r * in_cols + k];
  const double g = c.backward ? dy[r * c.n + k] : 0.0;
  if (c.act == Activation::kGelu) return c.backward ? g * gelu_grad64(x0) : gelu64(x0);
  const double x1 = x[r * in_cols + c.n + k];
  if (!c.backward) return silu64(x0) * x1;
  const double s = 1.0 / (1.0 + std::exp(-x0));
  return col < c.n ? g * x1 * s * (1.0 + x0 * (1.0 - s)) : g * x0 * s;
}

TEST(ActivationCastCpu, MatchesAnFp64Emulation) {
  for (const Activation act : {Activation::kGelu, Activation::kSwiGLU}) {
    for (const bool backward : {false, true}) {
      for (const Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
        const Case c{act, backward, 37, 45, f};
        // Finite inputs: the comparison is numeric (special values: the GPU test).
        Inputs<float> in(c, 11 + 2 * backward + int(act));
        for (auto* v : {&in.x, &in.dy}) {
          for (float& e : *v) e = std::isfinite(e) ? std::clamp(e, -30.0f, 30.0f) : 0.5f;
        }
        const Result<float> got = run_cpu(c, in);
        const int64_t cols = params_of(c, DType::kFloat32).out_cols();
        double want_amax = 0.0;
        int flips = 0;
        for (int64_t r = 0; r < c.rows; ++r) {
          for (int64_t col = 0; col < cols; ++col) {
            const double want = reference(c, in.x, in.dy, r, col);
            const float y = got.out[r * cols + col];
            want_amax = std::max(want_amax, std::fabs(want));
            // fp32 within 16 ulp of the larger of |value| and 1/8 of its factors (dy, b):
            // the derivatives have roots, where any fp32 formula cancels.
            const int64_t k = col % c.n, in_cols = act == Activation::kSwiGLU ? 2 * c.n : c.n;
            double factor = backward ? std::fabs(in.dy[r * c.n + k]) : 1.0;
            if (act == Activation::kSwiGLU) factor *= std::fabs(in.x[r * in_cols + c.n + k]);
            const double tol = 16 * 0x1p-24 * std::max(std::fabs(want), 0.125 * factor) + 0x1p-149;
            ASSERT_LE(std::fabs(y - want), tol) << describe(c, "fp32") << " at " << r << "," << col;
            // FP8 of the fp64 value: equal codes, but for a value within tol of a rounding
            // boundary, where fp32 and fp64 may round apart (a neighbouring code).
            const uint8_t code = got.rowwise[r * cols + col];
            const uint8_t want_code = encode_fp8(static_cast<float>(want) * kScale, f);
            if (code != want_code) {
              ++flips;
              EXPECT_EQ(std::abs(int(code & 0x7F) - int(want_code & 0x7F)), 1)
                  << describe(c, "fp32") << " at " << r << "," << col;
            }
            EXPECT_EQ(got.columnwise[col * c.rows + r], code);
          }
        }
        EXPECT_LE(flips, 2) << describe(c, "fp32");
        EXPECT_NEAR(got.amax, want_amax, want_amax * 1e-6) << describe(c, "fp32");
        EXPECT_EQ(got.scale_inv, 1.0f / kScale);
      }
    }
  }
}

TEST(ActivationCastCpu, AmaxIsOfTheFp32ResultAndPropagatesNaN) {
  Case c{Activation::kSwiGLU, true, 9, 24, Fp8Format::kE5M2};
  Inputs<float> in(c, 5);
  for (auto* v : {&in.x, &in.dy}) {
    for (float& e : *v) e = std::isfinite(e) ? e : 1.0f;
  }
  Result<float> r = run_cpu(c, in);
  float want = 0.0f;
  for (const float y : r.out) want = std::max(want, std::fabs(y));
  EXPECT_EQ(r.amax, want);
  in.dy[17] = NAN;
  r = run_cpu(c, in);
  EXPECT_TRUE(std::isnan(r.amax));
  EXPECT_EQ(r.rowwise[17], kFp8NaN);
}

TEST(ActivationCastCpu, CurrentScalingIsTheDelayedCastAtTheAmaxScale) {
  for (const bool backward : {false, true}) {
    Case c{Activation::kGelu, backward, 19, 40, Fp8Format::kE4M3};
    c.current = 0.0f;
    Inputs<bf16_t> in(c, 23);
    for (auto* v : {&in.x, &in.dy}) {
      for (bf16_t& e : *v) e = std::isfinite(to_float(e)) ? e : bf16_t{0x3F80};
    }
    const Result<bf16_t> cur = run_cpu(c, in);
    ASSERT_GT(cur.amax, 0.0f);
    ActivationCastParams p = params_of(c, DType::kBFloat16);
    std::vector<uint8_t> row(c.rows * p.out_cols());
    const float scale = current_scale(cur.amax, 0.0f, c.format);
    float scale_inv = 0.0f;
    p.input = in.x.data(), p.grad = backward ? in.dy.data() : nullptr;
    p.scale = &scale, p.rowwise = row.data(), p.scale_inv = &scale_inv;
    activation_cast_cpu(p);
    EXPECT_TRUE(same_bytes(row, cur.rowwise));
    EXPECT_EQ(scale_inv, cur.scale_inv);
  }
}

// cast.h's order of the column sums written out plainly, column by column (the reference shares
// its code with the cast's): lane sums of rows q, q + 16, ... per 128-row tile, pairs of lanes,
// tiles into 8 groups by t mod 8, then the groups.
std::vector<float> sums_in_cast_order(const std::vector<float>& y, int64_t rows, int64_t cols) {
  std::vector<float> dbias(cols);
  for (int64_t c = 0; c < cols; ++c) {
    float groups[8] = {};
    for (int64_t t = 0; t * 128 < rows; ++t) {
      float tile = 0.0f;
      for (int q = 0; q < 16; q += 2) {
        float lane[2] = {0.0f, 0.0f};
        for (int h = 0; h < 2; ++h) {
          for (int64_t r = t * 128 + q + h; r < std::min(rows, t * 128 + 128); r += 16) {
            lane[h] += y[r * cols + c];
          }
        }
        tile += lane[0] + lane[1];
      }
      groups[t % 8] += tile;
    }
    float sum = 0.0f;
    for (const float g : groups) sum += g;
    dbias[c] = std::isnan(sum) ? bits_float(0x7FC00000u) : sum;
  }
  return dbias;
}

TEST(ActivationCastCpu, DbiasIsTheColumnSumOfTheFp32Result) {
  for (const Activation act : {Activation::kGelu, Activation::kSwiGLU}) {
    for (const auto& [rows, n] : std::vector<std::pair<int64_t, int64_t>>{
             {0, 8}, {1, 3}, {37, 45}, {300, 40}, {1157, 24}}) {
      Case c{act, true, rows, n, Fp8Format::kE4M3};
      c.dbias = true;
      Inputs<float> in(c, 31 + rows);
      for (auto* v : {&in.x, &in.dy}) {
        for (float& e : *v) e = std::isfinite(e) ? std::clamp(e, -30.0f, 30.0f) : 0.5f;
      }
      const Result<float> got = run_cpu(c, in);  // fp32 `out` is the fp32 result itself
      const int64_t cols = params_of(c, DType::kFloat32).out_cols();
      EXPECT_TRUE(same_bytes(got.dbias, sums_in_cast_order(got.out, rows, cols)))
          << describe(c, "fp32");
      // Each element passes through at most this many fp32 additions.
      const int64_t depth = 8 + 1 + 8 + (dbias_tiles(rows) + 7) / 8 + 8 + 1;
      for (int64_t col = 0; col < cols; ++col) {
        double exact = 0.0, magnitude = 0.0;
        for (int64_t r = 0; r < rows; ++r) {
          const double y = reference(c, in.x, in.dy, r, col);
          exact += y;
          magnitude += std::fabs(y);
        }
        // The fp32 results' own error (16 ulp of max(|y|, 1/8 of its factors), see above) plus
        // the additions'.
        EXPECT_NEAR(got.dbias[col], exact, (depth + 16) * std::ldexp(magnitude, -24) + 1e-3)
            << describe(c, "fp32") << " column " << col;
      }
      // The rows of partial sums are those of the cast over the same values.
      std::vector<float> dbias(cols), partial(dbias_tiles(rows) * cols);
      column_sums_cpu(got.out.data(), rows, cols, dbias.data(), partial.data());
      EXPECT_TRUE(same_bytes(got.dbias_partial, partial)) << describe(c, "fp32");
    }
  }
  // Forward: the reference leaves dbias alone (the CUDA launcher rejects it).
  Case c{Activation::kGelu, false, 5, 8, Fp8Format::kE4M3};
  c.dbias = true;
  const Result<float> fwd = run_cpu(c, Inputs<float>(c, 3));
  EXPECT_TRUE(same_bytes(fwd.dbias, std::vector<float>(8, -1.0f)));
}

// ---------------------------------------------------------------------------------------------
// CUDA == CPU, byte for byte.

// Odd shapes (element-wise paths), a partial tile at both edges, rows not a multiple of 16
// with vector loads (bytewise column-wise stores), and a few full tiles.
const std::vector<std::pair<int64_t, int64_t>> kShapes = {
    {1, 1}, {17, 33}, {127, 129}, {160, 136}, {200, 256}, {48, 1032}, {512, 384}, {1000, 520}};

#if defined(TPFP8_WITH_CUDA)
template <typename T>
void expect_gpu_matches_cpu(Case c, uint64_t seed) {
  const Inputs<T> in(c, seed);
  const auto [row, col, out] = std::tuple{c.rowwise, c.columnwise, c.out};
  for (const auto& [r, cl, o] : {std::tuple{row, col, out},
                                 {true, false, false},
                                 {false, true, false},
                                 {false, false, true}}) {
    c.rowwise = r, c.columnwise = cl, c.out = o;
    const Result<T> cpu = run_cpu(c, in);
    const Result<T> gpu = run_gpu(c, in);
    EXPECT_TRUE(same_result(gpu, cpu)) << describe(c, dtype_name<T>());
  }
}
#endif

TEST(ActivationCastCuda, MatchesCpuForEveryActivationShapeAndDtype) {
  TPFP8_REQUIRE_GPU();
#if defined(TPFP8_WITH_CUDA)
  uint64_t seed = 1;
  for (const auto& [rows, n] : kShapes) {
    for (const Activation act : {Activation::kGelu, Activation::kSwiGLU}) {
      for (const bool backward : {false, true}) {
        const Fp8Format f = backward ? Fp8Format::kE5M2 : Fp8Format::kE4M3;
        for (const std::optional<float> current : {std::optional<float>{}, {1e-6f}}) {
          Case c{act, backward, rows, n, f};
          c.current = current;
          expect_gpu_matches_cpu<float>(c, ++seed);
          expect_gpu_matches_cpu<bf16_t>(c, ++seed);
          expect_gpu_matches_cpu<fp16_t>(c, ++seed);
        }
      }
    }
  }
#endif
}

TEST(ActivationCastCuda, MatchesCpuInTheOtherFormatAndOnLargeTensors) {
  TPFP8_REQUIRE_GPU();
#if defined(TPFP8_WITH_CUDA)
  for (const Activation act : {Activation::kGelu, Activation::kSwiGLU}) {
    for (const bool backward : {false, true}) {
      const Fp8Format f = backward ? Fp8Format::kE4M3 : Fp8Format::kE5M2;
      expect_gpu_matches_cpu<bf16_t>(Case{act, backward, 4096, 1024, f}, 7);
      Case c{act, backward, 2050, 1040, f};  // rows % 16 != 0 over many tiles
      c.current = 0.0f;
      expect_gpu_matches_cpu<bf16_t>(c, 8);
    }
  }
#endif
}

// More tiles (768) than resident blocks, so each block walks several with its input copies
// running ahead across them, forwards (delayed) and backwards (current scaling's cast pass).
TEST(ActivationCastCuda, MatchesCpuWhenBlocksWalkSeveralTiles) {
  TPFP8_REQUIRE_GPU();
#if defined(TPFP8_WITH_CUDA)
  for (const bool backward : {false, true}) {
    for (const std::optional<float> current : {std::optional<float>{}, {1e-6f}}) {
      Case c{Activation::kSwiGLU, backward, 6144, 2048, Fp8Format::kE4M3};
      c.current = current;
      expect_gpu_matches_cpu<bf16_t>(c, 9);
    }
  }
#endif
}

// dbias: both activations, bf16 and fp32, delayed and current scaling, every choice of outputs
// (the warp sums in the FP8 tiles or in room of their own); rows not a multiple of 128, the
// element path (n % 8 != 0), and more tiles than resident blocks over more than 8 row tiles.
TEST(ActivationCastCuda, DbiasMatchesCpuBytes) {
  TPFP8_REQUIRE_GPU();
#if defined(TPFP8_WITH_CUDA)
  uint64_t seed = 40;
  for (const auto& [rows, n] : std::vector<std::pair<int64_t, int64_t>>{
           {1, 1}, {300, 45}, {300, 136}, {1157, 520}, {6144, 2048}}) {
    for (const Activation act : {Activation::kGelu, Activation::kSwiGLU}) {
      for (const std::optional<float> current : {std::optional<float>{}, {1e-6f}}) {
        Case c{act, true, rows, n, Fp8Format::kE4M3};
        c.current = current, c.dbias = true;
        expect_gpu_matches_cpu<bf16_t>(c, ++seed);
        expect_gpu_matches_cpu<float>(c, ++seed);
      }
    }
  }
#endif
}

TEST(ActivationCastCuda, DbiasNeedsBackwardAndItsWorkspace) {
  TPFP8_REQUIRE_GPU();
#if defined(TPFP8_WITH_CUDA)
  DeviceBuffer<float> x(std::vector<float>(32 * 32, 1.0f)), dbias(32), partial(32);
  ActivationCastParams p;
  p.input = x.get(), p.grad = x.get(), p.rows = 32, p.n = 32;
  p.dbias = dbias.get();
  EXPECT_EQ(activation_cast_cuda(p, nullptr), cudaErrorInvalidValue);  // forward
  p.backward = true;
  EXPECT_EQ(activation_cast_cuda(p, nullptr), cudaErrorInvalidValue);  // no workspace
  p.dbias_partial = partial.get();
  EXPECT_EQ(activation_cast_cuda(p, nullptr), cudaSuccess);
#endif
}

}  // namespace
}  // namespace tpfp8
