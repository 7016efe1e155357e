"""The finite-difference gradient checker, on functions whose gradients are known by hand."""

from __future__ import annotations

import numpy as np
import pytest

from sdpa import gradcheck, numerical_gradient


def test_numerical_gradient_of_known_functions(rng):
    x = rng.standard_normal((3, 4))
    (g,) = numerical_gradient(lambda a: np.sum(np.sin(a)), (x,))
    np.testing.assert_allclose(g, np.cos(x), rtol=1e-8, atol=1e-10)
    a, b = rng.standard_normal((2, 3)), rng.standard_normal((3, 4))
    c = rng.standard_normal((2, 4))
    g_a, g_b = numerical_gradient(np.matmul, (a, b), c)  # L = sum(c * (a @ b))
    np.testing.assert_allclose(g_a, c @ b.T, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(g_b, a.T @ c, rtol=1e-8, atol=1e-10)


def test_scalar_output_and_argnums(rng):
    x, y = rng.standard_normal(3), rng.standard_normal(3)
    (g_y,) = numerical_gradient(lambda a, b: float(a @ b), (x, y), argnums=1)
    np.testing.assert_allclose(g_y, x, rtol=1e-9)
    (g_x,) = numerical_gradient(lambda a, b: float(a @ b), (x, y), argnums=[-2])
    np.testing.assert_allclose(g_x, x * 0 + y, rtol=1e-9)


def test_truncation_error_shrinks_as_eps_squared():
    # For f = x^3 the central difference is 3 x^2 + eps^2 exactly: the error is eps^2.
    x = np.array([1.5])
    for eps in (1e-1, 1e-2):
        (g,) = numerical_gradient(lambda a: np.sum(a**3), (x,), eps=eps)
        np.testing.assert_allclose(g - 3 * x**2, eps**2, rtol=1e-6)


def test_integer_and_float32_arguments_are_differentiated_in_float64():
    seen = []

    def f(a):
        seen.append(a.dtype)
        return np.sum(a**2)

    (g,) = numerical_gradient(f, ([1, 2],))
    np.testing.assert_allclose(g, [2.0, 4.0], rtol=1e-9)
    (g,) = numerical_gradient(f, (np.array([1.0], dtype=np.float32),))
    assert g.dtype == np.float64 and set(seen) == {np.dtype(np.float64)}


def test_inputs_are_not_modified(rng):
    x = rng.standard_normal(4)
    x.flags.writeable = False
    before = x.copy()
    numerical_gradient(lambda a: np.sum(a**2), (x,))
    np.testing.assert_array_equal(x, before)


def test_gradcheck_accepts_a_correct_vjp_and_rejects_a_wrong_one(rng):
    x, w = rng.standard_normal((3, 4)), rng.standard_normal((4, 2))

    def f(x_, w_):
        return np.tanh(x_ @ w_)

    def vjp(d, x_, w_):
        dz = d * (1 - np.tanh(x_ @ w_) ** 2)
        return dz @ w_.T, x_.T @ dz

    def off_by_a_little(d, x_, w_):
        g_x, g_w = vjp(d, x_, w_)
        return g_x, g_w * (1 + 1e-4)

    assert gradcheck(f, vjp, (x, w)) is True
    assert gradcheck(f, off_by_a_little, (x, w), raise_exception=False) is False
    with pytest.raises(
        AssertionError, match=r"gradcheck failed .*\nargument 1: 8 of 8 entries differ"
    ):
        gradcheck(f, off_by_a_little, (x, w))
    # the worst entry is reported as plain numbers, not NumPy scalar reprs
    with pytest.raises(AssertionError, match=r"analytic -?\d\.\d+(e-?\d+)?, numeric -?\d\.\d+"):
        gradcheck(f, off_by_a_little, (x, w))
    assert gradcheck(f, lambda d, x_, w_: vjp(d, x_, w_)[1], (x, w), argnums=1)  # a single array


def test_gradcheck_catches_an_error_that_a_cotangent_of_ones_hides(rng):
    # f(x) = x - mean(x) has sum(f) = 0 for every x, so with d_out = ones both the true
    # gradient and the wrong one below are zero; the random default cotangent tells them apart.
    x = rng.standard_normal(5)

    def f(a):
        return a - a.mean()

    def wrong(d, a):
        return (np.zeros_like(a),)

    assert gradcheck(f, wrong, (x,), d_out=np.ones(5))
    assert not gradcheck(f, wrong, (x,), raise_exception=False)


def test_gradcheck_reports_nan_as_a_failure(rng):
    x = rng.standard_normal(3)
    ok = gradcheck(lambda a: a**2, lambda d, a: (np.full(3, np.nan),), (x,), raise_exception=False)
    assert ok is False


@pytest.mark.parametrize("kind", [float, np.float64], ids=["python float", "numpy scalar"])
def test_gradcheck_accepts_a_scalar_gradient(kind):
    """For a scalar argument a vjp may return a Python float or a NumPy scalar (what
    arithmetic on 0-d arrays gives): each is a 0-d gradient, compared with the differences."""

    def cube(a):
        return a**3

    def vjp(d, a):
        return kind(d * 3 * a**2)  # d/da a^3 = 3 a^2, by hand

    def wrong_vjp(d, a):
        return kind(d * 2 * a**2)

    for x in (1.5, np.array(-0.7)):
        assert gradcheck(cube, vjp, x, d_out=1.3) is True
        assert gradcheck(cube, lambda d, a: (vjp(d, a),), (x,)) is True  # or in a tuple
        assert gradcheck(cube, wrong_vjp, x, raise_exception=False) is False
        with pytest.raises(AssertionError, match="argument 0: 1 of 1 entries differ"):
            gradcheck(cube, wrong_vjp, x)


X = np.array([0.3, -1.2, 2.0])


def identity(a):
    return a


def identity_vjp(d, a):
    return (d,)


# One raising call per case: (exception, message pattern, the call).
ERRORS = {
    "f not callable": (
        TypeError,
        "f must be callable; got int",
        lambda: numerical_gradient(3, (X,)),
    ),
    "args a set": (
        TypeError,
        "args must be an array or a tuple or list of .*; got set",
        lambda: numerical_gradient(np.sum, {1.0, 2.0}),
    ),
    "masked array": (
        TypeError,
        r"args\[0\] must not be a numpy.ma.MaskedArray",
        lambda: numerical_gradient(np.sum, np.ma.masked_array(X, [0, 1, 0])),
    ),
    "complex args": (
        TypeError,
        r"args\[0\] must be a real array; got dtype complex128",
        lambda: numerical_gradient(np.sum, (X + 1j,)),
    ),
    "eps zero": (
        ValueError,
        "eps must be a positive, finite real number; got 0.0",
        lambda: numerical_gradient(np.sum, (X,), eps=0.0),
    ),
    "eps a string": (
        TypeError,
        "eps must be a positive, finite real number; got .1e-6.",
        lambda: numerical_gradient(np.sum, (X,), eps="1e-6"),
    ),
    "argnums out of range": (
        ValueError,
        "argnums entry 1 is out of range for 1 argument",
        lambda: numerical_gradient(np.sum, (X,), argnums=1),
    ),
    "argnums a float": (
        TypeError,
        "argnums must be an int or a sequence of ints",
        lambda: numerical_gradient(np.sum, (X,), argnums=0.5),
    ),
    "d_out shape": (
        ValueError,
        r"d_out must have the shape of f's result, \(3,\); got d_out.shape=\(2,\)",
        lambda: numerical_gradient(identity, (X,), np.ones(2)),
    ),
    "vjp not callable": (TypeError, "vjp must be callable", lambda: gradcheck(np.sum, None, (X,))),
    "vjp gives too many gradients": (
        ValueError,
        r"vjp must return one gradient per checked argument \(1\); got 2",
        lambda: gradcheck(identity, lambda d, a: (d, d), (X,)),
    ),
    "vjp gives one scalar for two arguments": (
        ValueError,
        r"vjp must return one gradient per checked argument \(2\); got 1",
        lambda: gradcheck(np.multiply, lambda d, a, b: float(d * b), (1.5, 2.0)),
    ),
    "vjp gradient shape": (
        ValueError,
        r"vjp's gradient for argument 0 must have that argument's shape \(3,\); got shape \(2,\)",
        lambda: gradcheck(identity, lambda d, a: (d[:2],), (X,)),
    ),
    "atol negative": (
        ValueError,
        "atol must be a non-negative real number; got -1",
        lambda: gradcheck(identity, identity_vjp, (X,), atol=-1),
    ),
    "rng an int": (
        TypeError,
        r"rng must be a numpy.random.Generator, .*; got int",
        lambda: gradcheck(identity, identity_vjp, (X,), rng=0),
    ),
    # checked even when it is not used (d_out given): a wrong argument is never ignored
    "rng an int with d_out given": (
        TypeError,
        r"rng must be a numpy.random.Generator, .*; got int",
        lambda: gradcheck(identity, identity_vjp, (X,), np.ones(3), rng=0),
    ),
    "raise_exception a string": (
        TypeError,
        "raise_exception must be a bool; got 'no'",
        lambda: gradcheck(identity, identity_vjp, (X,), raise_exception="no"),
    ),
}


@pytest.mark.parametrize("case", ERRORS)
def test_error(case):
    exception, pattern, call = ERRORS[case]
    with pytest.raises(exception, match=pattern):
        call()


def test_a_single_array_is_one_argument(rng):
    # As torch.autograd.gradcheck(f, x): no need to write (x,).
    x = rng.standard_normal((2, 3))
    (g,) = numerical_gradient(lambda a: np.sum(a**3), x)
    np.testing.assert_allclose(g, 3 * x**2, rtol=1e-8)
    assert gradcheck(lambda a: np.sin(a), lambda d, a: d * np.cos(a), x)
    (g,) = numerical_gradient(lambda a: a**2, 1.5)  # a number is a 0-d array
    np.testing.assert_allclose(g, 3.0, rtol=1e-8)
