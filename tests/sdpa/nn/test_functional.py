"""sdpa.nn.functional's layers (linear, layer and RMS norms, GELU) and their backward passes,
checked against central finite differences (float64), against torch.autograd (float64 to 1e-10,
float32 to 1e-5), against hand-computed values and 40-digit decimal arithmetic, and for the
error of every ``raise``.

Every dimension is a different size (leading (2, 3), E = 5, out = 7, V = 11) so that a swapped
axis cannot pass. The losses are tested in test_losses.py, soft-capping in test_softcap.py, AdamW
in test_optim.py, the model, DecoderLM, in test_model.py.
"""

from __future__ import annotations

import math
from decimal import Decimal, localcontext

import numpy as np
import pytest
from nn_checks import F32, F64, FD, OUT, E, central_differences, readonly

from sdpa import nn

# ---------------------------------------------------------------------------------------------
# Forward passes: hand-computed values and torch
# ---------------------------------------------------------------------------------------------


def test_linear_hand_computed():
    x = np.array([[1.0, 2.0], [0.0, -1.0]])
    W = np.array([[1.0, 0.0, 2.0], [3.0, 1.0, 0.0]])
    expected = np.array([[1 + 6 + 0.5, 2 - 1, 2 + 0], [-3 + 0.5, -1 - 1, 0 + 0]])
    np.testing.assert_allclose(nn.linear(x, W, np.array([0.5, -1.0, 0.0])), expected, rtol=0)


def test_layer_norm_hand_computed():
    # row (1, 3): mean 2, biased variance 1, so x_hat = (-1, 1) / sqrt(1 + eps)
    y = nn.layer_norm(np.array([1.0, 3.0]), np.array([2.0, 1.0]), np.array([0.0, 5.0]), eps=0.25)
    np.testing.assert_allclose(y, [-2 / math.sqrt(1.25), 5 + 1 / math.sqrt(1.25)], rtol=1e-15)


def test_rms_norm_hand_computed():
    # row (3, 4): mean square 12.5
    y = nn.rms_norm(np.array([3.0, 4.0]), np.array([1.0, 2.0]), eps=0.5)
    np.testing.assert_allclose(y, [3 / math.sqrt(13), 8 / math.sqrt(13)], rtol=1e-15)


def test_gelu_hand_computed():
    # Phi(1) = (1 + erf(1/sqrt 2)) / 2 = 0.841344746068543 (tables of the normal distribution)
    np.testing.assert_allclose(
        nn.gelu(np.array([1.0, -1.0, 0.0])),
        [0.841344746068543, -0.158655253931457, 0.0],
        rtol=1e-14,
        atol=0,
    )
    # tanh form at 1: u = sqrt(2/pi) * 1.044715
    u = math.sqrt(2 / math.pi) * 1.044715
    np.testing.assert_allclose(
        nn.gelu(np.array([1.0]), approximate="tanh"), [0.5 * (1 + math.tanh(u))], rtol=1e-15
    )


@pytest.mark.torch
def test_forward_matches_torch(torch, data):
    F = torch.nn.functional
    for dt, tol in ((np.float64, F64), (np.float32, F32)):
        d = {k: (v.astype(dt) if v.dtype.kind == "f" else v) for k, v in data.items()}
        t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in d.items()}
        cases = [
            (nn.linear(d["x"], d["weight"], d["bias"]), F.linear(t["x"], t["weight"].T, t["bias"])),
            (
                nn.layer_norm(d["x"], d["gain"], d["shift"]),
                F.layer_norm(t["x"], (E,), t["gain"], t["shift"], eps=1e-5),
            ),
            (nn.rms_norm(d["x"], d["gain"]), F.rms_norm(t["x"], (E,), t["gain"], eps=1e-6)),
            (nn.gelu(d["x"]), F.gelu(t["x"])),
            (nn.gelu(d["x"], approximate="tanh"), F.gelu(t["x"], approximate="tanh")),
        ]
        for ours, theirs in cases:
            assert ours.dtype == dt
            np.testing.assert_allclose(ours, theirs.numpy(), **tol)


# ---------------------------------------------------------------------------------------------
# Backward passes: central differences (float64) and torch.autograd (float64 and float32)
# ---------------------------------------------------------------------------------------------


def backward_cases(d):
    """(name, forward f, args, cotangent, our gradients of sum(d_y * f(*args)) for each arg)."""
    x, W, b, g, s = d["x"], d["weight"], d["bias"], d["gain"], d["shift"]
    return [
        ("linear", nn.linear, (x, W, b), d["d_linear"], nn.linear_backward(d["d_linear"], x, W, b)),
        (
            "linear-no-bias",
            nn.linear,
            (x, W),
            d["d_linear"],
            nn.linear_backward(d["d_linear"], x, W)[:2],
        ),
        (
            "layer_norm",
            nn.layer_norm,
            (x, g, s),
            d["d_x"],
            nn.layer_norm_backward(d["d_x"], x, g, s),
        ),
        ("rms_norm", nn.rms_norm, (x, g), d["d_x"], nn.rms_norm_backward(d["d_x"], x, g)),
        ("gelu", nn.gelu, (x,), d["d_x"], (nn.gelu_backward(d["d_x"], x),)),
        (
            "gelu-tanh",
            lambda x: nn.gelu(x, approximate="tanh"),
            (x,),
            d["d_x"],
            (nn.gelu_backward(d["d_x"], x, approximate="tanh"),),
        ),
    ]


CASES = ["linear", "linear-no-bias", "layer_norm", "rms_norm", "gelu", "gelu-tanh"]


@pytest.mark.parametrize("case", range(len(CASES)), ids=CASES)
def test_backward_matches_central_differences(data, case):
    name, f, args, d_y, grads = backward_cases(data)[case]
    assert name == CASES[case] and len(grads) == len(args)
    for i, grad in enumerate(grads):
        np.testing.assert_allclose(
            grad, central_differences(f, args, d_y, i), **FD, err_msg=f"{name}, argument {i}"
        )


def torch_backward(torch, name, args, d_y, approximate="none"):
    """torch.autograd's gradients of sum(d_y * f(*args)) for the function called ``name``."""
    F = torch.nn.functional
    t = [torch.tensor(a, requires_grad=True) for a in args]
    forward = {
        "linear": lambda x, W, b=None: F.linear(x, W.T, b),
        "linear-no-bias": lambda x, W: F.linear(x, W.T),
        "layer_norm": lambda x, g, s: F.layer_norm(x, (x.shape[-1],), g, s, eps=1e-5),
        "rms_norm": lambda x, g: F.rms_norm(x, (x.shape[-1],), g, eps=1e-6),
        "gelu": lambda x: F.gelu(x),
        "gelu-tanh": lambda x: F.gelu(x, approximate="tanh"),
    }[name]
    (forward(*t) * torch.tensor(d_y)).sum().backward()
    return [a.grad.numpy() for a in t]


@pytest.mark.torch
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("case", range(len(CASES)), ids=CASES)
def test_backward_matches_torch(torch, data, case, dtype):
    d = {k: (v.astype(dtype) if v.dtype.kind == "f" else v) for k, v in data.items()}
    name, _, args, d_y, grads = backward_cases(d)[case]
    tol = F64 if dtype == np.float64 else F32
    for i, (ours, theirs) in enumerate(zip(grads, torch_backward(torch, name, args, d_y))):
        assert ours.dtype == dtype
        np.testing.assert_allclose(ours, theirs, **tol, err_msg=f"{name}, argument {i}")


# ---------------------------------------------------------------------------------------------
# Normalisations at any magnitude: an independent reference in 40-digit decimals
# ---------------------------------------------------------------------------------------------


def decimals(row):
    """The exact values of the floats of ``row``."""
    return [Decimal(float(a)) for a in row]


def decimal_normalise(x, eps, centred):
    """``x_hat`` of one row of decimals (layer norm if ``centred``, else RMS norm) in 40-digit
    decimal arithmetic, whose exponent range (1e-999999 to 1e999999) nothing here reaches."""
    with localcontext() as ctx:
        ctx.prec = 40
        mean = sum(x) / len(x) if centred else Decimal(0)
        c = [a - mean for a in x]
        r = 1 / (sum(a * a for a in c) / len(x) + Decimal(float(eps))).sqrt()
        return [a * r for a in c]


def decimal_norm(x, eps, centred):
    """``x_hat`` of every row, rounded once to float64."""
    rows = [[float(a) for a in decimal_normalise(decimals(row), eps, centred)] for row in x]
    return np.array(rows).reshape(x.shape)


def decimal_norm_grad(x, d_y, weight, eps, centred):
    """d/dx of ``sum(d_y * weight * x_hat(x))``, row by row, by central differences in
    40-digit decimals (step 1e-12 of the row's largest entry: error about 1e-24)."""
    grad = np.zeros(x.shape)
    for r in np.ndindex(*x.shape[:-1]):
        row = decimals(x[r])
        cot = [d * w for d, w in zip(decimals(d_y[r]), decimals(weight))]
        for j in range(len(row)):
            with localcontext() as ctx:
                ctx.prec = 40
                h = max(abs(a) for a in row) * Decimal("1e-12")
                up, down = list(row), list(row)
                up[j] += h
                down[j] -= h
                pairs = zip(
                    decimal_normalise(up, eps, centred), decimal_normalise(down, eps, centred)
                )
                slope = sum(c * (a - b) for c, (a, b) in zip(cot, pairs)) / (2 * h)
            grad[r + (j,)] = float(slope)
    return grad


# Rows of very different magnitudes: squares that overflow (float32 beyond 1.8e19, float64
# beyond 1.3e154), ordinary ones, and rows near the smallest normal numbers (1.2e-38, 2.2e-308),
# whose squares underflow and whose normalisation is dominated by eps. A row of the largest
# floats, and a constant row (its mean is exact, so x_hat is 0).
MAGNITUDES = {
    np.float32: [3.4e38, 1e30, 2e19, 1.0, 1e-3, 2e-38],
    np.float64: [1.7e308, 1e200, 1e155, 1.0, 1e-3, 3e-308],
}


def rows_of_magnitudes(rng, dtype):
    z = rng.standard_normal((len(MAGNITUDES[dtype]), E))
    x = z / np.abs(z).max(axis=1, keepdims=True) * np.array(MAGNITUDES[dtype])[:, None]
    constant = np.full((1, E), 2.0**100)
    return np.concatenate([x, constant]).astype(dtype)


def assert_rows_close(got, want, rtol):
    """Each row to ``rtol`` of its own largest entry: rows differ by hundreds of decades."""
    scale = np.abs(want).max(axis=-1, keepdims=True)
    np.testing.assert_array_less(np.abs(got - want), rtol * (np.abs(want) + scale) + 1e-300)


@pytest.mark.parametrize("centred", [True, False], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_norms_at_any_magnitude_match_decimal_arithmetic(centred, dtype, rng):
    """The squares of a row above 1.8e19 overflow float32 (and its mean may too); the row is
    scaled by a power of two first, so the result matches the decimal reference."""
    x = rows_of_magnitudes(rng, dtype)
    gain = (1.0 + 0.3 * rng.standard_normal(E)).astype(dtype)
    shift = rng.standard_normal(E).astype(dtype)
    eps = 1e-5
    rtol = 1e-6 if dtype == np.float32 else 1e-13
    x_hat = decimal_norm(x, eps, centred)
    if centred:
        got_hat = nn.layer_norm(x, np.ones(E, dtype), np.zeros(E, dtype), eps=eps)
        got = nn.layer_norm(x, gain, shift, eps=eps)
        want = x_hat * gain + shift
    else:
        got_hat = nn.rms_norm(x, np.ones(E, dtype), eps=eps)
        got = nn.rms_norm(x, gain, eps=eps)
        want = x_hat * gain
    assert got.dtype == got_hat.dtype == dtype
    assert np.abs(x_hat[:2]).max() > 0.5  # the largest rows are not normalised to zeros
    assert_rows_close(got_hat, x_hat, rtol)
    assert_rows_close(got, want, rtol)


@pytest.mark.parametrize("centred", [True, False], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_norm_gradients_at_any_magnitude_match_decimal_differences(centred, dtype, rng):
    x = rows_of_magnitudes(rng, dtype)[:-1]  # the constant row's x_hat is 0, its gradient huge
    d_y = rng.standard_normal(x.shape).astype(dtype)
    gain = (1.0 + 0.3 * rng.standard_normal(E)).astype(dtype)
    eps = 1e-5
    rtol = 2e-6 if dtype == np.float32 else 1e-12
    if centred:
        d_x, d_gain, _ = nn.layer_norm_backward(d_y, x, gain, np.zeros(E, dtype), eps=eps)
    else:
        d_x, d_gain = nn.rms_norm_backward(d_y, x, gain, eps=eps)
    want_dx = decimal_norm_grad(x, d_y, gain, eps, centred)
    want_dgain = np.sum(d_y * decimal_norm(x, eps, centred), axis=0)
    assert d_x.dtype == d_gain.dtype == dtype
    assert_rows_close(d_x, want_dx, rtol)
    np.testing.assert_allclose(d_gain, want_dgain, rtol=rtol, atol=rtol * np.abs(d_y).sum())


# ---------------------------------------------------------------------------------------------
# Properties: leading dimensions, no mutation, dtypes
# ---------------------------------------------------------------------------------------------


def test_leading_dimensions_are_rows(data):
    """A 3-D input gives the rows of the 2-D call on its flattened rows, and the same grads."""
    x, W, b, d_y = data["x"], data["weight"], data["bias"], data["d_linear"]
    grads = nn.linear_backward(d_y, x, W, b)
    flat = nn.linear_backward(d_y.reshape(-1, OUT), x.reshape(-1, E), W, b)
    np.testing.assert_allclose(grads[0].reshape(-1, E), flat[0], rtol=1e-14)
    np.testing.assert_allclose(grads[1], flat[1], rtol=1e-14)
    ln = nn.layer_norm_backward(data["d_x"], x, data["gain"], data["shift"])
    ln_flat = nn.layer_norm_backward(data["d_x"][0, 1], x[0, 1], data["gain"], data["shift"])
    np.testing.assert_allclose(ln[0][0, 1], ln_flat[0], rtol=1e-14)


def test_inputs_are_never_modified(data):
    """Every function runs on read-only inputs (a write would raise) and leaves them equal."""
    x, W, b, g, s, d_lin, d_x = readonly(
        *(data[k] for k in ("x", "weight", "bias", "gain", "shift", "d_linear", "d_x"))
    )
    before = [a.copy() for a in (x, W, b, g, s, d_lin, d_x)]
    nn.linear(x, W, b), nn.linear_backward(d_lin, x, W, b)
    nn.layer_norm(x, g, s), nn.layer_norm_backward(d_x, x, g, s)
    nn.rms_norm(x, g), nn.rms_norm_backward(d_x, x, g)
    for approximate in ("none", "tanh"):
        nn.gelu(x, approximate=approximate), nn.gelu_backward(d_x, x, approximate=approximate)
    for a, b0 in zip((x, W, b, g, s, d_lin, d_x), before):
        np.testing.assert_array_equal(a, b0)


def test_integer_inputs_compute_in_float64():
    y = nn.linear(np.array([[1, 2]]), np.array([[1], [1]]))
    assert y.dtype == np.float64
    np.testing.assert_array_equal(y, [[3.0]])


def test_float16_is_computed_in_float32_and_returned_as_float16(data):
    x = data["x"].astype(np.float16)
    y = nn.layer_norm(x, data["gain"].astype(np.float16), data["shift"].astype(np.float16))
    assert y.dtype == np.float16
    ref = nn.layer_norm(
        x.astype(np.float32),
        data["gain"].astype(np.float16).astype(np.float32),
        data["shift"].astype(np.float16).astype(np.float32),
    )
    np.testing.assert_array_equal(y, ref.astype(np.float16))


# ---------------------------------------------------------------------------------------------
# Errors: one test per raise, each matching its message
# ---------------------------------------------------------------------------------------------


def test_complex_input_raises():
    with pytest.raises(TypeError, match="x must be a real floating, integer or bool array"):
        nn.linear(np.ones((2, 3), dtype=complex), np.ones((3, 2)))


def test_weight_must_be_2d():
    with pytest.raises(
        ValueError, match=r"weight must be 2-D \(in, out\); got weight.shape=\(3,\)"
    ):
        nn.linear(np.ones((2, 3)), np.ones(3))


def test_linear_widths_must_match():
    with pytest.raises(
        ValueError,
        match=r"last axis of x must equal the rows of weight.*"
        r"x.shape=\(2, 3\), weight.shape=\(4, 2\)",
    ):
        nn.linear(np.ones((2, 3)), np.ones((4, 2)))


def test_bias_shape():
    with pytest.raises(ValueError, match=r"bias must have shape \(2,\).*got bias.shape=\(3,\)"):
        nn.linear(np.ones((2, 3)), np.ones((3, 2)), np.ones(3))


def test_norm_needs_features():
    with pytest.raises(ValueError, match=r"x must have .* a non-empty last axis.*\(4, 0\)"):
        nn.layer_norm(np.ones((4, 0)), np.ones(0), np.ones(0))


def test_norm_weight_shape():
    with pytest.raises(ValueError, match=r"weight must have shape \(3,\), the last axis of x"):
        nn.rms_norm(np.ones((2, 3)), np.ones(4))


def test_grad_shape_must_match():
    with pytest.raises(
        ValueError,
        match=r"d_y must have the shape of the forward result.*"
        r"\(2, 3\); got d_y.shape=\(3, 2\)",
    ):
        nn.gelu_backward(np.ones((3, 2)), np.ones((2, 3)))


def test_eps_must_be_real():
    with pytest.raises(TypeError, match="eps must be a positive, finite real number; got '1e-5'"):
        nn.layer_norm(np.ones(3), np.ones(3), np.zeros(3), eps="1e-5")


@pytest.mark.parametrize("eps", [0.0, -1e-5, math.inf])
def test_eps_must_be_positive_and_finite(eps):
    with pytest.raises(ValueError, match="eps must be a positive, finite real number"):
        nn.rms_norm(np.ones(3), np.ones(3), eps=eps)


def test_gelu_approximate_choices():
    with pytest.raises(ValueError, match="approximate must be 'none' or 'tanh'; got 'erf'"):
        nn.gelu(np.ones(3), approximate="erf")
