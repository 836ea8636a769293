// Quantizers: how one tensor of a Linear (input, weight or gradient) becomes FP8, and how a
// GEMM reads it.
//
// A quantizer is an object per tensor and recipe -- DelayedScalingQuantizer (the layer's scale,
// its amax written into the history), CurrentScalingQuantizer (the scale of this very tensor);
// a DebugQuantizer (debug_quantizer.h) wraps one of them, or none for high precision. Its
// tensors are views of the module's buffers, passed to the ops as arguments: the quantizer is
// built for a call and holds no state of its own. It produces the usages asked for: row-wise
// data [M, K] for GEMMs that contract over K, column-wise data [K, M] (the transpose) for those
// that contract over M, both from one cast_transpose pass over the high-precision tensor.
#pragma once

#include <torch/types.h>

#include <functional>
#include <memory>
#include <vector>

#include "comm.h"
#include "kernels/fp8_format.h"
#include "ops.h"

namespace tpfp8 {

enum class Scaling : int { kNone = 0, kDelayed = 1, kCurrent = 2, kLast = kCurrent };
enum class Gemm : int { kFprop = 0, kDgrad = 1, kWgrad = 2 };
enum Role : int64_t { kInput = 0, kWeight = 1, kGrad = 2 };  // a Linear's three tensors
const char* gemm_name(Gemm g);

// A per-tensor-scaled FP8 tensor. Either data part may be undefined.
struct Fp8Tensor {
  at::Tensor rowwise;     // [M, K] uint8
  at::Tensor columnwise;  // [K, M] uint8
  at::Tensor scale_inv;   // [1] fp32, shared by both parts
  Fp8Format format = Fp8Format::kE4M3;
};

// A tensor made ready for its GEMMs: its FP8 form and, where kept, the whole high-precision
// tensor (high-precision GEMMs, re-quantization, debugging).
struct Prepared {
  at::Tensor hp;
  Fp8Tensor q;
};

// A GEMM operand as the GEMM reads it: FP8 codes with their scale_inv, or high-precision
// values, stored [rows, K] or (transposed, high precision only) [K, rows].
struct Operand {
  at::Tensor data;
  OptTensor scale_inv;
  int64_t type = 0;
  bool transposed = false;
};
// `t` read by a GEMM in `dtype` (transposed: contracting over its rows).
Operand high_precision_operand(const at::Tensor& t, at::ScalarType dtype, bool transposed);

// How a cast fused into the kernel that computes its tensor (the norm or activation in front of
// a fused module's GEMM) is scaled: with `scale` (delayed), or with the scale derived from
// `scale_amax` (current: fp8_max / max(amax, epsilon)); `amax`, if given, receives max |y|.
struct CastScale {
  OptTensor scale, amax, scale_amax;
  double epsilon = 0.0;
};
// Such a kernel, as a quantizer drives it: its result's [rows, cols] and tensor options, a pass
// that only folds max |y| into a [1] float32 tensor (current scaling's first pass), and the pass
// that writes the defined parts of an Fp8Tensor (and its scale_inv).
struct FusedCast {
  int64_t rows = 0, cols = 0;
  at::TensorOptions options;
  std::function<void(const at::Tensor& amax)> amax;
  std::function<void(const Fp8Tensor& out, const CastScale& scale)> cast;
};

class Quantizer {
 public:
  explicit Quantizer(Fp8Format format) : format_(format) {}
  virtual ~Quantizer() = default;
  Fp8Format format() const { return format_; }

  // Quantizes a 2-D contiguous tensor. The outputs are fresh tensors unless `into` provides
  // buffers of the right shapes (the weight cache), which are then written in place. With
  // `split_over`, x is this rank's rows of a tensor split across that group and the scale is
  // the whole tensor's on every rank (they gather each other's codes). With `dbias` (float32
  // [cols]), the cast also writes the column sums of x -- of this rank's rows only -- the
  // bias gradient of an output gradient, in the cast kernel's fixed order (deterministic).
  virtual Fp8Tensor quantize(const at::Tensor& x, bool rowwise, bool columnwise,
                             const Fp8Tensor* into = nullptr,
                             const ProcessGroupPtr& split_over = {},
                             const OptTensor& dbias = std::nullopt) const = 0;
  // The same for a tensor that `fused` computes and casts in one pass, never written in high
  // precision by this quantizer (debugging, which needs the values, does not fuse).
  virtual Fp8Tensor quantize_fused(const FusedCast& fused, bool rowwise, bool columnwise,
                                   const ProcessGroupPtr& split_over = {}) const;
  // Whether a tensor split across ranks is gathered in high precision and quantized whole
  // (what debugging needs: statistics of the tensor the GEMMs see), instead of quantized per
  // rank and gathered as FP8 bytes.
  virtual bool quantizes_after_gather() const { return false; }
  // Whether `gemm` must run in high precision because of this tensor.
  virtual bool needs_high_precision(Gemm) const { return false; }
  // What `gemm` reads of `t`: FP8 codes, row-wise or column-wise (contracting over t's rows),
  // or with `high_precision` its values in `dtype`.
  virtual Operand operand(Gemm gemm, const Prepared& t, bool columnwise, bool high_precision,
                          at::ScalarType dtype) const;

 protected:
  // Fresh outputs for x, or `into`'s buffers, holding the usages asked for.
  Fp8Tensor outputs(const at::Tensor& x, bool rowwise, bool columnwise,
                    const Fp8Tensor* into) const;
  Fp8Tensor outputs(int64_t rows, int64_t cols, const at::TensorOptions& options, bool rowwise,
                    bool columnwise) const;

 private:
  Fp8Format format_;
};

// Delayed-scaling state of a layer (undefined otherwise): scale [3] of the input, the weight and
// the output gradient; amax histories (tensor-major, newest first) of the input and weight
// [2, H], written by forward, and of the gradient [1, H], written by backward -- two tensors,
// so that each is written in one direction only (a compiled graph writes a mutated input
// back when its direction ends). Casts fold their amax into row 0 unless the history is
// undefined (a checkpoint's recompute).
struct DelayedState {
  at::Tensor scale, amax_history, grad_amax_history;
};
// Delayed scaling of the layer's tensor `role`: casts with its scale in `state` and folds its
// amax into its history's row 0 (not when the history is undefined). The scale moves at
// fp8_autocast's exit (update_layers), where an amax group's ranks reduce their amaxes first,
// so the ranks of a split tensor share it already.
class DelayedScalingQuantizer final : public Quantizer {
 public:
  DelayedScalingQuantizer(Fp8Format format, const DelayedState& state, Role role)
      : Quantizer(format),
        scale_(state.scale),
        history_(role == kGrad ? state.grad_amax_history : state.amax_history),
        role_(role) {}
  Fp8Tensor quantize(const at::Tensor& x, bool rowwise, bool columnwise,
                     const Fp8Tensor* into = nullptr, const ProcessGroupPtr& split_over = {},
                     const OptTensor& dbias = std::nullopt) const override;
  Fp8Tensor quantize_fused(const FusedCast& fused, bool rowwise, bool columnwise,
                           const ProcessGroupPtr& split_over = {}) const override;

 private:
  int64_t amax_index() const;
  at::Tensor scale_, history_;  // the layer's [3] and [2 or 1, H]
  Role role_;
};

// Current scaling: scale = fp8_max / max(amax, epsilon) of this very tensor, computed on the
// device by the cast itself (no launch in between); a split tensor's amax is all-reduced (MAX)
// over the group first.
class CurrentScalingQuantizer final : public Quantizer {
 public:
  CurrentScalingQuantizer(Fp8Format format, double epsilon)
      : Quantizer(format), epsilon_(epsilon) {}
  Fp8Tensor quantize(const at::Tensor& x, bool rowwise, bool columnwise,
                     const Fp8Tensor* into = nullptr, const ProcessGroupPtr& split_over = {},
                     const OptTensor& dbias = std::nullopt) const override;
  Fp8Tensor quantize_fused(const FusedCast& fused, bool rowwise, bool columnwise,
                           const ProcessGroupPtr& split_over = {}) const override;

 private:
  // The amax of this rank's part, folded by `pass`, all-reduced (MAX) over `split_over`.
  at::Tensor amax_of(const at::TensorOptions& options, const std::function<void(at::Tensor&)>& pass,
                     const ProcessGroupPtr& split_over) const;
  double epsilon_;
};

// The delayed-scaling update of a fixed set of state tensors -- histories[j] [n_j, H]
// (tensor-major, newest first), scales[j] / scale_invs[j] [n_j] (or their slots from
// scale_offsets[j] on, as delayed_scaling_update_many takes them), fp8_max one per tensor --
// checked and laid out once, run at the end of every step: with `amax_group` the newest amaxes
// of all of them are all-reduced (MAX) first, in one collective; then the histories roll and
// the scales update in one launch per 96 tensors (keeping each scale before the update in
// previous[j], where given). It holds the tensors, so the addresses it launches with stay valid.
class DelayedUpdate {
 public:
  DelayedUpdate(const std::vector<at::Tensor>& histories, const std::vector<at::Tensor>& scales,
                const std::vector<at::Tensor>& scale_invs, const std::vector<double>& fp8_max,
                int64_t margin, bool use_history_max, ProcessGroupPtr amax_group,
                at::IntArrayRef scale_offsets = {}, const std::vector<at::Tensor>& previous = {});
  // Whether every tensor still has the memory, dtype, shape and strides it was laid out with
  // (`.data =`, `set_` or `resize_` change them): if not, build the update again.
  bool unchanged() const;
  // The update, now (TORCH_CHECK if a tensor changed: see unchanged()).
  void run() const;
  // The same, unchecked: after unchanged() answered true.
  void launch() const;

 private:
  // A tensor and what the launches' parameters took from it. The storage is held too: the
  // memory the launches write stays valid even if another thread moves the tensor meanwhile.
  struct Held {
    explicit Held(const at::Tensor& t);
    bool unchanged() const;
    at::Tensor tensor;
    c10::Storage storage;
    const void* data;
    at::ScalarType dtype;
    std::vector<int64_t> sizes, strides;
  };
  std::vector<Held> held_;
  std::vector<DelayedScalingBatch> batches_;
  ProcessGroupPtr amax_group_;
  std::vector<at::Tensor> newest_;  // views of the histories' row 0: what the group reduces
  std::vector<int64_t> newest_sizes_;
};

}  // namespace tpfp8
