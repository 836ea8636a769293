// The debug quantizer (debug_quantizer.h) and the registry of the function its reports go to.
#include "debug_quantizer.h"

#include "checks.h"
#include "ops.h"

namespace tpfp8 {
namespace {

using DebugLogger =
    std::function<void(int64_t, const std::string&, const std::string&, const at::Tensor&,
                       const at::Tensor&, const at::Tensor&, int64_t)>;
// Set by tpfp8.debug; kept until process exit.
DebugLogger& debug_logger() {
  static DebugLogger* logger = new DebugLogger();
  return *logger;
}

const char* tensor_name(Role role) {
  static const char* const names[] = {"activation", "weight", "gradient"};
  return names[role];
}

// Quantize -> dequantize with current scaling: the values an FP8 GEMM would see.
at::Tensor fake_quantize(const at::Tensor& hp, int64_t format) {
  const CurrentScalingQuantizer q(fp8_format_from(format), 0.0);
  const Fp8Tensor codes = q.quantize(hp.contiguous(), true, false);
  at::Tensor out = at::empty(hp.sizes(), hp.options().dtype(at::kFloat));
  dequantize(codes.rowwise, codes.scale_inv, format, out);
  return out;
}

}  // namespace

void set_debug_logger(DebugLogger logger) { debug_logger() = std::move(logger); }

DebugOptions debug_options(at::IntArrayRef packed) {
  DebugOptions d;
  if (packed.empty()) return d;
  TORCH_CHECK_VALUE(packed.size() == 7, "debug options are [] or 7 values, got ", packed.size());
  d.active = true;
  for (int g = 0; g < 3; ++g) d.high_precision[g] = packed[g] != 0;
  for (int r = 0; r < 3; ++r) d.fake[r] = packed[3 + r];
  const int64_t handle = packed[6];
  if (handle >= 0) {
    d.log = [handle](const char* gemm, const char* tensor, const at::Tensor& used,
                     const at::Tensor& original, const at::Tensor& scale_inv, int64_t format) {
      const DebugLogger& logger = debug_logger();
      if (logger) logger(handle, gemm, tensor, used, original, scale_inv, format);
    };
  }
  return d;
}

DebugQuantizer::DebugQuantizer(std::unique_ptr<Quantizer> parent, Role role, DebugOptions options)
    : Quantizer(parent ? parent->format() : Fp8Format::kE4M3),
      parent_(std::move(parent)),
      role_(role),
      options_(std::move(options)) {}

Fp8Tensor DebugQuantizer::quantize(const at::Tensor& x, bool rowwise, bool columnwise,
                                   const Fp8Tensor* into, const ProcessGroupPtr& split_over,
                                   const OptTensor& dbias) const {
  TORCH_CHECK(parent_, "a high-precision tensor is not quantized");
  return parent_->quantize(x, rowwise, columnwise, into, split_over, dbias);
}

bool DebugQuantizer::needs_high_precision(Gemm gemm) const {
  return !parent_ || options_.high_precision[static_cast<int>(gemm)] || options_.fake[role_] >= 0;
}

Operand DebugQuantizer::operand(Gemm gemm, const Prepared& t, bool columnwise, bool high_precision,
                                at::ScalarType dtype) const {
  const char* tensor = tensor_name(role_);
  const int64_t fake = options_.fake[role_];
  if (high_precision) {
    const at::Tensor used = (fake >= 0 ? fake_quantize(t.hp, fake) : t.hp).to(dtype).contiguous();
    if (options_.log) options_.log(gemm_name(gemm), tensor, used.to(at::kFloat), t.hp, {}, fake);
    return high_precision_operand(used, dtype, columnwise);
  }
  if (options_.log) {
    const at::Tensor& codes = columnwise ? t.q.columnwise : t.q.rowwise;
    at::Tensor used = at::empty(codes.sizes(), codes.options().dtype(at::kFloat));
    const auto format = static_cast<int64_t>(t.q.format);
    dequantize(codes, t.q.scale_inv, format, used);
    options_.log(gemm_name(gemm), tensor, columnwise ? used.t() : used, t.hp, t.q.scale_inv,
                 format);
  }
  return Quantizer::operand(gemm, t, columnwise, false, dtype);
}

}  // namespace tpfp8
