"""Small worked examples with every number given, as data for the book, the tests and the demo.

Each example is a :class:`WorkedExample`: the tokens, their embeddings ``X`` and either the
projection matrices (``W_q``, ``W_k``, ``W_v``, so ``Q = X W_q``) or the projected matrices
themselves. Nothing here is computed: these are the inputs, and the package computes the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "WorkedExample",
    "the_cat_sleeps",
    "the_cat_sat_on_mat",
    "the_dog_near_the_cats",
    "SOFTMAX_SCORES",
]

#: The scores whose softmax the formula walk-through computes: about [0.659, 0.242, 0.099].
SOFTMAX_SCORES = (2.0, 1.0, 0.1)


@dataclass(frozen=True)
class WorkedExample:
    """Tokens with embeddings and either projection weights or projected ``Q, K, V``.

    Attributes
    ----------
    tokens : tuple of str
        The ``T`` tokens.
    X : (T, E) np.ndarray
        Token embeddings, one row per token.
    W_q, W_k, W_v : (E, D) np.ndarray or None
        Projection weights, multiplied from the right: ``Q = X @ W_q``.
    Q, K, V : (T, D) np.ndarray
        The projected queries, keys and values.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.examples import WorkedExample
    >>> ex = WorkedExample(tokens=("a", "b"), X=np.eye(2), Q=np.eye(2), K=np.eye(2), V=np.eye(2))
    >>> ex.W_q is None  # the projections are optional: some sources give only Q, K, V
    True
    """

    tokens: tuple[str, ...]
    X: np.ndarray
    Q: np.ndarray
    K: np.ndarray
    V: np.ndarray
    W_q: np.ndarray | None = None
    W_k: np.ndarray | None = None
    W_v: np.ndarray | None = None


def _frozen(a) -> np.ndarray:
    arr = np.array(a)
    arr.flags.writeable = False
    return arr


def _projected(tokens, *, X, W_q, W_k, W_v) -> WorkedExample:
    """A worked example given by its embeddings and projections; ``Q = X W_q`` and so on."""
    X, W_q, W_k, W_v = (_frozen(a) for a in (X, W_q, W_k, W_v))
    Q, K, V = (_frozen(X @ W) for W in (W_q, W_k, W_v))
    return WorkedExample(tokens=tuple(tokens), X=X, Q=Q, K=K, V=V, W_q=W_q, W_k=W_k, W_v=W_v)


def the_cat_sleeps() -> WorkedExample:
    """ "The cat sleeps.": three tokens with 2-D integer embeddings and 2 x 2 projections.

    The walk-through attends from "cat" with *unscaled* scores ``[1, 1, 2]``, which gives
    weights of about ``[0.212, 0.212, 0.576]`` and an output of about ``[0.788, 1.576]``.

    Returns
    -------
    WorkedExample
        ``Q = X W_q``, ``K = X W_k`` and ``V = X W_v`` are computed from the weights.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.examples import the_cat_sleeps
    >>> ex = the_cat_sleeps()
    >>> ex.tokens
    ('The', 'cat', 'sleeps')
    >>> ex.K  # keys of The, cat, sleeps
    array([[1, 1],
           [0, 1],
           [1, 2]])
    >>> ex.Q[1] @ ex.K.T  # raw scores of "cat"
    array([1, 1, 2])
    """
    return _projected(
        ("The", "cat", "sleeps"),
        X=[[1, 0], [0, 1], [1, 1]],
        W_q=[[1, 0], [0, 1]],
        W_k=[[1, 1], [0, 1]],
        W_v=[[1, 0], [0, 2]],
    )


def the_cat_sat_on_mat() -> WorkedExample:
    """ "the cat sat on mat": five tokens, 4-D embeddings and their projections, batch of one.

    The embeddings count up in steps of 0.1; the projected ``Q``, ``K`` and ``V`` are given
    directly, rounded to three decimals, with no projection weights behind them. All arrays have shape ``(B, T, D) = (1, 5, 4)``.

    Returns
    -------
    WorkedExample
        Read-only arrays: a new copy on every call.

    Examples
    --------
    >>> from sdpa.examples import the_cat_sat_on_mat
    >>> ex = the_cat_sat_on_mat()
    >>> ex.X.shape, ex.Q.shape
    ((1, 5, 4), (1, 5, 4))
    >>> ex.tokens[2], ex.X[0, 2]
    ('sat', array([0.9, 1. , 1.1, 1.2]))
    """
    X = _frozen(np.round(np.arange(1, 21).reshape(1, 5, 4) / 10, 1))
    Q = _frozen(
        [
            [
                [-0.041, -0.663, -0.448, -0.059],
                [-0.027, -1.360, -0.433, 0.446],
                [-0.013, -2.058, -0.418, 0.951],
                [0.001, -2.755, -0.402, 1.456],
                [0.015, -3.452, -0.387, 1.961],
            ]
        ]
    )
    K = _frozen(
        [
            [
                [-0.212, -0.097, -0.663, 0.427],
                [-0.489, -0.134, -1.701, 0.184],
                [-0.765, -0.171, -2.738, -0.060],
                [-1.042, -0.208, -3.775, -0.303],
                [-1.319, -0.245, -4.812, -0.547],
            ]
        ]
    )
    V = _frozen(
        [
            [
                [-0.329, -0.734, -0.402, 0.250],
                [-0.547, -2.161, -0.835, 0.143],
                [-0.765, -3.587, -1.268, 0.035],
                [-0.983, -5.013, -1.701, -0.072],
                [-1.201, -6.440, -2.133, -0.179],
            ]
        ]
    )
    return WorkedExample(tokens=("the", "cat", "sat", "on", "mat"), X=X, Q=Q, K=K, V=V)


def the_dog_near_the_cats() -> WorkedExample:
    """ "the dog near the cats barks at them": projections built by hand to resolve agreement.

    Each word has eight 0/1 features, the columns of ``X``: noun, pronoun, verb, function word,
    singular, plural, dog, cat. Keys offer three slots (noun, singular, plural); queries ask for
    them: pronouns and verbs look for a noun (strength 6) of their own number (strength 6);
    values carry the meaning of the two nouns (dog, cat). With the scaling by ``sqrt(3)``,
    *barks* attends to *dog* and *them* to *cats*, each with a weight of about 0.94, and the
    function words, whose queries are zero, attend evenly. The book builds these matrices step
    by step on the page "Attention at work".

    Returns
    -------
    WorkedExample
        ``X`` is ``(8, 8)``; ``W_q`` and ``W_k`` are ``(8, 3)``, ``W_v`` is ``(8, 2)``.

    Examples
    --------
    >>> import numpy as np
    >>> import sdpa
    >>> from sdpa.examples import the_dog_near_the_cats
    >>> ex = the_dog_near_the_cats()
    >>> _, weights = sdpa.scaled_dot_product_attention(ex.Q, ex.K, ex.V, return_weights=True)
    >>> barks, dog = ex.tokens.index("barks"), ex.tokens.index("dog")
    >>> round(float(weights[barks, dog]), 3)
    0.937
    """
    #       noun pron verb func sing plur dog cat
    X = np.array(
        [
            [0, 0, 0, 1, 0, 0, 0, 0],  # the
            [1, 0, 0, 0, 1, 0, 1, 0],  # dog
            [0, 0, 0, 1, 0, 0, 0, 0],  # near
            [0, 0, 0, 1, 0, 0, 0, 0],  # the
            [1, 0, 0, 0, 0, 1, 0, 1],  # cats
            [0, 0, 1, 0, 1, 0, 0, 0],  # barks
            [0, 0, 0, 1, 0, 0, 0, 0],  # at
            [0, 1, 0, 0, 0, 1, 0, 0],  # them
        ],
        dtype=float,
    )
    W_q = np.zeros((8, 3))  # slots: noun, singular, plural
    W_q[[1, 2], 0] = 6.0  # pronouns and verbs look for a noun ...
    W_q[[4, 5], [1, 2]] = 6.0  # ... of their own number
    W_k = np.zeros((8, 3))
    W_k[[0, 4, 5], [0, 1, 2]] = 1.0  # a key says: noun, singular, plural
    W_v = np.zeros((8, 2))
    W_v[[6, 7], [0, 1]] = 1.0  # a value carries the meaning: dog, cat
    tokens = ("the", "dog", "near", "the", "cats", "barks", "at", "them")
    return _projected(tokens, X=X, W_q=W_q, W_k=W_k, W_v=W_v)
