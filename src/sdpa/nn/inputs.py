"""Checks of what a :class:`sdpa.nn.DecoderLM` is given at call time: tokens, targets, masks and
the result of a ``kv_transform``. Each raises with the argument's name, what was expected and
what was given; the model's own options are checked once, in :class:`sdpa.nn.DecoderConfig`.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from .._checks import check_bool
from .config import DecoderConfig

__all__: list[str] = []  # the model's own machinery: no public names


def check_tokens(tokens: ArrayLike, name: str, config: DecoderConfig) -> tuple[np.ndarray, bool]:
    """Tokens as a ``(B, T)`` integer array, and whether a 1-D ``(T,)`` was given."""
    arr = np.asarray(tokens)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array of token ids; got dtype {arr.dtype}")
    if arr.ndim not in (1, 2) or arr.shape[-1] == 0:
        raise ValueError(
            f"{name} must have shape (T,) or (B, T) with T >= 1; got {name}.shape={arr.shape}"
        )
    if arr.shape[-1] > config.max_len:
        raise ValueError(
            f"{name} holds T={arr.shape[-1]} tokens, more than max_len={config.max_len}"
        )
    V = config.vocab_size
    if arr.size and (arr.min() < 0 or arr.max() >= V):
        bad = arr[(arr < 0) | (arr >= V)].flat[0]
        raise ValueError(f"{name} must hold token ids in [0, vocab_size={V}); got {bad}")
    return (arr[None] if arr.ndim == 1 else arr), arr.ndim == 1


def check_targets(targets: ArrayLike, tokens: np.ndarray) -> np.ndarray:
    """Targets as a ``(B, T)`` integer array of the checked ``tokens``' shape (their range is
    checked by :func:`sdpa.nn.cross_entropy`)."""
    targets = np.asarray(targets)
    if targets.dtype.kind not in "iu":
        raise TypeError(f"targets must be an integer array of token ids; got dtype {targets.dtype}")
    if targets.ndim == 1:
        targets = targets[None]
    if targets.shape != tokens.shape:
        raise ValueError(
            f"targets must have the shape of tokens, {tokens.shape}; got {targets.shape}"
        )
    return targets


def check_flags(kv_transform=None, **flags) -> None:
    """Each of ``flags`` a bool; ``kv_transform`` None or callable."""
    for name, flag in flags.items():
        check_bool(flag, name)
    if kv_transform is not None and not callable(kv_transform):
        raise TypeError(f"kv_transform must be callable; got {kv_transform!r:.80}")


def check_attn_mask(attn_mask, T: int) -> np.ndarray | None:
    """A boolean ``(T, T)`` mask that, with the causal mask, leaves every query a key."""
    if attn_mask is None:
        return None
    mask = np.asarray(attn_mask)
    if mask.dtype != bool or mask.shape != (T, T):
        raise ValueError(
            f"attn_mask must be a boolean (T, T) = ({T}, {T}) array; got "
            f"dtype {mask.dtype}, shape {mask.shape}"
        )
    if not (mask & np.tril(np.ones_like(mask))).any(axis=1).all():
        raise ValueError("attn_mask leaves a query no key at or before it (with the causal mask)")
    return mask


def checked_kv(kv_transform, i: int, k: np.ndarray, v: np.ndarray, dtype: np.dtype):
    """``kv_transform(i, k, v)`` on copies, checked: new arrays of the same shapes."""
    result = kv_transform(i, k.copy(), v.copy())
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError(f"kv_transform must return a (keys, values) pair; got {result!r:.80}")
    new_k, new_v = (np.asarray(a, dtype=dtype) for a in result)
    if new_k.shape != k.shape or new_v.shape != v.shape:
        raise ValueError(
            f"kv_transform must keep the shapes {k.shape} and {v.shape}; got "
            f"{new_k.shape} and {new_v.shape}"
        )
    return new_k, new_v
