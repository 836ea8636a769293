// gemm (kernels/gemm.h): the CPU reference against a direct computation, the argument rules,
// and the cuBLASLt path against the CPU reference on the same FP8 bytes.
#include <cmath>

#include "kernels/gemm.h"
#include "test_util.h"

namespace tpfp8 {
namespace {

using testing::random_floats;

struct Fp8Matrix {
  std::vector<uint8_t> codes;
  float scale_inv;
};

Fp8Matrix quantize(const std::vector<float>& x, Fp8Format f, float scale) {
  Fp8Matrix q{std::vector<uint8_t>(x.size()), 1.0f / scale};
  for (size_t i = 0; i < x.size(); ++i) q.codes[i] = encode_fp8(x[i] * scale, f);
  return q;
}

std::vector<float> finite_randoms(size_t n, uint64_t seed) {
  auto v = random_floats(n, seed, 2.0f);
  for (auto& x : v) x = std::isfinite(x) && std::fabs(x) > 1e-3f ? x : 0.5f;
  return v;
}

double rel_err(const std::vector<float>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i])) return INFINITY;
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / den);
}

// Row i of A times row j of B, both FP8 [*, k], in fp64, scaled: the GEMM's exact value.
double direct_sum(const Fp8Matrix& a, Fp8Format fa, const Fp8Matrix& b, Fp8Format fb, int64_t i,
                  int64_t j, int64_t k) {
  double s = 0;
  for (int64_t c = 0; c < k; ++c) {
    s += double(decode_fp8(a.codes[i * k + c], fa)) * decode_fp8(b.codes[j * k + c], fb);
  }
  return s * a.scale_inv * b.scale_inv;
}

// The CPU reference's params for D[m, n] = A . B^T of FP8 operands.
GemmParams fp8_params(const Fp8Matrix& a, GemmType ta, const Fp8Matrix& b, GemmType tb, int64_t m,
                      int64_t n, int64_t k) {
  GemmParams p;
  p.m = m, p.n = n, p.k = k;
  p.a = {a.codes.data(), ta, &a.scale_inv, false};
  p.b = {b.codes.data(), tb, &b.scale_inv, false};
  return p;
}

TEST(GemmCpu, Fp8WithBiasMatchesDirectSum) {
  const int64_t m = 5, n = 16, k = 32;
  const Fp8Matrix a = quantize(finite_randoms(m * k, 1), Fp8Format::kE4M3, 8.0f);
  const Fp8Matrix b = quantize(finite_randoms(n * k, 2), Fp8Format::kE5M2, 16.0f);
  std::vector<bf16_t> bias(n);
  for (int64_t j = 0; j < n; ++j) bias[j] = to_bf16(0.25f * j);
  std::vector<float> d(m * n);
  GemmParams p = fp8_params(a, GemmType::kE4M3, b, GemmType::kE5M2, m, n, k);
  p.d = d.data(), p.d_type = GemmType::kFloat32, p.bias = bias.data();
  gemm_cpu(p);
  std::vector<double> want(m * n);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      want[i * n + j] = direct_sum(a, Fp8Format::kE4M3, b, Fp8Format::kE5M2, i, j, k) + 0.25 * j;
    }
  }
  EXPECT_LT(rel_err(d, want), 1e-7);
}

TEST(GemmCpu, ResidualIsAddedBeforeTheOneRounding) {
  const int64_t m = 3, n = 16, k = 32;
  const Fp8Matrix a = quantize(finite_randoms(m * k, 3), Fp8Format::kE4M3, 8.0f);
  const Fp8Matrix b = quantize(finite_randoms(n * k, 4), Fp8Format::kE4M3, 8.0f);
  const std::vector<float> r32 = finite_randoms(m * n, 5);
  std::vector<bf16_t> residual(m * n), d(m * n);
  for (int64_t i = 0; i < m * n; ++i) residual[i] = to_bf16(4.0f * r32[i]);
  GemmParams p = fp8_params(a, GemmType::kE4M3, b, GemmType::kE4M3, m, n, k);
  p.d = d.data(), p.d_type = GemmType::kBFloat16, p.residual = residual.data();
  gemm_cpu(p);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const double exact = direct_sum(a, Fp8Format::kE4M3, b, Fp8Format::kE4M3, i, j, k) +
                           to_float(residual[i * n + j]);
      EXPECT_EQ(d[i * n + j].bits, to_bf16(static_cast<float>(exact)).bits) << i << j;
    }
  }
  EXPECT_EQ(residual[0].bits, to_bf16(4.0f * r32[0]).bits);  // (read, never written)
}

TEST(GemmCpu, RulesNameTheProblem) {
  GemmParams p;
  p.m = 4, p.n = 16, p.k = 24;
  p.a.type = p.b.type = GemmType::kE4M3;
  float s = 1.0f;
  p.a.scale_inv = p.b.scale_inv = &s;
  EXPECT_NE(gemm_check(p).find("K=24"), std::string::npos);
  p.k = 32, p.b.transposed = true;
  EXPECT_NE(gemm_check(p).find("TN only"), std::string::npos);
  p.b.transposed = false, p.b.type = GemmType::kBFloat16;
  EXPECT_NE(gemm_check(p).find("cannot mix"), std::string::npos);
  p.b.type = GemmType::kE4M3;
  EXPECT_EQ(gemm_check(p), "");
  p.accumulate = true, p.residual = &s;
  EXPECT_NE(gemm_check(p).find("not both"), std::string::npos);
}

TEST(GemmCuda, Fp8MatchesCpuReference) {
  TPFP8_REQUIRE_GPU();
#if defined(TPFP8_WITH_CUDA)
  for (const auto [m, n, k] : {std::tuple{1, 16, 16}, {17, 48, 80}, {256, 512, 1024}}) {
    const Fp8Matrix a = quantize(finite_randoms(m * k, m), Fp8Format::kE4M3, 32.0f);
    const Fp8Matrix b = quantize(finite_randoms(n * k, n), Fp8Format::kE4M3, 32.0f);
    std::vector<float> cpu(m * n, NAN);
    GemmParams p = fp8_params(a, GemmType::kE4M3, b, GemmType::kE4M3, m, n, k);
    p.d = cpu.data(), p.d_type = GemmType::kFloat32;
    gemm_cpu(p);
    testing::DeviceBuffer<uint8_t> da(a.codes), db(b.codes), ws(kGemmWorkspaceBytes);
    testing::DeviceBuffer<float> dsa(std::vector<float>{a.scale_inv}),
        dsb(std::vector<float>{b.scale_inv}), dd(m * n, 0xFF);  // 0xFF.. is NaN: poison
    p.a.data = da.get(), p.a.scale_inv = dsa.get();
    p.b.data = db.get(), p.b.scale_inv = dsb.get();
    p.d = dd.get(), p.workspace = ws.get(), p.workspace_size = kGemmWorkspaceBytes;
    ASSERT_EQ(gemm_cuda(p, nullptr), "");
    std::vector<double> want(cpu.begin(), cpu.end());
    // Hopper FP8 tensor cores accumulate with ~14 mantissa bits between fp32 promotions
    // (see tests_py/test_gemm.py): 1e-3 normwise, measured up to 3.3e-4.
    EXPECT_LT(rel_err(dd.to_host(), want), 1e-3) << m << "x" << n << "x" << k;
    // The same with a residual (C, beta = 1): D is the product plus it.
    const std::vector<float> r = finite_randoms(m * n, k);
    testing::DeviceBuffer<float> dr(r);
    p.residual = dr.get();
    ASSERT_EQ(gemm_cuda(p, nullptr), "");
    for (int64_t i = 0; i < m * n; ++i) want[i] += r[i];
    EXPECT_LT(rel_err(dd.to_host(), want), 1e-3) << m << "x" << n << "x" << k << " + residual";
    p.residual = nullptr;
  }
#endif
}

}  // namespace
}  // namespace tpfp8
