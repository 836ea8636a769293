// FP8 formats E4M3 and E5M2: encode (scale, round to nearest even, saturate) and decode.
//
// One definition for host and device: the CPU reference and the CUDA kernels include this
// header, so they give the same bytes by construction. The device hot path may use the
// hardware conversion instead (see encode_fp8x2); tests check it against this software path.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TPFP8_HD __host__ __device__ __forceinline__
#else
#define TPFP8_HD inline
#endif

namespace tpfp8 {

enum class Fp8Format : int { kE4M3 = 0, kE5M2 = 1, kLast = kE5M2 };

// Both formats encode NaN as 0x7F (the sign is dropped): one canonical NaN keeps the CPU
// reference and the GPU byte-identical whatever NaN payload or sign the input carries.
constexpr uint8_t kFp8NaN = 0x7F;

// The largest finite fp32 (FLT_MAX, spelled out: <cfloat> is not usable in device code).
constexpr float kFloatMax = 3.402823466e38f;

struct Fp8Traits {
  int mantissa_bits;
  int exponent_bias;
  uint8_t max_code;  // largest finite magnitude: E4M3 0x7E = 448, E5M2 0x7B = 57344
  float max_value;
};

TPFP8_HD Fp8Traits fp8_traits(Fp8Format f) {
  return f == Fp8Format::kE4M3 ? Fp8Traits{3, 7, 0x7E, 448.0f} : Fp8Traits{2, 15, 0x7B, 57344.0f};
}

TPFP8_HD float fp8_max(Fp8Format f) { return fp8_traits(f).max_value; }

TPFP8_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

TPFP8_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
#endif
}

// fp32 operations rounded to nearest even, never contracted into an FMA with a neighbouring
// operation nor approximated, on either side (the host compiles with -ffp-contract=off): what
// lets a CPU reference give a CUDA kernel's bits.
TPFP8_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
TPFP8_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
TPFP8_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
TPFP8_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
// a * b + c rounded once (IEEE fusedMultiplyAdd): correctly rounded on both sides, so they
// agree -- unlike a contraction the compiler may or may not make.
TPFP8_HD float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

TPFP8_HD float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);  // IEEE correctly rounded, as __fsqrt_rn
#endif
}

// Encodes an fp32 value already multiplied by its scale. Round to nearest even from the fp32
// bits in one step (no double rounding), |v| beyond the format's max (inf included) saturates.
TPFP8_HD uint8_t encode_fp8(float v, Fp8Format f) {
  const Fp8Traits t = fp8_traits(f);
  const uint32_t u = float_bits(v);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return kFp8NaN;
  // Smallest normal of the format is 2^(1-bias); below it the grid is uniform with step
  // 2^(1-bias-mbits), and the code is just the rounded multiple of that step.
  const int min_normal_exp = 1 - t.exponent_bias;
  const int exp = static_cast<int>(a >> 23) - 127;
  uint32_t code;
  if (exp < min_normal_exp) {
    // Scaling by a power of two is exact, so `steps` is the value in units of the FP8 grid.
    const float steps =
        bits_float(a) *
        bits_float(static_cast<uint32_t>(127 - min_normal_exp + t.mantissa_bits) << 23);
    // Adding 2^23 (whose ulp is 1) rounds to the nearest even integer in the fp32 add.
    const float big = 8388608.0f;
    code = float_bits(add_rn(steps, big)) - float_bits(big);
  } else {
    const int shift = 23 - t.mantissa_bits;
    const uint32_t half = (1u << (shift - 1)) - 1u + ((a >> shift) & 1u);
    code = (a + half) >> shift;
    code -= static_cast<uint32_t>(127 - t.exponent_bias) << t.mantissa_bits;
  }
  if (code > t.max_code) code = t.max_code;
  return static_cast<uint8_t>(sign | code);
}

// Decodes one FP8 code to fp32 (exact: every FP8 value is an fp32 value).
TPFP8_HD float decode_fp8(uint8_t c, Fp8Format f) {
  const Fp8Traits t = fp8_traits(f);
  const uint32_t sign = static_cast<uint32_t>(c & 0x80) << 24;
  const uint32_t mag = c & 0x7F;
  const uint32_t exp_field = mag >> t.mantissa_bits;
  const uint32_t mant = mag & ((1u << t.mantissa_bits) - 1u);
  if (f == Fp8Format::kE4M3 && mag == 0x7F) return bits_float(0x7FC00000u);
  if (f == Fp8Format::kE5M2 && exp_field == 0x1F) {
    return bits_float(mant == 0 ? (sign | 0x7F800000u) : 0x7FC00000u);
  }
  if (exp_field == 0) {
    // Subnormal: mant * 2^(1 - bias - mbits); a power-of-two product, exact in fp32.
    const float step =
        bits_float(static_cast<uint32_t>(127 + 1 - t.exponent_bias - t.mantissa_bits) << 23);
    return bits_float(sign | float_bits(static_cast<float>(mant) * step));
  }
  const uint32_t e32 = exp_field - t.exponent_bias + 127;
  return bits_float(sign | (e32 << 23) | (mant << (23 - t.mantissa_bits)));
}

}  // namespace tpfp8
