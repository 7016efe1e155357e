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

import numpy as np

from ._checks import (
    ATTENTION_MASK_HINT,
    as_array,
    broadcasts_to,
    check_query_key_value,
    lse_dtype,
)
from .block_mask import FULL, PARTIAL, BlockMask, check_mod, evaluate_mask_mod, index_arrays
from .problem import AttentionProblem, prepare_attention

__all__: list[str] = []

SCORE_MOD_SIGNATURE = "score_mod(score, b, h, q_idx, kv_idx) -> array"


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


def mark_non_finite(call: FlexCall, out: np.ndarray, lse: np.ndarray) -> None:
    """NaN in, NaN out: set to NaN the rows of ``out`` and ``lse`` (in place) whose query holds
    NaN or inf or that may attend such a key, and the rows of ``out`` that may attend such a
    value, as :func:`sdpa.scaled_dot_product_attention` does (the inputs were zeroed there)."""
    problem = call.problem
    T, S = problem.T, problem.S
    bad_query = row_flags(problem.bad_query, call, T)
    if bad_query is not None:
        out[bad_query] = np.nan
        lse[bad_query] = np.nan
    for bad, with_lse in ((problem.bad_key, True), (problem.bad_value, False)):
        flags = row_flags(bad, call, S)
        if flags is None:
            continue
        reach = rows_reaching(call, flags)
        out[reach] = np.nan
        if with_lse:
            lse[reach] = np.nan


def is_empty(call: FlexCall) -> bool:
    return 0 in (call.B, call.Hq, call.problem.T, call.problem.S)


def finish(call: FlexCall, out: np.ndarray, lse: np.ndarray, return_lse: bool):
    """The caller's dtypes: ``out`` in the inputs' dtype, ``lse`` at least in float32."""
    mark_non_finite(call, out, lse)
    out = out.astype(call.problem.out_dtype, copy=False)
    if not return_lse:
        return out
    return out, lse.astype(lse_dtype(call.problem.out_dtype), copy=False)


def empty_result(call: FlexCall) -> tuple[np.ndarray, np.ndarray]:
    shape = (call.B, call.Hq, call.problem.T)
    out = np.zeros((*shape, call.problem.Dv), dtype=call.dtype)
    return out, np.full(shape, -np.inf, dtype=call.dtype)
