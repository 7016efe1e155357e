r"""Check hand-written gradients against central finite differences.

For a function ``f`` of arrays and a fixed *cotangent* ``c`` (an array shaped like ``f``'s
result), the scalar ``L = sum(c * f(x_1, ..., x_n))`` has the gradient that a vector-Jacobian
product (a backward pass) returns. Each entry of it is estimated by a central difference,

.. math:: \frac{\partial L}{\partial x_i} \approx
          \frac{L(x + \varepsilon e_i) - L(x - \varepsilon e_i)}{2 \varepsilon},

whose error is ``O(eps^2)`` from truncation plus ``O(u / eps)`` from rounding (``u`` the unit
roundoff): about ``1e-10`` relative for smooth functions in float64 with ``eps = 1e-6``. This is
the same test as ``torch.autograd.gradcheck``, for functions written in NumPy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from numbers import Integral, Real

import numpy as np
from numpy.typing import ArrayLike

from ._checks import as_array, check_bool, check_real, check_rng

__all__ = ["gradcheck", "numerical_gradient"]


def _check_callable(f, name: str) -> None:
    if not callable(f):
        raise TypeError(f"{name} must be callable; got {type(f).__name__}")


def _check_eps(eps) -> float:
    return check_real(
        eps, "eps", "a positive, finite real number", lambda x: math.isfinite(x) and x > 0
    )


def _as_args(args) -> list[np.ndarray]:
    """A list of float64 copies; a single array (or number) is one argument, as in torch."""
    if isinstance(args, (np.ndarray, np.generic, Real)) and not isinstance(args, bool):
        args = (args,)
    if not isinstance(args, (tuple, list)):
        raise TypeError(
            f"args must be an array or a tuple or list of arrays; got {type(args).__name__}"
        )
    arrays = []
    for i, a in enumerate(args):
        arr = as_array(a, f"args[{i}]", masked_hint="pass plain arrays")
        if arr.dtype.kind not in "biuf":
            raise TypeError(f"args[{i}] must be a real array; got dtype {arr.dtype}")
        arrays.append(np.array(arr, dtype=np.float64))  # a float64 copy: inputs are never touched
    return arrays


def _as_gradients(analytic, n: int) -> tuple:
    """``vjp``'s result as a tuple. A lone gradient is accepted as one: an array when one
    argument is checked, and a number (a Python float or a NumPy scalar, which arithmetic on
    0-d arrays returns) in any case, as a 0-d array."""
    if isinstance(analytic, (np.generic, Real)) or (
        isinstance(analytic, np.ndarray) and (n == 1 or analytic.ndim == 0)
    ):
        return (analytic,)
    return tuple(analytic)


def _check_argnums(argnums, n: int) -> tuple[int, ...]:
    if argnums is None:
        return tuple(range(n))
    single = isinstance(argnums, Integral) and not isinstance(argnums, (bool, np.bool_))
    items = (argnums,) if single else argnums
    try:
        items = tuple(items)
    except TypeError:
        raise TypeError(f"argnums must be an int or a sequence of ints; got {argnums!r}") from None
    result = []
    for i in items:
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, Integral):
            raise TypeError(f"argnums must be an int or a sequence of ints; got {argnums!r}")
        if not -n <= i < n:
            raise ValueError(f"argnums entry {i} is out of range for {n} argument(s)")
        result.append(int(i) % n)
    return tuple(result)


def numerical_gradient(
    f: Callable[..., ArrayLike],
    args: Sequence[ArrayLike],
    d_out: ArrayLike | None = None,
    *,
    argnums: int | Sequence[int] | None = None,
    eps: float = 1e-6,
) -> tuple[np.ndarray, ...]:
    r"""Central finite-difference gradient of ``L = sum(d_out * f(*args))``.

    Parameters
    ----------
    f : callable
        A function of arrays returning a real array (or scalar). It is called ``2 n + 1``
        times, ``n`` the number of entries of the differentiated arguments, with float64
        copies of ``args`` (the arrays passed in are never modified).
    args : array_like or tuple of array_like
        The point at which to differentiate: one array, or a tuple or list with one array per
        argument of ``f`` (as ``torch.autograd.gradcheck`` takes ``inputs``).
    d_out : array_like, optional
        The cotangent: an array of ``f``'s result shape. Default: ones, so that ``L`` is the
        sum of ``f`` (or ``f`` itself when it returns a scalar).
    argnums : int or sequence of int, optional
        Which arguments to differentiate; default all.
    eps : float, default 1e-6
        The step; the error is ``O(eps**2)`` truncation plus ``O(1e-16 / eps)`` rounding.

    Returns
    -------
    grads : tuple of np.ndarray
        One float64 array per differentiated argument, shaped like that argument.

    Raises
    ------
    TypeError
        If ``f`` is not callable, ``args`` is not a real array or a tuple or list of them, or
        ``argnums`` or ``eps`` is of the wrong kind.
    ValueError
        If ``eps`` is not positive, an ``argnums`` entry is out of range, or ``d_out`` does not
        have the shape of ``f``'s result.

    Examples
    --------
    The gradient of ``sum(x**2)`` is ``2 x``; of ``sum(c * (a @ b))`` it is ``c @ b.T`` and
    ``a.T @ c``:

    >>> import numpy as np
    >>> from sdpa import numerical_gradient
    >>> (g,) = numerical_gradient(lambda x: np.sum(x**2), np.array([1.0, -2.0, 3.0]))
    >>> np.round(g, 6)
    array([ 2., -4.,  6.])
    >>> a, b, c = np.eye(2), np.array([[1.0, 2.0], [3.0, 4.0]]), np.array([[1.0, 0.0], [0.0, 0.0]])
    >>> g_a, g_b = numerical_gradient(np.matmul, (a, b), c)
    >>> np.round(g_a, 6)
    array([[1., 3.],
           [0., 0.]])
    """
    _check_callable(f, "f")
    eps = _check_eps(eps)
    arrays = _as_args(args)
    argnums = _check_argnums(argnums, len(arrays))
    result_shape = np.shape(f(*arrays))
    if d_out is None:
        cotangent = np.ones(result_shape)
    else:
        cotangent = as_array(d_out, "d_out").astype(np.float64)
        if cotangent.shape != result_shape:
            raise ValueError(
                f"d_out must have the shape of f's result, {result_shape}; "
                f"got d_out.shape={cotangent.shape}"
            )

    def loss(xs) -> float:
        return float(np.sum(cotangent * np.asarray(f(*xs), dtype=np.float64)))

    grads = []
    for i in argnums:
        grad = np.zeros_like(arrays[i])
        flat = grad.reshape(-1)  # a view of grad
        shifted = list(arrays)
        shifted[i] = arrays[i].copy()
        x = shifted[i].reshape(-1)  # a view of the copy, perturbed one entry at a time
        for j in range(x.size):
            x0 = x[j]
            x[j] = x0 + eps
            up = loss(shifted)
            x[j] = x0 - eps
            down = loss(shifted)
            x[j] = x0
            flat[j] = (up - down) / (2 * eps)
        grads.append(grad)
    return tuple(grads)


def gradcheck(
    f: Callable[..., ArrayLike],
    vjp: Callable[..., Sequence[ArrayLike]],
    args: Sequence[ArrayLike],
    d_out: ArrayLike | None = None,
    *,
    argnums: int | Sequence[int] | None = None,
    eps: float = 1e-6,
    atol: float = 1e-8,
    rtol: float = 1e-6,
    rng: np.random.Generator | None = None,
    raise_exception: bool = True,
) -> bool:
    r"""Compare a hand-written backward pass with central finite differences.

    Parameters
    ----------
    f : callable
        The forward function, ``f(*args) -> array``.
    vjp : callable
        The backward function under test, ``vjp(d_out, *args) -> grads``: the gradients of
        ``sum(d_out * f(*args))`` with respect to the arguments selected by ``argnums``, in
        that order. A single array is accepted when one argument is selected, and a number
        (Python float or NumPy scalar) stands for a 0-d array.
    args : array_like or tuple of array_like
        The point at which to check: one array, or one per argument of ``f``. Use float64
        values: finite differences in float32 are too coarse to check anything.
    d_out : array_like, optional
        The cotangent. Default: standard normal numbers from ``rng``, which exercise every
        output entry with a different weight (a cotangent of ones can hide errors that
        cancel in the sum).
    argnums : int or sequence of int, optional
        Which arguments to check; default all.
    eps : float, default 1e-6
        Finite-difference step.
    atol, rtol : float, default 1e-8 and 1e-6
        Each entry must satisfy ``|analytic - numeric| <= atol + rtol * |numeric|``.
    rng : numpy.random.Generator, optional
        Source of the default cotangent; default ``np.random.default_rng(0)``. Checked even
        when ``d_out`` is given.
    raise_exception : bool, default True
        Raise ``AssertionError`` on a mismatch (with the worst entry) instead of returning
        False.

    Returns
    -------
    ok : bool
        True if every gradient matches; False on a mismatch when ``raise_exception`` is False.

    Raises
    ------
    AssertionError
        On a mismatch, when ``raise_exception`` is True.
    TypeError, ValueError
        As :func:`numerical_gradient`; ``TypeError`` also if ``raise_exception`` is not a bool
        or ``rng`` not a ``numpy.random.Generator`` (checked even when ``d_out`` is given),
        ``ValueError`` if ``vjp`` returns the wrong number of gradients or a gradient of the
        wrong shape.

    Examples
    --------
    A correct backward pass for ``f(x, w) = tanh(x @ w)`` passes; one that forgets the
    derivative of tanh does not:

    >>> import numpy as np
    >>> from sdpa import gradcheck
    >>> rng = np.random.default_rng(1)
    >>> x, w = rng.standard_normal((3, 4)), rng.standard_normal((4, 2))
    >>> def f(x, w):
    ...     return np.tanh(x @ w)
    >>> def vjp(d_out, x, w):
    ...     d_z = d_out * (1 - np.tanh(x @ w) ** 2)  # tanh' = 1 - tanh**2
    ...     return d_z @ w.T, x.T @ d_z
    >>> gradcheck(f, vjp, (x, w))
    True
    >>> def wrong_vjp(d_out, x, w):
    ...     return d_out @ w.T, x.T @ d_out
    >>> gradcheck(f, wrong_vjp, (x, w), raise_exception=False)
    False
    """
    _check_callable(f, "f")
    _check_callable(vjp, "vjp")
    raise_exception = check_bool(raise_exception, "raise_exception")
    rng = np.random.default_rng(0) if rng is None else check_rng(rng)
    for name, value in (("atol", atol), ("rtol", rtol)):
        check_real(value, name, "a non-negative real number", lambda x: x >= 0)
    arrays = _as_args(args)
    argnums = _check_argnums(argnums, len(arrays))
    result_shape = np.shape(f(*arrays))
    if d_out is None:
        d_out = rng.standard_normal(result_shape)
    numeric = numerical_gradient(f, arrays, d_out, argnums=argnums, eps=eps)
    analytic = vjp(np.asarray(d_out, dtype=np.float64), *[a.copy() for a in arrays])
    analytic = _as_gradients(analytic, len(argnums))
    if len(analytic) != len(argnums):
        raise ValueError(
            f"vjp must return one gradient per checked argument ({len(argnums)}); "
            f"got {len(analytic)}"
        )
    failures = []
    for i, got, want in zip(argnums, analytic, numeric):
        got = np.asarray(got, dtype=np.float64)
        if got.shape != want.shape:
            raise ValueError(
                f"vjp's gradient for argument {i} must have that argument's shape {want.shape}; "
                f"got shape {got.shape}"
            )
        error = np.abs(got - want)
        bad = ~(error <= atol + rtol * np.abs(want))  # NaN counts as a failure
        if bad.any():
            ranked = np.where(bad, np.where(np.isnan(error), np.inf, error), -1.0)
            worst = np.unravel_index(np.argmax(ranked), got.shape)
            failures.append(
                f"argument {i}: {int(bad.sum())} of {bad.size} entries differ; worst at index "
                f"{tuple(int(n) for n in worst)}: analytic {float(got[worst])!r}, "
                f"numeric {float(want[worst])!r}"
            )
    if failures:
        if raise_exception:
            raise AssertionError(
                f"gradcheck failed (eps={eps}, atol={atol}, rtol={rtol}):\n" + "\n".join(failures)
            )
        return False
    return True
