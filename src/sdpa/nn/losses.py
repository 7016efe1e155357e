r"""The loss where backpropagation starts, and the gradient of an embedding lookup.

:func:`cross_entropy` is the mean negative log-likelihood of the targets; its backward takes no
``d_y`` (the gradient of the loss with respect to itself is 1). :func:`embedding_backward`
scatters the gradient of the looked-up rows back into the table. Dtypes as in
:mod:`sdpa.nn.functional`.

Shape letters: ``V`` vocabulary size, ``E`` embedding width; leading dimensions ``...`` are
anything (batch, time).
"""

from __future__ import annotations

from numbers import Integral

import numpy as np
from numpy.typing import ArrayLike

from .._checks import (
    check_features,
    check_indices,
    check_nonneg_int,
    float_arrays,
)
from ..softmax_stable import log_softmax, softmax

__all__ = ["cross_entropy", "cross_entropy_backward", "embedding_backward"]


def _check_ignore_index(ignore_index) -> int | None:
    if ignore_index is None:
        return None
    if isinstance(ignore_index, (bool, np.bool_)) or not isinstance(ignore_index, Integral):
        raise TypeError(f"ignore_index must be an integer or None; got {ignore_index!r}")
    return int(ignore_index)


def _cross_entropy_args(logits, targets, ignore_index):
    ignore_index = _check_ignore_index(ignore_index)
    (logits,), out_dtype = float_arrays(logits=logits)
    V = check_features(logits, "logits")
    targets = check_indices(targets, "targets", logits.shape[:-1], V, ignore_index)
    if ignore_index is None:
        counted = np.ones(targets.shape, dtype=bool)
    else:
        counted = targets != ignore_index
    n = int(counted.sum())
    if n == 0:
        raise ValueError(
            f"every target equals ignore_index={ignore_index}, so the mean loss is undefined "
            "(PyTorch returns nan); give at least one target to count"
        )
    return logits, targets, counted, n, out_dtype


def cross_entropy(
    logits: ArrayLike, targets: ArrayLike, *, ignore_index: int | None = None
) -> float:
    r"""Mean negative log-likelihood of the targets under ``softmax(logits)``.

    The same number as ``torch.nn.functional.cross_entropy(logits.reshape(-1, V),
    targets.reshape(-1), ignore_index=...)`` with ``reduction="mean"``. The classes sit on the
    *last* axis here (PyTorch wants them on axis 1), which is the layout of a language model's
    ``(B, T, V)`` logits.

    Parameters
    ----------
    logits : (..., V) array_like
        Unnormalised log-probabilities over ``V`` classes.
    targets : (...) array_like of int
        The correct class of each row, in ``[0, V)``, or ``ignore_index``.
    ignore_index : int, optional
        Rows whose target equals it are left out of the loss and of the mean's denominator
        (padding).

    Returns
    -------
    loss : float
        ``-mean(log_softmax(logits)[..., targets])`` over the counted rows, in nats.

    Raises
    ------
    TypeError
        If ``logits`` is complex or not numeric, ``targets`` is not an integer array, or
        ``ignore_index`` is not an integer.
    ValueError
        If ``logits`` has no axis or no classes, ``targets`` does not have the shape
        ``logits.shape[:-1]``, a target is out of range, or every target is ignored.

    Notes
    -----
    The log-probabilities come from :func:`sdpa.log_softmax`, which subtracts the row maximum
    first, so large logits do not overflow. A model that predicts uniformly has loss
    :math:`\log V`.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.nn import cross_entropy
    >>> logits = np.zeros((2, 4))  # uniform over V = 4 classes: loss log 4
    >>> round(cross_entropy(logits, np.array([0, 3])), 6) == round(float(np.log(4)), 6)
    True
    >>> logits = np.array([[10.0, 0.0], [0.0, 10.0]])
    >>> round(cross_entropy(logits, np.array([0, -1]), ignore_index=-1), 6)  # confident, right
    4.5e-05
    """
    logits, targets, counted, n, _ = _cross_entropy_args(logits, targets, ignore_index)
    log_p = log_softmax(logits.reshape(-1, logits.shape[-1]), axis=-1)  # (N, V)
    rows = np.flatnonzero(counted)  # the counted rows of the flattened (N,) targets
    return float(-log_p[rows, targets.reshape(-1)[rows]].sum() / n)


def cross_entropy_backward(
    logits: ArrayLike, targets: ArrayLike, *, ignore_index: int | None = None
) -> np.ndarray:
    r"""Gradient of :func:`cross_entropy` with respect to the logits.

    Parameters
    ----------
    logits, targets, ignore_index
        As in :func:`cross_entropy`.

    Returns
    -------
    d_logits : (..., V) np.ndarray
        ``(softmax(logits) - onehot(targets)) / n`` on counted rows, with ``n`` their number;
        zero on ignored rows.

    Raises
    ------
    TypeError, ValueError
        As :func:`cross_entropy`.

    Notes
    -----
    For one row, :math:`L = -z_t + \log\sum_j e^{z_j}` gives :math:`\partial L / \partial z_j
    = p_j - [j = t]`: the predicted probabilities minus the one-hot target. Each row of the
    gradient sums to zero.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.nn import cross_entropy_backward
    >>> cross_entropy_backward(np.zeros((2, 4)), np.array([0, 3]))  # p = 1/4, n = 2
    array([[-0.375,  0.125,  0.125,  0.125],
           [ 0.125,  0.125,  0.125, -0.375]])
    """
    logits, targets, counted, n, out_dtype = _cross_entropy_args(logits, targets, ignore_index)
    d_logits = softmax(logits.reshape(-1, logits.shape[-1]), axis=-1)  # (N, V), a new array
    rows = np.flatnonzero(counted)
    d_logits[rows, targets.reshape(-1)[rows]] -= 1.0
    d_logits[~counted.reshape(-1)] = 0.0
    d_logits /= n
    return d_logits.reshape(logits.shape).astype(out_dtype, copy=False)


def embedding_backward(d_out: ArrayLike, indices: ArrayLike, num_embeddings: int) -> np.ndarray:
    r"""Gradient of ``sum(d_out * table[indices])`` with respect to ``table``.

    An embedding lookup copies row ``indices[i]`` of a ``(num_embeddings, E)`` table into
    output row ``i``; its backward adds each output row's gradient into the table row it came
    from. A token that appears several times receives the sum of the gradients of all its
    occurrences; rows that were never looked up receive zero.

    Parameters
    ----------
    d_out : (..., E) array_like
        Gradient with respect to the looked-up rows.
    indices : (...) array_like of int
        The row each output came from, in ``[0, num_embeddings)``.
    num_embeddings : int
        Number of rows of the table.

    Returns
    -------
    d_table : (num_embeddings, E) np.ndarray
        Row ``i`` is the sum of the rows of ``d_out`` whose index is ``i``.

    Raises
    ------
    TypeError
        If ``d_out`` is complex or not numeric, ``indices`` is not an integer array, or
        ``num_embeddings`` is not an integer.
    ValueError
        If ``d_out`` has no axis, ``num_embeddings`` is negative, ``indices`` does not have
        the shape ``d_out.shape[:-1]``, or an index is out of range.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.nn import embedding_backward
    >>> d_out = np.array([[1.0, 1.0], [2.0, 2.0], [4.0, 4.0]])  # three lookups, E = 2
    >>> embedding_backward(d_out, np.array([2, 0, 2]), 4)  # row 2 used twice: 1 + 4
    array([[2., 2.],
           [0., 0.],
           [5., 5.],
           [0., 0.]])
    """
    num_embeddings = check_nonneg_int(num_embeddings, "num_embeddings")
    (d_out,), out_dtype = float_arrays(d_out=d_out)
    if d_out.ndim == 0:
        raise ValueError("d_out must have at least one dimension (..., E); got a 0-d array")
    idx = check_indices(indices, "indices", d_out.shape[:-1], num_embeddings)
    E = d_out.shape[-1]
    d_table = np.zeros((num_embeddings, E), dtype=d_out.dtype)
    np.add.at(d_table, idx.reshape(-1), d_out.reshape(-1, E))  # unbuffered: repeats accumulate
    return d_table.astype(out_dtype, copy=False)
