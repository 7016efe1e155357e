r"""Helpers of the page *Choosing tokens: DeepSeek's indexer and compressed sparse attention*.

DeepSeek's sparse attention (DSA) picks, for every query, the ``k`` earlier keys with the
highest *index score* of a small "lightning indexer",

.. math::

    I_{ts} = \sum_{j=1}^{H_I} w_{tj}\, \operatorname{ReLU}(q_{tj} \cdot k_s),

and attends to those alone. This module writes the pieces the page builds on:

* :func:`index_scores`, :func:`top_k_keys` and :func:`top_k_mask_mod`: the scores, the chosen
  keys as a boolean table, and that table as a ``mask_mod`` for :func:`sdpa.create_block_mask`;
* :func:`init_indexer`, :func:`indexer_scores` and :func:`indexer_kl`: an indexer with its own
  projections of a layer's input (RoPE on its queries and keys), and the KL divergence from a
  target distribution (the layer's attention, summed over heads) to the softmax of its scores,
  with the gradient of every projection written out by hand (DeepSeek-V3.2's warm-up loss);
* :func:`train_indexer`: that loss minimised with :class:`sdpa.nn.AdamW`;
* :func:`sparse_forward`: the book's :class:`sdpa.nn.DecoderLM` run with each block's attention
  restricted to keys chosen per window and query (dense when nothing is chosen);
* :func:`compress` and :func:`compressed_sparse_attention`: DeepSeek-V4's compressed sparse
  attention, every ``m`` keys pooled into one entry, the top-k entries chosen, a sliding window
  of raw keys beside them, the two branches merged by their log-sum-exps.

Shape letters: ``B`` batch, ``H`` heads, ``T`` queries, ``S`` keys (``T = S = n`` in a
sequence's own attention), ``E`` model width, ``H_I`` and ``D_I`` the indexer's heads and width,
``m`` tokens per compressed entry.
"""

from __future__ import annotations

import numpy as np

import sdpa
from sdpa.nn import AdamW, gelu, layer_norm, linear
from sdpa_book.checks import check_count

__all__ = [
    "compress",
    "compressed_sparse_attention",
    "index_scores",
    "indexer_kl",
    "indexer_scores",
    "init_indexer",
    "sparse_forward",
    "top_k_keys",
    "top_k_mask_mod",
    "train_indexer",
]


def _causal(T: int, S: int) -> np.ndarray:
    """``(T, S)`` bool: query ``t`` sits at position ``S - T + t`` and sees keys up to it."""
    return np.arange(S)[None, :] <= np.arange(S - T, S)[:, None]


# -- the lightning indexer and its top-k ------------------------------------------------------


def index_scores(q: np.ndarray, w: np.ndarray, k: np.ndarray) -> np.ndarray:
    r"""The lightning indexer's scores ``I[..., t, s] = sum_j w[..., t, j] relu(q[..., t, j] . k[..., s])``.

    Parameters
    ----------
    q : (..., T, H_I, D_I) np.ndarray
        The indexer's queries, ``H_I`` small heads per token.
    w : (..., T, H_I) np.ndarray
        Each query head's weight (a scalar per token and head, computed from the token).
    k : (..., S, D_I) np.ndarray
        The indexer's keys: one per token, shared by the heads.

    Returns
    -------
    (..., T, S) np.ndarray
        The scores, for every pair (causality is the caller's: see :func:`top_k_keys`).

    Raises
    ------
    ValueError
        If the shapes do not agree.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa_book.pages.indexer import index_scores
    >>> q = np.array([[[1.0, 0.0], [0.0, 1.0]]])        # one query, two heads of width 2
    >>> k = np.array([[2.0, -1.0], [-1.0, 3.0]])         # two keys
    >>> index_scores(q, np.array([[0.5, 1.0]]), k)       # 0.5 relu(2) + relu(-1); 0 + 3
    array([[1., 3.]])
    """
    q, w, k = (np.asarray(a) for a in (q, w, k))
    if q.ndim < 3 or w.shape != q.shape[:-1] or k.shape[-1] != q.shape[-1]:
        raise ValueError(
            "index_scores needs q (..., T, H_I, D_I), w (..., T, H_I) and k (..., S, D_I); "
            f"got q {q.shape}, w {w.shape}, k {k.shape}"
        )
    u = np.einsum("...tjd,...sd->...tjs", q, k)  # (..., T, H_I, S) per-head dot products
    return np.einsum("...tj,...tjs->...ts", w, np.maximum(u, 0))


def top_k_keys(scores: np.ndarray, k: int, *, visible: np.ndarray | None = None) -> np.ndarray:
    """For each query, its ``k`` visible keys with the highest scores, as a bool table.

    Parameters
    ----------
    scores : (..., T, S) array_like
        One score per query and key.
    k : int
        Keys to keep per query, at least 1; a query with fewer visible keys keeps them all.
    visible : (T, S) or (..., T, S) array_like of bool, optional
        The keys each query may choose from; default causal (query ``t`` at position
        ``S - T + t`` sees keys ``0 ... S - T + t``).

    Returns
    -------
    (..., T, S) np.ndarray of bool
        True where a query keeps a key. Ties go to the earlier key.

    Raises
    ------
    TypeError
        If ``k`` is not an int.
    ValueError
        If ``k < 1`` or ``visible`` does not broadcast to the scores' shape.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa_book.pages.indexer import top_k_keys
    >>> top_k_keys(np.array([[5.0, 1.0, 9.0], [3.0, 4.0, 2.0], [3.0, 4.0, 2.0]]), 1)
    array([[ True, False, False],
           [False,  True, False],
           [False,  True, False]])
    """
    k = check_count(k, "k")
    scores = np.asarray(scores, dtype=float)
    T, S = scores.shape[-2:]
    if visible is None:
        visible = _causal(T, S)
    visible = np.asarray(visible, dtype=bool)
    try:
        visible = np.broadcast_to(visible, scores.shape)
    except ValueError:
        raise ValueError(
            f"visible must broadcast to the scores' shape {scores.shape}; got {visible.shape}"
        ) from None
    ranked = np.where(visible, scores, -np.inf)
    order = np.argsort(-ranked, axis=-1, kind="stable")  # best first, ties to the earlier key
    chosen = np.zeros(scores.shape, dtype=bool)
    np.put_along_axis(chosen, order[..., :k], True, axis=-1)
    return chosen & visible  # fewer than k visible keys: all of them, no invisible one


def top_k_mask_mod(chosen: np.ndarray):
    """A ``mask_mod`` that reads a table of chosen keys, causal on top of it.

    Parameters
    ----------
    chosen : (B, T, S) array_like of bool
        The keys each query keeps (:func:`top_k_keys`), per batch entry; shared by the heads.

    Returns
    -------
    callable
        ``mask_mod(b, h, q_idx, kv_idx)`` for :func:`sdpa.create_block_mask` with ``B`` the
        batch size: True where ``chosen[b, q_idx, kv_idx]`` and the key is not in the
        query's future (query ``t`` at position ``S - T + t``).

    Raises
    ------
    ValueError
        If ``chosen`` is not 3-D.

    Examples
    --------
    >>> import numpy as np, sdpa
    >>> from sdpa_book.pages.indexer import top_k_keys, top_k_mask_mod
    >>> chosen = top_k_keys(np.random.default_rng(0).standard_normal((1, 8, 8)), 2)
    >>> mask = sdpa.create_block_mask(top_k_mask_mod(chosen), 1, None, 8, 8, BLOCK_SIZE=4)
    >>> bool((mask.to_dense().sum() <= 3))                 # of the 4 tiles, the causal 3 at most
    True
    """
    chosen = np.asarray(chosen, dtype=bool)
    if chosen.ndim != 3:
        raise ValueError(f"chosen must be (B, T, S); got shape {chosen.shape}")
    T, S = chosen.shape[1:]

    def mask_mod(b, h, q_idx, kv_idx):
        return chosen[b, q_idx, kv_idx] & (kv_idx <= q_idx + (S - T))

    return mask_mod


# -- an indexer of a layer's input, and its warm-up loss ---------------------------------------


def init_indexer(rng: np.random.Generator, E: int, heads: int, dim: int) -> dict:
    """Random projections of an indexer over inputs of width ``E``, in float64.

    Parameters
    ----------
    rng : np.random.Generator
        The source of the random numbers.
    E : int
        Width of the layer input the indexer reads.
    heads, dim : int
        ``H_I`` query heads of width ``D_I``.

    Returns
    -------
    dict of np.ndarray
        ``w_q`` ``(E, H_I D_I)``, ``w_k`` ``(E, D_I)`` and ``w_w`` ``(E, H_I)``, each entry
        normal with standard deviation ``1 / sqrt(E)``.
    """
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a np.random.Generator; got {type(rng).__name__}")
    E, heads, dim = check_count(E, "E"), check_count(heads, "heads"), check_count(dim, "dim")
    shapes = {"w_q": (E, heads * dim), "w_k": (E, dim), "w_w": (E, heads)}
    return {name: rng.standard_normal(shape) / np.sqrt(E) for name, shape in shapes.items()}


def _project(params: dict, h: np.ndarray):
    """The indexer's queries ``(B, T, H_I, D_I)`` (RoPE'd), keys ``(B, T, D_I)`` (RoPE'd) and
    weights ``(B, T, H_I)`` of a layer input ``h`` ``(B, T, E)``."""
    B, T, _ = h.shape
    heads = params["w_w"].shape[1]
    positions = np.arange(T)
    q = (h @ params["w_q"]).reshape(B, T, heads, -1).transpose(0, 2, 1, 3)  # (B, H_I, T, D_I)
    q = sdpa.apply_rotary_embedding(q, positions).transpose(0, 2, 1, 3)  # (B, T, H_I, D_I)
    k = sdpa.apply_rotary_embedding(h @ params["w_k"], positions)  # (B, T, D_I)
    return q, k, h @ params["w_w"]


def indexer_scores(params: dict, h: np.ndarray) -> np.ndarray:
    """The index scores ``(B, T, T)`` of an indexer (:func:`init_indexer`) on a layer input.

    Queries and keys get rotary position embeddings, as DeepSeek's indexer's do, so that the
    indexer of a RoPE model can see positions too.

    Parameters
    ----------
    params : dict of np.ndarray
        As :func:`init_indexer` returns.
    h : (B, T, E) array_like
        The layer's input (after its norm).

    Returns
    -------
    (B, T, T) np.ndarray
        :func:`index_scores` of every query and key of each window (causality not applied).
    """
    h = np.asarray(h, dtype=float)
    if h.ndim != 3 or h.shape[2] != params["w_q"].shape[0]:
        raise ValueError(f"h must be (B, T, {params['w_q'].shape[0]}); got {h.shape}")
    q, k, w = _project(params, h)
    return index_scores(q, w, k)


def indexer_kl(params: dict, h: np.ndarray, target: np.ndarray, *, grads: bool = True):
    r"""DeepSeek-V3.2's warm-up loss and its gradient: the mean over queries of
    ``KL(target_t || softmax(I_t))`` over the causal keys.

    Parameters
    ----------
    params : dict of np.ndarray
        The indexer (:func:`init_indexer`).
    h : (B, T, E) array_like
        The layer input.
    target : (B, T, T) array_like
        Each query's target distribution over the keys (rows sum to one, zero on future keys):
        the layer's attention weights summed over heads and renormalised.
    grads : bool, default True
        Also return the gradients.

    Returns
    -------
    loss : float
        ``mean_{b,t} sum_s p log(p / softmax(I)_s)`` (``0 log 0 = 0``).
    grads : dict of np.ndarray
        Only with ``grads``: the loss's gradient for each array of ``params``.

    Notes
    -----
    The softmax's gradient is ``dI = (softmax(I) - p) / (B T)`` on the causal keys. Through
    ``I = sum_j w_j relu(u_j)`` with ``u_j = q_j . k``: ``dw_j = sum_s dI_s relu(u_js)`` and
    ``du_js = dI_s w_j [u_js > 0]``; then ``dq_j = sum_s du_js k_s``, ``dk_s = sum_{t,j}
    du_tjs q_tj``, each rotated back by RoPE's inverse (a rotation's transpose is its inverse)
    and multiplied into the projections' gradients ``h^T d(.)``.
    """
    h = np.asarray(h, dtype=float)
    target = np.asarray(target, dtype=float)
    B, T, _ = h.shape
    if target.shape != (B, T, T):
        raise ValueError(f"target must be (B, T, T) = {(B, T, T)}; got {target.shape}")
    q, k, w = _project(params, h)
    q = q.transpose(0, 2, 1, 3)  # (B, H_I, T, D_I): the heads first, for matmul
    w = w.transpose(0, 2, 1)[..., None]  # (B, H_I, T, 1)
    u = q @ k[:, None].transpose(0, 1, 3, 2)  # (B, H_I, T, S)
    relu = np.maximum(u, 0)
    scores = (w * relu).sum(axis=1)  # (B, T, S)
    causal = _causal(T, T)
    log_q = sdpa.log_softmax(np.where(causal, scores, -np.inf), axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):  # 0 log 0 and -inf on future keys
        terms = np.where(target > 0, target * (np.log(target) - log_q), 0.0)
    loss = float(terms.sum() / (B * T))
    if not grads:
        return loss
    d_scores = np.where(causal, np.exp(log_q) - target, 0.0)[:, None] / (B * T)  # (B, 1, T, S)
    d_w = (d_scores * relu).sum(axis=-1).transpose(0, 2, 1)  # (B, T, H_I)
    d_u = d_scores * w * (u > 0)  # (B, H_I, T, S)
    d_q = d_u @ k[:, None]  # (B, H_I, T, D_I)
    d_k = (d_u.transpose(0, 1, 3, 2) @ q).sum(axis=1)  # (B, S, D_I)
    positions = np.arange(T)
    d_q = sdpa.apply_rotary_embedding(d_q, -positions)  # RoPE's transpose: its inverse
    d_q = d_q.transpose(0, 2, 1, 3).reshape(B, T, -1)
    d_k = sdpa.apply_rotary_embedding(d_k, -positions)
    flat = h.reshape(B * T, -1)
    return loss, {
        "w_q": flat.T @ d_q.reshape(B * T, -1),
        "w_k": flat.T @ d_k.reshape(B * T, -1),
        "w_w": flat.T @ d_w.reshape(B * T, -1),
    }


def train_indexer(params: dict, h: np.ndarray, target: np.ndarray, *, steps: int, lr: float):
    """Minimise :func:`indexer_kl` over fixed inputs with AdamW (full batch, no weight decay).

    Parameters
    ----------
    params : dict of np.ndarray
        The starting indexer; not changed (a copy is trained).
    h, target : np.ndarray
        As :func:`indexer_kl`.
    steps : int
        Optimiser steps.
    lr : float
        Learning rate.

    Returns
    -------
    params : dict of np.ndarray
        The trained indexer.
    losses : (steps,) np.ndarray
        The loss before each step.
    """
    steps = check_count(steps, "steps")
    trained = {name: np.array(a, dtype=float) for name, a in params.items()}
    opt = AdamW(trained, lr=lr, weight_decay=0.0)
    losses = np.empty(steps)
    for step in range(steps):
        losses[step], g = indexer_kl(trained, h, target)
        opt.step(g)
    return trained, losses


# -- the book's model with chosen keys ----------------------------------------------------------


def sparse_forward(model, tokens: np.ndarray, select=None):
    """The logits of a :class:`sdpa.nn.DecoderLM`, each block attending to chosen keys only.

    The forward pass of the book's model (layer norm, RoPE, GELU MLP; no option beyond
    those), written with the package's public functions so that every block can take its own
    mask per window and query, which ``DecoderLM.forward``'s one ``(T, T)`` mask cannot.

    Parameters
    ----------
    model : sdpa.nn.DecoderLM
        With ``positional="rope"``, ``norm="layer"``, ``n_kv_heads == n_heads`` and no other
        option.
    tokens : (B, T) array_like of int
        Token ids.
    select : callable, optional
        ``select(layer, h, q, k) -> (B, T, T) bool or None``, given the block's input after its
        norm ``(B, T, E)`` and its queries and keys ``(B, H, T, Dk)`` (after RoPE): the keys
        each query may attend, shared by the heads (a future key is never attended). None
        (or a None result): dense causal attention.

    Returns
    -------
    logits : (B, T, V) np.ndarray
    record : list of dict
        Per block: ``h`` its normed input, ``weights`` ``(B, H, T, T)`` the attention weights
        it used.

    Raises
    ------
    ValueError
        If the model has an option this forward pass does not write.
    """
    c = model.config
    plain = dict(qk_norm=False, logit_softcap=None, attn_softcap=None, sink=False)
    plain |= dict(output_gate=False, attention_only=False, positional="rope", norm="layer")
    wrong = {name: getattr(c, name) for name, v in plain.items() if getattr(c, name) != v}
    if wrong or c.n_kv_heads != c.n_heads:
        raise ValueError(f"sparse_forward writes the book's plain model only; got {wrong}")
    p = model.params
    tokens = np.asarray(tokens)
    T = tokens.shape[1]
    causal = _causal(T, T)
    x = p["token_embedding"][tokens]  # (B, T, E)
    record = []
    for i in range(c.n_layers):
        b = f"blocks.{i}."
        h = layer_norm(x, p[b + "attn_norm.weight"], p[b + "attn_norm.bias"])
        q, k, v = (sdpa.split_heads(h @ p[b + f"attn.w_{n}"], c.n_heads) for n in "qkv")
        q, k = (sdpa.apply_rotary_embedding(a, np.arange(T)) for a in (q, k))
        chosen = None if select is None else select(i, h, q, k)
        allowed = causal if chosen is None else (np.asarray(chosen, bool) & causal)[:, None]
        out, weights = sdpa.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, implementation="reference", return_weights=True
        )
        record.append({"h": h, "weights": weights})
        x = x + sdpa.merge_heads(out) @ p[b + "attn.w_o"]
        h2 = layer_norm(x, p[b + "mlp_norm.weight"], p[b + "mlp_norm.bias"])
        u = gelu(linear(h2, p[b + "mlp.w_in"], p[b + "mlp.b_in"]), approximate="tanh")
        x = x + linear(u, p[b + "mlp.w_out"], p[b + "mlp.b_out"])
    h_final = layer_norm(x, p["final_norm.weight"], p["final_norm.bias"])
    return h_final @ p["unembedding"], record


# -- DeepSeek-V4's compressed sparse attention --------------------------------------------------


def compress(x: np.ndarray, m: int, bias: np.ndarray | None = None) -> np.ndarray:
    """Pool every ``m`` consecutive rows into one entry: ``(..., S, D) -> (..., S // m, D)``.

    Entry ``c`` is ``sum_i softmax(bias)_i x[c m + i]``; the default bias (zeros) makes it the
    mean. A trailing group of fewer than ``m`` rows is not pooled (it is not complete yet).

    Parameters
    ----------
    x : (..., S, D) array_like
        Keys or values.
    m : int
        Rows per entry.
    bias : (m,) array_like, optional
        Pooling logits by position in the group (learned in DeepSeek-V4, where they also
        depend on the token); default uniform.

    Returns
    -------
    (..., S // m, D) np.ndarray

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa_book.pages.indexer import compress
    >>> compress(np.arange(10.0).reshape(5, 2), 2)       # rows (0, 1), (2, 3); row 4 waits
    array([[1., 2.],
           [5., 6.]])
    """
    m = check_count(m, "m")
    x = np.asarray(x, dtype=float)
    weights = np.full(m, 1 / m) if bias is None else sdpa.softmax(np.asarray(bias, float))
    if weights.shape != (m,):
        raise ValueError(f"bias must have shape ({m},); got {np.shape(bias)}")
    n_c = x.shape[-2] // m
    groups = x[..., : n_c * m, :].reshape(*x.shape[:-2], n_c, m, x.shape[-1])
    return np.einsum("...cid,i->...cd", groups, weights)


def compressed_sparse_attention(q, k, v, scores, *, m: int, top_k: int, window: int):
    """Compressed sparse attention: the top-k of ``m``-token entries and a window, merged.

    Query ``t`` attends (1) the ``top_k`` compressed entries with the highest ``scores`` among
    the complete groups that end at or before ``t`` and (2) the raw keys ``t - window + 1 ...
    t``; each branch is a :func:`sdpa.flex_attention` call with a block mask, and the two are
    merged with :func:`sdpa.merge_attention_states`, which equals one softmax over the union
    of the two key sets.

    Parameters
    ----------
    q, k, v : (B, H, n, D) array_like
        A sequence's queries, keys and values.
    scores : (B, n, n // m) array_like
        The indexer's score of each compressed entry for each query (shared by the heads).
    m, top_k, window : int
        Tokens per entry, entries kept per query, raw keys in the window.

    Returns
    -------
    out : (B, H, n, D) np.ndarray
    lse : (B, H, n) np.ndarray
        The merged log-sum-exp.
    chosen : (B, n, n // m) np.ndarray of bool
        The entries each query kept.
    """
    m, top_k = check_count(m, "m"), check_count(top_k, "top_k")
    window = check_count(window, "window")
    q, k, v = (np.asarray(a, dtype=float) for a in (q, k, v))
    B, _, n, _ = q.shape
    if n < m:
        raise ValueError(f"the sequence must hold at least m = {m} tokens; got {n}")
    k_c, v_c = compress(k, m), compress(v, m)  # (B, H, n // m, D)
    n_c = k_c.shape[2]
    scores = np.asarray(scores, dtype=float)
    if scores.shape != (B, n, n_c):
        raise ValueError(f"scores must be (B, n, n // m) = {(B, n, n_c)}; got {scores.shape}")
    complete = (np.arange(n_c)[None, :] + 1) * m - 1 <= np.arange(n)[:, None]  # (n, n_c)
    chosen = top_k_keys(scores, top_k, visible=complete)

    def entries(b, h, q_idx, c_idx):
        return chosen[b, q_idx, c_idx]

    def recent(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx > q_idx - window)

    tiles = (min(16, n), min(16, n_c))
    mask_c = sdpa.create_block_mask(entries, B, None, n, n_c, BLOCK_SIZE=tiles)
    mask_w = sdpa.create_block_mask(recent, None, None, n, n, BLOCK_SIZE=min(16, n))
    out_c, lse_c = sdpa.flex_attention(q, k_c, v_c, block_mask=mask_c, return_lse=True)
    out_w, lse_w = sdpa.flex_attention(q, k, v, block_mask=mask_w, return_lse=True)
    out, lse = sdpa.merge_attention_states([out_c, out_w], [lse_c, lse_w])
    return out, lse, chosen
