// Device-side pieces shared by the cast kernels: 8-wide vector access, the hardware FP8
// conversion, the 4x4 byte transpose, the block-wide amax fold and the tiles' column sums.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cast.h"
#include "dtype.h"
#include "fp8_format.h"

namespace tpfp8 {
namespace device {

inline bool aligned(const void* p, int bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Eight elements, loaded or stored as one (or two) 16-byte accesses when aligned.
template <typename T>
struct alignas(8 * sizeof(T) < 16 ? 8 * sizeof(T) : 16) Pack8 {
  T v[8];
};

__device__ __forceinline__ float load_float(fp16_t x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));  // exact; NaN payloads never reach output
  return f;
}
__device__ __forceinline__ float load_float(bf16_t x) { return to_float(x); }
__device__ __forceinline__ float load_float(float x) { return x; }

// Element j of 8 held in 32-bit words as in memory (16-bit elements two a word, the first in the
// low half), as fp32: load_float of it, unpacked from its word only where it is used.
template <typename T>
__device__ __forceinline__ float element(const uint32_t* w, int j) {
  if constexpr (sizeof(T) == 4) {
    return bits_float(w[j]);
  } else if constexpr (std::is_same_v<T, bf16_t>) {
    return bits_float(j % 2 == 0 ? w[j / 2] << 16 : w[j / 2] & 0xFFFF0000u);
  } else {
    return load_float(fp16_t{static_cast<uint16_t>(w[j / 2] >> 16 * (j % 2))});
  }
}

// Four scaled values to four FP8 bytes (first value in the lowest byte). Branch-free, so
// the compiler keeps a thread's loads in flight together.
template <Fp8Format F>
__device__ __forceinline__ uint32_t encode4(const float* v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  // cvt...satfinite is round-to-nearest-even with saturation: the software encoder's rule.
  uint16_t lo, hi;
  if constexpr (F == Fp8Format::kE4M3) {
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;" : "=h"(lo) : "f"(v[0]), "f"(v[1]));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;" : "=h"(hi) : "f"(v[2]), "f"(v[3]));
  } else {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %2, %1;" : "=h"(lo) : "f"(v[0]), "f"(v[1]));
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %2, %1;" : "=h"(hi) : "f"(v[2]), "f"(v[3]));
  }
  const uint32_t w = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  // One canonical NaN byte (0x7F) whatever the hardware makes of NaN's sign and payload. Only
  // NaN inputs make NaN codes (satfinite saturates infinities): magnitudes 0x7F (E4M3) or 0x7D
  // .. 0x7F (E5M2), which adding 1 or 3 carries into bit 7 -- the four bytes in a few integer
  // operations instead of a float comparison each. E4M3's NaN magnitude is already canonical:
  // clearing the sign bit is all (1 % faster GELU / SwiGLU forward on the H200).
  static_assert(kFp8NaN == 0x7F, "the NaN fix-ups below make 0x7F");
  constexpr uint32_t kCarry = F == Fp8Format::kE4M3 ? 0x01010101u : 0x03030303u;
  const uint32_t nan = ((w & 0x7F7F7F7Fu) + kCarry) & 0x80808080u;
  if constexpr (F == Fp8Format::kE4M3) {
    return w & ~nan;
  } else {
    const uint32_t mask = (nan >> 7) * 0xFFu;
    return (w & ~mask) | (0x7F7F7F7Fu & mask);
  }
#else
  uint32_t w = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) w |= static_cast<uint32_t>(encode_fp8(v[j], F)) << (8 * j);
  return w;
#endif
}

// Converts eight elements, scales, encodes; folds |x| into amax. Returns bytes as uint2.
// abs_bits per element, though max_abs8 or a max over raw |x| bits issue 8-22 % fewer
// instructions: with either, back-to-back casts on the H200 ran slower (cast_transpose
// 8192x4096 bf16 40.4 -> 42.3-43.5 us, a 16384x4096 weight 74.4 -> 82-84 us; RESULTS.md,
// twenty-first session).
template <Fp8Format F, typename T>
__device__ __forceinline__ uint2 cast8(const Pack8<T>& in, float scale, uint32_t& amax) {
  float v[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float x = load_float(in.v[j]);
    amax = max(amax, abs_bits(x));
    v[j] = x * scale;
  }
  return make_uint2(encode4<F>(v), encode4<F>(v + 4));
}

// from_float<T> of eight values, in memory's word layout (16-bit T: two a word, the first in the
// low half). Returns the words' packed magnitudes' max (16-bit T: a max per half), which a
// caller may fold into an amax. 16-bit T: the hardware's round-to-nearest-even pair conversion
// rounds every non-NaN value as to_bf16 / to_fp16 do (overflow to inf, subnormals kept) in a
// fraction of the instructions; a chunk that made a NaN, rare, is redone by from_float for the
// canonical NaN (the returned max still orders it above every other value).
template <typename T>
__device__ __forceinline__ uint32_t round8(const float (&f)[8], uint32_t (&y)[2 * sizeof(T)]) {
  if constexpr (sizeof(T) == 4) {
    uint32_t m = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      y[j] = float_bits(from_float<float>(f[j]));
      m = max(m, y[j] & 0x7FFFFFFFu);
    }
    return m;
  } else {
    constexpr bool kBf16 = std::is_same_v<T, bf16_t>;
    constexpr uint32_t kInf2 = kBf16 ? 0x7F807F80u : 0x7C007C00u;
    auto software = [&] {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t lo = from_float<T>(f[2 * i]).bits, hi = from_float<T>(f[2 * i + 1]).bits;
        y[i] = lo | hi << 16;
      }
    };
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (kBf16) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(y[i]) : "f"(f[2 * i + 1]), "f"(f[2 * i]));
      } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(y[i]) : "f"(f[2 * i + 1]), "f"(f[2 * i]));
      }
    }
#else
    software();
#endif
    const uint32_t m = __vmaxu2(__vmaxu2(y[0] & 0x7FFF7FFFu, y[1] & 0x7FFF7FFFu),
                                __vmaxu2(y[2] & 0x7FFF7FFFu, y[3] & 0x7FFF7FFFu));
    if (__vmaxu2(m, kInf2) != kInf2) software();  // a magnitude above inf: a NaN
    return m;
  }
}

// Transposes a 4x4 byte block: w[r] holds row r, result t[c] holds column c.
__device__ __forceinline__ void transpose4x4(const uint32_t w[4], uint32_t t[4]) {
  const uint32_t x0 = __byte_perm(w[0], w[1], 0x5140), x1 = __byte_perm(w[0], w[1], 0x7362);
  const uint32_t y0 = __byte_perm(w[2], w[3], 0x5140), y1 = __byte_perm(w[2], w[3], 0x7362);
  t[0] = __byte_perm(x0, y0, 0x5410);
  t[1] = __byte_perm(x0, y0, 0x7632);
  t[2] = __byte_perm(x1, y1, 0x5410);
  t[3] = __byte_perm(x1, y1, 0x7632);
}

// max(a, b), NaN if either is: one FMNMX.NAN, whose operands take |x| as a modifier. Its bits
// over |x|, canonicalised, are abs_bits' max (a max over abs_bits takes three instructions).
__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
// max(a, |y[0]|, ..., |y[7]|) as a tree four deep: the same eight instructions as a chain, which
// kept a warp of the multi-input kernels waiting eight latencies a segment.
__device__ __forceinline__ float max_abs8(float a, const float (&y)[8]) {
  float m[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) m[i] = max_nan(fabsf(y[2 * i]), fabsf(y[2 * i + 1]));
  return max_nan(a, max_nan(max_nan(m[0], m[1]), max_nan(m[2], m[3])));
}
// max(a, |x|), NaN if either is: max_abs8's step for one element.
__device__ __forceinline__ float max_abs(float a, float x) { return max_nan(a, fabsf(x)); }

// Block-wide max of `v`, then one atomic per block into *amax (fp32 >= 0 or NaN, compared
// as ordered bits). `v` may be a max of raw |x| bits, any NaN payload: it is made abs_bits'
// here, once, instead of per element. Every thread of the block must call it.
__device__ __forceinline__ void fold_block_amax(uint32_t v, float* amax) {
  __shared__ uint32_t warp_max[32];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  v = __reduce_max_sync(0xFFFFFFFFu, canonical_amax_bits(v));
  if (lane == 0) warp_max[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>(blockDim.x / 32) ? warp_max[lane] : 0u;
    v = __reduce_max_sync(0xFFFFFFFFu, v);
    if (lane == 0 && v != 0) atomicMax(reinterpret_cast<unsigned int*>(amax), v);
  }
}

// A 128-column tile's column sums in cast.h's dbias order, for kernels of 256 threads where
// thread i sums columns 8 (i % 16) .. +7 of the tile over lane row q = i / 16 (rows q, q + 16,
// ..., q + 112) into v. Phase one: the two threads of a column segment in warp w (lane rows 2w
// and 2w + 1) add theirs, and the first stores the warp's 128 sums to warp_sums [8][128]. Every
// thread must call it; a barrier must follow before store_column_sums.
__device__ __forceinline__ void publish_column_sums(float (&v)[8], float* warp_sums) {
  static_assert(kDbiasLanes == 16 && kDbiasGroups == 8, "256 threads: 16 lanes, 8 warps");
  const int lane = threadIdx.x % 32, seg = threadIdx.x % 16;
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] += __shfl_xor_sync(0xFFFFFFFFu, v[j], 16);
  if (lane < 16) {
    float4* out = reinterpret_cast<float4*>(warp_sums + (threadIdx.x / 32) * 128 + seg * 8);
    out[0] = make_float4(v[0], v[1], v[2], v[3]);
    out[1] = make_float4(v[4], v[5], v[6], v[7]);
  }
}

// Phase two: thread c < 128 adds column k0 + c (if below cols) over the warps, in warp order,
// into row[k0 + c] (the tile's row of dbias_partial, columns [0, cols)).
__device__ __forceinline__ void store_column_sums(const float* warp_sums, float* row, int64_t k0,
                                                  int64_t cols) {
  const int c = threadIdx.x;
  if (c >= 128 || k0 + c >= cols) return;
  float sum = 0.0f;
#pragma unroll
  for (int w = 0; w < kDbiasGroups; ++w) sum += warp_sums[w * 128 + c];
  row[k0 + c] = from_float<float>(sum);
}

// Asks L2 for `bytes` at src (sm_90 bulk prefetch: no registers, nothing to wait for); src and
// bytes are multiples of 16. A no-op before sm_90.
__device__ __forceinline__ void prefetch_l2(const void* src, int64_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(__cvta_generic_to_global(src)),
               "r"(static_cast<uint32_t>(bytes)));
#endif
}

}  // namespace device

// Multiprocessors of the current device, read once per device (no sync, no allocation).
int current_sm_count();

}  // namespace tpfp8
