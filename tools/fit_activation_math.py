"""Fits the polynomial coefficients of csrc/kernels/activation_math.h (exp, erf, erfc) and
prints them as C++ initialisers.

Near-minimax fits by Lawson's iteratively reweighted least squares on Chebyshev nodes, in
float64 against Python's math.exp / math.erf / math.erfc, rounded to fp32. The accuracy that
counts is the one the fp32 evaluation reaches; tests_cpp/test_activation_cast.cpp measures
it against double over a dense grid. Run: python3 tools/fit_activation_math.py
"""
import math

import numpy as np


def fit(f, lo, hi, degree, var=lambda x: x, relative=True, nodes=4000, iterations=80):
    """Coefficients (lowest first) of the polynomial in var(x) nearest f on [lo, hi] in the
    max (relative or absolute) error, and that error."""
    x = (np.cos(np.linspace(np.pi, 0.0, nodes)) * (hi - lo) + (hi + lo)) / 2
    y = np.array([f(float(v)) for v in x])
    u = var(x)
    vander = np.vander(u, degree + 1, increasing=True)
    w = 1 / np.abs(y) if relative else np.ones_like(y)
    lawson = np.full_like(y, 1.0 / y.size)
    for _ in range(iterations):
        sw = w * np.sqrt(lawson)
        c = np.linalg.lstsq(vander * sw[:, None], y * sw, rcond=None)[0]
        err = np.abs(vander @ c - y) * w
        lawson = lawson * err
        lawson /= lawson.sum()
    c32 = c.astype(np.float32)
    return c32, float(np.max(np.abs(vander @ c32.astype(np.float64) - y) * w))


def show(name, coefficients, error):
    body = ", ".join(f"{v:.9g}f" for v in coefficients)
    print(f"// {name}: max error {error:.2g}\n{{{body}}}")


LN2_HALF = math.log(2) / 2
# exp(r) = 1 + r + r^2 Q(r), |r| <= ln2 / 2.
show("exp Q(r)", *fit(lambda r: (math.exp(r) - 1 - r) / (r * r) if r else 0.5,
                      -LN2_HALF, LN2_HALF, 4))
# erf(a) = a + a P(a^2), 0 <= a < 1 (absolute error of erf(a)/a).
show("erf P(a^2)", *fit(lambda a: math.erf(a) / a - 1 if a else 2 / math.sqrt(math.pi) - 1,
                        0.0, 1.0, 6, var=lambda x: x * x, relative=False))
# erfc(a) = exp(-a^2) t H(t), t = 1 / (1 + a/2), for a in [0, 10.25] (exp(-a^2) underflows
# past): one polynomial from 0 on, so GELU's Phi takes no branch.
show("erfc H(t), t = 1 / (1 + a/2)",
     *fit(lambda a: math.erfc(a) * math.exp(a * a) * (1 + a / 2), 0.0, 10.25, 10,
          var=lambda x: 1 / (1 + x / 2)))
