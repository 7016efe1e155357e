"""sdpa.nn's functions and AdamW, checked against central finite differences (float64), against
torch.autograd and torch.optim.AdamW (float64 to 1e-10, float32 to 1e-5), against hand-computed
values, and for the error of every ``raise``.

Every dimension is a different size (leading (2, 3), E = 5, out = 7, V = 11) so that a swapped
axis cannot pass. The model, DecoderLM, is tested in test_model.py.
"""

from __future__ import annotations

import math
from decimal import Decimal, localcontext

import numpy as np
import pytest

from sdpa import nn

LEAD, E, OUT, V = (2, 3), 5, 7, 11
F64 = dict(rtol=1e-10, atol=1e-10)  # against torch, float64
F32 = dict(rtol=1e-5, atol=1e-5)  # against torch, float32
FD = dict(rtol=1e-6, atol=1e-8)  # against central differences (step 1e-6), float64


# ---------------------------------------------------------------------------------------------
# An independent reference: central differences, entry by entry
# ---------------------------------------------------------------------------------------------


def central_differences(f, args, d_y, i, eps=1e-6):
    """d/d args[i] of sum(d_y * f(*args)), one entry at a time, in float64."""
    args = [np.array(a, dtype=np.float64) for a in args]
    grad = np.zeros_like(args[i])
    for idx in np.ndindex(*args[i].shape):
        saved = args[i][idx]
        args[i][idx] = saved + eps
        up = np.sum(d_y * f(*args))
        args[i][idx] = saved - eps
        down = np.sum(d_y * f(*args))
        args[i][idx] = saved
        grad[idx] = (up - down) / (2 * eps)
    return grad


def readonly(*arrays):
    """Copies that raise if anything writes to them: the functions must not mutate inputs."""
    out = []
    for a in arrays:
        a = np.array(a)
        a.flags.writeable = False
        out.append(a)
    return out


@pytest.fixture
def data(rng):
    """float64 inputs of every function, with a cotangent for each result."""
    x = rng.standard_normal((*LEAD, E))
    return dict(
        x=x,
        weight=rng.standard_normal((E, OUT)),
        bias=rng.standard_normal(OUT),
        d_linear=rng.standard_normal((*LEAD, OUT)),
        gain=1.0 + 0.3 * rng.standard_normal(E),
        shift=rng.standard_normal(E),
        d_x=rng.standard_normal((*LEAD, E)),
        logits=3.0 * rng.standard_normal((*LEAD, V)),
        targets=rng.integers(0, V, size=LEAD),
    )


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


def test_cross_entropy_hand_computed():
    # row 0: log(1 + e + e^2) - 2 for target 2; row 1 ignored; row 2: log 3 for equal logits
    logits = np.array([[0.0, 1.0, 2.0], [5.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    expected = (math.log(1 + math.e + math.e**2) - 2 + math.log(3)) / 2
    loss = nn.cross_entropy(logits, np.array([2, 7, 0]), ignore_index=7)
    assert isinstance(loss, float)
    assert loss == pytest.approx(expected, rel=1e-15)


def test_cross_entropy_large_logits_do_not_overflow():
    loss = nn.cross_entropy(np.array([[1000.0, 0.0]]), np.array([1]))
    assert loss == pytest.approx(1000.0, rel=1e-15)


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
        ce = F.cross_entropy(t["logits"].reshape(-1, V), t["targets"].reshape(-1))
        assert nn.cross_entropy(d["logits"], d["targets"]) == pytest.approx(
            ce.item(), rel=tol["rtol"], abs=tol["atol"]
        )


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


def test_cross_entropy_backward_matches_central_differences(data):
    targets = data["targets"].copy()
    targets[0, 1] = -1  # one ignored row
    grad = nn.cross_entropy_backward(data["logits"], targets, ignore_index=-1)
    numeric = central_differences(
        lambda z: nn.cross_entropy(z, targets, ignore_index=-1), (data["logits"],), 1.0, 0
    )
    np.testing.assert_allclose(grad, numeric, **FD)
    np.testing.assert_array_equal(grad[0, 1], 0.0)


def test_embedding_backward_matches_central_differences(rng):
    table = rng.standard_normal((V, E))
    indices = np.array([[3, 1, 3], [0, 3, 10]])  # token 3 three times; most rows unused
    d_out = rng.standard_normal((2, 3, E))
    numeric = central_differences(lambda t: t[indices], (table,), d_out, 0)
    np.testing.assert_allclose(nn.embedding_backward(d_out, indices, V), numeric, **FD)


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


@pytest.mark.torch
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("ignore_index", [None, -100, 4])
def test_cross_entropy_backward_matches_torch(torch, data, dtype, ignore_index):
    logits = data["logits"].astype(dtype)
    targets = data["targets"].copy()
    if ignore_index is not None:
        targets[1, ::2] = ignore_index
    z = torch.tensor(logits, requires_grad=True)
    loss = torch.nn.functional.cross_entropy(
        z.reshape(-1, V),
        torch.tensor(targets).reshape(-1),
        ignore_index=-100 if ignore_index is None else ignore_index,
    )
    loss.backward()
    tol = F64 if dtype == np.float64 else F32
    ours = nn.cross_entropy_backward(logits, targets, ignore_index=ignore_index)
    assert ours.dtype == dtype
    np.testing.assert_allclose(ours, z.grad.numpy(), **tol)
    assert nn.cross_entropy(logits, targets, ignore_index=ignore_index) == pytest.approx(
        loss.item(), rel=tol["rtol"]
    )


@pytest.mark.torch
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_embedding_backward_matches_torch(torch, rng, dtype):
    indices = np.array([[3, 1, 3], [0, 3, 10]])
    d_out = rng.standard_normal((2, 3, E)).astype(dtype)
    table = torch.zeros((V, E), dtype=getattr(torch, np.dtype(dtype).name), requires_grad=True)
    (
        torch.nn.functional.embedding(torch.tensor(indices), table) * torch.tensor(d_out)
    ).sum().backward()
    ours = nn.embedding_backward(d_out, indices, V)
    assert ours.dtype == dtype
    np.testing.assert_allclose(ours, table.grad.numpy(), **(F64 if dtype == np.float64 else F32))


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
    x, W, b, g, s, d_lin, d_x, z = readonly(
        *(data[k] for k in ("x", "weight", "bias", "gain", "shift", "d_linear", "d_x", "logits"))
    )
    (targets,) = readonly(data["targets"])
    before = [a.copy() for a in (x, W, b, g, s, d_lin, d_x, z)]
    nn.linear(x, W, b), nn.linear_backward(d_lin, x, W, b)
    nn.layer_norm(x, g, s), nn.layer_norm_backward(d_x, x, g, s)
    nn.rms_norm(x, g), nn.rms_norm_backward(d_x, x, g)
    for approximate in ("none", "tanh"):
        nn.gelu(x, approximate=approximate), nn.gelu_backward(d_x, x, approximate=approximate)
    nn.cross_entropy(z, targets), nn.cross_entropy_backward(z, targets)
    nn.embedding_backward(d_x, targets, V)
    for a, b0 in zip((x, W, b, g, s, d_lin, d_x, z), before):
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


def test_cross_entropy_backward_rows_sum_to_zero(data):
    grad = nn.cross_entropy_backward(data["logits"], data["targets"])
    np.testing.assert_allclose(grad.sum(axis=-1), 0.0, atol=1e-15)


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


def test_targets_must_be_integers():
    with pytest.raises(TypeError, match="targets must be an integer array; got dtype float64"):
        nn.cross_entropy(np.zeros((2, 3)), np.array([0.0, 1.0]))


def test_targets_shape():
    with pytest.raises(
        ValueError, match=r"targets must have shape \(2,\); got targets.shape=\(3,\)"
    ):
        nn.cross_entropy(np.zeros((2, 3)), np.array([0, 1, 2]))


def test_targets_range():
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 3\); got the value 3"):
        nn.cross_entropy_backward(np.zeros((2, 3)), np.array([0, 3]))


def test_ignore_index_must_be_integer():
    with pytest.raises(TypeError, match="ignore_index must be an integer or None; got 1.0"):
        nn.cross_entropy(np.zeros((2, 3)), np.array([0, 1]), ignore_index=1.0)


def test_all_targets_ignored():
    with pytest.raises(ValueError, match="every target equals ignore_index=-1"):
        nn.cross_entropy(np.zeros((2, 3)), np.array([-1, -1]), ignore_index=-1)


def test_num_embeddings_must_be_an_integer():
    with pytest.raises(TypeError, match="num_embeddings must be a non-negative integer; got 4.0"):
        nn.embedding_backward(np.ones((2, 3)), np.array([0, 1]), 4.0)


def test_num_embeddings_must_not_be_negative():
    with pytest.raises(ValueError, match="num_embeddings must be a non-negative integer; got -1"):
        nn.embedding_backward(np.ones((2, 3)), np.array([0, 1]), -1)


def test_embedding_d_out_needs_an_axis():
    with pytest.raises(ValueError, match=r"d_out must have at least one dimension \(..., E\)"):
        nn.embedding_backward(np.float64(1.0), np.array(0), 4)


# ---------------------------------------------------------------------------------------------
# AdamW
# ---------------------------------------------------------------------------------------------


@pytest.mark.torch
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_adamw_matches_torch_over_20_steps(torch, rng, dtype):
    shapes = {"w": (E, OUT), "b": (OUT,), "table": (V, 3)}
    params = {name: rng.standard_normal(shape).astype(dtype) for name, shape in shapes.items()}
    grads = [
        {name: rng.standard_normal(shape).astype(dtype) for name, shape in shapes.items()}
        for _ in range(20)
    ]
    tensors = {name: torch.tensor(p.copy(), requires_grad=True) for name, p in params.items()}
    hyper = dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    ours = nn.AdamW(params, **hyper)
    theirs = torch.optim.AdamW(list(tensors.values()), **hyper)
    tol = F64 if dtype == np.float64 else F32
    for step, g in enumerate(grads):
        if step == 10:  # a learning-rate schedule changes lr between steps
            ours.lr = theirs.param_groups[0]["lr"] = 1e-2
        for name, t in tensors.items():
            t.grad = torch.tensor(g[name])
        theirs.step()
        ours.step(g)
        for name, t in tensors.items():
            assert params[name].dtype == dtype
            np.testing.assert_allclose(
                params[name], t.detach().numpy(), **tol, err_msg=f"{name} after step {step + 1}"
            )
    assert ours.step_count == 20


def test_adamw_first_step_hand_computed():
    # step 1: m = (1 - b1) g, v = (1 - b2) g^2, so m / (1 - b1) / sqrt(v / (1 - b2)) = sign(g)
    params = {"w": np.array([1.0, -2.0])}
    opt = nn.AdamW(params, lr=0.1, eps=0.0, weight_decay=0.5)
    opt.step({"w": np.array([3.0, -0.001])})
    np.testing.assert_allclose(params["w"], [1.0 * 0.95 - 0.1, -2.0 * 0.95 + 0.1], rtol=1e-14)


def test_adamw_updates_the_arrays_in_place():
    w = np.zeros(3)
    params = {"w": w}
    nn.AdamW(params, lr=0.5).step({"w": np.ones(3)})
    assert params["w"] is w
    np.testing.assert_allclose(w, -0.5, rtol=1e-7)


def test_adamw_params_must_be_a_dict():
    with pytest.raises(TypeError, match="params must be a dict of named NumPy arrays; got list"):
        nn.AdamW([np.zeros(3)])


@pytest.mark.parametrize(
    "params", [{"w": [0.0, 1.0]}, {"w": np.zeros(3, dtype=int)}, {0: np.zeros(3)}]
)
def test_adamw_params_must_be_floating_arrays(params):
    with pytest.raises(TypeError, match="params must map str names to floating NumPy arrays"):
        nn.AdamW(params)


def test_adamw_params_must_be_writable():
    (w,) = readonly(np.zeros(3))
    with pytest.raises(ValueError, match=r"params\['w'\] is read-only"):
        nn.AdamW({"w": w})


@pytest.mark.parametrize("option", ["lr", "eps", "weight_decay"])
def test_adamw_option_must_be_real(option):
    with pytest.raises(TypeError, match=f"{option} must be a real number; got '0.1'"):
        nn.AdamW({}, **{option: "0.1"})


@pytest.mark.parametrize(
    "option, value", [("lr", -1e-3), ("eps", math.nan), ("weight_decay", math.inf)]
)
def test_adamw_option_range(option, value):
    with pytest.raises(ValueError, match=rf"{option} must be a finite number in \[0.0, inf\]"):
        nn.AdamW({}, **{option: value})


def test_adamw_betas_must_be_a_pair():
    with pytest.raises(TypeError, match=r"betas must be a pair \(beta1, beta2\); got 0.9"):
        nn.AdamW({}, betas=0.9)


def test_adamw_betas_range():
    with pytest.raises(
        ValueError, match=r"betas\[1\] must be a finite number in \[0.0, 1.0\); got 1.0"
    ):
        nn.AdamW({}, betas=(0.9, 1.0))


def test_adamw_grads_must_be_a_dict():
    with pytest.raises(TypeError, match="grads must be a dict keyed like params; got list"):
        nn.AdamW({"w": np.zeros(2)}).step([np.zeros(2)])


def test_adamw_grads_keys():
    with pytest.raises(ValueError, match=r"missing \['w'\], extra \['v'\]"):
        nn.AdamW({"w": np.zeros(2)}).step({"v": np.zeros(2)})


def test_adamw_grads_shape():
    with pytest.raises(
        ValueError,
        match=r"grads\['w'\] must have the shape of params\['w'\], "
        r"\(2,\); got \(3,\)",
    ):
        nn.AdamW({"w": np.zeros(2)}).step({"w": np.zeros(3)})


# ---------------------------------------------------------------------------------------------
# Soft-capping: cap * tanh(x / cap)
# ---------------------------------------------------------------------------------------------


def test_softcap_hand_computed():
    """tanh(1) = (e^2 - 1) / (e^2 + 1): at x = cap the result is cap * tanh(1) and the slope
    1 - tanh(1)^2 = 4 e^2 / (e^2 + 1)^2; at 0 the value 0 and the slope 1; +-inf give +-cap."""
    e2 = math.exp(2.0)
    x = np.array([-math.inf, -3.0, 0.0, 3.0, math.inf])
    np.testing.assert_allclose(
        nn.softcap(x, 3.0), [-3.0, -3.0 * (e2 - 1) / (e2 + 1), 0.0, 3.0 * (e2 - 1) / (e2 + 1), 3.0]
    )
    np.testing.assert_allclose(
        nn.softcap_backward(np.array([1.0, 2.0, 1.0]), np.array([0.0, 3.0, -3.0]), 3.0),
        [1.0, 2.0 * 4 * e2 / (e2 + 1) ** 2, 4 * e2 / (e2 + 1) ** 2],
        rtol=1e-15,
    )


def test_softcap_is_a_bounded_near_identity(rng):
    """|softcap(x) - x| <= |x|^3 / (3 cap^2) (the Notes' bound), and |softcap(x)| <= cap."""
    x = 10.0 * rng.standard_normal(1000)
    y = nn.softcap(x, 4.0)
    assert np.all(np.abs(y) <= 4.0)
    assert np.all(np.abs(y - x) <= np.abs(x) ** 3 / (3 * 4.0**2) * (1 + 1e-12) + 1e-15)


def test_softcap_backward_matches_central_differences(data):
    x = 3.0 * data["x"]
    grad = nn.softcap_backward(data["d_x"], x, 2.5)
    numeric = central_differences(lambda x: nn.softcap(x, 2.5), [x], data["d_x"], 0)
    np.testing.assert_allclose(grad, numeric, **FD)


@pytest.mark.torch
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_softcap_and_backward_match_torch(torch, data, dtype):
    x, d_y = (3.0 * data["x"]).astype(dtype), data["d_x"].astype(dtype)
    tol = F64 if dtype == np.float64 else F32
    t = torch.tensor(x, requires_grad=True)
    y = 2.5 * torch.tanh(t / 2.5)
    (y * torch.tensor(d_y)).sum().backward()
    ours = nn.softcap(x, 2.5)
    assert ours.dtype == dtype
    np.testing.assert_allclose(ours, y.detach().numpy(), **tol)
    d_x = nn.softcap_backward(d_y, x, 2.5)
    assert d_x.dtype == dtype
    np.testing.assert_allclose(d_x, t.grad.numpy(), **tol)


def test_softcap_does_not_modify_its_inputs(data):
    x, d_y = readonly(data["x"], data["d_x"])
    nn.softcap(x, 1.0)
    nn.softcap_backward(d_y, x, 1.0)


@pytest.mark.parametrize("cap", ["1", None, True])
def test_softcap_cap_must_be_real(cap):
    with pytest.raises(TypeError, match="cap must be a positive, finite real number; got"):
        nn.softcap(np.ones(2), cap)


@pytest.mark.parametrize("cap", [0.0, -2.0, math.inf, math.nan])
def test_softcap_cap_must_be_positive_and_finite(cap):
    with pytest.raises(ValueError, match="cap must be a positive, finite real number; got"):
        nn.softcap_backward(np.ones(2), np.ones(2), cap)


def test_softcap_backward_shape_must_match():
    with pytest.raises(ValueError, match=r"d_y must have the shape of the forward result"):
        nn.softcap_backward(np.ones(3), np.ones(2), 1.0)


def test_softcap_input_must_be_real():
    with pytest.raises(TypeError, match="x must be a real floating, integer or bool array"):
        nn.softcap(np.ones(2) * 1j, 1.0)
