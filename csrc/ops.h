// The torch-level ops (registered as torch.ops.tpfp8.*), callable directly from C++ so the
// Linear's forward and backward go through no dispatcher round trips. Each validates its
// arguments (TORCH_CHECK with what, why and how to fix) before touching any output.
#pragma once

#include <torch/types.h>

#include <optional>
#include <tuple>
#include <vector>

#include "kernels/delayed_scaling.h"

namespace tpfp8 {

using OptTensor = std::optional<at::Tensor>;

// input [M, K] fp32/bf16/fp16 -> out [M, K] uint8; amax folded, scale_inv = 1/scale written.
void quantize(const at::Tensor& input, const at::Tensor& scale, at::Tensor& out,
              const OptTensor& amax, const OptTensor& scale_inv, int64_t fp8_format);
// One read of input: rowwise [M, K] and/or columnwise [K, M]; with `dbias` [K] (float32, or
// bfloat16 / float16 converted from float32) also the column sums over M -- the bias gradient
// of a gradient -- in a fixed order (kernels/cast.h): the same bytes every run, GPU or CPU.
void cast_transpose(const at::Tensor& input, const at::Tensor& scale, const OptTensor& rowwise,
                    const OptTensor& columnwise, const OptTensor& amax, const OptTensor& scale_inv,
                    int64_t fp8_format, const OptTensor& dbias = std::nullopt);
// cast_transpose with the scale and the amax as slots of a layer's state: scale[scale_index],
// amax[amax_index] of contiguous float32 tensors (the Linear's casts: no views to make).
void cast_transpose_slots(const at::Tensor& input, const at::Tensor& scale, int64_t scale_index,
                          const OptTensor& rowwise, const OptTensor& columnwise,
                          const OptTensor& amax, int64_t amax_index, const OptTensor& scale_inv,
                          int64_t fp8_format, const OptTensor& dbias = std::nullopt);
// cast_transpose with current scaling: the kernel computes the scale from `amax` (already
// reduced over any group): fp8_max / max(amax, epsilon), 1 for an amax of 0, inf or NaN.
void cast_transpose_current(const at::Tensor& input, const at::Tensor& amax, double epsilon,
                            const OptTensor& rowwise, const OptTensor& columnwise,
                            const OptTensor& scale_inv, int64_t fp8_format,
                            const OptTensor& dbias = std::nullopt);
// cast_transpose's dbias alone: out [K] = the column sums of input [M, K], same bytes.
void column_sum(const at::Tensor& input, at::Tensor& out);
void transpose_fp8(const at::Tensor& input, at::Tensor& out);
void dequantize(const at::Tensor& input, const at::Tensor& scale_inv, int64_t fp8_format,
                at::Tensor& out);
void amax(const at::Tensor& input, at::Tensor& amax);
void delayed_scaling_update(at::Tensor& amax_history, at::Tensor& scale, at::Tensor& scale_inv,
                            const at::Tensor& fp8_max, int64_t margin, bool use_history_max);
// The same for state spread over many buffers: histories[j] [n_j, H] (tensor-major), one
// launch per 96 tensors. Their scales are scales[j] [n_j], or with `scale_offsets` the slots
// offsets[j] .. offsets[j] + n_j - 1 of scales[j] (a layer's [3]: no views to make). Given
// `previous` (the op does not take it), each scale is first kept in the same slot of
// previous[j], in the same launch.
void delayed_scaling_update_many(const std::vector<at::Tensor>& histories,
                                 const std::vector<at::Tensor>& scales,
                                 const std::vector<at::Tensor>& scale_invs,
                                 const std::vector<double>& fp8_max, int64_t margin,
                                 bool use_history_max, at::IntArrayRef scale_offsets = {},
                                 const std::vector<at::Tensor>& previous = {});
// delayed_scaling_update_many in two halves: its checks and the launches' parameters (the
// tensors' addresses), then the launches, on `device`'s device (a tensor there).
std::vector<DelayedScalingBatch> delayed_scaling_batches(
    const std::vector<at::Tensor>& histories, const std::vector<at::Tensor>& scales,
    const std::vector<at::Tensor>& scale_invs, const std::vector<double>& fp8_max, int64_t margin,
    bool use_history_max, at::IntArrayRef scale_offsets = {},
    const std::vector<at::Tensor>& previous = {});
void run_delayed_scaling_batches(const at::Tensor& device,
                                 const std::vector<DelayedScalingBatch>& batches);
// out[M, N] = scales * A . B^T (+ bias) (+ out, or + residual [M, N] in out's dtype); types are
// GemmType codes (kernels/gemm.h).
void gemm(const at::Tensor& a, const at::Tensor& b, at::Tensor& out, const OptTensor& a_scale_inv,
          const OptTensor& b_scale_inv, int64_t a_type, int64_t b_type, const OptTensor& bias,
          bool accumulate, bool fast_accum, bool a_transposed, bool b_transposed,
          const OptTensor& residual = std::nullopt);

// Fused LayerNorm (rms_norm false: gamma, optional beta) / RMSNorm forward of input [M, H]
// (H % 16 == 0, H <= 16384) into any of: out [M, H] (input dtype), rowwise [M, H] /
// columnwise [H, M] FP8 codes with `scale`, amax folded, scale_inv, mean / rstd [M] fp32.
void norm_cast(const at::Tensor& input, const at::Tensor& gamma, const OptTensor& beta,
               bool rms_norm, double eps, const at::Tensor& scale, const OptTensor& out,
               const OptTensor& rowwise, const OptTensor& columnwise, const OptTensor& amax,
               const OptTensor& scale_inv, const OptTensor& mean, const OptTensor& rstd,
               int64_t fp8_format);
// The same with current scaling: folds the normalized output's max |y| into `amax` (one pass
// over the input), then casts with fp8_max / max(amax, scale_epsilon) (a second pass).
void norm_cast_current(const at::Tensor& input, const at::Tensor& gamma, const OptTensor& beta,
                       bool rms_norm, double eps, const at::Tensor& amax, double scale_epsilon,
                       const OptTensor& out, const OptTensor& rowwise, const OptTensor& columnwise,
                       const OptTensor& scale_inv, const OptTensor& mean, const OptTensor& rstd,
                       int64_t fp8_format);
// The two passes apart, as a Linear with a norm in front runs them (an all-reduce of the amax
// may come between): norm_amax folds max |y| into `amax` and writes nothing else;
// norm_cast_from casts with `scale`, or with the scale derived from `scale_amax` when given
// (neither: high-precision outputs only).
void norm_amax(const at::Tensor& input, const at::Tensor& gamma, const OptTensor& beta,
               bool rms_norm, double eps, const at::Tensor& amax);
void norm_cast_from(const at::Tensor& input, const at::Tensor& gamma, const OptTensor& beta,
                    bool rms_norm, double eps, const OptTensor& scale, const OptTensor& scale_amax,
                    double scale_epsilon, const OptTensor& out, const OptTensor& rowwise,
                    const OptTensor& columnwise, const OptTensor& amax, const OptTensor& scale_inv,
                    const OptTensor& mean, const OptTensor& rstd, int64_t fp8_format);
// (dx [M, H] in x's dtype, dgamma [H] and dbeta [H] (RMSNorm: [0]) in gamma's dtype); `dx_add`
// (x's dtype and shape) is added to dx in the same pass, before its rounding.
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_backward(
    const at::Tensor& dy, const at::Tensor& x, const OptTensor& mean, const at::Tensor& rstd,
    const at::Tensor& gamma, bool rms_norm, const OptTensor& dx_add = std::nullopt);

}  // namespace tpfp8
