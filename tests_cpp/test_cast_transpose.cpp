// cast_transpose and transpose_fp8 (kernels/cast_transpose.cu): CUDA bytes equal to the CPU
// reference for every dtype, format, shape and choice of outputs, the column sums (dbias)
// included; the CPU reference's sums against float64.
#include <cfloat>
#include <cmath>

#include "cast_harness.h"

namespace tpfp8 {
namespace {

using namespace testing;

TEST(CastTransposeCpu, ColumnwiseIsTheTransposeOfRowwise) {
  const Shape s{5, 3};
  const auto values = random_floats(15, 9);
  const CastOutputs o = cast_on_cpu(values, s, Fp8Format::kE5M2, 0.5f, true, true);
  for (int64_t r = 0; r < s.rows; ++r) {
    for (int64_t c = 0; c < s.cols; ++c) {
      EXPECT_EQ(o.columnwise[c * s.rows + r], o.rowwise[r * s.cols + c]);
    }
  }
  std::vector<uint8_t> t(15);
  transpose_fp8_cpu(o.rowwise.data(), s.rows, s.cols, t.data());
  EXPECT_TRUE(same_bytes(t, o.columnwise));
}

#if defined(TPFP8_WITH_CUDA)
template <typename T>
void expect_cast_transpose_matches(const std::vector<float>& values, Shape s) {
  const std::vector<T> in = convert<T>(values);
  for (const Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    for (const auto [row, col] : {std::pair{true, true}, {false, true}, {true, false}}) {
      const CastOutputs cpu = cast_on_cpu(in, s, f, 1.93f, row, col);
      const CastOutputs gpu = cast_on_gpu(in, s, f, 1.93f, row, col, cast_transpose_cuda);
      EXPECT_TRUE(same_outputs(gpu, cpu))
          << dtype_name<T>() << " " << format_name(f) << " " << s.rows << "x" << s.cols
          << " row=" << row << " col=" << col;
    }
  }
}
#endif

TEST(CastTransposeCuda, MatchesCpuAtEveryShapeAndDtype) {
  TPFP8_REQUIRE_GPU();
#if defined(TPFP8_WITH_CUDA)
  for (const Shape s : kernel_shapes()) {
    const auto values = random_floats(s.rows * s.cols, s.rows * 31 + s.cols);
    expect_cast_transpose_matches<float>(values, s);
    expect_cast_transpose_matches<bf16_t>(values, s);
    expect_cast_transpose_matches<fp16_t>(values, s);
  }
#endif
}

TEST(CastTransposeCpu, CurrentScalingTakesTheScaleFromTheAmax) {
  const Shape s{4, 8};
  const auto values = random_floats(32, 3);
  const float amax = 2.5f, scale = 448.0f / amax;
  EXPECT_EQ(current_scale(amax, 0.0f, Fp8Format::kE4M3), scale);
  EXPECT_EQ(current_scale(0.0f, 0.0f, Fp8Format::kE4M3), 1.0f);
  EXPECT_EQ(current_scale(NAN, 0.0f, Fp8Format::kE4M3), 1.0f);
  EXPECT_EQ(current_scale(INFINITY, 0.0f, Fp8Format::kE5M2), 1.0f);
  EXPECT_EQ(current_scale(1e-45f, 0.0f, Fp8Format::kE5M2), FLT_MAX);
  EXPECT_EQ(current_scale(1e-3f, 0.5f, Fp8Format::kE5M2), 57344.0f / 0.5f);
  const CastOutputs want = cast_on_cpu(values, s, Fp8Format::kE4M3, scale, true, true);
  const CastOutputs got = cast_on_cpu(values, s, Fp8Format::kE4M3, 7.0f, true, true, amax);
  EXPECT_TRUE(same_outputs(got, want));
}

TEST(CastTransposeCuda, CurrentScalingMatchesCpu) {
  TPFP8_REQUIRE_GPU();
#if defined(TPFP8_WITH_CUDA)
  for (const Shape s : kernel_shapes()) {
    const auto values = convert<bf16_t>(random_floats(s.rows * s.cols, s.rows + 7 * s.cols));
    for (const float amax : {3.7f, 0.0f, NAN, 1e-45f, 1e-7f}) {
      for (const Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
        const CastOutputs cpu = cast_on_cpu(values, s, f, 1.0f, true, true, amax);
        const CastOutputs gpu =
            cast_on_gpu(values, s, f, 1.0f, true, true, cast_transpose_cuda, amax);
        EXPECT_TRUE(same_outputs(gpu, cpu)) << s.rows << "x" << s.cols << " amax=" << amax;
        const CastOutputs gpu_q = cast_on_gpu(values, s, f, 1.0f, true, false, quantize_cuda, amax);
        EXPECT_TRUE(same_bytes(gpu_q.rowwise, cpu.rowwise)) << s.rows << "x" << s.cols;
      }
    }
  }
#endif
}

// The shapes of the dbias tests: none, ragged rows and columns (not multiples of a tile), one
// tile, one more than 8 row tiles (the reduction's groups), vector path and element path.
const std::vector<Shape>& dbias_shapes() {
  static const std::vector<Shape> shapes = {{0, 24},    {0, 0},     {1, 1},    {17, 33},
                                            {127, 129}, {128, 128}, {144, 40}, {1152, 24},
                                            {1157, 70}, {2064, 16}};
  return shapes;
}

// Finite values over many magnitudes and signs (the specials of random_floats made 1).
std::vector<float> finite_floats(size_t n, uint64_t seed) {
  std::vector<float> v = random_floats(n, seed, 6.0f);
  for (float& x : v) x = std::isfinite(x) ? x : 1.0f;
  return v;
}

template <typename T>
void expect_dbias_near_float64(Shape s) {
  const std::vector<T> in = convert<T>(finite_floats(s.rows * s.cols, s.rows * 7 + s.cols));
  const CastOutputs o = cast_on_cpu(in, s, Fp8Format::kE5M2, 1.0f, false, false, {}, true);
  // Each element passes through at most this many fp32 additions (cast.h's order).
  const int64_t depth = 8 + 1 + 8 + (dbias_tiles(s.rows) + 7) / 8 + 8 + 1;
  for (int64_t c = 0; c < s.cols; ++c) {
    double exact = 0.0, magnitude = 0.0;
    for (int64_t r = 0; r < s.rows; ++r) {
      const double x = to_float(in[r * s.cols + c]);
      exact += x;
      magnitude += std::fabs(x);
    }
    EXPECT_LE(std::fabs(o.dbias[c] - exact), depth * std::ldexp(magnitude, -24))
        << dtype_name<T>() << " " << s.rows << "x" << s.cols << " column " << c;
  }
}

TEST(CastTransposeCpu, DbiasIsTheColumnSumToFloat32Rounding) {
  for (const Shape s : dbias_shapes()) {
    expect_dbias_near_float64<float>(s);
    expect_dbias_near_float64<bf16_t>(s);
    expect_dbias_near_float64<fp16_t>(s);
  }
}

TEST(CastTransposeCpu, DbiasLeavesTheCastAloneAndCanonicalisesNaN) {
  const Shape s{300, 20};
  std::vector<float> values = finite_floats(s.rows * s.cols, 5);
  values[17 * s.cols + 3] = INFINITY;  // column 3: inf
  values[18 * s.cols + 4] = INFINITY;  // column 4: inf - inf = NaN
  values[290 * s.cols + 4] = -INFINITY;
  values[2 * s.cols + 5] = NAN;                                         // column 5: NaN
  for (int64_t r = 0; r < s.rows; ++r) values[r * s.cols + 6] = -0.0f;  // column 6: +0
  const CastOutputs plain = cast_on_cpu(values, s, Fp8Format::kE4M3, 3.0f, true, true);
  const CastOutputs with = cast_on_cpu(values, s, Fp8Format::kE4M3, 3.0f, true, true, {}, true);
  EXPECT_TRUE(same_bytes(with.rowwise, plain.rowwise));
  EXPECT_TRUE(same_bytes(with.columnwise, plain.columnwise));
  EXPECT_TRUE(same_bytes<float>({with.amax, with.scale_inv}, {plain.amax, plain.scale_inv}));
  EXPECT_EQ(with.dbias[3], INFINITY);
  EXPECT_EQ(float_bits(with.dbias[4]), 0x7FC00000u);
  EXPECT_EQ(float_bits(with.dbias[5]), 0x7FC00000u);
  EXPECT_EQ(float_bits(with.dbias[6]), 0u);
  // Only the sums: the same bytes.
  const CastOutputs sums = cast_on_cpu(values, s, Fp8Format::kE4M3, 3.0f, false, false, {}, true);
  EXPECT_TRUE(same_bytes(sums.dbias, with.dbias));
  EXPECT_TRUE(same_bytes(sums.dbias_partial, with.dbias_partial));
}

#if defined(TPFP8_WITH_CUDA)
template <typename T>
void expect_dbias_matches(const std::vector<float>& values, Shape s) {
  const std::vector<T> in = convert<T>(values);
  for (const auto [row, col] :
       {std::pair{true, true}, {false, true}, {true, false}, {false, false}}) {
    const CastOutputs cpu = cast_on_cpu(in, s, Fp8Format::kE5M2, 1.93f, row, col, {}, true);
    const CastOutputs gpu =
        cast_on_gpu(in, s, Fp8Format::kE5M2, 1.93f, row, col, cast_transpose_cuda, {}, true);
    EXPECT_TRUE(same_outputs(gpu, cpu))
        << dtype_name<T>() << " " << s.rows << "x" << s.cols << " row=" << row << " col=" << col;
  }
  // Current scaling takes the same path; and a second run gives the same bytes.
  const CastOutputs cpu = cast_on_cpu(in, s, Fp8Format::kE4M3, 1.0f, true, true, 2.5f, true);
  for (int run = 0; run < 2; ++run) {
    const CastOutputs gpu =
        cast_on_gpu(in, s, Fp8Format::kE4M3, 1.0f, true, true, cast_transpose_cuda, 2.5f, true);
    EXPECT_TRUE(same_outputs(gpu, cpu))
        << dtype_name<T>() << " " << s.rows << "x" << s.cols << " current scaling, run " << run;
  }
}
#endif

TEST(CastTransposeCuda, DbiasMatchesCpuBytes) {
  TPFP8_REQUIRE_GPU();
#if defined(TPFP8_WITH_CUDA)
  std::vector<Shape> shapes = kernel_shapes();
  shapes.insert(shapes.end(), dbias_shapes().begin(), dbias_shapes().end());
  for (const Shape s : shapes) {
    // Finite values (sums of which the reference is checked against float64) and the specials.
    for (const auto& values : {finite_floats(s.rows * s.cols, s.rows + 3 * s.cols),
                               random_floats(s.rows * s.cols, s.rows + 5 * s.cols)}) {
      expect_dbias_matches<float>(values, s);
      expect_dbias_matches<bf16_t>(values, s);
      expect_dbias_matches<fp16_t>(values, s);
    }
  }
#endif
}

TEST(CastTransposeCuda, DbiasNeedsItsWorkspaceAndTheTiledKernel) {
  TPFP8_REQUIRE_GPU();
#if defined(TPFP8_WITH_CUDA)
  const Shape s{32, 32};
  DeviceBuffer<float> d_in(std::vector<float>(s.rows * s.cols, 1.0f)), d_dbias(s.cols),
      d_partial(partial_size(s));
  DeviceBuffer<uint8_t> d_row(s.rows * s.cols);
  CastParams p;
  p.input = d_in.get(), p.rows = s.rows, p.cols = s.cols, p.rowwise = d_row.get();
  p.dbias = d_dbias.get();
  EXPECT_EQ(cast_transpose_cuda(p, nullptr), cudaErrorInvalidValue);  // no workspace
  p.dbias_partial = d_partial.get();
  EXPECT_EQ(quantize_cuda(p, nullptr), cudaErrorInvalidValue);  // the row-wise kernel sums nothing
  TPFP8_CUDA_OK(cast_transpose_cuda(p, nullptr));
  EXPECT_EQ(d_dbias.to_host(), std::vector<float>(s.cols, 32.0f));
#endif
}

TEST(TransposeCuda, MatchesCpuAtEveryShape) {
  TPFP8_REQUIRE_GPU();
#if defined(TPFP8_WITH_CUDA)
  std::mt19937 rng(8);
  for (const Shape s : kernel_shapes()) {
    std::vector<uint8_t> in(s.rows * s.cols);
    for (auto& b : in) b = static_cast<uint8_t>(rng());
    std::vector<uint8_t> cpu(in.size());
    transpose_fp8_cpu(in.data(), s.rows, s.cols, cpu.data());
    DeviceBuffer<uint8_t> d_in(in), d_out(in.size());
    TPFP8_CUDA_OK(transpose_fp8_cuda(d_in.get(), s.rows, s.cols, d_out.get(), nullptr));
    EXPECT_TRUE(same_bytes(d_out.to_host(), cpu)) << s.rows << "x" << s.cols;
  }
#endif
}

}  // namespace
}  // namespace tpfp8
