// Quantizers (quantizer.h) over the cast ops.
#include "quantizer.h"

#include <ATen/record_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include <iterator>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>
#include <unordered_set>

#include "device_dispatch.h"
#include "ops.h"

namespace tpfp8 {

Fp8Tensor quantize(const at::Tensor& x, const QuantizerSpec& q, bool rowwise, bool columnwise,
                   const Fp8Tensor* into) {
  TORCH_CHECK(q.scaling != Scaling::kNone, "quantize called with a high-precision quantizer");
  Fp8Tensor out;
  const auto u8 = x.options().dtype(at::kByte);
  if (into) {
    out = *into;
    if (!rowwise) out.rowwise = at::Tensor();
    if (!columnwise) out.columnwise = at::Tensor();
  } else {
    if (rowwise) out.rowwise = at::empty({x.size(0), x.size(1)}, u8);
    if (columnwise) out.columnwise = at::empty({x.size(1), x.size(0)}, u8);
    out.scale_inv = at::empty({1}, x.options().dtype(at::kFloat));
  }
  out.format = q.format;
  OptTensor row = rowwise ? OptTensor(out.rowwise) : std::nullopt;
  OptTensor col = columnwise ? OptTensor(out.columnwise) : std::nullopt;
  const auto fmt = static_cast<int64_t>(q.format);
  if (q.scaling == Scaling::kDelayed) {
    cast_transpose(x, q.scale, row, col, q.amax, out.scale_inv, fmt);
    return out;
  }
  at::Tensor a = at::empty({1}, x.options().dtype(at::kFloat));
  zero_bytes(a);
  amax(x, a);
  if (q.reduce_amax) q.reduce_amax(a);
  cast_transpose_current(x, a, q.epsilon, row, col, out.scale_inv, fmt);
  return out;
}

namespace {

// The updates each running backward pass (autograd graph task) queued: each pass updates its
// own modules when it ends, whatever other threads' passes do meanwhile. The pass's final
// callback owns its list; the map only points at it, so a pass that fails (the engine then
// drops its callbacks) leaves nothing behind.
struct TaskUpdates {
  std::vector<std::shared_ptr<DelayedUpdate>> queue;
  std::unordered_set<const DelayedUpdate*> queued;  // each state once per pass
};
struct PendingUpdates {
  std::mutex mutex;
  std::map<int, std::weak_ptr<TaskUpdates>> by_task;
};
PendingUpdates& pending() {
  static PendingUpdates* p = new PendingUpdates();  // used until process exit
  return *p;
}

// The updates that can share one launch (and one all-reduce).
using UpdateKey = std::tuple<int, int, int64_t, int64_t, bool, c10d::ProcessGroup*>;
UpdateKey key_of(const DelayedUpdate& u) {
  const at::Device d = u.history.device();
  return {static_cast<int>(d.type()), d.index(),         u.history.size(1), u.margin,
          u.use_history_max,          u.amax_group.get()};
}

void run_updates(const std::vector<std::shared_ptr<DelayedUpdate>>& group) {
  const DelayedUpdate& first = *group.front();
  std::vector<at::Tensor> histories, scales, scale_invs;
  std::vector<double> fp8_max;
  for (const auto& u : group) {
    histories.push_back(u->history);
    scales.push_back(u->scale);
    scale_invs.push_back(u->scale_inv);
    fp8_max.insert(fp8_max.end(), u->fp8_max.begin(), u->fp8_max.end());
  }
  if (first.amax_group) {  // one collective for all the modules' amaxes
    const auto newest = c10::fmap(histories, [](const at::Tensor& h) { return h.select(1, 0); });
    at::Tensor amax = at::cat(newest);
    // NaN as Inf: MAX then orders every rank's values alike (a NaN's fate in MAX depends on the
    // backend and on the order of operands), and the bad step is dropped on every rank.
    const double inf = std::numeric_limits<double>::infinity();
    amax.nan_to_num_(inf, inf, inf);
    all_reduce(amax, *first.amax_group, c10d::ReduceOp::MAX);
    at::_foreach_copy_(newest, amax.split_with_sizes(c10::fmap(
                                   newest, [](const at::Tensor& t) { return t.size(0); })));
  }
  // Named as the op, so that profiles (and tests) count the launches.
  RECORD_FUNCTION("tpfp8::delayed_scaling_update_many", std::vector<c10::IValue>());
  delayed_scaling_update_many(histories, scales, scale_invs, fp8_max, first.margin,
                              first.use_history_max);
}

void run_pending_updates(const std::shared_ptr<TaskUpdates>& updates, int task) {
  std::vector<std::shared_ptr<DelayedUpdate>> queue;
  {
    const std::lock_guard<std::mutex> lock(pending().mutex);
    pending().by_task.erase(task);
    queue.swap(updates->queue);
  }
  update_delayed(queue);
}

}  // namespace

void update_delayed(const std::vector<std::shared_ptr<DelayedUpdate>>& updates) {
  std::map<UpdateKey, std::vector<std::shared_ptr<DelayedUpdate>>> groups;
  for (const auto& u : updates) groups[key_of(*u)].push_back(u);
  for (const auto& [key, group] : groups) {
    if (group.front()->amax_group) {
      run_updates(group);
      continue;
    }
    // Two threads' passes through one layer both update it: one at a time (the CPU
    // reference rolls the history on the host). Not under an amax group: holding a lock across
    // a collective could deadlock against another rank's order.
    static std::mutex mutex;
    const std::lock_guard<std::mutex> lock(mutex);
    run_updates(group);
  }
}

void update_after_backward(const std::shared_ptr<DelayedUpdate>& update) {
  const int task = torch::autograd::get_current_graph_task_id();
  if (task < 0) return;  // not inside a backward pass
  std::shared_ptr<TaskUpdates> updates;
  {
    const std::lock_guard<std::mutex> lock(pending().mutex);
    auto& by_task = pending().by_task;
    updates = by_task[task].lock();
    const bool first = !updates;
    if (first) {
      for (auto it = by_task.begin(); it != by_task.end();) {  // passes that failed
        it = it->second.expired() ? by_task.erase(it) : std::next(it);
      }
      updates = std::make_shared<TaskUpdates>();
      by_task[task] = updates;
    }
    if (!updates->queued.insert(update.get()).second) return;
    updates->queue.push_back(update);
    if (!first) return;
  }
  // Runs when this graph task's backward is done (the engine's final callbacks).
  torch::autograd::Engine::get_default_engine().queue_callback(
      [updates, task] { run_pending_updates(updates, task); });
}

}  // namespace tpfp8
