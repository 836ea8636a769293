"""Codes and rules defined once, in C++, and read from there by the Python API: FP8 formats and
their maxima, GEMM type codes, the FP8 size rule, and the Linear's one argument check."""
import pytest
import torch

import tpfp8
from tpfp8 import _C


def test_formats_come_from_the_native_enum():
    assert [int(f) for f in tpfp8.Fp8Format] == [int(_C.Fp8Format.E4M3), int(_C.Fp8Format.E5M2)]
    assert tpfp8.Fp8Format.E4M3.max == 448.0 and tpfp8.Fp8Format.E5M2.max == 57344.0
    for f in tpfp8.Fp8Format:
        assert f.native == _C.Fp8Format(int(f)) and f.max == _C.fp8_max(f.native)


def test_gemm_type_codes_come_from_the_native_enum():
    codes = {t.name: int(t) for t in _C.GemmType.__members__.values()}
    assert codes == {"FLOAT32": 0, "BFLOAT16": 1, "FLOAT16": 2, "E4M3": 3, "E5M2": 4}
    assert tpfp8.Fp8Format.E5M2.gemm_type == codes["E5M2"]
    # An unknown code is refused by the op itself.
    a = torch.zeros(16, 16, dtype=torch.uint8)
    one = torch.ones(1)
    out = torch.empty(16, 16)
    with pytest.raises(ValueError, match="0..4"):
        torch.ops.tpfp8.gemm(a, a, out, one, one, 5, 3, None, False, False, False, False)


def test_fp8_size_rule_is_one_constant():
    assert _C.FP8_MULTIPLE == 16
    k = _C.FP8_MULTIPLE + 8
    with tpfp8.fp8_autocast(), pytest.raises(ValueError, match=f"multiples of 16, got {k}"):
        tpfp8.Linear(k, 32)(torch.randn(2, k))
    a = torch.zeros(16, k, dtype=torch.uint8)
    with pytest.raises(ValueError, match=f"multiple of {_C.FP8_MULTIPLE}, got K={k}"):
        tpfp8.ops.gemm(a, a, a_format="e4m3", b_format="e4m3", a_scale_inv=torch.ones(1),
                       b_scale_inv=torch.ones(1))


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("make_input,message", [
    (lambda: torch.randn(4, 31), r"in_features=32\]"),
    (lambda: torch.randn(4, 32).double(), "float32, bfloat16 or float16"),
    (lambda: torch.randint(0, 3, (4, 32)), "float32, bfloat16 or float16"),
    (lambda: torch.randn(4, 32, device="meta"), "is on meta"),
])
def test_one_argument_check_raises_value_error(fp8, make_input, message):
    """The C++ check is the only one, inside and outside FP8 and on the meta device."""
    lin = tpfp8.Linear(32, 48)
    with tpfp8.fp8_autocast(enabled=fp8), pytest.raises(ValueError, match=message):
        lin(make_input())
    meta = tpfp8.Linear(32, 48, device="meta")
    if make_input().device.type != "meta":
        return
    with pytest.raises(ValueError, match=r"in_features=32\]"):
        meta(torch.randn(4, 31, device="meta"))


def test_not_a_tensor_is_a_type_error():
    with pytest.raises(TypeError, match="expects a tensor, got list"):
        tpfp8.Linear(32, 48)([1.0] * 32)


def test_the_forward_op_and_its_fake_kernel_share_one_check():
    def check(x, weight, scaling):
        return (x, weight, None, None, None, None, None, None, None, scaling, 0, 1, 0.0, 0,
                False, 0, False, "", [])
    _C.check_linear_forward(*check(torch.randn(2, 32), torch.randn(48, 32), 2), None, None, 0, 0.0)
    for device in ("cpu", "meta"):  # the op, and its fake kernel (meta device)
        x, w = torch.randn(2, 24, device=device), torch.randn(48, 24, device=device)
        with pytest.raises(ValueError, match="multiples of 16, got 24 and 48"):
            torch.ops.tpfp8.linear_forward(*check(x, w, 2), False, False)


@pytest.mark.parametrize("recipe", ["delayed", object(), {"margin": 0}])
def test_recipes_are_one_list(recipe):
    """fp8_autocast and the ops' codes read the recipes from one place (scaling.py); anything
    else is refused by name, before any layer runs."""
    layer = tpfp8.Linear(16, 16)
    with pytest.raises(ValueError, match="recipe must be tpfp8.DelayedScaling or "
                                         "tpfp8.CurrentScaling, got"):
        with tpfp8.fp8_autocast(recipe=recipe):
            layer(torch.randn(2, 16))
    assert layer.fp8_state is None  # (nothing ran in FP8)
