// The Linear's forward and backward as one C++ autograd Function (y = x W^T + b):
//
//   forward   x [.., K] -> x2 [M, K]; quantize x2 (row-wise, + column-wise if wgrad will need it)
//             quantize W [N, K] (row-wise, + column-wise for dgrad) or take the cached FP8 W
//             fprop  y = x2 . W^T (+ b)          GEMM(x row-wise, W row-wise), fast accumulation
//   backward  quantize dy [M, N] (row-wise for dgrad, column-wise for wgrad)
//             dgrad  dx = dy . W                 GEMM(dy row-wise, W column-wise)
//             wgrad  dW = dy^T . x2               GEMM(dy column-wise, x column-wise) ->
//             W.main_grad or dW db = sum over M of dy
//
// Saved for backward: the column-wise FP8 input (1 byte per element) and the column-wise FP8
// weight, or with save_original_input the high-precision input, re-quantized in backward.
// Outside FP8 the same three GEMMs run in the input's precision.
#pragma once

#include <torch/types.h>

#include <functional>
#include <optional>
#include <string>

#include "comm.h"
#include "quantizer.h"

namespace tpfp8 {

enum class WeightCache : int { kNone = 0, kFill = 1, kReuse = 2 };

// Megatron-style tensor parallelism over `tp_group`:
//   column: W split on N (this rank holds [N/tp, K]); with sequence parallelism the input
//           arrives split along dim 0 and is all-gathered (in FP8: row-wise bytes and one
//           shared scale), dx is reduce-scattered back; without it dx is all-reduced.
//   row:    W split on K ([N, K/tp]); y is reduce-scattered (sequence parallel) or
//           all-reduced, the full bias added after; with sequence parallelism dy arrives
//           split along dim 0 and is all-gathered (FP8) for both backward GEMMs.
enum class ParallelMode : int { kNone = 0, kColumn = 1, kRow = 2 };

// Precision debugging (tpfp8.debug): per GEMM, run it in high precision, feed it
// fake-quantized tensors, and report every operand exactly as the GEMM consumed it.
struct DebugOptions {
  bool active = false;
  bool hp_fprop = false, hp_dgrad = false, hp_wgrad = false;  // disable_fp8_gemm
  // fake_quant: quantize -> dequantize (current scaling) with this format, then a
  // high-precision GEMM; -1 leaves the tensor alone.
  int64_t fake_activation = -1, fake_weight = -1, fake_gradient = -1;
  // log(gemm, tensor, used, original, scale_inv, format): `used` are the fp32 values the GEMM
  // computed with ([rows, cols] of the tensor, whatever layout the GEMM read), `original` the
  // high-precision tensor they came from, scale_inv/format those of FP8 data (undefined / -1
  // for a high-precision operand).
  std::function<void(const std::string&, const std::string&, const at::Tensor&, const at::Tensor&,
                     const at::Tensor&, int64_t)>
      log;
};

struct LinearOptions {
  bool fp8 = false;
  QuantizerSpec input, weight, grad;  // used when fp8
  bool save_original_input = false;
  // wgrad into `main_grad` (fp32 [N, K]), written when main_grad_overwrite (first micro-batch)
  // else accumulated; the weight then gets no .grad.
  bool fuse_wgrad_accumulation = false;
  at::Tensor main_grad;
  bool main_grad_overwrite = false;
  // kFill casts the weight into these buffers, kReuse uses them without casting.
  WeightCache weight_cache = WeightCache::kNone;
  at::Tensor weight_cache_rowwise, weight_cache_columnwise, weight_cache_scale_inv;
  ParallelMode parallel_mode = ParallelMode::kNone;
  bool sequence_parallel = false;
  ProcessGroupPtr tp_group;
  // Active debugging also gathers the high-precision input and quantizes the gathered tensor
  // (its statistics and its usages must be of the tensor the GEMMs use) instead of gathering
  // FP8 bytes.
  DebugOptions debug;
};

// Sequence-parallel gather in FP8: quantize this rank's rows [m, K] (current scaling reduces
// the amax over the group first, so the scale is the whole tensor's on every rank), then
// all-gather the row-wise bytes into [world * m, K] sharing one scale_inv. `local_out`, if
// given, receives this rank's quantized rows.
Fp8Tensor all_gather_fp8(const at::Tensor& local, const QuantizerSpec& spec,
                         const ProcessGroupPtr& group, Fp8Tensor* local_out = nullptr);

// Raises ValueError (what was given, how to fix it) unless `linear` can run these arguments.
void check_inputs(const at::Tensor& x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias, const LinearOptions& options);

// y = x W^T (+ bias) with autograd. x: [..., K] fp32/bf16/fp16; weight [N, K]; bias [N].
// Every check runs before any FP8 state (amax history, caches) is touched.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias, const LinearOptions& options);

}  // namespace tpfp8
