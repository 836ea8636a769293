// quantize, dequantize and amax (kernels/cast.h): CPU reference semantics, and CUDA output
// bytes equal to the CPU reference for every dtype, format and shape.
#include "cast_harness.h"

namespace tpfp8 {
namespace {

using namespace testing;

TEST(CastCpu, QuantizeAmaxScaleInvAndFold) {
  const std::vector<float> x = {1.0f, -7.5f, 3.0f, 0.25f};
  const CastOutputs o = cast_on_cpu(x, {2, 2}, Fp8Format::kE4M3, 4.0f, true, true);
  EXPECT_EQ(o.amax, 7.5f);
  EXPECT_EQ(o.scale_inv, 0.25f);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(o.rowwise[i], encode_fp8(x[i] * 4.0f, Fp8Format::kE4M3));
  EXPECT_EQ(o.columnwise[1], o.rowwise[2]);  // [c, r] = [r, c]

  float amax = 100.0f;  // a larger amax already in the buffer stays
  amax_cpu(x.data(), DType::kFloat32, 4, &amax);
  EXPECT_EQ(amax, 100.0f);
  const std::vector<float> with_nan = {1.0f, NAN, -INFINITY};
  amax_cpu(with_nan.data(), DType::kFloat32, 3, &amax);
  EXPECT_TRUE(std::isnan(amax));
}

TEST(CastCpu, DequantizeIsDecodeTimesScaleInv) {
  std::vector<uint8_t> codes(256);
  for (int c = 0; c < 256; ++c) codes[c] = static_cast<uint8_t>(c);
  std::vector<float> out(256);
  const float scale_inv = 0.375f;
  DequantizeParams p;
  p.input = codes.data(), p.numel = 256, p.format = Fp8Format::kE5M2;
  p.scale_inv = &scale_inv, p.output = out.data(), p.out_dtype = DType::kFloat32;
  dequantize_cpu(p);
  for (int c = 0; c < 256; ++c) {
    const float want = decode_fp8(codes[c], Fp8Format::kE5M2) * scale_inv;
    EXPECT_TRUE(same_bytes<float>({out[c]}, {want}) || (std::isnan(want) && std::isnan(out[c])));
  }
}

#if defined(TPFP8_WITH_CUDA)
template <typename T>
void expect_quantize_matches(const std::vector<float>& values, Shape s, float scale) {
  const std::vector<T> in = convert<T>(values);
  for (const Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
    const CastOutputs cpu = cast_on_cpu(in, s, f, scale, true, false);
    const CastOutputs gpu = cast_on_gpu(in, s, f, scale, true, false, quantize_cuda);
    EXPECT_TRUE(same_outputs(gpu, cpu))
        << dtype_name<T>() << " " << format_name(f) << " " << s.rows << "x" << s.cols;
  }
}
#endif

TEST(CastCuda, QuantizeMatchesCpuAtEveryShapeAndDtype) {
  TPFP8_REQUIRE_GPU();
#if defined(TPFP8_WITH_CUDA)
  for (const Shape s : kernel_shapes()) {
    const auto values = random_floats(s.rows * s.cols, s.rows * 7919 + s.cols);
    expect_quantize_matches<float>(values, s, 3.7f);
    expect_quantize_matches<bf16_t>(values, s, 3.7f);
    expect_quantize_matches<fp16_t>(values, s, 0.61f);
  }
#endif
}

TEST(CastCuda, HardwareEncodeMatchesSoftwareOnAllBf16Patterns) {
  TPFP8_REQUIRE_GPU();
#if defined(TPFP8_WITH_CUDA)
  std::vector<bf16_t> all(65536);
  for (uint32_t b = 0; b < 65536; ++b) all[b] = bf16_t{static_cast<uint16_t>(b)};
  for (int k = -20; k <= 20; k += 4) {
    for (const Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      const float scale = std::ldexp(1.3f, k);
      const CastOutputs cpu = cast_on_cpu(all, {256, 256}, f, scale, true, false);
      const CastOutputs gpu = cast_on_gpu(all, {256, 256}, f, scale, true, false, quantize_cuda);
      EXPECT_TRUE(same_outputs(gpu, cpu)) << format_name(f) << " scale " << scale;
    }
  }
#endif
}

TEST(CastCuda, MillionRandomFp32AtScales) {
  TPFP8_REQUIRE_GPU();
#if defined(TPFP8_WITH_CUDA)
  std::mt19937_64 rng(5);
  std::uniform_int_distribution<uint32_t> bits;
  std::vector<float> v(1 << 20);
  for (auto& x : v) x = bits_float(bits(rng));  // every class of fp32 value, NaN included
  for (const int k : {-20, -7, 0, 9, 20}) {
    for (const Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      const float scale = std::ldexp(1.0f, k);
      const CastOutputs cpu = cast_on_cpu(v, {1024, 1024}, f, scale, true, false);
      const CastOutputs gpu = cast_on_gpu(v, {1024, 1024}, f, scale, true, false, quantize_cuda);
      EXPECT_TRUE(same_outputs(gpu, cpu)) << format_name(f) << " 2^" << k;
    }
  }
#endif
}

TEST(CastCuda, UnalignedInputTakesTheScalarPath) {
  TPFP8_REQUIRE_GPU();
#if defined(TPFP8_WITH_CUDA)
  // One element past an aligned start: no 16-byte access is legal, results must not change.
  const auto values = random_floats(1 + 33 * 65, 11);
  const std::vector<bf16_t> all = convert<bf16_t>(values);
  const std::vector<bf16_t> shifted(all.begin() + 1, all.end());
  DeviceBuffer<bf16_t> d_all(all);
  DeviceBuffer<uint8_t> d_out(shifted.size());
  DeviceBuffer<float> d_scale(std::vector<float>{2.0f}), d_amax(std::vector<float>{0.0f});
  CastParams p;
  p.input = d_all.get() + 1, p.dtype = DType::kBFloat16, p.rows = 33, p.cols = 65;
  p.scale = d_scale.get(), p.rowwise = d_out.get(), p.amax = d_amax.get();
  TPFP8_CUDA_OK(quantize_cuda(p, nullptr));
  const CastOutputs cpu = cast_on_cpu(shifted, {33, 65}, Fp8Format::kE4M3, 2.0f, true, false);
  EXPECT_TRUE(same_bytes(d_out.to_host(), cpu.rowwise));
  EXPECT_TRUE(same_bytes(d_amax.to_host(), std::vector<float>{cpu.amax}));
#endif
}

#if defined(TPFP8_WITH_CUDA)
template <typename T>
void expect_dequantize_matches(const std::vector<uint8_t>& codes, Fp8Format f) {
  const float scale_inv = 0.731f;
  std::vector<T> cpu(codes.size());
  DequantizeParams p;
  p.input = codes.data(), p.numel = static_cast<int64_t>(codes.size()), p.format = f;
  p.scale_inv = &scale_inv, p.output = cpu.data(), p.out_dtype = dtype_of<T>();
  dequantize_cpu(p);
  DeviceBuffer<uint8_t> d_in(codes);
  DeviceBuffer<T> d_out(codes.size());
  DeviceBuffer<float> d_si(std::vector<float>{scale_inv});
  p.input = d_in.get(), p.scale_inv = d_si.get(), p.output = d_out.get();
  ASSERT_EQ(dequantize_cuda(p, nullptr), cudaSuccess);
  EXPECT_TRUE(same_bytes(d_out.to_host(), cpu))
      << dtype_name<T>() << " " << format_name(f) << " n=" << codes.size();
}
#endif

TEST(CastCuda, DequantizeMatchesCpu) {
  TPFP8_REQUIRE_GPU();
#if defined(TPFP8_WITH_CUDA)
  std::mt19937 rng(3);
  for (const Shape s : kernel_shapes()) {
    std::vector<uint8_t> codes(s.rows * s.cols);
    for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<uint8_t>(i < 256 ? i : rng());
    for (const Fp8Format f : {Fp8Format::kE4M3, Fp8Format::kE5M2}) {
      expect_dequantize_matches<float>(codes, f);
      expect_dequantize_matches<bf16_t>(codes, f);
      expect_dequantize_matches<fp16_t>(codes, f);
    }
  }
#endif
}

#if defined(TPFP8_WITH_CUDA)
template <typename T>
void expect_amax_matches(const std::vector<float>& values) {
  const std::vector<T> in = convert<T>(values);
  float cpu = 0.0f;
  amax_cpu(in.data(), dtype_of<T>(), static_cast<int64_t>(in.size()), &cpu);
  DeviceBuffer<T> d_in(in);
  DeviceBuffer<float> d_amax(std::vector<float>{0.0f});
  ASSERT_EQ(
      amax_cuda(d_in.get(), dtype_of<T>(), static_cast<int64_t>(in.size()), d_amax.get(), nullptr),
      cudaSuccess);
  EXPECT_TRUE(same_bytes(d_amax.to_host(), std::vector<float>{cpu}))
      << dtype_name<T>() << " n=" << in.size();
}
#endif

TEST(CastCuda, AmaxMatchesCpu) {
  TPFP8_REQUIRE_GPU();
#if defined(TPFP8_WITH_CUDA)
  for (const Shape s : kernel_shapes()) {
    auto values = random_floats(s.rows * s.cols, s.rows + s.cols, 4.0f);
    for (auto& v : values) v = std::isnan(v) || std::isinf(v) ? 1.0f : v;  // finite amax
    values.back() = -1000.0f;  // the largest element at the very end (the scalar tail)
    expect_amax_matches<float>(values);
    expect_amax_matches<bf16_t>(values);
    expect_amax_matches<fp16_t>(values);
    values[values.size() / 2] = NAN;
    expect_amax_matches<float>(values);
  }
#endif
}

TEST(CastCuda, AmaxFindsOneOutlierAnywhere) {
  TPFP8_REQUIRE_GPU();
#if defined(TPFP8_WITH_CUDA)
  // A thread keeps several loads in flight, each over its own stretch of the tensor: one
  // outlier at positions spread over all of it, then in the scalar tail (n % 8 == 5).
  const int64_t n = int64_t{4096} * 4096 + 5;
  const bf16_t plain = to_bf16(0.5f), outlier = to_bf16(-96.0f);
  DeviceBuffer<bf16_t> d_in(std::vector<bf16_t>(n, plain));
  DeviceBuffer<float> d_amax(1);
  std::vector<int64_t> positions;
  for (int64_t i = 0; i < 256; ++i) positions.push_back(i * (n / 256) + i % 8);
  for (int64_t i = n - 8; i < n; ++i) positions.push_back(i);
  const float zero = 0.0f;
  for (const int64_t pos : positions) {
    ASSERT_EQ(cudaMemcpy(d_in.get() + pos, &outlier, sizeof(bf16_t), cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_amax.get(), &zero, sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    TPFP8_CUDA_OK(amax_cuda(d_in.get(), DType::kBFloat16, n, d_amax.get(), nullptr));
    EXPECT_EQ(d_amax.to_host()[0], 96.0f) << "outlier at " << pos << " of " << n;
    ASSERT_EQ(cudaMemcpy(d_in.get() + pos, &plain, sizeof(bf16_t), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
#endif
}

TEST(CastCuda, AmaxOfUnalignedInputTakesTheScalarPath) {
  TPFP8_REQUIRE_GPU();
#if defined(TPFP8_WITH_CUDA)
  // One element past an aligned start: no chunk may be read as one 16-byte access.
  auto values = random_floats(1 + 4096 * 33, 12, 4.0f);
  for (auto& v : values) v = std::isnan(v) || std::isinf(v) ? 1.0f : v;
  values[4096 * 17] = -900.0f;
  const std::vector<bf16_t> all = convert<bf16_t>(values);
  const std::vector<bf16_t> shifted(all.begin() + 1, all.end());
  float cpu = 0.0f;
  amax_cpu(shifted.data(), DType::kBFloat16, static_cast<int64_t>(shifted.size()), &cpu);
  DeviceBuffer<bf16_t> d_all(all);
  DeviceBuffer<float> d_amax(std::vector<float>{0.0f});
  TPFP8_CUDA_OK(amax_cuda(d_all.get() + 1, DType::kBFloat16, static_cast<int64_t>(shifted.size()),
                          d_amax.get(), nullptr));
  EXPECT_TRUE(same_bytes(d_amax.to_host(), std::vector<float>{cpu}));
  EXPECT_EQ(cpu, 900.0f);
#endif
}

}  // namespace
}  // namespace tpfp8
