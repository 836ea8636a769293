// Precision debugging (tpfp8.debug) as a quantizer: a DebugQuantizer wraps the quantizer a
// tensor would have (or none: high precision) and, per GEMM, can run the GEMM in high precision,
// feed it the tensor fake-quantized, and report the operand exactly as the GEMM consumed it.
// With sequence parallelism it quantizes the gathered tensor, never a rank's part (design.md:
// statistics describe what the GEMMs see, and every usage is made from the whole tensor).
#pragma once

#include <torch/types.h>

#include <array>
#include <functional>
#include <memory>
#include <string>

#include "quantizer.h"

namespace tpfp8 {

// A layer's debug options for one call.
struct DebugOptions {
  bool active = false;
  std::array<bool, 3> high_precision{};  // per Gemm: disable_fp8_gemm
  // fake_quant per Role: quantize -> dequantize (current scaling) with this format, then a
  // high-precision GEMM; -1 leaves the tensor alone.
  std::array<int64_t, 3> fake{-1, -1, -1};
  // log(gemm, tensor, used, original, scale_inv, format): `used` are the fp32 values the GEMM
  // computed with ([rows, cols] of the tensor, whatever layout the GEMM read), `original` the
  // high-precision tensor they came from, scale_inv/format those of FP8 data (undefined / -1
  // for a high-precision operand).
  std::function<void(const char*, const char*, const at::Tensor&, const at::Tensor&,
                     const at::Tensor&, int64_t)>
      log;
};

// The debug options as ops take them: [] (off) or [hp_fprop, hp_dgrad, hp_wgrad,
// fake_activation, fake_weight, fake_gradient, logger] -- logger -1 for none, else the handle
// tpfp8.debug registered with set_debug_logger.
DebugOptions debug_options(at::IntArrayRef packed);
// The Python function debug reports go to: logger(handle, gemm, tensor, used, original,
// scale_inv, format).
void set_debug_logger(
    std::function<void(int64_t, const std::string&, const std::string&, const at::Tensor&,
                       const at::Tensor&, const at::Tensor&, int64_t)>
        logger);

class DebugQuantizer final : public Quantizer {
 public:
  // `parent`: the tensor's quantizer, null in high precision.
  DebugQuantizer(std::unique_ptr<Quantizer> parent, Role role, DebugOptions options);
  Fp8Tensor quantize(const at::Tensor& x, bool rowwise, bool columnwise,
                     const Fp8Tensor* into = nullptr, const ProcessGroupPtr& split_over = {},
                     const OptTensor& dbias = std::nullopt) const override;
  bool quantizes_after_gather() const override { return true; }
  bool needs_high_precision(Gemm gemm) const override;
  Operand operand(Gemm gemm, const Prepared& t, bool columnwise, bool high_precision,
                  at::ScalarType dtype) const override;

 private:
  std::unique_ptr<Quantizer> parent_;
  Role role_;
  DebugOptions options_;
};

}  // namespace tpfp8
