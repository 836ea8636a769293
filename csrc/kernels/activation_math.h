// fp32 exp, erf and the activations built on them (GELU, SwiGLU, their derivatives), one
// definition for host and device so the CPU reference and the CUDA kernels give the same bits.
//
// The math libraries cannot be used for that: CUDA's expf / erff and glibc's are accurate to
// an ulp or two, but not equal to each other. Everything here is made of correctly rounded
// fp32 + - * / and explicit fused multiply-adds only (the _rn intrinsics on the device, which
// nvcc never contracts; plain operators and std::fma on the host, compiled with
// -ffp-contract=off), bit operations, and comparisons, so both sides round identically. The
// polynomials run on fma_rn: half the instructions of a multiply and an add, one rounding.
// Accuracy, measured against double by tests_cpp/test_activation_cast.cpp: exp within 1.05 ulp,
// erf 1.25, erfc 5.5, GELU ~6.
// Coefficients: tools/fit_activation_math.py.
#pragma once

#include <cstdint>

#include "fp8_format.h"

namespace tpfp8 {

TPFP8_HD float abs_f(float x) { return bits_float(float_bits(x) & 0x7FFFFFFFu); }

// Horner's rule over c[0] + c[1] u + ... + c[N-1] u^(N-1).
template <int N>
TPFP8_HD float horner(const float (&c)[N], float u) {
  float p = c[N - 1];
  for (int i = N - 2; i >= 0; --i) p = fma_rn(p, u, c[i]);
  return p;
}

// x clamped to [lo, hi], one FMNMX a bound. kNanToBound: by IEEE minNum / maxNum, where NaN
// becomes a bound; else by comparisons, where NaN stays NaN. Either way the callers select NaN
// back at the end; which form ptxas schedules better differs by kernel (on the H200 the minNum
// form makes SwiGLU 2-3 % faster and would slow GELU by 1 %).
template <bool kNanToBound>
TPFP8_HD float clamp_f(float x, float lo, float hi) {
  if constexpr (kNanToBound) {
#if defined(__CUDA_ARCH__)
    return fmaxf(fminf(x, hi), lo);
#else
    return std::fmax(std::fmin(x, hi), lo);
#endif
  }
  x = x > hi ? hi : x;
  return x < lo ? lo : x;
}

// e^(x + lo)'s range reduction, x already clamped to [-104, 89] and lo a small correction to
// it (kSplit; none otherwise): x + lo = k ln2 + r with |r| <= ln2/2. k*kLn2Hi is exact (kLn2Hi
// has 16 significant bits, |k| <= 150), so r carries only the rounding of its low parts.
template <bool kSplit>
TPFP8_HD float exp_reduce(float x, float lo, int& k) {
  constexpr float kLog2e = 1.44269502f;
  constexpr float kLn2Hi = 0.693145751953125f;
  constexpr float kLn2Lo = 1.42860677e-06f;
  constexpr float kShift = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float shifted = add_rn(mul_rn(x, kLog2e), kShift);
  const float kf = sub_rn(shifted, kShift);
  k = static_cast<int>(float_bits(shifted)) - static_cast<int>(float_bits(kShift));
  const float r = sub_rn(sub_rn(x, mul_rn(kf, kLn2Hi)), mul_rn(kf, kLn2Lo));
  return kSplit ? add_rn(r, lo) : r;
}
// e^r for |r| <= ln2/2 (a little more with a split argument's rest): in [0.70, 1.42].
TPFP8_HD float exp_poly(float r) {
  constexpr float kQ[] = {0.5f, 0.166665778f, 0.0416668542f, 0.00836314075f, 0.00139012828f};
  return add_rn(1.0f, add_rn(r, mul_rn(mul_rn(r, r), horner(kQ, r))));
}

// e^(x + lo). The 2^k scaling is two exact power-of-two steps then one rounding, so
// subnormal results round once too.
//
// Branch-free, so the compiler interleaves the elements a thread computes (the kernels are
// bound by instruction issue): arguments past the range are clamped to its ends, where the
// same arithmetic already gives inf (e^89: 1.32 * 2^128) or 0 (e^-104: 0.97 * 2^-150 rounds to
// 0), and NaN is selected back at the end, so every result equals the early-return form's.
TPFP8_HD float exp_fp32(float x, float lo = 0.0f) {
  const float hi = clamp_f<false>(x, -104.0f, 89.0f);  // e^88.73 > FLT_MAX; e^-104 rounds to 0
  lo = x == hi ? lo : 0.0f;                            // (a clamped x's rest could be NaN: x = inf)
  int k;
  const float p = exp_poly(exp_reduce<true>(hi, lo, k));
  const int k1 = k / 2, k2 = k - k1;  // each in [-75, 64]: 2^k1, 2^k2 are normal floats
  const float s1 = bits_float(static_cast<uint32_t>(k1 + 127) << 23);
  const float s2 = bits_float(static_cast<uint32_t>(k2 + 127) << 23);
  const float y = mul_rn(mul_rn(p, s1), s2);
  return x == x ? y : x;
}

// 1 + e^x, bit for bit add_rn(1.0f, exp_fp32(x)) (the sigmoid's denominator) in fewer
// instructions: below e^-86 (< 2^-124) the sum is 1 whatever the small term, so arguments
// clamp there and every e^x that counts is a normal p 2^k, k in [-124, 128]: p 2^(k-1) is exact
// and the doubling rounds (overflows) as exp_fp32's last step does.
TPFP8_HD float one_plus_exp(float x) {
  int k;
  const float p = exp_poly(exp_reduce<false>(clamp_f<true>(x, -86.0f, 89.0f), 0.0f, k));
  const float half = bits_float(static_cast<uint32_t>(k + 126) << 23);  // 2^(k-1)
  const float y = mul_rn(mul_rn(p, half), 2.0f);
  return add_rn(1.0f, x == x ? y : x);
}

// e^(-c x^2), c = 1 or 1/2. x^2 rounded to fp32 would be off by up to x^2 2^-24 in absolute
// terms, i.e. ~x^2 ulp of the result (70 ulp of erfc(8.6)); instead x_hi, x with its low 12
// significand bits cleared, squares exactly and only the small rest (x - x_hi)(x + x_hi) rounds.
TPFP8_HD float exp_neg_square(float x, float c) {
  const float xh = bits_float(float_bits(x) & 0xFFFFF000u);
  // Past -104 (x = inf too, where the rest is NaN) exp_fp32 drops the rest and gives 0.
  return exp_fp32(mul_rn(mul_rn(xh, xh), -c), mul_rn(mul_rn(sub_rn(x, xh), add_rn(x, xh)), -c));
}

// erf(a) for 0 <= a < 1: a + a P(a^2) (the a term exact, the correction about 1/8 of it).
TPFP8_HD float erf_small(float a) {
  constexpr float kP[] = {0.128379166f,   -0.37612626f,     0.112836003f,   -0.026854448f,
                          0.00518954033f, -0.000802087947f, 7.88923644e-05f};
  return add_rn(a, mul_rn(a, horner(kP, mul_rn(a, a))));
}

// erfc(a) for a >= 0, given gauss = e^(-a^2): gauss * t * H(t) with t = 1 / (1 + a/2) in
// (0, 1] and H smooth there (H(1) = 1/2, H -> 1/(2 sqrt(pi)) as a grows). Relative accuracy
// over the whole range, so the tail stays accurate, and one polynomial: no branch.
TPFP8_HD float erfc_from_gauss(float a, float gauss) {
  constexpr float kH[] = {0.282088637f,  0.282249659f,  0.245206669f,   0.185438529f,
                          0.0554381385f, 0.0340823717f, -0.0198658574f, -0.291789681f,
                          0.382886827f,  -0.191597477f, 0.035862159f};
  const float t = div_rn(1.0f, add_rn(1.0f, mul_rn(0.5f, a)));
  return mul_rn(mul_rn(gauss, t), horner(kH, t));
}

TPFP8_HD float erf_fp32(float x) {
  if (!(x == x)) return x;
  const float a = abs_f(x);
  const float r =
      a < 1.0f ? erf_small(a) : sub_rn(1.0f, erfc_from_gauss(a, exp_neg_square(a, 1.0f)));
  return bits_float(float_bits(r) | (float_bits(x) & 0x80000000u));
}

constexpr float kSqrtHalf = 0.707106769f;    // 1 / sqrt(2)
constexpr float kInvSqrt2Pi = 0.398942292f;  // 1 / sqrt(2 pi)

// Phi(x), the standard normal CDF, given gauss = e^(-x^2/2): erfc(|x| / sqrt(2)) / 2 or one
// minus it. Never 0.5 (1 + erf(x / sqrt(2))) as torch writes it: that cancels for x < 0 and
// GELU's negative tail would keep only a few bits.
TPFP8_HD float normal_cdf(float x, float gauss) {
  const float half_tail = mul_rn(0.5f, erfc_from_gauss(abs_f(mul_rn(x, kSqrtHalf)), gauss));
  return x > 0.0f ? sub_rn(1.0f, half_tail) : half_tail;
}

// GELU (torch's default, erf form): x Phi(x).
TPFP8_HD float gelu(float x) { return mul_rn(x, normal_cdf(x, exp_neg_square(x, 0.5f))); }

// d/dx GELU = Phi(x) + x phi(x), phi(x) = e^(-x^2/2) / sqrt(2 pi).
TPFP8_HD float gelu_grad(float x) {
  const float gauss = exp_neg_square(x, 0.5f);
  return add_rn(normal_cdf(x, gauss), mul_rn(x, mul_rn(gauss, kInvSqrt2Pi)));
}

// SiLU a sigmoid(a) as one quotient (one rounding fewer than a * (1 / (1 + e^-a))).
TPFP8_HD float silu(float a) { return div_rn(a, one_plus_exp(-a)); }

// SwiGLU's derivatives for y = silu(a) * b and upstream gradient dy:
//   da = dy b sigmoid(a) (1 + a (1 - sigmoid(a))),  db = dy silu(a).
// The factors that depend on a alone: silu'(a) and a sigmoid(a) (tabulated by the bf16 kernels).
TPFP8_HD void silu_grad_factors(float a, float& dsilu, float& a_sigmoid) {
  const float s = div_rn(1.0f, one_plus_exp(-a));
  dsilu = mul_rn(s, add_rn(1.0f, mul_rn(a, sub_rn(1.0f, s))));
  a_sigmoid = mul_rn(a, s);
}
TPFP8_HD void swiglu_grad(float a, float b, float dy, float& da, float& db) {
  float dsilu, a_sigmoid;
  silu_grad_factors(a, dsilu, a_sigmoid);
  da = mul_rn(mul_rn(dy, b), dsilu);
  db = mul_rn(dy, a_sigmoid);
}

}  // namespace tpfp8
