// The Linear's input prologues (prologue.h) over the norm and activation ops.
#include "prologue.h"

#include "activation_ops.h"
#include "checks.h"
#include "kernels/norm_cast.h"

namespace tpfp8 {
namespace {

bool rms(const PrologueArgs& p) { return p.kind == Prologue::kRMSNorm; }
int64_t activation_code(const PrologueArgs& p) { return p.kind == Prologue::kSwiGLU ? 1 : 0; }

void make_stats(const at::Tensor& x, const PrologueArgs& p, PrologueStats& stats) {
  if (!p.norm()) return;
  const auto f32 = x.options().dtype(at::kFloat);
  stats.rstd = at::empty({x.size(0)}, f32);
  if (!rms(p)) stats.mean = at::empty({x.size(0)}, f32);
}

OptTensor defined(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

// act(x) (dy null) or its backward dx = dy * act'(x), cast to FP8 in the same pass; `out`
// receives the result in x's dtype, `dbias` (backward) its column sums.
FusedCast fused_activation(const at::Tensor* dy, const at::Tensor& x, const PrologueArgs& p,
                           const OptTensor& out, const OptTensor& dbias) {
  FusedCast f;
  f.rows = x.size(0);
  f.cols = dy || p.kind != Prologue::kSwiGLU ? x.size(1) : x.size(1) / 2;
  f.options = x.options();
  const int64_t code = activation_code(p);
  f.amax = [dy, &x, code](const at::Tensor& amax) {
    at::Tensor a = amax;
    dy ? activation_backward_amax(*dy, x, a, code) : activation_amax(x, a, code);
  };
  f.cast = [dy, &x, code, out, dbias](const Fp8Tensor& q, const CastScale& s) {
    const auto format = static_cast<int64_t>(q.format);
    const OptTensor row = defined(q.rowwise), col = defined(q.columnwise);
    if (s.scale_amax && dy) {
      activation_backward_cast_current(*dy, x, *s.scale_amax, s.epsilon, row, col, out, q.scale_inv,
                                       code, format, dbias);
    } else if (s.scale_amax) {
      activation_cast_current(x, *s.scale_amax, s.epsilon, row, col, out, q.scale_inv, code,
                              format);
    } else if (dy) {
      activation_backward_cast(*dy, x, *s.scale, row, col, out, s.amax, q.scale_inv, code, format,
                               dbias);
    } else {
      activation_cast(x, *s.scale, row, col, out, s.amax, q.scale_inv, code, format);
    }
  };
  return f;
}

}  // namespace

PrologueArgs prologue_args(int64_t kind, const OptTensor& weight, const OptTensor& bias,
                           double eps) {
  const auto code = code_as<Prologue>(
      kind, "prologue", "0 (none), 1 (LayerNorm), 2 (RMSNorm), 3 (GELU) or 4 (SwiGLU)");
  return {code, weight, bias, eps};
}

void check_prologue(const PrologueArgs& p, const at::Tensor& x, int64_t k, bool row_parallel) {
  if (!p.any()) {
    TORCH_CHECK_VALUE(!p.weight && !p.bias, "a norm weight or bias needs a norm prologue");
    return;
  }
  if (!p.norm()) {
    TORCH_CHECK_VALUE(!p.weight && !p.bias, "an activation prologue takes no weight or bias");
    return;
  }
  TORCH_CHECK_VALUE(!row_parallel,
                    "a norm in front of a row-parallel Linear would normalize a slice of the "
                    "features; fuse the norm into a column-parallel (or unsplit) layer");
  TORCH_CHECK_VALUE(p.weight.has_value(), "the norm needs its weight (gamma)");
  TORCH_CHECK_VALUE(!(rms(p) && p.bias), "RMSNorm has no bias (beta); pass None");
  for (const OptTensor& t : {p.weight, p.bias}) {
    if (!t) continue;
    TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == k, "the norm's weight and bias must be [", k,
                      "] (the Linear's in_features), got shape ", t->sizes());
    TORCH_CHECK_VALUE(t->device() == x.device(), "the norm's weight is on ", t->device(),
                      " but the input on ", x.device(), "; move the module or the input");
  }
  TORCH_CHECK_VALUE(p.eps >= 0.0, "the norm's eps must be >= 0, got ", p.eps);
  TORCH_CHECK_VALUE(k % kNormHiddenAlign == 0 && k <= kNormMaxHidden,
                    "the fused norm needs in_features a multiple of ", kNormHiddenAlign,
                    " and at most ", kNormMaxHidden, " (its kernel keeps a row in registers), got ",
                    k, "; use torch's norm before a tpfp8.Linear instead");
}

at::Tensor prologue_high_precision(const at::Tensor& x, const PrologueArgs& p,
                                   PrologueStats& stats) {
  if (!p.norm()) {
    at::Tensor y =
        at::empty({x.size(0), x.size(1) / (p.kind == Prologue::kSwiGLU ? 2 : 1)}, x.options());
    activation_high_precision(nullptr, x, y, activation_code(p));
    return y;
  }
  make_stats(x, p, stats);
  at::Tensor y = at::empty_like(x);
  norm_cast_from(x, *p.weight, p.bias, rms(p), p.eps, std::nullopt, std::nullopt, 0.0, y, {}, {},
                 {}, {}, defined(stats.mean), stats.rstd, 0);
  return y;
}

FusedCast fused_prologue(const at::Tensor& x, const PrologueArgs& p, PrologueStats& stats,
                         const at::Tensor& hp_out) {
  const OptTensor out = defined(hp_out);
  if (!p.norm()) return fused_activation(nullptr, x, p, out, std::nullopt);
  FusedCast f;
  f.rows = x.size(0);
  f.cols = x.size(1);
  f.options = x.options();
  make_stats(x, p, stats);
  f.amax = [&x, &p](const at::Tensor& amax) {
    norm_amax(x, *p.weight, p.bias, rms(p), p.eps, amax);
  };
  f.cast = [&x, &p, &stats, out](const Fp8Tensor& q, const CastScale& s) {
    norm_cast_from(x, *p.weight, p.bias, rms(p), p.eps, s.scale, s.scale_amax, s.epsilon, out,
                   defined(q.rowwise), defined(q.columnwise), s.amax, q.scale_inv,
                   defined(stats.mean), stats.rstd, static_cast<int64_t>(q.format));
  };
  return f;
}

FusedCast fused_activation_backward(const at::Tensor& dy, const at::Tensor& x,
                                    const PrologueArgs& p, const OptTensor& dbias) {
  TORCH_CHECK(!p.norm() && p.any(), "internal error: a fused backward cast needs an activation");
  return fused_activation(&dy, x, p, std::nullopt, dbias);
}

PrologueGrads prologue_backward(const at::Tensor& dy, const at::Tensor& x, const PrologueArgs& p,
                                const PrologueStats& stats, const OptTensor& dx_add) {
  PrologueGrads g;
  if (p.norm()) {
    std::tie(g.dx, g.dweight, g.dbias) =
        norm_backward(dy, x, defined(stats.mean), stats.rstd, *p.weight, rms(p), dx_add);
    return g;
  }
  TORCH_CHECK(!dx_add, "internal error: only a norm's backward adds a skip connection's gradient");
  g.dx = at::empty_like(x);
  activation_high_precision(&dy, x, g.dx, activation_code(p));
  return g;
}

}  // namespace tpfp8
