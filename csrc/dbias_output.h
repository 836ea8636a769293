// A cast kernel's column sums (the bias gradient of a cast gradient: kernels/cast.h's dbias) as
// an op's optional output, shared by the cast and activation ops: float32, or bfloat16 /
// float16 converted from the float32 sums after the kernel.
#pragma once

#include <torch/types.h>

#include "checks.h"
#include "kernels/cast.h"
#include "ops.h"

namespace tpfp8 {

class DbiasOutput {
 public:
  // `dbias` [cols] on input's device, or none; rows x cols is the summed tensor.
  DbiasOutput(const OptTensor& dbias, int64_t rows, int64_t cols, const at::Tensor& input)
      : out_(dbias) {
    if (!dbias) return;
    high_precision_dtype(*dbias, "dbias");
    check_output(*dbias, "dbias", {cols}, dbias->scalar_type(), input);
    sum_ = dbias->scalar_type() == at::kFloat
               ? *dbias
               : at::empty({cols}, dbias->options().dtype(at::kFloat));
    // The GPU's workspace; the CPU reference keeps its own.
    if (!input.is_cpu()) partial_ = at::empty({dbias_tiles(rows), cols}, sum_.options());
  }
  float* sum() const { return sum_.defined() ? sum_.data_ptr<float>() : nullptr; }
  float* partial() const { return partial_.defined() ? partial_.data_ptr<float>() : nullptr; }
  // After the kernel ran: the sums into a 16-bit output.
  void finish() const {
    if (out_ && !sum_.is_same(*out_)) out_->copy_(sum_);
  }

 private:
  OptTensor out_;
  at::Tensor sum_, partial_;
};

}  // namespace tpfp8
