// Torch ops over the cast kernels (kernels/cast.h, kernels/delayed_scaling.h): validate,
// fill the params struct, run on the tensor's device. Outputs are caller-provided buffers so
// quantizers can write into their own storage; tpfp8/ops.py allocates them for casual use.
#include <torch/library.h>

#include "checks.h"
#include "dbias_output.h"
#include "device_dispatch.h"
#include "kernels/cast.h"
#include "kernels/delayed_scaling.h"
#include "ops.h"

namespace tpfp8 {
namespace {

float* optional_f32(const OptTensor& t, const char* name, const at::Tensor& ref) {
  if (!t.has_value()) return nullptr;
  check_scalar_f32(*t, name, ref, "input");
  return t->data_ptr<float>();
}

uint8_t* optional_fp8_out(const OptTensor& t, const char* name, at::IntArrayRef sizes,
                          const at::Tensor& ref) {
  if (!t.has_value()) return nullptr;
  check_output(*t, name, sizes, at::kByte, ref);
  return t->data_ptr<uint8_t>();
}

CastParams cast_params(const at::Tensor& input, int64_t fp8_format) {
  check_2d(input, "input");
  check_contiguous(input, "input");
  CastParams p;
  p.dtype = high_precision_dtype(input, "input");
  p.format = fp8_format_from(fp8_format);
  p.input = input.data_ptr();
  p.rows = input.size(0);
  p.cols = input.size(1);
  return p;
}

CastParams cast_params(const at::Tensor& input, const at::Tensor& scale, int64_t fp8_format) {
  CastParams p = cast_params(input, fp8_format);
  check_scalar_f32(scale, "scale", input, "input");
  p.scale = scale.data_ptr<float>();
  return p;
}

// Runs the cast p describes, also writing the column sums of the input into `dbias` ([cols],
// float32 or converted to its bfloat16 / float16) when given.
void run_with_dbias(CastParams& p, const at::Tensor& input, const OptTensor& dbias) {
  const DbiasOutput sums(dbias, p.rows, p.cols, input);
  p.dbias = sums.sum();
  p.dbias_partial = sums.partial();
  run_on_device(
      input, [&] { cast_cpu(p); }, [&](cudaStream_t s) { return cast_transpose_cuda(p, s); });
  sums.finish();
}

// (p's scale or scale_amax, and amax, are set by the caller.)
void run_cast_transpose(CastParams& p, const at::Tensor& input, const OptTensor& rowwise,
                        const OptTensor& columnwise, const OptTensor& scale_inv,
                        const OptTensor& dbias) {
  TORCH_CHECK_VALUE(rowwise.has_value() || columnwise.has_value(),
                    "cast_transpose needs at least one of rowwise / columnwise outputs");
  check_no_overlap({{"input", input},
                    {"rowwise", rowwise},
                    {"columnwise", columnwise},
                    {"scale_inv", scale_inv},
                    {"dbias", dbias}});
  p.rowwise = optional_fp8_out(rowwise, "rowwise", {p.rows, p.cols}, input);
  p.columnwise = optional_fp8_out(columnwise, "columnwise", {p.cols, p.rows}, input);
  p.scale_inv = optional_f32(scale_inv, "scale_inv", input);
  run_with_dbias(p, input, dbias);
}

}  // namespace

void quantize(const at::Tensor& input, const at::Tensor& scale, at::Tensor& out,
              const OptTensor& amax, const OptTensor& scale_inv, int64_t fp8_format) {
  CastParams p = cast_params(input, scale, fp8_format);
  check_output(out, "out", input.sizes(), at::kByte, input);
  check_no_overlap({{"input", input}, {"out", out}, {"amax", amax}, {"scale_inv", scale_inv}});
  p.rowwise = out.data_ptr<uint8_t>();
  p.amax = optional_f32(amax, "amax", input);
  p.scale_inv = optional_f32(scale_inv, "scale_inv", input);
  run_on_device(input, [&] { cast_cpu(p); }, [&](cudaStream_t s) { return quantize_cuda(p, s); });
}

void cast_transpose(const at::Tensor& input, const at::Tensor& scale, const OptTensor& rowwise,
                    const OptTensor& columnwise, const OptTensor& amax, const OptTensor& scale_inv,
                    int64_t fp8_format, const OptTensor& dbias) {
  CastParams p = cast_params(input, scale, fp8_format);
  p.amax = optional_f32(amax, "amax", input);
  check_no_overlap({{"amax", amax}, {"scale_inv", scale_inv}});
  run_cast_transpose(p, input, rowwise, columnwise, scale_inv, dbias);
}

void cast_transpose_slots(const at::Tensor& input, const at::Tensor& scale, int64_t scale_index,
                          const OptTensor& rowwise, const OptTensor& columnwise,
                          const OptTensor& amax, int64_t amax_index, const OptTensor& scale_inv,
                          int64_t fp8_format, const OptTensor& dbias) {
  CastParams p = cast_params(input, fp8_format);
  p.scale = f32_slot(scale, scale_index, "scale", input);
  p.amax = amax ? f32_slot(*amax, amax_index, "amax", input) : nullptr;
  run_cast_transpose(p, input, rowwise, columnwise, scale_inv, dbias);
}

void cast_transpose_current(const at::Tensor& input, const at::Tensor& amax, double epsilon,
                            const OptTensor& rowwise, const OptTensor& columnwise,
                            const OptTensor& scale_inv, int64_t fp8_format,
                            const OptTensor& dbias) {
  CastParams p = cast_params(input, fp8_format);
  check_scalar_f32(amax, "amax", input, "input");
  TORCH_CHECK_VALUE(epsilon >= 0.0, "epsilon must be >= 0, got ", epsilon);
  p.scale_amax = amax.data_ptr<float>();
  p.epsilon = static_cast<float>(epsilon);
  run_cast_transpose(p, input, rowwise, columnwise, scale_inv, dbias);
}

void column_sum(const at::Tensor& input, at::Tensor& out) {
  CastParams p = cast_params(input, 0);  // no FP8 output: only the sums' pass
  run_with_dbias(p, input, out);
}

void transpose_fp8(const at::Tensor& input, at::Tensor& out) {
  check_2d(input, "input");
  check_fp8_storage(input, "input");
  const int64_t rows = input.size(0), cols = input.size(1);
  check_output(out, "out", {cols, rows}, at::kByte, input);
  check_no_overlap({{"input", input}, {"out", out}});
  const uint8_t* in = input.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  run_on_device(
      input, [&] { transpose_fp8_cpu(in, rows, cols, o); },
      [&](cudaStream_t s) { return transpose_fp8_cuda(in, rows, cols, o, s); });
}

void dequantize(const at::Tensor& input, const at::Tensor& scale_inv, int64_t fp8_format,
                at::Tensor& out) {
  check_fp8_storage(input, "input");
  check_scalar_f32(scale_inv, "scale_inv", input, "input");
  DequantizeParams p;
  p.out_dtype = high_precision_dtype(out, "out");
  check_output(out, "out", input.sizes(), out.scalar_type(), input);
  check_no_overlap({{"input", input}, {"out", out}});
  p.input = input.data_ptr<uint8_t>();
  p.numel = input.numel();
  p.format = fp8_format_from(fp8_format);
  p.scale_inv = scale_inv.data_ptr<float>();
  p.output = out.data_ptr();
  run_on_device(
      input, [&] { dequantize_cpu(p); }, [&](cudaStream_t s) { return dequantize_cuda(p, s); });
}

void amax(const at::Tensor& input, at::Tensor& amax) {
  check_contiguous(input, "input");
  const DType dtype = high_precision_dtype(input, "input");
  check_scalar_f32(amax, "amax", input, "input");
  const void* in = input.data_ptr();
  float* a = amax.data_ptr<float>();
  const int64_t n = input.numel();
  run_on_device(
      input, [&] { amax_cpu(in, dtype, n, a); },
      [&](cudaStream_t s) { return amax_cuda(in, dtype, n, a, s); });
}

void delayed_scaling_update(at::Tensor& amax_history, at::Tensor& scale, at::Tensor& scale_inv,
                            const at::Tensor& fp8_max, int64_t margin, bool use_history_max) {
  TORCH_CHECK_VALUE(amax_history.dim() == 2 && amax_history.scalar_type() == at::kFloat,
                    "amax_history must be float32 [history_len, num_tensors], got ",
                    amax_history.scalar_type(), " of shape ", shape_str(amax_history));
  check_contiguous(amax_history, "amax_history");
  const int64_t n = amax_history.size(1);
  for (auto [t, name] : {std::pair{&scale, "scale"}, {&scale_inv, "scale_inv"}}) {
    check_output(*t, name, {n}, at::kFloat, amax_history);
  }
  TORCH_CHECK_VALUE(
      fp8_max.dim() == 1 && fp8_max.size(0) == n && fp8_max.scalar_type() == at::kFloat,
      "fp8_max must be float32 [", n, "] (one format max per tensor), got ", fp8_max.scalar_type(),
      " of shape ", shape_str(fp8_max));
  check_contiguous(fp8_max, "fp8_max");
  check_same_device(fp8_max, amax_history, "fp8_max", "amax_history");
  TORCH_CHECK_VALUE(margin >= -100 && margin <= 100, "margin must be in [-100, 100], got ", margin);
  DelayedScalingParams p;
  p.amax_history = amax_history.data_ptr<float>();
  p.history_len = amax_history.size(0);
  p.num_tensors = n;
  p.scale = scale.data_ptr<float>();
  p.scale_inv = scale_inv.data_ptr<float>();
  p.fp8_max = fp8_max.data_ptr<float>();
  p.margin = static_cast<int>(margin);
  p.use_history_max = use_history_max;
  run_on_device(
      amax_history, [&] { delayed_scaling_update_cpu(p); },
      [&](cudaStream_t s) { return delayed_scaling_update_cuda(p, s); });
}

std::vector<DelayedScalingBatch> delayed_scaling_batches(
    const std::vector<at::Tensor>& histories, const std::vector<at::Tensor>& scales,
    const std::vector<at::Tensor>& scale_invs, const std::vector<double>& fp8_max, int64_t margin,
    bool use_history_max, at::IntArrayRef scale_offsets, const std::vector<at::Tensor>& previous) {
  TORCH_CHECK_VALUE(histories.size() == scales.size() && histories.size() == scale_invs.size(),
                    "delayed_scaling_update_many needs one scale and scale_inv per history, got ",
                    histories.size(), " histories, ", scales.size(), " scales, ", scale_invs.size(),
                    " scale_invs");
  TORCH_CHECK_VALUE(margin >= -100 && margin <= 100, "margin must be in [-100, 100], got ", margin);
  // Before the loop below reads scale_offsets[j].
  TORCH_CHECK_VALUE(scale_offsets.empty() || scale_offsets.size() == histories.size(),
                    "scale_offsets needs one offset per history (", histories.size(), "), got ",
                    scale_offsets.size(), "; pass [] for whole scale tensors");
  TORCH_CHECK_VALUE(previous.empty() || previous.size() == histories.size(),
                    "previous needs one buffer per history (", histories.size(), "), got ",
                    previous.size());
  if (histories.empty()) return {};
  const at::Tensor& ref = histories[0];
  int64_t total = 0;
  for (size_t j = 0; j < histories.size(); ++j) {
    const at::Tensor& h = histories[j];
    TORCH_CHECK_VALUE(h.dim() == 2 && h.scalar_type() == at::kFloat && h.size(1) == ref.size(1),
                      "histories[", j, "] must be float32 [num_tensors, ", ref.size(1),
                      "] (tensor-major, newest first), got ", h.scalar_type(), " of shape ",
                      shape_str(h));
    check_contiguous(h, "history");
    check_same_device(h, ref, "history", "histories[0]");
    const int64_t offset = scale_offsets.empty() ? 0 : scale_offsets[j];
    if (scale_offsets.empty()) {
      check_output(scales[j], "scale", {h.size(0)}, at::kFloat, ref);
      check_output(scale_invs[j], "scale_inv", {h.size(0)}, at::kFloat, ref);
      if (!previous.empty()) check_output(previous[j], "previous", {h.size(0)}, at::kFloat, ref);
    } else if (h.size(0) > 0) {  // the slots offset .. offset + n - 1
      for (const int64_t i : {offset, offset + h.size(0) - 1}) {
        f32_slot(scales[j], i, "scale", ref);
        f32_slot(scale_invs[j], i, "scale_inv", ref);
        if (!previous.empty()) f32_slot(previous[j], i, "previous", ref);
      }
    }
    total += h.size(0);
  }
  TORCH_CHECK_VALUE(static_cast<int64_t>(fp8_max.size()) == total,
                    "fp8_max needs one value per tensor (", total, "), got ", fp8_max.size());
  std::vector<DelayedScalingBatch> batches;
  int64_t flat = 0;
  for (size_t j = 0; j < histories.size(); ++j) {
    for (int64_t i = 0; i < histories[j].size(0); ++i, ++flat) {
      if (batches.empty() || batches.back().num_tensors == DelayedScalingBatch::kMaxTensors) {
        DelayedScalingBatch& b = batches.emplace_back();
        b.history_len = ref.size(1);
        b.margin = static_cast<int>(margin);
        b.use_history_max = use_history_max;
      }
      DelayedScalingBatch& b = batches.back();
      const int t = b.num_tensors++;
      b.history[t] = histories[j].data_ptr<float>() + i * b.history_len;
      const int64_t slot = (scale_offsets.empty() ? 0 : scale_offsets[j]) + i;
      b.scale[t] = scales[j].data_ptr<float>() + slot;
      b.scale_inv[t] = scale_invs[j].data_ptr<float>() + slot;
      b.previous[t] = previous.empty() ? nullptr : previous[j].data_ptr<float>() + slot;
      b.fp8_max[t] = static_cast<float>(fp8_max[flat]);
    }
  }
  return batches;
}

void run_delayed_scaling_batches(const at::Tensor& device,
                                 const std::vector<DelayedScalingBatch>& batches) {
  for (const DelayedScalingBatch& b : batches) {
    run_on_device(
        device, [&] { delayed_scaling_update_batch_cpu(b); },
        [&](cudaStream_t s) { return delayed_scaling_update_batch_cuda(b, s); });
  }
}

void delayed_scaling_update_many(const std::vector<at::Tensor>& histories,
                                 const std::vector<at::Tensor>& scales,
                                 const std::vector<at::Tensor>& scale_invs,
                                 const std::vector<double>& fp8_max, int64_t margin,
                                 bool use_history_max, at::IntArrayRef scale_offsets,
                                 const std::vector<at::Tensor>& previous) {
  const auto batches = delayed_scaling_batches(histories, scales, scale_invs, fp8_max, margin,
                                               use_history_max, scale_offsets, previous);
  if (!batches.empty()) run_delayed_scaling_batches(histories[0], batches);
}

TORCH_LIBRARY_FRAGMENT(tpfp8, m) {
  m.def(
      "quantize(Tensor input, Tensor scale, Tensor(a!) out, Tensor(b!)? amax, "
      "Tensor(c!)? scale_inv, int fp8_format) -> ()");
  m.def(
      "cast_transpose(Tensor input, Tensor scale, Tensor(a!)? rowwise, Tensor(b!)? columnwise, "
      "Tensor(c!)? amax, Tensor(d!)? scale_inv, int fp8_format, Tensor(e!)? dbias=None) -> ()");
  m.def(
      "cast_transpose_current(Tensor input, Tensor amax, float epsilon, Tensor(a!)? rowwise, "
      "Tensor(b!)? columnwise, Tensor(c!)? scale_inv, int fp8_format, Tensor(d!)? dbias=None) "
      "-> ()");
  m.def("transpose_fp8(Tensor input, Tensor(a!) out) -> ()");
  m.def("dequantize(Tensor input, Tensor scale_inv, int fp8_format, Tensor(a!) out) -> ()");
  m.def("amax(Tensor input, Tensor(a!) amax) -> ()");
  m.def(
      "delayed_scaling_update(Tensor(a!) amax_history, Tensor(b!) scale, Tensor(c!) scale_inv, "
      "Tensor fp8_max, int margin, bool use_history_max) -> ()");
  m.def(
      "delayed_scaling_update_many(Tensor(a!)[] histories, Tensor(b!)[] scales, "
      "Tensor(c!)[] scale_invs, float[] fp8_max, int margin, bool use_history_max, "
      "int[] scale_offsets=[]) -> ()");
}

namespace {
// The op's form: no `previous` (only a layer's DelayedUpdate keeps the scales before an update).
void delayed_scaling_update_many_op(const std::vector<at::Tensor>& histories,
                                    const std::vector<at::Tensor>& scales,
                                    const std::vector<at::Tensor>& scale_invs,
                                    const std::vector<double>& fp8_max, int64_t margin,
                                    bool use_history_max, at::IntArrayRef scale_offsets) {
  delayed_scaling_update_many(histories, scales, scale_invs, fp8_max, margin, use_history_max,
                              scale_offsets);
}
}  // namespace

#define TPFP8_REGISTER_CAST_OPS(m)                           \
  m.impl("quantize", &quantize);                             \
  m.impl("cast_transpose", &cast_transpose);                 \
  m.impl("cast_transpose_current", &cast_transpose_current); \
  m.impl("transpose_fp8", &transpose_fp8);                   \
  m.impl("dequantize", &dequantize);                         \
  m.impl("amax", &amax);                                     \
  m.impl("delayed_scaling_update", &delayed_scaling_update); \
  m.impl("delayed_scaling_update_many", &delayed_scaling_update_many_op)

TORCH_LIBRARY_IMPL(tpfp8, CPU, m) { TPFP8_REGISTER_CAST_OPS(m); }
#if defined(TPFP8_WITH_CUDA)
TORCH_LIBRARY_IMPL(tpfp8, CUDA, m) { TPFP8_REGISTER_CAST_OPS(m); }
#endif

}  // namespace tpfp8
