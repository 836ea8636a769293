// FP8 encode/decode (kernels/fp8_format.h) and the 16-bit conversions (kernels/dtype.h),
// checked exhaustively against definitions written a different way.
#include <algorithm>
#include <cmath>

#include "test_util.h"

namespace tpfp8 {
namespace {

using testing::format_name;

// Value of a code straight from the format definition (sign, exponent, mantissa), in double.
double definition_value(uint8_t c, Fp8Format f) {
  const bool e4m3 = f == Fp8Format::kE4M3;
  const int mbits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15, ebits = e4m3 ? 4 : 5;
  const double sign = (c & 0x80) ? -1.0 : 1.0;
  const int e = (c >> mbits) & ((1 << ebits) - 1);
  const int m = c & ((1 << mbits) - 1);
  if (e4m3 && e == 15 && m == 7) return NAN;
  if (!e4m3 && e == 31) return m == 0 ? sign * INFINITY : NAN;
  if (e == 0) return sign * std::ldexp(m, 1 - bias - mbits);
  return sign * std::ldexp(1.0 + m / double(1 << mbits), e - bias);
}

// A second encoder: the nearest of the finite non-negative values, ties to the even code,
// everything beyond the largest value saturating to it.
class NearestEncoder {
 public:
  explicit NearestEncoder(Fp8Format f) : format_(f) {
    for (int c = 0; c <= fp8_traits(f).max_code; ++c) values_.push_back(definition_value(c, f));
  }
  uint8_t operator()(float v) const {
    if (std::isnan(v)) return kFp8NaN;
    const uint8_t sign = std::signbit(v) ? 0x80 : 0;
    const double a = std::fabs(static_cast<double>(v));
    const int top = static_cast<int>(values_.size()) - 1;
    if (a >= values_[top]) return sign | top;
    const int hi =
        static_cast<int>(std::upper_bound(values_.begin(), values_.end(), a) - values_.begin());
    const int lo = hi - 1;
    const double dlo = a - values_[lo], dhi = values_[hi] - a;
    const int code = dlo < dhi ? lo : dhi < dlo ? hi : (lo % 2 == 0 ? lo : hi);
    return static_cast<uint8_t>(sign | code);
  }

 private:
  Fp8Format format_;
  std::vector<double> values_;
};

class Fp8FormatTest : public ::testing::TestWithParam<Fp8Format> {};

TEST_P(Fp8FormatTest, DecodesAll256CodesAsDefined) {
  const Fp8Format f = GetParam();
  for (int c = 0; c < 256; ++c) {
    const double want = definition_value(static_cast<uint8_t>(c), f);
    const float got = decode_fp8(static_cast<uint8_t>(c), f);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << format_name(f) << " code " << c;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << format_name(f) << " code " << c;
      EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << format_name(f) << " code " << c;
    }
  }
}

TEST(Fp8Format, KnownValues) {
  EXPECT_EQ(decode_fp8(0x7E, Fp8Format::kE4M3), 448.0f);
  EXPECT_EQ(decode_fp8(0x01, Fp8Format::kE4M3), std::ldexp(1.0f, -9));
  EXPECT_EQ(decode_fp8(0x7B, Fp8Format::kE5M2), 57344.0f);
  EXPECT_EQ(decode_fp8(0x01, Fp8Format::kE5M2), std::ldexp(1.0f, -16));
  EXPECT_TRUE(std::isinf(decode_fp8(0x7C, Fp8Format::kE5M2)));
  EXPECT_EQ(encode_fp8(1e30f, Fp8Format::kE4M3), 0x7E);
  EXPECT_EQ(encode_fp8(-INFINITY, Fp8Format::kE4M3), 0xFE);
  EXPECT_EQ(encode_fp8(INFINITY, Fp8Format::kE5M2), 0x7B);
  EXPECT_EQ(encode_fp8(NAN, Fp8Format::kE5M2), kFp8NaN);
  EXPECT_EQ(encode_fp8(-0.0f, Fp8Format::kE4M3), 0x80);
  EXPECT_EQ(encode_fp8(464.0f, Fp8Format::kE4M3), 0x7E);  // tie above max saturates
  EXPECT_EQ(encode_fp8(17.0f, Fp8Format::kE4M3), 0x58);   // tie 16|18 -> 16 (even)
  EXPECT_EQ(encode_fp8(19.0f, Fp8Format::kE4M3), 0x5A);   // tie 18|20 -> 20 (even)
}

TEST_P(Fp8FormatTest, RoundTripsEveryFiniteCode) {
  const Fp8Format f = GetParam();
  for (int c = 0; c < 256; ++c) {
    const float v = decode_fp8(static_cast<uint8_t>(c), f);
    if (std::isfinite(v)) EXPECT_EQ(encode_fp8(v, f), c) << format_name(f) << " code " << c;
  }
}

TEST_P(Fp8FormatTest, EncodesAllBf16PatternsLikeNearestEncoder) {
  const Fp8Format f = GetParam();
  const NearestEncoder nearest(f);
  for (int k = -20; k <= 20; k += 2) {
    for (const float scale : {std::ldexp(1.0f, k), std::ldexp(1.7f, k)}) {
      for (uint32_t b = 0; b < 65536; ++b) {
        const float v = to_float(bf16_t{static_cast<uint16_t>(b)}) * scale;
        ASSERT_EQ(encode_fp8(v, f), nearest(v))
            << format_name(f) << " bf16 0x" << std::hex << b << " scale " << scale;
      }
    }
  }
}

TEST_P(Fp8FormatTest, EncodesMillionsOfRandomValuesLikeNearestEncoder) {
  const Fp8Format f = GetParam();
  const NearestEncoder nearest(f);
  std::mt19937_64 rng(1234);
  std::uniform_int_distribution<uint32_t> any_bits;
  std::uniform_int_distribution<int> kind(0, 3), code(0, fp8_traits(f).max_code - 1);
  std::uniform_int_distribution<int> scale_exp(-20, 20);
  for (int i = 0; i < 1500000; ++i) {
    float v;
    switch (kind(rng)) {
      case 0:  // any fp32 bit pattern: subnormals, inf, NaN included
        v = bits_float(any_bits(rng));
        break;
      case 1: {  // exact midpoint between two neighbouring codes, +-1 ulp: the ties
        const int c = code(rng);
        const float mid = 0.5f * (decode_fp8(c, f) + decode_fp8(c + 1, f));
        v = bits_float(float_bits(mid) + (any_bits(rng) % 3) - 1);
        break;
      }
      case 2:  // around the max, +-epsilon
        v = fp8_max(f) * (1.0f + std::ldexp(static_cast<float>(any_bits(rng) % 64) - 32, -10));
        break;
      default:  // a scaled product, as the kernels form it
        v = bits_float(any_bits(rng) & 0xBFFFFFFFu) * std::ldexp(1.0f, scale_exp(rng));
    }
    if (any_bits(rng) & 1) v = -v;
    ASSERT_EQ(encode_fp8(v, f), nearest(v)) << format_name(f) << " value " << v;
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, Fp8FormatTest,
                         ::testing::Values(Fp8Format::kE4M3, Fp8Format::kE5M2),
                         [](const auto& info) { return std::string(format_name(info.param)); });

// 16-bit types: exact widening, and narrowing against the nearest of the two neighbours.
TEST(Dtype, Fp16WidensAsDefined) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const int e = (b >> 10) & 0x1F, m = b & 0x3FF;
    const double sign = (b & 0x8000) ? -1.0 : 1.0;
    const double want = e == 31  ? (m ? NAN : sign * INFINITY)
                        : e == 0 ? sign * std::ldexp(m, -24)
                                 : sign * std::ldexp(1024 + m, e - 25);
    const float got = to_float(fp16_t{static_cast<uint16_t>(b)});
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << b;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << b;
      EXPECT_EQ(to_fp16(got).bits, b) << "round trip of " << b;
    }
  }
}

template <typename T>
uint16_t nearest_16bit(float x) {
  // Brute force over all non-negative codes, in double. The infinity code stands for the
  // next power of two past the max, as IEEE rounding with an unbounded exponent would see it.
  uint16_t best = 0;
  double best_d = INFINITY;
  for (uint32_t c = 0; c < 0x8000; ++c) {
    const float v = to_float(T{static_cast<uint16_t>(c)});
    if (std::isnan(v)) continue;
    const double dv = std::isinf(v) ? std::ldexp(2.0, std::ilogb(to_float(T{uint16_t(c - 1)})))
                                    : static_cast<double>(v);
    const double d = std::fabs(dv - std::fabs(static_cast<double>(x)));
    if (d < best_d || (d == best_d && (c % 2 == 0))) best = c, best_d = d;
  }
  return static_cast<uint16_t>(best | (std::signbit(x) ? 0x8000 : 0));
}

TEST(Dtype, NarrowingRoundsToNearestEven) {
  std::vector<float> values = testing::random_floats(300, 7);
  values.insert(values.end(), {65504.0f, 65519.0f, 65520.0f, 6e-8f, 2.98e-8f, 1.0f + 1.0f / 2048,
                               1.0f + 3.0f / 2048, 3.389e38f});
  for (const float x : values) {
    if (std::isnan(x)) continue;
    EXPECT_EQ(to_fp16(x).bits, nearest_16bit<fp16_t>(x)) << x;
    EXPECT_EQ(to_bf16(x).bits, nearest_16bit<bf16_t>(x)) << x;
  }
  EXPECT_EQ(to_fp16(NAN).bits, 0x7E00);
  EXPECT_EQ(to_bf16(NAN).bits, 0x7FC0);
}

}  // namespace
}  // namespace tpfp8
