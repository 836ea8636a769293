// Tensor-parallel collectives (comm.h).
#include "comm.h"

namespace tpfp8 {
namespace {

// Blocks the host only when the caller wants the result now; otherwise the handle travels.
void finish(WorkPtr w, WorkPtr* work) {
  if (work) {
    *work = std::move(w);
  } else {
    w->wait();
  }
}

}  // namespace

// _allgather_base / _reduce_scatter_base exist from torch 2.4 on (renamed later, kept as
// deprecated aliases): used for the range of versions we support.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

at::Tensor all_gather_rows(const at::Tensor& local, c10d::ProcessGroup& group, WorkPtr* work) {
  std::vector<int64_t> sizes = local.sizes().vec();
  sizes[0] *= group.getSize();
  at::Tensor out = at::empty(sizes, local.options());
  at::Tensor in = local.contiguous();
  finish(group._allgather_base(out, in), work);
  return out;
}

at::Tensor reduce_scatter_rows(const at::Tensor& full, c10d::ProcessGroup& group, WorkPtr* work) {
  const int64_t world = group.getSize();
  TORCH_CHECK(full.size(0) % world == 0, "reduce-scatter of ", full.size(0), " rows over ", world,
              " ranks: the rows must divide evenly");
  std::vector<int64_t> sizes = full.sizes().vec();
  sizes[0] /= world;
  at::Tensor out = at::empty(sizes, full.options());
  at::Tensor in = full.contiguous();
  finish(group._reduce_scatter_base(out, in), work);
  return out;
}

#pragma GCC diagnostic pop

void all_reduce(at::Tensor& t, c10d::ProcessGroup& group, c10d::ReduceOp::RedOpType op,
                WorkPtr* work) {
  std::vector<at::Tensor> tensors{t};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp(op);
  finish(group.allreduce(tensors, opts), work);
}

void wait(WorkPtr& work) {
  if (work) work->wait();
  work.reset();
}

}  // namespace tpfp8
