// Tensor-parallel collectives on the c10d::ProcessGroup that Python passes in (NCCL on GPUs,
// gloo on CPU: the same code). Every call can run asynchronously: it returns its output at
// once and, when `work` is given, leaves the handle there for the caller to wait on later
// (how backward overlaps a gather or a reduction with a GEMM).
#pragma once

#include <torch/types.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace tpfp8 {

using ProcessGroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// [m, ...] on each rank -> [world * m, ...], rank r's rows at r*m (any dtype, uint8 included).
at::Tensor all_gather_rows(const at::Tensor& local, c10d::ProcessGroup& group,
                           WorkPtr* work = nullptr);

// [world * m, ...] on each rank -> the sum over ranks of rows r*m .. (r+1)*m on rank r.
at::Tensor reduce_scatter_rows(const at::Tensor& full, c10d::ProcessGroup& group,
                               WorkPtr* work = nullptr);

// In place: the sum (or max) over ranks.
void all_reduce(at::Tensor& t, c10d::ProcessGroup& group, c10d::ReduceOp::RedOpType op,
                WorkPtr* work = nullptr);

// Waits for a handle left by an asynchronous call (no-op for an empty one).
void wait(WorkPtr& work);

}  // namespace tpfp8
