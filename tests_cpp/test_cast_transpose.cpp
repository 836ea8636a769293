// cast_transpose and transpose_fp8 (kernels/cast_transpose.cu): CUDA bytes equal to the CPU
// reference for every dtype, format, shape and choice of outputs.
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
