"""sdpa.nn.softcap: ``cap * tanh(x / cap)`` and its backward pass, checked against
hand-computed values, the bound of its Notes, central finite differences (float64) and
torch.autograd (float64 to 1e-10, float32 to 1e-5), and for the error of every ``raise``."""

from __future__ import annotations

import math

import numpy as np
import pytest
from nn_checks import F32, F64, FD, central_differences, readonly

from sdpa import nn


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
