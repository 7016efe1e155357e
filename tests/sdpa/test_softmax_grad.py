"""The softmax's Jacobian and vector-Jacobian product, against hand-computed values and a
finite-difference loop."""

from __future__ import annotations

import numpy as np
import pytest

from sdpa import softmax, softmax_jacobian, softmax_vjp


def finite_difference_jacobian(x, eps=1e-6):
    """J[i, j] = d softmax(x)_i / d x_j by central differences, with softmax written out here."""

    def sm(z):
        e = np.exp(z - z.max())
        return e / e.sum()

    n = x.size
    J = np.zeros((n, n))
    for j in range(n):
        e = np.zeros(n)
        e[j] = eps
        J[:, j] = (sm(x + e) - sm(x - e)) / (2 * eps)
    return J


def test_two_entries_by_hand():
    # p = (s, 1 - s) with s = sigmoid(x0 - x1): dp0/dx0 = s (1 - s), dp0/dx1 = -s (1 - s).
    x = np.array([0.7, -0.4])
    s = 1 / (1 + np.exp(-1.1))
    c = s * (1 - s)
    np.testing.assert_allclose(softmax_jacobian(x), [[c, -c], [-c, c]], rtol=1e-14)


def test_uniform_by_hand():
    # p = 1/n everywhere: J = I/n - 1/n^2.
    n = 4
    expected = np.eye(n) / n - 1.0 / n**2
    np.testing.assert_allclose(softmax_jacobian(np.full(n, 3.0)), expected, rtol=1e-14)


def test_matches_finite_differences(rng):
    x = rng.standard_normal(7) * 2
    np.testing.assert_allclose(softmax_jacobian(x), finite_difference_jacobian(x), atol=1e-9)


def test_properties(rng):
    x = rng.standard_normal((3, 5, 6))
    J = softmax_jacobian(x)
    assert J.shape == (3, 5, 6, 6)
    np.testing.assert_allclose(J, np.swapaxes(J, -1, -2), atol=1e-16)  # symmetric
    np.testing.assert_allclose(J.sum(axis=-1), 0.0, atol=1e-15)  # rows sum to zero
    eig = np.linalg.eigvalsh(J)
    p_max = softmax(x).max(axis=-1, keepdims=True)
    assert (eig >= -1e-15).all() and (eig <= p_max + 1e-15).all()  # in [0, max p]


def test_axis_moves_to_the_end(rng):
    x = rng.standard_normal((4, 5, 3))
    J = softmax_jacobian(x, axis=1)
    assert J.shape == (4, 3, 5, 5)
    np.testing.assert_allclose(J[2, 1], softmax_jacobian(x[2, :, 1]), rtol=1e-14)


def test_collapses_as_logits_spread():
    # Logits c * (0, 1, 2, 3): as c grows p becomes one-hot and J tends to zero.
    norms = [np.linalg.norm(softmax_jacobian(c * np.arange(4.0))) for c in (0.0, 1.0, 4.0, 16.0)]
    assert norms[0] > norms[1] > norms[2] > norms[3]
    assert norms[3] < 1e-6


def test_masked_entries_have_zero_rows_and_columns():
    J = softmax_jacobian([0.0, -np.inf, 0.0])
    np.testing.assert_array_equal(J[1], 0.0)
    np.testing.assert_array_equal(J[:, 1], 0.0)
    np.testing.assert_allclose(J[[0, 2]][:, [0, 2]], softmax_jacobian([0.0, 0.0]), rtol=1e-15)
    np.testing.assert_array_equal(softmax_jacobian([-np.inf, -np.inf]), 0.0)  # fully masked


def test_dtype_preserved():
    assert softmax_jacobian(np.zeros(3, dtype=np.float32)).dtype == np.float32
    assert softmax_jacobian(np.zeros(3, dtype=np.float16)).dtype == np.float16
    assert softmax_jacobian([1, 2]).dtype == np.float64
    assert (
        softmax_vjp(np.full(2, 0.5, dtype=np.float32), np.ones(2, dtype=np.float32)).dtype
        == np.float32
    )


def test_vjp_equals_jacobian_transpose_product(rng):
    x = rng.standard_normal((2, 3, 5))
    g = rng.standard_normal((2, 3, 5))
    expected = np.einsum("...ij,...i->...j", softmax_jacobian(x), g)
    np.testing.assert_allclose(softmax_vjp(softmax(x), g), expected, atol=1e-15)


def test_vjp_by_hand():
    # L = p_0: dL/dx = p_0 (e_0 - p).
    p = np.array([0.5, 0.3, 0.2])
    np.testing.assert_allclose(
        softmax_vjp(p, [1.0, 0.0, 0.0]), [0.5 * 0.5, -0.5 * 0.3, -0.5 * 0.2], rtol=1e-15
    )


def test_vjp_other_axis_and_broadcast(rng):
    x = rng.standard_normal((4, 3))
    g = rng.standard_normal((2, 4, 3))
    got = softmax_vjp(softmax(x, axis=0), g, axis=1)  # axis 1 of the broadcast shape (2, 4, 3)
    expected = np.stack([softmax_vjp(softmax(x, axis=0), g[i], axis=0) for i in range(2)])
    np.testing.assert_allclose(got, expected, rtol=1e-14)


def test_vjp_of_a_masked_slice_is_zero():
    d_x = softmax_vjp(softmax([-np.inf, -np.inf, -np.inf]), [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(d_x, 0.0)


def test_vjp_sums_to_zero(rng):
    p = softmax(rng.standard_normal((6, 9)))
    d_x = softmax_vjp(p, rng.standard_normal((6, 9)))
    np.testing.assert_allclose(d_x.sum(axis=-1), 0.0, atol=1e-15)


def test_errors():
    with pytest.raises(ValueError, match="x must have at least one dimension; got a 0-d array"):
        softmax_jacobian(1.0)
    with pytest.raises(ValueError, match=r"axis=2 is out of range for an array of shape \(3,\)"):
        softmax_jacobian(np.zeros(3), axis=2)
    with pytest.raises(TypeError, match="x must be a real floating"):
        softmax_jacobian(np.zeros(3, dtype=complex))
    with pytest.raises(
        ValueError,
        match=r"must broadcast to one shape; got weights.shape=\(3,\), d_weights.shape=\(4,\)",
    ):
        softmax_vjp(np.zeros(3), np.zeros(4))
    with pytest.raises(ValueError, match="d_weights must have at least one dimension"):
        softmax_vjp(np.zeros(3), 1.0)
    with pytest.raises(TypeError, match="axis must be an integer"):
        softmax_vjp(np.zeros(3), np.zeros(3), axis=0.5)


def test_jacobian_that_cannot_fit_raises_before_allocating():
    # 10**6 slices of 10**5 entries: a (10**6, 10**5, 10**5) Jacobian, 80 PB. A broadcast view
    # costs nothing to pass in; the estimate is made before anything is allocated.
    x = np.broadcast_to(np.zeros(1), (10**6, 10**5))
    with pytest.raises(
        MemoryError,
        match=r"the Jacobian of shape \(1000000, 100000, 100000\) in float64 would take about "
        r".* TiB \(80000000000000000 bytes\), more than the .* available; softmax_vjp",
    ):
        softmax_jacobian(x)


def test_jacobian_rejects_masked_arrays():
    with pytest.raises(TypeError, match=r"x must not be a numpy.ma.MaskedArray"):
        softmax_jacobian(np.ma.masked_array([1.0, 2.0], mask=[True, False]))
