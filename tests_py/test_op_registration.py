"""The native ops as torch.compile sees them: every op passes torch.library.opcheck (schema,
fake kernel, autograd registration, AOT dispatch), and a function built from them compiles
whole (fullgraph, no graph break) to the same bytes as eager."""
import pytest
import torch
from torch.library import opcheck

from test_activation_ops import activation_op_samples

import tpfp8
from tpfp8 import ops

ops_ns = torch.ops.tpfp8


def samples(device):
    """(op, arguments) for every op, on `device`: valid inputs, caller-made outputs."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(32, 64, generator=g) * 3).bfloat16().to(device)

    def f32(*values):
        return torch.tensor(values, dtype=torch.float32, device=device)

    def u8(*shape):
        return torch.empty(*shape, dtype=torch.uint8, device=device)

    codes = torch.randint(0, 126, (32, 64), generator=g, dtype=torch.uint8).to(device)
    amax = f32(float(x.float().abs().max()))
    history = torch.rand(8, 3, generator=g).to(device)
    fp8_max = f32(448.0, 57344.0, 448.0)
    a = torch.randint(0, 126, (16, 64), generator=g, dtype=torch.uint8).to(device)
    b = torch.randint(0, 126, (32, 64), generator=g, dtype=torch.uint8).to(device)
    e4m3, bf16 = int(tpfp8._C.GemmType.E4M3), int(tpfp8._C.GemmType.BFLOAT16)
    return {
        "quantize": (x, f32(2.0), u8(32, 64), f32(0.0), f32(0.0), 0),
        "cast_transpose": (x, f32(2.0), u8(32, 64), u8(64, 32), f32(0.0), f32(0.0), 1),
        "cast_transpose_current": (x, amax, 0.0, u8(32, 64), u8(64, 32), f32(0.0), 0),
        "cast_transpose dbias": (x, f32(2.0), None, u8(64, 32), f32(0.0), f32(0.0), 1,
                                 torch.empty(64, device=device)),
        "cast_transpose_current dbias": (x, amax, 0.0, u8(32, 64), None, f32(0.0), 0,
                                         torch.empty(64, dtype=torch.bfloat16, device=device)),
        "transpose_fp8": (codes, u8(64, 32)),
        "dequantize": (codes, f32(0.5), 0, torch.empty(32, 64, device=device)),
        "amax": (x, f32(0.0)),
        "delayed_scaling_update": (history, f32(1, 1, 1), f32(1, 1, 1), fp8_max, 0, True),
        "delayed_scaling_update_many": (
            [history.t().contiguous()], [f32(1, 1, 1)], [f32(1, 1, 1)], [448.0, 57344.0, 448.0],
            1, False),
        "delayed_scaling_update_many slots": (
            [history.t()[:2].contiguous(), history.t()[2:].contiguous()], [f32(1, 1, 1)] * 2,
            [f32(1, 1, 1)] * 2, [448.0, 57344.0, 448.0], 0, True, [0, 2]),
        "gemm": (a, b, torch.empty(16, 32, dtype=torch.bfloat16, device=device), f32(0.5),
                 f32(0.25), e4m3, e4m3, torch.randn(32, device=device).bfloat16(), False, True,
                 False, False),
        "gemm high precision": (x[:16], x, torch.empty(16, 32, dtype=torch.bfloat16,
                                                      device=device), None, None, bf16, bf16,
                                None, False, False, False, False),
        **linear_samples(device, x, f32, u8, g),
        **norm_samples(device, x, f32, u8, g),
        **activation_op_samples(device),
    }


def norm_samples(device, x, f32, u8, g):
    """The fused norm -> FP8 casts (LayerNorm with every output, delayed scaling; RMSNorm with
    current scaling) and the norm's backward."""
    gamma = (1 + torch.randn(64, generator=g)).to(device)
    beta = torch.randn(64, generator=g).to(device)

    def rows():
        return torch.empty(32, device=device)

    dy = torch.randn(32, 64, generator=g).bfloat16().to(device)
    return {
        "norm_cast layernorm": (x, gamma, beta, False, 1e-5, f32(2.0), torch.empty_like(x),
                                u8(32, 64), u8(64, 32), f32(0.0), f32(0.0), rows(), rows(), 0),
        "norm_cast_current rmsnorm": (x, gamma.bfloat16(), None, True, 1e-6, f32(0.0), 0.0,
                                      None, u8(32, 64), u8(64, 32), f32(0.0), None, rows(), 1),
        "norm_backward layernorm": (dy, x, x.float().mean(1), x.float().var(1).add(1e-5).rsqrt(),
                                    gamma, False),
        "norm_backward rmsnorm": (dy, x, None, torch.ones(32, device=device), gamma.bfloat16(),
                                  True),
    }


def linear_samples(device, x, f32, u8, g):
    """The Linear's forward (delayed scaling; current scaling filling the weight cache; high
    precision) and backward (FP8 into a main_grad; high precision)."""
    w = torch.randn(48, 64, generator=g).to(device)
    bias = torch.randn(48, generator=g).to(device)
    codes = torch.randint(0, 126, (64, 48), generator=g, dtype=torch.uint8).to(device)
    x_codes = torch.randint(0, 126, (64, 32), generator=g, dtype=torch.uint8).to(device)
    dy = torch.randn(32, 48, generator=g).bfloat16().to(device)
    dy_codes = torch.randint(0, 124, (32, 48), generator=g,  # (E5M2: finite)
                             dtype=torch.uint8).to(device)

    def state(rows):
        return f32(1.0, 2.0, 4.0), torch.zeros(rows, 8, device=device)

    def config(scaling, cache=0, debug=()):
        return (scaling, 0, 1, 0.0, cache, False, 0, False, "", list(debug))

    delayed, current = 1, 2
    return {
        "linear delayed": (x, w, bias, *state(2), state(1)[1], None, None, None, None, None,
                           *config(delayed), False, False, True, True),
        "linear current main_grad": (
            x, w, None, None, None, None, None, None, None, None,
            torch.zeros(48, 64, device=device), *config(current), True, False, True, True),
        "linear high precision": (x, w.bfloat16(), bias.bfloat16(), None, None, None, None,
                                  None, None, None, None, *config(0), False, True, True, True),
        "linear delayed with autograd": (
            x.clone().requires_grad_(True), w.clone().requires_grad_(True), None, *state(2),
            state(1)[1], None, None, None, None, None, *config(delayed), False, False, True,
            True),
        "linear_forward delayed": (x, w, bias, *state(2), None, None, None, None,
                                   *config(delayed), True, True),
        "linear_forward current weight cache": (
            x, w, None, None, None, u8(48, 64), u8(64, 48), f32(0.0), None,
            *config(current, cache=1), True, True),
        "linear_forward high precision": (x, w.bfloat16(), bias.bfloat16(), None, None, None,
                                          None, None, None, *config(0), True, True),
        # Debugging (a DebugQuantizer around each cast; options: high precision per GEMM,
        # fake-quantization format per tensor or -1, logger handle or -1): every GEMM in FP8;
        # then fprop in high precision and the weight fake-quantized to E4M3.
        "linear_forward delayed debug": (x, w, bias, *state(2), None, None, None, None,
                                         *config(delayed, debug=(0, 0, 0, -1, -1, -1, -1)),
                                         True, True),
        "linear_forward current debug high precision fprop": (
            x, w, None, None, None, None, None, None, None,
            *config(current, debug=(1, 0, 0, -1, 0, -1, -1)), True, True),
        "linear_backward main_grad": (
            dy, None, x_codes, f32(0.5), w, codes, f32(0.25), *state(1),
            torch.zeros(48, 64, device=device), False,
            *config(delayed)[:4], False, 0, False, "", [], [32, 64], torch.bfloat16,
            torch.float32, True, True),
        # fc2 of an MLP (GELU prologue) handing fc1 its gradient in FP8, and fc1 taking one.
        "linear_backward handoff": (
            dy, None, x_codes, f32(0.5), w, codes, f32(0.25), *state(1), None, False,
            *config(delayed)[:4], False, 0, False, "", [], [32, 64], torch.bfloat16, None, True,
            True, x, None, None, None, None, 3, None, f32(1.0, 2.0, 4.0),
            torch.zeros(1, 8, device=device), True, True, True),
        "linear_backward fp8 dy": (
            dy.new_empty(0), None, x_codes, f32(0.5), w, codes, f32(0.25), *state(1), None,
            False, *config(delayed)[:4], False, 0, False, "", [], [32, 64], torch.bfloat16,
            torch.float32, True, True, None, None, None, None, None, 0, None, None, None, False,
            False, False, dy_codes, dy_codes.t().contiguous(), f32(0.125), f32(*range(48))),
        **mlp_samples(device, x, state, config, g),
        "linear_backward high precision": (
            dy, x, u8(0), f32(), w.bfloat16(), u8(0), f32(), None, None, None, False,
            *config(0)[:4], False, 0, False, "", [], [32, 64], torch.bfloat16, torch.bfloat16,
            True, True),
    }


def mlp_samples(device, x, state, config, g):
    """LayerNormMLP's two Linears as one op (RMSNorm -> fc1 -> GELU -> fc2), delayed scaling,
    with autograd (its backward hands fc1 an FP8 gradient) and without."""
    def layer(w, prologue):
        return (w, None, *state(2), state(1)[1], None, None, None, None, None, *config(1),
                False, False, True, True, *prologue)

    def weights():
        return (torch.randn(96, 64, generator=g).to(device).requires_grad_(True),
                torch.randn(48, 96, generator=g).to(device).requires_grad_(True))

    gamma = (1 + torch.randn(64, generator=g)).to(device)
    out = {}
    for name, grad in (("mlp delayed with autograd", True), ("mlp delayed", False)):
        w1, w2 = weights()
        with torch.no_grad():
            w1, w2 = (w1, w2) if grad else (w1.detach(), w2.detach())
        out[name] = (x.clone().requires_grad_(grad),
                     *layer(w1, (gamma.clone().requires_grad_(grad), None, 2, 1e-5, False)),
                     *layer(w2, (None, None, 3, 0.0, False)))
    return out


OP_CASES = list(samples("cpu"))


def test_every_op_has_a_fake_kernel_and_a_case():
    registered = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith("tpfp8::")}
    assert registered == set(tpfp8._fake.OPS) == {case.split()[0] for case in OP_CASES}


@pytest.mark.parametrize("case", OP_CASES)
def test_opcheck(device, case):
    op = getattr(ops_ns, case.split()[0]).default
    opcheck(op, samples(device)[case])


def test_forward_and_backward_ops_refuse_to_be_differentiated(device):
    """linear_forward / linear_backward have no derivative of their own (torch.ops.tpfp8.linear
    differentiates them): called with a tensor that requires grad, under grad mode, they raise
    instead of returning outputs whose backward would drop that gradient; without grad they
    run."""
    x, w = samples(device)["linear_forward high precision"][:2]
    args = samples(device)["linear_forward high precision"][2:]
    with pytest.raises(RuntimeError, match="no derivative of its own"):
        ops_ns.linear_forward(x, w.clone().requires_grad_(True), *args)
    with torch.no_grad():
        y = ops_ns.linear_forward(x, w.clone().requires_grad_(True), *args)[0]
    assert torch.equal(y, ops_ns.linear_forward(x, w, *args)[0])
    backward_args = list(samples(device)["linear_backward high precision"])
    backward_args[0] = backward_args[0].clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match="no derivative of its own"):
        ops_ns.linear_backward(*backward_args)


def fp8_matmul(x, w):
    """x · wᵀ through tpfp8's ops: current-scaled E4M3 casts, then the FP8 GEMM."""
    qx = ops.cast_transpose_current(x, ops.amax(x), "e4m3", columnwise=False)
    qw = ops.cast_transpose_current(w, ops.amax(w), "e4m3", columnwise=False)
    return ops.gemm(qx.rowwise, qw.rowwise, a_format="e4m3", b_format="e4m3",
                    a_scale_inv=qx.scale_inv, b_scale_inv=qw.scale_inv,
                    out_dtype=torch.float32)


def test_ops_compile_whole_and_equal_eager(device):
    torch._dynamo.reset()
    x = torch.randn(32, 64, device=device).bfloat16()
    w = torch.randn(48, 64, device=device).bfloat16()
    explained = torch._dynamo.explain(fp8_matmul)(x, w)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(fp8_matmul, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x, w), fp8_matmul(x, w))
