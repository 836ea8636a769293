// Delayed-scaling update (kernels/delayed_scaling.h): the formula and the roll on the CPU
// reference, and the CUDA kernel's bytes against it.
#include <cfloat>
#include <memory>

#include "kernels/delayed_scaling.h"
#include "test_util.h"

namespace tpfp8 {
namespace {

using testing::same_bytes;

struct State {
  int64_t len, n;
  std::vector<float> history, scale, scale_inv, fp8_max;
  DelayedScalingParams params(float* h, float* s, float* si, const float* m, int margin,
                              bool use_max) const {
    DelayedScalingParams p;
    p.amax_history = h, p.history_len = len, p.num_tensors = n;
    p.scale = s, p.scale_inv = si, p.fp8_max = m, p.margin = margin;
    p.use_history_max = use_max;
    return p;
  }
};

// Random history with whole columns of zeros, and Inf / NaN both as this step's amax (row 0: the
// step is dropped) and in older rows (ignored by the max).
State random_state(int64_t len, int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(0.0f, 4.0f);
  State st{len,
           n,
           std::vector<float>(len * n),
           std::vector<float>(n),
           std::vector<float>(n),
           std::vector<float>(n)};
  for (auto& a : st.history) a = std::ldexp(u(rng), static_cast<int>(u(rng) * 10) - 20);
  for (int64_t i = 0; i < n; ++i) {
    st.scale[i] = 1.0f + i;
    st.fp8_max[i] = i % 2 ? 57344.0f : 448.0f;
    if (i % 5 == 1)
      for (int64_t r = 0; r < len; ++r) st.history[r * n + i] = 0.0f;
  }
  if (n > 2) st.history[2] = INFINITY;
  if (n > 3) st.history[(len - 1) * n + 3] = NAN;
  if (n > 4) st.history[4] = -NAN;
  if (n > 6 && len > 1) st.history[n + 6] = INFINITY;
  return st;
}

TEST(DelayedScaling, FollowsFormulaAndRolls) {
  State st = random_state(16, 7, 1);
  const State before = st;
  for (const int margin : {0, 2}) {
    st = before;
    auto p = st.params(st.history.data(), st.scale.data(), st.scale_inv.data(), st.fp8_max.data(),
                       margin, true);
    delayed_scaling_update_cpu(p);
    for (int64_t i = 0; i < st.n; ++i) {
      EXPECT_EQ(st.history[i], 0.0f);           // row 0 cleared for the next step
      if (!std::isfinite(before.history[i])) {  // a bad step: dropped, nothing else moves
        EXPECT_TRUE(same_bytes<float>({st.scale[i], st.scale_inv[i]},
                                      {before.scale[i], before.scale_inv[i]}))
            << "tensor " << i;
        for (int64_t r = 1; r < st.len; ++r) {
          EXPECT_TRUE(
              same_bytes<float>({st.history[r * st.n + i]}, {before.history[r * st.n + i]}));
        }
        continue;
      }
      float amax = 0.0f;
      for (int64_t r = 0; r < st.len; ++r) {
        const float a = before.history[r * st.n + i];
        if (std::isfinite(a)) amax = std::max(amax, a);  // older non-finite rows are ignored
      }
      const double want = amax == 0.0f
                              ? before.scale[i]
                              : std::min<double>(FLT_MAX, double(float(before.fp8_max[i] / amax)) *
                                                              std::ldexp(1.0, -margin));
      EXPECT_EQ(st.scale[i], static_cast<float>(want)) << "tensor " << i;
      EXPECT_EQ(st.scale_inv[i], 1.0f / st.scale[i]);
      for (int64_t r = 1; r < st.len; ++r) {
        EXPECT_TRUE(
            same_bytes<float>({st.history[r * st.n + i]}, {before.history[(r - 1) * st.n + i]}));
      }
    }
  }
}

// Steps with a NaN or Inf amax between good ones leave the state exactly as the good steps alone.
TEST(DelayedScaling, BadStepsLeaveNoTrace) {
  const std::vector<float> good = {3.0f, 0.5f, 7.0f, 2.0f, 1.0f};
  for (const bool use_max : {true, false}) {
    auto run = [&](bool with_bad) {
      State st = random_state(3, 1, 9);
      st.history.assign(3, 0.0f);
      for (const float a : good) {
        for (const float bad : {NAN, INFINITY, -NAN}) {
          if (!with_bad) break;
          st.history[0] = bad;
          delayed_scaling_update_cpu(st.params(st.history.data(), st.scale.data(),
                                               st.scale_inv.data(), st.fp8_max.data(), 0, use_max));
        }
        st.history[0] = a;
        delayed_scaling_update_cpu(st.params(st.history.data(), st.scale.data(),
                                             st.scale_inv.data(), st.fp8_max.data(), 0, use_max));
      }
      return st;
    };
    const State clean = run(false), dirty = run(true);
    EXPECT_TRUE(same_bytes(dirty.history, clean.history));
    EXPECT_TRUE(same_bytes(dirty.scale, clean.scale));
    EXPECT_TRUE(same_bytes(dirty.scale_inv, clean.scale_inv));
    EXPECT_EQ(clean.scale[0], 448.0f / (use_max ? 7.0f : 1.0f));
  }
}

// -0.0 is not an amax (abs never makes it; a loaded checkpoint might): its bits would win the
// unsigned max, so it is refused like NaN.
TEST(DelayedScaling, NegativeZeroIsNotAnAmax) {
  State st = random_state(3, 1, 4);
  st.history = {-0.0f, 2.0f, -0.0f};
  auto p = st.params(st.history.data(), st.scale.data(), st.scale_inv.data(), st.fp8_max.data(), 0,
                     true);
  delayed_scaling_update_cpu(p);
  EXPECT_EQ(st.scale[0], 1.0f);  // the step was dropped
  st.history = {1.0f, 2.0f, -0.0f};
  delayed_scaling_update_cpu(p);
  EXPECT_EQ(st.scale[0], 448.0f / 2.0f);  // the old -0.0 is ignored
}

TEST(DelayedScaling, MostRecentUsesRowZeroOnly) {
  State st = random_state(4, 2, 2);
  st.history = {1.0f, 2.0f, 100.0f, 100.0f, 100.0f, 100.0f, 100.0f, 100.0f};
  auto p = st.params(st.history.data(), st.scale.data(), st.scale_inv.data(), st.fp8_max.data(), 0,
                     false);
  delayed_scaling_update_cpu(p);
  EXPECT_EQ(st.scale[0], 448.0f);
  EXPECT_EQ(st.scale[1], 57344.0f / 2.0f);
}

TEST(DelayedScaling, TinyAmaxClampsToFltMax) {
  State st = random_state(1, 1, 3);
  st.history = {1e-44f};
  auto p = st.params(st.history.data(), st.scale.data(), st.scale_inv.data(), st.fp8_max.data(), 0,
                     true);
  delayed_scaling_update_cpu(p);
  EXPECT_EQ(st.scale[0], FLT_MAX);
}

TEST(DelayedScaling, CudaMatchesCpuBytes) {
  TPFP8_REQUIRE_GPU();
#if defined(TPFP8_WITH_CUDA)
  for (const int64_t len : {1, 16, 33, 1024}) {
    for (const int64_t n : {1, 3, 37}) {
      for (const bool use_max : {true, false}) {
        State cpu = random_state(len, n, len * 100 + n);
        testing::DeviceBuffer<float> h(cpu.history), s(cpu.scale), si(cpu.scale_inv),
            m(cpu.fp8_max);
        const State gpu_in = cpu;
        delayed_scaling_update_cpu(cpu.params(cpu.history.data(), cpu.scale.data(),
                                              cpu.scale_inv.data(), cpu.fp8_max.data(), 1,
                                              use_max));
        TPFP8_CUDA_OK(delayed_scaling_update_cuda(
            gpu_in.params(h.get(), s.get(), si.get(), m.get(), 1, use_max), nullptr));
        EXPECT_TRUE(same_bytes(h.to_host(), cpu.history)) << len << "x" << n;
        EXPECT_TRUE(same_bytes(s.to_host(), cpu.scale)) << len << "x" << n;
        EXPECT_TRUE(same_bytes(si.to_host(), cpu.scale_inv)) << len << "x" << n;
      }
    }
  }
#endif
}

// The batch form over per-tensor buffers: state `st` ([len, n]) split into n tensor-major rows.
DelayedScalingBatch batch_of(std::vector<std::vector<float>>& rows, std::vector<float>& scale,
                             std::vector<float>& scale_inv, const State& st, bool use_max) {
  DelayedScalingBatch b;
  b.num_tensors = static_cast<int>(st.n), b.history_len = st.len, b.margin = 1;
  b.use_history_max = use_max;
  for (int64_t i = 0; i < st.n; ++i) {
    b.history[i] = rows[i].data(), b.scale[i] = &scale[i], b.scale_inv[i] = &scale_inv[i];
    b.fp8_max[i] = st.fp8_max[i];
  }
  return b;
}

std::vector<std::vector<float>> tensor_major(const State& st) {
  std::vector<std::vector<float>> rows(st.n, std::vector<float>(st.len));
  for (int64_t i = 0; i < st.n; ++i) {
    for (int64_t r = 0; r < st.len; ++r) rows[i][r] = st.history[r * st.n + i];
  }
  return rows;
}

TEST(DelayedScalingBatch, CpuEqualsTheColumnUpdate) {
  for (const bool use_max : {true, false}) {
    State st = random_state(33, 37, 5);
    auto rows = tensor_major(st);
    std::vector<float> scale = st.scale, scale_inv(st.n), previous(st.n, -1.0f);
    const std::vector<float> before = st.scale;
    DelayedScalingBatch b = batch_of(rows, scale, scale_inv, st, use_max);
    for (int64_t i = 0; i < st.n; ++i) b.previous[i] = &previous[i];
    delayed_scaling_update_batch_cpu(b);
    delayed_scaling_update_cpu(st.params(st.history.data(), st.scale.data(), st.scale_inv.data(),
                                         st.fp8_max.data(), 1, use_max));
    const auto want = tensor_major(st);
    for (int64_t i = 0; i < st.n; ++i) EXPECT_TRUE(same_bytes(rows[i], want[i])) << i;
    EXPECT_TRUE(same_bytes(scale, st.scale));
    EXPECT_TRUE(same_bytes(scale_inv, st.scale_inv));
    EXPECT_TRUE(same_bytes(previous, before));  // each scale as it was before the update
  }
}

TEST(DelayedScalingBatch, CudaMatchesCpuBytes) {
  TPFP8_REQUIRE_GPU();
#if defined(TPFP8_WITH_CUDA)
  for (const int64_t len : {1, 33, 1024}) {
    const State st = random_state(len, DelayedScalingBatch::kMaxTensors, len);
    auto rows = tensor_major(st);
    std::vector<float> scale = st.scale, scale_inv(st.n), previous(st.n, -1.0f);
    std::vector<std::unique_ptr<testing::DeviceBuffer<float>>> d_rows;
    for (const auto& r : rows) d_rows.push_back(std::make_unique<testing::DeviceBuffer<float>>(r));
    testing::DeviceBuffer<float> d_scale(scale), d_scale_inv(scale_inv), d_previous(previous);
    const bool use_max = len != 33;  // most_recent once
    DelayedScalingBatch b = batch_of(rows, scale, scale_inv, st, use_max);
    for (int64_t i = 0; i < st.n; ++i) {
      b.history[i] = d_rows[i]->get(), b.scale[i] = d_scale.get() + i;
      b.scale_inv[i] = d_scale_inv.get() + i;
      // (kept for some tensors only, the bad steps 2 and 4 among them)
      b.previous[i] = i % 3 != 1 ? d_previous.get() + i : nullptr;
    }
    TPFP8_CUDA_OK(delayed_scaling_update_batch_cuda(b, nullptr));
    DelayedScalingBatch host = batch_of(rows, scale, scale_inv, st, use_max);
    for (int64_t i = 0; i < st.n; ++i) host.previous[i] = i % 3 != 1 ? &previous[i] : nullptr;
    delayed_scaling_update_batch_cpu(host);
    for (int64_t i = 0; i < st.n; ++i) EXPECT_TRUE(same_bytes(d_rows[i]->to_host(), rows[i])) << i;
    EXPECT_TRUE(same_bytes(d_scale.to_host(), scale));
    EXPECT_TRUE(same_bytes(d_scale_inv.to_host(), scale_inv));
    EXPECT_TRUE(same_bytes(d_previous.to_host(), previous));
  }
#endif
}

}  // namespace
}  // namespace tpfp8
