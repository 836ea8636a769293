// Argument checks for the torch layer: one helper per kind of check, each message says what
// was given, what is needed and how to fix it.
#pragma once

#include <ATen/MemoryOverlap.h>
#include <torch/types.h>

#include <string>

#include "kernels/dtype.h"
#include "kernels/fp8_format.h"

namespace tpfp8 {

inline std::string shape_str(const at::Tensor& t) { return c10::str(t.sizes()); }

inline void check_2d(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == 2, name, " must be 2-D [rows, cols], got shape ", shape_str(t),
                    "; reshape it first, e.g. x.reshape(-1, x.shape[-1])");
}

inline void check_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous (row-major), got strides ",
                    c10::str(t.strides()), "; call .contiguous() first");
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* name,
                              const char* ref_name) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), name, " is on ", t.device(), " but ", ref_name,
                    " is on ", ref.device(), "; move both to the same device");
}

// A one-element fp32 tensor on ref's device (scale, scale_inv, amax).
inline void check_scalar_f32(const at::Tensor& t, const char* name, const at::Tensor& ref,
                             const char* ref_name) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat && t.numel() == 1, name,
                    " must be a one-element float32 tensor, got ", t.scalar_type(), " of shape ",
                    shape_str(t));
  check_same_device(t, ref, name, ref_name);
}

// Element `index` of a contiguous float32 tensor (a slot of a layer's state), checked: the
// pointer an op reads or writes, with no view made (host time).
inline float* f32_slot(const at::Tensor& t, int64_t index, const char* name,
                       const at::Tensor& ref) {
  TORCH_CHECK_VALUE(
      t.scalar_type() == at::kFloat && t.is_contiguous() && index >= 0 && index < t.numel(), name,
      " must be a contiguous float32 tensor holding element ", index, ", got ", t.scalar_type(),
      " of shape ", shape_str(t));
  check_same_device(t, ref, name, "input");
  return t.data_ptr<float>() + index;
}

inline DType high_precision_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kHalf:
      return DType::kFloat16;
    default:
      TORCH_CHECK_TYPE(false, name, " must be float32, bfloat16 or float16, got ", t.scalar_type(),
                       "; convert it with .float() or .to(torch.bfloat16)");
  }
}

inline void check_fp8_storage(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kByte, name, " must hold FP8 codes as torch.uint8, got ",
                   t.scalar_type(), "; view float8 tensors with .view(torch.uint8)");
  check_contiguous(t, name);
}

// An output buffer must match exactly what the op writes: no silent resize or reinterpretation.
inline void check_output(const at::Tensor& out, const char* name, at::IntArrayRef sizes,
                         at::ScalarType dtype, const at::Tensor& ref) {
  TORCH_CHECK_VALUE(out.sizes() == sizes && out.scalar_type() == dtype, name, " must be ", dtype,
                    " of shape ", c10::str(sizes), ", got ", out.scalar_type(), " of shape ",
                    shape_str(out), "; allocate it with that shape and dtype or pass None");
  check_contiguous(out, name);
  check_same_device(out, ref, name, "input");
}

// Tensors an op reads and writes must not share memory (a transpose into its own input, one
// buffer given as both outputs, amax and scale_inv in one slot): the kernels would read bytes
// they had already overwritten, or keep only one of two results. `named`: each (name, tensor or
// none); views of distinct parts of one buffer are fine.
inline void check_no_overlap(
    std::initializer_list<std::pair<const char*, const c10::optional<at::Tensor>>> named) {
  for (auto a = named.begin(); a != named.end(); ++a) {
    for (auto b = std::next(a); b != named.end(); ++b) {
      if (!a->second || !b->second || !a->second->defined() || !b->second->defined()) continue;
      const at::MemOverlapStatus s = at::get_overlap_status(*a->second, *b->second);
      TORCH_CHECK_VALUE(s != at::MemOverlapStatus::Full && s != at::MemOverlapStatus::Partial,
                        a->first, " and ", b->first, " share memory; pass separate tensors");
    }
  }
}

// An op's enum argument (schemas take enums as ints): `code` as E, if it is one of E's codes,
// 0 .. E::kLast (`codes` names them for the message).
template <typename E>
E code_as(int64_t code, const char* what, const char* codes) {
  TORCH_CHECK_VALUE(code >= 0 && code <= static_cast<int64_t>(E::kLast), what, " must be ", codes,
                    ", got ", code);
  return static_cast<E>(code);
}

inline Fp8Format fp8_format_from(int64_t code) {
  return code_as<Fp8Format>(code, "fp8_format", "0 (E4M3) or 1 (E5M2)");
}

}  // namespace tpfp8
