// The fused activation + FP8 cast ops (kernels/activation_cast.h) as torch functions,
// registered as torch.ops.tpfp8.activation_* and callable directly from C++ (a future
// LayerNormMLP's fc1 -> act -> fc2). `activation` is 0 (GELU) or 1 (SwiGLU); x is the
// pre-activation [rows, in_cols] (SwiGLU: in_cols = 2n), its result y [rows, n], dy the gradient
// of y and dx = dy * act'(x) [rows, in_cols]. FP8 outputs: rowwise [rows, cols], columnwise
// [cols, rows] uint8, cols (n, or in_cols for dx) a multiple of 16; `out` / `grad_input` the
// result in x's dtype. Each validates everything before writing anything.
#pragma once

#include "ops.h"

namespace tpfp8 {

// Forward with a given scale (delayed scaling): amax folded, scale_inv = 1 / scale written.
void activation_cast(const at::Tensor& input, const at::Tensor& scale, const OptTensor& rowwise,
                     const OptTensor& columnwise, const OptTensor& out, const OptTensor& amax,
                     const OptTensor& scale_inv, int64_t activation, int64_t fp8_format);
// Forward with current scaling from `amax`, the amax of act(x) (activation_amax, then any
// all-reduce): scale = fp8_max / max(amax, epsilon), computed by the kernel.
void activation_cast_current(const at::Tensor& input, const at::Tensor& amax, double epsilon,
                             const OptTensor& rowwise, const OptTensor& columnwise,
                             const OptTensor& out, const OptTensor& scale_inv, int64_t activation,
                             int64_t fp8_format);
// amax = max(amax, max |act(x)|), nothing else written (current scaling's first pass).
void activation_amax(const at::Tensor& input, at::Tensor& amax, int64_t activation);

// The same three for the backward's dx = dy * act'(x); `dbias` ([in_cols], float32 or 16-bit),
// if given, receives dx's column sums (the bias gradient of the layer before) from the cast pass,
// in kernels/cast.h's fixed order.
void activation_backward_cast(const at::Tensor& grad, const at::Tensor& input,
                              const at::Tensor& scale, const OptTensor& rowwise,
                              const OptTensor& columnwise, const OptTensor& grad_input,
                              const OptTensor& amax, const OptTensor& scale_inv, int64_t activation,
                              int64_t fp8_format, const OptTensor& dbias = std::nullopt);
void activation_backward_cast_current(const at::Tensor& grad, const at::Tensor& input,
                                      const at::Tensor& amax, double epsilon,
                                      const OptTensor& rowwise, const OptTensor& columnwise,
                                      const OptTensor& grad_input, const OptTensor& scale_inv,
                                      int64_t activation, int64_t fp8_format,
                                      const OptTensor& dbias = std::nullopt);
// act(x) (grad null) or dx = dy * act'(x) (grad: dy) in x's dtype alone, into `out`.
void activation_high_precision(const at::Tensor* grad, const at::Tensor& input, at::Tensor& out,
                               int64_t activation);
void activation_backward_amax(const at::Tensor& grad, const at::Tensor& input, at::Tensor& amax,
                              int64_t activation);

}  // namespace tpfp8
