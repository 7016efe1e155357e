r"""The derivative of the softmax: its Jacobian, and the vector-Jacobian product used in backprop.

For ``p = softmax(x)`` along one axis of length ``N``,

.. math:: \frac{\partial p_i}{\partial x_j} = p_i (\delta_{ij} - p_j),
          \qquad J = \operatorname{diag}(p) - p p^\top .

Backpropagation never builds ``J``: for an upstream gradient ``g = dL/dp`` it needs only

.. math:: \frac{\partial L}{\partial x} = J^\top g = p \odot (g - \langle p, g \rangle),

which costs ``O(N)`` instead of ``O(N^2)``. This is the step ``dS = P * (dP - D)`` of the
attention backward pass (:func:`sdpa.scaled_dot_product_attention_backward`).
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike

from ._checks import as_float_array, check_axis, check_memory, compute_dtype
from .softmax_stable import SOFTMAX_MASK_HINT, softmax_and_lse

__all__ = ["softmax_jacobian", "softmax_vjp"]


def softmax_jacobian(x: ArrayLike, axis: int = -1) -> np.ndarray:
    r"""The Jacobian of :func:`sdpa.softmax` at ``x``: ``diag(p) - p p^T`` for each slice.

    Parameters
    ----------
    x : (..., N) array_like
        Logits. Entries equal to ``-inf`` (masked) have probability zero, and their rows and
        columns of the Jacobian are zero.
    axis : int, default -1
        The axis along which the softmax normalises.

    Returns
    -------
    jacobian : (..., N, N) np.ndarray
        ``jacobian[..., i, j] = d p_i / d x_j``. The normalised axis is moved to the end and
        expanded into two axes; the other axes keep their order. Same floating dtype as ``x``.

    Raises
    ------
    TypeError
        If ``x`` is complex, not numeric or a masked array, or ``axis`` is not an integer.
    ValueError
        If ``x`` is 0-d or ``axis`` is out of range.
    MemoryError
        If the ``(..., N, N)`` result would not fit in the available memory (estimated before
        anything is allocated; an input of 50,000 entries asks for 20 GB).

    Notes
    -----
    ``J`` is symmetric and each of its rows sums to zero (adding a constant to every logit does
    not change the softmax). Its eigenvalues lie in ``[0, max_i p_i]``. Its Frobenius norm is
    ``sqrt(N - 1) / N`` for a uniform ``p``, ``1/2`` for ``p`` split evenly between two entries,
    and tends to zero as ``p`` approaches a one-hot vector, which is what happens when the
    logits spread far apart. A fully masked slice (every entry ``-inf``)
    has ``p = 0`` and a zero Jacobian. float16 is computed in float32 and returned as float16.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa import softmax_jacobian
    >>> J = softmax_jacobian([0.0, 0.0])  # p = [0.5, 0.5]
    >>> J
    array([[ 0.25, -0.25],
           [-0.25,  0.25]])
    >>> J = softmax_jacobian([2.0, 1.0, 0.1])
    >>> bool(np.allclose(J, J.T)), bool(np.allclose(J.sum(axis=-1), 0.0))  # symmetric, rows sum to 0
    (True, True)
    >>> softmax_jacobian(np.zeros((4, 5, 3)), axis=1).shape  # axis 1 (N = 5) moves to the end
    (4, 3, 5, 5)
    """
    arr = as_float_array(x, "x", masked_hint=SOFTMAX_MASK_HINT)
    if arr.ndim == 0:
        raise ValueError("x must have at least one dimension; got a 0-d array")
    axis = check_axis(arr, axis)
    out_dtype, work_dtype = compute_dtype(arr)
    n = arr.shape[axis]
    shape = (*arr.shape[:axis], *arr.shape[axis + 1 :], n, n)
    # the Jacobian, in the working dtype and (float16) once more in the output dtype
    need = math.prod(shape) * (work_dtype.itemsize + (out_dtype != work_dtype) * out_dtype.itemsize)
    check_memory(
        need,
        f"the Jacobian of shape {shape} in {work_dtype}",
        "softmax_vjp gives its product with a vector in O(N) memory",
    )
    arr = np.moveaxis(arr.astype(work_dtype, copy=False), axis, -1)
    p, _ = softmax_and_lse(arr, axis=-1)  # (..., N)
    jacobian = -p[..., :, None] * p[..., None, :]  # (..., N, 1) * (..., 1, N) -> (..., N, N)
    diagonal = np.einsum("...ii->...i", jacobian)  # a writable view of the diagonal
    diagonal += p
    assert jacobian.shape == (*p.shape, n)
    return jacobian.astype(out_dtype, copy=False)


def softmax_vjp(weights: ArrayLike, d_weights: ArrayLike, axis: int = -1) -> np.ndarray:
    r"""Backpropagate through a softmax: ``d_x = p * (d_p - sum(p * d_p))`` without the Jacobian.

    Parameters
    ----------
    weights : (..., N) array_like
        The softmax output ``p`` of the forward pass (the attention weights).
    d_weights : (..., N) array_like
        Upstream gradient ``dL/dp``, broadcastable with ``weights``.
    axis : int, default -1
        The axis along which the softmax normalised.

    Returns
    -------
    d_x : (..., N) np.ndarray
        ``dL/dx``, the gradient with respect to the softmax's input (the scores), with the
        broadcast shape of the two arguments and their common floating dtype.

    Raises
    ------
    TypeError
        If an argument is complex or not numeric, or ``axis`` is not an integer.
    ValueError
        If an argument is 0-d, the shapes do not broadcast, or ``axis`` is out of range.

    Notes
    -----
    This is ``J^T d_p`` with ``J = diag(p) - p p^T`` (:func:`softmax_jacobian`), computed in
    ``O(N)`` per slice. Positions with ``p = 0`` (masked keys, fully masked rows) get exactly
    zero gradient. Each slice of ``d_x`` sums to zero when ``p`` sums to one. Only ``p`` is
    needed, not the logits: this is why the attention backward pass can recompute ``p`` from
    the stored log-sum-exp and never keep the scores.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa import softmax, softmax_jacobian, softmax_vjp
    >>> x = np.array([2.0, 1.0, 0.1])
    >>> g = np.array([1.0, 0.0, 0.0])  # the gradient of L = p_0
    >>> d_x = softmax_vjp(softmax(x), g)
    >>> np.round(d_x, 3)
    array([ 0.225, -0.16 , -0.065])
    >>> bool(np.allclose(d_x, softmax_jacobian(x).T @ g))
    True
    >>> float(np.round(d_x.sum(), 12))
    0.0
    """
    p = as_float_array(weights, "weights")
    g = as_float_array(d_weights, "d_weights")
    for name, a in (("weights", p), ("d_weights", g)):
        if a.ndim == 0:
            raise ValueError(f"{name} must have at least one dimension; got a 0-d array")
    try:
        shape = np.broadcast_shapes(p.shape, g.shape)
    except ValueError:
        raise ValueError(
            f"weights and d_weights must broadcast to one shape; got "
            f"weights.shape={p.shape}, d_weights.shape={g.shape}"
        ) from None
    axis = check_axis(np.empty(shape, dtype=bool), axis)
    out_dtype, work_dtype = compute_dtype(p, g)
    p = p.astype(work_dtype, copy=False)
    g = g.astype(work_dtype, copy=False)
    dot = np.sum(p * g, axis=axis, keepdims=True)  # <p, g> per slice
    d_x = p * (g - dot)
    return np.broadcast_to(d_x, shape).astype(out_dtype)
