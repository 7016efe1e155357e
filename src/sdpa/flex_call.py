"""A call of :func:`sdpa.flex_attention`, validated, and what both of its paths share.

:func:`check_call` checks every argument up front and lays the arrays out as
:class:`FlexCall` does (query heads split into ``(Hkv, G)``); :func:`apply_score_mod` runs a
``score_mod`` on a block of scores, checked; :func:`finish` marks the rows that non-finite
inputs reach and returns the caller's dtypes.

Shape letters: ``B`` batch, ``Hq``/``Hkv`` query and key/value heads, ``G = Hq // Hkv``,
``T`` queries, ``S`` keys, ``Dk``/``Dv`` head widths.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ._checks import (
    ATTENTION_MASK_HINT,
    as_array,
    broadcasts_to,
    check_bool,
    check_query_key_value,
    lse_dtype,
)
from .block_mask import FULL, PARTIAL, BlockMask, check_mod, evaluate_mask_mod, index_arrays
from .problem import AttentionProblem, prepare_attention

__all__ = ["AuxOutput", "AuxRequest"]

SCORE_MOD_SIGNATURE = "score_mod(score, b, h, q_idx, kv_idx) -> array"


class AuxRequest(NamedTuple):
    """What :func:`sdpa.flex_attention` returns beside ``out`` when passed ``return_aux``.

    Parameters
    ----------
    lse : bool, default False
        The log-sum-exp of each row's modified, allowed scores.
    max_scores : bool, default False
        The largest modified, allowed score of each row.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa import AuxRequest, flex_attention
    >>> x = np.eye(2).reshape(1, 1, 2, 2)  # (B, H, T, D): two orthogonal keys
    >>> out, aux = flex_attention(x, x, x, scale=1.0, return_aux=AuxRequest(max_scores=True))
    >>> aux.lse is None, aux.max_scores  # q . k is 1 against its own key, 0 against the other
    (True, array([[[1., 1.]]]))
    """

    lse: bool = False
    max_scores: bool = False


class AuxOutput(NamedTuple):
    """The auxiliary results of :func:`sdpa.flex_attention`: each array asked for by an
    :class:`AuxRequest`, the others None.

    Parameters
    ----------
    lse : (B, Hq, T) np.ndarray or None
        Natural-log log-sum-exp of each row's modified, allowed scores; ``-inf`` for a row
        with none.
    max_scores : (B, Hq, T) np.ndarray or None
        The largest modified, allowed score of each row, in natural units (as ``lse``);
        ``-inf`` for a row with none.

    Examples
    --------
    >>> from sdpa import AuxOutput
    >>> AuxOutput()
    AuxOutput(lse=None, max_scores=None)
    """

    lse: np.ndarray | None = None
    max_scores: np.ndarray | None = None


def check_aux(return_aux, return_lse: bool) -> AuxRequest | None:
    """``return_aux`` checked: None or an :class:`AuxRequest` of two bools, not with
    ``return_lse``."""
    if return_aux is None:
        return None
    if not isinstance(return_aux, AuxRequest):
        raise TypeError(
            f"return_aux must be an sdpa.AuxRequest or None; got {type(return_aux).__name__}"
        )
    if return_lse:
        raise ValueError(
            "return_lse=True and return_aux ask for the lse twice: pass "
            "return_aux=AuxRequest(lse=True) alone"
        )
    return AuxRequest(
        check_bool(return_aux.lse, "return_aux.lse"),
        check_bool(return_aux.max_scores, "return_aux.max_scores"),
    )


@dataclass(frozen=True)
class FlexCall:
    """A validated call in one layout: query heads split into ``(Hkv, G)``.

    Without ``enable_gqa``, keys and values with one head shared by all query heads are
    ``Hkv = 1, G = Hq`` (the heads fold into one unit's rows); otherwise ``Hkv = Hq, G = 1``.
    """

    problem: AttentionProblem  # validation, dtypes, scale, non-finite rows
    query: np.ndarray  # (B, Hkv, G, T, Dk) view
    key: np.ndarray  # (B, Hkv, 1, S, Dk) view
    value: np.ndarray  # (B, Hkv, 1, S, Dv) view
    score_mod: Callable | None
    block_mask: BlockMask | None
    B: int
    Hkv: int
    G: int

    @property
    def Hq(self) -> int:
        return self.Hkv * self.G

    @property
    def dtype(self) -> np.dtype:
        return self.problem.work_dtype


def check_call(query, key, value, score_mod, block_mask, scale, enable_gqa) -> FlexCall:
    """Every check of a call, up front; the arrays in the layout of :class:`FlexCall`."""
    q, k, v = check_query_key_value(query, key, value, masked_hint=ATTENTION_MASK_HINT)
    for name, a in (("query", q), ("key", k), ("value", v)):
        if a.ndim != 4:
            raise ValueError(
                f"{name} must be 4-D (B, H, L, D), as in torch's flex_attention; "
                f"got {name}.shape={a.shape}"
            )
    if score_mod is not None:
        check_mod(score_mod, "score_mod", SCORE_MOD_SIGNATURE)
    if block_mask is not None and not isinstance(block_mask, BlockMask):
        raise TypeError(
            "block_mask must be a BlockMask made by sdpa.create_block_mask, or None; "
            f"got {type(block_mask).__name__}"
        )
    problem = prepare_attention(q, k, v, None, False, scale=scale, enable_gqa=enable_gqa)
    T, S, Dk = problem.T, problem.S, problem.Dk
    B = problem.batch_shape[0]
    k, v = problem.key, problem.value
    if problem.groups is not None:  # (B, Hkv, G): the grouped layout already
        _, Hkv, G = problem.batch_shape
    elif k.shape[1] == 1 and v.shape[1] == 1:
        Hkv, G = 1, problem.batch_shape[1]  # every query head shares the one key head
    else:
        Hkv, G = problem.batch_shape[1], 1
    if problem.groups is None:  # add the axis of length G (queries) or 1 (keys and values)
        query = np.broadcast_to(problem.query, (B, Hkv * G, T, Dk)).reshape(B, Hkv, G, T, Dk)
        keys = [np.broadcast_to(a, (B, Hkv, S, a.shape[-1]))[:, :, None] for a in (k, v)]
    else:
        query = np.broadcast_to(problem.query, (B, Hkv, G, T, Dk))
        keys = [np.broadcast_to(a, (B, Hkv, 1, S, a.shape[-1])) for a in (k, v)]
    call = FlexCall(problem, query, keys[0], keys[1], score_mod, block_mask, B, Hkv, G)
    if block_mask is not None:
        check_fit(block_mask, call)
    return call


def check_fit(block_mask: BlockMask, call: FlexCall) -> None:
    Bm, Hm, T, S = block_mask.shape
    wanted = (call.B, call.Hq, call.problem.T, call.problem.S)
    if (T, S) != wanted[2:] or Bm not in (1, call.B) or Hm not in (1, call.Hq):
        raise ValueError(
            f"block_mask must fit the call: its shape (B, H, Q_LEN, KV_LEN) = "
            f"{block_mask.shape} against the call's (B, Hq, T, S) = {wanted}, where B and H "
            "may also be 1 (a mask created with None)"
        )


def apply_score_mod(call: FlexCall, scores: np.ndarray, b, h, q_idx, kv_idx) -> np.ndarray:
    """``score_mod`` on 4-D ``scores`` ``(n_b, n_h, n_q, n_kv)`` (an array the caller owns)
    and its index arrays, checked: ``scores``, holding the modified scores in the working dtype.

    The result is copied into ``scores`` unless it is ``scores`` itself: the tiled path writes
    into what this returns, and whatever else the mod returned may be the caller's (a stored
    bias, a view of one), which must not change. One pass over the tile, as a cast would be."""
    result = call.score_mod(scores, *index_arrays(b, h, q_idx, kv_idx))
    result = as_array(result, "score_mod's result")
    if result.dtype.kind not in "fiu":
        raise TypeError(
            f"score_mod must return real scores (a float array); got dtype {result.dtype}"
        )
    if not broadcasts_to(result.shape, scores.shape):
        raise ValueError(
            f"score_mod must return an array of the shape of its scores {scores.shape} (or one "
            f"that broadcasts to it); got shape {result.shape}"
        )
    if result is not scores:
        with np.errstate(over="ignore"):  # a score beyond the dtype's range is +-inf, as cast
            np.copyto(scores, result, casting="unsafe")  # broadcast, cast to the working dtype
    return scores


def row_flags(bad: np.ndarray | None, call: FlexCall, length: int) -> np.ndarray | None:
    """``(B, Hq, length)`` bool from the problem's flags of non-finite rows, or None."""
    if bad is None:
        return None
    full = np.broadcast_to(bad, (*call.problem.batch_shape, length))
    return full.reshape(call.B, call.Hq, length)


def rows_reaching(call: FlexCall, flags: np.ndarray) -> np.ndarray:
    """``(B, Hq, T)`` bool: the query rows that may attend a key flagged in ``flags``
    ``(B, Hq, S)``. ``mask_mod`` is called on the flagged keys' entries in partial blocks only,
    so never on an empty block."""
    T = call.problem.T
    bm = call.block_mask
    if bm is None:
        return np.broadcast_to(flags.any(axis=-1)[..., None], (call.B, call.Hq, T))
    reach = np.zeros((call.B, call.Hq, T), dtype=bool)
    block_q, block_kv = bm.BLOCK_SIZE
    for j in np.flatnonzero(flags.any(axis=(0, 1))):
        for mb, mh in np.ndindex(*bm.shape[:2]):
            kinds = np.repeat(bm.kinds[mb, mh, :, j // block_kv], block_q)[:T]  # (T,)
            allowed = kinds == FULL
            rows = np.flatnonzero(kinds == PARTIAL)
            if rows.size:
                allowed[rows] = evaluate_mask_mod(bm.mask_mod, [mb], [mh], rows, [j])[0, 0, :, 0]
            b = slice(None) if bm.shape[0] == 1 else mb
            h = slice(None) if bm.shape[1] == 1 else mh
            reach[b, h] |= allowed & flags[b, h, j][..., None]
    return reach


def mark_non_finite(call: FlexCall, out: np.ndarray, lse: np.ndarray, top=None) -> None:
    """NaN in, NaN out: set to NaN the rows of ``out`` and ``lse`` (in place) whose query holds
    NaN or inf or that may attend such a key, and the rows of ``out`` that may attend such a
    value, as :func:`sdpa.scaled_dot_product_attention` does (the inputs were zeroed there).
    The row maxima ``top`` (or None), as ``lse``."""
    problem = call.problem
    T, S = problem.T, problem.S
    stats = [lse] if top is None else [lse, top]
    bad_query = row_flags(problem.bad_query, call, T)
    if bad_query is not None:
        out[bad_query] = np.nan
        for a in stats:
            a[bad_query] = np.nan
    for bad, with_lse in ((problem.bad_key, True), (problem.bad_value, False)):
        flags = row_flags(bad, call, S)
        if flags is None:
            continue
        reach = rows_reaching(call, flags)
        out[reach] = np.nan
        if with_lse:
            for a in stats:
                a[reach] = np.nan


def is_empty(call: FlexCall) -> bool:
    return 0 in (call.B, call.Hq, call.problem.T, call.problem.S)


def finish(call: FlexCall, result: tuple, return_lse: bool, aux: AuxRequest | None = None):
    """The caller's results from ``(out, lse, top)`` (``top`` the row maxima, or None) in the
    caller's dtypes: ``out`` in the inputs' dtype, ``lse`` and ``top`` at least in float32;
    ``out``, ``(out, lse)`` or ``(out, AuxOutput)``."""
    out, lse, top = result
    mark_non_finite(call, out, lse, top)
    out = out.astype(call.problem.out_dtype, copy=False)
    dtype = lse_dtype(call.problem.out_dtype)
    if aux is not None:
        return out, AuxOutput(
            lse.astype(dtype, copy=False) if aux.lse else None,
            top.astype(dtype, copy=False) if aux.max_scores else None,
        )
    if not return_lse:
        return out
    return out, lse.astype(dtype, copy=False)


def empty_result(call: FlexCall) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(out, lse, top)`` of a call with no query, key, head or batch entry."""
    shape = (call.B, call.Hq, call.problem.T)
    out = np.zeros((*shape, call.problem.Dv), dtype=call.dtype)
    return out, np.full(shape, -np.inf, dtype=call.dtype), np.full(shape, -np.inf, call.dtype)
