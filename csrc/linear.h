// The Linear's forward and backward (y = x W^T + b), registered as the schema-first ops
// torch.ops.tpfp8.linear_forward / linear_backward (linear_ops.cpp); the op
// torch.ops.tpfp8.linear joins them with autograd (linear_autograd.cpp), and torch.compile
// traces the two, opaque with their fake kernels, into its forward and backward graphs.
//
//   forward   x [.., K] -> x2 [M, K]; quantize x2 (row-wise, + column-wise if wgrad will need it)
//             quantize W [N, K] (row-wise, + column-wise for dgrad) or take the cached FP8 W
//             fprop  y = x2 . W^T (+ b)          GEMM(x row-wise, W row-wise), fast accumulation
//   backward  quantize dy [M, N] (row-wise for dgrad, column-wise for wgrad)
//             dgrad  dx = dy . W                 GEMM(dy row-wise, W column-wise)
//             wgrad  dW = dy^T . x2               GEMM(dy column-wise, x column-wise) ->
//             W.main_grad or dW
//             db = sum over M of dy              (fused into dy's cast where dy has one)
//
// A `residual` (the output's shape and dtype) is added to y: in fprop's epilogue, before y's
// one rounding (beta = 1 with C = residual), or after the reduction under row parallelism --
// a block's skip connection without a separate add kernel. Its gradient is dy itself; where
// the residual is the input of a norm prologue (x + f(norm(x))), backward adds dy to dx in the
// norm backward's pass (`SavedForBackward::input_grad`) instead of in a separate kernel.
//
// A fused module's Linear runs a prologue (a norm, an activation) on its input first; in FP8
// (not debugging, not save_original_input) the prologue's kernel writes the FP8 input itself,
// and backward runs the prologue's backward on dgrad's output.
//
// Forward returns what backward needs: the column-wise FP8 input (1 byte per element) and the
// column-wise FP8 weight; with save_original_input (or debugging) the caller keeps the
// high-precision input instead, re-quantized in backward. Outside FP8 the same three GEMMs run
// in the input's precision.
#pragma once

#include <torch/types.h>

#include <functional>
#include <optional>
#include <string>

#include "comm.h"
#include "debug_quantizer.h"
#include "ops.h"
#include "prologue.h"
#include "quantizer.h"

namespace tpfp8 {

enum class WeightCache : int { kNone = 0, kFill = 1, kReuse = 2, kLast = kReuse };

// Megatron-style tensor parallelism over `tp_group`:
//   column: W split on N (this rank holds [N/tp, K]); with sequence parallelism the input
//           arrives split along dim 0 and is all-gathered (in FP8: row-wise bytes and one
//           shared scale), dx is reduce-scattered back; without it dx is all-reduced.
//   row:    W split on K ([N, K/tp]); y is reduce-scattered (sequence parallel) or
//           all-reduced, the full bias added after; with sequence parallelism dy arrives
//           split along dim 0 and is all-gathered (FP8) for both backward GEMMs.
enum class ParallelMode : int { kNone = 0, kColumn = 1, kRow = 2, kLast = kRow };

// A layer's settings for one call: fixed by the module's configuration and the recipe in force.
struct LinearConfig {
  Scaling scaling = Scaling::kNone;  // kNone: high precision
  Fp8Format fwd_format = Fp8Format::kE4M3, grad_format = Fp8Format::kE5M2;
  double epsilon = 0.0;  // current scaling
  WeightCache weight_cache = WeightCache::kNone;
  bool save_original_input = false;
  ParallelMode parallel_mode = ParallelMode::kNone;
  bool sequence_parallel = false;
  ProcessGroupPtr tp_group;  // resolved from its name (torch's process-group registry)
  DebugOptions debug;
  bool fp8() const { return scaling != Scaling::kNone; }
};

LinearConfig linear_config(int64_t scaling, int64_t fwd_format, int64_t grad_format, double epsilon,
                           int64_t weight_cache, bool save_original_input, int64_t parallel_mode,
                           bool sequence_parallel, const std::string& group_name,
                           at::IntArrayRef debug);

// The delayed-scaling update of many layers (fp8_autocast's exit), built once: layer j's scale
// and scale_inv [3], its forward and gradient histories, and fp8_max 3 per layer; with
// `amax_group` their newest amaxes are all-reduced first, in one collective. `previous`, if
// not empty, receives each layer's scales before each update (in the same launch).
DelayedUpdate layers_update(const std::vector<at::Tensor>& scales,
                            const std::vector<at::Tensor>& scale_invs,
                            const std::vector<at::Tensor>& histories,
                            const std::vector<at::Tensor>& grad_histories,
                            const std::vector<double>& fp8_max, int64_t margin,
                            bool use_history_max, const ProcessGroupPtr& amax_group,
                            const std::vector<at::Tensor>& previous = {});

// The weight's FP8 cache: filled with kFill, read with kReuse.
struct WeightCacheBuffers {
  at::Tensor rowwise, columnwise, scale_inv;
};

// Dim 0 of a Linear's output for its input's dim 0: sequence parallelism gathers it (column)
// or scatters it (row) over the group.
int64_t output_dim0(int64_t x_dim0, const LinearConfig& c);

// Raises ValueError (what was given, how to fix it) unless the forward can run these arguments.
void check_inputs(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                  const LinearConfig& c, const DelayedState& state, const WeightCacheBuffers& cache,
                  const OptTensor& main_grad, const PrologueArgs& prologue = {},
                  const OptTensor& residual = std::nullopt);

// The forward op's arguments as the C++ forward takes them, checked (check_inputs). The op
// and its fake kernel (for torch.compile and the meta device) both call this.
struct ForwardCall {
  LinearConfig c;
  DelayedState state;
  WeightCacheBuffers cache;
  PrologueArgs prologue;
};
ForwardCall checked_forward_call(
    const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias, const OptTensor& scale,
    const OptTensor& amax_history, const OptTensor& cache_rowwise,
    const OptTensor& cache_columnwise, const OptTensor& cache_scale_inv, const OptTensor& main_grad,
    int64_t scaling, int64_t fwd_format, int64_t grad_format, double epsilon, int64_t weight_cache,
    bool save_original_input, int64_t parallel_mode, bool sequence_parallel,
    const std::string& group_name, at::IntArrayRef debug,
    const OptTensor& prologue_weight = std::nullopt, const OptTensor& prologue_bias = std::nullopt,
    int64_t prologue = 0, double prologue_eps = 0.0, const OptTensor& residual = std::nullopt);

struct ForwardResult {
  at::Tensor y;
  // For wgrad: column-wise FP8 input [K, M], or (column-parallel SP) this rank's row-wise
  // bytes [M/tp, K], re-gathered in backward; empty when backward needs none.
  at::Tensor x_fp8, x_scale_inv;
  // For dgrad: the column-wise FP8 weight [K, N] (empty when cached: the cache is the copy).
  at::Tensor w_fp8, w_scale_inv;
  // With a prologue: its output, the Linear's high-precision input (shaped as x, the last
  // dimension in_features), where backward keeps it or `keep_prologue_output` asks for it; a
  // norm's per-row mean (LayerNorm) and rstd. Empty otherwise.
  at::Tensor x_hp, mean, rstd;
};
ForwardResult linear_forward(const at::Tensor& x, const at::Tensor& weight, const OptTensor& bias,
                             const LinearConfig& c, const DelayedState& state,
                             const WeightCacheBuffers& cache, bool need_dgrad, bool need_wgrad,
                             const PrologueArgs& prologue = {}, bool keep_prologue_output = false,
                             const OptTensor& residual = std::nullopt);

// What forward kept, as backward takes it.
struct SavedForBackward {
  OptTensor x;  // the high-precision input (high precision, save_original_input, debugging)
  at::Tensor x_fp8, x_scale_inv, w_fp8, w_scale_inv;
  std::vector<int64_t> x_shape;
  at::ScalarType x_dtype;
  // With a prologue: its input (dx is its gradient, of its shape), args and norm statistics;
  // `prologue_output_grad`, if defined, adds to the gradient of its output (a norm output the
  // module also returned).
  at::Tensor prologue_input;
  PrologueArgs prologue;
  PrologueStats stats;
  at::Tensor prologue_output_grad;
  // With a norm prologue: added to dx in the norm backward's pass (the gradient reaching the
  // prologue's input past the layer, a skip connection's: x's shape and dtype), if defined.
  at::Tensor input_grad;
};
struct Grads {
  // Empty placeholders where not asked for (dw: also when fused into main_grad; the
  // prologue's weight and bias gradients without a norm).
  at::Tensor dx, dw, db, dprologue_weight, dprologue_bias;
  // dx in FP8 instead, where the caller asked for it (GradHandoff), and its column sums.
  Fp8Tensor dx_fp8;
  at::Tensor dx_dbias;
};
// The gradient handed between the two Linears of an MLP (fc1 -> activation -> fc2) in FP8:
// fc2's backward casts the activation's input gradient, in the activation backward's own pass,
// with fc1's gradient quantizer (`state`: fc1's scale and gradient amax history, under fc2's
// recipe, which is fc1's), producing the usages fc1's GEMMs read, and with `dbias` the column
// sums of that gradient from the same pass (fc1's bias gradient, float32); fc1's backward takes
// them as its dy and its db.
struct GradHandoff {
  DelayedState state;  // give: fc1's (scale, grad_amax_history)
  bool rowwise = false, columnwise = false, dbias = false;
  const Fp8Tensor* dy = nullptr;  // take: fc2's cast of this layer's dy
  at::Tensor dy_dbias;            // and its column sums, where this layer has a bias gradient
  bool gives() const { return rowwise || columnwise; }
};
// main_grad, when given, receives wgrad (overwritten or accumulated); else dW is returned.
Grads linear_backward(const at::Tensor& dy, const SavedForBackward& saved, const at::Tensor& weight,
                      const LinearConfig& c, const DelayedState& state, const OptTensor& main_grad,
                      bool main_grad_overwrite, bool need_dgrad, bool need_wgrad,
                      std::optional<at::ScalarType> bias_dtype, const GradHandoff& handoff = {});

// Sequence-parallel gather in FP8: quantize this rank's rows [m, K] with the whole tensor's
// scale (Quantizer::quantize's split_over), then
// all-gather the row-wise bytes into [world * m, K] sharing one scale_inv. `local_out`, if
// given, receives this rank's quantized rows; `dbias` (float32 [K]), the column sums of them.
Fp8Tensor all_gather_fp8(const at::Tensor& local, const Quantizer& quantizer,
                         const ProcessGroupPtr& group, Fp8Tensor* local_out = nullptr,
                         const OptTensor& dbias = std::nullopt);

}  // namespace tpfp8
