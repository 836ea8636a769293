// High-precision element types the kernels read and write, as raw 16-bit storage so the
// library needs neither torch nor cuda_bf16.h. Conversions are written once, for host and
// device, so the CPU reference and the kernels round identically.
#pragma once

#include <cstdint>
#include <type_traits>

#include "fp8_format.h"

namespace tpfp8 {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

struct bf16_t {
  uint16_t bits;
};
struct fp16_t {
  uint16_t bits;
};

TPFP8_HD float to_float(float x) { return x; }
TPFP8_HD float to_float(bf16_t x) { return bits_float(static_cast<uint32_t>(x.bits) << 16); }

TPFP8_HD float to_float(fp16_t x) {
  const uint32_t sign = static_cast<uint32_t>(x.bits & 0x8000) << 16;
  const uint32_t exp = (x.bits >> 10) & 0x1F;
  const uint32_t mant = x.bits & 0x3FF;
  if (exp == 0x1F) return bits_float(sign | 0x7F800000u | (mant << 13));
  if (exp == 0) {
    // Subnormal half: mant * 2^-24, exact in fp32.
    return bits_float(sign | float_bits(static_cast<float>(mant) * 5.9604644775390625e-08f));
  }
  return bits_float(sign | ((exp + 112) << 23) | (mant << 13));
}

// Round-to-nearest-even narrowing; NaN becomes the canonical quiet NaN of the target type.
TPFP8_HD bf16_t to_bf16(float x) {
  const uint32_t u = float_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return bf16_t{0x7FC0};
  const uint32_t rounded = u + 0x7FFFu + ((u >> 16) & 1u);
  return bf16_t{static_cast<uint16_t>(rounded >> 16)};
}

TPFP8_HD fp16_t to_fp16(float x) {
  const uint32_t u = float_bits(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return fp16_t{0x7E00};
  if (a >= 0x477FF000u) return fp16_t{static_cast<uint16_t>(sign | 0x7C00)};  // rounds past 65504
  if (a < 0x38800000u) {
    // Below 2^-14: subnormal half, a multiple of 2^-24; 2^23 + v*2^24 rounds it to even.
    const float big = 8388608.0f;
    const float steps = bits_float(a) * 16777216.0f;
    return fp16_t{static_cast<uint16_t>(sign | (float_bits(add_rn(steps, big)) - float_bits(big)))};
  }
  const uint32_t rounded = (a + 0xFFFu + ((a >> 13) & 1u)) >> 13;
  return fp16_t{static_cast<uint16_t>(sign | (rounded - (112u << 10)))};
}

template <typename T>
TPFP8_HD T from_float(float x);
// NaN leaves as the canonical quiet NaN: the GPU's fp32 arithmetic does not keep payloads.
template <>
TPFP8_HD float from_float<float>(float x) {
  return (float_bits(x) & 0x7FFFFFFFu) > 0x7F800000u ? bits_float(0x7FC00000u) : x;
}
template <>
TPFP8_HD bf16_t from_float<bf16_t>(float x) {
  return to_bf16(x);
}
template <>
TPFP8_HD fp16_t from_float<fp16_t>(float x) {
  return to_fp16(x);
}

// |x| as ordered fp32 bits with every NaN made the same quiet NaN: an unsigned max over
// these is the amax, propagates NaN, and does not depend on the order of reduction. Every NaN's
// raw |x| bits order above inf, so canonical_amax_bits of a max over raw bits is the same value:
// the activation kernels and cast.cu's amax pass take that max (device::max_abs8) and
// fold_block_amax canonicalises once. norm_cast keeps a max over its output's own bits (amax_bits
// converts it). cast8 (quantize, cast_transpose) and the CPU references take abs_bits per element:
// cast8 measured faster so (cast_device.cuh).
TPFP8_HD uint32_t canonical_amax_bits(uint32_t a) { return a > 0x7F800000u ? 0x7FC00000u : a; }
TPFP8_HD uint32_t abs_bits(float x) { return canonical_amax_bits(float_bits(x) & 0x7FFFFFFFu); }

template <typename T>
constexpr DType dtype_of() {
  return std::is_same_v<T, bf16_t>   ? DType::kBFloat16
         : std::is_same_v<T, fp16_t> ? DType::kFloat16
                                     : DType::kFloat32;
}

// Calls fn(T{}) with T the storage type of `dtype` (host code: picks a template instance).
template <typename Fn>
auto dispatch_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kBFloat16:
      return fn(bf16_t{});
    case DType::kFloat16:
      return fn(fp16_t{});
    default:
      return fn(float{});
  }
}

}  // namespace tpfp8
